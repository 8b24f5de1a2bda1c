"""Agents and tools the agent tests name in their configs (``tests/agent_functions.py:NAME``).

They are loaded by file path on the rollout workers. An agent logs what the endpoint answered
to the file its sample's ``extra_info["log"]`` names, so the test can compare it with the
trajectories the trainer saw.
"""
from __future__ import annotations

import asyncio
import json
import time


async def two_calls(client, sample):
    """Ask, pass the answer through a tool turn, ask again; reward 1 when the second answer is right."""
    messages = list(sample["extra_info"]["messages"])
    first = await client.chat.completions.create(model="any-name", messages=messages, max_tokens=6)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    messages.append({"role": "tool", "content": f"the answer is {sample['ground_truth']}"})
    second = await client.chat.completions.create(model="policy", messages=messages)
    answer = second.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": answer})
    if sample["extra_info"].get("log"):
        with open(sample["extra_info"]["log"], "a") as log:
            calls = [{"prompt_token_ids": c.model_extra["prompt_token_ids"],
                      "token_ids": c.choices[0].model_extra["token_ids"]} for c in (first, second)]
            log.write(json.dumps({"messages": messages, "calls": calls}) + "\n")
    right = float(answer.strip() == str(sample["ground_truth"]))
    return {"reward": right, "acc": right, "tool_turns": 1}


async def two_calls_parity(client, sample):
    """The two_calls conversation, rewarded 1 when the token ids the model sampled first add up
    to an odd number: a reward that differs within a group of samples of one prompt."""
    messages = list(sample["extra_info"]["messages"])
    first = await client.chat.completions.create(model="any-name", messages=messages, max_tokens=6)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    messages.append({"role": "tool", "content": f"the answer is {sample['ground_truth']}"})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return float(sum(first.choices[0].model_extra["token_ids"]) % 2)


async def two_calls_pause(client, sample):
    """two_calls_parity with a tool that takes 0.3 s between the calls (so that weight syncs fall
    between a trajectory's turns when the rollout streams)."""
    messages = list(sample["extra_info"]["messages"])
    first = await client.chat.completions.create(model="any-name", messages=messages, max_tokens=6)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    await asyncio.sleep(0.3)
    messages.append({"role": "tool", "content": f"the answer is {sample['ground_truth']}"})
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return float(sum(first.choices[0].model_extra["token_ids"]) % 2)


async def fails_on_odd(client, sample):
    """Call the model once, then raise where the right answer is odd."""
    await client.chat.completions.create(model="policy", messages=sample["extra_info"]["messages"], max_tokens=2)
    if int(sample["ground_truth"]) % 2:
        raise RuntimeError("the agent's own bug")
    return 1.0


def broken(expression: str) -> str:
    """A tool that always raises.

    Args:
        expression: Anything.
    """
    raise ZeroDivisionError("division by zero in the tool")


def sleeps(seconds: float) -> str:
    """A tool that sleeps.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


class TwoRounds:
    """A text environment: any first answer earns 0.25 and is asked again; the second ends the
    episode and earns 1 more when it is the right answer."""

    def reset(self, sample):
        self.truth = str(sample["ground_truth"])
        return sample["extra_info"]["messages"][-1]["content"]

    async def step(self, text):
        if not hasattr(self, "asked"):
            self.asked = True
            return "Are you sure? Answer again.", 0.25, False
        return "", float(text.strip() == self.truth), True


def times_out_itself() -> str:
    """A tool that raises a TimeoutError of its own."""
    raise TimeoutError("the service did not answer")
