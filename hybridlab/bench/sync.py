"""Weight sync (actor -> colocated vLLM engine, in memory) vs the naive way: save an HF
checkpoint and start a fresh rollout engine on it. With ``rollout_tp > 1``, also a sync into a
separate tensor-parallel engine, timed by part: fetching and joining the trainer's slices, and
vLLM's loader (the measurement behind sending whole tensors to every engine rank)."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from hybridlab.batching import sequences_batch
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model
from hybridlab.protocol import Batch
from hybridlab.reshard.plan import RolloutLayout, TrainerLayout, plan_reshard
from hybridlab.reshard.transfer import sync_weights
from hybridlab.tasks import get_task
from hybridlab.workers.rollout.worker import RolloutWorker
from hybridlab.workers.train import checkpoint
from hybridlab.workers.train.settings import settings_for
from hybridlab.workers.train.workers import ActorWorker

GREEDY = {"temperature": 0, "max_tokens": 4}


def _arith_batches(model_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    train = get_task("arith").split("train", 64)
    test = get_task("arith").split("test", 16)
    return (sequences_batch([enc(s.prompt) for s in train], [enc(s.answer) + [tok.eos_token_id] for s in train], 0),
            Batch(objects={"prompt_ids": [enc(s.prompt) for s in test]}))


def run(model: str = "mid", bucket_mb: float = 64.0, warm_steps: int = 10, rollout_tp: int = 1) -> dict:
    """Return sync seconds, naive seconds, speedup, bytes moved and whether greedy outputs match
    (and with ``rollout_tp > 1`` the ``tp_*`` keys of ``_tp_sync``)."""
    model_dir = str(resolve_model(model))
    spec = ModelSpec.from_hf(model_dir)
    train, prompts = _arith_batches(model_dir)
    connect(num_gpus=max(2, 1 + rollout_tp))
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 1, "cpus_per_device": 2}},
                                       "roles": {"actor": {"pool": "p", "colocate": "hybrid"},
                                                 "rollout": {"pool": "p", "colocate": "hybrid"}}})
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=model_dir, settings=settings_for(lr=3e-3))),
             "rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=model_dir, max_model_len=128))}
    with WorkerSet(mapping, roles, env={"OMP_NUM_THREADS": "2"}) as session, \
            tempfile.TemporaryDirectory() as tmp:
        actor, rollout = session.groups["actor"], session.groups["rollout"]
        for _ in range(warm_steps):  # peaked distributions, so greedy decoding is a sharp check
            actor.sft_step(train)
        report = sync_weights(actor, rollout, spec, TrainerLayout(), RolloutLayout(), bucket_mb=bucket_mb)
        synced = rollout.generate(prompts, GREEDY)["responses"]

        start = time.perf_counter()  # naive: write a checkpoint, start an engine on it
        exported = checkpoint.export_hf(actor, model_dir, Path(tmp) / "export")
        naive_map = DeviceMapping.from_dict({"pools": {"q": {"devices": 1, "cpus_per_device": 2}},
                                             "roles": {"rollout": {"pool": "q"}}})
        naive_roles = {"rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=str(exported), max_model_len=128))}
        with WorkerSet(naive_map, naive_roles, env={"OMP_NUM_THREADS": "2"}) as fresh:
            naive_s = time.perf_counter() - start
            naive_out = fresh.groups["rollout"].generate(prompts, GREEDY)["responses"]
        reference = RolloutWorker(str(exported), backend="hf", max_model_len=128).generate(prompts, GREEDY)
    out = {"model": model, "sync_s": round(report.seconds, 4), "naive_s": round(naive_s, 3)}
    out.update(speedup=round(out["naive_s"] / out["sync_s"], 1), bytes_moved=report.bytes_moved,
               buckets=report.buckets, bucket_mb=bucket_mb,
               greedy_match=bool(torch.equal(synced, reference["responses"])),
               naive_greedy_match=bool(torch.equal(naive_out, reference["responses"])))
    if rollout_tp > 1:
        out.update(_tp_sync(model_dir, spec, train, prompts, bucket_mb, warm_steps, rollout_tp))
    return out


def _tp_sync(model_dir: str, spec: ModelSpec, train: Batch, prompts: Batch, bucket_mb: float, warm_steps: int,
             tp: int) -> dict:
    """Sync an actor on one device into a vLLM engine of ``tp`` ranks on others; returns the
    sync's seconds, the slowest rank's fetch and load seconds, the bytes sent (whole tensors to
    every rank) against the bytes a per-rank shard transfer would send, and whether the engine's
    greedy output equals transformers' on the exported weights."""
    mapping = DeviceMapping.from_dict({"pools": {"t": {"devices": 1}, "g": {"devices": tp}},
                                       "roles": {"actor": {"pool": "t"}, "rollout": {"pool": "g", "tp": tp}}})
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=model_dir, settings=settings_for(lr=3e-3))),
             "rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=model_dir, max_model_len=128, tp=tp))}
    with WorkerSet(mapping, roles, env={"OMP_NUM_THREADS": "1"}) as session, tempfile.TemporaryDirectory() as tmp:
        actor, rollout = session.groups["actor"], session.groups["rollout"]
        for _ in range(warm_steps):
            actor.sft_step(train)
        layout = RolloutLayout(tp=tp)
        sync_weights(actor, rollout, spec, TrainerLayout(), layout, bucket_mb=bucket_mb)  # warm-up
        rollout.take_load_seconds()
        report = sync_weights(actor, rollout, spec, TrainerLayout(), layout, bucket_mb=bucket_mb)
        parts = rollout.take_load_seconds()
        synced = rollout.generate(prompts, GREEDY)["responses"]
        exported = checkpoint.export_hf(actor, model_dir, Path(tmp) / "export")
        reference = RolloutWorker(str(exported), backend="hf", max_model_len=128).generate(prompts, GREEDY)
    return {"tp": tp, "tp_sync_s": round(report.seconds, 4),
            "tp_fetch_s": round(max(p["fetch_s"] for p in parts), 4),
            "tp_load_s": round(max(p["load_s"] for p in parts), 4),
            "tp_bytes_moved": report.bytes_moved,
            "tp_shard_bytes": plan_reshard(spec, TrainerLayout(), layout).total_bytes,
            "tp_greedy_match": bool(torch.equal(synced, reference["responses"]))}
