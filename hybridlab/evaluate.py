"""Greedy accuracy of a checkpoint on a task's test split or on a verl-format dataset."""
from __future__ import annotations

import time
from typing import Sequence

from hybridlab.tasks import Sample, Task


def load_hf(model_dir):
    """Return (model, tokenizer) loaded with transformers in fp32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def accuracy(model, tokenizer, task: Task, samples: Sequence[Sample], max_new_tokens: int = 16) -> dict:
    """Return ``{"accuracy", "n", "seconds", "examples"}`` of greedy decoding on ``samples``."""
    from hybridlab.workers.rollout.hf import generate_texts

    start = time.perf_counter()
    responses = generate_texts(model, tokenizer, [s.prompt for s in samples], max_new_tokens)
    correct = [task.check(r, s.ground_truth)[0] for r, s in zip(responses, samples)]
    examples = [{"prompt": s.prompt, "response": r, "correct": c}
                for s, r, c in list(zip(samples, responses, correct))[:5]]
    return {"accuracy": sum(correct) / len(samples), "n": len(samples),
            "seconds": round(time.perf_counter() - start, 3), "examples": examples}
