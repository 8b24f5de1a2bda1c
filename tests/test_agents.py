"""Agentic rollouts on real vLLM, Megatron and Ray: an unchanged OpenAI-SDK agent trained with
GRPO on exact multi-turn tokens, failing agents, text and OpenEnv environments, off-policy and
streamed trajectories, a remap and a resume. Without an engine: test_agent_records.py."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from hybridlab.agents.traces import model_turns
from hybridlab.agents.trajectory import MODEL
from hybridlab.controller.mapping import DeviceMapping
from openenv_envs import DroppingServer

AGENTS = Path(__file__).with_name("agent_functions.py")
ENVS = Path(__file__).with_name("openenv_envs.py")

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
