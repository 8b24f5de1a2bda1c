"""Supervised warm start: train a causal LM on a task's worked examples, save an HF checkpoint.

RL from a random model earns no reward, so RL runs start from this. The loss covers the
answer tokens and the end-of-sequence token only; the prompt is context.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch

from hybridlab.atomic import atomic_model_dir
from hybridlab.errors import UserError
from hybridlab.tasks import Sample, Task


@dataclasses.dataclass
class SFTConfig:
    """Settings of a warm start; the defaults take tiny to >30% on 2-digit addition in <3 min."""

    steps: int = 3000
    max_seconds: float = 170.0
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    train_samples: int = 4000
    seed: int = 0

    def validate(self) -> None:
        """Raise UserError naming the first field with an impossible value."""
        for name in ("steps", "batch_size", "train_samples"):
            if getattr(self, name) < 1:
                raise UserError(f"sft {name} must be at least 1, got {getattr(self, name)}")
        if self.max_seconds <= 0 or self.lr <= 0:
            raise UserError("sft max_seconds and lr must be positive")


def encode_examples(tokenizer, samples: list[Sample]) -> list[tuple[list[int], int]]:
    """Return (token ids of prompt+answer+eos, prompt length) for each sample."""
    out = []
    for s in samples:
        if not s.answer:
            raise UserError(f"sample {s.prompt!r} has no worked answer to train on")
        prompt = tokenizer(s.prompt, add_special_tokens=False).input_ids
        answer = tokenizer(s.answer, add_special_tokens=False).input_ids
        out.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return out


def collate(examples: list[tuple[list[int], int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch; returns input_ids, attention_mask and labels (-100 outside answers)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
        labels[i, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def train(model, tokenizer, task: Task, cfg: SFTConfig, progress: bool = True) -> dict:
    """Train ``model`` in place on ``task``'s train split; returns a summary with the loss curve."""
    from tqdm.auto import tqdm

    cfg.validate()
    torch.manual_seed(cfg.seed)
    examples = encode_examples(tokenizer, task.split("train", cfg.train_samples, seed=cfg.seed))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:  # linear warm-up then cosine to 10% over the planned steps
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc="sft", disable=not progress, dynamic_ncols=True, mininterval=0.5)
    step = 0
    while step < cfg.steps and time.perf_counter() - start < cfg.max_seconds:
        idx = torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()
        batch = collate([examples[i] for i in idx], tokenizer.pad_token_id)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / 10:.4f}")
    bar.close()
    model.eval()
    return {"steps": step, "seconds": round(time.perf_counter() - start, 2),
            "first_loss": losses[0], "final_loss": sum(losses[-20:]) / len(losses[-20:]), "losses": losses}


def save_checkpoint(model, tokenizer, out: str | os.PathLike) -> Path:
    """Save model and tokenizer to ``out`` atomically (written aside, then renamed); returns the path."""
    with atomic_model_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)
