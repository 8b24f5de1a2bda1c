"""Two simulated nodes (ray.cluster_utils.Cluster), attached to by address like a real cluster:
placement across them, pools pinned to labelled nodes, and an RL run whose weights cross the
node boundary."""
import json
import re
import shutil
import sys
import tempfile

import pytest
import ray

from hybridlab.controller.mapping import DeviceMapping, MappingError
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.errors import UserError

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
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False,
                                                      "labels": {LABEL: "head"}})
    c.add_node(num_cpus=2, num_gpus=2, labels={LABEL: "second"})
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()
    if old_tmp is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old_tmp
    shutil.rmtree(temp_dir, ignore_errors=True)


LABEL = "hybridlab/node"
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
    with pytest.raises(MappingError, match="too few devices: the pools need 6 devices, the cluster has 4 GPUs"):
        WorkerSet(big, {"actor": Where}, address=cluster.address).start()


def node_ids() -> dict[str, str]:
    """Return each node's label value -> its Ray node id."""
    return {n["Labels"][LABEL]: n["NodeID"] for n in ray.nodes() if n["Alive"] and LABEL in n.get("Labels", {})}


def test_a_pool_pinned_to_a_label_no_node_carries_is_refused_at_once_naming_the_nodes(cluster):
    nowhere = DeviceMapping.from_dict({"pools": {"p": {"devices": 1, "node_labels": {LABEL: "third"}}},
                                       "roles": {"actor": {"pool": "p"}}})
    with pytest.raises(UserError, match=r"pool 'p': no node carries the labels \{'hybridlab/node': 'third'\}"
                                        r" \(pools.p.node_labels\); nodes: ") as refused:
        WorkerSet(nowhere, {"actor": Where}, address=cluster.address).start()
    for name in ("head", "second"):  # each node named with its devices and labels
        assert f"127.0.0.1 (2 GPUs, labels {{'hybridlab/node': '{name}'}})" in str(refused.value)
    bad = {"pools": {"p": {"devices": 1, "node_labels": {LABEL: 3}}}, "roles": {"actor": {"pool": "p"}}}
    assert DeviceMapping.from_dict(bad).problems() == [
        "pools.p.node_labels: must map label names to values (strings), e.g. {\"hybridlab/node\": \"gen\"},"
        " got {'hybridlab/node': 3}"]


SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=8", "data.test_samples=8", "trainer.progress=false", "trainer.save_every=0",
            "trainer.eval_every=0"]


