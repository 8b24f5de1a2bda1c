"""Tasks: determinism, disjoint splits, scorers, and verl-format datasets with clear errors."""
import json

import pytest

from hybridlab.errors import UserError
from hybridlab.tasks import get_task
from hybridlab.tasks.base import task_for_source
from hybridlab.tasks.countdown import evaluate
from hybridlab.tasks.dataset import load_dataset, save_dataset


@pytest.mark.parametrize("name", ["arith", "reverse", "countdown"])
def test_splits_are_deterministic_disjoint_and_solved_by_their_answers(name):
    task = get_task(name)
    train = task.split("train", 300, seed=3)
    assert train == task.split("train", 300, seed=3)
    assert train != task.split("train", 300, seed=4)
    test = task.split("test", 100, seed=3)
    assert not {s.prompt for s in train} & {s.prompt for s in test}
    for s in train[:50] + test[:50]:
        assert task.score(s.answer, s.ground_truth) == 1.0
        assert task.score(s.answer + "\nextra lines are ignored", s.ground_truth) == 1.0


def test_arith_scoring_and_format_score():
    task = get_task("arith", digits=3, ops="+-*", format_score=0.1)
    assert task.score(" 579", "579") == 1.0
    assert task.score("578", "579") == 0.1       # well formed, wrong
    assert task.score("five", "579") == 0.0       # malformed
    assert get_task("arith").score("578", "579") == 0.0
    prompts = [s.prompt for s in task.split("train", 200)]
    assert any("-" in p for p in prompts) and any("*" in p for p in prompts)
    assert max(len(p.split("+")[0]) for p in prompts if "+" in p) == 3


def test_countdown_checks_numbers_and_value():
    gt = {"target": 22, "numbers": [3, 5, 7]}
    task = get_task("countdown", format_score=0.1)
    assert task.score("3*5+7", gt) == 1.0
    assert task.score("(7+5)*3-14", gt) == 0.0      # 14 is not given
    assert task.score("3*5+7+7", gt) == 0.0         # 7 used twice
    assert task.score("3+5+7", gt) == 0.1           # valid expression, wrong value
    assert task.score("__import__('os')", gt) == 0.0
    assert task.score("3*5+7", json.dumps(gt)) == 1.0  # ground truth stored as JSON text
    with pytest.raises(ValueError):
        evaluate("2**10")


def test_unknown_task_and_option_errors_list_choices():
    with pytest.raises(UserError, match="choose one of: arith, calc, countdown, countdown_code, reasoning_gym, reverse"):
        get_task("sudoku")
    with pytest.raises(UserError, match="has no option 'digit'.*digits"):
        get_task("arith", digit=2)
    with pytest.raises(UserError, match="ops must be made of"):
        get_task("arith", ops="/")
    with pytest.raises(UserError, match="cannot produce 500 distinct train prompts"):
        get_task("arith", digits=1).split("train", 500)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dataset_round_trip_in_verl_columns(tmp_path, suffix):
    task = get_task("countdown")
    samples = task.split("test", 20)
    path = save_dataset(samples, tmp_path / f"cd{suffix}")
    loaded = load_dataset(path)
    assert [s.prompt for s in loaded] == [s.prompt for s in samples]
    for s, orig in zip(loaded, samples):
        scorer = task_for_source(s.data_source)
        assert scorer.score(orig.answer, s.ground_truth) == 1.0


def test_dataset_accepts_chat_prompts_and_names_bad_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = {"prompt": [{"role": "user", "content": "1+2="}], "data_source": "openai/gsm8k",
            "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 0}}
    bad = {"prompt": [{"role": "user", "content": "2+2="}], "data_source": "arith",
           "reward_model": {"style": "rule", "ground_truth": None}, "extra_info": {"index": 1}}
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([good]), path)
    (s,) = load_dataset(path)
    assert s.prompt == "1+2=" and s.ground_truth == "3" and s.extra_info["messages"][0]["role"] == "user"
    pq.write_table(pa.Table.from_pylist([good, bad]), path)
    with pytest.raises(UserError, match=r"d\.parquet: row 2: missing field 'reward_model.ground_truth'"):
        load_dataset(path)

    jl = tmp_path / "d.jsonl"
    jl.write_text(json.dumps({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}) + "\n")
    with pytest.raises(UserError, match=r"d\.jsonl: row 1: missing field 'data_source'"):
        load_dataset(jl)
    jl.write_text('{"prompt": "1+1=", \n')
    with pytest.raises(UserError, match=r"d\.jsonl: row 1: not valid JSON"):
        load_dataset(jl)
    with pytest.raises(UserError, match="unsupported dataset format '.csv'"):
        load_dataset(tmp_path / "d.csv")
    with pytest.raises(UserError, match="no built-in scorer for data_source 'openai/gsm8k'"):
        task_for_source(s.data_source)


