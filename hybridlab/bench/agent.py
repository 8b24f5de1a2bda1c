"""Agent rollouts: asynchronous trajectories against a turn-synchronous baseline, and the
OpenAI endpoint's cost against the raw engine.

The workload is fixed by a seed: each trajectory makes 1 to ``max_turns`` model calls of 4 to
``max_call_tokens`` tokens each (``ignore_eos``, so every mode generates exactly the same
number of tokens), and between calls waits on a simulated tool of ``latency_ms`` plus or minus
``jitter_ms`` (uniform). Five modes run the same workload side by side on one engine:

- ``async``: the agent is an OpenAI-SDK function on the loopback endpoint (``rollout.agent``);
  ``in_flight`` trajectories run at once, each continuing as soon as its own tool answers;
- ``lockstep``: the baseline of turn-synchronous multi-turn rollouts, on the same agent and
  endpoint: waves of ``in_flight`` trajectories; each turn's calls are held until every live
  trajectory of the wave has made its own and then generated together, so the next turn
  waits for the turn's slowest tool;
- ``lockstep_raw``: the same waves on precomputed token ids straight to the engine (no SDK,
  no endpoint): what the baseline costs without the agent's per-call work;
- ``async_no_latency`` and ``raw_no_latency``: the same calls without tool latency, through the
  endpoint and straight to the engine (precomputed token ids, no HTTP, no chat template): the
  endpoint's overhead against raw vLLM for the same tokens.

``engine="inprocess"`` (the default) is the rollout worker's engine, a ``vllm.LLM`` in this
process stepped from the event loop (``agents.engine``); ``engine="asyncllm"`` is vLLM's
``AsyncLLM``, whose engine core runs in a process of its own: the alternative the rollout does
not take (weights would have to be loaded into that process), measured on the same workload.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import os
import unittest.mock
import random
import time
import uuid
from typing import Any

from hybridlab.environment import describe, usable_cores

GOAL_SPEEDUP = 1.5
GOAL_OVERHEAD = 0.10
TOOL_TEXT = "ok"
ENGINES = ("inprocess", "asyncllm")
CONTEXT = 512  # each engine's context: the longest trajectory the options allow must fit


def check_options(trajectories: int, in_flight: int, max_turns: int, max_call_tokens: int, latency_ms: float,
                  jitter_ms: float, engine: str = "inprocess") -> None:
    """Raise UserError naming the first impossible option."""
    from hybridlab.errors import UserError

    for name, value, low in (("trajectories", trajectories, 1), ("in_flight", in_flight, 1),
                             ("max_turns", max_turns, 1), ("max_call_tokens", max_call_tokens, 4)):
        if not isinstance(value, int) or value < low:
            raise UserError(f"benchmark agent: {name} must be an integer of at least {low}, got {value!r}")
    if not 0 <= jitter_ms <= latency_ms:
        raise UserError(f"benchmark agent: need 0 <= jitter_ms <= latency_ms, got jitter_ms={jitter_ms},"
                        f" latency_ms={latency_ms}")
    if engine not in ENGINES:
        raise UserError(f"benchmark agent: engine must be one of {', '.join(ENGINES)}, got {engine!r}")


def make_plans(trajectories: int, max_turns: int, max_call_tokens: int, latency_ms: float, jitter_ms: float,
               seed: int) -> list[list[tuple[int, float]]]:
    """Return per trajectory its calls: (tokens, tool seconds after the call)."""
    rng = random.Random(seed)
    return [[(rng.randint(4, max_call_tokens), max(0.0, (latency_ms + rng.uniform(-jitter_ms, jitter_ms)) / 1000))
             for _ in range(rng.randint(1, max_turns))] for _ in range(trajectories)]


async def planned_agent(client: Any, sample: dict) -> float:
    """The benchmark's agent: call the model as its plan says, a simulated tool between calls."""
    messages = [{"role": "user", "content": sample["prompt"]}]
    for tokens, wait in sample["extra_info"]["plan"]:
        reply = await client.chat.completions.create(model="bench", messages=messages, max_tokens=tokens)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        if wait:
            await asyncio.sleep(wait)
        messages.append({"role": "tool", "content": TOOL_TEXT})
    return 1.0


def _samples(plans: list, prompt: str, latency: bool) -> list[dict]:
    return [{"prompt": prompt, "messages": [{"role": "user", "content": prompt}], "prompt_ids": [],
             "ground_truth": None, "data_source": "bench",
             "extra_info": {"plan": [(t, w if latency else 0.0) for t, w in plan]}} for plan in plans]


