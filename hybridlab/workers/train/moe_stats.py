"""What an MoE model's routers did during one update: tokens per expert and the load-balancing loss.

Megatron's own ``track_moe_metrics`` allocates on ``cuda``, so the engine keeps its own: a
forward hook on each router counts the real tokens it sends to each expert, and the
load-balancing loss comes from the per-layer values Megatron's routers record in their aux-loss
tracker. Layers are global, so pipeline stages sum their disjoint
layers and data-parallel ranks their tokens. At TP > 1 every TP rank routes every token of its
rank's rows (``model.py``), so one TP rank's counts are the counts, and the tracked loss is
``1/tp`` of it (Megatron divides by the token count of every TP rank).
"""
from __future__ import annotations

import torch

LOSS = "load_balancing_loss"  # the name Megatron's routers record their aux loss under


class RoutingStats:
    """Per-layer, per-expert token counts of one update, from hooks on the model's routers."""

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
        for size, group, op in ((ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_group(),
                                 dist.ReduceOp.SUM),
                                (ps.get_data_parallel_world_size(), ps.get_data_parallel_group(), dist.ReduceOp.SUM)):
            if size > 1:
                dist.all_reduce(both, op=op, group=group)
        counts = both[:self.counts.numel()].view_as(self.counts)[list(sparse_layers)]
        losses = both[self.counts.numel():][list(sparse_layers)] / ps.get_data_parallel_world_size()
        load = counts / counts.mean(1, keepdim=True).clamp(min=1e-9)
        out = {f"moe/expert_tokens/{e}": float(n) for e, n in enumerate(counts.sum(0))}
        out["moe/expert_load_max"] = float(load.max())
        if tracked is not None:
            out["moe/load_balancing_loss"] = float(losses.mean())
        return out
