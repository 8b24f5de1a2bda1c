"""Agentic rollouts (hybridlab.agents): tools, the token-exact conversation record, the
OpenAI-compatible endpoint and GRPO on multi-turn trajectories, on real vLLM, Megatron and Ray."""
from __future__ import annotations

import asyncio
import json
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
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.errors import UserError
from openenv_envs import DroppingServer

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


# ------------------------------------------------------------------ GRPO on an OpenAI-SDK agent
AGENT_FLOW = "[generate_agent, agent_reward, old_logprob, advantages, update_actor, sync_weights]"


@pytest.fixture(scope="module")
def chat_trained_dir(tiny_dir, hybridlab_home):
    """tiny after a short SFT on addition in chat form (about 10 s): answers end their turn with
    <|im_end|>, as the template does, so conversations are prefix-stable."""
    from hybridlab import sft
    from hybridlab.atomic import built_once
    from hybridlab.evaluate import load_hf
    from hybridlab.tasks import get_task

    out = hybridlab_home / "fixtures" / "tiny-arith-chat"

    def train() -> None:
        model, tok = load_hf(tiny_dir)
        sft.train(model, tok, get_task("arith"), sft.SFTConfig(steps=300, warmup_steps=20, chat=True), progress=False)
        sft.save_checkpoint(model, tok, out)

    return built_once(out, train)


@pytest.fixture(scope="module")
def agent_rl(ray_local, chat_trained_dir, tmp_path_factory):
    """A GRPO session on one device whose rollouts are the two_calls agent; yields (session, log path)."""
    from hybridlab.dataflow.session import RLSession
    from hybridlab.tasks import get_task
    from hybridlab.tasks.dataset import write_rows

    root = tmp_path_factory.mktemp("agents")
    log = root / "calls.jsonl"
    rows = [{"prompt": [{"role": "user", "content": s.prompt}], "data_source": "arith",
             "reward_model": {"ground_truth": s.ground_truth},
             "extra_info": {"log": str(log), "env_reset": {"question": s.prompt, "answer": s.ground_truth}}}
            for s in get_task("arith").split("train", 16)]
    write_rows(rows, root / "train.jsonl")
    session = RLSession("grpo", [f"model={chat_trained_dir}", "warm_start.max_steps=0", "trainer.devices=1",
                                 f"data.train_files={root / 'train.jsonl'}", "data.prompts_per_step=4", "rollout.n=4",
                                 "rollout.max_new_tokens=8", f"rollout.agent={AGENTS}:two_calls",
                                 "rollout.max_trajectory_tokens=64", "actor.ppo_mini_batch_size=4",
                                 "actor.use_kl_loss=false", f"dataflow={AGENT_FLOW}", "trainer.progress=false",
                                 f"trainer.run_dir={root / 'run'}"])
    session.start()
    yield session, log
    session.shutdown()


