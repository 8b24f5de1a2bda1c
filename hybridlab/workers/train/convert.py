"""Hugging Face (Qwen2/3, Qwen3-MoE, Llama, Mistral) <-> megatron-core weights, any TP x PP layout.

Megatron's local layer spec fuses QKV per key/value group as [q heads of the group; k; v] and
fc1 as [gate; up] *per TP shard*, keeps norms as separate modules, and numbers each pipeline
stage's layers from 0. A sparse (MoE) layer holds the router (``mlp.router``, HF's ``mlp.gate``,
whole on every TP rank) and its experts as ``mlp.experts.local_experts.{k}``, each an MLP cut
over TP as the dense one; with expert parallelism a rank holds ``experts / ep`` of them, so
local expert ``k`` of EP rank ``r`` is expert ``r * experts / ep + k``.

The functions here are pure (no process groups): ``hf_to_megatron`` cuts one rank's shard out
of full HF tensors; ``megatron_to_hf`` joins the TP shards of one pipeline stage (all of its
experts) back into HF tensors. Optimizer moments shaped like the weights convert the
same way, which is what makes checkpoints layout-independent.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec


def _stage_layers(spec: ModelSpec, pp: int, pp_rank: int) -> range:
    per = spec.layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _fuse_qkv(spec: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[q; k; v] by rows -> Megatron's per-group [q_g; k_g; v_g] (works for weights and biases)."""
    d, per = spec.head_dim, spec.heads // spec.kv_heads
    rest = q.shape[1:]
    q = q.reshape(spec.kv_heads, per * d, *rest)
    k = k.reshape(spec.kv_heads, d, *rest)
    v = v.reshape(spec.kv_heads, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(spec: ModelSpec, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, per = spec.head_dim, spec.heads // spec.kv_heads
    rest = fused.shape[1:]
    groups = fused.reshape(spec.kv_heads, (per + 2) * d, *rest)
    q, k, v = groups.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def local_experts(spec: ModelSpec, ep: int, ep_rank: int) -> range:
    """Return the global indices of the experts EP rank ``ep_rank`` of ``ep`` holds."""
    per = spec.moe.experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def hf_to_megatron(hf: dict[str, torch.Tensor], spec: ModelSpec, tp: int, tp_rank: int, pp: int,
                   pp_rank: int, head: bool = True, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """Return the Megatron state dict of rank (tp_rank, pp_rank, ep_rank) cut from full HF
    tensors; ``head=False`` leaves out the output layer (a critic's value head replaces it)."""
    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[tp_rank].clone()

    def mlp(src: str, dst: str) -> None:  # an HF gate/up/down MLP -> Megatron fc1 [gate; up], fc2
        out[dst + "linear_fc1.weight"] = torch.cat([shard(hf[src + "gate_proj.weight"], 0),
                                                     shard(hf[src + "up_proj.weight"], 0)])
        out[dst + "linear_fc2.weight"] = shard(hf[src + "down_proj.weight"], 1)

    out: dict[str, torch.Tensor] = {}
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = shard(hf["model.embed_tokens.weight"], 0)
    for local, layer in enumerate(_stage_layers(spec, pp, pp_rank)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        out[dst + "self_attention.linear_qkv.weight"] = shard(_fuse_qkv(
            spec, hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"]), 0)
        if spec.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = shard(_fuse_qkv(
                spec, hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]), 0)
        out[dst + "self_attention.linear_proj.weight"] = shard(hf[attn + "o_proj.weight"], 1)
        if spec.qk_norm:  # one [head_dim] weight shared by every head: whole on each TP rank
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"].clone()
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        if spec.is_sparse(layer):
            out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"].clone()
            for k, expert in enumerate(local_experts(spec, ep, ep_rank)):
                mlp(f"{src}mlp.experts.{expert}.", f"{dst}mlp.experts.local_experts.{k}.")
        else:
            mlp(src + "mlp.", dst + "mlp.")
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if head and (not spec.tied or pp > 1):  # tied + PP>1: the last stage keeps its own embedding copy
            table = hf["model.embed_tokens.weight"] if spec.tied else hf["lm_head.weight"]
            out["output_layer.weight"] = shard(table, 0)
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], spec: ModelSpec, pp: int,
                   pp_rank: int) -> dict[str, torch.Tensor]:
    """Return the HF tensors of pipeline stage ``pp_rank`` joined from its TP shards (in TP order)."""
    def join(name: str, dim: int) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    # Tensors absent from the shards are skipped, so a subset (one bucket of layers) converts too.
    out: dict[str, torch.Tensor] = {}
    have = shards[0]
    if "embedding.word_embeddings.weight" in have:
        out["model.embed_tokens.weight"] = join("embedding.word_embeddings.weight", 0)
    for local, layer in enumerate(_stage_layers(spec, pp, pp_rank)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        attn = dst + "self_attn."
        for kind in ("weight", "bias"):
            if src + f"self_attention.linear_qkv.{kind}" not in have:
                continue
            # Each TP shard holds whole key/value groups; split groups per shard, then re-join.
            parts = [_split_qkv(dataclasses.replace(spec, heads=spec.heads // len(shards),
                                                    kv_heads=spec.kv_heads // len(shards)),
                                s[src + f"self_attention.linear_qkv.{kind}"]) for s in shards]
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[attn + f"{proj}.{kind}"] = torch.cat([p[i] for p in parts])
        mlps = [("mlp.", "mlp.")]
        if spec.is_sparse(layer):
            mlps = [(f"mlp.experts.local_experts.{k}.", f"mlp.experts.{e}.")
                    for k, e in enumerate(local_experts(spec, 1, 0))]
            if src + "mlp.router.weight" in have:
                out[dst + "mlp.gate.weight"] = have[src + "mlp.router.weight"]
        for mega, hf in mlps:
            if src + mega + "linear_fc1.weight" in have:
                fc1 = [s[src + mega + "linear_fc1.weight"].chunk(2) for s in shards]
                out[dst + hf + "gate_proj.weight"] = torch.cat([g for g, _ in fc1])
                out[dst + hf + "up_proj.weight"] = torch.cat([u for _, u in fc1])
            if src + mega + "linear_fc2.weight" in have:
                out[dst + hf + "down_proj.weight"] = join(src + mega + "linear_fc2.weight", 1)
        for mega, hf, dim in (("input_layernorm.weight", "input_layernorm.weight", None),
                              ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", None),
                              ("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", None),
                              ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", None),
                              ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", 1)):
            if src + mega in have:
                out[dst + hf] = have[src + mega] if dim is None else join(src + mega, dim)
    if "decoder.final_layernorm.weight" in have:
        out["model.norm.weight"] = have["decoder.final_layernorm.weight"]
    if not spec.tied and "output_layer.weight" in have:
        out["lm_head.weight"] = join("output_layer.weight", 0)
    return out


def megatron_names(spec: ModelSpec, pp: int, pp_rank: int, hf_names: list[str], ep: int = 1,
                   ep_rank: int = 0) -> list[str]:
    """Return the Megatron parameter names of stage ``pp_rank`` (and EP rank ``ep_rank``) that
    hold the given HF tensors; experts of other EP ranks are left out."""
    layers = list(_stage_layers(spec, pp, pp_rank))
    mine = local_experts(spec, ep, ep_rank) if spec.moe is not None else range(0)
    out = []
    for name in hf_names:
        if name == "model.embed_tokens.weight" and pp_rank == 0:
            out.append("embedding.word_embeddings.weight")
        elif name == "model.norm.weight" and pp_rank == pp - 1:
            out.append("decoder.final_layernorm.weight")
        elif name == "lm_head.weight" and pp_rank == pp - 1:
            out.append("output_layer.weight")
        elif name.startswith("model.layers.") and int(name.split(".")[2]) in layers:
            local = layers.index(int(name.split(".")[2]))
            part = name.split(".", 3)[3]
            mapped = {"input_layernorm.weight": "input_layernorm.weight",
                      "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
                      "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
                      "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
                      "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
                      "mlp.gate.weight": "mlp.router.weight"}.get(part)
            if mapped is None and part.startswith("self_attn."):
                mapped = "self_attention.linear_qkv." + part.rsplit(".", 1)[1]
            elif mapped is None:  # mlp.[experts.E.]{gate,up,down}_proj.weight
                fc = "linear_fc2.weight" if part.endswith("down_proj.weight") else "linear_fc1.weight"
                if ".experts." not in part:
                    mapped = "mlp." + fc
                elif int(part.split(".")[2]) in mine:
                    mapped = f"mlp.experts.local_experts.{int(part.split('.')[2]) - mine.start}.{fc}"
                else:
                    continue
            out.append(f"decoder.layers.{local}.{mapped}")
    return list(dict.fromkeys(out))


def load_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Return every tensor of an HF checkpoint directory (safetensors), in fp32."""
    from safetensors.torch import load_file

    # model*.safetensors covers sharded checkpoints; value_head.safetensors is a critic's head.
    files = sorted(Path(model_dir).glob("model*.safetensors")) + sorted(Path(model_dir).glob("value_head.safetensors"))
    if not files:
        raise UserError(f"{model_dir}: no model*.safetensors weights found")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    return state
