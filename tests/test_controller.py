"""The controller on a real local Ray cluster: dispatch, placement, colocation, faults, remap."""
import gc
import os
import sys
import time

import pytest
import ray
import torch

from hybridlab.controller.calls import WorkerError
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping, MappingError
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.protocol import Batch

# Worker processes cannot import this test module; ship its classes by value instead.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Probe(Worker):
    """A worker that reports where it runs and does small, checkable work."""

    def __init__(self, scale: int = 1, tp: int = 1):
        self.scale, self.tp = scale, tp

    def dp_info(self):
        # Pretend to be tensor-parallel: consecutive ranks form a TP group, TP rank 0 answers.
        return self.rank // self.tp, self.world_size // self.tp, self.rank % self.tp == 0

    @register(Dispatch.ALL)
    def where(self):
        # the cores any thread of the process may run on
        cores = sorted({c for tid in os.listdir("/proc/self/task") for c in os.sched_getaffinity(int(tid))})
        return {"rank": self.rank, "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()],
                "master": (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]), "cores": cores,
                "threads": torch.get_num_threads(), "collector": (gc.isenabled(), gc.get_freeze_count())}

    @register(Dispatch.ALL)
    def devices(self):
        """What the process's engines would see: its device variable."""
        return {"pid": os.getpid(), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

    @register(Dispatch.DP)
    def scaled(self, batch: Batch, offset: int = 0) -> Batch:
        return Batch({"y": batch["x"] * self.scale + offset, "dp": torch.full((len(batch),), self.rank // self.tp)},
                     {"text": [t.upper() for t in batch["text"]]})

    @register(Dispatch.RANK_ZERO)
    def hello(self, name: str) -> str:
        return f"hello {name} from {self.rank}"

    @register(Dispatch.RAW)
    def add(self, a: int, b: int) -> int:
        return a + b + self.rank

    @register(Dispatch.ALL)
    def all_reduce_ranks(self) -> float:
        import torch.distributed as dist

        self.init_distributed()
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return t.item()

    @register(Dispatch.ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad input on purpose at rank {rank}")
        return self.rank

    @register(Dispatch.DP)
    def update(self, batches: list, fail_at: int) -> list[list[int]]:
        """A step's optimizer steps' stand-in: each mini-batch's rows (column 0) recorded in order, a
        failure at the mini-batch holding row ``fail_at``."""
        done = []
        for batch in batches:
            rows = batch["x"][:, 0].tolist()
            if fail_at in rows:
                raise ValueError(f"the update of row {fail_at} fails on purpose")
            self.updates = [*getattr(self, "updates", []), rows]
            done.append(rows)
        return done

    @register(Dispatch.ALL)
    def updates_made(self) -> list[list[int]]:
        made, self.updates = getattr(self, "updates", []), []
        return made

    @register(Dispatch.RANK_ZERO)
    def die(self) -> None:
        os._exit(1)

    @register(Dispatch.RANK_ZERO)
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(Dispatch.RANK_ZERO, blocking=False)
    def wait_for(self, signal_name: str) -> str:
        signal = ray.get_actor(signal_name)
        while not ray.get(signal.is_set.remote()):
            time.sleep(0.01)
        return "released"

    @register(Dispatch.RANK_ZERO)
    def release(self, signal_name: str) -> None:
        ray.get(ray.get_actor(signal_name).set.remote())


@ray.remote(num_cpus=0)
class Signal:
    def __init__(self):
        self.flag = False

    def set(self):
        self.flag = True

    def is_set(self):
        return self.flag


MAPPING = DeviceMapping.from_dict({
    "pools": {"main": {"devices": 4}},
    "roles": {"actor": {"pool": "main", "tp": 2, "dp": 2, "colocate": "engine"},
              "reward": {"pool": "main", "dp": 4, "colocate": "engine"},
              "critic": {"pool": "main", "dp": 4}},
})


@pytest.fixture(scope="module")
def session(ray_local):
    s = WorkerSet(MAPPING, {"actor": RoleClass(Probe, kwargs={"tp": 2}), "reward": RoleClass(Probe, kwargs={"scale": 10}),
                          "critic": Probe}, timeout=60).start()
    yield s
    s.shutdown()


def test_a_re_created_group_starts_in_warmed_spares_on_its_own_devices(ray_local):
    # First in the module: the shared session below takes all four devices once it starts.
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 2}}, "roles": {"critic": {"pool": "p", "dp": 2}}})
    s = WorkerSet(mapping, {"critic": Probe}, timeout=60, spares=2).start()
    try:
        fresh = s.groups["critic"].devices()
        assert s.spares.wait_ready(timeout=300) == 2
        warmed = [ray.get(sp.warmed) for sp in s.spares.spares]
        spare_pids = {w["pid"] for w in warmed}
        # they imported what the running workers had imported (torch among it), without a device
        assert "torch" in s.spares.modules and not any("torch" in w["failed_imports"] for w in warmed)
        assert not any(w["device_touched"] for w in warmed)
        assert not spare_pids & {d["pid"] for d in fresh}
        group = s.recreate("critic")
        adopted = group.devices()
        assert {d["pid"] for d in adopted} == spare_pids and s.spares.taken == 2
        # each spare took its bundle's device, as Ray gave it to the processes it replaced
        assert sorted(d["cuda_visible"] for d in adopted) == sorted(d["cuda_visible"] for d in fresh)
        assert sorted(p["gpu_ids"] for p in group.placements) == sorted([d["cuda_visible"]] for d in fresh)
        assert group.all_reduce_ranks() == [1.0, 1.0]  # the rendezvous works between adopted spares
        assert len(s.spares.spares) == 2  # replaced after use
        # a spare that died while idle is passed over: its bundle gets a new process
        assert s.spares.wait_ready(timeout=300) == 2
        dead, alive = s.spares.spares
        ray.kill(dead.actor, no_restart=True)
        group = s.recreate("critic")
        pids = {d["pid"] for d in group.devices()}
        assert ray.get(alive.warmed)["pid"] in pids and len(pids) == 2 and s.spares.taken == 3
        assert group.all_reduce_ranks() == [1.0, 1.0]
        with pytest.raises(ValueError, match="spares must be a whole number >= 0, got -1"):
            s.set_spares(-1)
    finally:
        s.shutdown()
    assert s.spares.spares == []


