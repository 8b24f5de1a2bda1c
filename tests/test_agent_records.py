"""Agentic rollouts without an engine: tools (schemas, Hermes calls, calls that never raise), an
agent function's contract, the token-exact conversation record, the multi-turn layout, the agent
settings' checks and the calc task. The rollouts on real vLLM, Megatron and Ray: test_agents.py."""
from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch

from hybridlab.agents.conversation import Conversation
from hybridlab.agents.rollout import agent_result, check_agent_function
from hybridlab.agents.tools import Tool, call_tool, load_tools, parse_tool_calls
from hybridlab.agents.traces import model_turns
from hybridlab.agents.trajectory import MODEL, TOOL, Trajectory, trajectories_batch
from hybridlab.batching import on_last_token
from hybridlab.errors import UserError

AGENTS = Path(__file__).with_name("agent_functions.py")
ENVS = Path(__file__).with_name("openenv_envs.py")

# ------------------------------------------------------------------ tools
def test_a_tool_schema_comes_from_the_signature_and_docstring():
    tools = load_tools(f"{AGENTS}:broken,{AGENTS}:sleeps")
    assert list(tools) == ["broken", "sleeps"]
    assert tools["sleeps"].schema["function"]["parameters"] == {
        "type": "object", "properties": {"seconds": {"type": "number", "description": "How long to sleep."}},
        "required": ["seconds"]}


def test_a_tool_without_a_documented_argument_is_refused_naming_the_setting():
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(UserError, match=r"rollout.tools: cannot read a tool schema from 'undocumented'"):
        Tool.from_function(undocumented)
    with pytest.raises(UserError, match=r"rollout.tools: .*agent_functions.py' has no function 'nothing'"):
        load_tools(f"{AGENTS}:nothing")
    with pytest.raises(UserError, match="rollout.tools: two tools are named 'broken'"):
        load_tools(f"{AGENTS}:broken,{AGENTS}:broken")


def test_tool_calls_are_parsed_in_the_hermes_format_and_malformed_ones_named():
    text = ('<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>'
            '<tool_call>{"name": calc}</tool_call><tool_call>[1]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [{"name": "calc", "arguments": {"expression": "2*3"}},
                         {"name": "calc", "arguments": {"expression": "4"}}]
    assert calls[2].startswith("error: the tool call is not valid JSON")
    assert calls[3] == 'error: a tool call must be a JSON object {"name": ..., "arguments": {...}}'
    assert parse_tool_calls("no call here") == []


def test_a_raising_a_hanging_and_an_unknown_tool_answer_the_model_and_never_raise():
    tools = load_tools(f"{AGENTS}:broken,{AGENTS}:sleeps,{AGENTS}:times_out_itself")

    async def calls():
        return await asyncio.gather(
            call_tool(tools, {"name": "broken", "arguments": {"expression": "1/0"}}, 1.0),
            call_tool(tools, {"name": "sleeps", "arguments": {"seconds": 30}}, 0.3),
            call_tool(tools, {"name": "sleeps", "arguments": {"seconds": 0}}, 0.3),
            call_tool(tools, {"name": "search", "arguments": {}}, 1.0),
            call_tool(tools, {"name": "sleeps", "arguments": {"wrong": 1}}, 1.0),
            call_tool(tools, "error: the tool call is not valid JSON", 1.0),
            call_tool(tools, {"name": "times_out_itself", "arguments": {}}, 5.0))

    start = time.perf_counter()
    broken, hung, slept, unknown, bad_args, malformed, own_timeout = asyncio.run(calls())
    assert time.perf_counter() - start < 15  # the 30 s call was cut off at its 0.3 s timeout, not waited for
    assert (broken.content, broken.error, broken.timed_out) == (
        "error: ZeroDivisionError: division by zero in the tool", True, False)
    assert (hung.content, hung.error, hung.timed_out) == ("error: sleeps timed out after 0.3 s", True, True)
    assert (slept.content, slept.error) == ("awake", False)
    assert unknown.content == "error: no tool named 'search'; the tools are: broken, sleeps, times_out_itself"
    # a tool whose own TimeoutError is its answer, not the call's time limit
    assert (own_timeout.content, own_timeout.timed_out) == ("error: TimeoutError: the service did not answer", False)
    assert bad_args.error and "unexpected keyword argument 'wrong'" in bad_args.content
    assert malformed.error and malformed.content == "error: the tool call is not valid JSON"


