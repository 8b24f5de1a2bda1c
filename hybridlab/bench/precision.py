"""The precision lever, measured side by side: bf16 against fp32 for the rollout (vLLM's bf16
CPU path) and for training (Megatron under autocast: bf16 matmuls, fp32 weights, gradients and
AdamW state), on the same prompts and batch: rollout sessions in the order fp32, bf16, bf16,
fp32, and the two actors in one process stepped in turn, so drift falls on both alike.

Also the price: how far a bf16 rollout's log-probs are from the fp32 actor's on the tokens it
sampled (``rollout_corr/kl`` and friends, what rollout correction is for), and how far a bf16
actor's log-probs are from its fp32 self. Figures depend on the processor (AMX or AVX-512 BF16
or neither): the JSON names it.
"""
from __future__ import annotations

import statistics
import time

import torch

from hybridlab.algos.rollout_correction import mismatch_metrics
from hybridlab.bench import alternating
from hybridlab.bench.train import make_batch
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.environment import processor, usable_cores
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model
from hybridlab.protocol import Batch
from hybridlab.workers.rollout.sampling import SamplingConfig
from hybridlab.workers.rollout.worker import RolloutWorker
from hybridlab.workers.train.engine import MegatronEngine
from hybridlab.workers.train.settings import settings_for
from hybridlab.workers.train.workers import ActorWorker, sft_loss

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}




def _session(roles: dict, threads: int) -> WorkerSet:
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 1, "cpus_per_device": threads}},
                                       "roles": {r: {"pool": "p", "colocate": "e"} for r in roles}})
    return WorkerSet(mapping, roles, env={"OMP_NUM_THREADS": str(threads)})


def rollout_side(model_dir: str, prompts: list[list[int]], max_new_tokens: int, rounds: int,
                 threads: int, session_rounds: int = 2) -> dict:
    """Return tokens/s of fp32 and bf16 rollout engines (one session each per round of
    ``session_rounds``, alternating: fp32, bf16, bf16, fp32 for 2) and the log-prob gap of the
    bf16 engine's samples under the fp32 actor."""
    cfg = SamplingConfig(temperature=1.0, max_tokens=max_new_tokens, ignore_eos=True, seed=0)
    batch = Batch(objects={"prompt_ids": prompts})
    seconds: dict[str, list[float]] = {p: [] for p in DTYPES}
    for precision in alternating("fp32", "bf16", session_rounds):
        roles = {"rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=model_dir, kv_cache_mb=256,
                                                                 dtype=DTYPES[precision])),
                 "actor": RoleClass(ActorWorker, kwargs=dict(
                     model_dir=model_dir, settings=settings_for(lr=1e-5, micro_batch_size=16)))}
        with _session(roles, threads) as session:
            session.groups["rollout"].generate(batch, SamplingConfig(max_tokens=4))  # warm-up
            for _ in range(rounds):
                start = time.perf_counter()
                samples = session.groups["rollout"].generate(batch, cfg)
                seconds[precision].append(time.perf_counter() - start)
            if precision == "bf16":
                actor = session.groups["actor"].compute_log_prob(samples.select(
                    ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]))
                bf16_samples = samples
    tokens = len(prompts) * max_new_tokens
    mask = bf16_samples["response_mask"].float()
    gap = (bf16_samples["rollout_log_probs"] - actor["old_log_probs"])[mask.bool()].abs()
    result = {f"rollout_{p}_tokens_per_s": round(tokens / statistics.median(s), 1) for p, s in seconds.items()}
    result["rollout_bf16_speedup"] = round(result["rollout_bf16_tokens_per_s"] / result["rollout_fp32_tokens_per_s"],
                                           3)
    metrics = mismatch_metrics(actor["old_log_probs"], bf16_samples["rollout_log_probs"], mask)
    result["bf16_rollout_vs_fp32_actor"] = {"mean_abs_logprob_gap": round(float(gap.mean()), 6),
                                            "max_abs_logprob_gap": round(float(gap.max()), 6),
                                            **{k: round(metrics[k], 6) for k in ("kl", "k3_kl", "chi2_token")}}
    return result


