"""RewardWorker's scorers, used in-process: rules, a user's function that sometimes raises, and
a reward model with a scalar head compared with transformers."""
from __future__ import annotations

import pytest
import torch

from hybridlab.batching import on_last_token, sequences_batch
from hybridlab.protocol import Batch
from hybridlab.workers.reward.worker import RewardWorker


def _batch(tokenizer, prompts, responses, truths, source="arith") -> Batch:
    p_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    r_ids = [tokenizer(r, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for r in responses]
    batch = sequences_batch(p_ids, r_ids, tokenizer.pad_token_id)
    batch.objects.update(ground_truth=list(truths), data_source=[source] * len(prompts))
    return batch


def test_rule_scores_sit_on_the_last_response_token(tiny_dir):
    worker = RewardWorker(str(tiny_dir), kind="rule", format_score=0.1)
    batch = _batch(worker.tokenizer, ["1+2=", "3+4=", "5+5="], ["3", "8", "ten"], ["3", "7", "10"])
    out = worker.compute_reward(batch)
    scores = out["token_level_scores"]
    lengths = batch["response_mask"].sum(-1)
    assert torch.allclose(scores.sum(-1), torch.tensor([1.0, 0.1, 0.0]))  # right, well-formed wrong, malformed
    for i, n in enumerate(lengths.tolist()):
        assert scores[i, n - 1] == scores[i].sum()
    assert out["acc"].tolist() == [1.0, 0.0, 0.0] and out["reward_error"].sum() == 0


def test_a_raising_reward_function_scores_error_score_and_is_counted(tiny_dir, tmp_path):
    module = tmp_path / "my_reward.py"
    module.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == '8':\n"
        "        raise RuntimeError('cannot parse ' + solution_str)\n"
        "    return {'score': 2.0 if solution_str == ground_truth else -1.0, 'acc': solution_str == ground_truth}\n")
    worker = RewardWorker(str(tiny_dir), kind="function", function=f"{module}:compute_score", error_score=-5.0)
    out = worker.compute_reward(_batch(worker.tokenizer, ["1+2=", "3+4=", "5+5="], ["3", "8", "11"], ["3", "7", "10"]))
    assert out["token_level_scores"].sum(-1).tolist() == [2.0, -5.0, -1.0]
    assert out["reward_error"].tolist() == [0.0, 1.0, 0.0]
    assert out["reward_error_msg"][1] == "RuntimeError: cannot parse 8"
    assert out["acc"].tolist() == [1.0, 0.0, 0.0]


def test_reward_components_reach_gdpo_as_verl_passes_them(tiny_dir, tmp_path):
    """A dict answer's other numbers are the sample's components (verl's reward_extra_info);
    GDPO normalizes each within its group (config.gdpo_reward_keys), as verl's estimator does
    when handed them."""
    import hybridlab.algos as A
    from hybridlab.algos.advantages import compute_advantage

    module = tmp_path / "parts.py"
    module.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = float(solution_str == ground_truth)\n"
        "    fmt = float(solution_str.isdigit())\n"
        "    return {'score': right + fmt, 'accuracy_reward': right, 'format_reward': fmt, 'note': 'text'}\n")
    worker = RewardWorker(str(tiny_dir), kind="function", function=f"{module}:compute_score")
    batch = _batch(worker.tokenizer, ["1+2=", "1+2=", "3+4=", "3+4="], ["3", "x", "7", "8"], ["3", "3", "7", "7"])
    out = worker.compute_reward(batch)
    assert out["reward_extra_info"] == [{"accuracy_reward": 1.0, "format_reward": 1.0},
                                        {"accuracy_reward": 0.0, "format_reward": 0.0},
                                        {"accuracy_reward": 1.0, "format_reward": 1.0},
                                        {"accuracy_reward": 0.0, "format_reward": 1.0}]
    config = {"gdpo_reward_keys": ["format_reward", "accuracy_reward"], "gdpo_reward_weights": [1.0, 2.0]}
    fields = {"token_level_rewards": out["token_level_scores"], "response_mask": batch["response_mask"],
              "uid": ["a", "a", "b", "b"], "reward_extra_info": out["reward_extra_info"],
              "prompts": batch["prompts"], "attention_mask": batch["attention_mask"]}
    adv, _ = compute_advantage("gdpo", fields, config)
    mask = batch["response_mask"].float()
    fmt, acc = (A.compute_grpo_outcome_advantage(on_last_token(torch.tensor(v), batch["response_mask"]), mask,
                                                 fields["uid"])[0]
                for v in ([1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]))
    expected = A.masked_whiten(fmt + 2.0 * acc, mask) * mask
    assert torch.allclose(adv, expected, atol=1e-6)
    assert not torch.allclose(adv, compute_advantage("gdpo", fields, None)[0], atol=1e-3)  # not the total's


def test_reward_model_scores_equal_transformers(tiny_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hybridlab.models.zoo import build_reward_model

    rm_dir = build_reward_model(tiny_dir, tmp_path / "rm", seed=3)
    worker = RewardWorker(str(tiny_dir), kind="rule")
    batch = _batch(worker.tokenizer, ["1+2=", "13+24="], ["3", "37"], ["3", "37"])
    out = worker.compute_model_reward(batch, str(rm_dir))
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    expect = []
    for i in range(len(batch)):  # one unpadded sequence at a time
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].unsqueeze(0)
        with torch.no_grad():
            expect.append(float(model(input_ids=ids).logits[0, 0]))
    assert torch.allclose(out["token_level_scores"].sum(-1), torch.tensor(expect), atol=1e-5)
    assert out["acc"].tolist() == [1.0, 1.0]


