"""Tinker's built-in losses, as its documentation defines them, on padded per-token tensors.

Every loss is a sum over tokens (Tinker never averages: a user who wants a mean scales the
advantages or weights). Inputs are [datums, positions] tensors, right-padded; ``mask`` is 1 on
each datum's real positions. Position i of a datum holds the log-probability of its
``target_tokens[i]`` given ``model_input[: i + 1]``.

    cross_entropy        -(weights * logp)
    importance_sampling  -(ratio * advantages),              ratio = exp(logp - sampling logp)
    ppo                  -min(ratio * A, clip(ratio) * A)
    cispo                -(sg(clip(ratio)) * logp * A)
    dro                  -(logp * A - beta / 2 * (logp - sampling logp) ** 2)
    gspo                 ppo on the sequence's ratio: s = exp(mean log-ratio over the datum's
                         sequence positions), carried per token as sg(s) * exp(logp - sg(logp))

Clip thresholds are ratios (``clip_low_threshold`` 0.8 means 1 - 0.2): ``loss_fn_config``'s, or
per-datum tensors of the same names in ``loss_fn_inputs``, else the defaults below. GSPO's
sequence positions are ``sequence_ratio_mask`` where given, else those with a nonzero advantage
(the cookbook gives prompt positions advantage 0 and sampling log-prob 0).
"""
from __future__ import annotations

import torch

from hybridlab.errors import UserError

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
REFUSED = {
    "stable_reinforce": "it is not public (the cookbook's rl_loop.py defaults to it: pass"
                        " loss_fn='importance_sampling')",
    "custom": "server-side custom losses are Tinker's own; forward_backward_custom works through a forward"
              " pass and cross_entropy with weights",
}
# what each loss reads from loss_fn_inputs besides target_tokens (required ones first)
INPUTS = {"cross_entropy": ((), ("weights",)),
          "importance_sampling": (("logprobs", "advantages"), ()),
          "ppo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
          "cispo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
          "dro": (("logprobs", "advantages"), ()),
          "gspo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask"))}
CLIP = {"ppo": (0.8, 1.2), "cispo": (0.8, 1.2), "gspo": (1 - 3e-4, 1 + 4e-4)}  # GSPO's paper: 3e-4 / 4e-4
CONFIG_KEYS = {"ppo": ("clip_low_threshold", "clip_high_threshold"),
               "cispo": ("clip_low_threshold", "clip_high_threshold"),
               "gspo": ("clip_low_threshold", "clip_high_threshold"), "dro": ("beta",)}


class LossError(UserError):
    """A loss the server does not compute, or inputs it cannot use; the message says which."""


def check_loss(name: str, config: dict | None, input_keys: set[str], forward_only: bool = False) -> None:
    """Raise LossError naming an unknown or refused loss, a ``loss_fn_config`` key the loss does
    not take, an input it needs that the data lacks, or (training calls only: ``forward`` takes
    any data, as the SDK's ``forward_backward_custom`` sends) an input it would ignore."""
    if name in REFUSED:
        raise LossError(f"loss_fn {name!r} is not served here: {REFUSED[name]}")
    if name not in LOSSES:
        raise LossError(f"unknown loss_fn {name!r}; this server computes {', '.join(LOSSES)}")
    extra = sorted(set(config or {}) - set(CONFIG_KEYS.get(name, ())))
    if extra:
        allowed = ", ".join(CONFIG_KEYS.get(name, ())) or "none"
        raise LossError(f"loss_fn_config for {name!r} takes {allowed}; got {', '.join(extra)}")
    if name == "dro" and "beta" not in (config or {}):
        raise LossError("loss_fn 'dro' needs loss_fn_config={'beta': ...}")
    required, optional = INPUTS[name]
    missing = [k for k in ("target_tokens", *(() if forward_only else required)) if k not in input_keys]
    if missing:
        raise LossError(f"loss_fn {name!r} needs loss_fn_inputs {', '.join(missing)} in every datum")
    unknown = sorted(input_keys - {"target_tokens", *required, *optional})
    if unknown and not forward_only:
        raise LossError(f"loss_fn {name!r} does not read loss_fn_inputs {', '.join(unknown)}; it takes target_tokens,"
                        f" {', '.join((*required, *optional))}")


def _thresholds(name: str, inputs: dict[str, torch.Tensor], config: dict) -> tuple:
    low, high = CLIP[name]
    low = inputs.get("clip_low_threshold", config.get("clip_low_threshold", low))
    high = inputs.get("clip_high_threshold", config.get("clip_high_threshold", high))
    return low, high


def _clamp(x: torch.Tensor, low, high) -> torch.Tensor:
    return torch.minimum(torch.maximum(x, torch.as_tensor(low, dtype=x.dtype)), torch.as_tensor(high, dtype=x.dtype))


def token_losses(name: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], mask: torch.Tensor,
                 config: dict | None = None) -> torch.Tensor:
    """Return loss ``name``'s per-token terms, [datums, positions], zero off ``mask``: their sum
    is the loss whose gradient ``forward_backward`` takes and whose value is ``loss:sum``."""
    config = config or {}
    mask = mask.to(logp.dtype)
    if name == "cross_entropy":
        weights = inputs.get("weights", torch.ones_like(logp))
        return -(logp * weights) * mask
    q, adv = inputs["logprobs"].to(logp.dtype), inputs["advantages"].to(logp.dtype)
    if name == "dro":
        return -(logp * adv - 0.5 * float(config["beta"]) * (logp - q) ** 2) * mask
    if name == "gspo":
        seq = inputs.get("sequence_ratio_mask", (adv != 0).to(logp.dtype)).to(logp.dtype) * mask
        mean_log_ratio = ((logp - q) * seq).sum(-1, keepdim=True) / seq.sum(-1, keepdim=True).clamp(min=1)
        ratio = torch.exp(mean_log_ratio).detach() * torch.exp(logp - logp.detach())
        low, high = _thresholds(name, inputs, config)
        return -torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv) * seq
    ratio = torch.exp(logp - q)
    if name == "importance_sampling":
        return -(ratio * adv) * mask
    low, high = _thresholds(name, inputs, config)
    if name == "ppo":
        return -torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv) * mask
    if name == "cispo":
        return -(_clamp(ratio, low, high).detach() * logp * adv) * mask
    raise LossError(f"unknown loss_fn {name!r}; this server computes {', '.join(LOSSES)}")


def engine_loss(name: str, config: dict | None):
    """Return a ``backend.LossFn`` computing loss ``name`` on a micro-batch whose tensors carry
    the Tinker inputs (``tinker/<key>``) beside ``response_mask``: the sum of its token terms."""
    def loss_fn(outputs: dict, micro: dict) -> tuple[torch.Tensor, dict]:
        inputs = {k.removeprefix("tinker/"): v for k, v in micro.items() if k.startswith("tinker/")}
        terms = token_losses(name, outputs["log_probs"], inputs, micro["response_mask"], config)
        total = terms.sum()
        return total, {"loss_sum": total.detach()}
    return loss_fn
