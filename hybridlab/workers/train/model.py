"""Build a megatron-core GPTModel for one rank from an HF checkpoint, and the parallel state."""
from __future__ import annotations

import torch

from hybridlab.controller.worker import Worker
from hybridlab.models.spec import ModelSpec, rope_inv_freq
from hybridlab.workers.train import cpu_compat, moe
from hybridlab.workers.train.convert import hf_to_megatron


def init_parallel(tp: int, pp: int, seed: int, ep: int = 1) -> None:
    """Join torch.distributed (env rendezvous) and set up Megatron's TP/PP/DP (and expert) groups once.

    Roles colocated in one process share this state, so they must use the same tp, pp and ep.
    """
    import torch.distributed as dist

    from hybridlab.workers.train import megatron_import  # noqa: F401  (first: Megatron without torch.compile)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu_compat.enable()
    Worker.init_distributed()
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tp, pp, ep):
            raise ValueError(f"this process already runs Megatron with tp={have[0]}, pp={have[1]}, ep={have[2]};"
                             f" colocated training roles must share one layout (asked tp={tp}, pp={pp}, ep={ep})")
        return
    if dist.get_world_size() % (tp * pp * ep):
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tp x pp x ep = {tp * pp * ep}")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(spec: ModelSpec, tp: int, pp: int, dtype: torch.dtype = torch.float32, dp: int = 1):
    """Return the megatron-core TransformerConfig matching an HF model of a supported family."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, ffn_hidden_size=spec.intermediate,
        num_attention_heads=spec.heads, num_query_groups=spec.kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.eps, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        qk_layernorm=spec.qk_norm, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=dtype,
        pipeline_dtype=dtype, use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False, rotary_interleaved=False, attention_softmax_in_fp32=True,
        bf16=dtype == torch.bfloat16, **moe.megatron_settings(spec, tp, dp))


def _sdpa_attention_class():
    """Return a DotProductAttention that runs torch's fused scaled_dot_product_attention.

    megatron-core's local attention materialises the scores with baddbmm + masked softmax +
    bmm; on CPU torch's SDPA kernel is about twice as fast and gives the same numbers. The
    mask keeps Megatron's convention (True = do not attend) and its finite fill value, so a
    fully padded query row stays finite instead of producing NaN.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)
            # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                     enable_gqa=True)
            else:
                bias = torch.zeros(attention_mask.shape, dtype=q.dtype).masked_fill_(attention_mask, -10000.0)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.softmax_scale,
                                                     enable_gqa=True)
            # [b, heads, s, dim] -> [s, b, heads * dim]
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

        def _packed(self, query, key, value, cu_seqlens):
            """Causal attention within each segment of a packed sequence ([t, heads, dim]);
            returns [t, heads * dim]. Segments of one length run as one batched call: many short
            rows would otherwise cost a kernel launch each, slower than the padded layout."""
            bounds = cu_seqlens.tolist()
            by_length: dict[int, list[int]] = {}
            for start, end in zip(bounds[:-1], bounds[1:]):
                by_length.setdefault(end - start, []).append(start)
            order, parts = [], []
            for length, starts in by_length.items():
                rows = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).reshape(-1)
                # [n * length, heads, dim] -> [n, heads, length, dim]
                q, k, v = (t[rows].reshape(len(starts), length, *t.shape[1:]).transpose(1, 2)
                           for t in (query, key, value))
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                     enable_gqa=True)
                parts.append(att.transpose(1, 2).reshape(len(starts) * length, -1))
                order.append(rows)
            return torch.cat(parts)[torch.argsort(torch.cat(order))]  # back in the packed order

    return SDPAttention


class ValueHead(torch.nn.Module):
    """Scalar head replacing the LM output layer of a critic (replicated on every TP rank)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, 1, bias=True)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return self.linear(hidden_states), None


def build_model(spec: ModelSpec, tp: int, pp: int, hf_state: dict[str, torch.Tensor], value_head: bool = False):
    """Return this rank's GPTModel holding its shard of ``hf_state`` (a critic if ``value_head``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = transformer_config(spec, tp, pp, dp=ps.get_data_parallel_world_size())
    moe.without_transformer_engine()
    if spec.moe is None:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
        layers = [layer_spec]
    else:  # dense and sparse layers as the config's pattern says, this stage's slice
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                                pp_rank=ps.get_pipeline_model_parallel_rank())
        layers = layer_spec.layer_specs
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                     vocab_size=spec.vocab_size, max_sequence_length=spec.max_positions,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     parallel_output=True, share_embeddings_and_output_weights=spec.tied and not value_head,
                     position_embedding_type="rope", rotary_base=int(spec.rope_theta))
    if spec.moe is not None and tp > 1:
        moe.route_whole_sequence_on_every_tp_rank(model)
    inv_freq = rope_inv_freq(spec)  # scaled RoPE (llama3, linear): transformers' frequencies
    if inv_freq is not None:
        model.rotary_pos_emb.inv_freq = inv_freq.to(model.rotary_pos_emb.inv_freq)
    state = hf_to_megatron(hf_state, spec, tp, ps.get_tensor_model_parallel_rank(), pp,
                           ps.get_pipeline_model_parallel_rank(), ep=ps.get_expert_model_parallel_world_size(),
                           ep_rank=ps.get_expert_model_parallel_rank())
    if value_head:
        state.pop("output_layer.weight", None)
        if ps.is_pipeline_last_stage():
            model.output_layer = ValueHead(spec.hidden)
            for k in ("linear.weight", "linear.bias"):
                if f"value_head.{k}" in hf_state:
                    state[f"output_layer.{k}"] = hf_state[f"value_head.{k}"].clone()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith("output_layer.linear")]
    if missing or unexpected:
        raise RuntimeError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model
