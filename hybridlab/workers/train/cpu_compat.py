"""megatron-core 0.16 on a machine without CUDA: the few CUDA-only calls it makes, redirected.

``enable()`` is a no-op when CUDA is available; on GPU machines megatron-core runs unpatched.
Each patch names what it replaces. They are process-wide, which is safe because every one of
them replaces a function that would raise on a CPU-only torch anyway.
"""
from __future__ import annotations

import types

import torch

_ENABLED = False

# megatron-core warns on import that optional CUDA extensions (Transformer Engine, Apex) are
# missing; the local implementations it falls back to are the ones we use on purpose.
import warnings  # noqa: E402

for _text in ("Transformer Engine and Apex are not installed", "Apex is not installed",
              "full scope is deprecated"):
    warnings.filterwarnings("ignore", message=f".*{_text}.*")


class _CpuTorch(types.ModuleType):
    """A view of ``torch`` for modules that hard-code ``device="cuda"`` (pipeline schedules)."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            def on_cpu(*args, _fn=value, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return _fn(*args, **kwargs)
            return on_cpu
        return value


def enable() -> bool:
    """Install the CPU redirections once; returns True if they are active (no CUDA here)."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mp_random

    # Buffers, rotary frequencies and p2p shape tensors are allocated on
    # torch.cuda.current_device(): make that the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # The RNG tracker (model_parallel_cuda_manual_seed, tracker.add/fork) keeps per-region CUDA RNG
    # states: keep them as CPU generator states instead.
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    mp_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state())
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # With tied embeddings and PP>1, GPTModel moves the shared weight with .cuda() before the
    # first-stage/last-stage all-reduce: keep tensors where they are.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # p2p communication and the schedules call torch.cuda.synchronize(); nothing to wait for on CPU.
    torch.cuda.synchronize = lambda device=None: None
    # The schedules allocate their token counter with device="cuda".
    schedules.torch = _CpuTorch()
    p2p_communication.torch = _CpuTorch()
    _ENABLED = True
    return True
