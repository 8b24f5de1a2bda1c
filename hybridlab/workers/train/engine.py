"""MegatronEngine: one rank's model, optimizer and the forward/backward passes the RL roles use.

Inputs follow verl's layout: ``input_ids`` = prompt (left-padded) + response (right-padded),
``attention_mask``, ``position_ids`` and ``responses``. Log-probabilities and entropies come
from vocabulary-parallel logits without gathering the vocabulary on one rank. Updates run
through megatron-core's pipeline schedules (micro-batches, gradient accumulation), then the
gradients are averaged over data-parallel ranks, clipped and stepped with AdamW. The loss is
passed in, so the engine knows nothing of PPO versus GRPO.
"""
from __future__ import annotations

import contextlib
import math
from functools import partial
import torch

from hybridlab.models.spec import ModelSpec
from hybridlab.reshard.sources import local_slices, stream_colocated
from hybridlab.workers.train import cpu_compat  # noqa: F401  (filters megatron's import warnings)
from hybridlab.workers.train import megatron_state, packing
from hybridlab.workers.train.backend import LossFn, global_totals, make_optimizer, set_lr
from hybridlab.workers.train.convert import load_hf_state
from hybridlab.workers.train.model import build_model, init_parallel
from hybridlab.workers.train.moe import RoutingStats
from hybridlab.workers.train.settings import TrainSettings, apply_live



def vocab_parallel_logprobs_entropy(logits: torch.Tensor, target: torch.Tensor, sum_pi_squared: bool = False):
    """Return (log p(target), entropy) from logits split over TP ranks along the vocabulary, and
    with ``sum_pi_squared`` a third tensor: the sum of p^2 over the vocabulary per position (the
    optimal token baselines' path-variance term).

    The loss is replicated on TP ranks, so the sums use Megatron's all-reduce whose backward is
    the identity (each rank already holds the full upstream gradient).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as allsum

    tp = ps.get_tensor_model_parallel_world_size()
    shard = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * shard
    peak = logits.detach().max(-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - peak
    exp = shifted.exp()
    total = exp.sum(-1, keepdim=True)
    local = target - start
    inside = (local >= 0) & (local < shard)
    picked = shifted.gather(-1, local.clamp(0, shard - 1).unsqueeze(-1)).squeeze(-1) * inside
    if tp > 1:
        total, picked = allsum(total), allsum(picked)
    log_total = total.log()
    expected = (exp / total * shifted).sum(-1)
    if tp > 1:
        expected = allsum(expected)
    out = (picked - log_total.squeeze(-1), log_total.squeeze(-1) - expected)
    if not sum_pi_squared:
        return out
    squares = exp.detach().square().sum(-1)
    if tp > 1:
        dist.all_reduce(squares, group=ps.get_tensor_model_parallel_group())
    return (*out, squares / total.detach().squeeze(-1).square())


def _replicated(name: str) -> bool:
    return "layernorm" in name or name.startswith("output_layer.linear") or name.endswith("mlp.router.weight")


def attention_mask_4d(mask: torch.Tensor) -> torch.Tensor:
    """[b, s] 1/0 token mask -> Megatron's [b, 1, s, s] bool mask (True = do not attend)."""
    s = mask.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    return (causal.unsqueeze(0) | ~mask.bool().unsqueeze(1)).unsqueeze(1)