class DualActor(Worker):
    """Two actors of one model in one process, fp32 and bf16, stepped in turn."""

    def __init__(self, model_dir: str, micro_batch_size: int):
        self.micro_batch_size = micro_batch_size
        self.engines = {p: MegatronEngine(model_dir, settings_for(lr=1e-5, precision=p)) for p in DTYPES}

    @register(Dispatch.ALL)
    def log_probs(self, batch) -> dict:
        """Return {precision: response log-probs} before any step."""
        return {p: e.forward(batch, self.micro_batch_size)["log_probs"] for p, e in self.engines.items()}

    @register(Dispatch.ALL)
    def timed_steps(self, batch, steps: int) -> dict:
        """Return {precision: [seconds of each supervised step after the first]}, alternating."""
        seconds: dict[str, list[float]] = {p: [] for p in self.engines}
        for i in range(steps + 1):
            for p, engine in self.engines.items():
                start = time.perf_counter()
                engine.train_step(batch, sft_loss, self.micro_batch_size)
                if i:
                    seconds[p].append(time.perf_counter() - start)
        return seconds


def train_side(model_dir: str, batch, steps: int, threads: int, micro_batch_size: int) -> dict:
    """Return tokens/s of fp32 and bf16 actors (one process, stepped in turn) and the gap between
    their log-probs before training."""
    roles = {"actor": RoleClass(DualActor, kwargs=dict(model_dir=model_dir, micro_batch_size=micro_batch_size))}
    with _session(roles, threads) as session:
        logprobs = session.groups["actor"].log_probs(batch)[0]
        seconds = session.groups["actor"].timed_steps(batch, steps)[0]
    tokens = batch["input_ids"].numel()
    mask = batch["response_mask"].bool()
    result = {f"train_{p}_tokens_per_s": round(tokens / statistics.median(s), 1) for p, s in seconds.items()}
    result["train_bf16_speedup"] = round(result["train_bf16_tokens_per_s"] / result["train_fp32_tokens_per_s"], 3)
    result["bf16_actor_vs_fp32_actor_max_abs_logprob_gap"] = round(
        float((logprobs["bf16"] - logprobs["fp32"])[mask].abs().max()), 6)
    return result


def run(model: str = "small", prompts: int = 32, max_new_tokens: int = 64, rounds: int = 3, steps: int = 5,
        batch_size: int = 16, prompt_len: int = 32, response_len: int = 96, micro_batch_size: int = 8,
        session_rounds: int = 2) -> dict:
    """Return bf16-vs-fp32 tokens/s ratios of the rollout and of training, with the log-prob gaps.
    ``rounds``: timed generations per rollout session; ``session_rounds``: pairs of rollout
    sessions (fp32, bf16, bf16, fp32 for 2; 1: one of each)."""
    if not isinstance(session_rounds, int) or session_rounds < 1:
        raise UserError(f"benchmark precision: session_rounds must be an integer of at least 1, got {session_rounds!r}")
    import json

    threads = min(2, usable_cores())
    model_dir = str(resolve_model(model))
    vocab = json.loads((resolve_model(model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, min(vocab, 300), (prompts, 16), generator=g).tolist()
    out = {"model": model, "processor": processor(), "threads": threads, "prompts": prompts,
           "max_new_tokens": max_new_tokens, "train_batch": [batch_size, prompt_len + response_len]}
    connect(num_gpus=1)
    out.update(rollout_side(model_dir, prompt_ids, max_new_tokens, rounds, threads, session_rounds))
    out.update(train_side(model_dir, make_batch(batch_size, prompt_len, response_len, vocab), steps, threads,
                          micro_batch_size))
    return out
