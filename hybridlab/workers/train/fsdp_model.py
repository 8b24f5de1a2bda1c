"""The model the FSDP2 engine shards: the checkpoint's transformers causal LM as it is, with its
dropout zeroed (Megatron's build has none), or for a critic its decoder stack with a value head;
and the per-token log-probs, entropy and sum of p^2 from its logits."""
from __future__ import annotations

from pathlib import Path

import torch


class ValueModel(torch.nn.Module):
    """A causal LM's decoder stack with a scalar head (``value_head.linear``, zeros at start, as
    the Megatron critic's) in place of the LM head; parameter names stay the checkpoint's."""

    def __init__(self, lm: torch.nn.Module, hidden: int):
        super().__init__()
        setattr(self, lm.base_model_prefix, getattr(lm, lm.base_model_prefix))
        self.prefix = lm.base_model_prefix
        self._no_split_modules = lm._no_split_modules  # the decoder layer classes FSDP wraps one by one
        self.value_head = torch.nn.Module()
        self.value_head.linear = torch.nn.Linear(hidden, 1, bias=True)
        torch.nn.init.zeros_(self.value_head.linear.weight)
        torch.nn.init.zeros_(self.value_head.linear.bias)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """Return the value of every position, [batch, seq, 1]."""
        out = getattr(self, self.prefix)(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids, use_cache=False)
        return self.value_head.linear(out.last_hidden_state)


def logprobs_entropy(logits: torch.Tensor, target: torch.Tensor, sum_pi_squared: bool = False):
    """Return (log p(target), entropy) of fp32 logits over the whole vocabulary, and with
    ``sum_pi_squared`` the sum of p^2 per position (no gradient through it)."""
    log_p = torch.log_softmax(logits, -1)
    picked = log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    p = log_p.exp()
    out = (picked, -(p * log_p).sum(-1))
    return (*out, p.detach().square().sum(-1)) if sum_pi_squared else out


def build_model(model_dir: str, value_head: bool) -> torch.nn.Module:
    """Return the checkpoint's causal LM in fp32 without dropout (a critic: its ``ValueModel``)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for part in (config, config.get_text_config()):  # training runs without dropout, as Megatron's build
        for key, value in list(vars(part).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(part, key, 0.0)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                              attn_implementation="sdpa")
    if not value_head:
        return lm
    model = ValueModel(lm, lm.config.get_text_config().hidden_size)
    head = Path(model_dir) / "value_head.safetensors"
    if head.is_file():  # a saved critic
        weights = load_file(str(head))
        with torch.no_grad():
            for k in ("weight", "bias"):
                getattr(model.value_head.linear, k).copy_(weights[f"value_head.linear.{k}"].float())
    return model
