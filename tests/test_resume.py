"""Checkpoint and resume on the real engines: a `hybridlab train` driver killed with SIGKILL at
named points (mid-update, mid-checkpoint-write, mid-rollout), each time resumed with
`--resume`, then a worker killed mid-step and re-created, ends with per-step metrics identical
to the run that was never killed, and leaves no Ray or vLLM process and no /dev/shm segment
behind. The first killed driver owns its Ray cluster (its daemons must not outlive it); the
other runs attach to the run's shared cluster, as on a user's cluster (the killed drivers'
worker processes must not outlive them there)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray

from hybridlab.dataflow.checkpoints import checkpoint_dirs

STEPS = 6
SETTINGS = ["warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
            "actor.ppo_mini_batch_size=8", "data.test_samples=16", "trainer.progress=false",
            "trainer.eval_every=3", f"trainer.steps={STEPS}", "trainer.save_every=2", "trainer.keep_checkpoints=2"]


def train(args: list[str], fault: str | None = None,
          own_cluster: bool = False) -> tuple[subprocess.CompletedProcess, Path | None]:
    """Run ``hybridlab train ARGS`` in its own process group, attached to the cluster RAY_ADDRESS
    names or with ``own_cluster`` in a Ray cluster of its own; returns the finished process and
    the Ray temp dir of its own cluster (None when attached)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="hlray-r", dir="/tmp")) if own_cluster else None
    env = {**os.environ, "HYBRIDLAB_FAULT": fault or ""}
    if own_cluster:
        env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "hybridlab.cli", "train", *args,
                           *(["--ray-temp-dir", str(ray_tmp)] if own_cluster else [])],
                          env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    return proc, ray_tmp


IDLE = ("ray::IDLE", "ray::SPILL", "ray::RESTORE", "ray::DELETE")  # Ray's pooled workers, not a driver's


def cluster_processes(temp_dir: str) -> dict[int, str]:
    """{pid: command line} of every process below the raylet of the cluster in ``temp_dir``: its
    agents, pooled workers and actors (``ray::Host_actor...``) and whatever those started."""
    import psutil

    raylets = [p for p in psutil.process_iter(["cmdline"]) if (cmd := p.info["cmdline"])
               and cmd[0].endswith("raylet") and temp_dir in " ".join(cmd)]
    assert raylets, f"no raylet of the cluster in {temp_dir}"
    out = {}
    for child in (c for raylet in raylets for c in raylet.children(recursive=True)):
        try:
            cmd = " ".join(child.cmdline()).strip()
        except psutil.Error:  # it ended meanwhile (a zombie too)
            continue
        if cmd:  # empty for a moment (seen once in the suite; likely a Ray worker rewriting its title): next poll
            out[child.pid] = cmd
    return out


def processes_left(temp_dir: str, before: dict[int, str], wait_s: float = 60.0) -> list[str]:
    """Command lines of the processes below the cluster's raylet that were not there ``before``
    (or then had another title: a pooled worker became an actor) and are still there after up to
    ``wait_s`` seconds, apart from Ray's pooled workers: Ray ends a finished or killed driver's
    actors shortly after the driver goes."""
    import time

    def new() -> list[str]:
        now = cluster_processes(temp_dir)
        return sorted(cmd for pid, cmd in now.items() if before.get(pid) != cmd and not cmd.startswith(IDLE))

    deadline = time.time() + wait_s
    while (left := new()) and time.time() < deadline:
        time.sleep(0.5)
    return left


@ray.remote(num_cpus=0)
class Probe:
    def pid(self) -> int:
        return os.getpid()


def leftovers(ray_tmps: list[Path]) -> list[str]:
    """Command lines of live processes that belong to one of these Ray clusters."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if any(str(t) in cmd or str(t) in environ for t in ray_tmps):
            found.append(f"{pid}: {cmd[:160]}")
    return found


def shm_in_use() -> set[str]:
    """The files in /dev/shm that a live process holds open or mapped."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            held.update(line.split(maxsplit=5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                        if " /dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (OSError, IndexError):
            continue
    return {path for path in held if path.startswith("/dev/shm/")}


