"""End-to-end GRPO steps: hybridlab (vLLM rollout + Megatron training through Ray) against
Hugging Face TRL's GRPOTrainer on the CPU, same model, task, batch, group and lengths.

Both generate exactly ``max_new_tokens`` per completion (end-of-sequence ignored; TRL through
``min_new_tokens``), score them with the arith rule, and take one optimizer step per RL step
without a reference model (TRL's default beta=0). Both run with the same number of threads,
one after the other in this process (TRL) and in Ray workers (ours). Ours runs four times,
with the telemetry hub on (the reported figures), off, off and on again: alternating cancels
the drift between sessions, which one on/off pair mistook for a telemetry cost of -3% to +11%.

Levers (issue 18): ``precision=bf16`` runs both our engines in bf16 and TRL both ways (its
faster is the peer); ``placement=split`` puts the rollout and the actor on a device and a
thread each, the rollout one step ahead (off-policy) so generation overlaps the update.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch


# split: the rollout on one device, the actor (with the reward: beside the rollout it would wait
# behind the next step's generation) on the other, one thread each, generation of step k+1
# overlapping the update of step k (trainer.off_policy)
SPLIT = ["mapping={pools: {train: {devices: 1}, gen: {devices: 1}}, roles: {actor: {pool: train, colocate: t},"
         " reward: {pool: train, colocate: t}, rollout: {pool: gen}}}", "trainer.off_policy=true"]
PLACEMENTS = ("colocated", "split")


def _config(model: str, prompts_per_step: int, group: int, max_new_tokens: int, steps: int, run_dir: str,
            telemetry: bool = True, precision: str = "fp32", placement: str = "colocated") -> list[str]:
    # bf16 or split: the rollout's log-probs (of another precision, or one update stale) still
    # stand in for the old policy's, as verl's bypass mode (PPO clip against them; the gap is
    # logged as rollout_corr/*)
    levers = ["rollout.dtype=bfloat16", "actor.precision=bf16"] if precision == "bf16" else []
    levers += SPLIT if placement == "split" else []
    if levers:
        levers.append("algorithm.rollout_correction.bypass_mode=true")
    return [f"model={model}", "warm_start.max_steps=0", f"data.prompts_per_step={prompts_per_step}",
            f"rollout.n={group}", f"rollout.max_new_tokens={max_new_tokens}", "rollout.ignore_eos=true",
            "rollout.kv_cache_mb=256", f"actor.ppo_mini_batch_size={prompts_per_step}", "actor.use_kl_loss=false",
            "actor.micro_batch_size=64", "actor.lr=1e-5", f"trainer.steps={steps}", "trainer.progress=false",
            f"trainer.telemetry={str(telemetry).lower()}", f"trainer.run_dir={run_dir}", "data.test_samples=8",
            "dataflow=[generate, reward, rollout_as_old_logprob, advantages, update_actor, sync_weights]", *levers]


def ours(model_dir: str, prompts_per_step: int, group: int, max_new_tokens: int, steps: int, warmup: int,
         telemetry: bool = True, precision: str = "fp32", placement: str = "colocated") -> dict:
    """Return per-step seconds and completion tokens of hybridlab's GRPO steps."""
    from hybridlab.dataflow.session import RLSession

    with tempfile.TemporaryDirectory() as tmp:
        rl = RLSession(None, _config(model_dir, prompts_per_step, group, max_new_tokens, steps, f"{tmp}/run",
                                     telemetry, precision, placement))
        try:
            rl.start()
            seconds, tokens, busy, stale = [], [], [], []
            for i in range(warmup + steps):
                start = time.perf_counter()
                result = rl.step()
                if i >= warmup:
                    seconds.append(time.perf_counter() - start)
                    tokens.append(int(result.batch["response_mask"].sum()))
                    busy.append(result.metrics.get("perf/device_busy", float("nan")))
                    stale.append(result.metrics.get("rollout/staleness", 0))
            stage_s = {k.split("/")[1][:-2]: round(v, 3) for k, v in result.metrics.items() if k.startswith("timing/")}
        finally:
            rl.shutdown()
    return {"seconds": seconds, "tokens": tokens, "last_step_stages_s": stage_s, "device_busy": busy,
            "staleness": max(stale, default=0)}


