"""RL steps end to end on real engines (vLLM rollout, Megatron actor/critic/ref, reward workers):
one session on two data-parallel devices, whose dataflow is edited between steps."""
from __future__ import annotations

import json
import math

import pytest
import torch

import hybridlab.algos as A
from hybridlab.algos.advantages import compute_advantage
from hybridlab.algos.rollout_correction import compute_rollout_correction_and_rejection_mask
from hybridlab.dataflow.graph import DataflowError, StageError
from hybridlab.dataflow.recovery import step_start
from hybridlab.dataflow.session import RLSession
from hybridlab.dataflow.stages import STAGES, register_stage

GRPO_FLOW = "[generate, reward, old_logprob, ref_logprob, advantages, update_actor, sync_weights]"


@pytest.fixture(scope="module")
def rl(ray_local, trained_dir, tmp_path_factory):
    """A PPO session (actor, critic, ref, rollout and reward colocated on 2 devices, DP 2)."""
    run_dir = tmp_path_factory.mktemp("rl") / "run"
    session = RLSession("ppo", [f"model={trained_dir}", "warm_start.max_steps=0", "trainer.devices=2",
                                "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=6",
                                "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4",
                                "data.test_samples=32", "trainer.progress=false", f"trainer.run_dir={run_dir}"])
    session.start()
    yield session
    session.shutdown()


def pids(rl):
    return sorted(p["pid"] for p in rl.workers.groups["actor"].placements)


def assert_rollout_matches_actor(batch):
    """The sampled tokens' log-probs from vLLM equal the actor's: the last weight sync landed."""
    mask = batch["response_mask"].bool()
    assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max() < 1e-4