class AsyncLLMAdapter:
    """``await engine.generate(ids, params)`` on vLLM's ``AsyncLLM`` (one final output per call)."""

    def __init__(self, llm: Any):
        self.llm, self.ids = llm, itertools.count()
        self.prefix = f"bench-{uuid.uuid4().hex[:8]}-"

    async def generate(self, prompt_ids: list[int], params: Any) -> Sampled:
        """Return the sampled ids and their log-probs."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from hybridlab.agents.engine import Sampled
        from hybridlab.workers.rollout.vllm_engine import sampled_logprobs

        params.output_kind = RequestOutputKind.FINAL_ONLY
        out = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                           f"{self.prefix}{next(self.ids)}"):
            pass
        return Sampled(*sampled_logprobs(out.outputs[0]))


class LockstepEngine:
    """The turn-synchronous baseline's engine: ``generate`` holds each call until every live
    trajectory of the wave has made its call of the turn (``calls_per_turn``, from the plans),
    then hands the turn's calls to ``engine`` together, which batches them (``batches``: the
    size of each batch released)."""

    def __init__(self, engine: Any, calls_per_turn: list[int]):
        self.engine, self.calls_per_turn, self.turn = engine, calls_per_turn, 0
        self.held: list[tuple[list[int], Any, asyncio.Future]] = []
        self.batches: list[int] = []

    async def generate(self, prompt_ids: list[int], params: Any) -> Sampled:
        """Return the sampled ids and their log-probs once the turn's batch has run."""
        future = asyncio.get_running_loop().create_future()
        self.held.append((prompt_ids, params, future))
        if len(self.held) == self.calls_per_turn[self.turn]:
            batch, self.held, self.turn = self.held, [], self.turn + 1
            self.batches.append(len(batch))
            try:
                results = await asyncio.gather(*(self.engine.generate(ids, p) for ids, p, _ in batch))
            except BaseException as exc:  # every held call fails (or is cancelled) with the batch: none waits
                for _, _, waiting in batch:
                    if not waiting.done():
                        waiting.cancel() if isinstance(exc, asyncio.CancelledError) else waiting.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                for (_, _, waiting), result in zip(batch, results):
                    waiting.set_result(result)
        return await future


class Workload:
    """The plans and what every mode needs to run them on one engine (``engine.generate``, set
    once the engine runs)."""

    def __init__(self, tokenizer: Any, params, plans: list, prompt: str, in_flight: int):
        from hybridlab.agents.tool_loop import AgentLimits

        self.engine: Any = None
        self.processes: list[str] = []  # the vLLM processes the engine runs in besides this one
        self.tokenizer, self.params, self.plans = tokenizer, params, plans
        self.prompt, self.in_flight = prompt, in_flight
        self.prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=True)["input_ids"]
        self.context = _context_ids(tokenizer)
        self.limits = AgentLimits(max_turns=64, max_tokens=10_000, budget=10_000, tool_timeout_s=0.0,
                                  context=CONTEXT)
        self.lockstep_batches: list[int] = []

    async def run_agents(self, plans: list, latency: bool, engine: Any = None) -> int:
        """Run the planned agent on ``plans`` through the endpoint; returns the model tokens generated."""
        from hybridlab.agents.rollout import AgentSpec, TrajectoryRunner, run_all
        from hybridlab.agents.tool_loop import ChatClient

        engine = engine or self.engine
        make_client = lambda i: ChatClient(engine, self.tokenizer, self.params, self.limits, 0, None, [])
        runner = TrajectoryRunner(AgentSpec(agent=planned_agent), make_client, self.limits, self.in_flight)
        trajectories = await run_all(runner, _samples(plans, self.prompt, latency), 1)
        errors = [t.error for t in trajectories if t.error]
        if errors:
            raise RuntimeError(f"the benchmark agent failed: {errors[0]}")
        return sum(sum(t.response_mask()) for t in trajectories)

    async def lockstep(self) -> int:
        """The baseline: the agent in waves of ``in_flight``, one turn at a time; returns tokens."""
        generated = 0
        for wave in self._waves():
            calls_per_turn = [sum(len(p) > turn for p in wave) for turn in range(max(map(len, wave)))]
            engine = LockstepEngine(self.engine, calls_per_turn)
            generated += await self.run_agents(wave, True, engine)
            self.lockstep_batches += engine.batches
        return generated

    async def lockstep_raw(self) -> int:
        """The baseline's waves on precomputed ids, waiting as ``lockstep`` does: a turn for the
        tools of the trajectories that go on, the wave's end for every last tool; returns tokens."""
        generated, loop = 0, asyncio.get_running_loop()
        for wave in self._waves():
            ids, ends = [list(self.prompt_ids) for _ in wave], [0.0]
            for turn in range(max(map(len, wave))):
                live = [i for i, p in enumerate(wave) if len(p) > turn]
                outs = await asyncio.gather(*(self.engine.generate(ids[i], self.params(wave[i][turn][0], None))
                                              for i in live))
                for i, out in zip(live, outs):
                    sampled = out.ids
                    ids[i] += sampled + self.context
                    generated += len(sampled)
                ends += [loop.time() + wave[i][turn][1] for i in live if len(wave[i]) == turn + 1]
                await asyncio.sleep(max([wave[i][turn][1] for i in live if len(wave[i]) > turn + 1], default=0))
            await asyncio.sleep(max(ends) - loop.time())  # the last tools, slept beside the later turns
        return generated

    async def raw_calls(self) -> int:
        """The agent's calls straight to the engine, ``in_flight`` at once, no latency; returns tokens."""
        generated, slots = [], asyncio.Semaphore(self.in_flight)

        async def one(plan: list) -> None:
            async with slots:
                ids = list(self.prompt_ids)
                for tokens, _ in plan:
                    sampled = (await self.engine.generate(ids, self.params(tokens, None))).ids
                    ids += sampled + self.context
                    generated.append(len(sampled))

        await asyncio.gather(*(one(p) for p in self.plans))
        return sum(generated)

    def _waves(self) -> list[list]:
        return [self.plans[i:i + self.in_flight] for i in range(0, len(self.plans), self.in_flight)]


