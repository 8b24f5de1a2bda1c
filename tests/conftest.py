"""Shared fixtures and how the suite runs.

`make test` runs it on two pytest-xdist workers, each pinned to its own core (``pytest_configure``)
and handed whole modules, longest first (``LONGEST``). Shared: a private hybridlab cache per run,
the zoo models and the trained fixture built once per run (across workers too: each build holds
a file lock), one local Ray cluster per worker (``ray_local``), which the processes a test starts
attach to (``ray_address``). Every cluster and server the suite starts stays on loopback."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridlab.environment import use_loopback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No warm pool (controller/warm_pool.py) for the suite's sessions, nor for the notebook kernels and
# documentation examples it starts: a suite bound by CPU gains nothing from warming processes ahead, and
# each would take a core from the test running meanwhile. The pool's own tests turn it on.
os.environ["HYBRIDLAB_WARM_PROCESSES"] = "0"
# The suite's traffic stays on loopback. Ray's single-machine mode: every Ray cluster the tests
# start (their own, the subprocesses', the simulated nodes of test_multinode) binds and connects
# on 127.0.0.1 instead of this machine's network address (read when Ray is imported); gloo's
# connections (Megatron, vLLM's TP groups) and vLLM's own address on the loopback interface.
# The processes the tests start inherit these.
use_loopback()


# Modules, longest first (their seconds in a full `make test` run, AMD EPYC family 25 with AVX-512,
# d4ffb14): with two pytest-xdist workers and ``--dist loadfile`` each module is one unit of work,
# handed to whichever worker is free, so the long ones go out first and the workers finish close
# together. The others follow in file order; a stale list costs balance, never correctness.
# test_multinode (160 s) stops the worker's shared cluster (it runs two nodes of its own), and the
# next module on that worker starts it again (about 6 s): far less than the idle core it left at
# the end of the run when it was handed out last (about 140 s at d4ffb14).
LONGEST = ["test_bench.py", "test_remap.py", "test_families.py", "test_notebook.py", "test_resume.py",
           "test_agents.py", "test_multinode.py", "test_train.py", "test_fsdp.py", "test_streaming.py",
           "test_worker_faults.py", "test_bench_e2e.py", "test_controller.py", "test_widgets.py", "test_rl.py",
           "test_train_cli.py", "test_lab_browser.py", "test_verl_run.py", "test_docs.py", "test_sync.py",
           "test_lora.py", "test_preference.py", "test_dashboard.py", "test_ray_job.py", "test_sft.py",
           "test_bad_updates.py", "test_advisor.py", "test_warm_pool.py", "test_tinker.py", "test_rollout.py",
           "test_sandbox.py", "test_chat.py", "test_reasoning_gym.py", "test_zoo.py"]


# Handed out last, whatever its length: test_binding's ``every_core`` starts the worker's cluster again
# without the worker's core pin, and a module after it would start the pinned one again.
LAST = ["test_binding.py"]


SUITE_MODULES = os.environ.get("HYBRIDLAB_SUITE_MODULES")  # scripts/suite_cpu.py modules: when each module began
_MODULE: dict[str, str] = {}


def pytest_runtest_logstart(nodeid, location):
    """With HYBRIDLAB_SUITE_MODULES set, append a line to that file each time this process begins a
    test module: its pid, the module and the time (what scripts/suite_cpu.py attributes processes by)."""
    module = nodeid.split("::")[0]
    if SUITE_MODULES and _MODULE.get("now") != module:
        import json
        import time

        _MODULE["now"] = module
        with open(SUITE_MODULES, "a") as log:
            log.write(json.dumps({"pid": str(os.getpid()), "module": module, "time": time.time()}) + "\n")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST)}
    rank.update({name: len(LONGEST) + 1 + i for i, name in enumerate(LAST)})  # after the modules in file order
    module = {item: item.nodeid.split("::")[0].rsplit("/", 1)[-1] for item in items}
    items.sort(key=lambda item: rank.get(module[item], len(LONGEST)))  # stable: a module's tests keep their order


ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def pytest_configure(config):
    """Under pytest-xdist, pin each worker (and so every process its tests start: Ray, engines,
    subprocess runs) to its own share of the cores, threads sized to that share: the workers
    then never contend for a core, and each test runs as on a machine of that many cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    from hybridlab.controller.binding import pin_process, set_threads

    share = ALL_CORES[int(worker.removeprefix("gw")) % count::count] or ALL_CORES
    pin_process(share)
    set_threads(len(share))


