"""`hybridlab train` submitted as a Ray job, the way verl's multi-node guide runs main_ppo: a head
started with `ray start --head` on loopback, `ray job submit -- hybridlab train <verl's keys>`
against its job API, and the run's dashboard served from the head.

Every port the head opens is chosen free: another Ray cluster on this machine (the suite's own,
one per pytest worker) already holds the defaults, the dashboard agent's 52365 among them, and a
head whose agent cannot bind answers every job request with "No available agent"."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

# verl's main_ppo keys (docs/verl.md), and one of hybridlab's own after them
SETTINGS = ["algorithm.adv_estimator=grpo", "data.train_batch_size=8", "data.max_response_length=6",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=1", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.logger=['console']", "trainer.progress=false"]
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct free loopback ports."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture
def ray_head():
    """A Ray head started with `ray start --head --block` on loopback (2 CPUs, 2 logical GPUs);
    yields the job API's address; stopped with SIGTERM, as `ray stop` stops it."""
    gcs, dashboard, agent, agent_grpc, runtime_env, metrics = free_ports(6)
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths live under it
    # Ray turns token authentication on for a head when a token exists (~/.ray/auth_token, which a
    # local ray.init writes); it is set here explicitly, with a token of this test's own
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    log = open(os.path.join(temp_dir, "head.log"), "w")  # read on failure
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--port", str(gcs), "--node-ip-address", "127.0.0.1",
                             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
                             "--dashboard-agent-listen-port", str(agent),
                             "--dashboard-agent-grpc-port", str(agent_grpc),
                             "--runtime-env-agent-port", str(runtime_env), "--metrics-export-port", str(metrics),
                             "--num-cpus", "2", "--num-gpus", "2", "--temp-dir", temp_dir,
                             "--labels", json.dumps({"hybridlab/node": "head"})],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 180
        while True:  # the job API answers once the dashboard and its agent are up
            if head.poll() is not None:
                pytest.fail(f"ray start --head exited {head.returncode}: {open(log.name).read()[-3000:]}")
            try:
                request = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
                with urllib.request.urlopen(request, timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the head's job API did not answer within 180 s")
            time.sleep(1)
        yield address, f"127.0.0.1:{gcs}", env
    finally:
        head.send_signal(signal.SIGTERM)  # the head stops the processes it started, as on `ray stop`
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:  # its own session: nothing of the suite's clusters is in it
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_hybridlab_train_runs_as_a_ray_job_and_its_dashboard_is_served_from_the_head(ray_head, trained_dir,
                                                                                        tmp_path):
    from hybridlab.tasks import get_task
    from hybridlab.tasks.dataset import save_dataset

    address, gcs, env = ray_head  # env: the job API's token (ray job submit reads RAY_AUTH_MODE, RAY_AUTH_TOKEN)
    run_dir = tmp_path / "job-run"
    arith = get_task("arith")
    train = save_dataset(arith.split("train", 16), tmp_path / "train.parquet")
    test = save_dataset(arith.split("test", 8), tmp_path / "test.parquet")
    job = subprocess.run([RAY, "job", "submit", "--address", address, "--", sys.executable, "-m", "hybridlab.cli",
                          "train", f"actor_rollout_ref.model.path={trained_dir}", f"data.train_files={train}",
                          f"data.val_files={test}", *SETTINGS, f"trainer.default_local_dir={run_dir}"],
                         env=env, capture_output=True, text=True, timeout=600)
    log = job.stdout + job.stderr
    assert job.returncode == 0 and "succeeded" in log, log[-4000:]
    assert f"Connecting to existing Ray cluster at address: {gcs}" in log  # the job's driver attached to the head
    assert "Read as verl's main_ppo settings" in log
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
    assert json.loads((run_dir / "summary.json").read_text())["failed"] is False

    # the run's dashboard served from the head: `hybridlab dashboard` submitted as a second job, fetched there
    port, served = free_ports(1)[0], f"hybridlab-dashboard-{secrets.token_hex(4)}"
    submit = subprocess.run([RAY, "job", "submit", "--address", address, "--submission-id", served, "--no-wait", "--",
                             sys.executable, "-m", "hybridlab.cli", "dashboard", str(run_dir), "--port", str(port),
                             "--address", "127.0.0.1"], env=env, capture_output=True, text=True, timeout=120)
    assert submit.returncode == 0, submit.stdout + submit.stderr

    def job_logs() -> str:
        logs = subprocess.run([RAY, "job", "logs", "--address", address, served], env=env, capture_output=True,
                              text=True, timeout=60)
        return (logs.stdout + logs.stderr)[-3000:]

    try:
        deadline = time.monotonic() + 180
        while True:  # the job starts `hybridlab dashboard` on the head, which listens once Panel is up
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the dashboard job never answered on port {port}: {job_logs()}")
                time.sleep(1)
        # the page of this run: the name its telemetry's run record carries, in the template's title
        name = json.loads((run_dir / "telemetry.jsonl").read_text().splitlines()[0])["name"]
        with page:
            assert page.status == 200 and f"<title>hybridlab · {name}</title>" in page.read().decode()
        status = subprocess.run([RAY, "job", "status", "--address", address, served], env=env, capture_output=True,
                                text=True, timeout=60)
        assert "RUNNING" in status.stdout + status.stderr  # the page came from the job, still serving
    finally:
        subprocess.run([RAY, "job", "stop", "--address", address, served], env=env, capture_output=True, timeout=60)
