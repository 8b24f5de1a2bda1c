"""Training roles: actor, reference and critic workers for the controller, on any training backend."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from hybridlab.batching import GROUP_ROWS
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.models.spec import ModelSpec
from hybridlab.protocol import PAD_KEY, Batch
from hybridlab.workers.train.backend import LossFn, TrainEngine, engine_class, resolve_strategy
from hybridlab.workers.train.checkpoint import merge_state
from hybridlab.workers.train.settings import TrainSettings, apply_live


def sft_loss(outputs: dict, micro: dict) -> tuple[torch.Tensor, dict]:
    """Supervised loss: negative log-likelihood of the response tokens, averaged over every
    response token of the mini-batch; returns (this micro-batch's share, metrics)."""
    mask = micro["response_mask"].float()
    nll_sum = -(outputs["log_probs"] * mask).sum()
    return nll_sum / micro["global_tokens"], {"sft_loss": nll_sum.detach() / mask.sum().clamp(min=1)}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class TrainWorker(Worker):
    """Shared plumbing of the training roles over any backend (``backend.TrainEngine``):
    engine construction, live settings, weight export and checkpoint state in HF layout."""

    value_head = False
    frozen = False

    def __init__(self, model_dir: str, settings: TrainSettings, tp: int = 1, pp: int = 1, ep: int = 1,
                 spec: ModelSpec | None = None):
        """``spec``: the checkpoint's ``ModelSpec.read``, as the controller read it (``roles.py``).
        Given, a Megatron process never imports transformers (about 1.4 s of CPU) to read it again."""
        self.model_dir, self.spec = model_dir, spec
        self.micro_batch_size, self.seed = settings.section.micro_batch_size, settings.seed
        self.lora = settings.lora
        self.strategy = self._backend(settings.section.strategy)
        if self.shares_actor:  # the actor's base model with its adapter off: no engine of its own
            self._engine = None
            return
        # megatron only: expert parallelism (refused for fsdp2 on load) and the spec (fsdp2 builds
        # the model with transformers, which reads the checkpoint itself)
        only = {**({"ep": ep} if ep > 1 else {}), **({"spec": spec} if self.strategy == "megatron" else {})}
        self._engine = engine_class(self.strategy)(model_dir, settings, tp, pp, **only, value_head=self.value_head,
                                                   trainable=not self.frozen)

    def _backend(self, strategy: str) -> str:
        """Return the backend a configured ``strategy`` means for this worker (LoRA: fsdp2)."""
        if not self.lora:
            return resolve_strategy(strategy, self.model_dir, self.spec)
        if strategy == "megatron":
            raise ValueError("LoRA (actor.lora.rank > 0) runs on the fsdp2 backend; actor.strategy is megatron")
        return "fsdp2"

    @property
    def shares_actor(self) -> bool:
        """True for a LoRA run's reference, which computes with the actor's engine."""
        return False

    @property
    def engine(self) -> TrainEngine:
        """This rank's training engine."""
        return self._engine

    def dp_info(self) -> tuple[int, int, bool]:
        return self.engine.dp_info()

    @register(Dispatch.ALL)
    def export_hf(self) -> dict[str, torch.Tensor] | None:
        """Return the weights in HF names and layout (from one rank per pipeline stage; a LoRA
        actor's with the adapter merged in), else None."""
        if self.lora:
            return self.engine.merged_weights()
        state = self.engine.state(moments=False)
        return None if state is None else state["model"]

    @register(Dispatch.ALL)
    def checkpoint_state(self) -> dict | None:
        """Return this stage's weights and optimizer moments in HF layout, plus step and RNG."""
        state = self.engine.state()
        if state is None:
            return None
        return {**state, "step": self.engine.step_count, "rng": torch.get_rng_state()}

    @register(Dispatch.ALL)
    def configure(self, settings: TrainSettings) -> None:
        """Apply the role's new settings to the running worker (between steps): micro-batching
        (rows, token budget, packing), log-prob temperature, compute precision (fp32 or bf16
        autocast; weights and moments stay fp32) and optimizer settings (lr, weight decay,
        clipping, warm-up), keeping the optimizer's moments and the schedule's position. The seed
        and the strategy are only checked: they are fixed (``fsdp`` and ``lora`` are fixed too:
        a change of ``fsdp`` re-creates the role)."""
        if settings.seed != self.seed:
            raise ValueError(f"the seed is fixed once a worker runs (have {self.seed}, got {settings.seed})")
        if self._backend(settings.section.strategy) != self.strategy:
            raise ValueError(f"the training strategy is fixed once a worker runs (have {self.strategy},"
                             f" got {settings.section.strategy})")
        apply_live(self.engine, settings)
        self.micro_batch_size = settings.section.micro_batch_size
        if self.engine.optimizer is not None:  # the schedule's position is the engine's step count
            self.engine.optim_cfg = settings.optim()
            for group in self.engine.optimizer.param_groups:
                group["weight_decay"] = settings.section.weight_decay

    @register(Dispatch.ALL)
    def settings(self) -> dict:
        """Return this rank's live settings: micro-batching, temperature, precision, optim (a
        dict) and the backend."""
        optim = dataclasses.asdict(self.engine.optim_cfg) if self.engine.optimizer is not None else None
        return {"micro_batch_size": self.micro_batch_size, "micro_batch_tokens": self.engine.micro_batch_tokens,
                "remove_padding": self.engine.remove_padding, "temperature": self.engine.temperature,
                "optim": optim, "precision": self.engine.precision, "strategy": self.strategy}

    @register(Dispatch.ALL)
    def load_state(self, boxed: list) -> None:
        """Load training state from ``checkpoint_state`` of the role's previous workers (any
        layout, any backend) into this rank's shards: weights, AdamW moments, step counter and RNG.

        ``boxed`` is ``[ObjectRef of the list of parts]``: wrapped in a list so that Ray passes
        the reference and each rank fetches the state from the object store (never a file)."""
        import ray

        parts = [p for p in ray.get(boxed[0]) if p]
        merged = merge_state(parts)
        first = parts[0]
        moments = {m: merged[m] for m in ("exp_avg", "exp_avg_sq") if merged[m]}
        self.engine.load_state(merged["model"], moments, first["step"], first.get("adam_step", 0.0))
        torch.set_rng_state(first["rng"])

    @register(Dispatch.ALL)
    def load_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], step: int, adam_step: float,
                             rng: list[int] | None = None) -> None:
        """Load AdamW moments given in HF layout (any source layout) into this rank's shards,
        with the step counter and the saved RNG state."""
        self.engine.load_state({}, moments, step, adam_step)
        if rng is not None:
            torch.set_rng_state(torch.tensor(rng, dtype=torch.uint8))


