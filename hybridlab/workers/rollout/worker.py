"""RolloutWorker: generation on vLLM (or transformers) inside a worker group.

Input: a Batch whose object field ``prompt_ids`` holds token-id lists, or ``prompt`` holds
texts (tokenized here with the model's tokenizer); optionally ``index`` for error messages;
any other per-sample fields ride along. Output: the input repeated
``n`` times (interleaved: a a b b) plus verl's layout from ``hybridlab.batching`` and
``rollout_log_probs``, the sampled tokens' log-probabilities under the sampling temperature.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from hybridlab.agents.rollout import (AgentSettings, TrajectoryRunner, agent_batch, agent_samples, load_spec,
                                      run_agents)
from hybridlab.agents.stream import AgentStream
from hybridlab.agents.tool_loop import AgentLimits, ChatClient
from hybridlab.batching import PROMPT_WIDTH, right_padded, sequences_batch
from hybridlab.config.schema import DataConfig, RolloutConfig, SandboxConfig, TrainerConfig
from hybridlab.controller.worker import Dispatch, Worker, register
from hybridlab.models.chat import use_template
from hybridlab.models.stops import checkpoint_stop_ids
from hybridlab.protocol import Batch
from hybridlab.reshard.sources import join_slices
from hybridlab.sandbox import tool as python_tool
from hybridlab.workers.rollout.hf_engine import generate_ids
from hybridlab.workers.rollout.sampling import SamplingConfig, fit_prompts
from hybridlab.workers.rollout.stream import EngineStream
from hybridlab.workers.rollout.vllm_engine import (adapter_request, close_llm, engine_files, generate, load_adapter,
                                                   per_request_seeds, reload_weights, sampling_params, start_llm)

BACKENDS = ("vllm", "hf")


class RolloutWorker(Worker):
    """Holds one generation engine per rank (vLLM in this process, or transformers).

    With ``tp > 1`` each engine spans ``tp`` consecutive ranks (replica = rank // tp); every
    rank of an engine gets the same prompts, and the engine's first rank answers.
    """

    def __init__(self, model_dir: str, backend: str = RolloutConfig.backend, max_model_len: int | None = None,
                 kv_cache_mb: int = RolloutConfig.kv_cache_mb, dtype: str = RolloutConfig.dtype,
                 truncate_prompts: bool = DataConfig.truncate_prompts, seed: int = TrainerConfig.seed, tp: int = 1,
                 prefix_caching: bool = RolloutConfig.prefix_caching, lora_rank: int = 0,
                 sandbox: SandboxConfig | None = None, lora_slots: tuple[int, int] = (1, 1)):
        if backend not in BACKENDS:
            raise ValueError(f"unknown rollout backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
        if tp < 1 or self.world_size % tp:
            raise ValueError(f"rollout tp={tp} must divide the group's {self.world_size} ranks")
        if tp > 1 and backend != "vllm":
            raise ValueError(f"rollout tp={tp} needs the vllm backend (the hf backend runs one whole model per rank)")
        if lora_rank and backend != "vllm":
            raise ValueError("an adapter-only LoRA sync needs the vllm backend (actor.lora.sync=merged works with any)")
        import json

        config = json.loads(open(os.path.join(model_dir, "config.json")).read())
        self.model_dir, self.backend, self.truncate = model_dir, backend, truncate_prompts
        python_tool.configure(sandbox or SandboxConfig())  # the python tool's interpreter and limits
        self.context = max_model_len or config["max_position_embeddings"]
        self.pad_id = config.get("pad_token_id") or 0
        self.stop_ids = checkpoint_stop_ids(model_dir, self.tokenizer)  # where every path ends a response
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.tp, self.dtype = tp, getattr(torch, dtype)
        self.load_seconds = {"fetch_s": 0.0, "load_s": 0.0}
        self.adapter = False  # a LoRA adapter is installed: generation runs through it
        self.stream: EngineStream | None = None  # the continuously running engine (trainer.streaming)
        self.agent_stream: AgentStream | None = None  # agent trajectories run on it
        if backend == "vllm":
            if tp > 1:
                self.init_distributed()  # the engines' TP groups are cut from this group's world
            self.llm = start_llm(model_dir, self.context, kv_cache_mb, dtype, seed, tp, prefix_caching, lora_rank,
                                 lora_slots)
        else:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def dp_info(self) -> tuple[int, int, bool]:
        """Return (engine replica, replicas, answers): the ranks of one engine share a chunk."""
        return self.rank // self.tp, self.world_size // self.tp, self.rank % self.tp == 0

    def close(self) -> None:
        """Stop the engine and free what it holds outside this process (``/dev/shm`` segments)."""
        self.stream_close()
        if self.backend == "vllm" and getattr(self, "llm", None) is not None:
            close_llm(self.llm)
            self.llm = None

    @register(Dispatch.ALL)
    def engine_files(self) -> list[str]:
        """Return the files this rank's engine keeps outside its process (removed by ``close``)."""
        if self.backend != "vllm":
            return []

        return engine_files()

    @register(Dispatch.DP)
    def generate(self, batch: Batch, sampling: SamplingConfig | dict | None = None) -> Batch:
        """Return the batch repeated n times with generated responses and their log-probs."""
        cfg = SamplingConfig(**sampling) if isinstance(sampling, dict) else (sampling or SamplingConfig())
        cfg.validate()
        if "prompt_ids" in batch:
            ids = batch["prompt_ids"]
        elif "prompt" in batch:
            ids = [self.tokenizer(text, add_special_tokens=False).input_ids for text in batch["prompt"]]
        else:
            raise ValueError("generate needs an object field 'prompt_ids' (token-id lists) or 'prompt' (texts)")
        prompts = fit_prompts(ids, cfg.max_tokens, self.context, self.truncate, batch.objects.get("index"))
        if self.stream is not None:  # streaming: the engine is the stream thread's, so the call goes through it
            params = sampling_params(cfg, self.stop_ids, seed=cfg.seed if per_request_seeds() else None)
            samples = [s for group in self.stream.generate(prompts, params, adapter_request() if self.adapter else None)
                       for s in group]
            responses, logprobs = [s["ids"] for s in samples], [s["logprobs"] for s in samples]
        elif self.backend == "vllm":
            responses, logprobs = generate(self.llm, prompts, cfg, self.stop_ids, adapter=self.adapter)
        else:
            responses, logprobs = generate_ids(self.model, prompts, cfg, self.pad_id, self.stop_ids)
        repeated = batch.repeat(cfg.n)
        out = sequences_batch([p for p in prompts for _ in range(cfg.n)], responses, self.pad_id,
                              response_len=cfg.max_tokens, prompt_len=batch.meta.get(PROMPT_WIDTH))
        out.tensors["rollout_log_probs"] = right_padded(logprobs, out["responses"].shape[1])
        out.objects["prompt_ids"] = [p for p in prompts for _ in range(cfg.n)]  # as used (maybe truncated)
        for key, values in repeated.objects.items():
            out.objects.setdefault(key, values)
        for key, values in repeated.tensors.items():
            out.tensors.setdefault(key, values)
        return out

    @register(Dispatch.DP)
    def generate_agent(self, batch: Batch, sampling: SamplingConfig | dict, settings: dict) -> Batch:
        """Return n agent trajectories per prompt in verl's multi-turn layout (``hybridlab.agents``):
        the model's tokens have response_mask 1, tool and template tokens 0."""
        if self.stream is not None:
            raise ValueError("agent rollouts do not run beside a streaming engine (trainer.streaming); switch it off")
        if self.backend != "vllm" or self.tp > 1:
            raise ValueError("agent rollouts need the vllm backend with rollout tp=1 (the engine is driven from"
                             f" this process's event loop); this group has backend={self.backend!r}, tp={self.tp}")
        cfg = (SamplingConfig(**sampling) if isinstance(sampling, dict) else sampling).validate()
        agent = AgentSettings(**settings)
        trajectories = run_agents(self.llm, agent_samples(batch), cfg.n, self._agent_runner(cfg, agent),
                                  adapter_request() if self.adapter else None)
        out = agent_batch(trajectories, self.pad_id, agent.max_trajectory_tokens, batch.meta.get(PROMPT_WIDTH))
        for key, values in batch.repeat(cfg.n).objects.items():
            out.objects.setdefault(key, values)
        return out

    def _agent_runner(self, cfg: SamplingConfig, agent: AgentSettings) -> Callable:
        """Return ``make_runner(engine)``: a TrajectoryRunner of ``agent``'s tools, function or
        environment on ``engine``, its turns sampled as ``cfg`` says (``agent.version``: recorded
        on turns whose engine labels none)."""
        key = (agent.tools, agent.agent, agent.env, agent.env_adapter, agent.max_in_flight, agent.agent_timeout_s)
        if getattr(self, "_agent_spec", (None, None))[0] != key:
            self._agent_spec = (key, load_spec(agent))
        spec, tokenizer = self._agent_spec[1], use_template(self.tokenizer, agent.chat_template)
        limits = AgentLimits(agent.max_turns, cfg.max_tokens, agent.max_trajectory_tokens, agent.tool_timeout_s,
                             self.context, agent.agent_timeout_s)
        seed, schemas = cfg.seed if per_request_seeds() else None, [t.schema for t in spec.tools.values()]

        def params(max_tokens: int, call_seed: int | None):
            return sampling_params(cfg, self.stop_ids, n=1, max_tokens=max_tokens, seed=call_seed)

        def make_runner(engine: Any) -> TrajectoryRunner:
            def make_client(i: int) -> ChatClient:
                return ChatClient(engine, tokenizer, params, limits, agent.version,
                                  None if seed is None else seed * 100_003 + i, schemas)

            return TrajectoryRunner(spec, make_client, limits, agent.max_in_flight)

        return make_runner

    def _agent_exchange(self, order: dict) -> list[dict]:
        """Start the agent trajectories of ``order["prompts"]`` (``(key, sample)``) on this rank's
        stream; returns the groups whose trajectories have all ended."""
        cfg, agent = SamplingConfig(**order["sampling"]).validate(), AgentSettings(**order["agent"])
        if self.agent_stream is None:
            self.agent_stream = AgentStream(self.stream, self._agent_runner(cfg, agent),
                                            adapter_request() if self.adapter else None)
        self.agent_stream.submit(order["prompts"], cfg.n)
        return self.agent_stream.take(order["wait_s"])

    @register(Dispatch.RAW)
    def stream_exchange(self, order: dict) -> dict:
        """Add ``order["prompts"]`` (``(key, prompt ids)``, maybe none) to this rank's continuously
        running engine, started on the first call (``order["partial"]``: what samples in flight
        do at a sync; ``order["version"]``: the weights' version it holds), and take the groups
        of ``order["sampling"]["n"]`` samples that finished, waiting up to ``order["wait_s"]`` for
        one when none has. Returns the finished groups (oldest first), the engine's stats since
        the last call, the groups still generating and the pad id. (Raw dispatch: the
        controller shares prompts out over the ranks; one call, one turn of the engine.)"""
        if self.backend != "vllm" or self.tp > 1:
            raise ValueError("streaming rollouts need the vllm backend with rollout tp=1 (one engine per process,"
                             f" stepped by a thread of it); this group has backend={self.backend!r}, tp={self.tp}")
        if self.stream is None:
            self.stream = EngineStream(self.llm, order["partial"], order["version"])
        self.stream.partial = order["partial"]  # a live change applies from the next sync
        if order.get("agent"):
            groups = self._agent_exchange(order)
            _, stats, _ = self.stream.take()
            return {"groups": groups, "stats": vars(stats), "in_flight": self.agent_stream.in_flight(),
                    "pad_id": self.pad_id}
        if order["prompts"]:
            cfg = SamplingConfig(**order["sampling"]).validate()
            keys = [key for key, _ in order["prompts"]]
            fitted = fit_prompts([ids for _, ids in order["prompts"]], cfg.max_tokens, self.context, self.truncate)
            seeded = per_request_seeds()  # else the requests share the engine's seeded stream
            self.stream.submit([(key, ids, sampling_params(cfg, self.stop_ids, seed=cfg.seed + key if seeded else None))
                                for key, ids in zip(keys, fitted)], adapter_request() if self.adapter else None)
        groups, stats, in_flight = self.stream.take(order["wait_s"])
        return {"groups": groups, "stats": vars(stats), "in_flight": in_flight, "pad_id": self.pad_id}

    @register(Dispatch.ALL)
    def stream_pause(self) -> None:
        """Stop the engine stepping (a weight sync follows; a no-op without a stream)."""
        if self.stream is not None:
            self.stream.pause()

    @register(Dispatch.ALL)
    def stream_resume(self, version: int) -> None:
        """Go on generating, labelling tokens ``version`` (the weights just synced)."""
        if self.stream is not None:
            self.stream.resume(version)

    @register(Dispatch.ALL)
    def stream_close(self) -> None:
        """Abort the stream's requests and stop its thread (a no-op without a stream)."""
        if self.agent_stream is not None:
            self.agent_stream.close()
            self.agent_stream = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded on first use."""
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    @register(Dispatch.ALL)
    def sleep(self) -> None:
        """Free the engine's KV cache (and offload weights) while training runs; a no-op on CPU."""
        if self.backend == "vllm":
            self.llm.sleep(level=1)

    @register(Dispatch.ALL)
    def wake_up(self) -> None:
        """Re-allocate what ``sleep`` freed before the next rollout; a no-op on CPU."""
        if self.backend == "vllm":
            self.llm.wake_up()

    @register(Dispatch.ALL)
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors into the engine in place; returns how many were loaded.

        A call must carry whole fused groups (q, k and v of a layer; gate and up), as the
        engine fuses them on load. Tensors arrive in the trainer's precision and are cast to the
        engine's (fp32 weights into a bf16 engine).
        """
        named = [(n, t.to(self.dtype) if t.is_floating_point() and t.dtype != self.dtype else t) for n, t in named]
        if self.backend == "hf":
            missing = self.model.load_state_dict(dict(named), strict=False).unexpected_keys
            if missing:
                raise KeyError(f"unknown weight names for this model: {missing[:5]}")
            return len(named)

        return reload_weights(self.llm, named, self.tied)

    @register(Dispatch.RAW)
    def load_weight_slices(self, parts: list[tuple[int, object]]) -> int:
        """Fetch this rank's bucket slices ``(trainer tp rank, reference)`` from Ray's object
        store, join them into whole HF tensors and load them; returns how many were loaded.
        (Raw dispatch: each rank gets the list of the trainer ranks that feed it.)"""
        import time

        import ray

        start = time.perf_counter()
        slices = ray.get([ref for _, ref in parts])
        named = join_slices([(tp_rank, s) for (tp_rank, _), s in zip(parts, slices)])
        fetched = time.perf_counter()
        count = self.load_weights(sorted(named.items()))
        self.load_seconds["fetch_s"] += fetched - start
        self.load_seconds["load_s"] += time.perf_counter() - fetched
        return count

    @register(Dispatch.ALL)
    def take_load_seconds(self) -> dict[str, float]:
        """Return the seconds ``load_weight_slices`` spent fetching and joining slices
        (``fetch_s``) and in the engine's loader (``load_s``) since the last call, and reset them."""
        out, self.load_seconds = self.load_seconds, {"fetch_s": 0.0, "load_s": 0.0}
        return out

    @register(Dispatch.ALL)
    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> int:
        """Install the actor's LoRA adapter (PEFT file names, whole tensors this rank may keep)
        in the engine in place of the previous one; generation then runs through it. Returns the
        number of layers it adapts."""
        layers = load_adapter(self.llm, tensors, config)
        self.adapter = True
        return layers

    @register(Dispatch.ALL)
    def fetch_adapter(self, boxed: list) -> int:
        """``load_adapter`` from ``[ObjectRef of (tensors, config)]``: each rank fetches the
        adapter from Ray's object store itself (boxed so that Ray passes the reference)."""
        import ray

        tensors, config = ray.get(boxed[0])
        return self.load_adapter(tensors, config)
