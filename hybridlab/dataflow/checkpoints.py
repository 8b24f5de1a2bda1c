"""Checkpoints of a whole RL run, and resuming from them.

``RUN_DIR/checkpoints/step-000050/`` holds everything a run needs to go on as if it had never
stopped: each trainer role's weights and AdamW moments in HF layout with its step counter and
RNG (``actor/``, ``critic/``: the engine's layout-independent format, so a run saved at one
device mapping resumes at another), and ``session.json`` (the step, the prompt stream's
position, the KL controller, the evaluation curve so far, the metrics history, and how many
bytes of ``metrics.jsonl`` and ``telemetry.jsonl`` belong to steps up to this one), plus
``driver_rng.pt`` (Python, NumPy and torch RNG of the controller) and ``config.yaml`` (the config
as it was at that step, with every live update and remap).

A checkpoint is written into a temporary folder beside the others and renamed into place, so
a folder named ``step-N`` is always complete: a kill during the write leaves only a temporary
folder, which the next save or resume removes.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from hybridlab.atomic import write_json
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.dataflow.run_state import RunState, TrainProgress
from hybridlab.errors import UserError
from hybridlab.faults import fault_point
from hybridlab.telemetry.hub import TELEMETRY_FILE
from hybridlab.workers.train.checkpoint import ADAPTER_FILE, OPTIMIZER_FILE, save_checkpoint

if TYPE_CHECKING:
    from hybridlab.dataflow.session import RLSession

CHECKPOINTS = "checkpoints"
STATEFUL_ROLES = ("actor", "critic")
_NAME = re.compile(r"^step-(\d+)$")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Return the complete checkpoints of a run directory, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest(run_dir: Path) -> Path:
    """Return the newest complete checkpoint; raises UserError saying why there is none."""
    found = checkpoint_dirs(run_dir)
    if not Path(run_dir).is_dir():
        raise UserError(f"no run directory {str(run_dir)!r} to resume (hybridlab train prints it)")
    if not found:
        raise UserError(f"{run_dir} has no complete checkpoint to resume from; runs write one every"
                        " trainer.save_every steps, at the end and on a clean stop")
    return found[-1]


def save(rl: "RLSession", progress: TrainProgress | None) -> Path:
    """Write a checkpoint of ``rl`` after its current step; returns its folder. ``progress`` is
    what ``train()`` needs to go on (evaluation before, curve so far, seconds run)."""
    root = rl.run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    _remove_partial(root)
    target = root / f"step-{rl.state.step_count:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        for role in STATEFUL_ROLES:
            if role in rl.workers.groups:
                save_checkpoint(rl.workers.groups[role], rl.model_dir, tmp / role)
        fault_point("checkpoint_write", rl.state.step_count)
        torch.save({"python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state()},
                   tmp / "driver_rng.pt")
        # the config as it is now: live updates and remaps since the start carry over
        (tmp / "config.yaml").write_text(yaml.safe_dump(rl.cfg.to_dict(), sort_keys=False))
        write_json(tmp / "session.json", {
            **rl.state.record(progress), "time": time.time(), "mapping": rl.mapping.to_dict(),
            "metrics_bytes": rl.log.tell(), "telemetry_bytes": rl.telemetry.mark_checkpoint(rl.state.step_count)})
        if target.exists():  # the same step saved again (a stop right after a periodic save)
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoint_dirs(rl.run_dir)[:-rl.cfg.trainer.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def prepare_logs(run_dir: Path, checkpoint: Path, telemetry: bool = True) -> dict:
    """Cut ``metrics.jsonl`` (and ``telemetry.jsonl`` if ``telemetry``) back to what they held at
    the checkpoint (steps logged after it are run again) and remove unfinished checkpoint
    folders; returns the checkpoint's session record. Call while no one writes those files (a
    live run keeps its telemetry file: readers follow it by offset, and it records the restart)."""
    record = json.loads((checkpoint / "session.json").read_text())
    logs = [("metrics.jsonl", "metrics_bytes")] + ([(TELEMETRY_FILE, "telemetry_bytes")] if telemetry else [])
    for name, key in logs:
        path = Path(run_dir) / name
        if path.is_file() and record.get(key) is not None and path.stat().st_size > record[key]:
            with open(path, "r+b") as f:
                f.truncate(record[key])
    _remove_partial(Path(run_dir) / CHECKPOINTS)
    return record


def restore(workers: WorkerSet, state: RunState, checkpoint: Path, record: dict) -> None:
    """Load a checkpoint into started workers and the run's state: trainer state into the
    workers (any layout), the run's state (``record``: its session.json) and the controller's
    RNGs. The rollout engines still hold the weights they had: the caller syncs them."""
    import numpy as np
    import ray

    for role in STATEFUL_ROLES:
        folder = checkpoint / role
        if role in workers.groups and folder.is_dir():
            workers.groups[role].load_state([ray.put([read_role(folder)])])
    state.load(record)
    rng = torch.load(checkpoint / "driver_rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])


def read_role(folder: Path) -> dict[str, Any]:
    """Return a role's saved state in the form ``checkpoint_state`` gives it (HF layout)."""
    from safetensors.torch import load_file

    adapter = folder / ADAPTER_FILE  # a LoRA actor: the adapter alone (the base is the run's model)
    model = load_file(str(adapter if adapter.is_file() else folder / "model.safetensors"))
    if (folder / "value_head.safetensors").is_file():
        model.update(load_file(str(folder / "value_head.safetensors")))
    state: dict[str, Any] = {"model": model, "exp_avg": {}, "exp_avg_sq": {}}
    if (folder / OPTIMIZER_FILE).is_file():
        for key, value in load_file(str(folder / OPTIMIZER_FILE)).items():
            moment, name = key.split("/", 1)
            state[moment][name] = value
    trainer = json.loads((folder / "trainer_state.json").read_text())
    state.update(step=trainer["step"], adam_step=trainer["adam_step"], rng=torch.tensor(trainer["rng"], dtype=torch.uint8))
    return state


