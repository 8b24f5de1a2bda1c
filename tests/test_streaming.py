"""Streaming rollouts (trainer.streaming): the engine stepped by a thread of its own, samples
that span a weight sync, the staleness bound, and the controller's buffer (dataflow/stream.py).

The first test drives one in-process vLLM engine (fp32, no top-p/top-k) through a sync in the
middle of its samples; the others run a streaming session on split placement (actor on one
device, rollout and reward on the other)."""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

from hybridlab.dataflow.session import RLSession
from hybridlab.dataflow.stages import register_stage
from tests.test_fsdp import ODD_LENGTH, length_reward

SPLIT = ("mapping={pools: {a: {devices: 1}, r: {devices: 1}}, roles: {actor: {pool: a},"
         " rollout: {pool: r, colocate: gen}, reward: {pool: r, colocate: gen}}}")
MOVED = {"pools": {"a": {"devices": 1}, "r": {"devices": 1}},  # the reward beside the actor, the rollout alone
         "roles": {"actor": {"pool": "a", "colocate": "t"}, "reward": {"pool": "a", "colocate": "t"},
                   "rollout": {"pool": "r"}}}
PER_STEP, N, BOUND = 4, 2, 2


def _span_a_sync(llm, mode: str, old: dict, new: dict) -> list[dict]:
    """Generate 2 prompts x 2 samples of 24 tokens on a stream, load ``new`` after 8 engine
    steps, and return the finished groups (the engine holds ``old`` again afterwards)."""
    from hybridlab.workers.rollout.sampling import SamplingConfig
    from hybridlab.workers.rollout.stream import EngineStream
    from hybridlab.workers.rollout.vllm_engine import reload_weights, sampling_params

    stream = EngineStream(llm, mode)
    cfg = SamplingConfig(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=0)
    stream.submit([(i, [5 + i, 6, 7, 8], sampling_params(cfg, [], seed=None)) for i in range(2)])
    while stream.stats.engine_steps < 8:  # the first 8 tokens of each sample under the old weights, at least
        time.sleep(0.001)
    stream.pause()
    reload_weights(llm, sorted(new.items()), True)
    stream.resume(1)
    groups: list[dict] = []
    while len(groups) < 2:
        groups += stream.take()[0]
        time.sleep(0.01)
    stream.close()
    reload_weights(llm, sorted(old.items()), True)
    return groups


