"""Generation with transformers' ``generate``: the reference rollout backend and eval path."""
from __future__ import annotations

from typing import Sequence

import torch


@torch.no_grad()
def generate_texts(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *,
                   batch_size: int = 256, do_sample: bool = False, temperature: float = 1.0) -> list[str]:
    """Return the decoded response (up to end-of-sequence, specials removed) for each prompt."""
    model.eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts[start:start + batch_size]]
        width = max(len(ids) for ids in chunk)
        # Left padding keeps every prompt's last token at the same position for generation.
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chunk])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chunk])
        kwargs = dict(do_sample=do_sample, temperature=temperature) if do_sample else dict(do_sample=False)
        generated = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                   eos_token_id=eos, pad_token_id=pad, **kwargs)
        for row in generated[:, width:].tolist():
            if eos in row:
                row = row[:row.index(eos)]
            out.append(tokenizer.decode(row, skip_special_tokens=True))
    return out
