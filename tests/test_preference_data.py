"""Preference pairs as data (``hybridlab.tasks.preferences``): TRL's columns read from parquet and
JSONL with errors that name the file, row and field; pairs made from a task; the config checks of
offline DPO (``data.preferences``)."""
import json
import random

import pytest

from hybridlab.cli import main
from hybridlab.config import ConfigError
from hybridlab.errors import UserError
from hybridlab.tasks import TASKS, Task, get_task
from hybridlab.tasks.preferences import PreferencePair, load_preferences, save_preferences, task_pairs


@pytest.mark.parametrize("task", ["arith", "reverse", "countdown"])
def test_task_pairs_prefer_the_right_answer_to_a_well_formed_wrong_one(task):
    t = get_task(task)
    samples = t.split("train", 200, seed=3)
    pairs = task_pairs(t, "train", 200, seed=3)
    assert [p.prompt for p in pairs] == [s.prompt for s in samples]
    for pair, sample in zip(pairs, samples):
        assert t.check(pair.chosen, sample.ground_truth) == (True, True)
        correct, well_formed = t.check(pair.rejected, sample.ground_truth)
        assert not correct and (well_formed or task == "countdown"), (pair, sample)
    if task == "arith":  # off by a slip: a unit or a carry
        gaps = {abs(int(p.rejected) - int(p.chosen)) for p in pairs}
        assert gaps == {1, 2, 10, 11}


def test_hybridlab_data_writes_the_task_pairs_in_trl_columns(tmp_path, capsys):
    for out, chat in ((tmp_path / "p.jsonl", False), (tmp_path / "c.parquet", True)):
        args = ["data", "--task", "arith", "--preferences", "--n", "20", "--seed", "1", "--out", str(out)]
        assert main(args + (["--chat"] if chat else [])) == 0
        assert load_preferences(out) == task_pairs(get_task("arith"), "train", 20, seed=1, chat=chat)
    row = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])
    assert set(row) == {"prompt", "chosen", "rejected"}
    assert main(["data", "--task", "arith", "--chat", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "--chat writes preference pairs as chat messages, so it needs --preferences" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    chat = load_preferences(tmp_path / "c.parquet")[0]
    assert chat.conversational and chat.prompt[0]["role"] == "user" and chat.chosen[0]["role"] == "assistant"


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


USER, BLUE, GREEN = ({"role": "user", "content": "sky?"}, {"role": "assistant", "content": "blue"},
                     {"role": "assistant", "content": "green"})


def test_the_prompt_is_implicit_in_shared_messages_as_in_trl(tmp_path):
    path = _write(tmp_path, [{"chosen": [USER, BLUE], "rejected": [USER, GREEN]}], "pairs.parquet")
    assert load_preferences(path) == [PreferencePair([USER], [BLUE], [GREEN])]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1=", "rejected": "3"}, "row 2: missing field 'chosen'"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": [GREEN]}, "row 2: fields 'chosen' and 'rejected' must both be"),
    ({"chosen": "2", "rejected": "3"}, "row 2: no field 'prompt', and 'chosen' and 'rejected' share no text"),
    ({"prompt": ["1+1="], "chosen": "2", "rejected": "3"}, "row 2: field 'prompt' is a list, not text"),
    ({"prompt": "1+1=", "data_source": "arith", "reward_model": {"ground_truth": "2"}},
     "row 2: missing field 'chosen' \\(this row has verl's prompt columns: data.preferences=true reads preference"),
    ({"prompt": "1+1=", "chosen": "", "rejected": "3"}, "row 2: field 'chosen' is empty"),
    ({"prompt": [USER], "chosen": [BLUE], "rejected": [{"role": "assistant"}]},
     r"row 2: field 'rejected'\[0\] must be a message with string 'role' and 'content'"),
    ({"chosen": [BLUE], "rejected": [GREEN]}, "row 2: no field 'prompt', and 'chosen' and 'rejected' share no"),
    ({"prompt": "sky?", "chosen": [BLUE], "rejected": [GREEN]}, "row 2: field 'prompt' must be a list of chat"),
    ({"prompt": "1+1=", "chosen": 2, "rejected": 3}, "row 2: field 'chosen' must be text or a list of chat messages"),
])
def test_a_bad_row_is_refused_with_its_file_row_and_field(tmp_path, row, message):
    path = _write(tmp_path, [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, row])
    with pytest.raises(UserError, match=f"^{path}: {message}"):
        load_preferences(path)


