"""A user's Tinker RL loop against ``hybridlab serve tinker``: does it learn, and how fast is it
beside hybridlab's own GRPO on the same batch?

The loop is written as the cookbook's ``recipes/rl_loop.py`` is, with the unchanged SDK: each
iteration saves the weights and gets a sampling client, samples ``group`` answers to each of
``prompts`` prompts, centres each group's rewards, trains one ``importance_sampling``
forward_backward on the whole batch and takes one ``optim_step``. The model is the default run's:
the tiny zoo model warm-started on arith to its target (``warm_start``); greedy test accuracy
(``data.test_samples`` prompts, through the server's sampler at temperature 0) is measured before
and after. Beside it, in the same process, hybridlab's GRPO with the same LoRA and batch times
its steps (``grpo_steps`` of them): ``speed_ratio`` is GRPO's seconds per step over the loop's.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import tinker
from tinker import types

from hybridlab.config.schema import RunConfig
from hybridlab.dataflow.session import RLSession
from hybridlab.dataflow.warm_start import warm_start
from hybridlab.environment import describe
from hybridlab.models.chat import prompt_ids
from hybridlab.models.zoo import resolve_model
from hybridlab.tasks import get_task
from hybridlab.tinker.server import TinkerServer
from hybridlab.tinker.settings import ServiceSettings

GOAL_POINTS = 15.0


def _log(message: str) -> None:
    print(f"[bench tinker] {message}", file=sys.stderr, flush=True)


def greedy_accuracy(sampling, tokenizer, task, samples, max_tokens: int) -> float:
    """Return the share of ``samples`` the sampling client answers right at temperature 0."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [sampling.sample(types.ModelInput.from_ints(prompt_ids(tokenizer, s)), 1, params)
               for s in samples]
    right = 0
    for future, sample in zip(futures, samples):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True)
        right += task.check(text, sample.ground_truth)[0]
    return right / len(samples)


def rl_iteration(training, tokenizer, task, rows, group: int, max_tokens: int, adam) -> dict:
    """One iteration of the cookbook's loop; returns its mean reward and seconds."""
    start = time.perf_counter()
    sampling = training.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    prompts = [prompt_ids(tokenizer, s) for s in rows]
    futures = [sampling.sample(types.ModelInput.from_ints(p), group, params) for p in prompts]
    datums, rewards = [], []
    for prompt, future, sample in zip(prompts, futures, rows):
        sequences = future.result().sequences
        scores = [task.score(tokenizer.decode(s.tokens, skip_special_tokens=True), sample.ground_truth)
                  for s in sequences]
        rewards += scores
        mean = sum(scores) / len(scores)
        for seq, score in zip(sequences, scores):
            if score == mean:  # a group without a difference teaches nothing
                continue
            tokens = prompt + seq.tokens
            skip = len(prompt) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": tokens[1:], "logprobs": [0.0] * skip + seq.logprobs,
                "advantages": [0.0] * skip + [score - mean] * len(seq.tokens)}))
    if datums:
        training.forward_backward(datums, "importance_sampling").result()
        training.optim_step(adam).result()
    return {"reward": sum(rewards) / len(rewards), "seconds": time.perf_counter() - start}


def grpo_seconds(model_dir: Path, prompts: int, group: int, rank: int, steps: int, run_dir: Path) -> float:
    """Return the median seconds of hybridlab's GRPO step, same model, LoRA and batch."""
    rl = RLSession("grpo", [f"model={model_dir}", "warm_start.max_steps=0", f"data.prompts_per_step={prompts}",
                            f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={group}", f"actor.lora.rank={rank}",
                            "actor.lora.alpha=32", "actor.lr=1e-3", "actor.strategy=fsdp2",
                            f"trainer.run_dir={run_dir}", "trainer.progress=false"])
    rl.start()
    try:
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            rl.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])  # the first step warms up
    finally:
        rl.shutdown()


def run(iterations: int = 150, prompts: int = 32, group: int = 8, rank: int = 16, lr: float = 1e-3, seed: int = 0,
        grpo_steps: int = 3, test_samples: int = 0, warm_steps: int = -1, out: str | None = None) -> dict:
    """Return the loop's greedy accuracy before and after, gain in points, its minutes, seconds
    per iteration and GRPO's (``speed_ratio``), with the processor."""
    cfg = RunConfig()
    if warm_steps >= 0:
        cfg.warm_start.max_steps = warm_steps
    workdir = Path(out or tempfile.mkdtemp(prefix="bench-tinker-"))
    task = get_task(cfg.data.task)
    _log("warm start (the default run's)")
    model_dir = resolve_model(cfg.model, seed=seed)
    if cfg.warm_start.max_steps:
        model_dir, _ = warm_start(cfg, workdir, model_dir, lambda kind, record: None)
    samples = task.split("test", test_samples or cfg.data.test_samples, seed=seed)
    train_rows = task.split("train", cfg.data.train_samples or 2000, seed=seed)
    settings = ServiceSettings(model=str(model_dir), run_dir=str(workdir / "tinker"), hub_cache=str(workdir / "hub"),
                               max_lora_rank=rank, seed=seed)
    server = TinkerServer(settings).start()
    try:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
        training = service.create_lora_training_client(base_model=server.service.base_model, rank=rank).result()
        tokenizer = training.get_tokenizer()
        max_tokens = cfg.rollout.max_new_tokens
        before = greedy_accuracy(training.save_weights_and_get_sampling_client().result(), tokenizer, task, samples,
                                 max_tokens)
        _log(f"before: {before:.3f}; {iterations} iterations of {prompts} x {group}")
        adam = types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8)
        start, curve = time.perf_counter(), []
        for i in range(iterations):
            rows = [train_rows[(i * prompts + j) % len(train_rows)] for j in range(prompts)]
            curve.append(rl_iteration(training, tokenizer, task, rows, group, max_tokens, adam))
            if i % 10 == 0:
                _log(f"iteration {i}: reward {curve[-1]['reward']:.3f}")
        minutes = (time.perf_counter() - start) / 60
        after = greedy_accuracy(training.save_weights_and_get_sampling_client().result(), tokenizer, task, samples,
                                max_tokens)
        service.close("success")
    finally:
        server.stop()
    loop_s = round(statistics.median(c["seconds"] for c in curve[1:] or curve), 3)
    grpo_s = round(grpo_seconds(model_dir, prompts, group, rank, grpo_steps, workdir / "grpo"), 3) if grpo_steps \
        else None
    gain = round(100 * (after - before), 1)
    return {"processor": describe()["processor"], "accuracy_before": before, "accuracy_after": after, "gain": gain,
            "goal_points": GOAL_POINTS, "goal_met": gain >= GOAL_POINTS, "iterations": iterations,
            "batch": {"prompts": prompts, "group": group}, "rank": rank, "lr": lr, "training_minutes": round(minutes, 2),
            "loop_s_per_iteration": loop_s, "grpo_s_per_step": grpo_s,
            "speed_ratio": None if grpo_s is None else round(grpo_s / loop_s, 3),
            "reward_curve": [round(c["reward"], 3) for c in curve], "test_samples": len(samples)}