ODD = ["2+3= \U0001F600 \u0645\u0631\u062d\u0628\u0627 e\u0301 a\u200db \u4e2d\u6587", "\u202eRTL override 7+1=",
       "tab\tand\u00a0nbsp 1+1="]


def write_rows(path, prompts) -> None:
    path.write_text("".join(json.dumps({"prompt": p, "data_source": "arith",
                                        "reward_model": {"ground_truth": "1"}}) + "\n" for p in prompts))


def test_prompts_are_checked_with_the_row_named_and_long_ones_refused_or_left_truncated(tmp_path, tiny_dir):
    from transformers import AutoTokenizer

    from hybridlab.dataflow.prompts import PromptFit, tokenize_prompts

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    path = tmp_path / "odd.jsonl"
    write_rows(path, ODD)
    samples = load_dataset(path)
    ids = tokenize_prompts(samples, tok, PromptFit(context=64, max_new_tokens=8))
    import unicodedata

    # odd Unicode goes through, as the tokenizer normalizes it (NFC: e + combining accent -> é)
    assert [tok.decode(i) for i in ids] == [unicodedata.normalize("NFC", p) for p in ODD] != ODD

    write_rows(path, ["1+1=", ""])
    with pytest.raises(UserError, match=r"odd.jsonl: row 2: the prompt is empty"):
        tokenize_prompts(load_dataset(path), tok)
    write_rows(path, ["1+1=", "1+1=", "bad \ud800 surrogate"])
    with pytest.raises(UserError, match=r"odd.jsonl: row 3: the prompt cannot be tokenized"):
        tokenize_prompts(load_dataset(path), tok)

    long = " ".join(str(i) for i in range(40))
    write_rows(path, ["1+1=", long])
    n = len(tok(long, add_special_tokens=False).input_ids)
    fit = PromptFit(context=32, max_new_tokens=8)
    with pytest.raises(UserError, match=rf"odd.jsonl: row 2: the prompt has {n} tokens, more than the 24 that fit \(the"
                                        r" model's context of 32 minus rollout.max_new_tokens=8\); shorten it, or set"
                                        r" data.truncate_prompts=true to keep its last 24 tokens"):
        tokenize_prompts(load_dataset(path), tok, fit)
    kept = tokenize_prompts(load_dataset(path), tok, PromptFit(context=32, max_new_tokens=8, truncate=True))
    assert kept[1] == tok(long, add_special_tokens=False).input_ids[-24:] and len(kept[0]) < 24


def test_a_session_refuses_bad_prompts_before_ray_starts(tmp_path, tiny_dir, monkeypatch):
    from hybridlab.dataflow import session as session_module
    from hybridlab.dataflow.session import RLSession

    def reached(**_):  # an earlier module's cluster may still be up, so the call itself is watched
        raise AssertionError("the session reached Ray before it checked the prompts")

    monkeypatch.setattr(session_module, "connect", reached)  # the name the session calls
    path = tmp_path / "train.jsonl"
    write_rows(path, ["1+1=", "2+2=", ""])
    rl = RLSession(None, [f"model={tiny_dir}", f"data.train_files={path}", "warm_start.max_steps=0",
                          f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match=r"train.jsonl: row 3: the prompt is empty"):
        rl.start()
    assert rl.workers is None


def test_a_session_refuses_a_data_source_without_a_scorer_before_ray_starts(tmp_path, tiny_dir, monkeypatch):
    """A GSM8K-style file whose third row comes from a source nothing scores: refused with its row
    and the sources that have a scorer, not trained on error_score throughout."""
    from hybridlab.dataflow import session as session_module
    from hybridlab.dataflow.session import RLSession
    from hybridlab.tasks.dataset import write_rows as write_verl_rows

    def reached(**_):
        raise AssertionError("the session reached Ray before it checked the data sources")

    monkeypatch.setattr(session_module, "connect", reached)
    path = write_verl_rows([{"prompt": f"{i}+1=", "data_source": source, "reward_model": {"ground_truth": str(i + 1)}}
                            for i, source in enumerate(["openai/gsm8k", "math_dapo", "hiyouga/geometry3k"])],
                           tmp_path / "train.parquet")
    rl = RLSession(None, [f"model={tiny_dir}", f"data.train_files={path}", "warm_start.max_steps=0",
                          f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match=r"train.parquet: row 3: no built-in scorer for data_source 'hiyouga/geometry3k':"
                                        r" an image task.*verl's openai/gsm8k, lighteval/MATH"):
        rl.start()
    assert rl.workers is None
