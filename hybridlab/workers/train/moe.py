"""Routed experts (Qwen3-MoE) on megatron-core: the layer settings, TP without sequence
parallelism, and what the routers did during an update.

- ``megatron_settings``: the TransformerConfig fields of a model's experts;
- ``route_whole_sequence_on_every_tp_rank``: MoE layers train at TP > 1 (see its docstring);
- ``RoutingStats``: tokens per expert and the load-balancing loss of one update.

The weight names live with the other families' in ``convert.py``; the engine adds the experts'
gradient reductions (``engine.py``) and the syncs gather them over expert-parallel ranks
(``reshard/sources.py``).
"""
from __future__ import annotations

import torch

from hybridlab.models.spec import ModelSpec

LOSS = "load_balancing_loss"  # the name Megatron's routers record their aux loss under


def megatron_settings(spec: ModelSpec, tp: int, dp: int) -> dict:
    """Return the TransformerConfig fields of a model's routed experts (empty if dense).

    Qwen3-MoE softmaxes the router logits over all experts and keeps the top k, renormalised
    when ``norm_topk_prob``. Megatron's router computes the same probabilities either way:
    softmax over the top-k logits (renormalised) or top-k of the full softmax (pre_softmax).
    The allgather dispatcher is the one whose collectives run over gloo.

    The load-balancing loss is Megatron's (per sparse layer, summed), weighted by the
    checkpoint's ``router_aux_loss_coef`` as a mean over the step's micro-batches. Two scalings
    keep it that: without sequence parallelism every TP rank routes all tokens, and Megatron,
    which counts them once per TP rank, computes ``1/tp`` of the loss; and the engine sums
    gradients over DP ranks (the main loss is a share of the global batch's), where Megatron
    averages the aux loss per rank.
    """
    moe = spec.moe
    if moe is None:
        return {}
    return dict(num_moe_experts=moe.experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.intermediate,
                moe_layer_freq=[int(spec.is_sparse(i)) for i in range(spec.layers)],
                moe_router_pre_softmax=not moe.norm_topk_prob, moe_router_score_function="softmax",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe.aux_loss_coef * tp / dp,
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_router_dtype="fp32")


def without_transformer_engine() -> None:
    """megatron-core 0.16's router reads ``te_general_gemm``, which its moe_utils defines only when
    Transformer Engine imports (a NameError otherwise, on any device): None selects its own matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class _OneRankGroup:
    """What MoELayer's training check sees in place of the TP group (it reads only ``size()``)."""

    def size(self) -> int:
        return 1


def route_whole_sequence_on_every_tp_rank(model: torch.nn.Module) -> None:
    """Let MoE layers train at TP > 1 without sequence parallelism, which Megatron refuses as
    slow. Megatron's local norms (``WrappedTorchNorm``, without Apex) cannot run sequence
    parallel, so here every TP rank routes the whole sequence: the allgather dispatcher then
    hands each expert shard the tokens of every TP rank and the combine sums them back, which is
    exact (tested against TP 1) but does not divide the experts' work over TP ranks."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):
            module.attn_tp_group = _OneRankGroup()


class RoutingStats:
    """Per-layer, per-expert token counts of one update, from hooks on the model's routers.

    Megatron's own ``track_moe_metrics`` allocates on ``cuda``, so the engine keeps its own: a
    forward hook on each router counts the real tokens it sends to each expert, and the
    load-balancing loss comes from the per-layer values Megatron's routers record in their
    aux-loss tracker. Layers are global, so pipeline stages sum their disjoint layers and
    data-parallel ranks their tokens. At TP > 1 every TP rank routes every token of its rank's
    rows (above), so one TP rank's counts are the counts, and the tracked loss is ``1/tp`` of it.
    """

    def __init__(self, model: torch.nn.Module, layers: int, experts: int):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts = torch.zeros(layers, experts, dtype=torch.float64)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs) -> None:
        if router.training:  # updates only: log-prob passes are not part of the step's routing
            _, routing_map = outputs
            padding = inputs[1] if len(inputs) > 1 else None  # [s, b], True at padding
            if padding is not None:  # padding is routed too (its output is masked), but not counted
                routing_map = routing_map[~padding.reshape(-1)]
            self.counts[router.layer_number - 1] += routing_map.sum(0).double()

    def reset(self) -> None:
        """Forget the last update's counts and losses (call before an update)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()

    def metrics(self, ps, sparse_layers: tuple[int, ...], num_microbatches: int) -> dict[str, float]:
        """Return ``moe/expert_tokens/E`` (tokens routed to expert E over the sparse layers),
        ``moe/expert_load_max`` (the busiest expert's tokens over the mean, in its layer; 1.0 is
        even) and ``moe/load_balancing_loss`` (Megatron's, per sparse layer, mean over layers
        and micro-batches; 1.0 is even routing), summed over this update's global batch."""
        import torch.distributed as dist
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracked = get_moe_layer_wise_logging_tracker().get(LOSS)
        losses = torch.zeros(self.counts.shape[0], dtype=torch.float64)
        if tracked is not None:
            losses += tracked["values"].detach().double() * ps.get_tensor_model_parallel_world_size()
        both = torch.cat([self.counts.flatten(), losses / max(num_microbatches, 1)])
        for size, group in ((ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group()),
                            (ps.get_data_parallel_world_size(), ps.get_data_parallel_group())):
            if size > 1:  # stages hold other layers, DP ranks other tokens: both add up
                dist.all_reduce(both, group=group)
        counts = both[:self.counts.numel()].view_as(self.counts)[list(sparse_layers)]
        losses = both[self.counts.numel():][list(sparse_layers)] / ps.get_data_parallel_world_size()
        load = counts / counts.mean(1, keepdim=True).clamp(min=1e-9)
        out = {f"moe/expert_tokens/{e}": float(n) for e, n in enumerate(counts.sum(0))}
        out["moe/expert_load_max"] = float(load.max())
        if tracked is not None:
            out["moe/load_balancing_loss"] = float(losses.mean())
        return out
