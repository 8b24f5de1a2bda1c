"""Offline DPO throughput: hybridlab's ``dpo`` dataflow (the reference's log-probs, then the
actor's DPO step, through Ray) against Hugging Face TRL's DPOTrainer on the CPU, on the same
model, preference pairs, batch, loss, beta, learning rate and threads, one after the other.

The pairs are the reverse task's (``min_len``..``max_len`` letters: prompts and responses of
varied lengths), written once in TRL's columns and read by both sides. A step is one optimizer
step of the sigmoid loss on ``pairs`` pairs, the reference scoring them in the same step on both
sides (TRL: ``precompute_ref_log_probs=False``, its default). Tokens are the real (unpadded)
tokens of the step's chosen and rejected sequences, counted from what each side's batches hold;
the first ``warmup`` steps are not timed. TRL runs without gradient checkpointing (its default
recomputes activations) and with as many threads as our worker process. Each side at its best
here: both run in fp32 and in bf16 (ours: ``actor.precision``; TRL: ``bf16`` autocast) and each
reports its faster; ours packs micro-batches without padding (``actor.remove_padding``, a token
budget), TRL pads (its ``padding_free`` is disabled in TRL 1.16).
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridlab.environment import processor
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model
from hybridlab.tasks import get_task
from hybridlab.tasks.preferences import save_preferences, task_pairs

PRECISIONS = ("fp32", "bf16")  # each side runs both; its faster is its figure


def _ours(model_dir: Path, pairs_file: Path, pairs: int, steps: int, warmup: int, lr: float, beta: float,
          micro_batch_tokens: int, precision: str) -> dict:
    from hybridlab.dataflow.session import RLSession

    overrides = [f"model={model_dir}", "data.preferences=true", f"data.train_files={pairs_file}",
                 "warm_start.max_steps=0", f"data.prompts_per_step={pairs}", f"actor.lr={lr}", "actor.warmup_steps=0",
                 "dpo.loss_type=sigmoid", "dpo.loss_weights=null",  # TRL's default loss, not the preset's
                 f"dpo.beta={beta}", f"actor.precision={precision}", "actor.remove_padding=true",
                 f"actor.micro_batch_tokens={micro_batch_tokens}",
                 "dataflow=[ref_logprob, update_actor_dpo]",  # no rollout to feed: TRL has none either
                 "trainer.progress=false", "trainer.telemetry=false", "trainer.logger=[console]"]
    seconds, tokens = [], []
    with tempfile.TemporaryDirectory(prefix="bench-dpo-") as run_dir, \
            RLSession("dpo", [*overrides, f"trainer.run_dir={run_dir}"]) as rl:
        for _ in range(warmup + steps):
            start = time.perf_counter()
            result = rl.step()
            seconds.append(time.perf_counter() - start)
            tokens.append(int(result.batch["attention_mask"].sum()))
        threads = rl.environment["worker_threads"]
    return {**_figures(seconds, tokens, warmup), "threads": threads}


def _figures(seconds: list[float], tokens: list[int], warmup: int) -> dict:
    """Return tokens/s and the median step of the timed steps (after ``warmup``), and the tokens of
    all steps (one epoch of the pairs: equal on both sides when they read and tokenize alike)."""
    timed = slice(warmup, None)
    return {"tokens_per_s": round(sum(tokens[timed]) / sum(seconds[timed]), 1),
            "step_s": round(statistics.median(seconds[timed]), 4), "tokens_total": sum(tokens)}


def _trl(model_dir: Path, pairs_file: Path, pairs: int, steps: int, warmup: int, lr: float, beta: float,
         bf16: bool, threads: int) -> dict:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(threads)
    marks: list[float] = []
    tokens: list[int] = []

    class Timed(DPOTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            tokens.append(int(inputs["attention_mask"].sum()))
            return super().training_step(model, inputs, *args, **kwargs)

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            marks.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, per_device_train_batch_size=pairs, max_steps=warmup + steps, learning_rate=lr,
                         beta=beta, bf16=bf16, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                         gradient_checkpointing=False,  # TRL's default recomputes activations: ~20% slower
                         lr_scheduler_type="constant", warmup_steps=0, seed=0, disable_tqdm=True)
        load = (lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
        trainer = Timed(model=load(), ref_model=load(), args=args, callbacks=[Clock()],
                        train_dataset=load_dataset("json", data_files=str(pairs_file), split="train"),
                        processing_class=AutoTokenizer.from_pretrained(model_dir))
        trainer.train()
    return _figures([marks[2 * i + 1] - marks[2 * i] for i in range(warmup + steps)], tokens, warmup)


def run(model: str = "small", pairs: int = 16, steps: int = 6, warmup: int = 2, min_len: int = 8, max_len: int = 48,
        lr: float = 1e-5, beta: float = 0.1, micro_batch_tokens: int = 2048) -> dict:
    """Return tokens/s of hybridlab's offline DPO step and of TRL's DPOTrainer, each in fp32 and
    bf16, on the same pairs (one epoch of them), and ``ratio`` = our faster / TRL's faster."""
    for name, value, low in (("pairs", pairs, 1), ("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or value < low:
            raise UserError(f"benchmark dpo: {name} must be an integer of at least {low}, got {value!r}")
    model_dir = resolve_model(model)
    task = get_task("reverse", min_len=min_len, max_len=max_len)
    with tempfile.TemporaryDirectory(prefix="bench-dpo-data-") as workdir:
        pairs_file = save_preferences(task_pairs(task, "train", pairs * (warmup + steps), seed=0),
                                      Path(workdir) / "pairs.jsonl")
        ours = {p: _ours(model_dir, pairs_file, pairs, steps, warmup, lr, beta, micro_batch_tokens, p)
                for p in PRECISIONS}
        threads = ours["fp32"]["threads"]  # TRL gets as many threads as our worker process has
        trl = {p: _trl(model_dir, pairs_file, pairs, steps, warmup, lr, beta, p == "bf16", threads)
               for p in PRECISIONS}
    mine, best = (max(side, key=lambda p: side[p]["tokens_per_s"]) for side in (ours, trl))
    return {"benchmark": "dpo", "processor": processor(), "threads": threads, "model": model,
            "pairs_per_step": pairs, "steps_timed": steps, "task": f"reverse {min_len}-{max_len} letters",
            "tokens_per_s": ours[mine]["tokens_per_s"], "precision": mine,
            "trl_tokens_per_s": trl[best]["tokens_per_s"], "trl_precision": best,
            "ratio": round(ours[mine]["tokens_per_s"] / trl[best]["tokens_per_s"], 3), "ours": ours, "trl": trl}