def trl(model_dir: str, prompts_per_step: int, group: int, max_new_tokens: int, steps: int, warmup: int,
        threads: int, bf16: bool = False) -> dict:
    """Return per-step seconds and completion tokens of TRL's GRPOTrainer on the same work."""
    import warnings

    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybridlab.tasks import get_task

    torch.set_num_threads(threads)
    task = get_task("arith")
    samples = task.split("train", prompts_per_step * (steps + warmup) * 2, seed=0)
    data = Dataset.from_dict({"prompt": [s.prompt for s in samples], "ground_truth": [s.ground_truth for s in samples]})

    def reward(completions, ground_truth, **_):
        return [task.score(c, g) for c, g in zip(completions, ground_truth)]

    class Clock(TrainerCallback):
        """Wall-clock marks at the start and end of every trainer step."""

        def __init__(self):
            self.marks: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(time.perf_counter())

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=prompts_per_step * group, num_generations=group,
                          max_completion_length=max_new_tokens, generation_kwargs={"min_new_tokens": max_new_tokens},
                          temperature=1.0, learning_rate=1e-5, max_steps=steps + warmup, use_cpu=True, bf16=bf16,
                          report_to="none", save_strategy="no", logging_steps=10**6, beta=0.0,
                          dataloader_num_workers=0, disable_tqdm=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[clock])
        trainer.train()
    pairs = list(zip(clock.marks[::2], clock.marks[1::2]))[warmup:]
    per_step = prompts_per_step * group * max_new_tokens
    return {"seconds": [end - start for start, end in pairs], "tokens": [per_step] * len(pairs)}


# Telemetry on, off, off, on: each setting sees early and late sessions alike.
TELEMETRY_ORDER = (True, False, False, True)


def _pooled(results: list[dict]) -> dict:
    return {"seconds": [s for r in results for s in r["seconds"]], "tokens": [t for r in results for t in r["tokens"]]}


def _summary(result: dict) -> dict:
    median = statistics.median(result["seconds"])
    return {"median_step_s": round(median, 3),
            "completion_tokens_per_s": round(statistics.median(result["tokens"]) / median, 1)}


def run(model: str = "small", prompts_per_step: int = 8, group: int = 8, max_new_tokens: int = 64, steps: int = 10,
        warmup: int = 1, peer: str = "trl", precision: str = "fp32", placement: str = "colocated") -> dict:
    """Return hybridlab's and TRL's median step time and completion tokens/s, and their ratio.
    ``precision`` bf16 runs both engines of ours in bf16 and TRL with ``bf16=True``; TRL's fp32
    figure is measured too and the faster of its two is the peer. ``placement`` split puts the
    rollout and the actor on a device (and a thread) each, overlapping them one step off-policy."""
    from hybridlab.controller.resources import connect
    from hybridlab.models.zoo import count_parameters, resolve_model

    threads = max(1, min(2, os.cpu_count() or 1))
    model_dir = str(resolve_model(model))
    params = count_parameters(model_dir)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    if peer not in ("trl", "none"):
        raise ValueError(f"peer must be trl or none, got {peer!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    from hybridlab.environment import processor

    out = {"model": model, "params": params, "prompts_per_step": prompts_per_step, "group": group,
           "max_new_tokens": max_new_tokens, "steps": steps, "threads": threads, "precision": precision,
           "processor": processor(), "workload": "fixed_length", "placement": placement}
    import ray

    attached = ray.is_initialized()  # a caller's cluster stays up; one we start is stopped
    connect(num_gpus=2 if placement == "split" else 1)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for telemetry in TELEMETRY_ORDER:
        runs[telemetry].append(ours(model_dir, prompts_per_step, group, max_new_tokens, steps, warmup, telemetry,
                                    precision, placement))
    out.update(_summary(_pooled(runs[True])), stages_s=runs[True][0]["last_step_stages_s"],
               device_busy=round(statistics.median(b for r in runs[True] for b in r["device_busy"]), 3),
               rollout_staleness=max(r["staleness"] for r in runs[True]))
    quiet = _summary(_pooled(runs[False]))
    out.update(median_step_s_telemetry_off=quiet["median_step_s"],
               telemetry_overhead_pct=round(100 * (out["median_step_s"] / quiet["median_step_s"] - 1), 1),
               telemetry_sessions=len(runs[True]))
    if not attached:
        ray.shutdown()  # free the cores for the peer
    if peer == "trl":
        settings = (False, True) if precision == "bf16" else (False,)
        peers = {bf16: _summary(trl(model_dir, prompts_per_step, group, max_new_tokens, steps, warmup, threads, bf16))
                 for bf16 in settings}
        best = max(peers, key=lambda k: peers[k]["completion_tokens_per_s"])
        theirs = peers[best]
        out.update(trl_median_step_s=theirs["median_step_s"],
                   trl_completion_tokens_per_s=theirs["completion_tokens_per_s"], trl_bf16=best,
                   trl_tokens_per_s_by_precision={("bf16" if k else "fp32"): v["completion_tokens_per_s"]
                                                  for k, v in peers.items()},
                   speedup_vs_trl=round(out["completion_tokens_per_s"] / theirs["completion_tokens_per_s"], 2))
    return out

