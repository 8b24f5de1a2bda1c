"""``hybridlab calibrate``: measure this machine's device profile for the cost model.

    hybridlab calibrate --json                  # measure and save ~/.cache/hybridlab/profiles/local.json

Each figure is measured on one device's share of the cores (``cores_per_device``: the usable
cores over the devices, as thread binding deals them out):

- matmul FLOP/s in fp32 and bf16 (square matmuls), and memory bandwidth (a streaming copy);
- the all-reduce latency and bandwidth between two processes over gloo on loopback, and a
  round trip between two processes through shared memory (what vLLM's TP all-reduce rests on);
- vLLM prefill and decode on a zoo model (``engine_model``) at a few batch sizes;
- forward and training (forward, backward, AdamW) tokens/s of transformers models of a few sizes;
- one worker call through the controller and Ray (a no-op DP call with a small Batch).

The fit (``fit_profile``) keeps the roofline terms the matmul and bandwidth figures give and
puts what the measurements add on top into the overhead terms (never below zero), so that one
calibration on small models predicts others; the raw measurements stay in ``measured``.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

import torch

from hybridlab.advisor.profile import LOCAL, DeviceProfile
from hybridlab.bench.dispatch import NoopWorker
from hybridlab.bench.profile import matmul_gflops
from hybridlab.controller.binding import pin_process, set_threads
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.environment import processor, usable_cores
from hybridlab.explain import parameter_count
from hybridlab.models.zoo import model_config, parse_preset, resolve_model
from hybridlab.protocol import Batch
from hybridlab.workers.rollout.sampling import SamplingConfig

ALLREDUCE_SIZES = (4 << 10, 16 << 20)


def median_seconds(fn, repeats: int) -> float:
    """Return the median seconds of ``repeats`` calls of ``fn`` after one untimed warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _bandwidth(threads: int, mb: int = 256, seconds: float = 0.5) -> float:
    """Return bytes/s of a streaming copy (read and write counted) on ``threads`` threads."""
    torch.set_num_threads(threads)
    a = torch.ones(mb << 18)  # mb MB of float32
    b = torch.empty_like(a)
    b.copy_(a)
    count, start = 0, time.perf_counter()
    while count < 2 or time.perf_counter() - start < seconds:
        b.copy_(a)
        count += 1
    return 2 * a.nbytes * count / (time.perf_counter() - start)


