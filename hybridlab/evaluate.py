"""Greedy accuracy of a checkpoint on a task's test split or on a verl-format dataset."""
from __future__ import annotations

import time
from typing import Sequence

from hybridlab.models.chat import prompt_ids
from hybridlab.models.stops import model_stop_ids
from hybridlab.tasks import Sample, Task
from hybridlab.workers.reward.scoring import RuleScorer
from hybridlab.workers.rollout.hf_engine import generate_ids
from hybridlab.workers.rollout.sampling import SamplingConfig


def load_hf(model_dir):
    """Return (model, tokenizer) loaded with transformers in fp32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer


def greedy_ids(model, tokenizer, prompts: Sequence[list[int]], max_new_tokens: int,
               batch_size: int = 256) -> list[list[int]]:
    """Return each prompt's (token ids) greedy response ids, up to and including the checkpoint's
    first end id (any it lists, as the rollout stops)."""
    model.eval()
    cfg = SamplingConfig(temperature=0, max_tokens=max_new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = model_stop_ids(model, tokenizer)
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        out += generate_ids(model, list(prompts[start:start + batch_size]), cfg, pad, stops)[0]
    return out


def greedy_texts(model, tokenizer, prompts: Sequence[list[int]], max_new_tokens: int,
                 batch_size: int = 256) -> list[str]:
    """Return each prompt's (token ids) greedy response, decoded up to the checkpoint's first end
    id (any it lists, as the rollout stops) without special tokens."""
    return [tokenizer.decode(r, skip_special_tokens=True)
            for r in greedy_ids(model, tokenizer, prompts, max_new_tokens, batch_size)]


def accuracy(model, tokenizer, task: Task | RuleScorer, samples: Sequence[Sample], max_new_tokens: int = 16) -> dict:
    """Return ``{"accuracy", "n", "seconds", "examples"}`` of greedy decoding on ``samples``, each
    response judged by ``task``'s check, or by the built-in scorer of its sample's data source."""
    start = time.perf_counter()
    responses = greedy_texts(model, tokenizer, [prompt_ids(tokenizer, s) for s in samples], max_new_tokens)
    if isinstance(task, Task):
        correct = [task.check(r, s.ground_truth)[0] for r, s in zip(responses, samples)]
    else:
        correct = [task.accuracy(s.data_source, r, s.ground_truth) == 1.0 for r, s in zip(responses, samples)]
    examples = [{"prompt": s.prompt, "response": r, "correct": c}
                for s, r, c in list(zip(samples, responses, correct))[:5]]
    return {"accuracy": sum(correct) / len(samples), "n": len(samples),
            "seconds": round(time.perf_counter() - start, 3), "examples": examples}
