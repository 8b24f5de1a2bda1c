"""The mapping advisor against published GPU runs: each run's step predicted from a GPU kind's
profile (``advisor/profile.py``: datasheet peaks and stated efficiency assumptions) and the
run's published configuration, then compared with the published figures. Nothing is measured
here and nothing is fitted to the published figures; where a run does not publish something the
model needs (a prompt length), the value assumed is stated in the row.

- NeMo-RL's GRPO throughput tables (H100, Megatron Core training, vLLM generation): Qwen3-30B-A3B
  on 32 GPUs, on-policy (colocated) and one step off-policy (16 training and 16 generation
  GPUs), from v0.6; Qwen3-32B, on-policy on 32 GPUs and one step off-policy on 64, from v0.5.
  The published tokens/s/GPU count every sample's prompt and response (G-GBS x G-Average Seq len
  / (step time x GPUs), within the few percent the table's notes allow for its 5-step averages).
- verl's fully-async trainer (Qwen2.5-Math-7B, DAPO, 128 H20): the colocated synchronous step
  against rollout and training on 64 GPUs each. The run publishes no mean response length (only
  its 28K maximum); its 16 + 16 row's update time bounds it (``response_bound``: at the H20's
  peak, a longer mean could not have trained in the time published), and the speedup is
  predicted at that bound and at 512 to 8,192 tokens, those past the bound marked not feasible.
- The seeds' figures (../shared/seeds, 000: Llama-2-70B PPO on 64 A100 at TP 4, PP 8, DP 2, 1M
  tokens per step): a colocated step of 0.893 s against 1.842 s for "traditional PPO", devices
  busy 72.4% and 38.7%; predicted for the colocated mapping and for generation and training on
  separate pools, with the arithmetic lower bound of the update alone.

Keys: ``rows`` (per run: published and predicted figures, ``error`` = predicted / published - 1,
the predicted stages, ``assumed``), ``median_abs_error`` over the NeMo-RL step times,
``async_speedup`` and ``seeds``.
"""
from __future__ import annotations

import dataclasses
import statistics

from hybridlab.advisor.cost_model import Workload, predict
from hybridlab.advisor.profile import load_profile
from hybridlab.config import RunConfig, config_with
from hybridlab.controller.mapping import DeviceMapping

NEMO_RL = ("NVIDIA-NeMo/RL docs/about/performance-summary.md, {version} (https://docs.nvidia.com/nemo/rl/"
           "{version}/about/performance-summary.html): H100 BF16, Megatron Core, vLLM, OpenMathInstruct-2, G-GBS 2048"
           " (64 prompts x 32), T-GBS 512, T-Max Seq Len 4096")
VERL_ASYNC = ("volcengine/verl docs/advance/fully_async.md and recipe/fully_async_policy/README.md (commit "
              "19997f9e): Qwen2.5-Math-7B, DAPO, 128 H20, 512 prompts x 16 responses, max response 28K")
SEED = "../shared/seeds/000 (a blog post's claims): Llama-2-70B PPO on 8 x 8 A100, TP 4, PP 8, DP 2"
PROMPT_ASSUMED = 150  # tokens: NeMo-RL publishes the whole sequence's mean only (OpenMathInstruct-2 prompts are short)

# each model's Hugging Face config, as much of it as its parameter count needs
CONFIGS = {
    "Qwen3-30B-A3B": dict(layers=48, hidden=2048, vocab=151_936, heads=32, kv_heads=4, head_dim=128, qk_norm=True,
                          experts=128, top_k=8, expert_intermediate=768),
    "Qwen3-32B": dict(layers=64, hidden=5120, vocab=151_936, heads=64, kv_heads=8, head_dim=128, qk_norm=True,
                      intermediate=25_600),
    "Qwen2.5-Math-7B": dict(layers=28, hidden=3584, vocab=152_064, heads=28, kv_heads=4, head_dim=128, qkv_bias=True,
                            intermediate=18_944),
    "Llama-2-70B": dict(layers=80, hidden=8192, vocab=32_000, heads=64, kv_heads=8, head_dim=128,
                        intermediate=28_672),
}