class MegatronEngine:
    """This rank's share of a model under megatron-core, with optional optimizer."""

    def __init__(self, model_dir: str, settings: TrainSettings, tp: int = 1, pp: int = 1, ep: int = 1, *,
                 value_head: bool = False, trainable: bool = True, spec: ModelSpec | None = None):
        # ``spec``: the checkpoint's, read by the controller; an unconverted one (or none) is read
        # here again, so that from_hf names what the build cannot reproduce
        self.spec = spec if spec is not None and spec.converted else ModelSpec.from_hf(model_dir)
        self.spec.check_layout(tp, pp, ep)
        init_parallel(tp, pp, settings.seed, ep)
        from megatron.core import parallel_state as ps

        self.ps, self.tp, self.pp, self.ep = ps, tp, pp, ep
        self.value_head = value_head
        apply_live(self, settings)  # precision, temperature, micro-batching (packing.py)
        torch.manual_seed(settings.seed)
        self.model = build_model(self.spec, tp, pp, load_hf_state(model_dir), value_head=value_head)
        self.optim_cfg = settings.optim() if trainable else None
        self.step_count = 0
        self.padded_token_share = 0.0   # of the last forward or update
        self.optimizer = None
        self.routing = RoutingStats(self.model, self.spec.layers, self.spec.moe.experts) if self.spec.moe else None
        if trainable:
            self.optimizer = make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optim_cfg)
        else:
            self.model.requires_grad_(False)

    # ------------------------------------------------------------------ layout
    def dp_info(self) -> tuple[int, int, bool]:
        """Return (dp rank, dp size, answers): TP rank 0 of the last pipeline stage answers."""
        ps = self.ps
        collect = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), collect

    # ------------------------------------------------- state and weight sync (HF layout)
    def state(self, moments: bool = True) -> dict | None:
        """Return this stage's weights and AdamW moments as whole HF tensors (``megatron_state``)."""
        return megatron_state.hf_state(self, moments)

    def load_state(self, weights: dict, moments: dict, step: int, adam_step: float) -> None:
        """Load whole HF weights and moments (any source layout) into this rank's shards."""
        megatron_state.load_hf_state(self, weights, moments, step, adam_step)

    def export_slices(self, hf_names: list[str], dp_ranks: list[int]) -> tuple[int, int, int, dict] | None:
        """Return (tp, pp, dp rank, this rank's HF-named slices of the bucket) if its DP rank
        feeds a rollout replica, else None; no communication, except that with expert
        parallelism every rank first gathers its EP group's experts (each holds some)."""
        ps = self.ps
        feeds = ps.get_data_parallel_rank() in dp_ranks
        slices = local_slices(self, hf_names) if feeds or self.ep > 1 else None  # EP: every rank joins the gather
        if not feeds:
            return None
        return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                ps.get_data_parallel_rank(), slices)

    def stream_colocated(self, buckets: list[list[str]], load) -> dict:
        """Gather each bucket on every rank and hand it to ``load`` (``reshard.sources``)."""
        return stream_colocated(self, buckets, load)

    # ------------------------------------------------------------- micro-batches
    def _forward_step(self, loss_fn: LossFn | None, data_iterator, model):
        micro = next(data_iterator)
        if "packed" in micro:
            from megatron.core.packed_seq_params import PackedSeqParams

            packed = micro["packed"]
            cu, longest = packed["cu_seqlens"], packed["max_seqlen"]
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest)
            ids = packed["input_ids"]
            padding = torch.arange(ids.shape[1]).unsqueeze(0) >= packed["real_tokens"]
            output = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), None, packed_seq_params=params,
                           **self._moe_padding(padding))
            return output, partial(self._loss, loss_fn, micro)
        mask = micro["attention_mask"]
        position_ids = micro.get("position_ids")
        if position_ids is None:
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        # Without padding the mask is plain causal, which the attention kernel applies itself.
        mask_4d = None if bool(mask.all()) else attention_mask_4d(mask)
        output = model(micro["input_ids"], position_ids, mask_4d, **self._moe_padding(~mask.bool()))
        return output, partial(self._loss, loss_fn, micro)

    def _moe_padding(self, padding: torch.Tensor) -> dict:
        """Return the model's padding_mask argument (True: padding) for an MoE model with padding:
        padding then stays out of the routing, the token counts and the load-balancing loss."""
        # A micro-batch of filler rows only (expert parallelism, when a rank holds fewer rows than
        # micro-batches) is routed unmasked: Megatron's loss would divide by its zero real tokens.
        moe = self.spec.moe is not None and bool(padding.any()) and not bool(padding.all())
        return {"padding_mask": padding} if moe else {}

    def _autocast(self):
        """bf16: matmuls in bf16, weights, gradients and optimizer state stay fp32 (autocast).
        It spans the whole schedule, backward included: Megatron's linear layers compute their
        input gradients in a custom autograd function that would otherwise meet bf16 gradients
        with fp32 weights."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)

    def _outputs(self, output: torch.Tensor, micro: dict) -> dict:
        """Return the per-response-token outputs, [rows, response_len]. Packed, only the real
        response tokens are computed (zeros stand at the padding)."""
        resp_len = micro["responses"].shape[1]
        targets = micro["responses"]
        if "packed" in micro:
            real = micro["attention_mask"][:, -resp_len:].bool()
            output = output[0, micro["packed"]["response_index"][real]]  # [real tokens, vocab or 1]
            targets = targets[real]
        else:
            output = output[:, -resp_len - 1:-1]
        if self.value_head:  # value of the state before each response token
            named = {"values": output[..., 0].float()}
        else:
            logits = output.float() / self.temperature  # bf16 logits: softmax in fp32
            names = ("log_probs", "entropy", "sum_pi_squared")
            named = dict(zip(names, vocab_parallel_logprobs_entropy(logits, targets,
                                                                    bool(micro.get("sum_pi_squared")))))
        return packing.spread(named, real) if "packed" in micro else named

    def _loss(self, loss_fn: LossFn | None, micro: dict, output: torch.Tensor):
        outputs = self._outputs(output, micro)
        if loss_fn is None:  # forward only: hand the outputs back through the metrics channel
            return output.sum() * 0.0, {k: v.detach() for k, v in outputs.items()}
        loss, metrics = loss_fn(outputs, micro)
        # Megatron divides each micro-batch loss by the number of micro-batches; undo that, as the
        # loss is already a share of the mini-batch total. (Metrics are copied: the schedule
        # divides the returned tensor in place.)
        return loss * micro["num_microbatches"], {k: torch.as_tensor(v).detach().clone().float()
                                                  for k, v in metrics.items()}

    def _run(self, batch, micro_batch_size: int, loss_fn: LossFn | None,
             sum_pi_squared: bool = False) -> tuple[list[dict], list[packing.MicroBatch]]:
        """Run the schedule over the batch's micro-batches; return what the last stage stored
        per micro-batch and the micro-batches (their rows, for putting outputs back in order)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # Pipeline stages exchange activations of one shape: packs are padded alike at PP > 1.
        group = batch.meta.get(packing.GROUP_ROWS, 1)
        if self.ep > 1:  # the experts' all-gather needs one micro-batch count and shape on the EP group
            micros = packing.even_micro_batches(batch.tensors, micro_batch_size, self._ep_rows(len(batch)), group)
        else:
            micros = packing.micro_batches(batch.tensors, micro_batch_size, self.micro_batch_tokens,
                                           self.remove_padding, one_length=self.pp > 1, group=group)
        totals = global_totals(batch, self.ps.get_data_parallel_group(), self.ps.get_data_parallel_world_size())
        inputs = [{**m.tensors, **totals, "num_microbatches": len(micros), "sum_pi_squared": sum_pi_squared,
                   **({"packed": m.packed} if m.packed else {})} for m in micros]
        self.padded_token_share = packing.padded_share(micros, int(batch["attention_mask"].sum()))
        shape = (micros[0].packed or micros[0].tensors)["input_ids"].shape
        with self._autocast():
            store = get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn), data_iterator=iter(inputs),
                model=[self.model], num_microbatches=len(inputs), seq_length=shape[1],
                micro_batch_size=shape[0], forward_only=loss_fn is None)
        return store, micros

    def _ep_rows(self, rows: int) -> int:
        """Return the most rows any rank of this rank's expert-parallel group holds (padded micro-
        batches of that many rows have one shape and count on every rank of the group)."""
        import torch.distributed as dist

        most = torch.tensor([rows])
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.ps.get_expert_model_parallel_group())
        return int(most)

    # -------------------------------------------------------------- public API
    @torch.no_grad()
    def forward(self, batch, micro_batch_size: int,
                sum_pi_squared: bool = False) -> dict[str, torch.Tensor] | None:
        """Return log_probs and entropy (or values for a critic) for the response tokens,
        [batch, response_len], and with ``sum_pi_squared`` the sum of squared token
        probabilities per position, on the answering rank; None on the other ranks."""
        self.model.eval()
        store, micros = self._run(batch, micro_batch_size, None, sum_pi_squared=sum_pi_squared)
        if not store:
            return None
        return {k: packing.gather_rows([s[k] for s in store], micros, len(batch)) for k in store[0]}

    def train_step(self, batch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over micro-batches, average over DP, clip and step.

        Returns metrics averaged over micro-batches (and DP ranks), plus grad_norm, lr and
        ``skipped`` (1.0 when the gradient norm was NaN or inf and the optimizer step was skipped).
        """
        if self.optimizer is None:
            raise RuntimeError("this engine is frozen (no optimizer): it cannot train")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.routing is not None:
            self.routing.reset()
        store, micros = self._run(batch, micro_batch_size, loss_fn)
        padded_token_share = self.padded_token_share
        self._finalize_grads()
        grad_norm = self._clip_grads(self.optim_cfg.grad_clip)
        lr = set_lr(self)
        finite = math.isfinite(grad_norm)  # a NaN/inf loss or gradient: skip the update, keep the weights
        if finite:
            self.optimizer.step()
        self.step_count += 1
        metrics = self._reduce_metrics(store)
        metrics.update(grad_norm=grad_norm, lr=lr, skipped=0.0 if finite else 1.0,
                       padded_token_share=padded_token_share)
        if self.routing is not None:
            metrics.update(self.routing.metrics(self.ps, self.spec.moe.sparse_layers, len(micros)))
        return metrics

    # ------------------------------------------------------------------ grads
    def _finalize_grads(self) -> None:
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        ps = self.ps
        params = [p for p in self.model.parameters() if p.grad is not None]
        if ps.get_pipeline_model_parallel_world_size() > 1 and self.spec.tied and not self.value_head:
            # The first stage's embedding and the last stage's output layer are one weight.
            if ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage():
                shared = self.model.shared_embedding_or_output_weight()
                if shared is not None and shared.grad is not None:
                    dist.all_reduce(shared.grad, group=ps.get_embedding_group())
        if self.spec.qk_norm and ps.get_tensor_model_parallel_world_size() > 1:
            # Each TP rank normalises only its own heads with the shared q/k norm weights, so
            # each holds a part of their gradient (as megatron's finalize_model_grads sums).
            for name, p in self.model.named_parameters():
                if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        if self.spec.moe is not None and ps.get_tensor_model_parallel_world_size() > 1:
            # Every TP rank routes the whole sequence (model.py, no sequence parallelism), so each
            # token reaches the experts once per TP rank: their gradients add up tp times.
            for name, p in self.model.named_parameters():
                if p.grad is not None and ".experts." in name:
                    p.grad.div_(ps.get_tensor_model_parallel_world_size())
        # Losses are shares of the global mini-batch loss, so DP gradients add up (no mean). An
        # expert-parallel rank's experts saw the tokens of its whole EP group already: their
        # gradients add up over the ranks holding the same experts (the expert-DP group) only.
        experts = {id(p) for n, p in self.model.named_parameters() if ".experts." in n} if self.ep > 1 else set()
        for members, group in (([p for p in params if id(p) not in experts], ps.get_data_parallel_group()),
                               ([p for p in params if id(p) in experts], ps.get_expert_data_parallel_group())):
            if members and dist.get_world_size(group) > 1:
                flat = _flatten_dense_tensors([p.grad for p in members])
                dist.all_reduce(flat, group=group)
                for p, g in zip(members, _unflatten_dense_tensors(flat, [p.grad for p in members])):
                    p.grad.copy_(g)

    def _clip_grads(self, max_norm: float) -> float:
        import torch.distributed as dist

        ps = self.ps
        total, experts = torch.zeros(1), torch.zeros(1)
        last_shared = (ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_pipeline_last_stage()
                       and self.spec.tied and not self.value_head)
        shared = self.model.shared_embedding_or_output_weight() if last_shared else None
        for name, p in self.model.named_parameters():
            if p.grad is None or p is shared:  # count the tied embedding once (first stage)
                continue
            # Norms and the value head are replicated on TP ranks (count them once); everything
            # else is a shard. (Megatron's tensor_model_parallel attribute is unset when weights
            # are created on the CPU without initialization, so names decide.)
            if self.ep > 1 and ".experts." in name:  # each EP rank holds other experts
                experts += p.grad.float().pow(2).sum()
            elif not _replicated(name) or ps.get_tensor_model_parallel_rank() == 0:
                total += p.grad.float().pow(2).sum()
        if self.ep > 1:
            dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
            total += experts
        for size, group in ((ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()),
                            (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group())):
            if size > 1:
                dist.all_reduce(total, group=group)
        norm = total.sqrt().item()
        if max_norm and max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _reduce_metrics(self, store: list[dict]) -> dict[str, float]:
        import torch.distributed as dist

        ps = self.ps
        keys = sorted(store[0]) if store else []
        local = torch.tensor([float(torch.stack([s[k].mean() for s in store]).mean()) for k in keys]) \
            if keys else torch.zeros(0)
        # Only last-stage ranks hold metrics: share the key count through the pipeline first.
        if ps.get_pipeline_model_parallel_world_size() > 1:
            obj = [keys]
            dist.broadcast_object_list(obj, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            keys = obj[0]
            if not store:
                local = torch.zeros(len(keys))
            dist.broadcast(local, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        if ps.get_data_parallel_world_size() > 1 and len(keys):
            dist.all_reduce(local, group=ps.get_data_parallel_group())
            local /= ps.get_data_parallel_world_size()
        return dict(zip(keys, local.tolist()))
