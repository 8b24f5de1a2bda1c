"""Thread binding (trainer.bind_threads): each worker process pinned to its devices' share of the
node's cores. It runs with every core the suite started with (``every_core``), also when
pytest-xdist has pinned the test worker to one of them."""
import os
import sys

import ray
import torch

from hybridlab.controller.binding import BIND_ENV, device_cores
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.controller.worker import Dispatch, Worker, register

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

class Probe(Worker):
    @register(Dispatch.ALL)
    def where(self):
        """The cores any thread of the process may run on, its device and its thread count."""
        cores = sorted({c for tid in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(tid))})
        return {"gpus": [str(g) for g in ray.get_gpu_ids()], "cores": cores, "threads": torch.get_num_threads()}


def test_one_torch_thread_leaves_the_threads_an_in_process_engine_bound(monkeypatch):
    """vLLM's CPU engine, once it has bound its OpenMP threads, replaces torch.set_num_threads with
    a stand-in that warns and does nothing: the controller's one-thread scope then leaves the
    threads alone (no warning a step); with torch's own setter it sets one and puts them back."""
    from hybridlab.controller.binding import one_torch_thread

    calls, threads = [], torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    torch.set_num_threads(2)
    try:
        with one_torch_thread():
            calls.append(torch.get_num_threads())
        assert (calls, torch.get_num_threads()) == ([1], 2)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))  # vLLM's kind: records, not warns
        with one_torch_thread():
            calls.append(torch.get_num_threads())
        assert calls == [1, 2]  # the stand-in never called: the threads stay as they were
    finally:
        torch._C.set_num_threads(threads)


def test_device_cores_deal_the_nodes_cores_out_in_blocks():
    assert device_cores([0, 1, 2, 3], 2, [0]) == [0, 1] and device_cores([0, 1, 2, 3], 2, [1]) == [2, 3]
    assert device_cores([4, 5, 6, 7], 4, [1, 3]) == [5, 7]
    assert device_cores([0, 1], 4, [2]) == [0] and device_cores([0, 1], 4, [3]) == [1]  # more devices than cores
    assert device_cores([0, 1], 2, []) == [0, 1]
    assert device_cores([0, 1, 2, 3], 2, [3]) == [2, 3]  # a node whose ids do not start at 0


def test_bind_threads_pins_each_process_to_its_devices_cores(every_core):
    mapping = DeviceMapping.from_dict({"pools": {"a": {"devices": 1}, "b": {"devices": 1}},
                                       "roles": {"actor": {"pool": "a"}, "critic": {"pool": "b"}}})
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "binding needs a machine of two cores or more to show a difference"
    two = {"OMP_NUM_THREADS": "2"}
    with WorkerSet(mapping, {"actor": Probe, "critic": Probe}, timeout=60, env={**two, BIND_ENV: "1"}) as bound:
        placed = [w for r in ("actor", "critic") for w in bound.groups[r].where()]
    with WorkerSet(mapping, {"actor": Probe, "critic": Probe}, timeout=60, env=two) as free:
        unbound = [w for r in ("actor", "critic") for w in free.groups[r].where()]
    for w in placed:  # the local cluster's four devices deal out this machine's cores
        assert w["cores"] == device_cores(allowed, 4, [int(w["gpus"][0])])
        assert 0 < len(w["cores"]) < len(allowed)
        assert w["threads"] == len(w["cores"])  # no more threads than pinned cores
    assert [w["cores"] for w in unbound] == [allowed, allowed]
    assert [w["threads"] for w in unbound] == [2, 2]