def model_dims(name: str) -> dict:
    """Return the Workload fields of model ``name`` (``CONFIGS``): its parameters counted from the
    config (untied embeddings, gated MLPs, RMSNorms), and for an MoE its routed experts'."""
    c = CONFIGS[name]
    h, q, kv = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if c.get("qkv_bias") else 0)
    attention += 2 * c["head_dim"] if c.get("qk_norm") else 0
    experts = c.get("experts", 0)
    expert = 3 * h * c["expert_intermediate"] if experts else 0
    mlp = experts * expert + h * experts if experts else 3 * h * c["intermediate"]  # MoE: the experts and router
    params = 2 * c["vocab"] * h + c["layers"] * (attention + mlp + 2 * h) + h
    dims = dict(params=params, layers=c["layers"], hidden=h, vocab=c["vocab"])
    if experts:
        dims.update(experts=experts, top_k=c["top_k"], moe_layers=c["layers"],
                    expert_params=c["layers"] * experts * expert)
    return dims


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published row: its model, GPUs and layout (in hybridlab's mapping), and figures."""

    name: str
    version: str                   # NeMo-RL's release whose table holds the row
    model: str
    gpu: str
    mapping: dict
    off_policy: bool
    sequence_mean: float           # G-Average Seq len: prompt and response
    step_s: float
    tokens_per_s_per_gpu: float


def _pools(train: dict, gen: dict, train_devices: int, gen_devices: int = 0) -> dict:
    """Return a mapping: the actor (with the reward) and the rollout colocated on one pool, or on
    two (``gen_devices``)."""
    if not gen_devices:
        roles = {"actor": {**train, "colocate": "e"}, "rollout": {**gen, "colocate": "e"},
                 "reward": {"dp": train_devices, "colocate": "e"}}
        return {"pools": {"main": {"devices": train_devices}}, "roles": {r: {"pool": "main", **v}
                                                                          for r, v in roles.items()}}
    roles = {"actor": {"pool": "train", **train, "colocate": "t"}, "rollout": {"pool": "gen", **gen, "colocate": "g"},
             "reward": {"pool": "train", "dp": train_devices, "colocate": "t"}}
    return {"pools": {"train": {"devices": train_devices}, "gen": {"devices": gen_devices}}, "roles": roles}


NEMO_RUNS = (
    PublishedRun("NeMo-RL v0.6 Qwen3-30B-A3B on-policy, 32 H100", "0.6.0", "Qwen3-30B-A3B", "h100",
                 _pools({"dp": 32, "ep": 8}, {"tp": 2, "dp": 16}, 32), False, 3203, 192.0, 1102.0),
    PublishedRun("NeMo-RL v0.6 Qwen3-30B-A3B one step off-policy, 16 + 16 H100", "0.6.0", "Qwen3-30B-A3B", "h100",
                 _pools({"dp": 8, "pp": 2, "ep": 8}, {"tp": 2, "dp": 8}, 16, 16), True, 3201, 152.0, 1414.0),
    PublishedRun("NeMo-RL v0.5 Qwen3-32B on-policy, 32 H100", "0.5.0", "Qwen3-32B", "h100",
                 _pools({"tp": 4, "pp": 4, "dp": 2}, {"tp": 4, "dp": 8}, 32), False, 3251, 376.0, 571.0),
    PublishedRun("NeMo-RL v0.5 Qwen3-32B one step off-policy, 32 + 32 H100 (the split assumed)", "0.5.0",
                 "Qwen3-32B", "h100",
                 _pools({"tp": 4, "pp": 4, "dp": 2}, {"tp": 4, "dp": 8}, 32, 32), True, 3252, 200.0, 538.0),
)


def _grpo(prompts: int, group: int, train_samples: int, max_new: int, off_policy: bool,
          extra: tuple[str, ...] = ()) -> RunConfig:
    """GRPO as NeMo-RL and verl run it: old log-probs recomputed by the trainer, packed micro-batches."""
    return config_with({}, [f"data.prompts_per_step={prompts}", f"rollout.n={group}",
                            f"rollout.max_new_tokens={max_new}", f"actor.ppo_mini_batch_size={train_samples // group}",
                            "actor.use_rollout_log_probs=false", f"trainer.off_policy={str(off_policy).lower()}",
                            *extra])


def nemo_row(run: PublishedRun) -> dict:
    """Return the predicted against the published step and tokens/s/GPU of a NeMo-RL row."""
    max_seq, samples = 4096, 2048   # T-Max Seq Len; G-GBS: 64 prompts x 32 generations
    work = Workload(samples=samples, prompt_mean=PROMPT_ASSUMED, prompt_max=PROMPT_ASSUMED,
                    response_mean=run.sequence_mean - PROMPT_ASSUMED, response_max=max_seq - PROMPT_ASSUMED,
                    **model_dims(run.model))
    cfg = _grpo(64, 32, 512, max_seq - PROMPT_ASSUMED, run.off_policy)
    mapping = DeviceMapping.from_dict(run.mapping)
    p = predict(work, cfg, mapping, load_profile(run.gpu))
    gpus = sum(pool.devices for pool in mapping.pools.values())
    tokens = samples * run.sequence_mean / (p.step_s * gpus)
    return {"run": run.name, "source": NEMO_RL.format(version=run.version), "profile": run.gpu, "mapping": run.mapping,
            "published": {"step_s": run.step_s, "tokens_per_s_per_gpu": run.tokens_per_s_per_gpu},
            "predicted": {"step_s": round(p.step_s, 1), "tokens_per_s_per_gpu": round(tokens, 1),
                          "stage_s": {k: round(v, 2) for k, v in p.stage_s.items()}, "overlapped": p.overlapped},
            "error": {"step_s": round(p.step_s / run.step_s - 1, 3),
                      "tokens_per_s_per_gpu": round(tokens / run.tokens_per_s_per_gpu - 1, 3)},
            "assumed": [f"prompts of {PROMPT_ASSUMED} tokens (the mean sequence, prompt and response, is published)",
                        "the reward beside the trainer; no reference pass (the table's step is training, generation,"
                        " policy log-probs and refit)"]}


def response_bound(flops: float, params: int, prompt: int) -> int:
    """Return the longest mean response (tokens) with which verl's 16 + 16 run of the same recipe
    could have updated in its published time: 512 x 16 sequences trained by 16 GPUs in 269.80 s,
    at 6 x params FLOPs per token (no attention, no recomputation) and every GPU at ``flops``
    (the datasheet's peak). A longer mean needs more than the hardware's peak."""
    gpus, update_s, sequences = 16, 269.80, 512 * 16
    return int(gpus * flops * update_s / (6 * params * sequences)) - prompt


def async_speedup(response_means: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)) -> dict:
    """Return verl's fully-async speedup at 128 H20 (published per step: colocated 356.30 s against
    64 + 64 GPUs at 150.63 s) against the cost model's, at the longest mean response the published
    update times allow (``response_bound``) and at each of ``response_means``.

    The basis, read from the recipe (``verl/experimental/fully_async_policy``): a published
    asynchronous step is one parameter-sync cycle, ``trigger_parameter_sync_step`` (4) x
    ``require_batches`` (4) x ``ppo_mini_batch_size`` (32) = 512 prompts x 16 responses, the
    colocated step's batch (``timing_s/step`` is summed over the cycle's 4 local updates); the
    rollout streams with partial rollouts (``partial_rollout=True``, staleness 0.5), and the old
    log-probs are the rollout's (``use_rollout_log_probs=True``: its old_log_prob column is empty),
    which hybridlab's streaming with bypass mode prices the same way. The run publishes no mean
    response, only its 28K maximum; the means past the bound are shown as not feasible."""
    prompts, group, max_response, prompt = 512, 16, 28 * 1024, 512
    predicted, profile, dims = {}, load_profile("h20"), model_dims("Qwen2.5-Math-7B")
    bound = response_bound(profile.flops, dims["params"], prompt)
    colocated = DeviceMapping.from_dict(_pools({"tp": 4, "dp": 32}, {"tp": 4, "dp": 32}, 128))
    split = DeviceMapping.from_dict(_pools({"tp": 4, "dp": 16}, {"tp": 4, "dp": 16}, 64, 64))
    on = _grpo(prompts, group, 32 * group, max_response, False)
    streaming = _grpo(prompts, group, 32 * group, max_response, False,
                      ("trainer.streaming=true", "algorithm.rollout_correction.bypass_mode=true"))
    for mean in sorted({bound, *response_means}):
        work = Workload(samples=prompts * group, prompt_mean=prompt, prompt_max=2048, response_mean=mean,
                        response_max=max_response, **dims)
        sync, stream = predict(work, on, colocated, profile), predict(work, streaming, split, profile)
        predicted[str(mean)] = {"colocated_s": round(sync.step_s, 1), "streaming_s": round(stream.step_s, 1),
                                "speedup": round(sync.step_s / stream.step_s, 3), "feasible": mean <= bound,
                                "colocated_stages_s": {k: round(v, 1) for k, v in sync.stage_s.items()},
                                "streaming_stages_s": {k: round(v, 1) for k, v in stream.stage_s.items()}}
    published = round(356.30 / 150.63, 3)
    errors = {mean: round(p["speedup"] / published - 1, 3) for mean, p in predicted.items()}
    return {"source": VERL_ASYNC, "profile": "h20", "published_speedup": published, "predicted": predicted,
            "response_bound": bound, "error": errors, "error_at_bound": errors[str(bound)],
            "assumed": [f"prompts of {prompt} tokens (at most 2,048); the mean response lengths listed (the run"
                        " publishes only its 28K maximum), the longest of them the bound that verl's 16 + 16 row's"
                        " update time (269.80 s) sets at the H20's peak",
                        "TP 4 on both sides (the run's scripts; their Ulysses sequence parallelism is not modelled)"]}


