"""DeviceProfile: what one device of a machine can do, as the cost model needs it.

A profile is measured on this machine by ``hybridlab calibrate`` (``advisor/calibrate.py``)
or comes from a GPU kind's vendor peaks (``GPU_PROFILES``). Every figure is per device: for a
CPU machine a "device" is the share of its cores one logical GPU stands for (``cores_per_device``,
the binding of ``controller/binding.py``).

The cost model reads a primitive as a roofline plus a measured overhead, so that one calibration
on a small model predicts larger ones:

- a decode step of a batch of ``b`` sequences of a ``P``-parameter model:
  ``decode_overhead_s + b * decode_token_s + P * bytes / bandwidth + b * 2P / flops``;
- a prefill per prompt token: ``prefill_token_s + 2P / flops``;
- a forward pass per token (log-probs): ``forward_token_s + 2P / (flops * forward_efficiency)``;
- a training token (forward, backward, optimizer): ``train_token_s + 6P / (flops * train_efficiency)``;
- an all-reduce of ``n`` bytes between two devices: ``collective_latency_s + n / collective_gbps``
  (the training backend's: gloo or nccl); the rollout engine's TP all-reduces:
  ``engine_collective_latency_s + n / bandwidth`` (vLLM's shared-memory communicator on a CPU node).

``sources`` names where each figure comes from: the calibration run (processor, command, date)
or a vendor datasheet and the assumption made on top of it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hybridlab.errors import UserError
from hybridlab.models.zoo import home


def profile_dir() -> Path:
    """Return where profiles are saved: ``profiles/`` in hybridlab's cache folder (``$HYBRIDLAB_HOME``)."""
    return home() / "profiles"

LOCAL = "local"  # the name ``hybridlab calibrate`` saves this machine's profile under


@dataclasses.dataclass
class DeviceProfile:
    """One device's throughput and overheads; see the module docstring for how they combine."""

    name: str
    kind: str                     # "cpu" or "gpu"
    processor: str
    dtype: str                    # the precision the figures are for: float32 or bfloat16
    flops: float                  # dense matmul FLOP/s in ``dtype``
    bandwidth: float              # memory bytes/s (a streaming copy)
    memory_gb: float              # per device; on a CPU machine the node's memory, shared (``memory_shared``)
    collective_latency_s: float
    collective_gbps: float        # all-reduce bytes/s between two devices (the backend's bus bandwidth)
    engine_collective_latency_s: float  # the rollout engine's TP all-reduce (vLLM's own communicator)
    decode_overhead_s: float      # per decode step, beyond the roofline (scheduling, sampling, Python)
    decode_token_s: float         # per sequence of a decode step, beyond the roofline
    prefill_token_s: float        # per prompt token of a prefill, beyond the roofline
    forward_token_s: float        # per token of a forward pass, beyond the roofline
    forward_efficiency: float     # fraction of ``flops`` a forward pass reaches on its matmuls
    train_token_s: float
    train_efficiency: float
    call_overhead_s: float        # one worker call through Ray (dispatch, serialization), per stage
    memory_shared: bool = False
    cores_per_device: int = 0
    devices: int = 0              # devices on the calibrated node (0: a GPU kind, any count)
    measured: dict = dataclasses.field(default_factory=dict)   # the raw measurements behind the fit
    sources: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        """Return the profile as plain data (its JSON form)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        """Return a profile from its JSON form; unknown or missing fields are errors naming them."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if unknown or missing:
            raise UserError(f"device profile {data.get('name', '?')!r}: unknown field(s) {unknown or 'none'},"
                            f" missing field(s) {missing or 'none'}; a profile has: {', '.join(sorted(fields))}")
        return cls(**data)

    def save(self, path: str | Path | None = None) -> Path:
        """Write the profile as JSON (default: ``profile_dir()/NAME.json``); returns the path."""
        path = Path(path) if path else profile_dir() / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)
        return path