def test_a_sample_spanning_a_sync_records_two_versions_with_each_versions_log_probs(tiny_dir):
    """recompute: the tokens after the sync are sampled with the KV cache computed again under
    the new weights, so every token's log-prob is transformers' under the version that sampled
    it (1e-5). keep: the tokens after it come from the old weights' KV cache, so they differ."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybridlab.workers.rollout.vllm_engine import start_llm

    llm = start_llm(str(tiny_dir), 512, 64, "float32", 0)
    old = load_file(glob.glob(os.path.join(tiny_dir, "*.safetensors"))[0])
    new = {k: v * 1.05 if v.is_floating_point() else v for k, v in old.items()}
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    def log_probs(weights: dict, prompt: list[int], ids: list[int]) -> torch.Tensor:
        hf.load_state_dict(weights, strict=False)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids])).logits.double()[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)

    for mode in ("recompute", "keep"):
        gaps = {0: 0.0, 1: 0.0}
        for group in _span_a_sync(llm, mode, old, new):
            for sample in group["samples"]:
                versions = torch.tensor(sample["versions"])
                assert len(sample["ids"]) == 24 and 0 < int((versions == 0).sum()) < 24  # it spans the sync
                assert versions.tolist() == sorted(versions.tolist())  # old tokens first, then new
                got = torch.tensor(sample["logprobs"], dtype=torch.float64)
                for version, weights in ((0, old), (1, new)):
                    ref = log_probs(weights, group["prompt_ids"], sample["ids"])
                    gaps[version] = max(gaps[version], float((ref - got)[versions == version].abs().max()))
        assert gaps[0] < 1e-5, (mode, gaps)
        if mode == "recompute":
            assert gaps[1] < 1e-5, gaps
        else:  # the KV cache of the first tokens is the old weights': the new tokens' log-probs are not a fresh pass's
            assert gaps[1] > 1e-3, gaps


def test_preemptions_under_kv_cache_pressure_are_counted_and_the_samples_finish_whole(tiny_dir):
    """A 1 MB KV cache holds three 128-token blocks of the tiny model: eight samples of 144
    tokens each need two, so vLLM preempts some and computes them again; the stream counts it."""
    from hybridlab.workers.rollout.sampling import SamplingConfig
    from hybridlab.workers.rollout.stream import EngineStream
    from hybridlab.workers.rollout.vllm_engine import sampling_params, start_llm

    stream = EngineStream(start_llm(str(tiny_dir), 256, 1, "float32", 0), "keep")
    cfg = SamplingConfig(n=2, temperature=1.0, max_tokens=140, ignore_eos=True, seed=0)
    stream.submit([(i, [5 + i, 6, 7, 8], sampling_params(cfg, [], seed=None)) for i in range(4)])
    groups, preempted = [], 0
    while len(groups) < 4:
        done, stats, _ = stream.take(0.1)
        groups, preempted = groups + done, preempted + stats.preempted
    stream.close()
    assert preempted > 0
    assert [len(s["ids"]) for g in groups for s in g["samples"]] == [140] * 8
    assert all(set(s["versions"]) == {0} for g in groups for s in g["samples"])


@pytest.fixture(scope="module")
def stream_rl(ray_local, tiny_dir, tmp_path_factory):
    """A streaming GRPO session, split placement, token-level rollout correction. The untrained
    model scores 0 on every prompt, so a reward by the answer's length, which differs within a
    group, moves the weights: stale tokens' importance weights then differ from 1."""
    reward = length_reward(tmp_path_factory.mktemp("reward"), ODD_LENGTH)
    session = RLSession(None, [f"model={tiny_dir}", "warm_start.max_steps=0", f"data.prompts_per_step={PER_STEP}",
                               *reward, "actor.lr=1e-3",
                               "actor.warmup_steps=0",
                               f"rollout.n={N}", "rollout.max_new_tokens=24", "rollout.ignore_eos=true",
                               f"actor.ppo_mini_batch_size={PER_STEP}", "data.test_samples=4", "trainer.devices=2",
                               SPLIT, "trainer.streaming=true", f"trainer.max_staleness={BOUND}",
                               "algorithm.rollout_correction.rollout_is=token", "trainer.progress=false",
                               f"trainer.run_dir={tmp_path_factory.mktemp('stream') / 'run'}"])
    session.start()
    yield session
    session.shutdown()


@register_stage("slow_trainer", None, ("responses",), ())
def slow_trainer(ctx, batch):
    """A trainer that falls behind: half a second more per step."""
    time.sleep(0.5)
    return None, {}


def test_streaming_steps_train_each_prompt_once_within_the_bound_and_correct_per_token(stream_rl):
    rl, trained, moved = stream_rl, [], 0.0
    flow = rl.dataflow.names
    rl.dataflow = [*flow[:-1], "slow_trainer", flow[-1]]  # the engine gets ahead; admission must stop
    try:
        for _ in range(5):
            version = rl.state.actor_version
            result = rl.step()
            b, m = result.batch, result.metrics
            assert len(b) == PER_STEP * N and len(set(b["uid"])) == PER_STEP
            trained += sorted(set(b["uid"]))
            mask = b["response_mask"].bool()
            versions = b["rollout_versions"][mask]
            assert int(versions.max()) <= version and version - int(versions.min()) <= BOUND
            assert m["rollout/staleness"] == version - int(versions.min())
            assert sum(v for k, v in m.items() if k.startswith("rollout/stale_tokens/")) == int(mask.sum())
            # the sync did not wait for the engines: its look, pause, last load and resume are read
            # by the next step (the trainer goes on meanwhile), and are not listed as running
            assert [f.method for f in rl.state.stream.deferred] == ["stream_exchange", "stream_pause",
                                                                  "load_weight_slices", "stream_resume"]
            assert [c["method"] for c in rl.workers.watch.running()] == []
            # the bound: with k steps done, at most k + bound + 1 batches' prompts were admitted
            assert rl.state.stream.admitted <= (rl.state.step_count + BOUND + 1) * PER_STEP
            # token-level correction on the per-token behaviour log-probs (threshold 2)
            expect = torch.exp(b["old_log_probs"] - b["rollout_log_probs"]).clamp(max=2.0)
            assert torch.allclose(b["rollout_is_weights"][mask], expect[mask], atol=1e-6)
            stale = mask & (b["rollout_versions"] < version)
            deviation = (b["rollout_is_weights"][stale] - 1).abs()
            moved = max(moved, float(deviation.max()) if len(deviation) else 0.0)
    finally:
        rl.dataflow = flow
    assert moved > 1e-3  # the weights compared above are not all 1: stale tokens were corrected
    assert len(trained) == len(set(trained)) == 5 * PER_STEP
    from hybridlab.explain import explain

    text = explain(rl.cfg, rl.model_dir).text()
    assert f"a step trains the first {PER_STEP} groups to finish ({PER_STEP * N} samples)" in text
    assert f"(trainer.max_staleness={BOUND})" in text and "(trainer.partial_rollouts=keep)" in text
    assert m["rollout/occupancy"] > 0 and m["rollout/in_flight_groups"] + m["rollout/buffer_groups"] > 0