def test_placement_colocation_and_rendezvous(session):
    actor, reward, critic = (session.groups[r].where() for r in ("actor", "reward", "critic"))
    assert [w["rank"] for w in actor] == [0, 1, 2, 3]
    assert [w["pid"] for w in actor] == [w["pid"] for w in reward]          # colocated: one process
    assert not {w["pid"] for w in actor} & {w["pid"] for w in critic}   # separate processes ...
    assert [w["gpus"] for w in actor] == [w["gpus"] for w in critic]    # ... on the same devices
    assert len({tuple(w["gpus"]) for w in actor}) == 4
    assert len({w["master"] for w in actor}) == 1
    # the tests' Ray clusters stay on loopback (conftest.py), the group's rendezvous with them
    assert {w["master"][0] for w in actor + critic} == {"127.0.0.1"}
    # each process built its workers with the collector paused, then froze what the build made
    assert all(w["collector"][0] and w["collector"][1] > 1000 for w in actor + critic)
    assert session.groups["critic"].all_reduce_ranks() == [6.0] * 4


def test_dp_dispatch_splits_pads_and_collects_one_rank_per_group(session):
    batch = Batch({"x": torch.arange(7)}, {"text": list("abcdefg")})
    out = session.groups["actor"].scaled(batch, offset=1)   # dp=2 (tp=2): chunks of 4, 1 padding row
    assert out["y"].tolist() == [x + 1 for x in range(7)]
    assert out["dp"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out["text"] == list("ABCDEFG")
    out = session.groups["reward"].scaled(batch)               # dp=4: chunks of 2
    assert out["y"].tolist() == [10 * x for x in range(7)]
    assert out["dp"].tolist() == [0, 0, 1, 1, 2, 2, 3]


def test_other_dispatch_modes(session):
    actor = session.groups["actor"]
    assert actor.hello("ada") == "hello ada from 0"
    assert actor.add([1, 2, 3, 4], b=[10, 20, 30, 40]) == [11, 23, 35, 47]
    with pytest.raises(ValueError, match="list of 4 per-rank values"):
        actor.add([1, 2], b=[1, 2, 3, 4])
    assert "dispatch=dp" in repr(actor.scaled)


def test_futures_let_independent_calls_overlap(session):
    name = f"signal-{time.time()}"
    signal = Signal.options(name=name).remote()
    pending = session.groups["critic"].wait_for(name)       # blocking=False: returns a future
    assert not pending.done()
    session.groups["actor"].release(name)                   # would deadlock if calls were serial
    assert pending.result(timeout=30) == "released"
    ray.kill(signal)


def test_a_steps_updates_go_in_one_call_each_split_over_the_dp_ranks_and_a_failure_stops_the_rest(session):
    """run_updates sends a step's mini-batches in one call to each process: each mini-batch is
    split over the data-parallel ranks as a lone Batch is (the TP peers of a rank share one
    stored copy of their part: 3 x 128 KiB here), each rank runs its parts in order, and the
    answers come back per mini-batch and per DP rank. A failed one stops those after it in its
    process; the processes answer at once and no call is left listed as running."""
    from hybridlab.dataflow.update_stages import run_updates

    group = session.groups["actor"]  # 4 ranks: dp 2 x tp 2, TP rank 0 answers
    batches = [Batch({"x": (torch.arange(4) + 10 * i)[:, None].repeat(1, 8192)}) for i in range(3)]
    group.updates_made()
    assert run_updates(group.update, batches, -1) == [[[10 * i, 10 * i + 1], [10 * i + 2, 10 * i + 3]]
                                                      for i in range(3)]
    dp0, dp1 = [[0, 1], [10, 11], [20, 21]], [[2, 3], [12, 13], [22, 23]]
    assert group.updates_made() == [dp0, dp0, dp1, dp1]  # each rank its DP part of each, in order; TP peers alike
    future = group.update.submit(batches, -1)  # timed per mini-batch: 3 x the 120 s floor (quick ones)
    assert [c["deadline_s"] for c in session.watch.running() if c["method"] == "update"] == [360.0]
    future.result()
    group.updates_made()
    with pytest.raises(WorkerError, match="the update of row 10 fails on purpose"):
        run_updates(group.update, batches, 10)
    assert group.ping(timeout=1.0) and group.updates_made() == [[[0, 1]], [[0, 1]], dp1, dp1]  # dp 0 stopped
    assert [c for c in session.watch.running() if c["method"] == "update"] == []


def test_spans_record_every_call_with_bytes(session):
    session.timeline.clear()
    batch = Batch({"x": torch.arange(8)}, {"text": list("abcdefgh")})
    session.groups["reward"].scaled(batch)
    spans = session.timeline.spans(role="reward", method="scaled")
    assert sorted(s.rank for s in spans) == [0, 1, 2, 3]
    assert all(s.end >= s.start and s.bytes_in == 2 * 8 and s.bytes_out == 2 * 8 * 2 for s in spans)


def test_errors_name_role_rank_method_with_traceback(session):
    with pytest.raises(WorkerError) as info:
        session.groups["critic"].fail_on(2)
    err = info.value
    assert (err.role, err.rank, err.method, err.kind) == ("critic", 2, "fail_on", "raised")
    assert "ValueError: bad input on purpose at rank 2" in str(err) and "Traceback" in str(err)
    assert session.groups["critic"].fail_on(-1) == [0, 1, 2, 3]   # the group still works


def test_timeouts_do_not_hang(session):
    with pytest.raises(WorkerError, match="worker actor rank 0 timed out in nap"):
        session.groups["actor"].nap.submit(3).result(timeout=0.5)
    session.groups["actor"].nap(0)  # the worker is fine afterwards


def test_a_steps_mini_batches_repeat_their_objects_each_epoch_so_a_call_pickles_each_once():
    import pickle

    from hybridlab.dataflow.update_stages import mini_batches

    batch = Batch({"x": torch.arange(8 * 1024).reshape(8, 1024)})
    steps = mini_batches(batch, prompts=2, n=2, epochs=3)  # 2 mini-batches of 4 rows, 3 passes
    assert [s["x"][:, 0].tolist() for s in steps] == [[0, 1024, 2048, 3072], [4096, 5120, 6144, 7168]] * 3
    assert all(steps[i] is steps[i % 2] for i in range(6))
    assert len(pickle.dumps(steps)) < 1.1 * len(pickle.dumps(steps[:2]))  # the data once, not 3 times


def test_a_call_of_a_steps_updates_is_given_each_updates_deadline(monkeypatch):
    """A call doing a step's n optimizer steps (``run_updates``) is timed per step: before a call
    of its kind has finished, ``first_s`` for its first step and the floor for each other one;
    afterwards 5 times the longest recent step, times n; a fixed deadline also counts per step."""
    from hybridlab.controller import watch as watch_module

    clock = [1000.0]
    monkeypatch.setattr(watch_module.time, "time", lambda: clock[0])
    watch = watch_module.CallWatch(floor_s=120.0, first_s=600.0)
    assert watch.deadline("actor", "update_actor", "update_actor", 4) == 600.0 + 3 * 120.0
    call = watch.begin("actor", "update_actor", "update_actor", [0], [1], units=4)
    assert watch.running()[0]["deadline_s"] == 960.0
    clock[0] += 200.0  # 50 s a step
    watch.end(call, ok=True)
    assert watch.deadline("actor", "update_actor", "update_actor", 4) == 5 * 50.0 * 4
    assert watch.deadline("actor", "update_actor", "update_actor", 1) == 250.0  # one step: 5 x 50 s
    watch.configure(floor_s=120.0, fixed_s=30.0)
    assert watch.deadline("actor", "update_actor", "update_actor", 4) == 120.0


def test_a_call_past_its_deadline_is_reported_stuck_with_the_stacks_of_its_process(session, tmp_path):
    watch = session.watch
    watch.stacks_dir = tmp_path
    watch.configure(floor_s=1.0, fixed_s=0.0)
    watch.forget({"actor"})  # the earlier tests' naps (one queued behind a 3 s nap) do not count
    try:
        for _ in range(3):
            session.groups["actor"].nap(0.01)
        assert watch.deadline("actor", "nap", "") == 1.0  # the floor: 5x the recent calls is less
        future = session.groups["actor"].nap.submit(60)
        time.sleep(0.3)
        assert [(c["role"], c["ranks"], c["method"], c["late"]) for c in watch.running()] == \
            [("actor", [0], "nap", False)]
        with pytest.raises(WorkerError, match=r"worker actor rank 0 stuck in nap:\nno answer after 1 s") as info:
            future.result()
        assert info.value.kind == "stuck"
        # its process is still busy with it: listed, late, until the process is replaced
        assert [(c["method"], c["late"]) for c in watch.running()] == [("nap", True)]
        (stack,) = tmp_path.glob("*-actor-nap-rank0-pid*.txt")
        assert "test_controller.py" in stack.read_text() and "in nap" in stack.read_text()  # where it was
        session.recreate("actor", close_timeout=0)  # the stuck process goes; a new one answers
        assert watch.running() == []
        assert session.groups["actor"].hello("x") == "hello x from 0"
    finally:
        watch.configure(floor_s=120.0, fixed_s=0.0)


def test_dead_worker_is_named_and_group_can_be_recreated(session):
    saved, loaded = [], []
    session.add_remap_hook(save=lambda role, g: saved.append(role) or role,
                           load=lambda role, g, state: loaded.append((role, state)))
    with pytest.raises(WorkerError) as info:
        session.groups["critic"].die()
    assert info.value.kind == "died" and info.value.rank == 0 and info.value.role == "critic"
    group = session.recreate("critic")
    assert group.all_reduce_ranks() == [6.0] * 4
    assert loaded == [("critic", None)]  # the dead group's state could not be saved
    session._hooks.clear()


def test_remap_recreates_only_changed_roles_and_validates_first(session):
    before = {r: [w["pid"] for w in session.groups[r].where()] for r in ("actor", "reward", "critic")}
    data = MAPPING.to_dict()
    data["roles"]["critic"] = {"pool": "main", "tp": 2, "dp": 2}
    bad = DeviceMapping.from_dict({**data, "roles": {**data["roles"], "critic": {"pool": "main", "dp": 3}}})
    with pytest.raises(MappingError, match="roles.critic: tp x pp x dp"):
        session.remap(bad)
    assert [w["pid"] for w in session.groups["critic"].where()] == before["critic"]   # untouched

    calls = []
    session.add_remap_hook(save=lambda role, g: f"state-of-{role}", load=lambda role, g, s: calls.append((role, s)))
    changed = session.remap(DeviceMapping.from_dict(data))
    assert changed == {"critic"} and calls == [("critic", "state-of-critic")]
    after = {r: [w["pid"] for w in session.groups[r].where()] for r in ("actor", "reward", "critic")}
    assert after["actor"] == before["actor"] and after["reward"] == before["reward"]
    assert not set(after["critic"]) & set(before["critic"])
    session._hooks.clear()



def test_a_process_with_ray_address_set_attaches_to_that_cluster(ray_local, ray_address):
    """As any Ray program: with RAY_ADDRESS set, connect() joins that cluster (here the run's
    shared one) instead of starting a local one."""
    import subprocess

    code = ("import ray; from hybridlab.controller.resources import connect; connect(num_gpus=1);"
            " print(ray.get_runtime_context().gcs_address, ray.cluster_resources()['GPU'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == [ray_address, "4.0"]  # the shared cluster's 4, not a new one's 1


def test_rendezvous_ports_are_free_and_below_the_ephemeral_range():
    """A port from bind(0) is ephemeral: an outgoing connection may take it as its source port
    before the group's TCPStore listens (EADDRINUSE, seen in the suite). free_port stays below."""
    import socket

    from hybridlab.controller.worker import WorkerHost

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {WorkerHost.free_port(None) for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1  # random, not one fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # free when returned
