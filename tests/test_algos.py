"""The verl-named algorithms against hand-computed cases, including padding and groups of one."""
from __future__ import annotations

import math

import pytest
import torch

import hybridlab.algos as A
from hybridlab.errors import UserError


def outcome(scores, length=3, lengths=None):
    """Token-level rewards with each score on the last real token, and the response mask."""
    lengths = lengths or [length] * len(scores)
    rewards = torch.zeros(len(scores), length)
    mask = torch.zeros(len(scores), length)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask


def test_grpo_normalises_within_groups_and_leaves_singletons_alone():
    rewards, mask = outcome([1.0, 0.0, 1.0, 1.0, 5.0], lengths=[3, 2, 1, 3, 2])
    index = ["a", "a", "a", "b", "c"]
    adv, ret = A.compute_grpo_outcome_advantage(rewards, mask, index)
    mean, std = 2 / 3, math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # unbiased std
    expect = [(1 - mean) / (std + 1e-6), (0 - mean) / (std + 1e-6), (1 - mean) / (std + 1e-6),
              (1.0 - 0) / 1, 5.0]  # "b" and "c" are groups of one: mean 0, std 1
    for i, e in enumerate(expect):
        assert torch.allclose(adv[i], e * mask[i], atol=1e-5)
    assert torch.equal(adv, ret)
    assert adv[1, 2] == 0 and adv[2, 1] == 0  # padding stays zero
    dr, _ = A.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert torch.allclose(dr[0, 0], torch.tensor(1 / 3)) and torch.allclose(dr[4, 0], torch.tensor(5.0))


def test_rloo_uses_leave_one_out_mean():
    rewards, mask = outcome([1.0, 0.0, 0.0, 2.0], lengths=[2, 3, 1, 2])
    adv, _ = A.compute_rloo_outcome_advantage(rewards, mask, [0, 0, 0, 1])
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 2.0]))  # 1 - mean(0, 0), ...; singleton raw
    assert adv[0, 2] == 0 and adv[2, 1] == 0


def test_gae_matches_a_hand_rollout():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0]])  # the padded position's value must be ignored
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.3
    d1 = 0 + gamma * 0.3 - 0.4
    d0 = 0 + gamma * 0.4 - 0.5
    a2, a1 = d2, d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    raw = torch.tensor([a0, a1, a2])
    adv, ret = A.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    assert torch.allclose(ret[0, :3], raw + values[0, :3], atol=1e-6)
    whitened = (raw - raw.mean()) / torch.sqrt(raw.var(unbiased=True) + 1e-8)
    assert torch.allclose(adv[0, :3], whitened, atol=1e-5)


