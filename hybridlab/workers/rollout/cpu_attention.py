"""Whether vLLM's CPU build can run a checkpoint's attention on this processor, checked when a
session starts, before Ray: a user finds out from one line instead of from inside ``generate``.

vLLM lists the head sizes its CPU attention supports (``CPUAttentionBackend.get_supported_head_sizes``
in ``vllm/v1/attention/backends/cpu_attn.py``). Its AVX-512 build runs other sizes too (16 runs
in this suite, on the AMD EPYC with AVX-512); its AVX2 build stops inside ``generate`` with
``Unsupported CPU attention configuration: head_dim=16 isa=2`` (a Qwen3 checkpoint with head_dim
16 on the AMD EPYC without AVX-512, family 23), after the engine has loaded. So on a processor
without AVX-512 a head size outside vLLM's list is refused. GPU builds are not checked here.
"""
from __future__ import annotations

import torch

from hybridlab.environment import cpu_flags
from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec

# vLLM 0.32's CPUAttentionBackend.get_supported_head_sizes() (tests/test_rollout.py compares them)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size_problem(head_dim: int, flags: set[str]) -> str:
    """Return why vLLM's CPU attention cannot run heads of ``head_dim`` on a processor with
    ``flags`` (/proc/cpuinfo's), or "" when it can."""
    if head_dim in VLLM_CPU_HEAD_SIZES or "avx512f" in flags:
        return ""
    return (f"the model's attention heads have head_dim {head_dim}, which vLLM's CPU attention runs only with"
            f" AVX-512, and this processor has none (vLLM's CPU build supports head_dim"
            f" {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} everywhere); use such a checkpoint, or a machine with AVX-512")


def check_head_size(backend: str, model_dir) -> None:
    """Raise UserError when ``backend`` is vLLM on a CPU build of torch (so vLLM's CPU build) and
    this processor cannot run the attention heads of the checkpoint in ``model_dir``
    (``head_size_problem``)."""
    if backend != "vllm" or not cpu_build():
        return
    if problem := head_size_problem(ModelSpec.read(model_dir).head_dim, cpu_flags()):
        raise UserError(f"{model_dir}: {problem}")



def cpu_build() -> bool:
    """True when torch is a CPU build (no CUDA, no ROCm): vLLM then runs its CPU build too, whether
    from the ``vllm-cpu`` package or built from source."""
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None