def _allreduce_worker(rank: int, port: int, threads: int, repeats: int, out) -> None:
    import torch.distributed as dist

    _pin(rank, threads)  # each rank on its own device's cores, as bound workers run
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for size in ALLREDUCE_SIZES:
        x = torch.ones(size // 4)
        times[size] = median_seconds(lambda: dist.all_reduce(x), repeats)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def _two_ranks(target, *args):
    """Run ``target(rank, *args, out)`` in two fresh processes; returns what rank 0 puts in ``out``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=120)
    finally:  # a rank that died or hung leaves nothing behind
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def _allreduce(threads: int, repeats: int = 10) -> dict[int, float]:
    """Return bytes -> median seconds of a 2-process gloo all-reduce on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _two_ranks(_allreduce_worker, port, threads, repeats)


def _exchange_worker(rank: int, name: str, threads: int, repeats: int, out) -> None:
    from multiprocessing import shared_memory

    import numpy as np

    _pin(rank, threads)
    shm = shared_memory.SharedMemory(name=name)
    flags = np.ndarray((2,), dtype=np.int64, buffer=shm.buf)
    times = []
    for i in range(1, repeats + 1):  # rank 0 raises a flag, rank 1 answers: one round trip
        if rank == 0:
            start = time.perf_counter()
            flags[0] = i
            while flags[1] != i:
                pass
            times.append(time.perf_counter() - start)
        else:
            while flags[0] != i:
                pass
            flags[1] = i
    if rank == 0:
        out.put(statistics.median(times))
    del flags
    shm.close()


def _shared_memory_exchange(threads: int, repeats: int = 2000) -> float:
    """Return the median seconds of a round trip between two processes on two devices through
    shared memory: the latency floor of a shared-memory all-reduce (vLLM's TP on a CPU node)."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=16)
    try:
        shm.buf[:16] = bytes(16)
        return _two_ranks(_exchange_worker, shm.name, threads, repeats)
    finally:
        shm.close()
        shm.unlink()


def _pin(device: int, threads: int) -> None:
    """Pin this process to device ``device``'s cores (``threads`` of them, in order), as
    ``trainer.bind_threads`` pins a worker; no pinning where the platform cannot."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    mine = cores[device * threads:(device + 1) * threads]
    if mine:
        pin_process(mine)
    set_threads(threads)


def _engine(model: str, threads: int, batches: tuple[int, ...], new_tokens: int, prompt_len: int) -> dict:
    """Return vLLM's measured prefill seconds per prompt token and decode seconds per step at
    each batch size (two lengths of generation differenced, so the prefill cancels)."""
    from hybridlab.workers.rollout import vllm_engine

    model_dir = str(resolve_model(model))
    llm = vllm_engine.start_llm(model_dir, prompt_len + new_tokens + 8, 64, "float32", 0)
    g = torch.Generator().manual_seed(0)
    try:
        def timed(prompts: list[list[int]], tokens: int) -> float:
            cfg = SamplingConfig(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0)
            start = time.perf_counter()
            vllm_engine.generate(llm, prompts, cfg, [])
            return time.perf_counter() - start

        timed([[5] * prompt_len], 2)  # warm-up
        decode: dict[str, float] = {}
        for b in batches:
            prompts = torch.randint(3, 300, (b, prompt_len), generator=g).tolist()
            short, long = timed(prompts, 1), timed(prompts, new_tokens + 1)
            decode[str(b)] = max(0.0, (long - short) / new_tokens)  # str keys: as JSON reads them back
        big = max(batches)
        prompts = torch.randint(3, 300, (big, prompt_len), generator=g).tolist()
        prefill = timed(prompts, 1) / (big * prompt_len)
    finally:
        vllm_engine.close_llm(llm)
    return {"model": model, "params": parameter_count(model_dir), "prompt_len": prompt_len,
            "decode_step_s": decode, "prefill_token_s": prefill}


def _training(presets: tuple[str, ...], threads: int, rows: int, seq: int, steps: int) -> list[dict]:
    """Return, per zoo preset (a transformers model built in memory, random weights), its
    parameters and median seconds per token of a forward pass and of a training step."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    out = []
    for name in presets:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(*parse_preset(name)))
        ids = torch.randint(3, model.config.vocab_size, (rows, seq))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def forward() -> torch.Tensor:
            return torch.log_softmax(model(input_ids=ids).logits.float(), -1).mean()

        def train() -> None:
            opt.zero_grad()
            (-forward()).backward()
            opt.step()

        times = {kind: median_seconds(fn, steps) / (rows * seq)
                 for kind, fn in (("forward", lambda: torch.no_grad()(forward)()), ("train", train))}
        out.append({"model": name, "params": sum(p.numel() for p in model.parameters()),
                    "forward_token_s": times["forward"], "train_token_s": times["train"]})
    return out


def _call_overhead(repeats: int = 30) -> float:
    """Return the median seconds of a no-op DP call with a small Batch through the controller
    to one worker process (Ray attached or started here)."""
    connect(num_gpus=1)
    mapping = DeviceMapping.from_dict({"pools": {"calibrate": {"devices": 1, "cpus_per_device": 0}},
                                       "roles": {"actor": {"pool": "calibrate"}}})
    batch = Batch({"x": torch.zeros(64, 128)})
    with WorkerSet(mapping, {"actor": NoopWorker}) as session:
        return median_seconds(lambda: session.groups["actor"].consume(batch), repeats)


def _line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Return (intercept, slope) of the least-squares line through the points (one point: the
    line through the origin)."""
    if len(set(xs)) < 2:
        return 0.0, sum(ys) / max(sum(xs), 1e-30)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def _positive_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Return (intercept, slope) of the least-squares line with neither below zero: a negative
    one is set to zero and the other fitted again alone."""
    intercept, slope = _line_fit(xs, ys)
    if intercept < 0:
        intercept, slope = 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    elif slope < 0:
        intercept, slope = max(0.0, sum(ys) / len(ys)), 0.0
    return intercept, slope


def _fit_through(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Return (overhead, efficiency) of ``y = overhead + x / efficiency`` (overhead >= 0, efficiency <= 1)."""
    overhead, slope = _positive_line(xs, ys)
    return overhead, min(1.0, 1.0 / slope) if slope > 0 else 1.0


def fit_profile(measured: dict, name: str = LOCAL) -> DeviceProfile:
    """Return the DeviceProfile that ``measured`` (what ``measure`` returns) implies: the roofline
    terms from the matmul and bandwidth figures, the rest fitted into the overheads."""
    flops, bandwidth = measured["matmul_gflops"]["float32"] * 1e9, measured["bandwidth_gbps"] * 1e9
    (s1, t1), (s2, t2) = sorted((int(k), v) for k, v in measured["allreduce_s"].items())
    link = (s2 - s1) / max(t2 - t1, 1e-9)
    engine = measured["engine"]
    p = engine["params"]
    decode = {int(b): s for b, s in engine["decode_step_s"].items()}  # JSON keys are strings
    batches = sorted(decode)
    residual = [decode[b] - p * 4 / bandwidth - b * 2 * p / flops for b in batches]
    step_overhead, token_overhead = _positive_line([float(b) for b in batches], residual)
    train = measured["training"]
    fwd = _fit_through([2 * t["params"] / flops for t in train], [t["forward_token_s"] for t in train])
    trn = _fit_through([6 * t["params"] / flops for t in train], [t["train_token_s"] for t in train])
    when = measured["date"]
    return DeviceProfile(
        name=name, kind="cpu", processor=measured["processor"], dtype="float32", flops=flops, bandwidth=bandwidth,
        memory_gb=measured["memory_gb"], memory_shared=True, collective_latency_s=max(0.0, t1 - s1 / link),
        collective_gbps=link, engine_collective_latency_s=measured["shared_memory_exchange_s"],
        decode_overhead_s=max(0.0, step_overhead), decode_token_s=max(0.0, token_overhead),
        prefill_token_s=max(0.0, engine["prefill_token_s"] - 2 * p / flops), forward_token_s=fwd[0],
        forward_efficiency=fwd[1], train_token_s=trn[0], train_efficiency=trn[1],
        call_overhead_s=measured["call_overhead_s"], cores_per_device=measured["cores_per_device"],
        devices=measured["devices"], measured=measured,
        sources={"all": f"hybridlab calibrate on {measured['processor']}, {when}: {measured['cores_per_device']}"
                        f" core(s) per device; vLLM on {engine['model']}, transformers on"
                        f" {', '.join(t['model'] for t in train)} (measured holds the raw figures)"})


def _memory_gb() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return round(kb / 2**20, 1)


def measure(devices: int = 0, engine_model: str = "small", batches: tuple[int, ...] = (1, 8, 32),
            new_tokens: int = 32, train_models: tuple[str, ...] = ("tiny", "small", "mid"), train_rows: int = 8,
            train_seq: int = 64, steps: int = 3, progress=print) -> dict:
    """Return this machine's raw measurements (see the module docstring) for ``devices`` devices
    (default: one per usable core); ``progress(text)`` reports each part as it starts."""
    cores = usable_cores()
    devices = devices or cores
    threads = max(1, cores // devices)
    out = {"processor": processor(), "date": datetime.date.today().isoformat(), "devices": devices,
           "cores_per_device": threads, "memory_gb": _memory_gb()}
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    torch_threads = torch.get_num_threads()
    try:
        _measure_on_device(out, threads, engine_model, batches, new_tokens, train_models, train_rows, train_seq,
                           steps, progress)
    finally:  # this process gets its cores and threads back
        if allowed:
            pin_process(allowed)
        torch.set_num_threads(torch_threads)
    progress("a worker call through the controller")
    out["call_overhead_s"] = _call_overhead()
    return out


def _measure_on_device(out: dict, threads: int, engine_model: str, batches: tuple[int, ...], new_tokens: int,
                       train_models: tuple[str, ...], train_rows: int, train_seq: int, steps: int, progress) -> None:
    """Fill ``out`` with what is measured on one device's cores (this process pinned to them)."""
    progress("all-reduce between two processes (gloo, loopback)")  # before pinning: its ranks pin themselves
    out["allreduce_s"] = {str(k): v for k, v in _allreduce(threads).items()}
    out["shared_memory_exchange_s"] = _shared_memory_exchange(threads)
    _pin(0, threads)
    progress("matmul and memory bandwidth")
    out["matmul_gflops"] = {"float32": round(matmul_gflops(torch.float32, threads), 2),
                            "bfloat16": round(matmul_gflops(torch.bfloat16, threads), 2)}
    out["bandwidth_gbps"] = round(_bandwidth(threads) / 1e9, 3)
    progress(f"vLLM prefill and decode on {engine_model} at batch sizes {list(batches)}")
    out["engine"] = _engine(engine_model, threads, batches, new_tokens, 16)
    progress(f"training and forward tokens/s of {', '.join(train_models)}")
    out["training"] = _training(train_models, threads, train_rows, train_seq, steps)


def calibrate(name: str = LOCAL, out: str | None = None, progress=print, **options) -> dict:
    """Measure this machine, fit and save its profile; returns ``{"path", "profile"}`` (the JSON form)."""
    profile = fit_profile(measure(progress=progress, **options), name)
    path = profile.save(out)
    return {"path": str(path), "profile": profile.to_dict()}
