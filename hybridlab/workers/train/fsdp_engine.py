"""FSDPEngine: one rank's share of any transformers causal LM under torch FSDP2 (``fully_shard``).

The second training backend beside Megatron (``backend.py`` has the contract). It takes the
checkpoint's architecture as transformers builds it, so it needs no converter; in exchange it
shards over data-parallel ranks only (tp = pp = 1). Every decoder layer (the classes the model
lists in ``_no_split_modules``) and then the whole model are sharded along dim 0 over the
role's ranks (gloo on CPU, nccl on GPU). Parameter names are the checkpoint's own, so
checkpoints, remaps and weight syncs speak HF layout with no conversion.

Gradients: FSDP2 averages them over ranks, while our losses are each rank's share of the
mini-batch total (``backend.LossFn``), so each backward runs on ``loss * dp``. Every rank runs
the same number of micro-batches (FSDP gathers each layer with a collective): a rank with
fewer runs empty ones whose loss is zero and whose outputs are dropped.

Packed micro-batches (``remove_padding``) lay the rows end to end in one sequence with
position ids that restart per row and no attention mask; transformers' masking then builds a
block-diagonal causal mask from the position ids, so attention stays inside each row.

With LoRA (``lora.py``) peft wraps the model before sharding and only the adapter trains: the
optimizer, checkpoints and (by default) weight syncs carry the adapter alone, and the reference
policy is this same model with the adapter switched off (``without_adapter``).
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from hybridlab.controller.worker import Worker
from hybridlab.workers.train import lora, packing
from hybridlab.workers.train.backend import LossFn, global_totals, make_optimizer, set_lr
from hybridlab.workers.train.fsdp_model import build_model, logprobs_entropy
from hybridlab.workers.train.settings import TrainSettings, apply_live

MOMENTS = ("exp_avg", "exp_avg_sq")


class FSDPEngine:
    """This rank's FSDP2 shard of a transformers model, with optional optimizer."""

    def __init__(self, model_dir: str, settings: TrainSettings, tp: int = 1, pp: int = 1, *, value_head: bool = False,
                 trainable: bool = True):
        if tp != 1 or pp != 1:
            raise ValueError(f"the fsdp2 backend shards over data-parallel ranks only: tp and pp must be 1"
                             f" (got tp={tp}, pp={pp}); use strategy megatron for tensor or pipeline parallelism")
        self.value_head = value_head
        apply_live(self, settings)  # precision, temperature, micro-batching (packing.py)
        param_offload, optimizer_offload = settings.section.fsdp.param_offload, settings.section.fsdp.optimizer_offload
        Worker.init_distributed()
        self.rank, self.dp = dist.get_rank(), dist.get_world_size()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if (param_offload or optimizer_offload) and self.device.type == "cuda" and self.dp > 1:
            # the gradient norm, the state gathers and the sync run collectives on the offloaded
            # host tensors, which nccl cannot take; not built yet
            raise ValueError("fsdp offload (param_offload, optimizer_offload) runs at dp 1 on GPU so far;"
                             f" this role has dp {self.dp}")
        torch.manual_seed(settings.seed)  # the same adapter initialisation on every rank
        model = build_model(model_dir, value_head).to(self.device)
        layer_classes = set(model._no_split_modules or ())
        self.lora, self.lora_layers, self.adapter_config = settings.lora, {}, None
        if self.lora is not None:
            model = lora.add_adapter(model, self.lora)
            lora.check_linear_only(model)
            self.lora_layers = lora.lora_layers(model)  # HF weight name -> the peft layer wrapping it
            self.adapter_config = lora.adapter_config(model, model_dir)
        shard = {"mesh": init_device_mesh(self.device.type, (self.dp,))}
        if param_offload:  # shards (and so the optimizer step) live in host memory between uses
            from torch.distributed.fsdp import CPUOffloadPolicy

            shard["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        self.optimizer_offload = optimizer_offload and not param_offload
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, **shard)
        self.model = fully_shard(model, **shard)
        self.params = dict(self.model.named_parameters())  # HF names (peft's names with LoRA)
        # HF name -> the parameter (LoRA: the frozen base weights)
        self.hf_params = {lora.hf_name(n): p for n, p in self.params.items() if lora.saved_name(n) is None}
        # what trains and what a checkpoint holds, by checkpoint name: the whole model, or the adapter
        self.saved = self.hf_params if self.lora is None else \
            {lora.saved_name(n): p for n, p in self.params.items() if lora.saved_name(n)}
        self.optim_cfg = settings.optim() if trainable else None
        self.step_count = 0
        self.padded_token_share = 0.0
        self.optimizer = None
        if trainable:
            self.optimizer = make_optimizer(list(self.saved.values()), self.optim_cfg)
        else:
            self.model.requires_grad_(False)

    def dp_info(self) -> tuple[int, int, bool]:
        """Return (dp rank, dp size, answers): every rank answers for its own rows."""
        return self.rank, self.dp, True

    # ------------------------------------------------------------- micro-batches
    def _micro_batches(self, batch, micro_batch_size: int) -> list[packing.MicroBatch | None]:
        """This rank's micro-batches, followed by None up to the largest count on any rank."""
        micros = packing.micro_batches(batch.tensors, micro_batch_size, self.micro_batch_tokens, self.remove_padding,
                                       group=batch.meta.get(packing.GROUP_ROWS, 1))
        self.padded_token_share = packing.padded_share(micros, int(batch["attention_mask"].sum()))
        count = torch.tensor([len(micros)], device=self.device)  # nccl reduces device tensors only
        if self.dp > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return micros + [None] * (int(count) - len(micros))

    def _autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _outputs(self, micro: packing.MicroBatch, sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """Run the model on one micro-batch; return its per-response-token outputs, [rows,
        response_len] (zeros at padding when packed)."""
        t = {k: v.to(self.device) for k, v in micro.tensors.items()}
        resp_len = t["responses"].shape[1]
        targets = t["responses"]
        if micro.packed:
            ids = micro.packed["input_ids"].to(self.device)
            cu = micro.packed["cu_seqlens"].long()
            starts = torch.repeat_interleave(cu[:-1], cu.diff())
            positions = (torch.arange(ids.shape[1]) - starts).unsqueeze(0).to(self.device)
            real = t["attention_mask"][:, -resp_len:].bool()
            where = micro.packed["response_index"].to(self.device)[real]  # the logits that predict them
            out = self._call(ids, None, positions, keep=where)[0]
            targets = targets[real]
        else:
            mask = t["attention_mask"]
            positions = t.get("position_ids")
            if positions is None:
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            out = self._call(t["input_ids"], mask, positions, keep=resp_len + 1)[:, :-1]
        if self.value_head:
            named = {"values": out[..., 0].float()}
        else:
            names = ("log_probs", "entropy", "sum_pi_squared")
            named = dict(zip(names, logprobs_entropy(out.float() / self.temperature, targets, sum_pi_squared)))
        return packing.spread(named, real) if micro.packed else named

    def _call(self, ids, mask, positions, keep: int | torch.Tensor) -> torch.Tensor:
        """Run the model; return logits (values for a critic) at the positions ``keep`` selects:
        the last ``keep`` ones, or those indices (transformers' ``logits_to_keep``: the LM head
        runs on them alone, never on the whole vocabulary x sequence)."""
        if self.value_head:
            values = self.model(ids, attention_mask=mask, position_ids=positions)
            return values[:, -keep:] if isinstance(keep, int) else values[:, keep]
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                          logits_to_keep=keep).logits

    def _empty(self) -> packing.MicroBatch:
        """A one-token micro-batch that keeps this rank in step with the others' collectives."""
        one = torch.ones(1, 2, dtype=torch.long)
        return packing.MicroBatch({"input_ids": one, "attention_mask": one, "responses": one[:, :1],
                                   "response_mask": torch.zeros(1, 1)}, [], 2)

    # -------------------------------------------------------------- public API
    @torch.no_grad()
    def forward(self, batch, micro_batch_size: int, sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """Return log_probs and entropy (or values for a critic) for the response tokens,
        [batch, response_len], and with ``sum_pi_squared`` the sum of squared probabilities."""
        self.model.eval()
        micros = self._micro_batches(batch, micro_batch_size)
        outs = []
        with self._autocast():
            for micro in micros:
                out = self._outputs(micro or self._empty(), sum_pi_squared)
                if micro is not None:
                    outs.append({k: v.float().cpu() for k, v in out.items()})
        # FSDP keeps the root's parameters gathered after a forward with no backward: free them,
        # and so that a later load_state (a rollback) is what the next forward sees
        self.model.reshard()
        real = [m for m in micros if m is not None]
        return {k: packing.gather_rows([o[k] for o in outs], real, len(batch)) for k in outs[0]}

    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over micro-batches (summed over DP), clip and step.

        Returns metrics averaged over micro-batches and DP ranks, plus grad_norm, lr, skipped
        (1.0 when the gradient norm was NaN or inf and the step was skipped) and padded_token_share."""
        if self.optimizer is None:
            raise RuntimeError("this engine is frozen (no optimizer): it cannot train")
        self.optimizer.zero_grad(set_to_none=True)
        _, store = self.accumulate(batch, loss_fn, micro_batch_size)
        metrics = self._reduce_metrics(store)
        metrics.update(self.step_optimizer(), padded_token_share=self.padded_token_share)
        return metrics

    def accumulate(self, batch, loss_fn: LossFn, micro_batch_size: int) -> tuple[torch.Tensor, list[dict]]:
        """Add the gradients of ``loss_fn`` over the batch's micro-batches to the parameters'
        (no optimizer step); returns the response tokens' log-probs (a critic's values), [batch,
        response_len], and each micro-batch's metrics."""
        self.model.train()
        micros = self._micro_batches(batch, micro_batch_size)
        totals = global_totals(batch, None, self.dp, self.device)
        store, logprobs = [], []
        with self._autocast():
            for micro in micros:
                outputs = self._outputs(micro or self._empty())
                if micro is None:
                    loss = sum(v.sum() for v in outputs.values()) * 0.0
                else:
                    inputs = {**{k: v.to(self.device) for k, v in micro.tensors.items()}, **totals,
                              "num_microbatches": len(micros), **({"packed": micro.packed} if micro.packed else {})}
                    loss, metrics = loss_fn(outputs, inputs)
                    store.append({k: torch.as_tensor(v).detach().float().cpu() for k, v in metrics.items()})
                    logprobs.append(outputs["values" if self.value_head else "log_probs"].detach().float().cpu())
                (loss * self.dp).backward()  # FSDP averages over ranks; the shares must add up
        real = [m for m in micros if m is not None]
        return packing.gather_rows(logprobs, real, len(batch)) if real else torch.zeros(0), store

    def step_optimizer(self) -> dict[str, float]:
        """Clip the accumulated gradients, set the scheduled learning rate and step (skipped when
        the gradient norm is NaN or inf); returns grad_norm, lr and skipped."""
        grad_norm = self._clip_grads(self.optim_cfg.grad_clip)
        lr = set_lr(self)
        finite = math.isfinite(grad_norm)
        if finite:
            self._offload_moments(False)
            self.optimizer.step()
            self._offload_moments(True)
        self.step_count += 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0 if finite else 1.0}

    def _offload_moments(self, out: bool) -> None:
        """With optimizer offload, move AdamW's moments to host memory (``out``) between steps and
        back to the device for the step (verl's ``optimizer_offload``; on a CPU-only machine
        they are in host memory already and nothing moves)."""
        if not self.optimizer_offload or self.device.type == "cpu":
            return
        where = "cpu" if out else self.device
        for state in self.optimizer.state.values():
            for key in MOMENTS:
                if key in state:
                    state[key] = state[key].to(where)

    def _clip_grads(self, max_norm: float) -> float:
        grads = [p.grad.to_local() for p in self.saved.values() if p.grad is not None]
        total = torch.stack([g.float().pow(2).sum() for g in grads]).sum().reshape(1) if grads \
            else torch.zeros(1, device=self.device)
        if self.dp > 1:  # each rank holds distinct rows of every gradient
            dist.all_reduce(total)
        norm = total.sqrt().item()
        if max_norm and max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    def _reduce_metrics(self, store: list[dict]) -> dict[str, float]:
        keys = sorted(store[0]) if store else []
        if self.dp > 1:  # a rank with no micro-batch of its own still joins the average
            gathered = [None] * self.dp
            dist.all_gather_object(gathered, keys)
            keys = next(k for k in gathered if k) if any(gathered) else []
        local = torch.tensor([float(torch.stack([s[k].mean() for s in store]).mean()) for k in keys]) \
            if store else torch.zeros(len(keys))
        local = local.to(self.device)
        if self.dp > 1 and keys:
            dist.all_reduce(local)
            local /= self.dp
        return dict(zip(keys, local.cpu().tolist()))

    # ------------------------------------------------- state and weight sync (HF layout)
    def _whole(self, tensor) -> torch.Tensor:
        return tensor.full_tensor().cpu()  # a collective: every rank calls it in the same order

    def _hf_whole(self, name: str) -> torch.Tensor:
        """Return the whole tensor of HF weight ``name``, with the adapter folded in (LoRA); a
        collective."""
        if name in self.lora_layers:
            return lora.merged_weight(self.lora_layers[name], lambda p: self._whole(p.detach()))
        if name not in self.hf_params:  # the sync would leave the rollout's tensor stale
            raise KeyError(f"the weight sync asks for {name!r}, which this {type(self.model).__name__} does not have")
        return self._whole(self.hf_params[name].detach())

    def state(self, moments: bool = True) -> dict | None:
        """Return the whole weights (with LoRA: the adapter's, under PEFT's file names, and its
        ``adapter_config``) and (with ``moments``) AdamW moments on rank 0, None elsewhere
        (every rank must call it: each tensor is all-gathered in turn)."""
        keep = self.rank == 0
        state = {"model": {}}
        for name, p in self.saved.items():
            whole = self._whole(p.detach())
            if keep:
                state["model"][name] = whole
        if self.lora is not None:
            state["adapter_config"] = self.adapter_config
        if moments and isinstance(self.optimizer, torch.optim.AdamW):
            for moment in MOMENTS:
                state[moment] = {}
                for name, p in self.saved.items():
                    whole = self._whole(self.optimizer.state[p][moment]) if p in self.optimizer.state \
                        else torch.zeros(p.shape)
                    if keep:
                        state[moment][name] = whole
            steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
            state["adam_step"] = max(steps) if steps else 0.0
        return state if keep else None

    def _shard(self, p, whole: torch.Tensor):
        # every rank holds the whole tensor: each keeps its own rows, no communication
        return distribute_tensor(whole.to(p.device, torch.float32), p.device_mesh, p.placements,
                                 src_data_rank=None)

    def load_state(self, weights: dict, moments: dict, step: int, adam_step: float) -> None:
        """Load whole ``weights`` (if any; HF names, or with LoRA the adapter's PEFT names) and
        AdamW ``moments`` (if any) into this rank's shards; raises KeyError naming a parameter
        the weights do not cover."""
        if weights:
            with torch.no_grad():
                for name, p in self.saved.items():
                    if name not in weights:
                        what = "adapter weights" if self.lora is not None and not any(".lora_" in k for k in weights) \
                            else "weights"
                        raise KeyError(f"the saved state has no {what} for {name}")
                    p.to_local().copy_(self._shard(p, weights[name]).to_local())
        self.step_count = step
        if self.optimizer is None or not moments:
            return
        for name, p in self.saved.items():
            self.optimizer.state[p] = {"step": torch.tensor(float(adam_step)),
                                       **{m: self._shard(p, moments[m][name]) for m in MOMENTS}}

    def export_slices(self, hf_names: list[str], dp_ranks: list[int]) -> tuple[int, int, int, dict] | None:
        """Return (0, 0, dp rank, whole HF tensors of the bucket) if this rank feeds a rollout
        replica, else None; every rank joins each tensor's all-gather."""
        part = {}
        for name in hf_names:
            whole = self._hf_whole(name)
            if self.rank in dp_ranks:
                part[name] = whole
        return (0, 0, self.rank, part) if self.rank in dp_ranks else None

    def stream_colocated(self, buckets: list[list[str]], load: Callable) -> dict:
        """All-gather each bucket on every rank and hand it to ``load`` (the engine in this
        process), one bucket at a time; returns {"bytes", "buckets", "seconds"}."""
        start, moved = time.perf_counter(), 0
        for bucket in buckets:
            named = [(n, self._hf_whole(n)) for n in bucket]
            moved += sum(t.numel() * t.element_size() for _, t in named)
            load(named)
        return {"bytes": moved, "buckets": len(buckets), "seconds": time.perf_counter() - start}

    # ----------------------------------------------------------------------- LoRA
    def merged_weights(self) -> dict[str, torch.Tensor] | None:
        """Return every HF weight whole, with the adapter folded in, on rank 0 (None elsewhere;
        every rank joins the gathers): the model a LoRA run has trained, as a plain checkpoint."""
        weights = {name: self._hf_whole(name) for name in self.hf_params}
        return weights if self.rank == 0 else None

    def adapter(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Return the adapter's whole weights (PEFT's file names) and its PEFT config, on every
        rank (each tensor is all-gathered)."""
        if self.lora is None:
            raise RuntimeError("this engine has no LoRA adapter (actor.lora.rank is 0)")
        return {name: self._whole(p.detach()) for name, p in self.saved.items()}, self.adapter_config

    def without_adapter(self):
        """Return a context in which the model runs as its base (the adapter off): the
        reference policy of a LoRA run."""
        if self.lora is None:
            raise RuntimeError("this engine has no LoRA adapter (actor.lora.rank is 0)")
        return self.model.disable_adapter()
