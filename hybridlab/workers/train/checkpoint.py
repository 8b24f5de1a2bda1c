"""Layout-independent checkpoints of a training role, and plain HF export.

A checkpoint directory is an ordinary Hugging Face checkpoint (config, tokenizer,
``model.safetensors`` in HF names; a LoRA actor's holds its adapter in PEFT's format instead)
plus ``optimizer/adamw.safetensors`` (AdamW moments in the same names and layout) and
``trainer_state.json`` (step counters, RNG); the moments sit in a subfolder because vLLM loads
every ``*.safetensors`` at the top of a model directory. Because every tensor is stored in HF
layout, a run saved at TP=2 resumes at TP=1 or any other layout. Directories are written
beside the target and renamed into place, so a crash never leaves half a checkpoint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hybridlab.atomic import atomic_model_dir

OPTIMIZER_FILE = "optimizer/adamw.safetensors"
# a LoRA actor's checkpoint holds its adapter in PEFT's format (PeftModel.from_pretrained reads it)
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")


STATE_KEYS = ("model", "exp_avg", "exp_avg_sq")


def merge_state(parts: list[dict | None]) -> dict[str, dict[str, torch.Tensor]]:
    """Return a role's ``checkpoint_state`` parts (one per pipeline stage, None elsewhere)
    merged per key: ``{"model" | "exp_avg" | "exp_avg_sq": {HF name: tensor}}``."""
    merged: dict[str, dict[str, torch.Tensor]] = {key: {} for key in STATE_KEYS}
    for part in parts:
        for key in STATE_KEYS:
            if part and part.get(key):
                merged[key].update(part[key])
    return merged


def _write(out: Path, source_dir: Path, tensors: dict[str, dict[str, torch.Tensor]], state: dict | None,
           adapter_config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    with atomic_model_dir(out) as tmp:
        for name in COPIED:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, tmp / name)
        for filename, named in tensors.items():
            (tmp / filename).parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in named.items()}, str(tmp / filename))
        if state is not None:
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        if adapter_config is not None:
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=1))
    return Path(out)


def export_hf(group, source_dir: str | Path, out: str | Path) -> Path:
    """Write the role's current weights as a plain HF checkpoint directory; returns its path."""
    weights = {}
    for part in group.export_hf():
        if part:
            weights.update(part)
    model = {k: v for k, v in weights.items() if not k.startswith("value_head.")}
    files = {"model.safetensors": model}
    heads = {k: v for k, v in weights.items() if k.startswith("value_head.")}
    if heads:
        files["value_head.safetensors"] = heads
    return _write(Path(out), Path(source_dir), files, None)


def save_checkpoint(group, source_dir: str | Path, out: str | Path) -> Path:
    """Save weights, AdamW moments, step and RNG of a training role; returns the directory."""
    parts = group.checkpoint_state()
    merged = merge_state(parts)
    model = merged["model"]
    first = next(p for p in parts if p)
    adapter_config = first.get("adapter_config")
    files = {ADAPTER_FILE if adapter_config else "model.safetensors":
             {k: v for k, v in model.items() if not k.startswith("value_head.")}}
    heads = {k: v for k, v in model.items() if k.startswith("value_head.")}
    if heads:
        files["value_head.safetensors"] = heads
    moments = {m: merged[m] for m in ("exp_avg", "exp_avg_sq")}
    if moments["exp_avg"]:
        files[OPTIMIZER_FILE] = {f"{m}/{k}": v for m, named in moments.items() for k, v in named.items()}
    state = {"step": first["step"], "adam_step": first.get("adam_step", 0.0),
             "rng": first["rng"].tolist()}
    return _write(Path(out), Path(source_dir), files, state, adapter_config)


def load_optimizer(group, checkpoint_dir: str | Path) -> int:
    """Load a checkpoint's optimizer moments and step counter into a role started from that
    checkpoint's weights (any layout); returns the restored step."""
    from safetensors.torch import load_file

    checkpoint_dir = Path(checkpoint_dir)
    state = json.loads((checkpoint_dir / "trainer_state.json").read_text())
    moments: dict[str, dict[str, torch.Tensor]] = {}
    if (checkpoint_dir / OPTIMIZER_FILE).is_file():
        for key, value in load_file(str(checkpoint_dir / OPTIMIZER_FILE)).items():
            moment, name = key.split("/", 1)
            moments.setdefault(moment, {})[name] = value
    group.load_optimizer_state(moments, state["step"], state["adam_step"], state.get("rng"))
    return state["step"]
