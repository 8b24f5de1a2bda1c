"""Weight sync from the actor (Megatron layout) into the rollout engines, in bounded buckets.

Colocated (actor and rollout share processes, the hybrid engine): every process gathers each
bucket and loads it into its own engine in memory, no serialization. Separate (rollout on
other processes or devices): the transfer follows ``plan_reshard``: rollout replica r is fed
by trainer DP rank r % dp, whose TP ranks each put only their own slices of the bucket in
Ray's object store (no gathering on the trainer side); the rollout rank fetches them directly,
never through the controller, and joins them. The report carries the bytes measured per
(trainer rank, rollout rank) pair beside the plan's.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

from hybridlab.models.spec import ModelSpec
from hybridlab.reshard.plan import RolloutLayout, TrainerLayout, buckets, hf_shapes, plan_reshard


@dataclasses.dataclass
class SyncReport:
    """What one weight sync did: bytes delivered to engines, buckets, time, the plan summary."""

    mode: str
    bytes_moved: int
    buckets: int
    max_bucket_bytes: int
    seconds: float
    plan: dict
    bytes_per_pair: dict = dataclasses.field(default_factory=dict)  # measured, separate placement only

    def as_dict(self) -> dict:
        """Return the report as plain data (for metrics, JSON and the dashboard)."""
        return dataclasses.asdict(self)


def sync_weights(actor, rollout, spec: ModelSpec, trainer: TrainerLayout, rollout_layout: RolloutLayout,
                 bucket_mb: float = 64.0, deferred: list | None = None) -> SyncReport:
    """Copy the actor's current weights into every rollout engine; returns a SyncReport.

    The placement is read from the groups: colocated when both roles live in the same processes.
    With a ``deferred`` list (separate placement), the last bucket's load is sent without waiting
    for it: its future goes into the list, for the caller to read later (the trainer goes on
    while the engines load), and the report's seconds end when it was sent.
    """
    # vLLM's loader takes whole tensors and cuts each rank's shard itself: every rank of an
    # engine receives whole tensors (docs/engine.md has the measurement).
    plan = plan_reshard(spec, trainer, rollout_layout, whole=True)
    groups = buckets(spec, int(bucket_mb * 2**20))
    sizes = _bucket_bytes(spec, groups)
    start = time.perf_counter()
    colocated = actor.hostset is rollout.hostset
    pairs: dict[str, int] = defaultdict(int)  # measured bytes, "trainer rank->rollout rank" (separate)
    if colocated:
        actor.sync_to_colocated(rollout.role, groups)
        moved = sum(sizes) * rollout.world_size
    else:  # as planned: replica r is fed by trainer DP rank r % dp, each TP rank sending its slices
        feeds = [(rank // rollout_layout.tp) % trainer.dp for rank in range(rollout.world_size)]
        moved = 0
        for bucket in groups:
            by_dp = defaultdict(list)  # trainer DP rank -> its TP ranks' (tp, pp, reference, bytes)
            for tp, pp, dp, ref, nbytes in filter(None, actor.export_slices(bucket, sorted(set(feeds)))):
                by_dp[dp].append((tp, pp, ref, nbytes))
            load = rollout.load_weight_slices.submit([[(tp, ref) for tp, _, ref, _ in by_dp[feed]] for feed in feeds])
            if deferred is not None and bucket is groups[-1]:
                deferred.append(load)
            else:
                load.result()
            for dst, feed in enumerate(feeds):
                for tp, pp, _, nbytes in by_dp[feed]:
                    pairs[f"{trainer.rank(tp, pp, feed)}->{dst}"] += nbytes
                    moved += nbytes
    return SyncReport(mode="colocated" if colocated else "separate", bytes_moved=moved, buckets=len(groups),
                      max_bucket_bytes=max(sizes), seconds=time.perf_counter() - start, plan=plan.summary(),
                      bytes_per_pair=dict(sorted(pairs.items())))


def sync_adapter(actor, rollout) -> SyncReport:
    """Copy the actor's LoRA adapter (not the frozen base) into every rollout engine; returns a
    SyncReport. Colocated: each process hands its engine the adapter in memory. Separate: the
    actor's rank 0 puts it in Ray's object store once and every rollout rank fetches it."""
    start = time.perf_counter()
    colocated = actor.hostset is rollout.hostset
    if colocated:
        sizes = actor.sync_adapter_to_colocated(rollout.role)
        nbytes, moved, pairs = sizes[0], sum(sizes), {}
    else:
        ref, nbytes = next(p for p in actor.export_adapter() if p)
        rollout.fetch_adapter([ref])
        moved = nbytes * rollout.world_size
        pairs = {f"0->{dst}": nbytes for dst in range(rollout.world_size)}
    return SyncReport(mode=f"{'colocated' if colocated else 'separate'} adapter", bytes_moved=moved, buckets=1,
                      max_bucket_bytes=nbytes, seconds=time.perf_counter() - start,
                      plan={"adapter_bytes": nbytes}, bytes_per_pair=pairs)


def layouts(mapping) -> tuple[TrainerLayout, RolloutLayout]:
    """Return the actor's training layout and the rollout's layout in a DeviceMapping."""
    a, r = mapping.roles["actor"], mapping.roles["rollout"]
    return TrainerLayout(tp=a.tp, pp=a.pp, dp=a.dp), RolloutLayout(tp=r.tp, replicas=r.dp)


def sync_mapped(groups: dict, mapping, spec: ModelSpec, bucket_mb: float = 64.0, adapter: bool = False,
                deferred: list | None = None) -> SyncReport:
    """Sync the actor's weights (with ``adapter``: its LoRA adapter alone) into the rollout
    engines of ``groups`` with the layouts of ``mapping`` (what the dataflow's sync stage and a
    remap call); returns the SyncReport. ``deferred``: see ``sync_weights``."""
    if adapter:
        return sync_adapter(groups["actor"], groups["rollout"])
    return sync_weights(groups["actor"], groups["rollout"], spec, *layouts(mapping), bucket_mb=bucket_mb,
                        deferred=deferred)


def _bucket_bytes(spec: ModelSpec, groups: list[list[str]], itemsize: int = 4) -> list[int]:
    import math

    shapes = hf_shapes(spec)
    return [sum(math.prod(shapes[n]) * itemsize for n in group) for group in groups]
