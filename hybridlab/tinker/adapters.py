"""Training clients' LoRA adapters of different shapes in one engine's adapter.

The trainer's engine holds one adapter of the largest shape a client may ask for: the server's
``max_lora_rank``, on the attention and the MLP projections both. A client's adapter of rank
``r`` on some of those modules sits in it zero-padded: A's rows from ``r`` on and B's columns
from ``r`` on are zero, and so is every weight of a module it does not train.

That is exact. A zero row of A meets a zero column of B, so each gets a zero gradient
(dL/dA[j] = B[:, j]^T ..., dL/dB[:, j] = ... A[j] x); a module with A = B = 0 gets zero
gradients on both. AdamW then leaves them zero: their moments stay zero, the update is
0 / (0 + eps), and decay multiplies zero. The gradient norm (and so clipping) is unchanged. With
each layer's scale set to the client's ``alpha / r``, the padded adapter computes and trains as
the client's own does.
"""
from __future__ import annotations

import dataclasses
import math

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]  # what Tinker's train_attn adapts
MLP = ["gate_proj", "up_proj", "down_proj"]      # and train_mlp


@dataclasses.dataclass(frozen=True)
class AdapterShape:
    """A client's adapter: its rank and the projections it trains (``q_proj``, ...)."""

    rank: int
    modules: tuple[str, ...]

    @classmethod
    def of(cls, lora: dict) -> "AdapterShape":
        """Return the shape of Tinker's ``lora_config`` (``rank``, ``train_attn``, ``train_mlp``)."""
        return cls(int(lora["rank"]), tuple((ATTN if lora["train_attn"] else []) + (MLP if lora["train_mlp"] else [])))

    def __str__(self) -> str:
        return f"rank {self.rank}, train_attn={ATTN[0] in self.modules}, train_mlp={MLP[0] in self.modules}"

    def owns(self, name: str) -> bool:
        """True when the adapter weight ``name`` (PEFT's file name) is one of this adapter's."""
        return name.split(".lora_")[0].rpartition(".")[2] in self.modules

    def cut(self, tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """Return this adapter's part of the engine's padded ``tensors`` (weights, moments or
        gradients; None stays None), in its own shapes."""
        return {name: None if t is None else _rank_slice(name, t, self.rank).clone()
                for name, t in tensors.items() if self.owns(name)}

    def pad(self, tensors: dict[str, torch.Tensor], full: dict[str, tuple]) -> dict[str, torch.Tensor]:
        """Return ``tensors`` (this adapter's own weights or moments) placed in zeros of the
        engine's ``full`` shapes, every other weight of the engine zero."""
        return {name: self.pad_one(name, tensors[name], shape) if name in tensors else torch.zeros(shape)
                for name, shape in full.items()}

    def pad_one(self, name: str, tensor: torch.Tensor, full: tuple) -> torch.Tensor:
        """Return this adapter's weight ``name`` placed in zeros of the engine's shape ``full``."""
        whole = torch.zeros(full)
        _rank_slice(name, whole, self.rank).copy_(tensor)
        return whole

    def shapes(self, full: dict[str, tuple]) -> dict[str, tuple]:
        """Return this adapter's own weight shapes, given the engine's ``full`` ones."""
        return {name: tuple(_rank_slice(name, torch.empty(shape, device="meta"), self.rank).shape)
                for name, shape in full.items() if self.owns(name)}

    def peft_config(self, engine_config: dict, alpha: float) -> dict:
        """Return the PEFT ``adapter_config`` of this adapter, from the engine's."""
        return {**engine_config, "r": self.rank, "lora_alpha": alpha, "target_modules": sorted(self.modules)}


def _rank_slice(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[:rank] if ".lora_A." in name else t[:, :rank]  # A: [rank, in]; B: [out, rank]


def fresh_adapter(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Return a new adapter's weights as peft initialises them (A: Kaiming-uniform with a = sqrt(5),
    as ``nn.Linear``; B: zeros, so the model is unchanged until it trains), drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes.items()):
        weight = torch.zeros(shape)
        if ".lora_A." in name:
            bound = 1 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on [rank, in]: U(-1/sqrt(in), 1/sqrt(in))
            weight.uniform_(-bound, bound, generator=generator)
        out[name] = weight
    return out
