"""Preference losses (DPO and its variants) under TRL 1.16's ``loss_type`` names.

Every loss sees one row per pair and returns one loss per pair. A row holds the sequence
log-probs (token sums) of the chosen and rejected responses under the policy and the reference,
and their token counts:

    PreferencePairs(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)

``preference_loss`` adds several of them with weights, as TRL's ``loss_type`` list with
``loss_weights``, and returns TRL's metrics. Its ``sft`` type is the mean negative log-likelihood
of the chosen tokens, so it needs the pairs' token counts over the whole batch (``batch_tokens``)
when the pairs arrive in parts.

    sigmoid       -log sigmoid(beta x margin): DPO                             arXiv 2305.18290
    hinge         relu(1 - beta x margin): SLiC                                arXiv 2305.10425
    ipo           (length-normalised margin - 1 / (2 beta))^2                   arXiv 2310.12036
    exo_pair      reverse KL to a label-smoothed target (label_smoothing > 0)  arXiv 2402.00856
    nca_pair      noise-contrastive alignment                                  arXiv 2402.05369
    robust        DPO unbiased under label noise (label_smoothing < 0.5)       arXiv 2403.00409
    bco_pair      binary classification of chosen vs rejected rewards          arXiv 2404.04656
    sppo_hard     self-play preference optimisation with hard probabilities   arXiv 2405.00675
    apo_zero      anchored: raise chosen, lower rejected                        arXiv 2408.06266
    apo_down      anchored: lower both, rejected more                          arXiv 2408.06266
    sigmoid_norm  DPO on length-normalised log-ratios
    sft           negative log-likelihood of the chosen responses
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from hybridlab.errors import unknown


@dataclasses.dataclass
class PreferencePairs:
    """Sequence log-probs (token sums) of each pair's responses, [pairs] each, and token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @property
    def chosen_logratios(self) -> torch.Tensor:
        """log pi(chosen) - log pi_ref(chosen), per pair."""
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> torch.Tensor:
        """log pi(rejected) - log pi_ref(rejected), per pair."""
        return self.rejected - self.ref_rejected


@dataclasses.dataclass(frozen=True)
class PreferenceSettings:
    """``beta`` (the strength of the reference), ``label_smoothing`` (exo_pair, robust) and,
    for ``sft`` when the pairs are part of a batch, the batch's chosen tokens and pairs (None:
    these pairs are the batch)."""

    beta: float = 0.1
    label_smoothing: float = 0.0
    batch_tokens: float | None = None
    batch_pairs: float | None = None


PreferenceLossFn = Callable[[PreferencePairs, PreferenceSettings], torch.Tensor]
PREFERENCE_LOSSES: dict[str, PreferenceLossFn] = {}


def register_preference_loss(name: str) -> Callable[[PreferenceLossFn], PreferenceLossFn]:
    """Register a loss under ``name``: ``fn(pairs, settings)`` returns the loss of each pair."""
    def wrap(fn: PreferenceLossFn) -> PreferenceLossFn:
        PREFERENCE_LOSSES[name] = fn
        return fn
    return wrap


def _margin(p: PreferencePairs) -> torch.Tensor:
    return p.chosen_logratios - p.rejected_logratios


def _normalised_margin(p: PreferencePairs) -> torch.Tensor:
    return p.chosen_logratios / p.chosen_tokens.clamp(min=1) - p.rejected_logratios / p.rejected_tokens.clamp(min=1)


@register_preference_loss("sigmoid")
def sigmoid_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """DPO: -log sigmoid(beta x margin), per pair."""
    return -F.logsigmoid(s.beta * _margin(p))


@register_preference_loss("hinge")
def hinge_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """SLiC: relu(1 - beta x margin), per pair."""
    return torch.relu(1 - s.beta * _margin(p))


@register_preference_loss("ipo")
def ipo_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """IPO: (length-normalised margin - 1 / (2 beta))^2, per pair."""
    # IPO on log-ratios averaged per token, as TRL does (so that beta means the same at any length)
    return (_normalised_margin(p) - 1 / (2 * s.beta)) ** 2


@register_preference_loss("exo_pair")
def exo_pair_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """EXO: reverse KL to the label-smoothed target (label_smoothing in (0, 1)), per pair."""
    logits = s.beta * _margin(p)
    eps = torch.tensor(s.label_smoothing, dtype=logits.dtype)
    return (torch.sigmoid(logits) * (F.logsigmoid(logits) - torch.log1p(-eps))
            + torch.sigmoid(-logits) * (F.logsigmoid(-logits) - torch.log(eps)))


@register_preference_loss("nca_pair")
def nca_pair_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """NCA: noise-contrastive alignment of the two rewards, per pair."""
    chosen, rejected = s.beta * p.chosen_logratios, s.beta * p.rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


