"""reasoning-gym's generators as a task (hybridlab.tasks.reasoning_gym): its own scores on its
own entries, typed options, disjoint splits, the verl parquet `hybridlab data` writes, and a GRPO
step on it with the rewards reasoning-gym gives."""
from __future__ import annotations

import json
import math

import pytest
import reasoning_gym

from hybridlab.cli import main
from hybridlab.errors import UserError
from hybridlab.tasks import get_task, parse_task_options
from hybridlab.tasks.dataset import load_dataset
from hybridlab.workers.reward.scoring import rule_for

# arithmetic, counting, GCD/LCM, sorting and spelling: reasoning-gym's tasks of adjustable difficulty
DATASETS = {"chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 2}, "basic_arithmetic": {},
            "gcd": {}, "lcm": {}, "letter_counting": {}, "number_sorting": {}, "spell_backward": {}}


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_oracle_answers_score_one_and_other_answers_what_reasoning_gym_gives(name):
    task = get_task("reasoning_gym", name=name, **DATASETS[name])
    score_answer = reasoning_gym.get_score_answer_fn(name)
    for sample in task.split("train", 20, seed=0):
        entry = json.loads(sample.ground_truth)
        assert task.score(sample.answer, sample.ground_truth) == 1.0
        oracle = entry["answer"]
        padded = f"x {oracle} y"  # contains the oracle: partial credit, as reasoning-gym gives it
        assert task.score(f"think first <answer>{padded}</answer>", sample.ground_truth) == \
            score_answer(padded, entry)
        assert task.score("<answer>0</answer>", sample.ground_truth) == score_answer("0", entry)
        assert task.score("no tags at all", sample.ground_truth) == 0.0
    if type(task.dataset).score_answer is reasoning_gym.dataset.ProceduralDataset.score_answer:
        assert task.score(f"<answer>{padded}</answer>", sample.ground_truth) == len(oracle) / len(padded)


def test_the_same_seed_gives_the_same_rows_and_the_splits_never_share_a_question():
    task = get_task("reasoning_gym", name="chain_sum")
    train, again = task.split("train", 200, seed=3), task.split("train", 200, seed=3)
    assert train == again and task.split("train", 200, seed=4) != train
    test = task.split("test", 200, seed=3)
    assert not {s.extra_info["question"] for s in train} & {s.extra_info["question"] for s in test}
    assert train[0].prompt.startswith("Answer the question directly. Provide your answer between <answer> and"
                                      " </answer> tags.")  # reasoning-gym's "direct" system prompt


def test_options_keep_their_types_and_bad_ones_are_named():
    options = parse_task_options(["name=chain_sum", "min_terms=2", "allow_negation=true", "max_digits=3"])
    assert options == {"name": "chain_sum", "min_terms": 2, "allow_negation": True, "max_digits": 3}
    assert get_task("reasoning_gym", **options).dataset.config.allow_negation is True
    with pytest.raises(UserError, match=r"reasoning-gym has no dataset 'chain_summ'; it has: .*chain_sum"):
        get_task("reasoning_gym", name="chain_summ")
    with pytest.raises(UserError, match=r"reasoning-gym's chain_sum has no option 'min_term'; its options are:"
                                        r" min_terms, max_terms"):
        get_task("reasoning_gym", name="chain_sum", min_term=2)
    with pytest.raises(UserError, match=r"system_prompt .terse. is none of reasoning-gym.s \(DeepSeekZero, default"):
        get_task("reasoning_gym", name="chain_sum", system_prompt="terse")
    with pytest.raises(UserError, match=r"cannot produce 40 distinct train prompts.*; or draw from a larger pool of"
                                        r" entries \(task option pool, now 30\)$"):
        get_task("reasoning_gym", name="chain_sum", pool=30).split("train", 40)
    # a generator that builds all its entries up front gets a bounded pool
    assert len(get_task("reasoning_gym", name="gsm_symbolic", pool=50).split("train", 3, seed=0)) == 3
    with pytest.raises(UserError, match=r"reasoning-gym's rubiks_cube has no oracle answer for its entries"):
        get_task("reasoning_gym", name="rubiks_cube")


