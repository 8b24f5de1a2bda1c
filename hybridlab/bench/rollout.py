"""Generation throughput: our rollout worker vs raw vLLM vs transformers ``generate``.

All three generate the same number of tokens (fixed length, end-of-sequence ignored) from the
same prompts with the same threads: raw vLLM and transformers in this process, ours through
the controller into a RolloutWorker on its own worker process.
"""
from __future__ import annotations

import time

import torch

from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.resources import connect
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.environment import usable_cores
from hybridlab.models.zoo import resolve_model
from hybridlab.protocol import Batch
from hybridlab.workers.rollout import hf_engine, vllm_engine
from hybridlab.workers.rollout.sampling import SamplingConfig
from hybridlab.workers.rollout.worker import RolloutWorker


def run(model: str = "mid", prompts: int = 64, max_new_tokens: int = 128, prompt_len: int = 16,
        kv_cache_mb: int = 256) -> dict:
    """Return tokens/s of ours, raw vLLM and transformers (each side's own generated tokens over
    its seconds; ``generated_tokens`` has the counts, which ``ignore_eos`` makes ``prompts`` x
    ``max_new_tokens`` on every side) and the ratios of the reported figures."""
    threads = min(2, usable_cores())
    model_dir = str(resolve_model(model))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (prompts, prompt_len), generator=g).tolist()
    cfg = SamplingConfig(temperature=1.0, max_tokens=max_new_tokens, ignore_eos=True, seed=0)
    out = {"model": model, "prompts": prompts, "max_new_tokens": max_new_tokens, "threads": threads}
    generated = out["generated_tokens"] = {}

    connect(num_gpus=1)
    mapping = DeviceMapping.from_dict({"pools": {"gen": {"devices": 1, "cpus_per_device": threads}},
                                       "roles": {"rollout": {"pool": "gen"}}})
    roles = {"rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=model_dir, kv_cache_mb=kv_cache_mb))}
    with WorkerSet(mapping, roles, env={"OMP_NUM_THREADS": str(threads)}) as session:
        rollout = session.groups["rollout"]
        batch = Batch(objects={"prompt_ids": ids})
        rollout.generate(batch, SamplingConfig(max_tokens=4))   # warm-up
        t = time.perf_counter()
        result = rollout.generate(batch, cfg)
        ours_s = time.perf_counter() - t
        generated["ours"] = int(result["response_mask"].sum())
    out["ours_tokens_per_s"] = round(generated["ours"] / ours_s, 1)

    torch.set_num_threads(threads)
    llm = vllm_engine.start_llm(model_dir, 512, kv_cache_mb, "float32", 0)
    vllm_engine.generate(llm, ids[:2], SamplingConfig(max_tokens=4), [])   # warm-up
    t = time.perf_counter()
    responses, _ = vllm_engine.generate(llm, ids, cfg, [])
    vllm_s = time.perf_counter() - t
    generated["vllm"] = sum(len(r) for r in responses)
    llm.llm_engine.engine_core.shutdown()
    del llm
    out["vllm_tokens_per_s"] = round(generated["vllm"] / vllm_s, 1)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t = time.perf_counter()
    responses, _ = hf_engine.generate_ids(hf, ids, cfg, 0, [])
    hf_s = time.perf_counter() - t
    generated["hf"] = sum(len(r) for r in responses)
    out["hf_tokens_per_s"] = round(generated["hf"] / hf_s, 1)
    out["ratio_vs_vllm"] = round(out["ours_tokens_per_s"] / out["vllm_tokens_per_s"], 3)
    out["ratio_vs_hf"] = round(out["ours_tokens_per_s"] / out["hf_tokens_per_s"], 3)
    return out