def test_an_unchanged_openai_agent_trains_grpo_on_exact_multi_turn_tokens(agent_rl, chat_trained_dir):
    from transformers import AutoTokenizer

    rl, log = agent_rl
    tok = AutoTokenizer.from_pretrained(chat_trained_dir)
    first, second = rl.step(), rl.step()
    for result in (first, second):
        b, m = result.batch, result.metrics
        assert len(b) == 16 and math.isfinite(m["actor/pg_loss"])
        assert m["agent/turns_mean"] == 2.0 and m["agent/errors"] == 0
        assert m["agent/model_tokens"] == float(b["response_mask"].sum())
        # Mask 1 on exactly the model's tokens: the rollout's log-probs there are the actor's after the sync
        # (vLLM's CPU attention and Megatron's sum in different orders: the single-turn bound, test_rl's 1e-4).
        gap = (b["old_log_probs"] - b["rollout_log_probs"])[b["response_mask"].bool()].abs()
        assert gap.max() < 1e-4 and gap.mean() < 1e-5
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 32
    rows = {}
    b = second.batch
    width = b["prompts"].shape[1]
    for i in range(len(b)):
        ids = b["input_ids"][i][b["attention_mask"][i].bool()].tolist()
        rows[tuple(ids)] = b["response_mask"][i][:len(ids) - int(b["attention_mask"][i, :width].sum())].tolist()
    stable = 0
    for record in calls[16:]:
        one, two = record["calls"]
        whole = two["prompt_token_ids"] + two["token_ids"]
        # the trajectory the trainer saw is the ids the endpoint continued and sampled, nothing re-tokenized
        assert tuple(whole) in rows
        first_call = one["prompt_token_ids"] + one["token_ids"]
        assert whole[:len(first_call)] == first_call
        mask = rows[tuple(whole)]
        start = len(one["prompt_token_ids"])
        expected = [1] * len(one["token_ids"]) + [0] * (len(two["prompt_token_ids"]) - start - len(one["token_ids"]))
        assert mask == expected + [1] * len(two["token_ids"])
        rendered = tok.apply_chat_template(record["messages"], tokenize=False)
        # each turn's text (as the endpoint answers it) tokenizes back to what was sampled: no special token
        # inside it, and split as the tokenizer splits it (BPE may merge otherwise)
        canonical = all(tok(tok.decode(t["token_ids"][:-1], skip_special_tokens=True),
                            add_special_tokens=False).input_ids == t["token_ids"][:-1] for t in (one, two))
        if canonical and one["token_ids"][-1] != 2 and two["token_ids"][-1] == 4:  # turns end as the template ends them
            stable += 1
            assert tok(rendered, add_special_tokens=False).input_ids == whole + tok("\n").input_ids
    print(f"{stable} of 16 conversations prefix-stable")
    # the trajectory inspector: every token by source, the model's with their log-prob and version
    from hybridlab.notebook.trajectories import token_rows

    view = rl.inspect(second)
    assert view.rows and view.trajectories.pick.value == 0
    tokens = token_rows(b, 0, tok)
    sources = [t["source"] for t in tokens]
    assert sources.count("model") == int(b["response_mask"][0].sum()) and sources.count("tool") > 0
    assert {t["version"] for t in tokens if t["source"] == "model"} == {1}  # step 2 sampled after one update
    assert view.trajectories.view.value.count("class='tok-model'") == sources.count("model")
    assert "".join(t["text"] for t in tokens) == tok.decode(b["input_ids"][0][b["attention_mask"][0].bool()])
    assert stable >= 8  # the chat warm start ends its turns with <|im_end|>
    # A first turn that ended with </s> (the template writes <|im_end|>) makes the second call re-tokenized.
    ended_with_eos = sum(record["calls"][0]["token_ids"][-1] == 2 for record in calls[16:])
    assert second.metrics["agent/retokenized_share"] == ended_with_eos / 32


def test_the_agents_grpo_update_follows_its_rewards_and_moves_the_weights(agent_rl):
    """GRPO on multi-turn trajectories whose reward differs within a group (the parity of the first
    call's sampled ids): the step's advantages are GRPO's on its rewards and groups, and the actor's
    weights move (the two_calls agent's answers, told the sum by the tool, are all right: no difference)."""
    import hybridlab.algos as A
    from tests.test_remap import actor_state

    rl, _ = agent_rl
    rl.update(f"rollout.agent={AGENTS}:two_calls_parity")
    try:
        weights = actor_state(rl)
        for _ in range(4):  # which seeded step first draws a difference depends on the steps before
            result = rl.step()
            if result.batch["advantages"].abs().sum() > 0:
                break
        moved = actor_state(rl)
    finally:
        rl.update(f"rollout.agent={AGENTS}:two_calls")
    b = result.batch
    rewards = b["token_level_scores"].sum(-1)
    assert set(rewards.tolist()) == {0.0, 1.0} and result.metrics["agent/turns_mean"] == 2.0
    expected, _ = A.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"].float(), b["uid"])
    assert expected.abs().sum() > 0 and torch.allclose(b["advantages"], expected, atol=1e-5)
    assert any(not torch.equal(weights[k], moved[k]) for k in weights if k.startswith("model/"))


def test_a_raising_agent_scores_error_score_is_counted_and_warned_once(agent_rl):
    rl, _ = agent_rl
    rl.update(f"rollout.agent={AGENTS}:fails_on_odd", "reward.error_score=-1")
    try:
        with pytest.warns(RuntimeWarning, match=r"the agent function failed on \d+ of 16 trajectories .*first:"
                                                 r" RuntimeError: the agent's own bug"):
            first = rl.step()
        b = first.batch
        odd = torch.tensor([int(t) % 2 == 1 for t in b["ground_truth"]])
        assert odd.any() and not odd.all()
        assert first.metrics["agent/errors"] == float(odd.sum())
        assert b["token_level_scores"].sum(-1).tolist() == [-1.0 if o else 1.0 for o in odd.tolist()]
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # counted every step, warned once
            second = rl.step()
        odd = [int(t) % 2 == 1 for t in second.batch["ground_truth"]]
        assert second.metrics["agent/errors"] == float(sum(odd)) > 0
    finally:
        rl.update(f"rollout.agent={AGENTS}:two_calls", "reward.error_score=0.0")


