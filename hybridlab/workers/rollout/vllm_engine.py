"""vLLM in the worker's own process: start, generate from token ids, reload weights in place."""
from __future__ import annotations

import functools
import gc
import logging
import os
import tempfile
from typing import TYPE_CHECKING

import torch

from hybridlab.config.schema import RolloutConfig
from hybridlab.workers.rollout.sampling import SamplingConfig

if TYPE_CHECKING:
    from vllm import LLM


def start_llm(model_dir: str, context: int, kv_cache_mb: int, dtype: str, seed: int, tp: int = 1,
              prefix_caching: bool = RolloutConfig.prefix_caching, lora_rank: int = 0,
              lora_slots: tuple[int, int] = (1, 1)) -> "LLM":
    """Return a vLLM ``LLM`` running in this process with an explicitly sized KV cache.

    With ``prefix_caching`` the n samples of a prompt share its prefill (vLLM fans ``n`` out
    into n requests, each prefilling the prompt again otherwise); ``generate`` empties the
    cache first, so no KV computed under earlier weights is ever reused. Only whole KV blocks
    are shared, so on the CPU the engine then takes 32-token blocks (the CPU attention kernels
    prefer multiples of 32; the default, 128, is longer than most RL prompts).

    With ``tp > 1`` this process is one tensor-parallel rank of the engine (vLLM's
    "external launcher" mode, as verl runs it): the worker group's torch.distributed world must
    exist, its consecutive ranks form the engines, and every rank of an engine is given the
    same prompts and computes the same tokens.

    With ``lora_rank`` the engine serves LoRA adapters of at most that rank beside the base
    model, loaded from memory by ``load_adapter``: ``lora_slots`` (adapters in one batch,
    adapters held) of them, one by default (the actor's; the Tinker service holds several).
    """
    # In-process engine: needed to reload weights from this process (see docs/install.md).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    _quiet_partial_reload_warnings()
    gc.freeze()  # objects from imports are never collected; freezing them speeds up engine start
    from vllm.platforms import current_platform

    extra = {}
    if current_platform.is_cpu():
        run_compiled_helpers_eagerly()
        if prefix_caching:
            extra["block_size"] = 32
    if tp > 1:
        extra.update(tensor_parallel_size=tp, distributed_executor_backend=_external_launcher())
    if lora_rank:
        extra.update(enable_lora=True, max_lora_rank=lora_slot_rank(lora_rank), max_loras=lora_slots[0],
                     max_cpu_loras=lora_slots[1])
    return LLM(model=model_dir, dtype=dtype, max_model_len=context, kv_cache_memory_bytes=kv_cache_mb << 20,
               enforce_eager=True, seed=seed, logprobs_mode="processed_logprobs",
               enable_prefix_caching=prefix_caching, **extra)


def run_compiled_helpers_eagerly() -> None:
    """Make this process run ``torch.compile``'d functions as plain Python (Dynamo off).

    On CPU the engine runs eagerly (``enforce_eager``), yet vLLM still compiles two helpers on
    their first call: the rank count of the sampled tokens' log-probs and the vocab-parallel
    embedding mask. Tracing them costs about 2 s per engine process on our 2-core machines, and
    inductor's C++ build minutes more on a fresh one; eager they compute the same integers.
    Megatron's fused helpers (``jit_fuser``) in a colocated process run eagerly too.
    """
    import torch._dynamo

    torch._dynamo.config.disable = True


def _external_launcher() -> type:
    """Return vLLM's external-launcher executor, named after this worker group's rendezvous.

    vLLM names the CPU shared-memory segments of a TP group after the executor's init method,
    which for the stock executor is always "env://": two groups (two replicas, two sessions, a
    crashed run's leftovers) would then collide on ``/dev/shm`` ("create shm ... errno 17").
    The group's rendezvous port is unique while the group lives.
    """
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher

    class GroupExternalLauncher(ExecutorWithExternalLauncher):
        def _distributed_args(self) -> tuple[str, int, int]:
            _, rank, local_rank = super()._distributed_args()
            return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", rank, local_rank

    return GroupExternalLauncher


