"""The local model zoo: small Qwen2/3-, Qwen3-MoE-, Llama- and Mistral-style checkpoints built from a seed.

Nothing is downloaded. ``build`` trains a byte-level BPE tokenizer on task text and
initialises a model with ``torch.manual_seed(seed)``, then saves an ordinary Hugging Face
checkpoint directory that transformers, vLLM and the Megatron converter load unchanged.
``resolve_model`` turns a preset name or a checkpoint path into a directory, building and
caching presets on first use; for a task that asks for its own tokenizer (reasoning-gym's), the
preset is built with one trained on that task's text.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from hybridlab.atomic import atomic_model_dir, built_once, check_model_dir_target
from hybridlab.errors import UserError
from hybridlab.tasks import TASKS, get_task

# Zoo names: a preset, then a family: tiny (Qwen2), tiny-llama, tiny-llama3 (Llama with Llama 3's
# rope scaling), tiny-qwen3 (QK-norm, head_dim twice hidden/heads as Qwen3-0.6B), tiny-mistral
# (a sliding window of half the context), tiny-qwen3moe (Qwen3-MoE: 4 experts, 2 per token, the first
# layer dense).
ARCHS = ("qwen2", "llama", "llama3", "qwen3", "mistral", "qwen3moe", "gemma3", "phi3")
CONVERTED = ARCHS[:6]  # the others have no Megatron conversion: the fsdp2 backend trains them
VOCAB_SIZE = 320  # divisible by 64, so any TP up to 64 splits the vocabulary evenly
TASK_VOCAB_MAX = 1024  # a task's own tokenizer (Task.own_tokenizer): reasoning-gym's chain_sum learns 384
TASK_CORPUS_SAMPLES = 1500  # training prompts (with answers) it is trained on, as the zoo's per task
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0 to 4
END_OF_TURN = 4  # <|im_end|>: the chat template ends each turn with it, and generation stops there
# ChatML, as Qwen's: chat data runs on zoo models (data.chat=true or chat-message datasets)
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Part of the cache folder's name: a zoo build of another version is not reused.
ZOO_VERSION = 2
# Qwen2's pre-tokenizer split: every digit stands alone, so numbers are digit sequences.
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class Preset:
    """Shape of a zoo model; the parameter count is printed by ``hybridlab zoo list``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 512


PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256),    # ~0.6M
    "small": Preset(hidden=256, layers=8, heads=8, kv_heads=4, intermediate=688),   # ~6M
    "mid": Preset(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),    # ~25M
}


def home() -> Path:
    """Return hybridlab's cache folder (``$HYBRIDLAB_HOME``, else ``~/.cache/hybridlab``)."""
    return Path(os.environ.get("HYBRIDLAB_HOME", Path.home() / ".cache" / "hybridlab"))