def test_ppo_step_fills_every_field_and_logs_metrics(rl):
    result = rl.step()
    b, m = result.batch, result.metrics
    assert len(b) == 8 * 4
    for field in ("responses", "token_level_scores", "token_level_rewards", "old_log_probs", "ref_log_prob",
                  "values", "advantages", "returns"):
        assert field in b, field
    adv, ret = A.compute_gae_advantage_return(b["token_level_rewards"], b["values"], b["response_mask"].float(),
                                              gamma=1.0, lam=0.95)
    assert torch.allclose(b["advantages"], adv, atol=1e-5) and torch.allclose(b["returns"], ret, atol=1e-5)
    expect_rewards, _ = A.apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                           b["response_mask"], A.FixedKLController(0.001), "kl")
    assert torch.allclose(b["token_level_rewards"], expect_rewards, atol=1e-6)
    for key in ("reward/mean", "accuracy", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac",
                "actor/reward_kl_penalty", "critic/vf_loss", "advantages/mean", "timing/generate_s",
                "timing/update_actor_s", "perf/tokens_per_s", "sync/seconds"):
        assert key in m, key
    assert m["sync/bytes"] > 0 and m["rollout/staleness"] == 0
    logged = [json.loads(line) for line in (rl.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == result.step and logged[-1]["reward/mean"] == pytest.approx(m["reward/mean"])
    assert list((rl.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    rows = rl.decoded(b, limit=3)
    assert set(rows[0]) == {"prompt", "response", "length", "reward", "rollout_logp", "old_logp", "ref_logp", "value",
                            "advantage"} and "=" in rows[0]["prompt"]
    # the first step's actor was the reference, so its penalty was zero: checked again on the next
    # step, whose actor the first update moved
    b = rl.step().batch
    mask = b["response_mask"].bool()
    penalty = (b["token_level_scores"] - b["token_level_rewards"])[mask].abs().max()
    expect_rewards, _ = A.apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                           b["response_mask"], A.FixedKLController(0.001), "kl")
    assert penalty > 1e-5  # 1.9e-4 here: the actor is 0.19 from the reference in log-prob at most
    assert torch.allclose(b["token_level_rewards"], expect_rewards, atol=1e-6)


def test_critic_warmup_steps_train_the_critic_alone(rl):
    rl.update(f"trainer.critic_warmup={rl.state.step_count + 1}")  # the next step is in the warm-up
    version = rl.state.actor_version
    try:
        m = rl.step().metrics
    finally:
        rl.update("trainer.critic_warmup=0")
    assert m["actor/critic_warmup"] == 1 and "actor/pg_loss" not in m and m["sync/skipped"] == 1
    assert "critic/vf_loss" in m and rl.state.actor_version == version
    after = rl.step().metrics  # past the warm-up: the actor updates and syncs again
    assert "actor/pg_loss" in after and "actor/critic_warmup" not in after and after["sync/bytes"] > 0
    assert rl.state.actor_version == version + 1


def test_drop_the_critic_switch_to_grpo_then_rloo_without_restarting(rl):
    before = pids(rl)
    rl.update("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor.use_kl_loss=true",
              f"dataflow={GRPO_FLOW}")
    b = step_with_a_reward_difference(rl, "grpo").batch  # zero advantages would match any estimator
    assert "values" not in b
    adv, _ = A.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"].float(), b["uid"])
    assert torch.allclose(b["advantages"], adv, atol=1e-5)
    assert_rollout_matches_actor(b)
    rl.update("algorithm.adv_estimator=rloo")
    b = step_with_a_reward_difference(rl, "rloo").batch
    adv, _ = A.compute_rloo_outcome_advantage(b["token_level_rewards"], b["response_mask"].float(), b["uid"])
    assert torch.allclose(b["advantages"], adv, atol=1e-5)
    assert pids(rl) == before


def test_rollout_log_probs_can_stand_in_for_old_log_probs(rl):
    flow = rl.dataflow.names
    rl.dataflow = [n if n != "old_logprob" else "rollout_as_old_logprob" for n in flow]
    try:
        b = rl.step().batch
    finally:
        rl.dataflow = flow
    assert torch.equal(b["old_log_probs"], b["rollout_log_probs"]) and "entropy" not in b


def test_inexact_rollout_log_probs_are_refused_when_assigned(rl):
    flow = rl.dataflow.names
    rl.update("rollout.top_k=5")
    try:
        with pytest.raises(DataflowError, match="rollout.top_k=5.*truncated distribution"):
            rl.dataflow = [n if n != "old_logprob" else "rollout_as_old_logprob" for n in flow]
    finally:
        rl.update("rollout.top_k=0")
    assert rl.dataflow.names == flow


def test_a_missing_input_is_named_and_nothing_changes(rl):
    flow = rl.dataflow.names
    with pytest.raises(DataflowError, match="update_actor: input 'old_log_probs' is not produced"):
        rl.dataflow = ["generate", "reward", "ref_logprob", "advantages", "update_actor", "sync_weights"]
    assert rl.dataflow.names == flow


def test_a_reward_model_stage_is_added_between_steps(rl, trained_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hybridlab.models.zoo import build_reward_model

    rm = build_reward_model(trained_dir, tmp_path / "rm")
    flow = rl.dataflow.names
    rl.update(f"reward.model={rm}", "dataflow=" + GRPO_FLOW.replace("reward,", "reward_model,"))
    try:
        b = rl.step().batch
    finally:
        rl.update("dataflow=" + json.dumps(flow))
    model = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32).eval()
    with torch.no_grad():
        expect = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, 0]
    assert torch.allclose(b["token_level_scores"].sum(-1), expect, atol=1e-4)


def test_one_step_off_policy_records_staleness_and_trains_every_prompt_once(rl):
    """Staleness per step; and rollouts ahead thrown away by a settings change are not lost: the
    prompt stream goes back before their prompts, so the steps train every prompt once, in
    order, and count the regenerated ones."""
    import time

    since = time.time()
    per_step, first_uid, regenerated = rl.cfg.data.prompts_per_step, rl.state.prompts.drawn, rl.state.ahead.regenerated
    rl.update("trainer.off_policy=true")
    try:
        first, second = rl.step(), rl.step()
        # bounded staleness: two rollouts kept ahead (the change throws the pending one away first)
        rl.update("trainer.max_staleness=2")
        deeper = [rl.step() for _ in range(4)]
        assert len(rl.state.ahead.pending) == 2
        # a checkpoint, and a step retried after a worker fault, go back before the two batches ahead
        assert rl.state.prompts.drawn == first_uid + 8 * per_step
        assert rl.state.record(None)["prompts"]["drawn"] == step_start(rl.state).prompts["drawn"] \
            == first_uid + 6 * per_step
    finally:
        rl.update("trainer.off_policy=false", "trainer.max_staleness=1")
    after = rl.step()  # on-policy: the first prompts of the two rollouts thrown away
    assert first.metrics["rollout/staleness"] == 0 and second.metrics["rollout/staleness"] == 1
    assert [r.metrics["rollout/staleness"] for r in deeper] == [0, 1, 2, 2] and rl.state.ahead.pending == []
    trained = [uid for r in (first, second, *deeper, after) for uid in sorted(set(r.batch["uid"]))]
    assert trained == list(range(first_uid, first_uid + 7 * per_step))
    assert rl.state.ahead.regenerated - regenerated == 3 * per_step  # one batch ahead, then two
    assert deeper[-1].metrics["rollout/regenerated_prompts"] == rl.state.ahead.regenerated - 2 * per_step
    assert "advantages" in second.batch and second.metrics["sync/bytes"] > 0
    # rollouts submitted ahead (collected by the next step's thread) still count as generate
    generated = [s for s in rl.workers.timeline.spans(since=since) if s.method == "generate"]
    assert generated and {s.stage for s in generated} == {"generate"}


def test_refill_rounds_generate_now_and_leave_the_next_steps_rollout_alone(rl):
    """DAPO's refills (rerun_rollout) are on-policy even off-policy: the look-ahead rollout
    submitted for the next step is neither consumed nor replaced by them."""

    rl.update("trainer.off_policy=true")
    try:
        rl.step()
        pending = list(rl.state.ahead.pending)
        batch = rl.context().rerun_rollout(["generate", "reward"])
        assert rl.state.ahead.pending == pending and len(pending) == 1
        assert len(batch) == rl.cfg.data.prompts_per_step * rl.cfg.rollout.n and "token_level_scores" in batch
    finally:
        rl.update("trainer.off_policy=false")


def test_a_stop_request_ends_train_after_the_current_step_and_is_consumed(rl):
    steps = rl.state.step_count
    rl.request_stop()  # before train() starts: still honoured
    summary = rl.train(5)
    assert summary["stopped_by"] == "stop requested" and rl.state.step_count == steps
    assert rl.train(1)["stopped_by"] == "steps" and rl.state.step_count == steps + 1


def test_a_failing_stage_is_named_and_the_callers_torch_threads_are_put_back(rl, monkeypatch):
    # torch's own setter, whatever an in-process vLLM engine of an earlier module left (test_binding)
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    seen = []

    @register_stage("explode", None, ("responses",), ("boom",))
    def explode(ctx, batch):
        seen.append(torch.get_num_threads())
        raise ValueError("no such thing")

    flow, threads = rl.dataflow.names, torch.get_num_threads()
    try:
        rl.dataflow = ["generate", "explode"]
        torch.set_num_threads(2)  # a kernel's own number: the step's stages run on one, then the kernel has its 2 back
        with pytest.raises(StageError, match="stage 'explode' \\(role controller\\) failed: ValueError: no such"):
            rl.step()
        assert (seen, torch.get_num_threads()) == ([1], 2)
    finally:
        torch.set_num_threads(threads)
        STAGES.pop("explode")
        rl.dataflow = flow


def transformers_greedy_accuracy(rl) -> float:
    """Greedy accuracy of the actor's current weights on the session's test samples, computed apart
    from the engines: the weights loaded into a transformers model, its ``generate`` on each prompt
    alone (no padding) for rollout.max_new_tokens, the answer decoded and scored by the task."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridlab.tasks.base import task_for_source
    from hybridlab.workers.train.checkpoint import merge_state

    weights = merge_state(rl.workers.groups["actor"].checkpoint_state())["model"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(rl.model_dir), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    tok = rl.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    right = 0
    with torch.no_grad():
        for sample in rl.test_samples:
            ids = torch.tensor([tok(sample.prompt, add_special_tokens=False).input_ids])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=rl.cfg.rollout.max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=pad)
            answer = tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
            right += task_for_source(sample.data_source).check(answer, sample.ground_truth)[0]
    return right / len(rl.test_samples)


def test_a_policy_gradient_step_raises_positive_advantage_samples_and_lowers_the_others(rl):
    """One update of the actor on a fixed batch, two of its own greedy answers with advantages +1
    and -1: the first one's mean log-prob over its response tokens rises, the other's falls.

    The two answers share no digit. Answers that share tokens pull those tokens' log-probs both
    ways, and in a larger batch of such answers the pulls of the others can outweigh a sample's
    own (a transformers replica of this step on GRPO batches of 8 x 4 moved about a third of the
    samples with a non-zero advantage against it). The AdamW moments are zeroed first, so the step
    follows this batch's gradient, not the momentum of earlier steps; the actor's whole state is
    restored after."""
    import ray

    from hybridlab.algos.objectives import actor_loss
    from hybridlab.dataflow.prompts import prompt_batch
    from hybridlab.dataflow.fields import SEQUENCE_FIELDS
    from hybridlab.dataflow.update_stages import actor_loss_settings
    from hybridlab.protocol import Batch
    from hybridlab.workers.train.checkpoint import merge_state

    samples = rl.test_samples[:16]
    greedy = rl.workers.groups["rollout"].generate(prompt_batch(samples, rl.tokenizer, list(range(len(samples)))),
                                                   rl.context().sampling(n=1, temperature=0.0))
    eos = rl.tokenizer.eos_token_id
    digits = [set(r[m.bool()].tolist()) - {eos} for r, m in zip(greedy["responses"], greedy["response_mask"])]
    pair = next(((i, j) for i in range(len(digits)) for j in range(i + 1, len(digits))
                 if digits[i] and digits[j] and not digits[i] & digits[j]), None)
    assert pair is not None, "no two greedy answers without a common digit"
    batch = greedy.take(list(pair)).select(SEQUENCE_FIELDS, meta=False)
    mask = batch["response_mask"].float()
    actor = rl.workers.groups["actor"]
    saved = actor.checkpoint_state()  # weights, AdamW moments, step and RNG
    settings = [f"actor.lr={rl.cfg.actor.lr}", f"actor.warmup_steps={rl.cfg.actor.warmup_steps}"]
    try:
        rl.update("actor.lr=1e-5", "actor.warmup_steps=0")  # a small step: first-order effects rule
        zeros = {name: torch.zeros_like(t) for name, t in merge_state(saved)["model"].items()}
        actor.load_optimizer_state({"exp_avg": zeros, "exp_avg_sq": zeros}, next(p for p in saved if p)["step"], 0.0)
        before = actor.compute_log_prob(batch)["old_log_probs"]
        loss = actor_loss({**actor_loss_settings(rl.cfg), "policy_loss": "vanilla", "loss_agg_mode": "token-mean",
                           "entropy_coeff": 0.0, "use_kl_loss": False})
        advantages = torch.tensor([[1.0], [-1.0]]) * mask
        metrics = [m for rank in actor.update_actor([Batch({**batch.tensors, "old_log_probs": before,
                                                             "advantages": advantages})], loss) for m in rank]
        after = actor.compute_log_prob(batch)["old_log_probs"]
    finally:
        actor.load_state([ray.put(saved)])  # the rollout still holds these weights: nothing to sync
        rl.update(*settings)
    assert all(m["skipped"] == 0 and m["lr"] == pytest.approx(1e-5) and m["grad_norm"] > 0 for m in metrics)
    change = ((after - before) * mask).sum(-1) / mask.sum(-1)
    assert change[0] > 0 > change[1], change


def test_evaluate_reports_greedy_accuracy(rl):
    import time

    expected = transformers_greedy_accuracy(rl)  # before `since`: its worker call is no evaluate span
    since = time.time()
    ev = rl.evaluate()
    assert ev["n"] == 32 and ev["accuracy"] == pytest.approx(expected, abs=1e-9)
    # the dashboard shows these calls as the evaluate stage, not as a bare method name
    spans = rl.workers.timeline.spans(since=since)
    assert {s.method for s in spans} >= {"generate", "compute_reward"}
    assert {s.stage for s in spans} == {"evaluate"}


def test_evaluation_answers_n_times_and_reports_verls_entries(rl):
    """evaluation.n answers per test prompt (verl's val_kwargs): greedy ones repeat the greedy
    answer, sampled ones differ; under verl's names, mean@N, std@N and best@n/worst@n."""
    samples = rl.test_samples[:16]
    greedy = rl.evaluate(samples)
    rl.update("trainer.verl_names=true", "evaluation.n=2")
    try:
        repeated = rl.evaluate(samples)
        rl.update("evaluation.n=4", "evaluation.temperature=1.0")
        sampled = rl.evaluate(samples)
    finally:
        rl.update("trainer.verl_names=false", "evaluation.n=1", "evaluation.temperature=0")
    assert "verl" not in greedy
    v = repeated["verl"]
    assert repeated["accuracy"] == greedy["accuracy"] == pytest.approx(v["val-core/arith/acc/mean@2"], abs=1e-12)
    assert repeated["n"] == sampled["n"] == 16
    for name in ("acc", "reward"):
        mean = v[f"{'val-core' if name == 'acc' else 'val-aux'}/arith/{name}/mean@2"]
        assert v[f"val-aux/arith/{name}/std@2"] == 0.0  # the same answer twice
        assert v[f"val-aux/arith/{name}/worst@2/mean"] == mean == v[f"val-{'core' if name == 'acc' else 'aux'}/arith/"
                                                                    f"{name}/best@2/mean"]
    v = sampled["verl"]
    stats = [f"{kind}@{n}/{what}" for n in (2, 4) for kind in ("best", "worst") for what in ("mean", "std")]
    assert sorted(v) == sorted([f"val-core/arith/acc/{m}" for m in ("mean@4", "best@4/mean", "best@4/std")]
                               + [f"val-aux/arith/acc/{m}" for m in ("std@4", *stats) if not m.startswith("best@4")]
                               + [f"val-aux/arith/{name}/{m}" for name in ("reward", "score")  # the dict's score
                                  for m in ("mean@4", "std@4", *stats)])
    assert v["val-aux/arith/acc/std@4"] > 0  # sampled answers differ
    assert sampled["accuracy"] == pytest.approx(v["val-core/arith/acc/mean@4"], abs=1e-12)
    assert v["val-core/arith/acc/best@4/mean"] > v["val-core/arith/acc/mean@4"] > v["val-aux/arith/acc/worst@4/mean"]


def test_remax_and_dapo_dataflows(rl):
    flow = rl.dataflow.names
    saved = [f"algorithm.adv_estimator={rl.cfg.algorithm.adv_estimator}",
             f"actor.use_kl_loss={str(rl.cfg.actor.use_kl_loss).lower()}", "dataflow=" + json.dumps(flow)]
    try:
        rl.update("algorithm.adv_estimator=remax", "actor.use_kl_loss=false",
                  "dataflow=[generate, reward, remax_baseline, old_logprob, advantages, update_actor, sync_weights]")
        b = rl.step().batch
        adv, _ = A.compute_remax_outcome_advantage(b["token_level_rewards"], b["reward_baselines"],
                                                   b["response_mask"].float())
        assert torch.allclose(b["advantages"], adv, atol=1e-6)
        assert set(b["reward_baselines"].tolist()) <= {0.0, 1.0}  # the greedy answer's rule reward
        rl.update("algorithm.adv_estimator=grpo", "algorithm.filter_groups.enable=true",
                  "dataflow=[generate, reward, filter_groups, old_logprob, advantages, update_actor, sync_weights]")
        for _ in range(4):  # a step that dropped a group: which seeded step draws one depends on the steps before
            result = rl.step()
            if result.metrics["filter_groups/kept_fraction"] < 1:
                break
        b, m = result.batch, result.metrics
        groups = {}
        for uid, score in zip(b["uid"], b["token_level_scores"].sum(-1).tolist()):
            groups.setdefault(uid, []).append(score)
        # The step's samples hold both kinds of group: some whose rewards all drew equal, dropped, and
        # some that differ, kept. kept_fraction is the kept prompts over every prompt generated (8 a
        # round); it is below 1 only when a group was dropped, since a first round whose 8 groups all
        # differ fills the step at once.
        rounds, kept = m["filter_groups/generation_rounds"], m["filter_groups/kept_prompts"]
        assert 0 < kept == len(groups) <= rl.cfg.data.prompts_per_step and rounds >= 1
        assert m["filter_groups/kept_fraction"] == pytest.approx(kept / (rl.cfg.data.prompts_per_step * rounds))
        assert m["filter_groups/kept_fraction"] < 1
        assert all(max(s) > min(s) and len(s) == rl.cfg.rollout.n for s in groups.values())  # each teaches
    finally:
        rl.update("algorithm.filter_groups.enable=false", *saved)


@pytest.mark.parametrize("mode, extra", [("token-sum", []), ("seq-mean-token-sum-norm", []),
                                         ("seq-mean-token-sum-norm", ["actor.loss_scale_factor=4"]),
                                         ("seq-mean-token-mean", [])])
def test_the_engines_loss_over_micro_batches_and_dp_ranks_is_verls_on_the_whole_batch(rl, mode, extra):
    """One mini-batch split over 2 DP ranks and micro-batches of 3: the first update sees ratio 1,
    so its policy loss is agg_loss(-advantages) over the whole batch, as verl's function gives it.
    GRPO's advantages sum to zero in each group, and with a group's answers of one length every
    aggregation of them is zero too (it was, to 1e-6: any normalisation passed). Pass@k's are not:
    only each group's best answer gets one, so the loss differs between the modes."""
    saved = [f"algorithm.adv_estimator={rl.cfg.algorithm.adv_estimator}", f"dataflow={json.dumps(rl.dataflow.names)}",
             f"actor.ppo_mini_batch_size={rl.cfg.actor.ppo_mini_batch_size}",
             f"actor.micro_batch_size={rl.cfg.actor.micro_batch_size}", "actor.loss_scale_factor=null",
             f"actor.loss_agg_mode={rl.cfg.actor.loss_agg_mode}", f"actor.use_kl_loss={str(rl.cfg.actor.use_kl_loss).lower()}"]
    try:
        rl.update("algorithm.adv_estimator=grpo_passk", "actor.use_kl_loss=false", f"actor.loss_agg_mode={mode}",
                  "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=3", *extra,
                  "dataflow=[generate, reward, old_logprob, advantages, update_actor, sync_weights]")
        result = step_with_a_reward_difference(rl, mode)
        b = result.batch
        expected = A.agg_loss(-b["advantages"], b["response_mask"].float(), mode,
                              loss_scale_factor=rl.cfg.actor.loss_scale_factor)
        assert abs(float(expected)) > 1e-3
        assert result.metrics["actor/pg_loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    finally:
        rl.update(*saved)


LOSS_KEYS = ("policy_loss", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "tau_pos", "tau_neg",
             "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")


def step_with_a_reward_difference(rl, what: str):
    """Return the first of up to eight steps whose advantages are not all zero. A batch whose
    groups all drew equal rewards has zero advantages, and then no gradient whatever the loss;
    which seeded step first draws a difference depends on the processor's arithmetic (here every
    call's first step had one: 1 to 4 right answers of 32)."""
    for _ in range(8):
        result = rl.step()
        if result.batch["advantages"].abs().sum() > 0:
            return result
    raise AssertionError(f"{what}: eight steps without a reward difference")


def test_every_policy_loss_preset_steps_through_update_with_finite_loss_and_gradient(rl):
    """The presets of verl's policy losses, switched live on one session (DP 2); each step's
    policy loss and gradient norm are finite, and the loss is the preset's: one mini-batch, so the
    update sees ratio 1 and its loss is the preset's loss function on the whole batch at ratio 1
    (clip_cov aside: it masks a random subset of tokens in the worker). Pass@k's advantages, as
    in the test above: at ratio 1 gspo, gmpo and kl_cov reduce to an aggregate of the advantages,
    which GRPO's made zero."""
    from hybridlab.algos.losses import get_policy_loss_fn
    from hybridlab.run_config import load_config

    saved = [f"actor.{k}={json.dumps(getattr(rl.cfg.actor, k))}" for k in LOSS_KEYS] + [
        f"algorithm.adv_estimator={rl.cfg.algorithm.adv_estimator}", f"dataflow={json.dumps(rl.dataflow.names)}",
        f"algorithm.norm_adv_by_std_in_grpo={str(rl.cfg.algorithm.norm_adv_by_std_in_grpo).lower()}",
        f"actor.ppo_mini_batch_size={rl.cfg.actor.ppo_mini_batch_size}"]
    before = pids(rl)
    try:
        rl.update("algorithm.adv_estimator=grpo_passk", "actor.use_kl_loss=false", "actor.ppo_mini_batch_size=8",
                  "dataflow=[generate, reward, old_logprob, advantages, update_actor, sync_weights]")
        for preset in ("gspo", "cispo", "gpg", "clip_cov", "kl_cov", "sapo", "gmpo"):
            cfg = load_config(preset)
            rl.update(*[f"actor.{k}={json.dumps(getattr(cfg.actor, k))}" for k in LOSS_KEYS],
                      f"algorithm.norm_adv_by_std_in_grpo={str(cfg.algorithm.norm_adv_by_std_in_grpo).lower()}")
            result = step_with_a_reward_difference(rl, preset)
            b, m = result.batch, result.metrics
            assert rl.cfg.actor.policy_loss == cfg.actor.policy_loss
            assert torch.isfinite(torch.tensor([m["actor/pg_loss"], m["actor/grad_norm"]])).all(), (preset, m)
            assert m["actor/grad_norm"] > 0, preset
            if preset != "clip_cov":
                expected, _ = get_policy_loss_fn(cfg.actor.policy_loss)(
                    old_log_prob=b["old_log_probs"], log_prob=b["old_log_probs"], advantages=b["advantages"],
                    response_mask=b["response_mask"].float(), loss_agg_mode=rl.cfg.actor.loss_agg_mode,
                    config=rl.cfg.actor)
                assert abs(float(expected)) > 1e-3, preset
                assert m["actor/pg_loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6), preset
        assert pids(rl) == before  # live: no worker was re-created
    finally:
        rl.update(*saved)


def test_rollout_correction_and_the_other_verl_estimators_run_live(rl, tmp_path):
    """Decoupled rollout correction (token IS weights, k3 rejection), then bypass mode with
    IS-weighted REINFORCE, then every estimator added for verl parity, on one live session:
    the metrics are present, the losses finite, each step's advantages are its estimator's on the
    step's own fields, no worker re-created."""
    rc = "algorithm.rollout_correction"
    saved = [f"algorithm.adv_estimator={rl.cfg.algorithm.adv_estimator}", f"dataflow={json.dumps(rl.dataflow.names)}",
             f"actor.use_kl_loss={str(rl.cfg.actor.use_kl_loss).lower()}", f"{rc}.rollout_is=null",
             f"{rc}.rollout_rs=null", f"{rc}.rollout_rs_threshold=null", f"{rc}.bypass_mode=false",
             f"{rc}.loss_type=ppo_clip"]
    before = pids(rl)
    try:
        rl.update("algorithm.adv_estimator=grpo", "actor.use_kl_loss=false", f"{rc}.rollout_is=token",
                  f"{rc}.rollout_rs=token_k3", f"{rc}.rollout_rs_threshold=1e-12", "dataflow=null")
        assert rl.dataflow.names.index("rollout_correction") == rl.dataflow.names.index("advantages") - 1
        result = rl.step()
        b, m = result.batch, result.metrics
        kept = b["response_mask"].bool()
        sampled = b["attention_mask"][:, -b["responses"].shape[1]:]  # the response tokens before rejection
        rejected = 1 - float(kept.sum() / sampled.sum())
        assert 0 < rejected < 1, rejected  # the threshold told tokens apart: some rejected, some kept
        log_ratio = b["old_log_probs"] - b["rollout_log_probs"]
        assert torch.equal(b["rollout_is_weights"][kept], log_ratio.exp().clamp(max=2.0)[kept])
        assert (log_ratio.exp() - 1 - log_ratio)[kept].max() <= 1e-12  # what stays passed the k3 threshold
        # the weights, the mask and every metric are the rejection function's on the step's own fields
        weights, mask, expected = compute_rollout_correction_and_rejection_mask(
            b["old_log_probs"], b["rollout_log_probs"], sampled.to(b["response_mask"].dtype), rollout_is="token",
            rollout_rs="token_k3", rollout_rs_threshold=1e-12)
        assert torch.equal(mask.bool(), kept) and torch.equal(weights, b["rollout_is_weights"])
        assert expected["rollout_corr/rollout_rs_token_k3_masked_fraction"] == pytest.approx(rejected)
        for key, value in expected.items():
            assert m[key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), key
        assert math.isfinite(m["actor/pg_loss"])

        rl.update(f"{rc}.bypass_mode=true", f"{rc}.loss_type=reinforce", f"{rc}.rollout_is=sequence",
                  f"{rc}.rollout_rs=null", f"{rc}.rollout_rs_threshold=null")
        assert "rollout_as_old_logprob" in rl.dataflow.names and "rollout_correction" not in rl.dataflow.names
        m = step_with_a_reward_difference(rl, "bypass mode").metrics
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        for key in ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/kl"):
            assert math.isfinite(m[key]), key  # measured inside the loss, against the evolving policy
        rl.update(f"{rc}.bypass_mode=false", f"{rc}.rollout_is=null", "dataflow=null")

        norm = {"norm_adv_by_std_in_grpo": rl.cfg.algorithm.norm_adv_by_std_in_grpo}
        grouped = {  # each estimator on a step's rewards, mask and groups (gdpo without components: GRPO, whitened)
            "grpo_vectorized": lambda rewards, mask, uid: A.compute_grpo_vectorized_outcome_advantage(
                rewards, mask, uid, **norm),
            "grpo_passk": lambda rewards, mask, uid: A.compute_grpo_passk_outcome_advantage(rewards, mask, uid,
                                                                                            config=norm),
            "rloo_vectorized": A.compute_rloo_vectorized_outcome_advantage, "opo": A.compute_opo_outcome_advantage,
            "gpg": A.compute_gpg_outcome_advantage,
            "gdpo": A.compute_gdpo_outcome_advantage}
        for estimator in ("grpo_vectorized", "grpo_passk", "rloo_vectorized", "opo", "gpg", "gdpo",
                          "optimal_token_baseline", "tir_optimal_token_baseline"):
            rl.update(f"algorithm.adv_estimator={estimator}")
            # a step with a reward difference, so that the comparison below tells estimators apart
            result = step_with_a_reward_difference(rl, estimator)
            b, m = result.batch, result.metrics
            assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), estimator
            mask = b["response_mask"].float()
            if "optimal_token_baseline" in estimator:  # the actor's sum of p^2 feeds the baseline
                assert ((b["sum_pi_squared"] > 0) & (b["sum_pi_squared"] <= 1 + 1e-6))[mask.bool()].all()
                expected, _ = A.get_adv_estimator_fn(estimator)(b["token_level_rewards"], mask, b["uid"],
                                                                b["old_log_probs"], b["sum_pi_squared"])
            else:
                expected, _ = grouped[estimator](b["token_level_rewards"], mask, b["uid"])
            assert expected.abs().sum() > 0 and torch.allclose(b["advantages"], expected, atol=1e-6), estimator
        assert pids(rl) == before

        module = tmp_path / "parts.py"  # GDPO's reward components, from a reward function's dict answer
        module.write_text("from hybridlab.tasks.base import task_for_source\n"
                          "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    right = float(task_for_source(data_source).check(solution_str, ground_truth)[0])\n"
                          "    short = float(len(solution_str) <= 3)\n"
                          "    return {'score': right + short, 'right': right, 'short': short}\n")
        rl.update("reward.kind=function", f"reward.function={module}:score", "algorithm.adv_estimator=gdpo",
                  "algorithm.gdpo_reward_keys=[right, short]", "algorithm.gdpo_reward_weights=[2.0, 1.0]")
        result = rl.step()
        b, m = result.batch, result.metrics
        assert {"reward/right/mean", "reward/short/mean"} <= m.keys()
        fields = {k: b[k] for k in ("token_level_rewards", "response_mask", "uid", "reward_extra_info", "prompts",
                                    "attention_mask")}
        expected, _ = compute_advantage("gdpo", fields, rl.cfg.algorithm)
        assert torch.allclose(b["advantages"], expected, atol=1e-6)
    finally:
        rl.update("reward.kind=rule", "reward.function=null", "algorithm.gdpo_reward_keys=null",
                  "algorithm.gdpo_reward_weights=null", *saved)