def engine_files() -> list[str]:
    """Return the files this process's engine keeps outside it, which vLLM does not remove: its
    TP group's shared-memory segments in ``/dev/shm`` (vLLM's private parallel state names them,
    as of vLLM 0.32) and a tp=1 engine's rendezvous file ``/tmp/vllm_dist_<id>``."""
    paths = []
    from vllm.distributed import parallel_state

    for group in (parallel_state._TP, parallel_state._PP):
        shm = getattr(getattr(group, "device_communicator", None), "dist_module", None)
        if group is not None and hasattr(shm, "group_name"):
            paths.append(os.path.join("/dev/shm", f"{shm.group_name}_{group.rank_in_group}"))
    ident = os.environ.get("VLLM_DIST_IDENT", "")  # a file store's name, set by vLLM's CPU worker
    if ident.startswith("vllm_dist_"):
        paths.append(os.path.join(tempfile.gettempdir(), ident))
    return paths


def close_llm(llm: "LLM") -> None:
    """Stop the engine and remove the files ``engine_files`` names."""
    paths = engine_files()
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _not_partial_reload_warning(record: logging.LogRecord) -> bool:
    """False for vLLM's warnings about layers a reload call did not carry. A sync reloads the
    model one bucket at a time, so every call leaves most layers out (and the rotary table is
    computed, never loaded); vLLM keeps those layers as they were and syncs are exact (tested)."""
    return record.msg not in ("%s: Failed to load weights", "Following weights were not loaded from checkpoint: %s")


def _quiet_partial_reload_warnings() -> None:
    for name in ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace"):
        logger = logging.getLogger(name)
        if _not_partial_reload_warning not in logger.filters:
            logger.addFilter(_not_partial_reload_warning)


def sampling_params(cfg: SamplingConfig, stop_ids: list[int], **overrides):
    """Return vLLM's ``SamplingParams`` for ``cfg`` (``overrides``: e.g. ``n``, ``max_tokens``,
    ``seed`` of one agent call), with the sampled tokens' log-probs and no detokenizing."""
    from vllm import SamplingParams

    fields = dict(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or 0,
                  max_tokens=cfg.max_tokens, seed=cfg.seed,
                  # vLLM adds its own end ids; these make it stop exactly where the hf backend does
                  stop_token_ids=None if cfg.ignore_eos else [*stop_ids, *(cfg.stop_token_ids or [])],
                  logprobs=0, detokenize=False, ignore_eos=cfg.ignore_eos)
    return SamplingParams(**{**fields, **overrides})