def leaked_shm(before: set[str]) -> list[str]:
    """Files that appeared in /dev/shm since ``before`` and that no live process holds: left
    behind by killed processes (what other tests' live engines make meanwhile is held). A file
    gone by the end of the scan was not left behind: Python's semaphores (``sem.mp-*``) live in
    /dev/shm only between their creation and their unlink a moment later, in any process."""
    new = {os.path.join("/dev/shm", name) for name in os.listdir("/dev/shm")} - before
    return sorted(path for path in new - shm_in_use() if os.path.exists(path))


def repeatable(line: dict) -> dict:
    """A metrics line without what measures time."""
    return {k: v for k, v in line.items()
            if k != "time" and not k.startswith(("timing/", "perf/")) and not k.endswith(("seconds", "_s"))}


def metrics(run_dir: Path) -> list[dict]:
    return [repeatable(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_killed_three_times_resumed_and_a_worker_killed_the_run_repeats_the_uninterrupted_one(
        trained_dir, ray_address, shared_cluster, tmp_path):
    """The driver SIGKILLed mid-update, mid-checkpoint-write and mid-rollout, resumed each time;
    in the last resumed run a worker process is killed mid-step, re-created, and the run rolls
    back to its checkpoint. Every step's metrics equal the uninterrupted run's."""
    shm_before = {os.path.join("/dev/shm", name) for name in os.listdir("/dev/shm")}
    shared = shared_cluster.temp_dirs[-1]
    before = cluster_processes(shared)
    probe = Probe.remote()  # the check below sees a driver's actor: this one's, until it is killed
    ray.get(probe.pid.remote())
    assert processes_left(shared, before, wait_s=0) == ["ray::Probe"]
    ray.kill(probe)
    base = [f"model={trained_dir}", *SETTINGS]
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref, _ = train([*base, f"trainer.run_dir={reference_dir}"])
    assert ref.returncode == 0, ref.stderr[-3000:]

    killed, own = train([*base, f"trainer.run_dir={run_dir}"], fault="update_actor@3", own_cluster=True)
    assert killed.returncode == -signal.SIGKILL and "fault injected: update_actor at step 3" in killed.stderr
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000000", "step-000002"]  # 0: at the start

    killed, _ = train(["--resume", str(run_dir)], fault="checkpoint_write@4")  # attached from here on
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "resuming" in killed.stdout and "step-000002" in killed.stdout
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000000", "step-000002"]  # the half-written one
    # does not count
    assert list((run_dir / "checkpoints").glob(".step-000004.*"))  # ... and is still there, unfinished

    killed, _ = train(["--resume", str(run_dir)], fault="generate@5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000002", "step-000004"]
    assert not list((run_dir / "checkpoints").glob(".step-*"))  # the unfinished write was cleared

    # one process holds every role here: the kill takes the actor too, so the run goes back to
    # its checkpoint of step 4 and runs steps 5 and 6 again (step 5 was logged before the kill)
    done, _ = train(["--resume", str(run_dir)], fault="kill:rollout:reward@6")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fault injected: kill rollout" in done.stderr
    assert re.search(r"worker \w+ rank 0 died in \w+; re-creating [\w, ]+ \(restart 1 of at most 3\)", done.stderr), \
        done.stderr[-3000:]
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000004", "step-000006"]  # keep_checkpoints=2

    ours = metrics(run_dir)
    restarts = [m.pop("faults/worker_restarts") for m in ours if "faults/worker_restarts" in m]  # step lines
    assert restarts == [0, 0, 0, 0, 1, 1]  # counted from the restart on
    # every step once, every other non-timing key equal
    assert ours == [{k: v for k, v in m.items() if k != "faults/worker_restarts"} for m in metrics(reference_dir)]
    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference_dir))
    assert (summary["steps"], summary["accuracy_before"], summary["accuracy_after"]) == \
        (reference["steps"], reference["accuracy_before"], reference["accuracy_after"]) and summary["steps"] == STEPS
    assert summary["worker_restarts"] == 1 and summary["failed"] is False
    telemetry = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    events = [(r["kind"], r["step"]) for r in telemetry if r["kind"] in ("metrics", "restart")]
    # a resume cuts the file back to its checkpoint (no step twice across the kills); the
    # telemetry of a running session is appended to, so the step the restart rolled back and ran
    # again is in it twice, either side of the restart record
    assert events == [*(("metrics", s) for s in range(1, 6)), ("restart", 4), ("metrics", 5), ("metrics", 6)]
    # the second resume's own marker was cut with the steps it logged after checkpoint 2
    assert [r["step"] for r in telemetry if r["kind"] == "resume"] == [2, 4]
    (restart,) = [r for r in telemetry if r["kind"] == "restart"]
    assert (restart["rolled_back_to"], restart["failure"]) == (4, "died")
    assert {"actor", "reward", "rollout"} <= set(restart["recreated"])  # every role: one process

    assert leftovers([own]) == []  # the first killed driver's own cluster went with it
    assert processes_left(shared, before) == []  # the attached drivers' workers with them
    assert leaked_shm(shm_before) == []


