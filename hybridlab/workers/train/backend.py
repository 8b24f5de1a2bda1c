"""The contract between the training workers (actor, reference, critic) and a training backend.

A backend is one module with an engine class that holds one rank's share of the model and its
optimizer. The workers (``workers.py``) only call what ``TrainEngine`` lists, so a new backend
is a new module plus a row of ``BACKENDS``; nothing of the dataflow, the algorithms or the
dashboard knows which backend runs. Every tensor that leaves an engine is in Hugging Face
names and layout (whole tensors for checkpoints, HF-named slices for the weight sync), which is
what makes checkpoints, remaps and syncs independent of the backend and of its layout.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from pathlib import Path
from typing import Callable, Protocol

import torch

from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec

# loss_fn(outputs, micro) -> (loss, metrics). outputs holds log_probs and entropy (actor) or
# values (critic), [micro_batch, response_len]. The loss is this micro-batch's *contribution*:
# contributions are summed over micro-batches and data-parallel ranks, so normalise by
# micro["global_tokens"] (response tokens in the whole mini-batch) or micro["global_seqs"].
# That makes the gradient independent of the micro-batch size and of the layout.
LossFn = Callable[[dict, dict], tuple[torch.Tensor, dict]]

PRECISIONS = ("fp32", "bf16")

# strategy -> "module:Class"; imported on first use, so a process loads only its own backend
STRATEGIES = ("auto", "megatron", "fsdp2")  # what actor.strategy / critic.strategy take
BACKENDS = {"megatron": "hybridlab.workers.train.engine:MegatronEngine",
            "fsdp2": "hybridlab.workers.train.fsdp_engine:FSDPEngine"}


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule of a trainable role."""

    lr: float              # these four come from the role's config section (settings.TrainSettings)
    weight_decay: float
    grad_clip: float
    warmup_steps: int
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    total_steps: int = 0          # 0: constant after warm-up; else cosine decay to min_lr_ratio
    min_lr_ratio: float = 0.0
    optimizer: str = "adamw"      # "adamw" or "sgd"

    def lr_factor(self, step: int) -> float:
        """Return the multiplier of ``lr`` at optimizer step ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.total_steps:
            return 1.0
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def make_optimizer(params: list[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.Optimizer:
    """Return the optimizer ``optim`` names over ``params``."""
    if optim.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                 weight_decay=optim.weight_decay)
    if optim.optimizer == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, weight_decay=optim.weight_decay)
    raise ValueError(f"unknown optimizer {optim.optimizer!r}; choose adamw or sgd")


def check_precision(precision: str) -> str:
    """Return ``precision`` if a backend computes in it; raises ValueError naming the choices."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def set_lr(engine: "TrainEngine") -> float:
    """Set the optimizer's learning rate for the engine's next step (warm-up and decay); returns it."""
    lr = engine.optim_cfg.lr * engine.optim_cfg.lr_factor(engine.step_count)
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
    return lr


def global_totals(batch, group, dp_size: int, device: torch.device | str = "cpu") -> dict:
    """Return the whole mini-batch's response tokens and sequences with at least one of them
    (summed over the ``dp_size`` ranks of ``group``, None: the default group, as tensors on
    ``device`` for the collective), and ``dp_size``:
    what a loss divides by to be one rank's share of the total."""
    import torch.distributed as dist

    mask = batch.tensors.get("response_mask")
    seqs = float((mask.sum(-1) > 0).sum()) if mask is not None else float(len(batch))  # as verl: empty rows don't count
    local = torch.tensor([float(mask.sum()) if mask is not None else 0.0, seqs], device=device)
    if dp_size > 1:
        dist.all_reduce(local, group=group)
    local = local.cpu()
    return {"global_tokens": local[0].clamp(min=1), "global_seqs": local[1].clamp(min=1), "dp_size": dp_size}


def resolve_strategy(strategy: str, model_dir: str | Path, spec: ModelSpec | None = None) -> str:
    """Return the backend that runs ``model_dir`` for a configured ``strategy``: itself, or for
    ``auto`` megatron where hybridlab converts the architecture and its settings, else fsdp2.
    ``spec``, the checkpoint's ``ModelSpec.read``, answers without reading its config again."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown training strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy != "auto":
        return strategy
    if spec is not None:  # read() falls back to an unconverted spec exactly where from_hf refuses
        return "megatron" if spec.converted else "fsdp2"
    try:
        ModelSpec.from_hf(model_dir)
    except UserError:
        return "fsdp2"
    return "megatron"


def engine_class(strategy: str) -> type:
    """Return the engine class of a training backend (``megatron`` or ``fsdp2``)."""
    if strategy not in BACKENDS:
        raise ValueError(f"unknown training strategy {strategy!r}; choose one of {', '.join(BACKENDS)}")
    module, name = BACKENDS[strategy].split(":")
    return getattr(importlib.import_module(module), name)


class TrainEngine(Protocol):
    """One rank's model and optimizer. Settings the workers change between steps are plain
    attributes; everything else is a method. "HF" means Hugging Face names and layout."""

    precision: str                  # "fp32" or "bf16" (autocast; weights and moments stay fp32)
    temperature: float              # log-probs of logits / temperature
    micro_batch_tokens: int         # token budget per micro-batch (0: by row count)
    remove_padding: bool            # pack micro-batches without padding
    optim_cfg: OptimConfig | None
    optimizer: torch.optim.Optimizer | None   # None: frozen (the reference)
    step_count: int

    def dp_info(self) -> tuple[int, int, bool]:
        """Return (dp rank, dp size, whether this rank answers for its DP share)."""

    def forward(self, batch, micro_batch_size: int, sum_pi_squared: bool = False) -> dict | None:
        """Return log_probs and entropy (values for a critic), [batch, response_len], on answering ranks."""

    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """Take one optimizer step of ``loss_fn`` over the batch; return DP-averaged metrics,
        grad_norm, lr, skipped and padded_token_share."""

    def state(self, moments: bool = True) -> dict | None:
        """Return {"model", and with ``moments`` "exp_avg", "exp_avg_sq": {HF name: whole
        tensor}, "adam_step"} for the part of the model this rank reports (None on ranks that
        report nothing)."""

    def load_state(self, weights: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]],
                   step: int, adam_step: float) -> None:
        """Load whole HF ``weights`` (if any) and AdamW ``moments`` (if any) into this rank's shards."""

    def export_slices(self, hf_names: list[str], dp_ranks: list[int]) -> tuple[int, int, int, dict] | None:
        """Return (tp rank, pp rank, dp rank, {HF name: slice}) of a sync bucket if this rank's
        DP rank is in ``dp_ranks``, else None (every rank must call it: some backends gather)."""

    def stream_colocated(self, buckets: list[list[str]], load: Callable) -> dict:
        """Hand each bucket of whole HF tensors to ``load`` in this process; return
        {"bytes", "buckets", "seconds"}."""