def test_an_agent_function_must_be_async_and_return_a_reward():
    async def run(client, sample):
        return 1.0

    def sync(client, sample):
        return 1.0

    assert check_agent_function(run) is run
    with pytest.raises(UserError, match=r"rollout.agent: 'sync' must be an async function"):
        check_agent_function(sync)
    assert agent_result(0.5) == (0.5, {})
    assert agent_result({"reward": 1, "turns": 3, "note": "x"}) == (1.0, {"turns": 3.0})
    for bad, message in (({"score": 1}, "without 'reward'"), (None, "returned None"), (math.nan, "returned nan"),
                         (True, "returned True")):
        with pytest.raises(ValueError, match=message):
            agent_result(bad)


# ------------------------------------------------------------------ the token record
def test_a_conversation_records_sampled_ids_and_adds_only_the_new_text(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    conv = Conversation(tok)
    user = [{"role": "user", "content": "12+34="}]
    first = conv.prompt(user)
    assert first == tok(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False).input_ids
    sampled = tok("46", add_special_tokens=False).input_ids + [4]  # the turn ends with <|im_end|>, as sampled
    assert conv.record_reply(sampled, [-0.5] * len(sampled), version=3) == "46"
    messages = [*user, {"role": "assistant", "content": "46"}, {"role": "tool", "content": "checked"}]
    ids = conv.prompt(messages)
    whole = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False).input_ids
    assert ids == whole and conv.trajectory.retokenized == 0  # ChatML is prefix-stable
    t = conv.trajectory
    assert [s.source for s in t.segments] == [MODEL, TOOL] and t.segments[0].ids == sampled
    # A reply the template renders differently (it ended with </s>, the template writes <|im_end|>):
    # the sampled ids are kept and only the new message is added, counted as re-tokenized.
    conv2 = Conversation(tok)
    conv2.prompt(user)
    odd = tok("46", add_special_tokens=False).input_ids + [2]
    conv2.record_reply(odd, [0.0] * len(odd), version=0)
    ids2 = conv2.prompt(messages)
    assert ids2[:len(first) + len(odd)] == first + odd and conv2.trajectory.retokenized == 1
    assert tok.decode(ids2[len(first) + len(odd):]).endswith("<|im_start|>tool\nchecked<|im_end|>\n"
                                                               "<|im_start|>assistant\n")