def test_a_remap_during_streaming_draws_the_prompts_in_flight_again_and_says_so(stream_rl):
    """The engines' streams close with the old workers; the prompts not trained yet go back into
    the prompt stream and the report counts them; none is lost or trained twice."""
    rl = stream_rl
    trained = [uid for _ in range(2) for uid in set(rl.step().batch["uid"])]
    in_flight = set(rl.state.stream.rows)
    report = rl.remap(MOVED)
    assert report.prompts_drawn_again == len(in_flight) > 0 and set(report.roles_recreated) >= {"rollout"}
    assert f"{len(in_flight)} streamed prompts not trained yet drawn again" in str(report)
    after = [uid for _ in range(3) for uid in set(rl.step().batch["uid"])]
    assert not set(after) & set(trained) and in_flight <= set(after) | set(rl.state.stream.rows)


def test_streaming_switches_off_and_on_between_steps_and_trains_each_prompt_once(stream_rl):
    """Off: the streams close and their prompts not trained yet go back into the prompt stream,
    which an on-policy step draws again (the ones trained out of order passed over); on again:
    streaming from where the stream stands."""
    rl = stream_rl
    trained = [uid for _ in range(2) for uid in set(rl.step().batch["uid"])]
    in_flight = set(rl.state.stream.rows)
    streaming_eval = rl.evaluate()  # greedy, through the running stream (its engine is the stream thread's)
    rl.update("trainer.streaming=false")
    assert rl.evaluate() == streaming_eval and streaming_eval["n"] == 4  # the same weights, the same answers
    off = [rl.step() for _ in range(2)]
    assert all("rollout/occupancy" not in r.metrics and r.metrics["rollout/staleness"] == 0 for r in off)
    first = sorted(in_flight)[:2 * PER_STEP]  # drawn again first, generated on-policy
    assert sorted(uid for r in off for uid in set(r.batch["uid"]))[:len(first)] == first
    rl.update("trainer.streaming=true")
    trained += [uid for r in off for uid in set(r.batch["uid"])]
    trained += [uid for _ in range(2) for uid in set(rl.step().batch["uid"])]
    assert len(trained) == len(set(trained)) == 6 * PER_STEP
    assert in_flight and in_flight <= set(trained) | set(rl.state.stream.rows)


def test_a_rewound_stream_skips_the_prompts_trained_out_of_order(tiny_dir):
    """Groups finish out of order: a prompt admitted later may be trained before an earlier one
    still in flight. Going back before the oldest untrained prompt must not train it twice."""
    from transformers import AutoTokenizer

    from hybridlab.dataflow.prompts import PromptSource
    from hybridlab.dataflow.stream import RolloutStream
    from hybridlab.tasks import get_task

    prompts = PromptSource(get_task("arith").split("train", 40, seed=0), AutoTokenizer.from_pretrained(tiny_dir), 4)
    stream = RolloutStream()
    for _ in range(3):
        stream._queue(prompts.next())  # uids 0..11
    stream._consume([5, 6, 9])  # finished first and trained
    assert stream.oldest(prompts) == 0 and stream.consumed_since(0, prompts) == [5, 6, 9]
    stream.totals = {"engine_busy_s": 0.4, "preempted": 1.0}  # what the last looks found, not reported yet
    stream.forget(prompts)
    assert prompts.drawn == 0 and stream.regenerated == 9
    assert stream.totals == {}  # thrown away with the prompts: a stream started later reports its own
    for _ in range(3):
        stream._queue(prompts.next())
    assert sorted(stream.rows) == [0, 1, 2, 3, 4, 7, 8, 10, 11, 12, 13, 14] and not prompts.skip
    assert prompts.drawn == 15  # three draws of 4 passed over the 3 trained prompts

    fresh = PromptSource(prompts.samples, prompts.tokenizer, 4)
    first = fresh.state()
    prompts.skip, prompts.pin = {1, 2}, 3  # what a stream in flight leaves behind
    prompts.restart(first)  # bench async: every mode of one session draws the same prompts
    for _ in range(3):
        again, want = prompts.next(), fresh.next()
        assert again["uid"] == want["uid"] and again["prompt_ids"] == want["prompt_ids"]
    assert sorted(prompts.marks) == [0, 4, 8] and prompts.pin is None and not prompts.skip