def test_a_text_environment_answers_each_turn_and_its_rewards_add_up(agent_rl):
    rl, _ = agent_rl
    rl.update("rollout.agent=null", f"rollout.env={AGENTS}:TwoRounds")
    try:
        result = rl.step()
    finally:
        rl.update("rollout.env=null", f"rollout.agent={AGENTS}:two_calls")
    b, m = result.batch, result.metrics
    assert m["agent/turns_mean"] == 2.0 and m["agent/errors"] == 0 and m["agent/tool_tokens"] > 0
    right = torch.tensor([f.strip() == t for f, t in zip(b["final_response"], b["ground_truth"])]).float()
    assert b["token_level_scores"].sum(-1).tolist() == pytest.approx((0.25 + right).tolist())
    # the environment's question between the turns is context: two runs of model tokens per row
    for row in b["response_mask"].tolist():
        assert len(model_turns(row)) == 2


def test_an_openenv_environment_served_here_trains_grpo_with_the_models_tokens_masked(agent_rl, chat_trained_dir):
    from transformers import AutoTokenizer

    rl, _ = agent_rl
    tok = AutoTokenizer.from_pretrained(chat_trained_dir)
    rl.update("rollout.agent=null", f"rollout.env={ENVS}:TwoTries")
    try:
        results = [rl.step(), rl.step()]
    finally:
        rl.update("rollout.env=null", f"rollout.agent={AGENTS}:two_calls")
    for result in results:
        b, m = result.batch, result.metrics
        assert m["agent/turns_mean"] == 2.0 and m["agent/errors"] == 0 and math.isfinite(m["actor/pg_loss"])
        # the first observation has no reward (0); the second answer earns 0.5, or 1 when it is right
        right = [1.0 if f.strip() == t else 0.5 for f, t in zip(b["final_response"], b["ground_truth"])]
        assert b["token_level_scores"].sum(-1).tolist() == right
        for ids, mask in zip(b["responses"].tolist(), b["response_mask"].tolist()):
            (s1, e1), (s2, e2) = model_turns(mask)  # two model turns; the environment's question between
            between = tok.decode(ids[e1:s2])
            assert "Are you sure? Answer again." in between and "Are you sure" not in tok.decode(ids[s1:e1] + ids[s2:e2])


def test_a_hanging_and_a_dropping_openenv_server_score_error_score_and_the_run_goes_on(agent_rl):
    rl, _ = agent_rl
    dropping = DroppingServer()
    rl.update("rollout.agent=null", f"rollout.env={ENVS}:HangsOnOdd", "rollout.agent_timeout_s=2")
    try:
        start = time.perf_counter()
        hung = rl.step()
        hang_s = time.perf_counter() - start
        rl.update(f"rollout.env={dropping.url}")
        dropped = rl.step()
        rl.update(f"rollout.env={ENVS}:OneSession")  # one session at a time: the group's episodes queue
        after = rl.step()
    finally:
        rl.update("rollout.env=null", f"rollout.agent={AGENTS}:two_calls", "rollout.agent_timeout_s=300")
        dropping.close()
    odd = [int(t) % 2 == 1 for t in hung.batch["ground_truth"]]
    assert hung.batch["agent_error"].bool().tolist() == odd and hung.metrics["agent/errors"] == sum(odd) > 0
    scores = hung.batch["token_level_scores"].sum(-1).tolist()
    assert [s for s, o in zip(scores, odd) if o] == [0.0] * sum(odd)  # reward.error_score
    assert min(s for s, o in zip(scores, odd) if not o) >= 0.5
    assert hang_s < 60  # the hanging episodes cost their 2 s limit, not the environment's hour
    assert all("rollout.agent_timeout_s=2" in m for m, o in zip(hung.batch["agent_error_msg"], odd) if o)
    assert dropped.metrics["agent/errors"] == len(dropped.batch)
    assert all(m.startswith("ConnectionClosedError") for m in dropped.batch["agent_error_msg"])
    assert after.metrics["agent/errors"] == 0 and after.metrics["agent/turns_mean"] == 2.0