def test_resume_refuses_a_folder_without_a_checkpoint(tmp_path, capsys):
    from hybridlab.cli import main

    (tmp_path / "run").mkdir()
    assert main(["train", "--resume", str(tmp_path / "run")]) == 2
    assert "has no complete checkpoint to resume from" in capsys.readouterr().err
    assert main(["train", "grpo", "--resume", str(tmp_path / "run")]) == 2
    assert "--resume continues the run with its own config.yaml" in capsys.readouterr().err


def test_fault_points_are_checked():
    from hybridlab import faults

    os.environ[faults.ENV] = "update_actor@3,nowhere@1"
    try:
        with pytest.raises(ValueError, match="'nowhere@1' is not POINT@STEP with POINT one of generate"):
            faults.armed()
    finally:
        del os.environ[faults.ENV]


def test_sigterm_stops_at_a_step_boundary_saves_and_says_how_to_resume_and_a_second_signal_stops_at_once(
        trained_dir, tmp_path):
    import time

    run_dir = tmp_path / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="hlray-s", dir="/tmp"))
    args = [sys.executable, "-m", "hybridlab.cli", "train", f"model={trained_dir}", *SETTINGS[:-3],
            "trainer.steps=200", "trainer.save_every=0", f"trainer.run_dir={run_dir}", "--ray-temp-dir", str(ray_tmp)]

    def steps_logged() -> int:
        path = run_dir / "metrics.jsonl"
        return sum(1 for line in path.read_text().splitlines() if "reward/mean" in line) if path.is_file() else 0

    err_file = tmp_path / "stderr.txt"

    def start_and_wait_for(steps: int, stderr=subprocess.PIPE) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True, env={**env, "HYBRIDLAB_FAULT": ""})
        deadline = time.time() + 300
        while steps_logged() < steps and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        return proc

    proc = start_and_wait_for(2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGTERM: stopping after this step and saving a checkpoint" in err
    assert f"resume with: hybridlab train --resume {run_dir}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "stop requested" and summary["steps"] == steps_logged() < 200
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step-000000", f"step-{summary['steps']:06d}"]  # saved
    # at the start and at the stop

    args[args.index(f"trainer.run_dir={run_dir}")] = f"trainer.run_dir={tmp_path / 'second'}"
    args[args.index("trainer.save_every=0")] = "trainer.save_every=1"  # a checkpoint after every step
    run_dir = tmp_path / "second"
    stderr = err_file.open("w")
    proc = start_and_wait_for(2, stderr=stderr)
    proc.send_signal(signal.SIGINT)
    # two deliveries, not one merged signal: the second goes once the first was handled (on a
    # loaded machine a fixed pause can end before the driver ran its handler)
    err = ""
    deadline = time.time() + 120
    while "SIGINT: stopping after this step" not in err and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        err = err_file.read_text()
    proc.send_signal(signal.SIGINT)  # the second one: at once
    proc.communicate(timeout=300)
    stderr.close()
    err = err_file.read_text()
    assert proc.returncode == 130, err[-3000:]
    kept = checkpoint_dirs(run_dir)
    assert kept and all((p / "session.json").is_file() and (p / "actor" / "model.safetensors").is_file()
                        for p in kept)  # the latest complete checkpoint is intact; nothing half-written counts
    assert leftovers([ray_tmp]) == []
