"""What a Hugging Face checkpoint's config says about its architecture, read into a ModelSpec.

The Megatron build (``workers/train/model.py``) reproduces four dense families and Qwen3-MoE exactly. Each
family is a row of ``FAMILIES``; every config setting that would change the model's numbers
and that the build does not reproduce is refused here, by name, before any worker starts:
training a model that silently differs from the checkpoint is worse than not training it.
transformers reads the config first, so both spellings of rope scaling (``rope_scaling`` of
transformers 4, ``rope_parameters`` of transformers 5) arrive as one ``rope_parameters``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hybridlab.errors import UserError


@dataclasses.dataclass(frozen=True)
class Family:
    """How one model family differs from Llama in the Megatron build."""

    qkv_bias: bool = False   # biases on q/k/v (not on the output projection)
    qk_norm: bool = False    # RMSNorm over each query and key head before RoPE
    moe: bool = False        # routed experts in place of the MLP (in the layers the config names)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True, moe=True),
}
SUPPORTED = tuple(FAMILIES)
# RoPE variants whose frequencies the build computes (with transformers' own functions); the
# others change attention by position-dependent scaling the build does not reproduce.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The architecture facts the conversion and the model builder need."""

    arch: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    tied: bool
    qkv_bias: bool
    max_positions: int
    qk_norm: bool = False
    rope: tuple[tuple[str, Any], ...] = ()   # rope_parameters beyond rope_theta, sorted (empty: plain RoPE)
    sliding_window: int | None = None        # attention window of the windowed layers (None: full attention)
    # False: an architecture without a Megatron conversion (trained by the fsdp2 backend), whose
    # tensors' HF names and shapes are read from its weight files into tensor_shapes
    converted: bool = True
    tensor_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    moe: "MoESpec | None" = None             # routed experts (Qwen3-MoE), else None

    def is_sparse(self, layer: int) -> bool:
        """Return True if layer ``layer`` (0-based, global) routes tokens to experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @classmethod
    def read(cls, model_dir: str | Path) -> "ModelSpec":
        """Return the spec of a checkpoint directory: a converted family's (``from_hf``), else,
        for any causal LM transformers builds (the fsdp2 backend trains it as it is), its sizes
        from the config and its tensors from the weight files, ``converted`` False. Raises
        UserError naming an architecture transformers cannot build as a causal LM."""
        try:
            return cls.from_hf(model_dir)
        except UserError:
            return _unconverted(Path(model_dir))

    @classmethod
    def from_hf(cls, config: Any) -> "ModelSpec":
        """Return the spec of an HF config object, dict, or checkpoint directory; raises
        UserError naming the architecture or the setting the Megatron build cannot reproduce."""
        config = _as_config(config)
        family = FAMILIES[config.model_type]
        problems = unsupported_settings(config)
        if problems:
            raise UserError(f"this {config.model_type} checkpoint cannot be converted to Megatron: "
                            + "; ".join(problems))
        rope = dict(config.rope_parameters or {})
        theta = float(rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        heads, hidden = config.num_attention_heads, config.hidden_size
        return cls(arch=config.model_type, vocab_size=config.vocab_size, hidden=hidden,
                   layers=config.num_hidden_layers, heads=heads, kv_heads=config.num_key_value_heads or heads,
                   head_dim=getattr(config, "head_dim", None) or hidden // heads,
                   intermediate=config.intermediate_size, eps=config.rms_norm_eps, rope_theta=theta,
                   tied=bool(config.tie_word_embeddings), qkv_bias=family.qkv_bias,
                   max_positions=config.max_position_embeddings, qk_norm=family.qk_norm,
                   rope=tuple(sorted(rope.items())), sliding_window=_window(config),
                   moe=MoESpec.from_hf(config) if family.moe else None)

    @property
    def context(self) -> int:
        """Return the longest sequence the model computes exactly: its position limit, or its
        sliding window when shorter (within the window, windowed attention is full attention)."""
        return min(self.max_positions, self.sliding_window or self.max_positions)

    def layout_problems(self, tp: int, pp: int, ep: int = 1) -> list[str]:
        """Return why this model cannot run at tp x pp (x ep) (empty if it can)."""
        out = []
        if not self.converted and tp * pp > 1:
            return [f"hybridlab has no Megatron conversion for {self.arch}; the fsdp2 backend that trains it"
                    " shards over data-parallel ranks only (tp and pp must be 1)"]
        if self.heads % tp:
            out.append(f"{self.heads} attention heads are not divisible by tp={tp}")
        if self.kv_heads % tp:
            out.append(f"{self.kv_heads} key/value heads are not divisible by tp={tp}")
        if self.vocab_size % tp:
            out.append(f"the vocabulary of {self.vocab_size} is not divisible by tp={tp}")
        if self.intermediate % tp:
            out.append(f"the MLP width {self.intermediate} is not divisible by tp={tp}")
        if self.layers % pp:
            out.append(f"{self.layers} layers are not divisible by pp={pp}")
        if self.moe is not None and self.moe.intermediate % tp:
            out.append(f"the expert MLP width {self.moe.intermediate} is not divisible by tp={tp}")
        if ep > 1 and self.moe is None:
            out.append(f"ep={ep}, but the model has no routed experts")
        elif ep > 1 and self.moe.experts % ep:
            out.append(f"{self.moe.experts} experts are not divisible by ep={ep}")
        return out

    def check_layout(self, tp: int, pp: int, ep: int = 1) -> None:
        """Raise UserError if the model cannot be split tp x pp (x ep)."""
        problems = self.layout_problems(tp, pp, ep)
        if problems:
            split = f"tp={tp}, pp={pp}" + (f", ep={ep}" if ep > 1 else "")
            raise UserError(f"cannot split this {self.arch} model as {split}: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """Routed experts as a Qwen3-MoE config sets them: each token goes to ``top_k`` of
    ``experts`` MLPs of width ``intermediate`` in the ``sparse_layers``; the others are dense."""

    experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool          # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]
    aux_loss_coef: float          # weight of the load-balancing loss in training

    @classmethod
    def from_hf(cls, config: Any) -> "MoESpec":
        """Return the experts of a Qwen3-MoE config (transformers' rule for which layers are sparse)."""
        step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
        sparse = tuple(i for i in range(config.num_hidden_layers)
                       if i not in dense and config.num_experts > 0 and (i + 1) % step == 0)
        return cls(experts=config.num_experts, top_k=config.num_experts_per_tok,
                   intermediate=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                   sparse_layers=sparse, aux_loss_coef=float(config.router_aux_loss_coef))


def _as_config(config: Any):
    """Return a transformers config for a config object, a config.json dict or a checkpoint
    directory; raises UserError for an architecture without a Megatron conversion."""
    from transformers import AutoConfig

    if isinstance(config, (str, Path)):
        config = json.loads((Path(config) / "config.json").read_text())
    arch = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if arch not in FAMILIES:
        raise UserError(f"unsupported architecture {arch!r}: hybridlab converts {', '.join(SUPPORTED)}"
                        " checkpoints to Megatron (the fsdp2 backend trains other architectures)")
    if isinstance(config, dict):
        fields = {k: v for k, v in config.items() if k != "model_type"}
        config = AutoConfig.for_model(arch, **fields)
    return config


def _unconverted(model_dir: Path) -> ModelSpec:
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise UserError(f"{model_dir}: transformers cannot read this checkpoint's config ({exc})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"unsupported architecture {config.model_type!r}: transformers has no causal LM for it")
    text = config.get_text_config()
    shapes = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    if not shapes:
        raise UserError(f"{model_dir}: no model*.safetensors weights found (give the checkpoint in safetensors)")
    tied = bool(getattr(text, "tie_word_embeddings", False))
    if tied:
        shapes.pop("lm_head.weight", None)
    heads, hidden = text.num_attention_heads, text.hidden_size
    rope = dict(getattr(text, "rope_parameters", None) or {})
    return ModelSpec(arch=config.model_type, vocab_size=text.vocab_size, hidden=hidden,
                     layers=text.num_hidden_layers, heads=heads,
                     kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                     head_dim=getattr(text, "head_dim", None) or hidden // heads,
                     intermediate=getattr(text, "intermediate_size", 0) or 0,
                     eps=float(getattr(text, "rms_norm_eps", 1e-6)), rope_theta=float(rope.get("rope_theta", 0.0)),
                     tied=tied, qkv_bias=False, max_positions=text.max_position_embeddings, converted=False,
                     tensor_shapes=tuple(sorted(shapes.items())))


def unsupported_settings(config: Any) -> list[str]:
    """Return each setting of an HF config that the Megatron build would not reproduce, named."""
    get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
    out = []
    if get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={get('hidden_act')!r} (only 'silu' is built)")
    if get("mlp_bias"):
        out.append("mlp_bias=true (the MLP is built without biases)")
    if get("attention_bias") and config.model_type != "qwen2":
        out.append("attention_bias=true (biases on q/k/v and the output projection are not built)")
    if get("attention_dropout"):
        out.append(f"attention_dropout={get('attention_dropout')} (training runs without dropout)")
    if get("quantization_config"):
        out.append("quantization_config (quantized weights; give a full-precision checkpoint)")
    rope = get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        out.append(f"rope type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        out.append(f"partial_rotary_factor={partial} (RoPE is built over the whole head)")
    odd = sorted(set(get("layer_types") or []) - {"full_attention", "sliding_attention"})
    if odd:
        out.append(f"layer_types {', '.join(map(repr, odd))} (only full and sliding attention are built)")
    return out


def _window(config: Any) -> int | None:
    """Return the sliding window if any layer attends through one, else None."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    qwen = config.model_type in ("qwen2", "qwen3", "qwen3_moe")
    if types is None and qwen and not getattr(config, "use_sliding_window", False):
        return None
    return int(window) if window else None


def rope_inv_freq(spec: ModelSpec):
    """Return RoPE's inverse frequencies for a scaled rope (transformers' own computation, so
    they equal the checkpoint's), or None for plain RoPE, which Megatron computes itself."""
    if not spec.rope:
        return None
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(spec.rope)
    config = AutoConfig.for_model(spec.arch, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                                  head_dim=spec.head_dim, max_position_embeddings=spec.max_positions,
                                  rope_parameters={**rope, "rope_theta": spec.rope_theta})
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    if scale != 1.0:  # not so for linear and llama3; a guard should ROPE_TYPES grow
        raise UserError(f"rope type {rope['rope_type']!r} scales attention by {scale}, which the build does not do")
    return inv_freq
