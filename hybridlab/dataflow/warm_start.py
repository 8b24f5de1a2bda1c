"""The supervised warm start before RL: train the model on the task's worked answers until
greedy accuracy on held-out training prompts reaches ``warm_start.target_accuracy``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from hybridlab import sft
from hybridlab.agents.tools import load_tools
from hybridlab.atomic import write_json
from hybridlab.config import RunConfig
from hybridlab.evaluate import load_hf
from hybridlab.models.chat import use_template
from hybridlab.sandbox import Sandbox
from hybridlab.tasks import get_task


def tool_schemas(cfg: RunConfig) -> list[dict] | None:
    """Return the schemas of rollout.tools (what the rollout renders conversations with), or None."""
    if not cfg.rollout.tools:
        return None

    return [tool.schema for tool in load_tools(cfg.rollout.tools).values()]


def warm_start(cfg: RunConfig, run_dir: Path, base: Path, emit: Callable[[str, dict], None]) -> tuple[Path, dict | None]:
    """Train ``base`` (a model directory) and save it under ``run_dir/warm_start``; returns the
    checkpoint directory and the record written to ``warm_start.json`` (a run directory that
    already has the checkpoint reuses it). ``emit(kind, record)`` reports progress to the
    dashboard. Raises WarmStartError naming the keys when the target is not reached."""
    ws = cfg.warm_start
    out = run_dir / "warm_start"
    info_path = run_dir / "warm_start.json"
    if (out / "config.json").is_file():  # resumed run directory: reuse
        return out, json.loads(info_path.read_text()) if info_path.is_file() else None
    model, tokenizer = load_hf(base)
    use_template(tokenizer, cfg.data.chat_template)  # saved with the checkpoint: the workers render with it
    task = get_task(cfg.data.task, **cfg.data.task_options)
    if task.needs_sandbox:  # its held-out checks run answers in the run's sandbox
        task.use_sandbox(Sandbox(cfg.sandbox))
    # the worked examples come from the run's training prompts, as many as data.train_samples asks
    pool = cfg.data.train_samples or sft.SFTConfig.train_samples
    sft_cfg = sft.SFTConfig(steps=ws.max_steps, max_seconds=float("inf"), lr=ws.lr, batch_size=ws.batch_size,
                            train_samples=pool,
                            warmup_steps=min(ws.warmup_steps, ws.max_steps // 5), seed=cfg.trainer.seed,
                            target_accuracy=ws.target_accuracy, eval_every=ws.eval_every,
                            eval_samples=ws.eval_samples, chat=cfg.data.chat, tools=tool_schemas(cfg))
    emit("phase", {"phase": "warm start", "step": 0, "max_steps": ws.max_steps})

    def on_check(step: int, accuracy: float) -> None:
        emit("phase", {"phase": "warm start", "step": step, "max_steps": ws.max_steps,
                       "accuracy": accuracy, "target": ws.target_accuracy})

    try:
        result = sft.train(model, tokenizer, task, sft_cfg, progress=cfg.trainer.progress, on_check=on_check)
    except sft.WarmStartError as exc:
        raise sft.WarmStartError(f"{exc} (warm_start.max_steps={ws.max_steps}, warm_start.target_accuracy="
                                 f"{ws.target_accuracy}, warm_start.lr={ws.lr:g})") from None
    info = {"steps": result["steps"], "seconds": result["seconds"],
            "held_out_accuracy": result["held_out_accuracy"], "target_accuracy": ws.target_accuracy,
            "held_out_prompts": ws.eval_samples, "checks": result["checks"]}
    path = sft.save_checkpoint(model, tokenizer, out)
    write_json(info_path, info)
    return path, info