def seed_figures() -> dict:
    """Return the seed's Llama-2-70B PPO figures against the colocated and the separate-pool
    predictions, and the update's arithmetic lower bound (every FLOP at the A100's peak)."""
    model, devices, tokens = model_dims("Llama-2-70B"), 64, 2**20
    samples, half = tokens // 2048, 1024           # 1M tokens of 2,048-token sequences: 1,024 prompt + 1,024 response
    work = Workload(samples=samples, prompt_mean=half, prompt_max=half, response_mean=half, response_max=half, **model)
    cfg = config_with({}, [f"data.prompts_per_step={samples}", "rollout.n=1", f"rollout.max_new_tokens={half}",
                           "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
                           f"actor.ppo_mini_batch_size={samples}", f"critic.ppo_mini_batch_size={samples}"])
    layout = {"tp": 4, "pp": 8, "dp": 2}
    together = {"pools": {"main": {"devices": 64}},
                "roles": {r: {"pool": "main", **layout, "colocate": "e"} for r in ("actor", "ref", "critic")}
                | {"rollout": {"pool": "main", "tp": 4, "dp": 16, "colocate": "e"},
                   "reward": {"pool": "main", "dp": 64, "colocate": "e"}}}
    apart = {"pools": {"train": {"devices": 32}, "gen": {"devices": 32}},
             "roles": {r: {"pool": "train", "tp": 4, "pp": 4, "dp": 2, "colocate": "t"}
                       for r in ("actor", "ref", "critic")}
             | {"rollout": {"pool": "gen", "tp": 4, "dp": 8, "colocate": "g"},
                "reward": {"pool": "gen", "dp": 32, "colocate": "g"}}}
    profile = load_profile("a100")
    out = {}
    for name, mapping in (("colocated", together), ("separate_pools", apart)):
        p = predict(work, cfg, DeviceMapping.from_dict(mapping), profile)
        out[name] = {"step_s": round(p.step_s, 1), "busy": p.busy}
    floor = 6 * model["params"] * tokens / (devices * profile.flops)  # the actor's update alone at 100% of peak
    return {"source": SEED, "profile": "a100",
            "published": {"colocated": {"step_s": 0.893, "busy": 0.724},
                          "traditional": {"step_s": 1.842, "busy": 0.387}},
            "predicted": out, "update_lower_bound_s": round(floor, 1),
            "assumed": ["1M tokens as 512 sequences of 1,024 prompt and 1,024 response tokens; PPO with a critic of"
                        " the same size and KL in the reward; 'traditional' as generation and training on separate"
                        " halves, one after the other"]}


def run() -> dict:
    """Return the published runs' figures against the cost model's predictions."""
    rows = [nemo_row(r) for r in NEMO_RUNS]
    return {"benchmark": "published", "measured": False, "rows": rows,
            "median_abs_error": round(statistics.median(abs(r["error"]["step_s"]) for r in rows), 3),
            "async_speedup": async_speedup(), "seeds": seed_figures()}
