"""Agent rollouts: asynchronous trajectories against a turn-synchronous baseline, and the
OpenAI endpoint's cost against the raw engine, on one in-process vLLM engine.

The workload is fixed by a seed: each trajectory makes 1 to ``max_turns`` model calls of 4 to
``max_call_tokens`` tokens each (``ignore_eos``, so every mode generates exactly the same
number of tokens), and between calls waits on a simulated tool of ``latency_ms`` plus or minus
``jitter_ms`` (uniform). Four modes run the same workload side by side:

- ``async``: the agent is an OpenAI-SDK function on the loopback endpoint (``rollout.agent``);
  ``in_flight`` trajectories run at once, each continuing as soon as its own tool answers;
- ``lockstep``: the baseline of turn-synchronous multi-turn rollouts: waves of ``in_flight``
  trajectories, each turn one batched ``LLM.generate`` for the wave's live trajectories, then
  every tool of the turn, waiting for the slowest;
- ``async_no_latency`` and ``raw_no_latency``: the same calls without tool latency, through the
  endpoint and straight to the engine (``AsyncEngine.generate`` on precomputed token ids, no
  HTTP, no chat template): the endpoint's overhead against raw vLLM for the same tokens.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from hybridlab.environment import describe, usable_cores

GOAL_SPEEDUP = 1.5
GOAL_OVERHEAD = 0.10
TOOL_TEXT = "ok"


def check_options(trajectories: int, in_flight: int, max_turns: int, max_call_tokens: int, latency_ms: float,
                  jitter_ms: float) -> None:
    """Raise UserError naming the first impossible option."""
    from hybridlab.errors import UserError

    for name, value, low in (("trajectories", trajectories, 1), ("in_flight", in_flight, 1),
                             ("max_turns", max_turns, 1), ("max_call_tokens", max_call_tokens, 4)):
        if not isinstance(value, int) or value < low:
            raise UserError(f"benchmark agent: {name} must be an integer of at least {low}, got {value!r}")
    if not 0 <= jitter_ms <= latency_ms:
        raise UserError(f"benchmark agent: need 0 <= jitter_ms <= latency_ms, got jitter_ms={jitter_ms},"
                        f" latency_ms={latency_ms}")


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


def run_async(llm: Any, tokenizer: Any, params, plans: list, prompt: str, in_flight: int,
              latency: bool) -> tuple[float, int]:
    """Return (seconds, model tokens generated) of the endpoint mode on the plans."""
    from hybridlab.agents.rollout import AgentSpec, run_agents
    from hybridlab.agents.tool_loop import AgentLimits

    limits = AgentLimits(max_turns=64, max_tokens=10_000, budget=10_000, tool_timeout_s=0.0,
                         context=llm.llm_engine.model_config.max_model_len)
    start = time.perf_counter()
    trajectories = run_agents(llm, tokenizer, _samples(plans, prompt, latency), 1, params,
                              AgentSpec(agent=planned_agent), limits, 0, None, in_flight)
    seconds = time.perf_counter() - start
    errors = [t.error for t in trajectories if t.error]
    if errors:
        raise RuntimeError(f"the benchmark agent failed: {errors[0]}")
    return seconds, sum(sum(t.response_mask()) for t in trajectories)


def _context_ids(tokenizer: Any) -> list[int]:
    """The ids a tool turn adds after a model turn (ChatML-like markers and the tool's text)."""
    from hybridlab.agents.conversation import Conversation

    conversation = Conversation(tokenizer)
    first = [{"role": "user", "content": "x"}]
    conversation.prompt(first)
    conversation.record_reply([tokenizer.eos_token_id], [0.0], 0)
    ids = conversation.prompt([*first, {"role": "assistant", "content": ""}, {"role": "tool", "content": TOOL_TEXT}])
    return ids[len(conversation.trajectory.prompt_ids) + 1:]


def run_raw(llm: Any, params, plans: list, prompt_ids: list[int], context: list[int],
            in_flight: int) -> tuple[float, int]:
    """Return (seconds, tokens generated) of the same calls straight on the engine, without latency."""
    from hybridlab.agents.engine import AsyncEngine

    generated = []

    async def main() -> None:
        engine, slots = AsyncEngine(llm), asyncio.Semaphore(in_flight)

        async def one(plan: list) -> None:
            async with slots:
                ids = list(prompt_ids)
                for tokens, _ in plan:
                    sampled, _ = await engine.generate(ids, params(tokens, None))
                    ids += sampled + context
                    generated.append(len(sampled))

        await asyncio.gather(*(one(p) for p in plans))

    start = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - start, sum(generated)


def run_lockstep(llm: Any, params, plans: list, prompt_ids: list[int], context: list[int],
                 in_flight: int) -> tuple[float, int]:
    """Return (seconds, tokens generated) of the turn-synchronous baseline on the plans."""
    from vllm.inputs import TokensPrompt

    generated = 0
    start = time.perf_counter()
    for first in range(0, len(plans), in_flight):
        wave = plans[first:first + in_flight]
        ids = [list(prompt_ids) for _ in wave]
        for turn in range(max(len(p) for p in wave)):
            live = [i for i, p in enumerate(wave) if len(p) > turn]
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids[i]) for i in live],
                                [params(wave[i][turn][0], None) for i in live], use_tqdm=False)
            for i, out in zip(live, outs):
                ids[i] += list(out.outputs[0].token_ids) + context
                generated += len(out.outputs[0].token_ids)
            time.sleep(max(wave[i][turn][1] for i in live))  # every tool of the turn, waiting for the slowest
    return time.perf_counter() - start, generated


