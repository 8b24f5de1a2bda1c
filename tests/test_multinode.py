"""Two simulated nodes (ray.cluster_utils.Cluster), attached to by address like a real cluster."""
import shutil
import sys
import tempfile

import pytest
import ray

from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.controller.worker import Dispatch, Worker, register

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Where(Worker):
    @register(Dispatch.ALL)
    def where(self):
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), tuple(str(g) for g in ray.get_gpu_ids())


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    import os

    temp_dir = tempfile.mkdtemp(prefix="hlray-", dir="/tmp")
    old_tmp = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir  # Ray also writes its address file under the default temp root
    os.makedirs(os.path.join(temp_dir, "ray"))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2, num_gpus=2)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()
    if old_tmp is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old_tmp
    shutil.rmtree(temp_dir, ignore_errors=True)


MAPPING = DeviceMapping.from_dict({"pools": {"wide": {"devices": 4, "strategy": "SPREAD"}},
                                   "roles": {"actor": {"pool": "wide", "dp": 4}}})


def test_spread_lands_on_both_nodes_and_ranks_map_stably(cluster):
    session = WorkerSet(MAPPING, {"actor": Where}, address=cluster.address, timeout=120).start()
    try:
        first = session.groups["actor"].where()
        assert len({node for node, _ in first}) == 2
        assert len(set(first)) == 4
        assert session.recreate("actor").where() == first
    finally:
        session.shutdown()
    again = WorkerSet(MAPPING, {"actor": Where}, address=cluster.address, timeout=120).start()
    try:
        assert again.groups["actor"].where() == first   # a fresh pool on the same devices: same ranks
    finally:
        again.shutdown()


def test_too_few_devices_is_refused_before_anything_starts(cluster):
    big = DeviceMapping.from_dict({"pools": {"p": {"devices": 6}}, "roles": {"actor": {"pool": "p", "dp": 6}}})
    with pytest.raises(Exception, match="too few devices: the pools need 6 devices, the cluster has 4 GPUs"):
        WorkerSet(big, {"actor": Where}, address=cluster.address).start()
