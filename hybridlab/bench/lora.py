"""LoRA against full fine-tuning on the fsdp2 backend, on the same model and batch.

Three runs, each an actor and a vLLM engine sharing one process (the hybrid engine):

- ``full``: every weight trains; each sync sends the whole model;
- ``lora``: only the adapter trains; each sync sends the adapter alone, into vLLM's LoRA support;
- ``lora_merged``: only the adapter trains; each sync sends the base weights with the adapter
  folded in (``actor.lora.sync=merged``, for rollout engines without LoRA support).

Each run times ``steps`` supervised updates (after one untimed) and ``syncs`` weight syncs,
reads the process's peak resident memory, and checks the sync: the engine's log-probs of its
own samples must equal the actor's (``rollout_vs_actor_logprob_diff``).
"""
from __future__ import annotations

import statistics
import time

import torch

from hybridlab.bench.train import BenchActor, make_batch
from hybridlab.config.training import LoraConfig
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker import Dispatch, register
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.environment import usable_cores
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model
from hybridlab.protocol import Batch
from hybridlab.reshard.transfer import sync_mapped
from hybridlab.workers.rollout.worker import RolloutWorker
from hybridlab.workers.train.settings import settings_for

MODES = ("full", "lora", "lora_merged")
SAMPLE = {"n": 1, "temperature": 1.0, "max_tokens": 8, "seed": 0}


class LoraBenchActor(BenchActor):
    """An actor that also reports how many of its parameters train."""

    @register(Dispatch.ALL)
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.engine.saved.values())


def _mode_run(model_dir: str, spec: ModelSpec, mode: str, batch, lora: dict, steps: int, syncs: int,
              threads: int) -> dict:
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 1, "cpus_per_device": threads}},
                                       "roles": {r: {"pool": "p", "colocate": "hybrid"} for r in ("actor", "rollout")}})
    adapter = mode == "lora"
    context = batch["input_ids"].shape[1] + SAMPLE["max_tokens"]
    roles = {"actor": RoleClass(LoraBenchActor, kwargs=dict(model_dir=model_dir, settings=settings_for(
                                    lr=1e-4, micro_batch_size=len(batch), strategy="fsdp2",
                                    lora=LoraConfig(**lora) if mode != "full" else LoraConfig()))),
             "rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=model_dir, max_model_len=context,
                                                             lora_rank=lora["rank"] if adapter else 0))}
    with WorkerSet(mapping, roles, env={"OMP_NUM_THREADS": str(threads)}) as session:
        actor, rollout = session.groups["actor"], session.groups["rollout"]
        updates = []
        for i in range(steps + 1):
            start = time.perf_counter()
            actor.sft_step(batch)
            if i:
                updates.append(time.perf_counter() - start)
        reports = [sync_mapped(session.groups, mapping, spec, adapter=adapter) for _ in range(syncs)]
        prompts = Batch(objects={"prompt_ids": batch["input_ids"][:4, :8].tolist()})
        sampled = rollout.generate(prompts, SAMPLE)
        mask = sampled["response_mask"].bool()
        diff = (actor.compute_log_prob(sampled)["old_log_probs"] - sampled["rollout_log_probs"])[mask].abs().max()
        sync_s = statistics.median(r.seconds for r in reports)
        return {"sync_bytes": reports[-1].bytes_moved, "sync_s": round(sync_s, 4), "sync_mode": reports[-1].mode, "update_s": round(statistics.median(updates), 4),
                "peak_rss_mb": round(max(actor.peak_rss_mb()), 1),
                "trainable_params": actor.trainable_parameters()[0],
                "rollout_vs_actor_logprob_diff": float(diff)}


def run(model: str = "small", rank: int = 16, alpha: float = 32.0, steps: int = 3, syncs: int = 3,
        batch_size: int = 8, prompt_len: int = 32, response_len: int = 32) -> dict:
    """Return, for ``model`` (a zoo name or a checkpoint directory), each mode's sync bytes and
    seconds, update seconds, peak RSS and trainable parameters, and LoRA's ratios against full
    fine-tuning (``sync_bytes_ratio``: LoRA's bytes / full's; ``sync_speedup``: full's sync
    seconds / LoRA's; ``update_speedup``; ``trainable_share``)."""
    model_dir = str(resolve_model(model))
    spec = ModelSpec.read(model_dir)
    threads = min(2, usable_cores())
    torch.manual_seed(0)
    batch = make_batch(batch_size, prompt_len, response_len, spec.vocab_size)
    lora = {"rank": rank, "alpha": alpha, "dropout": 0.0, "target_modules": "all-linear"}
    connect(num_gpus=1)
    out: dict = {"model": model, "rank": rank, "alpha": alpha, "steps": steps, "syncs": syncs, "threads": threads,
                 "batch_tokens": batch_size * (prompt_len + response_len)}
    for mode in MODES:
        out[mode] = _mode_run(model_dir, spec, mode, batch, lora, steps, syncs, threads)
    full, adapter = out["full"], out["lora"]
    out["sync_bytes_ratio"] = round(adapter["sync_bytes"] / full["sync_bytes"], 5)
    out["sync_speedup"] = round(full["sync_s"] / adapter["sync_s"], 2)
    out["merged_sync_speedup"] = round(full["sync_s"] / out["lora_merged"]["sync_s"], 2)
    out["update_speedup"] = round(full["update_s"] / adapter["update_s"], 2)
    out["trainable_share"] = round(adapter["trainable_params"] / full["trainable_params"], 5)
    return out
