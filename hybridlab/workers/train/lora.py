"""LoRA adapters on a transformers model, built with peft, and the names they travel under.

Three names matter for one adapter weight:

- the model's own: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``
  (peft wraps the model and keys each adapter by name, here ``default``);
- the saved one, PEFT's file format (``adapter_model.safetensors``), which vLLM's LoRA loader
  also reads: the same without the adapter name;
- for the frozen base, the checkpoint's HF name (``model.layers.0.self_attn.q_proj.weight``),
  which peft moved to ``...q_proj.base_layer.weight``.

Checkpoints and weight syncs speak the saved names; a merged sync (``merged_weight``) speaks HF
names, with the adapter folded into the base weight.
"""
from __future__ import annotations


import torch

from hybridlab.config.training import LoraConfig

ADAPTER = "default"           # peft's name for the one adapter a model gets
PEFT_PREFIX = "base_model.model."
SYNC_MODES = ("adapter", "merged")


def adapter_config(model: torch.nn.Module, base_model_dir: str) -> dict:
    """Return what ``adapter_config.json`` holds for ``model`` (peft-wrapped): PEFT's own
    format, with the target modules resolved to the names peft found."""
    config = model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = str(base_model_dir)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def add_adapter(model: torch.nn.Module, settings: LoraConfig) -> torch.nn.Module:
    """Return ``model`` wrapped by peft with a fresh adapter of the ``actor.lora`` settings
    (rank, alpha: the update is scaled by alpha / rank, dropout on the adapter's input while
    training, the modules it wraps); B = 0, so the model's outputs are unchanged until it trains;
    only the adapter's weights require gradients."""
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    return get_peft_model(model, PeftLoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                                                lora_dropout=settings.dropout,
                                                target_modules=settings.target_modules, bias="none"))


def saved_name(name: str) -> str | None:
    """Return the PEFT file name of an adapter weight of the model, None for a base weight."""
    marker = f".{ADAPTER}."
    if ".lora_" not in name or marker not in name:
        return None
    return name.replace(marker, ".", 1)


def model_name(saved: str) -> str:
    """Return the model's name of an adapter weight given by its PEFT file name."""
    head, _, leaf = saved.rpartition(".")  # "...q_proj.lora_A", "weight"
    return f"{head}.{ADAPTER}.{leaf}"


def hf_name(name: str) -> str:
    """Return the checkpoint's HF name of a base weight of the peft-wrapped model."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Return {HF name of a wrapped layer's weight: the peft layer} for every layer the adapter wraps."""
    from peft.tuners.lora import LoraLayer

    return {hf_name(f"{name}.weight"): module for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}


def check_linear_only(model: torch.nn.Module) -> None:
    """Raise ValueError naming a module the adapter wraps that is not a linear layer: vLLM serves
    adapters on linear layers, and the merged sync folds only those."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise ValueError(f"actor.lora.target_modules: {hf_name(name)} is a {type(module.base_layer).__name__},"
                             " not a linear layer; adapters go on linear layers (q_proj, ..., down_proj)")


def merged_weight(layer: torch.nn.Module, whole) -> torch.Tensor:
    """Return the layer's base weight with its adapter folded in, W + scale * B @ A, as one
    whole tensor; ``whole(param)`` gathers a (possibly sharded) parameter."""
    base = whole(layer.base_layer.weight)
    delta = whole(layer.lora_B[ADAPTER].weight) @ whole(layer.lora_A[ADAPTER].weight)
    if getattr(layer, "fan_in_fan_out", False):  # GPT-2's Conv1D stores the weight transposed
        delta = delta.T
    return base + layer.scaling[ADAPTER] * delta