class ActorWorker(TrainWorker):
    """The policy: log-probs of its own samples, PPO-style updates, supervised steps, and the
    source of weight syncs to the rollout engines."""

    @register(Dispatch.ALL)
    def export_slices(self, hf_names: list[str], dp_ranks: list[int]):
        """Put this rank's slices of a bucket (HF names) in Ray's object store if its
        data-parallel rank feeds a rollout replica; returns (tp rank, pp rank, dp rank,
        reference, bytes), else None. The rollout ranks join the slices (``reshard.sources``)."""
        import ray

        out = self.engine.export_slices(hf_names, dp_ranks)
        if out is None or not out[3]:
            return None
        tp_rank, pp_rank, dp_rank, part = out
        return tp_rank, pp_rank, dp_rank, ray.put(part), _nbytes(part)

    @register(Dispatch.ALL)
    def sync_to_colocated(self, role: str, buckets: list[list[str]]) -> dict:
        """Stream the weights, bucket by bucket, into the ``role`` engine of this same process
        (``reshard.sources.stream_colocated``); returns {"bytes", "buckets", "seconds"}."""
        return self.engine.stream_colocated(buckets, self.peers[role].load_weights)

    @register(Dispatch.ALL)
    def export_adapter(self) -> tuple | None:
        """Put the LoRA adapter (whole tensors in PEFT's file names, and its config) in Ray's
        object store from rank 0; returns (reference, bytes) there, None elsewhere (every rank
        joins the gathers)."""
        import ray

        tensors, config = self.engine.adapter()
        if self.rank != 0:
            return None
        return ray.put((tensors, config)), _nbytes(tensors)

    @register(Dispatch.ALL)
    def sync_adapter_to_colocated(self, role: str) -> int:
        """Install the LoRA adapter in the ``role`` engine of this same process; returns the bytes."""
        tensors, config = self.engine.adapter()
        self.peers[role].load_adapter(tensors, config)
        return _nbytes(tensors)

    @register(Dispatch.DP)
    def compute_log_prob(self, batch: Batch, sum_pi_squared: bool = False) -> Batch:
        """Return ``old_log_probs`` and ``entropy`` of the responses, [batch, response_len], and
        with ``sum_pi_squared`` the sum of squared token probabilities per position."""
        out = self.engine.forward(batch, self.micro_batch_size, sum_pi_squared=sum_pi_squared)
        if out is None:
            return None
        fields = {"old_log_probs": out["log_probs"], "entropy": out["entropy"]}
        if sum_pi_squared:
            fields["sum_pi_squared"] = out["sum_pi_squared"]
        return Batch(fields)

    @register(Dispatch.DP)
    def update_actor(self, batches: list[Batch], loss_fn: LossFn) -> list[dict]:
        """Take one optimizer step of ``loss_fn`` per mini-batch, in order (a step's updates in one
        call); returns each step's metrics (DP-averaged). A failed step stops those after it."""
        for batch in batches:
            group = batch.meta.get(GROUP_ROWS, 1)
            if group > 1 and batch.meta.get(PAD_KEY):  # the DP split padded with copies of real rows
                raise ValueError(f"rows grouped by {group} ({GROUP_ROWS}) must split evenly over the actor's"
                                 " data-parallel ranks: give a multiple of dp x that many rows")
        return [self.engine.train_step(batch, loss_fn, self.micro_batch_size) for batch in batches]

    @register(Dispatch.DP)
    def sft_step(self, batch: Batch) -> dict:
        """Take one optimizer step of the supervised loss on the responses; returns metrics."""
        return self.engine.train_step(batch, sft_loss, self.micro_batch_size)


