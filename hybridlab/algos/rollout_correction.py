"""Rollout correction: importance weights and rejection against the training-inference mismatch.

The rollout engine's log-probs differ from the trainer's (bf16 against fp32 kernels, or a
stale policy under off-policy generation). As verl 0.9.1's ``rollout_corr_helper``:

- **IS weights** ``rollout_is``: "token" (exp of each token's log-ratio) or "sequence" (exp of
  the response's summed log-ratio), truncated at ``rollout_is_threshold`` (TIS), or, for a
  "lower_upper" threshold string, zeroed outside [lower, upper] (IcePop); optionally
  normalized to mean 1 over the batch.
- **Rejection** ``rollout_rs``: comma-separated criteria, each must pass: token_k1/k2/k3,
  seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1 is the geometric-mean ratio, "Geo-RS"),
  seq_max_k2/k3, with k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. A rejected token (or
  a whole rejected sequence) leaves the response mask.
- **Mismatch metrics** (always): KL and k3-KL between rollout and trainer, both perplexities,
  their log difference, chi-squared per token and per sequence.

Every metric is prefixed ``rollout_corr/``. Tested equal to verl 0.9.1 (weights, mask and
metrics) in ``tests/test_verl_reference.py``.
"""
from __future__ import annotations

import math

import torch

from hybridlab.algos.functional import masked_mean, masked_sum

BOUND = 20.0  # log-space clamp before exponentiating, as verl
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
IS_LEVELS = ("token", "sequence")


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """Return (upper, lower or None) from a number (truncation) or a "lower_upper" string (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"rollout_is_threshold {spec!r} is not a number or a 'lower_upper' pair of numbers") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive with lower <= upper")
    return upper, lower


def parse_rs(options: str, spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """Return {option: (lower or None, upper)} for a comma-separated ``rollout_rs`` and its
    thresholds (one shared or one per option; k1 options take "lower_upper" ratio bounds, a
    single number meaning [1/x, x]); raises naming the bad option or value."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    bad = [o for o in names if o not in RS_OPTIONS]
    if not names or bad:
        raise ValueError(f"rollout_rs {options!r}: unknown option(s) {bad}; allowed: {', '.join(RS_OPTIONS)}")
    if spec is None:
        raise ValueError("rollout_rs_threshold is required when rollout_rs is set")
    specs = [str(spec)] if isinstance(spec, (int, float)) else [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {spec!r}: give one threshold or one per option ({len(names)})")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = {}
    for name, text in zip(names, specs):
        try:
            if name.endswith("k1"):
                lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (1 / float(text), float(text))
            elif "_" in text:
                raise ValueError
            else:
                lower, upper = None, float(text)
        except ValueError:
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: k1 options take a number or 'lower_upper',"
                             f" k2/k3 options one positive number") from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {text!r} for {name}: bounds must be positive, lower <= upper")
        out[name] = (lower, upper)
    return out