def per_request_seeds() -> bool:
    """True where vLLM can seed requests that join a running batch. On the CPU, vLLM 0.32 fails
    ("CPU Generator does not use offset") when it rewinds a seeded request's generator after a
    step that prefilled only part of its prompt, which agent rollouts hit as later turns join
    running ones; there the requests share the engine's seeded stream instead."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu()


def empty_prefix_cache(llm) -> None:
    """Drop every cached KV block (the weights may have changed since they were computed);
    raises RuntimeError when vLLM cannot (blocks still held by unfinished requests)."""
    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not empty its prefix cache (blocks still held by unfinished requests)")


def generate(llm, prompts: list[list[int]], cfg: SamplingConfig, stop_ids: list[int], adapter: bool = False):
    """Return (responses, log-probs): one token list and one float list per sample, n per prompt,
    each ending at the first of ``stop_ids`` (the checkpoint's end ids) or ``cfg.stop_token_ids``;
    with ``adapter``, sampled through the LoRA adapter ``load_adapter`` installed."""
    from vllm.inputs import TokensPrompt

    empty_prefix_cache(llm)
    params = sampling_params(cfg, stop_ids)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                           lora_request=adapter_request() if adapter else None)
    responses, logprobs = [], []
    for out in outputs:
        for completion in out.outputs:
            ids, sampled = sampled_logprobs(completion)
            responses.append(ids)
            logprobs.append(sampled)
    return responses, logprobs


def sampled_logprobs(completion) -> tuple[list[int], list[float]]:
    """Return a vLLM completion's token ids and the log-prob each was sampled with (the engine
    runs with ``logprobs=0``: each step holds the sampled token's)."""
    ids = list(completion.token_ids)
    return ids, [step[t].logprob for step, t in zip(completion.logprobs, ids)]


def reload_weights(llm, named: list[tuple[str, torch.Tensor]], tied: bool) -> int:
    """Load HF-named tensors into the running engine; returns the number of tensors loaded."""
    named = list(named)
    if tied:  # the engine keeps a prepacked copy of the tied output layer: send it explicitly
        named += [("lm_head.weight", t) for n, t in named if n == "model.embed_tokens.weight"]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
    experts = {n.split(".experts.")[0] + ".experts" for n, _ in named if ".mlp.experts." in n}
    if experts:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            llm.apply_model(functools.partial(_prepack_reloaded_experts, layers=experts))
    return len(named)


def _prepack_reloaded_experts(model: torch.nn.Module, layers: set[str]) -> None:
    """Re-run the CPU MoE kernel's weight prepacking on the reloaded layers' experts.

    vLLM 0.32 prepacks a layer's experts into the CPU grouped-gemm layout only on the first
    load: a reload (``UnquantizedFusedMoEMethod._setup_kernel`` on a weight update) copies the
    new weights in plain layout and skips the kernel's ``process_weights_after_loading``, so the
    kernel would read plain weights as packed (a synced MoE model then generated garbage). The
    sync sends a layer's experts in one reload (``reshard.plan.buckets``), so each layer named
    here holds freshly loaded, unpacked weights.
    """
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None and name.rsplit(".routed_experts", 1)[0] in layers:
            kernel.fused_experts.process_weights_after_loading(module)


# ------------------------------------------------------------------------------- LoRA
ADAPTER_ID = 1  # the actor's adapter: each sync replaces the adapter under this id


def lora_slot_rank(rank: int) -> int:
    """Return the smallest adapter rank vLLM can reserve that holds ``rank``; raises ValueError
    past its largest."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    fits = [r for r in typing.get_args(MaxLoRARanks) if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {max(typing.get_args(MaxLoRARanks))}, got {rank}")
    return fits[0]


def adapter_request(adapter_id: int = ADAPTER_ID):
    """Return the LoRARequest that samples through the adapter ``load_adapter`` installed under ``adapter_id``."""
    from vllm.lora.request import LoRARequest

    # never read from this path: the adapter is in the engine already (load_adapter)
    return LoRARequest(f"hybridlab-{adapter_id}", adapter_id, "in-memory")


def _install_adapter(worker, tensors: dict[str, torch.Tensor], config: dict, adapter_id: int) -> int:
    """Runs inside the engine's worker: build a LoRAModel from the tensors (as vLLM's loader does
    from files) and put it under ``adapter_id`` in place of the previous one; returns its layer count."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(worker, "worker", worker).model_runner.lora_manager
    slots = manager._adapter_manager  # vLLM's model manager: the loaded adapters and their slots
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(slots.lora_config)
    dtype = slots.lora_config.lora_dtype
    adapter = LoRAModel.from_lora_tensors(adapter_id, tensors, helper, device="cpu", dtype=dtype,
                                          model_vocab_size=manager.vocab_size)
    slots.remove_adapter(adapter_id)
    slots.add_adapter(adapter)
    slots.activate_adapter(adapter_id)
    return len(adapter.loras)


def _installed_adapters(worker) -> list[int]:
    manager = getattr(worker, "worker", worker).model_runner.lora_manager
    return sorted(manager.list_adapters())


def installed_adapters(llm) -> set[int]:
    """Return the ids of the adapters the engine holds now (vLLM evicts the least recently used
    past its ``max_cpu_loras``)."""
    return set(llm.collective_rpc(_installed_adapters)[0])


def load_adapter(llm, tensors: dict[str, torch.Tensor], config: dict, adapter_id: int = ADAPTER_ID) -> int:
    """Install a LoRA adapter, given as tensors in PEFT's file names and its PEFT config, in the
    running engine under ``adapter_id``, replacing what it held there; returns the number of
    layers it adapts.

    vLLM's own path (``LoRARequest``) reads adapters from a folder; this engine runs in our
    process, so the adapter is built from the tensors directly (as verl does), with no files.
    vLLM folds the scale into B in place: it gets copies, so the caller's tensors (the trainer's
    own, in a colocated sync) stay as they are.
    """
    copies = {name: t.clone() for name, t in tensors.items()}
    return llm.collective_rpc(_install_adapter, args=(copies, config, adapter_id))[0]
