"""A Megatron engine's training state in and out of Hugging Face layout (whole tensors).

``hf_state`` gathers a pipeline stage's TP shards of the weights and AdamW moments into HF
tensors; ``load_hf_state`` cuts HF tensors from any source layout into this rank's shards. A
critic's scalar head travels as ``value_head.linear.*``.
"""
from __future__ import annotations

import torch

from hybridlab.reshard.sources import gather_stage
from hybridlab.workers.train.convert import hf_to_megatron

MOMENTS = ("exp_avg", "exp_avg_sq")


def hf_state(engine, moments: bool = True) -> dict | None:
    """Return this stage's weights and (with ``moments``) AdamW moments in HF layout, with
    ``adam_step``, on (tp 0, dp 0) of each stage; None on the other ranks (every rank must call it)."""
    params = dict(engine.model.named_parameters())
    state = {"model": gather_stage(engine, {k: p.detach() for k, p in params.items()})}
    opt = engine.optimizer
    if moments and isinstance(opt, torch.optim.AdamW):
        for moment in MOMENTS:
            named = {k: opt.state[p][moment] if p in opt.state else torch.zeros_like(p) for k, p in params.items()}
            state[moment] = gather_stage(engine, named)
        steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
        state["adam_step"] = max(steps) if steps else 0.0
    return state if state["model"] is not None else None


def _local(engine, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors -> this rank's shards in Megatron names (a critic's head under output_layer.linear)."""
    ps = engine.ps
    out = hf_to_megatron(named, engine.spec, engine.tp, ps.get_tensor_model_parallel_rank(), engine.pp,
                         ps.get_pipeline_model_parallel_rank(), head=not engine.value_head, ep=engine.ep,
                         ep_rank=ps.get_expert_model_parallel_rank())
    for k in ("weight", "bias"):
        if f"value_head.linear.{k}" in named:
            out[f"output_layer.linear.{k}"] = named[f"value_head.linear.{k}"].clone()
    return out


def load_hf_state(engine, weights: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]],
                  step: int, adam_step: float) -> None:
    """Load whole HF ``weights`` (if any) and AdamW ``moments`` (if any) into this rank's shards,
    with the step counters; raises KeyError naming a parameter the weights do not cover."""
    params = dict(engine.model.named_parameters())
    if weights:
        local = _local(engine, weights)
        with torch.no_grad():
            for name, param in params.items():
                if name in local:
                    param.copy_(local[name])
                elif not (name == "output_layer.weight" and engine.spec.tied):
                    raise KeyError(f"the saved state has no weights for {name}")
    engine.step_count = step
    opt = engine.optimizer
    if opt is None or not moments:
        return
    shards = {m: _local(engine, moments[m]) for m in MOMENTS}
    for name, p in params.items():
        if name == "output_layer.weight" and name not in shards["exp_avg"]:  # tied: the embedding's
            continue
        opt.state[p] = {"step": torch.tensor(float(adam_step)), **{m: shards[m][name] for m in MOMENTS}}