def _context_ids(tokenizer: Any) -> list[int]:
    """The ids the endpoint adds after a model turn that ended without its end-of-turn token
    (``ignore_eos``): the template's end-of-turn markers and the tool's turn."""
    from hybridlab.agents.conversation import Conversation

    conversation = Conversation(tokenizer)
    first = [{"role": "user", "content": "x"}]
    prompt = conversation.prompt(first)
    reply = tokenizer.encode("x", add_special_tokens=False)
    text = conversation.record_reply(reply, [0.0] * len(reply), 0)
    ids = conversation.prompt([*first, {"role": "assistant", "content": text}, {"role": "tool", "content": TOOL_TEXT}])
    return ids[len(prompt) + len(reply):]


async def _timed(run) -> tuple[float, int]:
    start = time.perf_counter()
    generated = await run
    return time.perf_counter() - start, generated


async def measure(work: Workload) -> dict[str, tuple[float, int]]:
    """Return each mode's (seconds, model tokens generated), after a warm-up of one wave."""
    await work.run_agents(work.plans[:work.in_flight], False)
    return {"async": await _timed(work.run_agents(work.plans, True)),
            "lockstep": await _timed(work.lockstep()),
            "lockstep_raw": await _timed(work.lockstep_raw()),
            "async_no_latency": await _timed(work.run_agents(work.plans, False)),
            "raw_no_latency": await _timed(work.raw_calls())}


def engine_processes() -> list[str]:
    """Return the titles of this process's vLLM child processes (``VLLM::EngineCore``, ...)."""
    import psutil

    names = []
    for child in psutil.Process().children(recursive=True):
        try:
            names.append(child.name())
        except psutil.Error:  # gone meanwhile
            continue
    return sorted(n for n in names if n.startswith("VLLM::"))


async def _measure_on_asyncllm(path: str, seed: int, work: "Workload") -> dict[str, tuple[float, int]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    # Set up as start_llm sets up the in-process engine: no prefix caching, no stats logging, and on
    # the CPU vLLM's compiled helpers run as Python (in the engine core: it inherits the environment).
    # vLLM's own executor on the CPU, whatever an in-process engine set here before: the model in a
    # process of its own ("OMP requires the MP executor", vllm/platforms/cpu.py).
    values = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if current_platform.is_cpu():
        values["TORCHDYNAMO_DISABLE"] = "1"
    with unittest.mock.patch.dict(os.environ, values):  # until the engine's processes have started
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=path, dtype="float32", max_model_len=CONTEXT, kv_cache_memory_bytes=256 << 20, enforce_eager=True,
            seed=seed, logprobs_mode="processed_logprobs", enable_prefix_caching=False, disable_log_stats=True))
    try:
        work.engine = AsyncLLMAdapter(llm)
        measured = await measure(work)
        work.processes = engine_processes()  # while the engine still runs
        return measured
    finally:
        llm.shutdown()
        work.engine = None
        del llm  # now: its __del__ shuts down again, which fails once the interpreter is exiting
        gc.collect()