BRANCHED_FROM = "branched_from.txt"  # in a run directory that branch() started: the checkpoint


def branch(checkpoint: Path, run_dir: Path) -> Path:
    """Start the run directory ``run_dir`` from ``checkpoint`` of another run: the checkpoint and
    the run's warm start (hard-linked where the file system allows, else copied), its metrics and
    telemetry up to the checkpoint, and ``branched_from.txt`` naming it, so resuming ``run_dir``
    goes on from that step and the other run stays as it was. Written aside and renamed into
    place; returns ``run_dir``. Raises UserError when ``run_dir`` exists and is not empty."""
    run_dir, source = Path(run_dir), Path(checkpoint).parent.parent
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} is not empty: a run going on from {checkpoint} needs a new run directory")
    record = json.loads((Path(checkpoint) / "session.json").read_text())
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}-", dir=run_dir.parent))
    try:
        shutil.copytree(checkpoint, aside / CHECKPOINTS / Path(checkpoint).name, copy_function=_link_or_copy)
        if (source / "warm_start").is_dir():  # the model the run's roles started from (the reference's)
            shutil.copytree(source / "warm_start", aside / "warm_start", copy_function=_link_or_copy)
            shutil.copy2(source / "warm_start.json", aside / "warm_start.json")
        (aside / BRANCHED_FROM).write_text(str(Path(checkpoint).resolve()))
        for name, key in (("metrics.jsonl", "metrics_bytes"), (TELEMETRY_FILE, "telemetry_bytes")):
            if (source / name).is_file() and record.get(key) is not None:
                with open(source / name, "rb") as f:
                    (aside / name).write_bytes(f.read(record[key]))
        if run_dir.exists():
            run_dir.rmdir()
        aside.rename(run_dir)
    except BaseException:
        shutil.rmtree(aside, ignore_errors=True)
        raise
    return run_dir


def branched_from(run_dir: Path) -> Path | None:
    """Return the checkpoint ``branch`` started ``run_dir`` from, or None."""
    marker = Path(run_dir) / BRANCHED_FROM
    return Path(marker.read_text()) if marker.is_file() else None


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst`` (checkpoint files are never written again in place), or copy it
    where links cannot be made (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _remove_partial(root: Path) -> None:
    for p in root.glob(".step-*"):
        shutil.rmtree(p, ignore_errors=True)


def _numpy_state():
    import numpy as np

    return np.random.get_state()
