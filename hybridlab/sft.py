"""Supervised warm start: train a causal LM on a task's worked examples, save an HF checkpoint.

RL from a random model earns no reward, so RL runs start from this. The loss covers the
answer tokens and the end-of-sequence token only; the prompt is context.

With ``target_accuracy`` set, training stops as soon as greedy accuracy on held-out *training*
prompts (drawn after the ones trained on, never the test split) reaches the target, checked
every ``eval_every`` steps; reaching ``steps`` or ``max_seconds`` first raises WarmStartError.
A fixed step count is not robust: small models learn addition in an abrupt jump whose timing
depends on the processor's floating-point kernels (the same seeded 800 steps gave 56% on one
machine and 17% on another), so RL must start from a measured accuracy, not a step count.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from hybridlab.agents.traces import encode_trace, trace_accuracy
from hybridlab.atomic import atomic_model_dir
from hybridlab.config.schema import WarmStartConfig
from hybridlab.errors import UserError
from hybridlab.evaluate import accuracy
from hybridlab.models.chat import as_chat, end_of_turn, prompt_ids
from hybridlab.models.stops import end_of_response, model_stop_ids
from hybridlab.tasks import Sample, Task


@dataclasses.dataclass
class SFTConfig:
    """Settings of a warm start; the defaults are the run's (``warm_start`` in the schema) with a
    time limit, which takes tiny to >30% on 2-digit addition in <3 min."""
    steps: int = WarmStartConfig.max_steps
    max_seconds: float = 170.0
    batch_size: int = WarmStartConfig.batch_size
    lr: float = WarmStartConfig.lr
    warmup_steps: int = WarmStartConfig.warmup_steps
    weight_decay: float = 0.01
    train_samples: int = 4000
    seed: int = 0
    target_accuracy: Optional[float] = None   # stop once held-out greedy accuracy reaches this
    eval_every: int = WarmStartConfig.eval_every      # steps between held-out checks (with a target)
    eval_samples: int = WarmStartConfig.eval_samples  # held-out training prompts for the check
    chat: bool = False                        # prompts as one user message in the chat template
    tools: Optional[list] = None              # tool schemas a traced task's conversations are rendered with

    def validate(self) -> None:
        """Raise UserError naming the first field with an impossible value."""
        for name in ("steps", "batch_size", "train_samples", "eval_every", "eval_samples"):
            if getattr(self, name) < 1:
                raise UserError(f"sft {name} must be at least 1, got {getattr(self, name)}")
        if self.max_seconds <= 0 or self.lr <= 0:
            raise UserError("sft max_seconds and lr must be positive")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise UserError(f"sft target_accuracy must be in (0, 1], got {self.target_accuracy}")


class WarmStartError(UserError):
    """The warm start used its step or time budget without reaching its target accuracy."""


def held_out_split(task: Task, cfg: SFTConfig) -> tuple[list[Sample], list[Sample]]:
    """Return (prompts to train on, held-out prompts to check): both from the task's train
    split, the held-out ones drawn after the trained ones, so they never overlap the test split
    that reports a run's result nor the prompts the model trained on."""
    held = cfg.eval_samples if cfg.target_accuracy is not None else 0
    samples = task.split("train", cfg.train_samples + held, seed=cfg.seed)
    return samples[:cfg.train_samples], samples[cfg.train_samples:]


def held_out_accuracy(model, tokenizer, task: Task, held_out: list[Sample]) -> float:
    """Return greedy accuracy on ``held_out``, generating one token more than the longest answer
    (enough to score, and the check stays cheap)."""
    longest = max(len(tokenizer(s.answer, add_special_tokens=False).input_ids) for s in held_out)
    return accuracy(model, tokenizer, task, held_out, max_new_tokens=longest + 1)["accuracy"]


def encode_examples(tokenizer, samples: list[Sample], end: int) -> list[tuple[list[int], int]]:
    """Return (token ids of prompt+answer+``end``, prompt length) for each sample (chat prompts
    rendered with the template, as the rollout sees them)."""
    out = []
    for s in samples:
        if not s.answer:
            raise UserError(f"sample {s.prompt!r} has no worked answer to train on")
        prompt = prompt_ids(tokenizer, s)
        answer = tokenizer(s.answer, add_special_tokens=False).input_ids
        out.append((prompt + answer + [end], len(prompt)))
    return out


def answer_end(model, tokenizer, chat: bool) -> int:
    """Return the id a worked answer ends with: the end-of-sequence id the checkpoint stops at,
    or in chat form the template's end of turn (<|im_end|>) when the checkpoint stops there."""
    stops = model_stop_ids(model, tokenizer)
    end = end_of_response(tokenizer, stops)
    return (end_of_turn(tokenizer, stops) or end) if chat else end


