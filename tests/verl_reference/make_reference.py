"""Regenerate ``reference.json``: inputs and verl 0.9.1's outputs for hybridlab's algorithms.

verl is not a dependency: this script runs where its algorithm module can be imported, and the
test suite (``tests/test_verl_reference.py``) only reads the JSON it writes. To regenerate:

    pip download --no-deps verl==0.9.1 -d /tmp/verl-wheel
    python -m zipfile -e /tmp/verl-wheel/verl-0.9.1-py3-none-any.whl /tmp/verl-src
    pip install --target /tmp/verl-deps --no-deps omegaconf antlr4-python3-runtime==4.9.3 \\
        tensordict pyvers codetiming orjson
    PYTHONPATH=/tmp/verl-deps python tests/verl_reference/make_reference.py /tmp/verl-src

verl's package ``__init__`` imports its whole runtime; the script registers an empty ``verl``
package over the unpacked source, so only the algorithm module and its small imports load.
Inputs are fixed numbers (written into the JSON), so the test does not depend on an RNG.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).with_name("reference.json")
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class Config(dict):
    """A dict that also answers attribute access (None when missing), as verl's configs do."""

    def __getattr__(self, key):
        return self.get(key)


def load_verl(source: str):
    package = types.ModuleType("verl")
    package.__path__ = [str(Path(source) / "verl")]
    sys.modules["verl"] = package
    from verl.trainer.ppo import core_algos

    return core_algos


def masks() -> dict[str, list[list[float]]]:
    """Response masks: right padding with a length-1 response, interior spans (tool output), an empty row."""
    return {"right_padding": [[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]],
            "interior_spans": [[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0]],
            "with_empty_row": [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]}


def numbers(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).round(decimals=4).tolist()


def tensors(case: dict) -> dict:
    return {k: torch.tensor(v, dtype=torch.float32) if isinstance(v, list) and k != "index" else v
            for k, v in case.items()}


def agg_cases(C) -> list[dict]:
    cases = []
    for name, mask in masks().items():
        loss = numbers((4, 6), 1)
        for mode in MODES:
            for extra in ({}, {"dp_size": 2, "batch_num_tokens": 30.0, "global_batch_size": 7.0},
                          {"loss_scale_factor": 4.0}):
                if "loss_scale_factor" in extra and mode != "seq-mean-token-sum-norm":
                    continue
                case = {"fn": "agg_loss", "name": f"{mode} {name} {sorted(extra)}", "loss_mat": loss, "loss_mask": mask,
                        "loss_agg_mode": mode, "kwargs": extra}
                case["expected"] = float(C.agg_loss(torch.tensor(loss), torch.tensor(mask, dtype=torch.float32),
                                                    mode, **extra))
                cases.append(case)
    return cases


def policy_call(C, name: str, inputs: dict, mode: str, cfg: Config, is_weights) -> dict:
    """Run verl's policy loss ``name``; returns its loss, metrics and gradient w.r.t. log_prob."""
    log_prob = torch.tensor(inputs["log_prob"], requires_grad=True)
    torch.manual_seed(0)  # clip_cov draws from the global RNG; the test seeds the same way
    loss, metrics = C.get_policy_loss_fn(name)(
        torch.tensor(inputs["old_log_prob"]), log_prob, torch.tensor(inputs["advantages"]),
        torch.tensor(inputs["response_mask"], dtype=torch.float32), mode, cfg,
        None if is_weights is None else torch.tensor(is_weights))
    loss.backward()
    return {"expected": float(loss.detach()), "expected_metrics": metrics, "expected_grad": log_prob.grad.tolist()}


BATCHES: dict[str, dict] = {}  # policy-loss inputs, stored once in the JSON and named by the cases
BYPASS = [{"loss_type": "ppo_clip"},
          {"loss_type": "ppo_clip", "rollout_rs": "token_k3", "rollout_rs_threshold": 0.05},
          {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 2.0},
          {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.5,
           "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.1"},
          {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": "0.5_2.0",
           "rollout_is_batch_normalize": True}]