@pytest.fixture
def every_core(shared_cluster):
    """Every core the suite started with, for a test whose point needs several (thread binding):
    the test worker's pin is lifted and the shared cluster started again under it; afterwards
    both go back (the next module starts the cluster again, pinned)."""
    import ray

    from hybridlab.controller.binding import pin_process, set_threads

    pinned = sorted(os.sched_getaffinity(0))
    if pinned == ALL_CORES:
        yield ALL_CORES
        return
    if ray.is_initialized():
        ray.shutdown()
    pin_process(ALL_CORES)
    set_threads(len(ALL_CORES))
    try:
        yield ALL_CORES
    finally:
        if ray.is_initialized():
            ray.shutdown()
        pin_process(pinned)
        set_threads(len(pinned))


def _shared_dir(tmp_path_factory, name: str) -> Path:
    """A folder all xdist workers of this run share (the run's base temp dir without xdist)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def hybridlab_home(tmp_path_factory):
    """Point HYBRIDLAB_HOME at a fresh folder so tests never touch the user's model cache."""
    home = _shared_dir(tmp_path_factory, "hybridlab-home")
    old = os.environ.get("HYBRIDLAB_HOME")
    os.environ["HYBRIDLAB_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("HYBRIDLAB_HOME", None)
    else:
        os.environ["HYBRIDLAB_HOME"] = old


@pytest.fixture(scope="session")
def tiny_dir(hybridlab_home):
    """Path of the tiny Qwen2-style zoo checkpoint (built once per run)."""
    from hybridlab.models.zoo import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def tiny_llama_dir(hybridlab_home):
    """Path of the tiny Llama-style zoo checkpoint (built once per run)."""
    from hybridlab.models.zoo import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session")
def trained_dir(tiny_dir, hybridlab_home):
    """tiny after a short SFT on addition (about 10 s, once per run): peaked distributions, so
    greedy decoding is a sharp check of weights."""
    from hybridlab import sft
    from hybridlab.atomic import built_once
    from hybridlab.evaluate import load_hf
    from hybridlab.tasks import get_task

    out = hybridlab_home / "fixtures" / "tiny-arith"

    def train() -> None:
        model, tok = load_hf(tiny_dir)
        sft.train(model, tok, get_task("arith"), sft.SFTConfig(steps=300, warmup_steps=20), progress=False)
        sft.save_checkpoint(model, tok, out)

    return built_once(out, train)


class SharedCluster:
    """The run's local Ray cluster (4 logical GPUs, 8 CPUs, a short temp dir of its own): started
    by the first module that asks for it and kept for the next ones, started again after a
    module that stopped it (test_multinode runs its own), stopped when the run ends."""

    def __init__(self):
        self.address: str | None = None
        self.temp_dirs: list[str] = []

    def up(self) -> dict:
        """Connect this process to the shared cluster (starting it if needed); returns its resources."""
        import tempfile

        import ray

        from hybridlab.controller.resources import connect

        if ray.is_initialized() and ray.get_runtime_context().gcs_address != self.address:
            ray.shutdown()  # a cluster a test started by itself: not the shared one
        if not ray.is_initialized():
            self.temp_dirs.append(tempfile.mkdtemp(prefix="hlray-", dir="/tmp"))  # short: socket paths are limited
            connect(num_gpus=4, num_cpus=8, temp_dir=self.temp_dirs[-1])
            self.address = ray.get_runtime_context().gcs_address
        return ray.cluster_resources()

    def release_leftovers(self) -> None:
        """Remove the placement groups a module left reserved, so the next module finds every
        device free (a module's sessions release theirs; a failed test may not)."""
        import ray
        from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

        if not ray.is_initialized() or ray.get_runtime_context().gcs_address != self.address:
            return
        for pg_id, info in placement_group_table().items():
            if info["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))

    def down(self) -> None:
        import shutil

        import ray

        if ray.is_initialized():
            ray.shutdown()
        for path in self.temp_dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_cluster():
    """The run's SharedCluster (stopped at the end of the run)."""
    cluster = SharedCluster()
    yield cluster
    cluster.down()


@pytest.fixture(scope="module")
def ray_local(shared_cluster):
    """This process connected to the run's shared local Ray cluster; returns its resources.
    Modules share it: each leaves it as it found it (its sessions shut down, their devices free)."""
    yield shared_cluster.up()
    shared_cluster.release_leftovers()


@pytest.fixture(scope="module")
def ray_address(ray_local, shared_cluster):
    """The shared cluster's address, set as RAY_ADDRESS for the processes this module's tests
    start: `hybridlab train`, notebook kernels and the docs' examples attach to it (as they
    would to a user's cluster) instead of each starting and stopping one of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ADDRESS", shared_cluster.address)
        yield shared_cluster.address