def test_a_zoo_model_for_a_reasoning_gym_task_gets_a_tokenizer_trained_on_its_text():
    from transformers import AutoConfig, AutoTokenizer

    from hybridlab.models.zoo import resolve_model
    from hybridlab.run_config import load_config

    cfg = load_config(None, ["data.task=reasoning_gym", "data.task_options={name: chain_sum, min_terms: 2,"
                             " max_terms: 2, max_digits: 2, pool: 100000}"])
    own = resolve_model("tiny", data=cfg.data)
    zoo = resolve_model("tiny", data=load_config(None, []).data)  # arith: the zoo's own tokenizer
    assert own != zoo and zoo == resolve_model("tiny")
    assert resolve_model("tiny", data=cfg.data) == own  # built once, then reused
    sample = get_task("reasoning_gym", **cfg.data.task_options).split("test", 1)[0]
    lengths = {}
    for name, path in (("own", own), ("zoo", zoo)):
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok(sample.prompt + sample.answer).input_ids
        assert tok.decode(ids) == sample.prompt + sample.answer
        lengths[name] = len(ids)
        vocab = AutoConfig.from_pretrained(path).vocab_size
        assert vocab % 64 == 0 and len(tok) <= vocab < len(tok) + 64
    # reasoning-gym's fixed system prompt takes ~100 zoo tokens, about a third of that with its own
    assert lengths["own"] < 60 < 100 < lengths["zoo"]


def test_hybridlab_data_writes_a_verl_parquet_that_scores_the_same(tmp_path, capsys):
    out = tmp_path / "rg.parquet"
    assert main(["data", "--task", "reasoning_gym", "--task-opt", "name=chain_sum", "--task-opt", "max_terms=3",
                 "--n", "12", "--out", str(out)]) == 0
    rows = load_dataset(str(out))
    task = get_task("reasoning_gym", name="chain_sum", max_terms=3)
    assert [r.prompt for r in rows] == [s.prompt for s in task.split("train", 12, seed=0)]
    scorer = rule_for(rows[0].data_source)  # what a run that reads the parquet scores with
    for row in rows:
        assert scorer(row.answer, row.ground_truth)["score"] == 1.0
        assert scorer("<answer>x</answer>", row.ground_truth)["score"] == task.score("<answer>x</answer>",
                                                                                     row.ground_truth)


def test_a_grpo_step_trains_on_the_parquet_with_the_scores_reasoning_gym_gives(ray_local, tiny_dir, tmp_path):
    from hybridlab.dataflow.session import RLSession

    out = tmp_path / "rg.parquet"
    assert main(["data", "--task", "reasoning_gym", "--task-opt", "name=chain_sum", "--task-opt", "max_terms=2",
                 "--task-opt", "max_digits=1", "--n", "8", "--out", str(out)]) == 0
    rl = RLSession("grpo", [f"model={tiny_dir}", f"data.train_files={out}", "warm_start.max_steps=0",
                            "data.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=8",
                            "actor.ppo_mini_batch_size=4", "trainer.progress=false", f"trainer.run_dir={tmp_path / 'run'}"])
    try:
        step = rl.step()
        rows = rl.decoded(step.batch, limit=16)
    finally:
        rl.shutdown()
    batch, task = step.batch, get_task("reasoning_gym")
    assert len(rows) == 16 and set(batch.objects["data_source"]) == {"reasoning_gym"}
    expected = [task.score(row["response"], truth) for row, truth in zip(rows, batch.objects["ground_truth"])]
    assert batch["token_level_scores"].sum(-1).tolist() == expected
    assert math.isfinite(step.metrics["actor/pg_loss"]) and step.metrics["faults/bad_updates"] == 0  # the update ran