def _gpu(name: str, tflops: float, tbps: float, memory_gb: float, link_gbps: float, sheet: str) -> DeviceProfile:
    """Return a GPU kind's profile from its datasheet peaks and the stated efficiency assumptions."""
    return DeviceProfile(
        name=name, kind="gpu", processor=f"NVIDIA {name.upper()} SXM", dtype="bfloat16", flops=tflops * 1e12,
        bandwidth=tbps * 1e12 * 0.8, memory_gb=memory_gb, collective_latency_s=20e-6,
        engine_collective_latency_s=20e-6,
        collective_gbps=link_gbps * 1e9 * 0.8, decode_overhead_s=4e-3, decode_token_s=0.0, prefill_token_s=0.0,
        forward_token_s=0.0,
        forward_efficiency=0.5, train_token_s=0.0, train_efficiency=0.4, call_overhead_s=0.05,
        sources={
            "flops, bandwidth, memory_gb, collective_gbps": f"{sheet} (dense bf16 without sparsity; HBM; NVLink"
                                                            " per direction)",
            "bandwidth": "80% of the datasheet's HBM figure: what a streaming copy reaches (assumed)",
            "collective_gbps": "80% of NVLink's per-direction bandwidth as NCCL all-reduce bus bandwidth (assumed)",
            "collective_latency_s, engine_collective_latency_s": "20 us per NCCL all-reduce of a few KB within a"
                                                                 " node (assumed)",
            "train_efficiency": "0.4 of peak (assumed): below the 52% of peak Megatron-LM reached for GPT models on"
                                " A100 (Narayanan et al., SC21), for RL's shorter sequences and smaller batches",
            "forward_efficiency": "0.5 of peak for log-prob passes (no backward; assumed)",
            "decode_overhead_s": "4 ms per vLLM decode step (scheduling, sampling, CUDA graph launch; assumed)",
            "call_overhead_s": "50 ms per worker call through Ray at GPU batch sizes (assumed)"})


GPU_PROFILES = {
    "h100": _gpu("h100", 989.4, 3.35, 80, 450, "NVIDIA H100 SXM datasheet: 989.4 TFLOPS bf16, 3.35 TB/s, 80 GB,"
                                              " NVLink 900 GB/s bidirectional"),
    "h200": _gpu("h200", 989.4, 4.8, 141, 450, "NVIDIA H200 SXM datasheet: 989.4 TFLOPS bf16, 4.8 TB/s, 141 GB,"
                                              " NVLink 900 GB/s bidirectional"),
    "a100": _gpu("a100", 312.0, 2.039, 80, 300, "NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS bf16, 2.039 TB/s,"
                                               " 80 GB, NVLink 600 GB/s bidirectional"),
    "h20": _gpu("h20", 148.0, 4.0, 96, 450, "NVIDIA H20 datasheet: 148 TFLOPS bf16, 4.0 TB/s, 96 GB,"
                                           " NVLink 900 GB/s bidirectional"),
}


def load_profile(name_or_path: str | Path | None = None) -> DeviceProfile:
    """Return a profile: a GPU kind (h100, h200, a100, h20), a JSON file, or a saved profile's name
    (default: this machine's, which ``hybridlab calibrate`` writes). Raises UserError saying
    how to get one when there is none."""
    name = str(name_or_path or LOCAL)
    if name.lower() in GPU_PROFILES:
        return dataclasses.replace(GPU_PROFILES[name.lower()])
    path = Path(name)
    if not path.suffix:
        path = profile_dir() / f"{name}.json"
    if not path.is_file():
        kinds = ", ".join(GPU_PROFILES)
        raise UserError(f"no device profile {name!r} (looked for {path}); run `hybridlab calibrate` to measure this"
                        f" machine, or name a GPU kind ({kinds}) or a profile JSON file")
    try:
        return DeviceProfile.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise UserError(f"device profile {path} is not valid JSON: {exc}") from None
