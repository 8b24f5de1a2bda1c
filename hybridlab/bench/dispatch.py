"""Controller overhead: a no-op call over 4 workers per dispatch mode vs a bare Ray actor call,
and Batch throughput through the object store."""
from __future__ import annotations

import statistics
import time

import ray
import torch

from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.protocol import Batch


class NoopWorker(Worker):
    """Does nothing, in every dispatch mode."""

    @register(Dispatch.ALL)
    def all(self):
        return None

    @register(Dispatch.DP)
    def dp(self, batch: Batch):
        return None

    @register(Dispatch.RANK_ZERO)
    def rank_zero(self):
        return None

    @register(Dispatch.RAW)
    def raw(self, x):
        return None

    @register(Dispatch.DP)
    def consume(self, batch: Batch) -> int:
        return batch.nbytes


@ray.remote(num_cpus=0)
class BareActor:
    def noop(self):
        return None

    def consume(self, tensors):
        return sum(t.nbytes for t in tensors.values())


def _median_ms(fn, iters: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(workers: int = 4, iters: int = 200, batch_mb: int = 64) -> dict:
    """Return median no-op latencies (ms) per dispatch mode beside bare Ray, and Batch MB/s."""
    connect(num_gpus=workers)
    mapping = DeviceMapping.from_dict({"pools": {"bench": {"devices": workers}},
                                       "roles": {"actor": {"pool": "bench", "dp": workers}}})
    bare = [BareActor.remote() for _ in range(workers)]
    ray.get([a.noop.remote() for a in bare])
    with WorkerSet(mapping, {"actor": NoopWorker}) as session:
        group = session.groups["actor"]
        tiny = Batch({"x": torch.zeros(workers, 4)})
        bare_ms = _median_ms(lambda: ray.get([a.noop.remote() for a in bare]), iters)
        # The DP call carries data; plain Ray carrying the same rows as torch tensors, for scale.
        tiny_parts = [{"x": c} for c in tiny["x"].chunk(workers)]
        bare_data_ms = _median_ms(lambda: ray.get([a.consume.remote(p) for a, p in zip(bare, tiny_parts)]), iters)
        dispatch_ms = {
            "all": _median_ms(group.all, iters),
            "dp": _median_ms(lambda: group.dp(tiny), iters),
            "rank_zero": _median_ms(group.rank_zero, iters),
            "raw": _median_ms(lambda: group.raw(list(range(workers))), iters),
        }
        rows = batch_mb * 2**20 // (4 * 1024)
        big = Batch({"x": torch.randn(rows, 1024)})
        session.timeline.clear()
        batch_s = _median_ms(lambda: group.consume(big), 5, warmup=1) / 1e3
        # Baseline: the same bytes, split the same way, sent as plain tensors to bare actors.
        parts = [{"x": c} for c in big["x"].chunk(workers)]
        bare_batch_s = _median_ms(lambda: ray.get([a.consume.remote(p) for a, p in zip(bare, parts)]), 5,
                                  warmup=1) / 1e3
    for a in bare:
        ray.kill(a)
    mb = big.nbytes / 2**20
    return {
        "workers": workers, "iters": iters,
        "bare_ray_ms": round(bare_ms, 3),
        "dispatch_ms": {k: round(v, 3) for k, v in dispatch_ms.items()},
        "overhead_ms": round(max(dispatch_ms.values()) - bare_ms, 3),
        "bare_ray_same_data_ms": round(bare_data_ms, 3),
        "dp_overhead_vs_same_data_ms": round(dispatch_ms["dp"] - bare_data_ms, 3),
        "batch_mb": round(mb, 1),
        "batch_mb_per_s": round(mb / batch_s, 1),
        "bare_tensor_mb_per_s": round(mb / bare_batch_s, 1),
    }
