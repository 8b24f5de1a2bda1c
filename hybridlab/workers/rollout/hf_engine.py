"""Generation with transformers from token ids: the reference backend behind RolloutWorker."""
from __future__ import annotations

import torch

from hybridlab.workers.rollout.sampling import SamplingConfig


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], cfg: SamplingConfig, pad_id: int, stop_ids: list[int]):
    """Return (responses, log-probs) like the vLLM backend: n samples per prompt, interleaved,
    each ending at the first of ``stop_ids`` (the checkpoint's end ids) or ``cfg.stop_token_ids``."""
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(cfg.n, 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(cfg.n, 0)
    greedy = cfg.temperature == 0
    extra = {} if greedy else dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
    stops = None if cfg.ignore_eos else [*stop_ids, *(cfg.stop_token_ids or [])] or None
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_tokens, do_sample=not greedy,
                         eos_token_id=stops, pad_token_id=pad_id, output_scores=True, return_dict_in_generate=True,
                         **extra)
    new = out.sequences[:, width:]
    scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # processed (warped) scores
    responses, logprobs = [], []
    for row, row_scores in zip(new.tolist(), scores):
        length = len(row)
        for j, t in enumerate(row):  # cut after the first stop token, keep it like vLLM does
            if stops and t in stops:
                length = j + 1
                break
        responses.append(row[:length])
        logprobs.append([row_scores[j, t].item() for j, t in enumerate(row[:length])])
    return responses, logprobs