def rollout_actor_gap(batch) -> float:
    """Return the largest |rollout log-prob - actor's old log-prob| over the batch's response tokens."""
    mask = batch["response_mask"].bool()
    return float((batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max())


def test_an_rl_run_across_two_nodes_equals_the_same_run_on_one(cluster, trained_dir, tmp_path):
    """Actor and reference on one node, rollout and reward on the other: the weights sync across
    the node boundary every step, and the seeded steps equal those of the same run on one node."""
    from hybridlab.controller.resources import connect
    from hybridlab.dataflow.session import RLSession

    # the old log-probs recomputed on the actor: a weight sync that never landed shows as a rollout/actor gap
    settings = [*SETTINGS, "actor.use_kl_loss=true", "actor.use_rollout_log_probs=false"]

    def run(train: str, gen: str) -> tuple[dict, list[dict]]:
        mapping = {"pools": {"train": {"devices": 1, "node_labels": {LABEL: train}},
                             "gen": {"devices": 1, "node_labels": {LABEL: gen}}},
                   "roles": {"actor": {"pool": "train"}, "ref": {"pool": "train"}, "rollout": {"pool": "gen"},
                             "reward": {"pool": "gen"}}}
        rl = RLSession(None, [f"model={trained_dir}", *settings, f"mapping={json.dumps(mapping)}",
                              f"trainer.run_dir={tmp_path / f'{train}-{gen}'}"], ray_address=cluster.address).start()
        try:
            where = {role: {p["node_id"] for p in group.placements} for role, group in rl.workers.groups.items()}
            steps = [rl.step() for _ in range(2)]
        finally:
            rl.shutdown()
        repeatable = [{k: v for k, v in s.metrics.items() if not k.startswith(("timing/", "perf/", "sync/"))}
                      for s in steps]
        assert all(rollout_actor_gap(s.batch) < 1e-4 for s in steps)  # each step sampled the synced weights
        return where, repeatable, [s.metrics["sync/bytes"] for s in steps]

    connect(address=cluster.address)  # run alone too: node_ids() asks the cluster before any session does
    nodes = node_ids()
    one_where, one, _ = run("head", "head")
    two_where, two, synced = run("head", "second")
    assert one_where == {role: {nodes["head"]} for role in ("actor", "ref", "rollout", "reward")}
    assert two_where == {"actor": {nodes["head"]}, "ref": {nodes["head"]}, "rollout": {nodes["second"]},
                         "reward": {nodes["second"]}}
    assert all(b > 0 for b in synced)       # the actor's weights went to the other node each step
    assert two == one                       # the same seeded steps, wherever the roles ran
    assert "actor/kl_loss" in two[0] and two[0]["reward/mean"] == one[0]["reward/mean"]


def test_losing_the_rollout_node_re_creates_its_roles_on_the_other_and_the_run_goes_on(cluster, trained_dir,
                                                                                         tmp_path):
    """Rollout and reward on the second node (the head's spare device held while they start);
    the node is removed mid-run: Ray moves the pool's bundle to the head, the roles are
    re-created there and the run goes on. Last in the module: the cluster keeps one node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from hybridlab.controller.resources import connect
    from hybridlab.dataflow.session import RLSession

    mapping = {"pools": {"train": {"devices": 1, "node_labels": {LABEL: "head"}}, "gen": {"devices": 1}},
               "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "gen"}, "reward": {"pool": "gen"}}}
    connect(address=cluster.address)
    nodes = node_ids()
    filler = placement_group([{"GPU": 1}], bundle_label_selector=[{LABEL: "head"}])  # the head's second device
    ray.get(filler.ready(), timeout=60)
    rl = RLSession(None, [f"model={trained_dir}", *SETTINGS, f"mapping={json.dumps(mapping)}", "trainer.max_restarts=2",
                          "actor.use_rollout_log_probs=false", f"trainer.run_dir={tmp_path / 'run'}"],
                   ray_address=cluster.address).start()
    try:
        remove_placement_group(filler)
        assert {p["node_id"] for p in rl.workers.groups["rollout"].placements} == {nodes["second"]}
        rl.save_checkpoint()
        first = rl.step()
        second = next(n for n in cluster.worker_nodes if n.node_id == nodes["second"])
        cluster.remove_node(second)
        again = rl.step()
        assert rl.state.restarts[-1]["recreated"] == ["reward", "rollout"] and again.metrics["faults/worker_restarts"] == 1
        assert {p["node_id"] for p in rl.workers.groups["rollout"].placements} == {nodes["head"]}
        # the re-created rollout was given the actor's weights: it samples what the actor scores
        assert again.metrics["sync/bytes"] > 0 and rollout_actor_gap(first.batch) < 1e-4
        assert rollout_actor_gap(again.batch) < 1e-4
    finally:
        rl.shutdown()


def test_losing_the_only_node_a_pool_is_pinned_to_stops_the_run_with_a_checkpoint_naming_the_node(cluster,
                                                                                                    trained_dir,
                                                                                                    tmp_path):
    """The rollout pool pinned to a node that goes away, with no other node carrying its label:
    train() stops with a checkpoint of the last finished step and says which node went."""
    from hybridlab.dataflow import checkpoints
    from hybridlab.dataflow.session import RLSession

    third = cluster.add_node(num_cpus=2, num_gpus=1, labels={LABEL: "third"})
    cluster.wait_for_nodes()
    mapping = {"pools": {"train": {"devices": 1, "node_labels": {LABEL: "head"}},
                         "gen": {"devices": 1, "node_labels": {LABEL: "third"}}},
               "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "gen"}, "reward": {"pool": "gen"}}}
    rl = RLSession(None, [f"model={trained_dir}", *SETTINGS, f"mapping={json.dumps(mapping)}",
                          f"trainer.run_dir={tmp_path / 'run'}"], ray_address=cluster.address).start()
    try:
        assert rl.train(1)["failed"] is False
        cluster.remove_node(third)
        summary = rl.train(2)
    finally:
        rl.shutdown()
    assert summary["failed"] is True and summary["steps"] == 1
    assert re.fullmatch(r"worker (rollout|reward) rank 0 died in \w+: node 127\.0\.0\.1 \(node \w{12}\) is gone, and no"
                        r" other node carries pools\.gen\.node_labels \{'hybridlab/node': 'third'\}; the run stops",
                        summary["stopped_by"]), summary["stopped_by"]
    assert json.loads((checkpoints.checkpoint_dirs(tmp_path / "run")[-1] / "session.json").read_text())["step"] == 1