def worked_examples(tokenizer, task: Task, samples: list[Sample], end: int,
                    tools: list | None = None) -> list[tuple[list[int], int | list[int]]]:
    """Return what the warm start trains on: (ids, prompt length) per worked answer, or for a
    tool-use task (one with ``trace``) (ids, loss mask) per worked conversation, tokenized as an
    agent rollout records it (``hybridlab.agents.traces``)."""
    if not hasattr(task, "trace"):
        return encode_examples(tokenizer, samples, end)

    return [encode_trace(tokenizer, task.trace(s), end, tools) for s in samples]


def collate(examples: list[tuple[list[int], int | list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch of (ids, prompt length) or (ids, loss mask) examples; returns input_ids,
    attention_mask and labels (-100 outside answers: after the prompt, or where the mask is 0)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, trained) in enumerate(examples):
        row = torch.tensor(ids)
        input_ids[i, :len(ids)] = row
        mask[i, :len(ids)] = 1
        keep = torch.arange(len(ids)) >= trained if isinstance(trained, int) else torch.tensor(trained).bool()
        labels[i, :len(ids)] = torch.where(keep, row, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def optimizer(model, cfg: SFTConfig) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """Return AdamW over ``model`` and its schedule: linear warm-up, then cosine down to 10% of the
    learning rate over the planned steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def optimizer_step(model, opt: torch.optim.Optimizer, sched, batch: dict) -> float:
    """One step on ``batch`` (gradient norm clipped at 1); returns the loss."""
    loss = model(**batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def train(model, tokenizer, task: Task, cfg: SFTConfig, progress: bool = True,
          on_check: Optional[Callable[[int, float], None]] = None) -> dict:
    """Train ``model`` in place on ``task``'s train split; returns a summary with the loss curve
    and, with a target, the held-out accuracy curve (``checks``) and ``held_out_accuracy``.
    ``on_check(step, accuracy)`` is called after each held-out check. Raises WarmStartError
    when the step or time budget runs out before the target is reached."""
    cfg.validate()
    torch.manual_seed(cfg.seed)
    train_samples, held_out = held_out_split(task, cfg)
    if cfg.chat:
        train_samples, held_out = as_chat(train_samples), as_chat(held_out)
    end = answer_end(model, tokenizer, cfg.chat)
    examples = worked_examples(tokenizer, task, train_samples, end, cfg.tools)
    held_traces = worked_examples(tokenizer, task, held_out, end, cfg.tools) if hasattr(task, "trace") else None
    checks: list[dict] = []

    def check(step: int) -> float:
        acc = (trace_accuracy(model, tokenizer, held_traces) if held_traces is not None
               else held_out_accuracy(model, tokenizer, task, held_out))
        model.train()
        checks.append({"step": step, "accuracy": acc})
        if on_check is not None:
            on_check(step, acc)
        return acc

    opt, sched = optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="sft", disable=not progress, dynamic_ncols=True, mininterval=0.5)
    step = 0
    while step < cfg.steps and time.perf_counter() - start < cfg.max_seconds:
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        batch = collate([examples[i] for i in idx], tokenizer.pad_token_id)
        losses.append(optimizer_step(model, opt, sched, batch))
        step += 1
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / 10:.4f}",
                            **({"held_out": f"{checks[-1]['accuracy']:.3f}"} if checks else {}))
        if cfg.target_accuracy is not None and step % cfg.eval_every == 0:
            if check(step) >= cfg.target_accuracy:
                break
    if cfg.target_accuracy is not None and (not checks or checks[-1]["step"] != step):
        check(step)  # the budget ran out between checks: the last weights get their check
    bar.close()
    model.eval()
    summary = {"steps": step, "seconds": round(time.perf_counter() - start, 2), "first_loss": losses[0],
               "final_loss": sum(losses[-20:]) / len(losses[-20:]), "losses": losses}
    if cfg.target_accuracy is not None:  # the last weights were checked (above), so checks is not empty
        reached = checks[-1]["accuracy"]
        summary.update(checks=checks, target_accuracy=cfg.target_accuracy, held_out_accuracy=reached)
        if reached < cfg.target_accuracy:
            budget = f"{step} steps" + (" (the time limit)" if step < cfg.steps else " (the step cap)")
            raise WarmStartError(
                f"warm start reached {reached:.1%} greedy accuracy on {len(held_out)} held-out training prompts after"
                f" {budget}, short of its target {cfg.target_accuracy:.0%}; allow more steps, lower the target,"
                f" or change the learning rate (best so far: {max(c['accuracy'] for c in checks):.1%})")
    return summary


def save_checkpoint(model, tokenizer, out: str | os.PathLike) -> Path:
    """Save model and tokenizer to ``out`` atomically (written aside, then renamed); returns the path."""
    with atomic_model_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)