THINKING_LAST = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.last %}"
                 "<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_earlier_turns_keeps_the_new_messages_whole(tiny_dir):
    """Like Qwen3's, this template writes a reasoning block on the last assistant turn only, so a
    rendering after a base conversation does not extend the base: the new messages come alone."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = THINKING_LAST
    conv = Conversation(tok)
    user = [{"role": "user", "content": "12+34="}]
    conv.prompt(user)
    conv.record_reply(tok("46", add_special_tokens=False).input_ids + [2], [0.0] * 3, version=0)
    # an agent that trimmed its history: only the tool message after its last assistant message is new
    ids = conv.prompt([{"role": "assistant", "content": "46"}, {"role": "tool", "content": "408"}])
    added = tok.decode(ids[len(conv.trajectory.prompt_ids) + 3:])
    assert added == "<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n" and conv.trajectory.retokenized == 1


def test_a_trajectory_trains_only_the_models_tokens_and_its_reward_lands_on_its_last_one():
    t = Trajectory([7, 8, 9])
    t.add_model([10, 11], [-0.1, -0.2], version=1)
    t.add_context([12, 13, 14], TOOL)
    t.add_model([15], [-0.3], version=2)
    t.add_context([16], TOOL)
    b = trajectories_batch([t, Trajectory([5], [])], pad_id=0, response_len=8)
    assert b["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 1, 0, 0]
    assert b["attention_mask"][0].tolist() == [1] * 10 + [0]  # prompt, then every token after it
    assert b["rollout_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.3, 0, 0])
    assert b["rollout_versions"][0].tolist() == [1, 1, -1, -1, -1, 2, -1, -1]
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    scores = on_last_token(torch.tensor([1.0, 2.0]), b["response_mask"])
    assert scores[0].tolist() == [0, 0, 0, 0, 0, 1.0, 0, 0] and scores[1].tolist() == [2.0] + [0] * 7
    t.truncate(4)
    assert t.response_ids() == [10, 11, 12, 13]


# ------------------------------------------------------------------ config checks, the calc task
@pytest.mark.parametrize("overrides, message", [
    ([f"rollout.tools={AGENTS}:broken", f"rollout.agent={AGENTS}:two_calls"],
     "rollout.tools, rollout.agent and rollout.env: set one"),
    ([f"rollout.env={AGENTS}:two_calls"], r"rollout.env: 'two_calls' must be a class with reset\(sample\)"),
    ([f"rollout.agent={AGENTS}:broken"], r"rollout.agent: 'broken' must be an async function"),
    ([f"rollout.env_adapter={ENVS}:Answer"], "rollout.env_adapter: adapts an OpenEnv environment; set rollout.env"),
    (["rollout.env=http://:8000"], r"rollout.env: 'http://:8000' is not a server URL \(http://HOST:PORT"),
    ([f"rollout.env={AGENTS}:TwoRounds", f"rollout.env_adapter={ENVS}:Answer"],
     "rollout.env_adapter: adapts OpenEnv environments; rollout.env names a text environment"),
    (["rollout.env=http://127.0.0.1:9", f"rollout.env_adapter={ENVS}:Answer"],
     r"rollout.env_adapter: '.*:Answer' must name a subclass of hybridlab.agents.openenv_env.OpenEnvAdapter"),
    ([f"rollout.tools={AGENTS}:missing"], r"rollout.tools: .* has no function 'missing'"),
    ([f"rollout.tools={AGENTS}:broken", "rollout.max_trajectory_tokens=4"],
     r"rollout.max_trajectory_tokens: must be at least 8, got 4 \(rollout.max_new_tokens: one model turn must fit\)"),
    ([f"rollout.tools={AGENTS}:broken", "rollout.backend=hf"], "agent rollouts run on the vllm backend at tp 1"),
    ([f"rollout.tools={AGENTS}:broken", "trainer.off_policy=true",
      "dataflow=[generate, reward, old_logprob, advantages, update_actor, sync_weights]"],
     "trainer.off_policy: the dataflow must start with 'generate_agent'"),
    (["data.task=calc", "data.chat=true"], r"data.task: 'calc' is a tool-use task; set rollout.tools=hybridlab"),
    (["data.task=calc", "rollout.tools=hybridlab.tasks.calc:calc"], "data.chat: 'calc' is a tool-use conversation"),
])
def test_agent_settings_are_checked_when_the_config_loads(overrides, message):
    from hybridlab.config import ConfigError
    from hybridlab.run_config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_calc_task_scores_the_reply_and_its_trace_trains_only_the_models_turns(tiny_dir):
    from transformers import AutoTokenizer

    from hybridlab.agents.traces import encode_trace
    from hybridlab.tasks import get_task
    from hybridlab.tasks.calc import calc

    task = get_task("calc")
    sample = task.split("train", 1)[0]
    a, b = sample.prompt.rstrip("=").split("*")
    assert sample.ground_truth == str(int(a) * int(b)) and 3 <= len(a) <= 4 and len(b) == 3
    assert calc(f"{a}*{b}") == sample.ground_truth and calc("2*(3+4)-5") == "9"
    with pytest.raises(ValueError, match="calc takes integers with \\+ - \\* only"):
        calc("__import__('os')")
    assert task.score(sample.ground_truth + "\n", sample.ground_truth) == 1.0 and task.score("12", "13") == 0.0
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids, mask = encode_trace(tok, task.trace(sample), end=4)
    turns = [tok.decode(ids[start:stop]) for start, stop in model_turns(mask)]
    assert turns == [f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{a}*{b}"}}}}</tool_call><|im_end|>',
                     f"{sample.ground_truth}<|im_end|>"]
    whole = tok.apply_chat_template(task.trace(sample), tokenize=False)
    assert tok.decode(ids) + "\n" == whole  # the zoo's ChatML renders the trace as the rollout records it