def test_none_strings_nan_and_inf_score_error_score_and_are_counted(tiny_dir, tmp_path):
    module = tmp_path / "odd_reward.py"
    module.write_text(
        "import math\n"
        "ANSWERS = {'1': None, '2': 'good', '3': math.nan, '4': -math.inf, '5': {'score': math.nan}, '6': 0.5}\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return ANSWERS[solution_str]\n")
    worker = RewardWorker(str(tiny_dir), kind="function", function=f"{module}:compute_score", error_score=-1.0)
    batch = _batch(worker.tokenizer, ["a"] * 6, ["1", "2", "3", "4", "5", "6"], ["0"] * 6)
    out = worker.compute_reward(batch)
    assert out["token_level_scores"].sum(-1).tolist() == [-1.0] * 5 + [0.5]
    assert out["reward_error"].tolist() == [1.0] * 5 + [0.0]
    assert out["reward_error_msg"][:5] == ["ValueError: reward function returned NoneType None, not a number",
                                           "ValueError: reward function returned str 'good', not a number",
                                           "ValueError: reward function returned nan, not a finite number",
                                           "ValueError: reward function returned -inf, not a finite number",
                                           "ValueError: reward function returned nan, not a finite number"]


def test_a_bad_reward_function_is_refused_with_the_config_before_any_worker(tmp_path):
    import pytest

    from hybridlab.config import ConfigError
    from hybridlab.run_config import load_config

    module = tmp_path / "bad_reward.py"
    module.write_text("SCORE = 1.0\ndef two_args(a, b):\n    return 1.0\n")
    cases = [("nowhere_pkg.rewards:score", "cannot import 'nowhere_pkg.rewards'"),
             (f"{module}:missing", "has no function 'missing'"),
             (f"{module}:SCORE", ":SCORE is a float, not a function"),
             (f"{module}:two_args", ":two_args(a, b) cannot be called as fn(data_source=..., solution_str=...,"
                                    " ground_truth=..., extra_info=...) (verl's compute_score, called by keyword)")]
    for spec, message in cases:
        with pytest.raises(ConfigError, match="reward.function") as err:
            load_config(None, ["reward.kind=function", f"reward.function={spec}"])
        assert message in str(err.value), str(err.value)


def test_a_hanging_reward_function_is_cut_off_by_timeout_s(tiny_dir, tmp_path):
    module = tmp_path / "hanging_reward.py"
    module.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == '2':\n"
        "        while True:  # a busy hang: only killing the scorer stops it\n"
        "            pass\n"
        "    return 1.0\n")
    worker = RewardWorker(str(tiny_dir), kind="function", function=f"{module}:compute_score", error_score=-1.0,
                          timeout_s=3.0)
    out = worker.compute_reward(_batch(worker.tokenizer, ["a"] * 3, ["1", "2", "3"], ["0"] * 3))
    assert out["token_level_scores"].sum(-1).tolist() == [1.0, -1.0, -1.0]  # scored, hung, never reached
    assert out["reward_error"].tolist() == [0.0, 1.0, 1.0]
    assert out["reward_error_msg"][1] == "TimeoutError: reward.timeout_s=3 s passed before this sample was scored"
    again = worker.compute_reward(_batch(worker.tokenizer, ["a"], ["1"], ["0"]))  # the next batch is fine
    assert again["token_level_scores"].sum(-1).tolist() == [1.0] and again["reward_error"].tolist() == [0.0]


def test_verl_sources_are_scored_by_the_reward_worker_as_verl_scores_them(tiny_dir):
    """GSM8K's strict extraction with the format score, DAPO's +-1 with its acc and pred (its
    string ``pred`` is not a component), and math-verify's algebra where the setting asks for it."""
    worker = RewardWorker(str(tiny_dir), kind="rule", format_score=0.1)
    gsm = worker.compute_reward(_batch(worker.tokenizer, ["q"] * 3, ["so\n#### 72", "#### 73", "72"], ["72"] * 3,
                                       source="openai/gsm8k"))
    assert gsm["token_level_scores"].sum(-1).tolist() == pytest.approx([1.0, 0.1, 0.0])
    assert gsm["acc"].tolist() == [1.0, 0.0, 0.0]
    dapo = worker.compute_reward(_batch(worker.tokenizer, ["q"] * 2, ["Answer: 34", "Answer: 35"], ["34"] * 2,
                                        source="aime2024"))
    assert dapo["token_level_scores"].sum(-1).tolist() == [1.0, -1.0] and dapo["acc"].tolist() == [1.0, 0.0]
    assert dapo.objects["reward_extra_info"] == [{}, {}]
    # what verl records of each answer (its validation's maj@N votes on pred); GSM8K's is a bare number
    assert dapo.objects["reward_answer"] == [{"score": 1.0, "acc": 1.0, "pred": "34"},
                                             {"score": -1.0, "acc": 0.0, "pred": "35"}]
    assert gsm.objects["reward_answer"] == [{}, {}, {}]
    algebra = RewardWorker(str(tiny_dir), kind="rule", math_verifier="math-verify")
    out = algebra.compute_reward(_batch(algebra.tokenizer, ["q"] * 2, ["\\boxed{2/4}", "\\boxed{3/4}"],
                                        ["\\frac{1}{2}"] * 2, source="lighteval/MATH"))
    assert out["token_level_scores"].sum(-1).tolist() == [1.0, 0.0] and out["reward_error"].sum() == 0