def test_reinforce_plus_plus_discounts_and_whitens():
    rewards, mask = outcome([1.0, 0.0], length=3, lengths=[3, 2])
    adv, ret = A.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config={"gamma": 0.5})
    assert torch.allclose(ret[0], torch.tensor([0.25, 0.5, 1.0]))
    assert torch.allclose(ret[1, :2], torch.zeros(2))
    vals = torch.tensor([0.25, 0.5, 1.0, 0.0, 0.0])
    white = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    assert torch.allclose(adv[0], white[:3], atol=1e-5) and adv[1, 2] == 0


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens():
    rewards, mask = outcome([1.0, 0.0, 3.0], lengths=[2, 2, 1])
    adv, _ = A.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, [0, 0, 1])
    vals = torch.tensor([0.5, 0.5, -0.5, -0.5, 3.0])  # group-centred scores on every real token
    white = (vals - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    assert torch.allclose(adv[mask.bool()], white, atol=1e-5)


def test_remax_subtracts_the_greedy_baseline():
    rewards, mask = outcome([1.0, 0.0], lengths=[2, 3])
    adv, ret = A.compute_remax_outcome_advantage(rewards, torch.tensor([0.25, 1.0]), mask)
    assert torch.allclose(ret[0], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.allclose(adv[0], torch.tensor([0.75, 0.75, 0.0]))
    assert torch.allclose(adv[1], torch.tensor([-1.0, -1.0, -1.0]))


def test_agg_loss_modes_and_micro_batch_shares():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert torch.isclose(A.agg_loss(loss, mask, "token-mean"), torch.tensor(10 / 4))
    assert torch.isclose(A.agg_loss(loss, mask, "seq-mean-token-sum"), torch.tensor((6 + 4) / 2))
    assert torch.isclose(A.agg_loss(loss, mask, "seq-mean-token-mean"), torch.tensor((2 + 4) / 2))
    assert torch.isclose(A.agg_loss(loss, mask, "seq-mean-token-sum-norm"), torch.tensor((6 + 4) / 2 / 3))  # verl
    assert torch.isclose(A.agg_loss(loss, mask, "token-sum"), torch.tensor(10.0))
    for mode in A.AGG_MODES:  # shares of single rows add up to the whole
        whole = A.agg_loss(loss, mask, mode)
        parts = sum(A.agg_loss(loss[i:i + 1], mask[i:i + 1], mode, global_tokens=4.0, global_seqs=2.0)
                    for i in range(2))
        assert torch.isclose(whole, parts), mode
    with pytest.raises(UserError, match="token-mean"):
        A.agg_loss(loss, mask, "mean")


def test_policy_loss_clip_higher_and_dual_clip():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    loss, clipfrac, ppo_kl, clip_lower = A.compute_policy_loss(old, new, adv, mask, cliprange=0.2,
                                                               cliprange_high=0.28, clip_ratio_c=3.0)
    # token 0: ratio 1.5 clipped at 1.28 -> -1.28; token 1: ratio 0.5, A<0 -> max(0.5, 0.8) = 0.8;
    # token 2: 1.1 inside -> -1.1; token 3: ratio 5, A<0 -> max(5, 1.2) = 5, dual clip -> 3.
    assert torch.isclose(loss, torch.tensor((-1.28 + 0.8 - 1.1 + 3.0) / 4), atol=1e-6)
    assert torch.isclose(clipfrac, torch.tensor(2 / 4)) and torch.isclose(clip_lower, torch.tensor(1 / 4))
    assert torch.isclose(ppo_kl, -new.mean())
    same, metrics = A.compute_policy_loss_vanilla(old, new, adv, mask, config={"clip_ratio": 0.2,
                                                                               "clip_ratio_high": 0.28})
    assert torch.isclose(same, loss) and metrics == {"actor/pg_clipfrac": float(clipfrac),
                                                     "actor/ppo_kl": float(ppo_kl),
                                                     "actor/pg_clipfrac_lower": float(clip_lower)}
    assert A.get_policy_loss_fn("vanilla") is A.compute_policy_loss_vanilla


def test_value_loss_clips_around_old_values():
    vpreds = torch.tensor([[1.0, 0.0]])
    values = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, clipfrac = A.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    assert torch.isclose(loss, torch.tensor(0.5 * (0.5 - 2.0) ** 2)) and clipfrac == 1.0


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref
    assert torch.allclose(A.kl_penalty(lp, ref, "k1"), d)
    assert torch.allclose(A.kl_penalty(lp, ref, "abs"), d.abs())
    assert torch.allclose(A.kl_penalty(lp, ref, "mse"), 0.5 * d ** 2)
    assert torch.allclose(A.kl_penalty(lp, ref, "low_var_kl"), torch.exp(-d) + d - 1)
    with pytest.raises(UserError, match="low_var_kl"):
        A.kl_penalty(lp, ref, "full")


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_a_plus_kl_estimator_keeps_its_value_and_takes_k2s_gradient(name):
    """verl 0.9.1's straight-through estimators: "k3+" is k3 in value, k2 in gradient."""
    from hybridlab.run_config import load_config

    ref = torch.tensor([-1.5, -1.0, -0.2])
    lp = torch.tensor([-1.0, -2.0, -0.7], requires_grad=True)
    plus = A.kl_penalty(lp, ref, name + "+")
    assert torch.equal(plus.detach(), A.kl_penalty(lp.detach(), ref, name))
    plus.sum().backward()
    assert torch.allclose(lp.grad, (lp - ref).detach())  # the gradient of 0.5 (lp - ref)^2
    cfg = load_config("grpo", [f"actor.kl_loss_type={name}+", f"algorithm.kl_penalty={name}+"])
    assert (cfg.actor.kl_loss_type, cfg.algorithm.kl_penalty) == (name + "+", name + "+")


def test_kl_reward_penalty_and_adaptive_coefficient():
    scores, mask = outcome([1.0, 0.0], lengths=[2, 1], length=2)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0], [-2.0, -7.0]])
    ctrl = A.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    rewards, metrics = A.apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    assert torch.allclose(rewards, torch.tensor([[-0.05, 1.0], [-0.1, 0.0]]))
    assert math.isclose(metrics["actor/reward_kl_penalty"], (0.25 + 1.0) / 2, rel_tol=1e-5)
    assert math.isclose(ctrl.value, 0.1 * (1 + 0.2 * 2 / 100))  # KL above target: coefficient grows (capped)


def test_entropy_and_logprobs_from_logits():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    p = torch.tensor([0.25, 0.75])
    assert torch.isclose(A.entropy_from_logits(logits)[0], -(p * p.log()).sum())
    assert torch.isclose(A.logprobs_from_logits(logits, torch.tensor([1]))[0], torch.log(torch.tensor(0.75)))


def test_dapo_helpers():
    assert A.informative_groups(["a", "a", "b", "b", "c"], torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])) == ["b", "c"]
    pen = A.overlong_penalty(torch.tensor([4, 6, 8]), max_response_length=8, buffer_len=4, penalty_factor=1.0)
    assert torch.allclose(pen, torch.tensor([0.0, -0.5, -1.0]))


def test_registry_names_and_errors():
    assert set(A.ADV_ESTIMATORS) == {  # verl 0.9.1's 14
        "gae", "grpo", "grpo_vectorized", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo",
        "rloo_vectorized", "opo", "remax", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo"}
    assert set(A.POLICY_LOSSES) == {"vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                                    "geo_mean", "dro", "cispo", "bypass_mode"}  # verl 0.9.1's 12
    assert A.get_adv_estimator_fn("rloo") is A.compute_rloo_outcome_advantage
    with pytest.raises(UserError, match="grpo"):
        A.get_adv_estimator_fn("gpro")


def test_pass_at_k_names_a_group_of_one():
    rewards, mask = torch.tensor([[1.0], [0.0], [1.0]]), torch.ones(3, 1)
    with pytest.raises(ValueError, match="grpo_passk needs at least 2 samples per group .* group 'b' has 1"):
        A.compute_grpo_passk_outcome_advantage(rewards, mask, ["a", "a", "b"])


def test_gdpo_names_a_missing_reward_component():
    rewards, mask = torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.ones(2, 2)
    batch = {"prompts": torch.zeros(2, 1, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="gdpo reward key 'format' is not among the reward's outputs \\['acc'\\]"):
        A.compute_gdpo_outcome_advantage(rewards, mask, ["a", "a"], config={"gdpo_reward_keys": ["format"]},
                                         non_tensor_batch={"acc": [1.0, 0.0]}, batch=batch)