def test_off_policy_agent_rollouts_are_generated_a_step_ahead_and_carry_the_version_that_sampled_them(agent_rl):
    rl, _ = agent_rl
    rl.update("trainer.off_policy=true")
    try:
        before = rl.state.rollout_version  # the updates the engine's weights have had
        first, second = rl.step(), rl.step()  # the second step's trajectories were submitted during the first
    finally:
        rl.update("trainer.off_policy=false")
    for result, staleness in ((first, 0), (second, 1)):
        b, m = result.batch, result.metrics
        assert m["rollout/staleness"] == staleness and m["agent/turns_mean"] == 2.0 and m["agent/errors"] == 0
        assert math.isfinite(m["actor/pg_loss"])
        # every model token was sampled by the weights of step `before` (version = updates applied),
        # context tokens carry no version
        versions = b["rollout_versions"][b["response_mask"].bool()]
        assert set(versions.tolist()) == {before}
        assert set(b["rollout_versions"][~b["response_mask"].bool()].tolist()) == {-1}  # tool turns, padding
    assert not set(first.batch["uid"]) & set(second.batch["uid"])  # the look-ahead took the next prompts
    assert rl.state.rollout_version == before + 2


SPLIT = {"pools": {"train": {"devices": 1}, "gen": {"devices": 2}},
         "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "gen", "dp": 2, "colocate": "g"},
                   "reward": {"pool": "gen", "dp": 2, "colocate": "g"}}}


def test_streamed_agent_trajectories_span_weight_syncs_with_exact_masks(agent_rl):
    """Streaming (the rollout on processes of its own): each trajectory's model tokens record
    the version that sampled them, some trajectories have turns on both sides of a sync, the
    mask is 1 on exactly the model's tokens (each with the log-prob it was sampled with, which
    the correction reads), context tokens carry no version, and no prompt is trained twice."""
    from hybridlab.agents.trajectory import SOURCES

    rl, _ = agent_rl
    if rl.mapping != DeviceMapping.from_dict(SPLIT):
        rl.remap(SPLIT)  # the actor alone, two rollout engines beside it
    rl.update(f"rollout.agent={AGENTS}:two_calls_pause")
    rl.update("trainer.streaming=true")
    try:
        results = [(rl.state.actor_version, rl.step()) for _ in range(4)]
    finally:
        rl.update("trainer.streaming=false", f"rollout.agent={AGENTS}:two_calls")
    spanning, trained = 0, []
    for version, result in results:
        b, m = result.batch, result.metrics
        assert len(b) == 16 and m["agent/turns_mean"] == 2.0 and m["agent/errors"] == 0
        mask = b["response_mask"].bool()
        assert torch.equal(mask, b["token_sources"] == SOURCES.index(MODEL))
        versions = b["rollout_versions"]
        assert set(versions[~mask].tolist()) == {-1}
        assert int(versions[mask].max()) <= version and version - int(versions[mask].min()) <= m["rollout/staleness"]
        assert float(b["rollout_log_probs"][~mask].abs().sum()) == 0.0 and bool((b["rollout_log_probs"][mask] < 0).all())
        spanning += sum(int(versions[i][mask[i]].min() < versions[i][mask[i]].max()) for i in range(len(b)))
        trained += sorted(set(b["uid"]))
    assert spanning > 0 and len(trained) == len(set(trained)) == 16


def test_agent_training_goes_on_through_a_remap_and_a_resume(agent_rl):
    from hybridlab.dataflow.session import RLSession

    rl, _ = agent_rl
    if rl.mapping != DeviceMapping.from_dict(SPLIT):
        rl.remap(SPLIT)  # the actor alone, two rollout engines beside it
    moved = rl.step()
    gap = (moved.batch["old_log_probs"] - moved.batch["rollout_log_probs"])[moved.batch["response_mask"].bool()].abs()
    assert len(moved.batch) == 16 and moved.metrics["agent/turns_mean"] == 2.0 and gap.max() < 1e-4
    rl.save_checkpoint()
    done, run_dir, version = rl.state.step_count, rl.cfg.trainer.run_dir, rl.state.actor_version
    rl.shutdown()
    resumed = RLSession.resume(run_dir)
    try:
        assert (resumed.state.actor_version, resumed.state.rollout_version) == (version, version)
        result = resumed.step()
        assert resumed.state.step_count == done + 1 and len(result.batch) == 16
        assert set(result.batch["rollout_versions"][result.batch["response_mask"].bool()].tolist()) == {version}
        assert result.metrics["agent/turns_mean"] == 2.0 and result.metrics["agent/errors"] == 0
    finally:
        resumed.shutdown()


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