@register_preference_loss("robust")
def robust_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """Robust DPO, unbiased under label noise (label_smoothing < 0.5), per pair."""
    logits, eps = s.beta * _margin(p), s.label_smoothing
    return (-(1 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1 - 2 * eps)


@register_preference_loss("bco_pair")
def bco_pair_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """BCO: chosen reward classified positive, rejected negative, per pair."""
    return -F.logsigmoid(s.beta * p.chosen_logratios) - F.logsigmoid(-s.beta * p.rejected_logratios)


@register_preference_loss("sppo_hard")
def sppo_hard_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """SPPO with hard probabilities: squared distances of the log-ratios to +-1/(2 beta), per pair."""
    return (p.chosen_logratios - 0.5 / s.beta) ** 2 + (p.rejected_logratios + 0.5 / s.beta) ** 2


@register_preference_loss("apo_zero")
def apo_zero_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """APO-zero: raise the chosen likelihood, lower the rejected one, per pair."""
    return 1 - torch.sigmoid(s.beta * p.chosen_logratios) + torch.sigmoid(s.beta * p.rejected_logratios)


@register_preference_loss("apo_down")
def apo_down_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """APO-down: lower both likelihoods, the rejected one more, per pair."""
    return torch.sigmoid(s.beta * p.chosen_logratios) + 1 - torch.sigmoid(s.beta * _margin(p))


@register_preference_loss("sigmoid_norm")
def sigmoid_norm_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """DPO on length-normalised log-ratios, per pair."""
    return -F.logsigmoid(s.beta * _normalised_margin(p))


@register_preference_loss("sft")
def sft_loss(p: PreferencePairs, s: PreferenceSettings) -> torch.Tensor:
    """The chosen responses' mean negative log-likelihood over the batch, as a share per pair."""
    # the chosen tokens' mean NLL over the batch, spread over the batch's pairs so that the mean
    # of every pair's share is it
    tokens = s.batch_tokens if s.batch_tokens is not None else float(p.chosen_tokens.sum())
    pairs = s.batch_pairs if s.batch_pairs is not None else len(p.chosen)
    return -p.chosen * pairs / max(tokens, 1.0)


def check_preference_settings(loss_types: list[str], weights: list[float] | None, label_smoothing: float,
                              beta: float) -> list[str]:
    """Return every problem of these settings (empty when they can run), each naming the key."""
    problems = [f"dpo.loss_type: {t!r} is not one of {', '.join(PREFERENCE_LOSSES)}"
                for t in loss_types if t not in PREFERENCE_LOSSES]
    if not loss_types:
        problems.append(f"dpo.loss_type: give at least one of {', '.join(PREFERENCE_LOSSES)}")
    if weights is not None and len(weights) != len(loss_types):
        problems.append(f"dpo.loss_weights: {len(weights)} weight(s) for {len(loss_types)} loss type(s)")
    if not beta > 0:
        problems.append(f"dpo.beta: must be positive, got {beta}")
    if "exo_pair" in loss_types and not 0 < label_smoothing < 1:
        problems.append(f"dpo.label_smoothing: exo_pair needs it in (0, 1), got {label_smoothing}")
    if "robust" in loss_types and not 0 <= label_smoothing < 0.5:
        problems.append(f"dpo.label_smoothing: robust needs it in [0, 0.5), got {label_smoothing}")
    return problems


def preference_loss(pairs: PreferencePairs, loss_types: list[str], weights: list[float] | None = None,
                    settings: PreferenceSettings = PreferenceSettings()) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (the weighted sum of each type's mean loss over the pairs, TRL's metrics: loss,
    rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen and
    logps/rejected, each a mean over the pairs)."""
    for name in loss_types:
        if name not in PREFERENCE_LOSSES:
            raise unknown("preference loss", name, PREFERENCE_LOSSES)
    problems = check_preference_settings(loss_types, weights, settings.label_smoothing, settings.beta)
    if problems:
        raise ValueError("; ".join(problems))
    loss = sum(PREFERENCE_LOSSES[t](pairs, settings).mean() * w
               for t, w in zip(loss_types, weights or [1.0] * len(loss_types)))
    chosen = settings.beta * pairs.chosen_logratios.detach()
    rejected = settings.beta * pairs.rejected_logratios.detach()
    metrics = {"loss": loss.detach(), "rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
               "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean(),
               "logps/chosen": pairs.chosen.detach().mean(), "logps/rejected": pairs.rejected.detach().mean()}
    return loss, {k: float(v) for k, v in metrics.items()}


CHOSEN_TOKENS = "chosen_tokens_total"  # per-row field: the chosen response tokens of the whole mini-batch


def dpo_loss_fn(loss_types: list[str], weights: list[float] | None = None, beta: float = 0.1,
                label_smoothing: float = 0.0) -> Callable[[dict, dict], tuple[torch.Tensor, dict]]:
    """Return a training-engine loss (``workers.train.backend.LossFn``) for a batch of pairs laid
    out chosen, rejected, chosen, ... (``packing.GROUP_ROWS`` 2, so a pair never straddles two
    micro-batches), with the reference's per-token log-probs in ``ref_log_prob`` and
    ``CHOSEN_TOKENS``. Each micro-batch returns its pairs' share of the mini-batch's mean loss;
    rows whose responses are all masked (padding the engine added) are left out."""
    def loss_fn(outputs: dict, micro: dict) -> tuple[torch.Tensor, dict]:
        mask = micro["response_mask"].to(outputs["log_probs"].dtype)
        logps = (outputs["log_probs"] * mask).sum(-1)
        ref = (micro["ref_log_prob"].to(mask.dtype) * mask).sum(-1)
        tokens = mask.sum(-1)
        real = (tokens[0::2] > 0) & (tokens[1::2] > 0)
        pairs = PreferencePairs(logps[0::2][real], logps[1::2][real], ref[0::2][real], ref[1::2][real],
                                tokens[0::2][real], tokens[1::2][real])
        batch_pairs = float(micro["global_seqs"]) / 2  # every real row has a response token (at least EOS)
        settings = PreferenceSettings(beta, label_smoothing, float(micro[CHOSEN_TOKENS][0]), batch_pairs)
        loss, metrics = preference_loss(pairs, loss_types, weights, settings)
        return loss * (int(real.sum()) / batch_pairs), metrics
    return loss_fn
