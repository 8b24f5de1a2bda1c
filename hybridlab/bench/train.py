"""Training throughput on megatron-core (TP1, TP2) vs plain transformers on the same batch, and
with ``strategy=fsdp2`` the FSDP2 backend (DP1, DP2) beside Megatron TP1 and transformers.

A step is forward + backward + AdamW on a supervised loss over the response tokens. Both
sides get the machine's cores: one worker with all threads at TP1 (DP1), one thread per worker
at TP2 (DP2); transformers runs in this process with the same thread count.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from hybridlab.batching import sequences_batch
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker import Dispatch, register
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.environment import usable_cores
from hybridlab.errors import UserError
from hybridlab.models.zoo import resolve_model
from hybridlab.workers.train.settings import settings_for
from hybridlab.workers.train.workers import ActorWorker

WARMUP = 2  # steps not timed on either side: allocator and kernel warm-up


class BenchActor(ActorWorker):
    """An actor that also reports its peak resident memory."""

    @register(Dispatch.ALL)
    def peak_rss_mb(self) -> float:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """Return a Batch of random prompts and responses of fixed lengths (no padding)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=g).tolist()
    responses = torch.randint(3, vocab, (n, response_len), generator=g).tolist()
    return sequences_batch(prompts, responses, pad_id=0)


def hf_step_time(model_dir, batch, steps: int, threads: int) -> tuple[float, torch.Tensor]:
    """Return (median seconds per training step, initial response log-probs) for transformers."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    r = batch["responses"].shape[1]
    mask = batch["response_mask"].float()

    def logprobs():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -r - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)

    with torch.no_grad():
        reference = logprobs().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i in range(steps + WARMUP):
        t = time.perf_counter()
        loss = -(logprobs() * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    return statistics.median(times), reference


def trainer_run(model_dir, batch, strategy: str, ranks: int, steps: int, threads: int,
                micro_batch_size: int) -> dict:
    """Return median step seconds, initial log-probs and peak RSS of an actor on ``ranks``
    devices: Megatron at tp=ranks, or FSDP2 at dp=ranks."""
    split = "tp" if strategy == "megatron" else "dp"
    mapping = DeviceMapping.from_dict({"pools": {"bench": {"devices": ranks, "cpus_per_device": threads / ranks}},
                                       "roles": {"actor": {"pool": "bench", split: ranks}}})
    roles = {"actor": RoleClass(BenchActor, kwargs=dict(model_dir=str(model_dir), tp=ranks if split == "tp" else 1,
                                                        settings=settings_for(lr=1e-5, strategy=strategy,
                                                                              micro_batch_size=micro_batch_size)))}
    env = {"OMP_NUM_THREADS": str(max(1, threads // ranks))}
    with WorkerSet(mapping, roles, env=env) as session:
        actor = session.groups["actor"]
        logprobs = actor.compute_log_prob(batch)["old_log_probs"].double()
        times = []
        for i in range(steps + WARMUP):
            t = time.perf_counter()
            actor.sft_step(batch)
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
        rss = actor.peak_rss_mb()
    return {"step_s": statistics.median(times), "logprobs": logprobs, "peak_rss_mb": max(rss)}


def run(models: str = "small,mid", steps: int = 5, batch_size: int = 16, prompt_len: int = 32,
        response_len: int = 96, micro_batch_size: int = 8, model: str | None = None,
        strategy: str = "megatron") -> dict:
    """Return tokens/s per model and layout, the transformers baseline, ratios, RSS and parity;
    ``model`` (a zoo name or a checkpoint directory) measures that one model instead of
    ``models``; ``strategy`` fsdp2 adds the FSDP2 backend at DP1 and DP2 (Megatron runs TP1 only)."""
    if strategy not in ("megatron", "fsdp2"):
        raise UserError(f"benchmark train: strategy must be megatron or fsdp2, got {strategy!r}")
    models = model or models
    threads = min(2, usable_cores())
    connect(num_gpus=2)
    out: dict = {"strategy": strategy, "batch_size": batch_size, "seq_len": prompt_len + response_len,
                 "steps": steps, "threads": threads, "tokens_per_s": {}, "hf_tokens_per_s": {}, "peak_rss_mb": {},
                 "max_abs_logprob_diff_vs_hf": {}}
    layouts = [("megatron", 1, "tp1"), ("megatron", 2, "tp2")] if strategy == "megatron" else \
        [("megatron", 1, "tp1"), ("fsdp2", 1, "fsdp2_dp1"), ("fsdp2", 2, "fsdp2_dp2")]
    for name in models.split(","):
        model_dir = resolve_model(name)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        batch = make_batch(batch_size, prompt_len, response_len, vocab)
        tokens = batch_size * (prompt_len + response_len)
        mask = batch["response_mask"].bool()
        hf_s, reference = hf_step_time(model_dir, batch, steps, threads)
        out["hf_tokens_per_s"][name] = round(tokens / hf_s, 1)
        for backend, ranks, label in layouts:
            layout = f"{name}_{label}"
            result = trainer_run(model_dir, batch, backend, ranks, steps, threads, micro_batch_size)
            out["tokens_per_s"][layout] = round(tokens / result["step_s"], 1)
            out["peak_rss_mb"][layout] = round(result["peak_rss_mb"], 1)
            out["max_abs_logprob_diff_vs_hf"][layout] = float((result["logprobs"] - reference)[mask].abs().max())
        speed = out["tokens_per_s"]
        out[f"ratio_tp1_vs_hf_{name}"] = round(speed[f"{name}_tp1"] / out["hf_tokens_per_s"][name], 3)
        if strategy == "fsdp2":
            out[f"ratio_fsdp2_vs_megatron_{name}"] = round(speed[f"{name}_fsdp2_dp1"] / speed[f"{name}_tp1"], 3)
            out[f"ratio_fsdp2_vs_hf_{name}"] = round(speed[f"{name}_fsdp2_dp1"] / out["hf_tokens_per_s"][name], 3)
    first = models.split(",")[0]
    for key in ("ratio_tp1_vs_hf", "ratio_fsdp2_vs_megatron", "ratio_fsdp2_vs_hf"):
        if f"{key}_{first}" in out:
            out[key] = out[f"{key}_{first}"]
    return out
