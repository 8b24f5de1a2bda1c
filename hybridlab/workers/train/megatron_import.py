"""megatron-core, imported without setting up ``torch.compile`` for kernels hybridlab never runs.

As it is imported, megatron-core decorates its fused kernels (bias-GeLU, bias-SwiGLU and their
weighted and backward forms, the MoE router's expert bias, the flex token dispatcher) with
``torch.compile`` (``megatron.core.jit.jit_fuser`` on torch >= 2.2). hybridlab builds every
model with the fusions off (``model.transformer_config``), so none of them does any work: the
only one called, the router's ``_apply_expert_bias``, returns at once without
``moe_router_enable_expert_bias``. Its inference engine also imports Weights & Biases when
installed, to log inference hybridlab does not run with Megatron. Together these cost about
1.1 s of CPU in every training process, on every start, remap and recovery (5.35 -> 4.22 s to
build a tiny engine in a fresh process on our 2-core machines; docs/tests.md).

Importing this module imports ``megatron.core`` with ``torch.compile`` standing in as the
identity and ``wandb`` unavailable for that one import, then sets Megatron's ``jit_fuser`` to its
own no-op decorator for the fusion modules it imports later. Both are restored before anything
else runs: the run's W&B tracker (in the controller) and a user's own ``import wandb`` are
unaffected. A library that ``megatron.core`` imports for the first time inside that window keeps
the identity too (Transformer Engine's own fusions, on a GPU install that has it; hybridlab builds
Megatron's local layer specs, not Transformer Engine's). Import this module before the first
``megatron.core`` import of a process (``model.init_parallel`` does); a process that imported
Megatron before keeps its compiled wrappers and works the same.
"""
from __future__ import annotations

import sys

import torch


def _identity(model=None, **_options):
    """``torch.compile``'s signature, compiling nothing: the function, or a decorator returning it."""
    return model if model is not None else (lambda fn: fn)


if "megatron.core" not in sys.modules:
    _compile, torch.compile = torch.compile, _identity
    _hide_wandb = "wandb" not in sys.modules
    if _hide_wandb:  # seen as not installed by this import alone
        sys.modules["wandb"] = None
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = _compile
        if _hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]

from megatron.core import jit  # noqa: E402  (after the guarded import above)

jit.disable_jit_fuser()