def run(model: str = "small", trajectories: int = 128, in_flight: int = 32, max_turns: int = 4,
        max_call_tokens: int = 24, latency_ms: float = 50.0, jitter_ms: float = 25.0, seed: int = 0) -> dict:
    """Return trajectories/s and tokens/s of the asynchronous agent rollout and the lock-step
    baseline (``speedup``), and the endpoint's ``overhead`` against the raw engine."""
    from transformers import AutoTokenizer

    from hybridlab.models.zoo import resolve_model

    check_options(trajectories, in_flight, max_turns, max_call_tokens, latency_ms, jitter_ms)
    from hybridlab.workers.rollout.sampling import SamplingConfig
    from hybridlab.workers.rollout.vllm_engine import close_llm, sampling_params, start_llm

    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    plans = make_plans(trajectories, max_turns, max_call_tokens, latency_ms, jitter_ms, seed)
    tokens = sum(t for plan in plans for t, _ in plan)
    cfg = SamplingConfig(temperature=1.0, ignore_eos=True)
    params = lambda max_tokens, call_seed: sampling_params(cfg, [], n=1, max_tokens=max_tokens, seed=call_seed)
    prompt = "12+34="
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=True)["input_ids"]
    context = _context_ids(tokenizer)
    llm = start_llm(str(path), 512, 256, "float32", seed)
    try:
        run_async(llm, tokenizer, params, plans[:in_flight], prompt, in_flight, False)  # warm-up
        measured = {"async": run_async(llm, tokenizer, params, plans, prompt, in_flight, True),
                    "lockstep": run_lockstep(llm, params, plans, prompt_ids, context, in_flight),
                    "async_no_latency": run_async(llm, tokenizer, params, plans, prompt, in_flight, False),
                    "raw_no_latency": run_raw(llm, params, plans, prompt_ids, context, in_flight)}
    finally:
        close_llm(llm)
    seconds = {mode: round(s, 4) for mode, (s, _) in measured.items()}  # the ratios are of the reported figures
    rates = {mode: {"trajectories_per_s": round(trajectories / seconds[mode], 2),
                    "tokens_per_s": round(tokens / seconds[mode], 1), "seconds": seconds[mode],
                    "tokens_generated": generated} for mode, (_, generated) in measured.items()}
    speedup = seconds["lockstep"] / seconds["async"]
    overhead = seconds["async_no_latency"] / seconds["raw_no_latency"] - 1
    env = describe()
    return {"benchmark": "agent", "processor": env["processor"], "threads": usable_cores(), "model": model,
            "trajectories": trajectories, "in_flight": in_flight, "model_calls": sum(len(p) for p in plans),
            "model_tokens": tokens, "latency_ms": latency_ms, "jitter_ms": jitter_ms, "modes": rates,
            "trajectories_per_s": rates["async"]["trajectories_per_s"], "tokens_per_s": rates["async"]["tokens_per_s"],
            "baseline_trajectories_per_s": rates["lockstep"]["trajectories_per_s"],
            "baseline_tokens_per_s": rates["lockstep"]["tokens_per_s"], "speedup": round(speedup, 3),
            "endpoint_overhead": round(overhead, 4),
            # the wall time the endpoint adds, over the model calls (in_flight of them at once), in ms
            "endpoint_extra_ms_per_call": round(1000 * (seconds["async_no_latency"] - seconds["raw_no_latency"])
                                          / sum(len(p) for p in plans), 2),
            "goal": {"speedup": GOAL_SPEEDUP, "endpoint_overhead": GOAL_OVERHEAD},
            "goal_met": speedup >= GOAL_SPEEDUP and overhead <= GOAL_OVERHEAD}