class RefWorker(TrainWorker):
    """The frozen reference policy. In a LoRA run it is the actor's base model with the adapter
    off: it uses the actor's engine in the same process and holds no weights of its own."""

    frozen = True

    @property
    def shares_actor(self) -> bool:
        """True in a LoRA run: the reference is the actor's base model, computed in the actor's engine."""
        return bool(self.lora)

    @property
    def engine(self) -> TrainEngine:
        """Return the engine the reference computes with: its own, or in a LoRA run the colocated actor's."""
        if not self.shares_actor:
            return self._engine
        actor = self.peers.get("actor")
        if actor is None:
            raise RuntimeError("a LoRA run's reference is the actor's base model: the ref role must be colocated"
                               " with the actor (the same colocate name in the mapping)")
        return actor.engine

    @register(Dispatch.DP)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Return ``ref_log_prob`` of the responses, [batch, response_len]."""
        with self.engine.without_adapter() if self.shares_actor else contextlib.nullcontext():
            out = self.engine.forward(batch, self.micro_batch_size)
        return None if out is None else Batch({"ref_log_prob": out["log_probs"]})


class CriticWorker(TrainWorker):
    """The value model: the actor's architecture with a scalar head."""

    value_head = True

    @register(Dispatch.DP)
    def compute_values(self, batch: Batch) -> Batch:
        """Return ``values`` for the states before each response token, [batch, response_len]."""
        out = self.engine.forward(batch, self.micro_batch_size)
        return None if out is None else Batch({"values": out["values"]})

    @register(Dispatch.DP)
    def update_critic(self, batches: list[Batch], loss_fn: LossFn) -> list[dict]:
        """Take one optimizer step of the value loss per mini-batch, in order; returns each step's
        metrics (DP-averaged)."""
        return [self.engine.train_step(batch, loss_fn, self.micro_batch_size) for batch in batches]
