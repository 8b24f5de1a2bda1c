"""Shared fixtures: a private hybridlab cache per test run, and the zoo models and the trained
fixture built once per run (also across pytest-xdist workers, should a run use them: each
build holds a file lock, so concurrent workers build once and share it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's traffic stays on loopback. Ray's single-machine mode: every Ray cluster the tests
# start (their own, the subprocesses', the simulated nodes of test_multinode) binds and connects
# on 127.0.0.1 instead of this machine's network address (read when Ray is imported); gloo's
# connections (Megatron, vLLM's TP groups) and vLLM's own address on the loopback interface.
# The processes the tests start inherit these.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
os.environ["VLLM_HOST_IP"] = "127.0.0.1"


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


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    """A local Ray cluster with 4 logical GPUs and its own temp dir, shared by one test module."""
    import shutil
    import tempfile

    import ray

    from hybridlab.controller.resources import connect

    if ray.is_initialized():
        ray.shutdown()
    temp_dir = tempfile.mkdtemp(prefix="hlray-", dir="/tmp")  # short: Ray's socket paths are limited
    resources = connect(num_gpus=4, num_cpus=8, temp_dir=temp_dir)
    yield resources
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)