def _measure_in_process(path: str, seed: int, work: "Workload") -> dict[str, tuple[float, int]]:
    from hybridlab.agents.engine import AsyncEngine
    from hybridlab.workers.rollout.vllm_engine import close_llm, start_llm

    llm = start_llm(path, CONTEXT, 256, "float32", seed)
    try:
        work.engine = AsyncEngine(llm)
        measured = asyncio.run(measure(work))
        work.processes = engine_processes()
        return measured
    finally:
        close_llm(llm)


def run(model: str = "small", trajectories: int = 128, in_flight: int = 32, max_turns: int = 4,
        max_call_tokens: int = 24, latency_ms: float = 50.0, jitter_ms: float = 25.0, seed: int = 0,
        engine: str = "inprocess") -> dict:
    """Return trajectories/s and tokens/s of the asynchronous agent rollout and the lock-step
    baseline (``speedup``), and the endpoint's ``overhead`` against the raw engine."""
    from transformers import AutoTokenizer

    from hybridlab.errors import UserError
    from hybridlab.models.zoo import resolve_model
    from hybridlab.workers.rollout.sampling import SamplingConfig
    from hybridlab.workers.rollout.vllm_engine import sampling_params

    check_options(trajectories, in_flight, max_turns, max_call_tokens, latency_ms, jitter_ms, engine)
    path = str(resolve_model(model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    plans = make_plans(trajectories, max_turns, max_call_tokens, latency_ms, jitter_ms, seed)
    tokens = sum(t for plan in plans for t, _ in plan)
    cfg = SamplingConfig(temperature=1.0, ignore_eos=True)
    params = lambda max_tokens, call_seed: sampling_params(cfg, [], n=1, max_tokens=max_tokens, seed=call_seed)
    work = Workload(tokenizer, params, plans, "12+34=", in_flight)
    longest = len(work.prompt_ids) + max(sum(t + len(work.context) for t, _ in plan) for plan in plans)
    if longest > CONTEXT:  # a call with no room left would never reach the engine
        raise UserError(f"benchmark agent: with max_turns={max_turns} and max_call_tokens={max_call_tokens} a planned"
                        f" trajectory reaches {longest} tokens, past the engine's context of {CONTEXT}; lower either")
    if engine == "asyncllm":
        measured = asyncio.run(_measure_on_asyncllm(path, seed, work))
    else:
        measured = _measure_in_process(path, seed, work)
    seconds = {mode: round(s, 4) for mode, (s, _) in measured.items()}  # the ratios are of the reported figures
    rates = {mode: {"trajectories_per_s": round(trajectories / seconds[mode], 2),
                    "tokens_per_s": round(tokens / seconds[mode], 1), "seconds": seconds[mode],
                    "tokens_generated": generated} for mode, (_, generated) in measured.items()}
    speedup = seconds["lockstep"] / seconds["async"]
    overhead = seconds["async_no_latency"] / seconds["raw_no_latency"] - 1
    calls = sum(len(p) for p in plans)
    return {"benchmark": "agent", "processor": describe()["processor"], "threads": usable_cores(), "model": model,
            "engine": engine, "engine_processes": work.processes, "trajectories": trajectories,
            "in_flight": in_flight, "model_calls": calls,
            "model_tokens": tokens, "latency_ms": latency_ms, "jitter_ms": jitter_ms, "modes": rates,
            "trajectories_per_s": rates["async"]["trajectories_per_s"], "tokens_per_s": rates["async"]["tokens_per_s"],
            "baseline_trajectories_per_s": rates["lockstep"]["trajectories_per_s"],
            "baseline_tokens_per_s": rates["lockstep"]["tokens_per_s"], "speedup": round(speedup, 3),
            "endpoint_overhead": round(overhead, 4), "lockstep_batches": work.lockstep_batches,
            # the wall time the endpoint adds, over the model calls (in_flight of them at once), in ms
            "endpoint_extra_ms_per_call": round(1000 * (seconds["async_no_latency"] - seconds["raw_no_latency"])
                                                / calls, 2),
            "goal": {"speedup": GOAL_SPEEDUP, "endpoint_overhead": GOAL_OVERHEAD},
            "goal_met": speedup >= GOAL_SPEEDUP and overhead <= GOAL_OVERHEAD}