def policy_cases(C) -> list[dict]:
    C.ActorConfig = Config  # some losses assert an ActorConfig; a dict with attribute access is what they read
    cases = []
    mask = masks()["right_padding"]
    old = numbers((4, 6), 2, 0.5)
    new = [[o + d for o, d in zip(row, drow)] for row, drow in zip(old, numbers((4, 6), 3, 0.4))]
    new[0][0] = old[0][0] + 25.0   # a log-ratio beyond the +-20 clamp
    new[3][0] = old[3][0] - 25.0
    inputs = {"old_log_prob": old, "log_prob": new, "advantages": numbers((4, 6), 4), "response_mask": mask}
    weights = [[abs(x) for x in row] for row in numbers((4, 6), 5)]
    # a batch without the +-25 outliers, where the covariance-based losses pick interior tokens
    calm = {**inputs, "log_prob": [[o + d for o, d in zip(row, drow)] for row, drow in zip(old, numbers((4, 6), 8, 0.3))],
            "advantages": numbers((4, 6), 9, 2.0)}
    BATCHES.update(outliers=inputs, calm=calm, is_weights=weights)
    settings = [("symmetric", {"clip_ratio": 0.2}),
                ("asymmetric", {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
                ("dual clip 1.5", {"clip_ratio": 0.2, "clip_ratio_c": 1.5})]
    for label, config in settings:
        for mode in MODES:
            for info in ({}, {"global_batch_info": {"dp_size": 2, "batch_num_tokens": 30.0, "global_batch_size": 7.0}},
                         {"global_batch_info": {"loss_scale_factor": 4.0}},
                         {"loss_scale_factor": 4.0}):  # verl's policy losses read only global_batch_info
                for is_weights in (None, weights):
                    if "loss_scale_factor" in json.dumps(info) and mode != "seq-mean-token-sum-norm":
                        continue
                    cfg = Config({**config, "global_batch_info": {}, **info})
                    cases.append({"fn": "policy_loss", "policy_loss": "vanilla",
                                  "name": f"vanilla {label} {mode} {json.dumps(info)} is={is_weights is not None}",
                                  "batch": "outliers", "loss_agg_mode": mode, "config": dict(cfg),
                                  "rollout_is_weights": None if is_weights is None else "is_weights",
                                  **policy_call(C, "vanilla", inputs, mode, cfg, is_weights)})
    others = {"gspo": [{"clip_ratio": 0.2}, {"clip_ratio": 0.2, "clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004}],
              "sapo": [{"tau_pos": 1.0, "tau_neg": 1.05}, {"tau_pos": 2.0, "tau_neg": 3.0}],
              "gpg": [{}],
              "geo_mean": [{"clip_ratio": 0.4}, {"clip_ratio": 0.2, "clip_ratio_low": 0.1, "clip_ratio_high": 0.3}],
              "cispo": [{"clip_ratio": 0.2}, {"clip_ratio": 0.2, "clip_ratio_low": 1.0, "clip_ratio_high": 4.0}],
              "dro": [{"policy_loss": {"dro_beta": 0.1}}, {"policy_loss": {"dro_beta": 2.0}}],
              "clip_cov": [{"clip_ratio": 0.2, "policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0,
                                                               "clip_cov_ub": 5.0}},
                           {"clip_ratio": 0.2, "policy_loss": {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                                                               "clip_cov_ub": 5.0}}],
              "kl_cov": [{"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}},
                         {"policy_loss": {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}}],
              "dppo_tv": [{"clip_ratio": 0.2}, {"clip_ratio": 0.2, "clip_ratio_low": 0.05, "clip_ratio_high": 0.1,
                                                "clip_ratio_c": 3.0}],
              "dppo_kl": [{"clip_ratio": 0.05}, {"clip_ratio": 0.2, "clip_ratio_low": 0.01, "clip_ratio_high": 0.3,
                                                 "clip_ratio_c": 3.0}],
              "bypass_mode": [{"clip_ratio": 0.2, "policy_loss": {"rollout_correction": c}} for c in BYPASS]}
    for name, configs in others.items():
        for config in configs:
            for batch_label, batch in (("outliers", inputs), ("calm", calm)):
                for mode in ("token-mean", "seq-mean-token-sum-norm"):
                    for info, is_weights in (({}, None), ({"global_batch_info": {"dp_size": 2, "batch_num_tokens": 30.0,
                                                                                 "global_batch_size": 7.0}}, weights)):
                        cfg = Config({"global_batch_info": {}, **config, **info})
                        if "policy_loss" in cfg:
                            cfg["policy_loss"] = Config({k: Config(v) if isinstance(v, dict) else v
                                                         for k, v in cfg["policy_loss"].items()})
                        cases.append({"fn": "policy_loss", "policy_loss": name,
                                      "name": f"{name} {json.dumps(config)} {batch_label} {mode} {json.dumps(info)}",
                                      "batch": batch_label, "loss_agg_mode": mode,
                                      "config": json.loads(json.dumps(cfg)),
                                      "rollout_is_weights": None if is_weights is None else "is_weights",
                                      **policy_call(C, name, batch, mode, cfg, is_weights)})
    return cases


def advantage_cases(C) -> list[dict]:
    # groups of sizes 1, 2 and 4 interleaved; group "d" has equal scores
    index = ["a", "b", "c", "b", "c", "c", "c", "d", "d"]
    lengths = [1, 3, 6, 2, 5, 6, 4, 3, 3]
    mask = [[1.0] * n + [0.0] * (6 - n) for n in lengths]
    mask[2] = [1, 1, 0, 0, 1, 1]   # an interior span in a response (tool output)
    mask[5] = [1, 0, 1, 1, 0, 1]
    scores = [0.5, 1.0, 0.0, 0.25, 1.0, 0.75, 0.0, 0.5, 0.5]
    outcome = [[0.0] * 6 for _ in index]
    for i, row in enumerate(mask):
        outcome[i][max(j for j, m in enumerate(row) if m)] = scores[i]
    dense = numbers((9, 6), 6)          # rewards on every token, also under the interior spans
    values = numbers((9, 6), 7)
    cases = []

    def add(estimator, call, **inputs):
        def arg(k, v):
            if k == "index":
                return np.array(v, dtype=object)
            if k == "batch":
                return {f: torch.tensor(x, dtype=torch.long) for f, x in v.items()}
            return torch.tensor(v, dtype=torch.float32) if isinstance(v, list) and k != "non_tensor_batch" else v
        adv, ret = call(**{k: arg(k, v) for k, v in inputs.items()})
        cases.append({"fn": "advantage", "estimator": estimator, "name": f"{estimator} {sorted(inputs)}",
                      "inputs": inputs, "expected": adv.tolist(), "expected_returns": ret.tolist()})

    for norm in (True, False):
        add("grpo", C.compute_grpo_outcome_advantage, token_level_rewards=outcome, response_mask=mask, index=index,
            norm_adv_by_std_in_grpo=norm)
    add("rloo", C.compute_rloo_outcome_advantage, token_level_rewards=outcome, response_mask=mask, index=index,
        config=Config())
    add("reinforce_plus_plus_baseline", C.compute_reinforce_plus_plus_baseline_outcome_advantage,
        token_level_rewards=outcome, response_mask=mask, index=index, config=Config())
    for gamma in (1.0, 0.9):
        for rewards in (outcome, dense):
            add("reinforce_plus_plus", C.compute_reinforce_plus_plus_outcome_advantage, token_level_rewards=rewards,
                response_mask=mask, config=Config(gamma=gamma))
    add("remax", C.compute_remax_outcome_advantage, token_level_rewards=outcome, response_mask=mask,
        reward_baselines=[0.25, 1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.5, 0.25], config=Config())
    for norm in (True, False):
        add("grpo_vectorized", C.compute_grpo_vectorized_outcome_advantage, token_level_rewards=outcome,
            response_mask=mask, index=index, norm_adv_by_std_in_grpo=norm)
        # Pass@k needs groups of two or more: the rows without the single-sample group "a"
        add("grpo_passk", C.compute_grpo_passk_outcome_advantage, token_level_rewards=outcome[1:],
            response_mask=mask[1:], index=index[1:], config=Config(norm_adv_by_std_in_grpo=norm))
    add("rloo_vectorized", C.compute_rloo_vectorized_outcome_advantage, token_level_rewards=outcome,
        response_mask=mask, index=index, config=Config())
    add("opo", C.compute_opo_outcome_advantage, token_level_rewards=outcome, response_mask=mask, index=index,
        config=Config())
    add("gpg", C.compute_gpg_outcome_advantage, token_level_rewards=outcome, response_mask=mask, index=index,
        config=Config())
    add("gdpo", C.compute_gdpo_outcome_advantage, token_level_rewards=outcome, response_mask=mask, index=index)
    last = [max(j for j, m in enumerate(row) if m) for row in mask]
    components = {"format_reward": [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0],
                  "accuracy_reward": scores}
    batch = {"prompts": [[5, 6, 7]] * 9,
             "attention_mask": [[1, 1, 1] + [int(j <= last[i]) for j in range(6)] for i in range(9)]}
    for weights in (None, [0.5, 2.0]):
        add("gdpo", C.compute_gdpo_outcome_advantage, token_level_rewards=outcome, response_mask=mask, index=index,
            norm_adv_by_std_in_grpo=weights is None, non_tensor_batch=components, batch=batch,
            config=Config(gdpo_reward_keys=["format_reward", "accuracy_reward"], gdpo_reward_weights=weights))
    old = [[-abs(x) for x in row] for row in numbers((9, 6), 10, 1.5)]
    sum_pi_squared = [[min(0.95, 0.05 + abs(x) / 3) for x in row] for row in numbers((9, 6), 11)]
    is_weights = [[min(2.0, abs(x)) for x in row] for row in numbers((9, 6), 12)]
    for name, fn in (("optimal_token_baseline", C.compute_optimal_token_baseline_advantage),
                     ("tir_optimal_token_baseline", C.compute_multi_turn_optimal_token_baseline_advantage)):
        for rewards in (outcome, dense):
            for weights, tail in ((None, True), (is_weights, True), (None, False)):
                add(name, fn, token_level_rewards=rewards, response_mask=mask, index=index, old_log_probs=old,
                    sum_pi_squared=sum_pi_squared, rollout_is_weights=weights, handle_zero_tail=tail)
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
        add("gae", C.compute_gae_advantage_return, token_level_rewards=dense, values=values, response_mask=mask,
            gamma=gamma, lam=lam)
    for case in cases:  # JSON-friendly configs
        if isinstance(case["inputs"].get("config"), Config):
            case["inputs"]["config"] = dict(case["inputs"]["config"])
    return cases


def correction_cases() -> list[dict]:
    """compute_rollout_correction_and_rejection_mask under every IS level, threshold form and
    rejection option; the trainer's log-probs are the calm batch's, the rollout's its old ones."""
    from verl.trainer.ppo import rollout_corr_helper as H

    settings = [{}, {"rollout_is": "token"}, {"rollout_is": "sequence", "rollout_is_threshold": 3.0},
                {"rollout_is": "token", "rollout_is_threshold": "0.8_1.25"},
                {"rollout_is": "token", "rollout_is_batch_normalize": True},
                {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True},
                {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"},
                {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.3},
                {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
                {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2.0,0.05"},
                {"rollout_rs": "seq_max_k2,seq_max_k3,seq_sum_k2", "rollout_rs_threshold": 0.1},
                {"rollout_is": "token", "rollout_rs": "seq_sum_k1,seq_sum_k3,seq_mean_k2,token_k2,token_k3",
                 "rollout_rs_threshold": "0.5_3.0,0.2,0.02,0.05,0.05"}]
    cases = []
    for mask_name in ("right_padding", "with_empty_row"):
        mask = masks()[mask_name]
        for setting in settings:
            weights, new_mask, metrics = H.compute_rollout_correction_and_rejection_mask(
                torch.tensor(BATCHES["calm"]["log_prob"]), torch.tensor(BATCHES["calm"]["old_log_prob"]),
                torch.tensor(mask, dtype=torch.float32), **setting)
            cases.append({"fn": "rollout_correction", "name": f"rollout correction {mask_name} {json.dumps(setting)}",
                          "response_mask": mask, "settings": setting, "expected_mask": new_mask.tolist(),
                          "expected_weights": None if weights is None else weights.batch["rollout_is_weights"].tolist(),
                          "expected_metrics": metrics})
    return cases


def rounded(value):
    """Return ``value`` with floats to 9 significant digits (more than fp32 holds)."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def main(source: str) -> None:
    C = load_verl(source)
    cases = [rounded(c) for c in agg_cases(C) + policy_cases(C) + advantage_cases(C) + correction_cases()]
    OUT.write_text(json.dumps({"verl": "0.9.1", "batches": rounded(BATCHES), "cases": cases},
                              separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases -> {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_reference.py VERL_SOURCE_DIR (the unpacked verl 0.9.1 wheel)")
    main(sys.argv[1])