def test_a_streaming_run_killed_mid_update_resumes_and_trains_every_prompt_once_within_the_bound(
        ray_address, tiny_dir, tmp_path):
    """`hybridlab train` streaming, SIGKILLed in step 5's update with groups in flight, resumed
    from its checkpoint of step 4 (which saved the prompt stream's position before the prompts
    in flight and the ones trained after it, to skip): the steps' generation files (``trainer.rollout_data_dir``,
    each step's file written again when the step runs again) show every prompt before the final
    checkpoint's position trained exactly once, those after it trained being its skip list, and
    every trained token within the bound. Not bit-exact: which requests share a batch changes."""
    import json
    import signal
    import subprocess
    import sys

    from hybridlab.dataflow.checkpoints import checkpoint_dirs

    run_dir, steps = tmp_path / "run", 6
    args = [f"model={tiny_dir}", "warm_start.max_steps=0", f"data.prompts_per_step={PER_STEP}", f"rollout.n={N}",
            "rollout.max_new_tokens=24", "rollout.ignore_eos=true", f"actor.ppo_mini_batch_size={PER_STEP}",
            "data.test_samples=4", "trainer.eval_every=0", "trainer.devices=2", SPLIT, "trainer.streaming=true",
            f"trainer.max_staleness={BOUND}", "trainer.progress=false", f"trainer.steps={steps}",
            "trainer.save_every=2", "trainer.rollout_data_dir=generations", f"trainer.run_dir={run_dir}"]

    def train(cli: list[str], fault: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hybridlab.cli", "train", *cli], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "HYBRIDLAB_FAULT": fault})

    killed = train(args, fault="update_actor@5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoint = checkpoint_dirs(run_dir)[-1]
    assert checkpoint.name == "step-000004"
    at_kill = json.loads((checkpoint / "session.json").read_text())  # written with groups in flight
    done = train(["--resume", str(run_dir)])
    assert done.returncode == 0, done.stderr[-3000:]

    files = sorted((run_dir / "generations").glob("*.jsonl"), key=lambda p: int(p.stem))
    assert [int(p.stem) for p in files] == list(range(1, steps + 1))  # step 5 written again by the resumed run
    trained: list[int] = []
    for step, path in enumerate(files, start=1):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == PER_STEP * N and {r["step"] for r in rows} == {step}
        assert all(len(r["output"]) > 0 and r["input"] for r in rows)
        # step k trains on weights k - 1: its oldest token at most BOUND updates older, none newer
        assert all(step - 1 - BOUND <= r["versions"][0] <= r["versions"][1] <= step - 1 for r in rows)
        trained += sorted({r["uid"] for r in rows})
    assert len(trained) == len(set(trained)) == steps * PER_STEP  # none twice across the kill
    # the checkpoint the run resumed from: its position before the prompts in flight then, the ones
    # trained after that position its skip list
    first4 = trained[:4 * PER_STEP]
    assert set(range(at_kill["prompts"]["drawn"])) <= set(first4)
    assert sorted(u for u in first4 if u >= at_kill["prompts"]["drawn"]) == sorted(at_kill["stream_skip"])
    session = json.loads((checkpoint_dirs(run_dir)[-1] / "session.json").read_text())
    drawn, skip = session["prompts"]["drawn"], session["stream_skip"]
    assert session["step"] == steps and set(range(drawn)) <= set(trained)  # none lost before the position
    assert sorted(u for u in trained if u >= drawn) == sorted(skip)  # those after it are passed over when drawn
