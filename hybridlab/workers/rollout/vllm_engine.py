"""vLLM in the worker's own process: start, generate from token ids, reload weights in place."""
from __future__ import annotations

import gc
import logging
import os

import torch

from hybridlab.workers.rollout.sampling import SamplingConfig


def start_llm(model_dir: str, context: int, kv_cache_mb: int, dtype: str, seed: int):
    """Return a vLLM ``LLM`` running in this process with an explicitly sized KV cache."""
    # In-process engine: needed to reload weights from this process (see docs/install.md).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    _quiet_rotary_reload_warning()
    gc.freeze()  # objects from imports are never collected; freezing them speeds up engine start
    return LLM(model=model_dir, dtype=dtype, max_model_len=context, kv_cache_memory_bytes=kv_cache_mb << 20,
               enforce_eager=True, seed=seed, logprobs_mode="processed_logprobs",
               enable_prefix_caching=False)


def _not_rotary_reload_warning(record: logging.LogRecord) -> bool:
    """False for vLLM's "<...>RotaryEmbedding: Failed to load weights", printed on every in-place
    reload: the rotary table is computed, not loaded, and stays as it was (syncs are exact)."""
    return not (record.msg == "%s: Failed to load weights" and bool(record.args)
                and str(record.args[0]).endswith("RotaryEmbedding"))


def _quiet_rotary_reload_warning() -> None:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _not_rotary_reload_warning not in logger.filters:
        logger.addFilter(_not_rotary_reload_warning)


def generate(llm, prompts: list[list[int]], cfg: SamplingConfig, eos_id: int | None):
    """Return (responses, log-probs): one token list and one float list per sample, n per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0,
                            max_tokens=cfg.max_tokens, stop_token_ids=cfg.stop_token_ids, seed=cfg.seed,
                            logprobs=0, detokenize=False, ignore_eos=cfg.ignore_eos)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    responses, logprobs = [], []
    for out in outputs:
        for completion in out.outputs:
            ids = list(completion.token_ids)
            responses.append(ids)
            logprobs.append([step[t].logprob for step, t in zip(completion.logprobs, ids)])
    return responses, logprobs


def reload_weights(llm, named: list[tuple[str, torch.Tensor]], tied: bool) -> int:
    """Load HF-named tensors into the running engine; returns the number of tensors loaded."""
    named = list(named)
    if tied:  # the engine keeps a prepacked copy of the tied output layer: send it explicitly
        named += [("lm_head.weight", t) for n, t in named if n == "model.embed_tokens.weight"]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
    return len(named)