def parse_preset(name: str) -> tuple[str, str]:
    """Split ``tiny`` / ``tiny-llama`` into (preset, arch); raises UserError for unknown names."""
    preset, _, arch = name.partition("-")
    arch = arch or "qwen2"
    if preset not in PRESETS or arch not in ARCHS:
        raise UserError(f"unknown zoo model {name!r}; a zoo name is a preset ({', '.join(PRESETS)}), optionally"
                        f" with a family ({', '.join('-' + a for a in ARCHS[1:])}; without one: qwen2), e.g."
                        " tiny-qwen3 (or give the path of a local Hugging Face checkpoint directory)")
    return preset, arch


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Return the text the zoo tokenizer is trained on: prompts and answers of every task."""
    lines = []
    for task in (get_task("arith", digits=3, ops="+-*"), get_task("reverse"), get_task("countdown")):
        for s in task.split("train", 1500, seed=seed):
            lines.append(s.prompt + s.answer)
    return lines


def train_tokenizer(seed: int = 0, corpus: list[str] | None = None, vocab_size: int = VOCAB_SIZE):
    """Return a byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` (default: the
    zoo's, ``tokenizer_corpus``), with at most ``vocab_size`` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(seed) if corpus is None else corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", unk_token="<pad>",
                                   eos_token="</s>", model_max_length=512, chat_template=CHAT_TEMPLATE)


def model_config(preset: str, arch: str, vocab_size: int = VOCAB_SIZE):
    """Return the transformers config of a zoo preset in the given architecture."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    p = PRESETS[preset]
    common = dict(vocab_size=vocab_size, hidden_size=p.hidden, intermediate_size=p.intermediate,
                  num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
                  max_position_embeddings=p.max_positions, rms_norm_eps=1e-6, hidden_act="silu",
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    if arch == "qwen2":  # Qwen2: QKV bias, tied embeddings (as the small Qwen2 models)
        return Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "qwen3":
        return Qwen3Config(tie_word_embeddings=True, head_dim=2 * p.hidden // p.heads, **common)
    if arch == "qwen3moe":  # experts a quarter of the dense width, so two per token cost half the MLP
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(tie_word_embeddings=True, head_dim=2 * p.hidden // p.heads, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=p.intermediate // 4, norm_topk_prob=True,
                              mlp_only_layers=[0], router_aux_loss_coef=0.01, **common)
    if arch == "gemma3":  # text-only Gemma 3: GeLU-tanh, QK-norm, sliding and full layers, tied embeddings
        from transformers import Gemma3TextConfig

        gemma = {k: v for k, v in common.items() if k != "hidden_act"}
        return Gemma3TextConfig(head_dim=p.hidden // p.heads, query_pre_attn_scalar=p.hidden // p.heads,
                                sliding_window=p.max_positions // 4, tie_word_embeddings=True, **gemma)
    if arch == "phi3":  # Phi-3: fused qkv_proj and gate_up_proj tensors
        from transformers import Phi3Config

        return Phi3Config(tie_word_embeddings=False, original_max_position_embeddings=p.max_positions, **common)
    if arch == "mistral":
        return MistralConfig(tie_word_embeddings=False, sliding_window=p.max_positions // 2, **common)
    # Llama 3's rope scaling with a short original context, so that it changes most frequencies
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if arch == "llama3" else None
    return LlamaConfig(tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_parameters=rope,
                       **common)


def build(name: str, out: str | os.PathLike, seed: int = 0, corpus: list[str] | None = None) -> Path:
    """Build zoo model ``name`` into directory ``out`` atomically; returns the directory. With a
    ``corpus`` (a task's text) its tokenizer is trained on that, with up to ``TASK_VOCAB_MAX``
    tokens, and the vocabulary is what it learnt, rounded up to a multiple of 64.

    ``out`` must not exist yet, or must be an earlier build (it is then replaced whole).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    preset, arch = parse_preset(name)
    with atomic_model_dir(out) as tmp:
        tokenizer = train_tokenizer(seed, corpus, VOCAB_SIZE if corpus is None else TASK_VOCAB_MAX)
        torch.manual_seed(seed)
        config = model_config(preset, arch, VOCAB_SIZE if corpus is None else -(-len(tokenizer) // 64) * 64)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=[2, END_OF_TURN], pad_token_id=0)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)


def task_corpus(task: str, options: dict) -> tuple[str, list[str]] | None:
    """Return (a cache key, the text) to train a zoo tokenizer on for ``task`` with ``options``:
    its training prompts and answers where the task asks for its own tokenizer
    (``Task.own_tokenizer``); None where the zoo's own tokenizer serves."""
    key = own_tokenizer_key(task, options)
    if key is None:
        return None
    samples = get_task(task, **options).split("train", TASK_CORPUS_SAMPLES, seed=0)
    return key, [s.prompt + s.answer for s in samples]


def own_tokenizer_key(task: str, options: dict) -> str | None:
    """Return the cache key of ``task``'s own tokenizer with ``options`` (None where the task
    takes the zoo's), without building the task."""
    if task not in TASKS or not TASKS[task].own_tokenizer:
        return None
    return f"{task}-{hashlib.sha1(json.dumps(options, sort_keys=True, default=str).encode()).hexdigest()[:10]}"


def resolve_model(spec: str | os.PathLike, seed: int = 0, data: Any = None) -> Path:
    """Return the checkpoint directory for a preset name or a local checkpoint path.

    Presets are built once into ``home()/zoo`` and reused; a path must hold a ``config.json``.
    Given a run's ``data`` settings whose task asks for its own tokenizer (``task_corpus``), a
    preset is built with a tokenizer trained on the task's text.
    """
    spec = str(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is not a Hugging Face checkpoint directory (no config.json)")
        return path
    if os.sep in spec or spec.startswith("."):
        raise UserError(f"model path {spec} does not exist")
    preset, arch = parse_preset(spec)
    own = data is not None and not (data.train_files or data.preferences)
    key = own_tokenizer_key(data.task, data.task_options) if own else None
    if key is None:
        cached = home() / "zoo" / f"{preset}-{arch}-seed{seed}-v{ZOO_VERSION}"
        return built_once(cached, lambda: build(spec, cached, seed=seed))
    cached = home() / "zoo" / f"{preset}-{arch}-seed{seed}-v{ZOO_VERSION}-{key}"
    # the task's text is generated only when the model is built, not each time it is found
    return built_once(cached, lambda: build(spec, cached, seed=seed,
                                            corpus=task_corpus(data.task, data.task_options)[1]))


def count_parameters(name: str | os.PathLike) -> int:
    """Return the number of distinct parameters of a preset or a checkpoint directory (tied
    weights counted once), without loading weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if Path(name).is_dir():
        config = AutoConfig.from_pretrained(name)
    else:
        config = model_config(*parse_preset(str(name)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def build_reward_model(base: str | os.PathLike, out: str | os.PathLike, seed: int = 0) -> Path:
    """Save ``base`` (a zoo name or checkpoint) with a scalar head as a sequence-classification
    checkpoint (one label: the reward), the head initialised from ``seed``; returns ``out``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = resolve_model(base)
    out = check_model_dir_target(out)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src)
    model.config.pad_token_id = tokenizer.pad_token_id
    with atomic_model_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out)