def _item(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def rollout_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str = "token",
                       rollout_is_threshold: str | float = 2.0,
                       rollout_is_batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (IS weights [batch, len], zero on padding and detached; metrics without prefix)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} (or unset), got {rollout_is!r}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    if rollout_is == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-BOUND, BOUND))
    else:
        log_for_metrics = masked_sum(log_ratio, response_mask, -1).unsqueeze(-1)
        raw = torch.exp(log_for_metrics.clamp(-BOUND, BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    weights = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw,
                                                                    torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, log_for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _item(masked_mean(((raw < lower) | (raw > upper)).float(), response_mask))
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq_mask = (response_mask.sum(-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, response_mask, -1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = _item(mean) if mean > 1e-8 else 1.0
    return weights, metrics


def _is_metrics(weights, raw, log_for_metrics, mask, level, upper, lower) -> dict[str, float]:
    lower = 1.0 / upper if lower is None else lower
    bool_mask = mask.bool()
    m = {"rollout_is_mean": _item(masked_mean(weights, mask))}
    if level == "sequence":
        m["rollout_is_max"] = _item(torch.exp(log_for_metrics.max().clamp(max=BOUND)))
        m["rollout_is_min"] = _item(torch.exp(log_for_metrics.min()))
        m["rollout_is_ratio_fraction_high"] = _item((log_for_metrics > math.log(upper)).float().mean())
        m["rollout_is_ratio_fraction_low"] = _item((log_for_metrics < math.log(lower)).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = _item(masked_mean((raw > upper).float(), mask))
        m["rollout_is_ratio_fraction_low"] = _item(masked_mean((raw < lower).float(), mask))
        m["rollout_is_max"] = _item(weights.masked_fill(~bool_mask, float("-inf")).max())
        m["rollout_is_min"] = _item(weights.masked_fill(~bool_mask, float("inf")).min())
    clamped = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped.square(), mask) - mean.square()
    m["rollout_is_std"] = _item(var.clamp(min=0.0).sqrt()) if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / _item(masked_mean((clamped / (mean + 1e-8)).square(), mask))
    seq = masked_mean(weights, mask, -1)
    m.update(rollout_is_seq_mean=_item(seq.mean()), rollout_is_seq_std=_item(seq.std()) if seq.numel() > 1 else 0.0,
             rollout_is_seq_max=_item(seq.max()), rollout_is_seq_min=_item(seq.min()),
             rollout_is_seq_max_deviation=_item((seq - 1.0).abs().max()))
    raw_seq = masked_mean(raw, mask, -1)
    m["rollout_is_seq_fraction_high"] = _item((raw_seq > upper).float().mean())
    m["rollout_is_seq_fraction_low"] = _item((raw_seq < lower).float().mean())
    return m


def rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str,
                           rollout_rs_threshold: str | float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (the response mask without rejected tokens and sequences, metrics without prefix)."""
    options = parse_rs(rollout_rs, rollout_rs_threshold)
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    safe = log_ratio.clamp(-BOUND, BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    bool_mask = response_mask.bool()
    seq_valid = response_mask.sum(-1) > 0
    keep_all = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for name, (lower, upper) in options.items():
        kind, k = name.rsplit("_", 1)
        low, high = (math.log(lower), math.log(upper)) if k == "k1" else (None, upper)
        if kind == "token":
            stat, seq_stat = per_token[k], None
        else:
            values = per_token[k]
            if kind == "seq_sum":
                seq_stat = masked_sum(values, response_mask, -1)
            elif kind == "seq_mean":
                seq_stat = masked_mean(values, response_mask, -1)
            else:
                peak = values.masked_fill(~bool_mask, float("-inf")).max(-1).values
                seq_stat = torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)
            stat = seq_stat.unsqueeze(-1).expand_as(response_mask)
        keep = (stat <= high) & (stat >= low) if low is not None else stat <= high
        keep_float = keep.to(log_ratio.dtype)
        keep_all = keep_all * keep_float
        metrics.update(_rs_metrics(name, stat, response_mask, seq_valid, seq_stat, high,
                                   low if low is not None else 0.0, low is not None))
        metrics[f"rollout_rs_{name}_masked_fraction"] = _item(masked_mean(1 - keep_float, response_mask))
        seq_kept = (~(~keep & bool_mask)).all(-1).to(log_ratio.dtype)
        valid = seq_valid.float()
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (
            _item(((1.0 - seq_kept) * valid).sum() / valid.sum()) if valid.sum() > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = _item(masked_mean(1 - keep_all, response_mask))
    metrics["rollout_rs_seq_masked_fraction"] = _item((~((keep_all > 0.5) & bool_mask) & bool_mask).any(-1)
                                                      .float().mean())
    return (response_mask * keep_all).to(response_mask.dtype), metrics


def _rs_metrics(name, stat, mask, seq_valid, seq_stat, high, low, two_sided) -> dict[str, float]:
    if not mask.any():
        raise ValueError("rollout correction needs at least one response token")
    prefix, bool_mask = f"rollout_rs_{name}", mask.bool()
    seq = (seq_stat if seq_stat is not None else masked_mean(stat, mask, -1))[seq_valid]
    sequence = seq_stat is not None and seq.numel() > 0
    m = {f"{prefix}_mean": _item(masked_mean(stat, mask))}
    if sequence:
        m[f"{prefix}_max"], m[f"{prefix}_min"] = _item(seq.max()), _item(seq.min())
        m[f"{prefix}_fraction_high"] = _item((seq > high).float().mean())
        m[f"{prefix}_fraction_low"] = _item((seq < low).float().mean()) if two_sided else 0.0
    else:
        m[f"{prefix}_max"] = _item(stat.masked_fill(~bool_mask, float("-inf")).max())
        m[f"{prefix}_min"] = _item(stat.masked_fill(~bool_mask, float("inf")).min())
        m[f"{prefix}_fraction_high"] = _item(masked_mean((stat > high).float(), mask))
        m[f"{prefix}_fraction_low"] = _item(masked_mean((stat < low).float(), mask)) if two_sided else 0.0
    if mask.sum() > 1:
        clamped = stat.clamp(min=low if two_sided else 0.0, max=high)
        mean = masked_mean(clamped, mask)
        m[f"{prefix}_std"] = _item((masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0.0).sqrt())
    else:
        m[f"{prefix}_std"] = 0.0
    if seq.numel() > 0:
        m.update({f"{prefix}_seq_mean": _item(seq.mean()),
                  f"{prefix}_seq_std": _item(seq.std()) if seq.numel() > 1 else 0.0,
                  f"{prefix}_seq_max": _item(seq.max()), f"{prefix}_seq_min": _item(seq.min()),
                  f"{prefix}_seq_max_deviation": _item(seq.abs().max()),
                  f"{prefix}_seq_fraction_high": _item((seq > high).float().mean())})
        if two_sided:
            m[f"{prefix}_seq_fraction_low"] = _item((seq < low).float().mean())
    else:
        m.update({f"{prefix}_{k}": 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                                  "seq_fraction_high", "seq_fraction_low")})
    return m


def mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """Return the trainer-vs-rollout gap without prefix: kl (rollout minus trainer log-prob),
    k3_kl, training/rollout perplexity and log-perplexity, log_ppl_diff (mean, |mean|, max,
    min), ppl_ratio, chi2_token and chi2_seq."""
    if not response_mask.any():
        raise ValueError("rollout correction needs at least one response token")
    train_mean = masked_mean(old_log_prob, response_mask, -1)
    roll_mean = masked_mean(rollout_log_prob, response_mask, -1)
    log_ratio = old_log_prob - rollout_log_prob
    diff = roll_mean - train_mean
    seq_sum = masked_sum(log_ratio, response_mask, -1).clamp(-BOUND, BOUND)
    return {"training_ppl": _item(torch.exp(-train_mean).mean()), "training_log_ppl": _item((-train_mean).mean()),
            "kl": _item(masked_mean(rollout_log_prob - old_log_prob, response_mask)),
            "k3_kl": _item(masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask)),
            "rollout_ppl": _item(torch.exp(-roll_mean).mean()), "rollout_log_ppl": _item((-roll_mean).mean()),
            "log_ppl_diff": _item(diff.mean()), "log_ppl_abs_diff": _item(diff.abs().mean()),
            "log_ppl_diff_max": _item(diff.max()), "log_ppl_diff_min": _item(diff.min()),
            "ppl_ratio": _item(torch.exp(diff).mean()),
            "chi2_token": _item(masked_mean(torch.exp(log_ratio.clamp(-BOUND, BOUND)).square(), response_mask) - 1.0),
            "chi2_seq": _item(torch.exp(2.0 * seq_sum).mean() - 1.0)}


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
        rollout_is: str | None = None, rollout_is_threshold: str | float | None = 2.0,
        rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
        rollout_rs_threshold: str | float | None = None) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Return (IS weights or None when ``rollout_is`` is unset, the response mask after
    rejection, metrics prefixed ``rollout_corr/``). ``old_log_prob`` is the trainer's."""
    if not response_mask.any():
        raise ValueError("rollout correction needs at least one response token")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"rollout correction: shapes differ: trainer log-probs {tuple(old_log_prob.shape)}, rollout "
                         f"log-probs {tuple(rollout_log_prob.shape)}, response mask {tuple(response_mask.shape)}")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = rollout_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                                 rollout_is_batch_normalize)
        metrics.update(is_metrics)
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_metrics = rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(mismatch_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}