def test_a_text_prompt_is_implicit_as_in_trl_and_rows_are_numbered_by_their_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"}, {"prompt": "1+1=", "chosen": "2"}]
    path.write_text("\n" + json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # blank lines 1 and 3
    with pytest.raises(UserError, match=r"pairs.jsonl: row 4: missing field 'rejected'"):  # the editor's line
        load_preferences(path)
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"chosen": "Q: hi A: yo", "rejected": "Q: hi A: hey"}))
    first, second = load_preferences(path)
    # trl.data_utils.extract_prompt's results on these rows: the space before the answers goes with them
    assert (first.prompt, first.chosen, first.rejected) == ("Q: 2+2? A:", " 4", " 5")
    assert (second.prompt, second.chosen, second.rejected) == ("Q: hi A:", " yo", " hey")


def test_unreadable_files_are_refused_by_name(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{oops\n')
    with pytest.raises(UserError, match=r"bad.jsonl: row 2: not valid JSON"):
        load_preferences(bad)
    with pytest.raises(UserError, match=r"pairs.csv: unsupported dataset format '.csv'; use one of: .parquet, .jsonl"):
        save_preferences([], tmp_path / "pairs.csv")
    with pytest.raises(UserError, match=r"task 'x' cannot write preference pairs"):
        type("X", (Task,), {"name": "x"})().wrong_answer(None, random.Random(0))


def test_offline_dpo_settings_are_checked_by_name(tiny_dir, tmp_path):
    from hybridlab.dataflow.defaults import dataflow_names
    from hybridlab.run_config import load_config

    cfg = load_config("dpo", [f"model={tiny_dir}"])
    assert dataflow_names(cfg) == ["ref_logprob", "update_actor_dpo", "sync_weights"]
    with pytest.raises(ConfigError, match=r"dpo.online: online DPO pairs the policy's own samples, but"
                                          r" data.preferences reads the pairs from the data"):
        load_config("dpo", ["dpo.online=true"])
    with pytest.raises(ConfigError, match=r"data.prompts_per_step: 3 preference pairs per step do not split over the"
                                          r" actor's data-parallel size 2"):
        load_config("dpo", ["data.prompts_per_step=3", "trainer.devices=2"])
    with pytest.raises(ConfigError, match=r"trainer.rollout_data_dir: writes the generated samples of RL steps, and a"
                                          r" DPO step trains pairs"):
        load_config("dpo", ["trainer.rollout_data_dir=gen"])
    with pytest.raises(ConfigError, match=r"update_actor_dpo: input 'ref_log_prob' is not produced"):
        load_config("dpo", ["dataflow=[update_actor_dpo, sync_weights]"])
    with pytest.raises(ConfigError, match=r"data.train_files: no file"):
        load_config("dpo", [f"data.train_files={tmp_path / 'none.parquet'}", "warm_start.max_steps=0"])
    no_reward = "mapping={pools: {p: {devices: 1}}, roles: {actor: {pool: p, colocate: e}, ref: {pool: p, colocate: e}," \
                " rollout: {pool: p, colocate: e}}}"
    with pytest.raises(ConfigError) as err:
        load_config("dpo", [no_reward])
    assert str(err.value) == ("config is invalid:\n  - mapping: the greedy evaluation of the test prompts generates on"
                              " the rollout and scores on the reward role; add reward")

    class Plain(Task):  # a task of a user's own, without wrong answers
        name = "plain_for_test"
    TASKS[Plain.name] = Plain
    try:
        with pytest.raises(ConfigError, match=r"data.task: task 'plain_for_test' has no wrong_answer, so it cannot"
                                              r" make preference pairs; give them in data.train_files"):
            load_config("dpo", ["data.task=plain_for_test"])
    finally:
        del TASKS[Plain.name]


def test_a_chat_pair_needs_a_chat_template_and_a_resume_needs_the_same_data(tiny_dir):
    from transformers import AutoTokenizer

    from hybridlab.dataflow.pairs import PairSource
    from hybridlab.models.chat import check_chat

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    chat = task_pairs(get_task("arith"), "train", 4, chat=True)
    source = PairSource(chat, tokenizer, per_step=2)
    source.next()
    state = source.state()
    with pytest.raises(UserError, match=r"the checkpoint's training stream drew from 4 items, but this run's data has"
                                        r" 5: the training data .* changed since the checkpoint"):
        PairSource(task_pairs(get_task("arith"), "train", 5, chat=True), tokenizer, per_step=2).set_state(state)
    tokenizer.chat_template = None  # what the session checks before it makes the source
    with pytest.raises(UserError, match=r"^the task's prompts \(data.chat=true\): the prompt is a list of chat"
                                        r" messages, but the tokenizer of .* has no chat template.* set"
                                        r" data.chat_template"):
        check_chat(tokenizer, chat, tiny_dir)
    check_chat(tokenizer, task_pairs(get_task("arith"), "train", 4), tiny_dir)  # text pairs need no template
