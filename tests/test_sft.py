"""Supervised warm start: the model learns, checkpoints are atomic, the CLI speaks plainly."""
import json

import pytest

from hybridlab import sft
from hybridlab.cli import main
from hybridlab.errors import UserError
from hybridlab.evaluate import accuracy, load_hf
from hybridlab.tasks import get_task


@pytest.fixture(scope="module")
def trained(tiny_dir):
    """Tiny model after 500 SFT steps on 2-digit addition (about 15 s on 2 cores)."""
    model, tok = load_hf(tiny_dir)
    task = get_task("arith", digits=2)
    summary = sft.train(model, tok, task, sft.SFTConfig(steps=500, warmup_steps=20), progress=False)
    return model, tok, task, summary


def test_sft_learns_addition(trained, tiny_dir):
    model, tok, task, summary = trained
    test = task.split("test", 200)
    untrained = accuracy(*load_hf(tiny_dir), task, test)["accuracy"]
    after = accuracy(model, tok, task, test)["accuracy"]
    assert summary["steps"] == 500
    assert summary["final_loss"] < summary["first_loss"] / 4
    assert untrained == 0.0 and after >= 0.05  # chance level is about 0.5%


def test_collate_masks_prompt_and_padding(tiny_dir):
    _, tok = load_hf(tiny_dir)
    task = get_task("arith")
    examples = sft.encode_examples(tok, task.split("train", 2), end=tok.eos_token_id)
    batch = sft.collate(examples, tok.pad_token_id)
    for row, (ids, prompt_len) in enumerate(examples):
        labels = batch["labels"][row].tolist()
        assert labels[:prompt_len] == [-100] * prompt_len
        assert labels[prompt_len:len(ids)] == ids[prompt_len:] and ids[-1] == tok.eos_token_id
        assert labels[len(ids):] == [-100] * (len(labels) - len(ids))


def test_checkpoint_save_is_atomic(trained, tmp_path, monkeypatch):
    model, tok, task, _ = trained
    out = sft.save_checkpoint(model, tok, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tok), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        sft.save_checkpoint(model, tok, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    reloaded, tok2 = load_hf(out)
    assert accuracy(reloaded, tok2, task, task.split("test", 50))["accuracy"] == \
        accuracy(model, tok, task, task.split("test", 50))["accuracy"]


def test_cli_sft_then_eval_json(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["sft", "--task", "reverse", "--model", "tiny", "--out", str(out), "--steps", "30",
                 "--eval", "20"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert trained["steps"] == 30 and trained["final_loss"] < trained["first_loss"]
    assert main(["eval", "--model", str(out), "--task", "reverse", "--n", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 20 and result["task"] == "reverse"
    # the accuracy sft printed is the saved model's, on the same 20 test prompts that eval scores
    assert trained["test_accuracy"] == result["accuracy"]


@pytest.mark.parametrize("argv,message", [
    (["zoo", "build", "huge", "--out", "x"], "unknown zoo model 'huge'; a zoo name is a preset (tiny, small, mid)"),
    (["sft", "--task", "sudoku", "--out", "x"], "unknown task 'sudoku'; choose one of: arith"),
    (["sft", "--task", "arith", "--task-opt", "digits", "--out", "x"], "must look like key=value"),
    (["sft", "--task", "arith", "--out", "x", "--steps", "0"], "sft steps must be at least 1"),
    (["eval", "--model", "tiny"], "eval needs --task NAME or --data FILE"),
    (["eval", "--model", "tiny", "--data", "nope.jsonl"], "nope.jsonl: no such dataset file"),
])
def test_cli_user_errors_are_one_line_without_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sft_refuses_to_overwrite_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    assert main(["sft", "--task", "arith", "--out", str(tmp_path), "--steps", "1"]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_config_validation_names_the_field():
    with pytest.raises(UserError, match="batch_size"):
        sft.SFTConfig(batch_size=0).validate()


def test_held_out_prompts_are_training_prompts_never_trained_on_nor_tested():
    task = get_task("arith")
    cfg = sft.SFTConfig(train_samples=300, eval_samples=100, target_accuracy=0.5)
    assert sft.held_out_split(task, sft.SFTConfig(train_samples=300))[1] == []  # no target, no extra prompts
    trained, held_out = sft.held_out_split(task, cfg)
    assert len(trained) == 300 and len(held_out) == 100
    trained_prompts, held_prompts = {s.prompt for s in trained}, {s.prompt for s in held_out}
    assert not trained_prompts & held_prompts
    assert not held_prompts & {s.prompt for s in task.split("test", 500)}
    assert held_prompts <= {s.prompt for s in task.split("train", 400)}  # from the train split


def test_warm_start_stops_once_held_out_accuracy_reaches_its_target(tiny_dir):
    model, tok = load_hf(tiny_dir)
    task = get_task("arith")
    cfg = sft.SFTConfig(steps=800, warmup_steps=20, target_accuracy=0.03, eval_every=50, eval_samples=200)
    seen = []
    summary = sft.train(model, tok, task, cfg, progress=False, on_check=lambda step, acc: seen.append((step, acc)))
    checks = summary["checks"]
    assert [(c["step"], c["accuracy"]) for c in checks] == seen
    assert [c["step"] for c in checks] == list(range(50, summary["steps"] + 1, 50))
    assert summary["steps"] < 800  # stopped on the target, not the cap
    assert checks[-1]["accuracy"] >= 0.03 > max((c["accuracy"] for c in checks[:-1]), default=0.0)
    _, held_out = sft.held_out_split(task, cfg)
    assert sft.held_out_accuracy(model, tok, task, held_out) == summary["held_out_accuracy"]


def test_warm_start_short_of_its_target_stops_with_a_message_naming_it(tiny_dir):
    model, tok = load_hf(tiny_dir)
    cfg = sft.SFTConfig(steps=40, warmup_steps=10, target_accuracy=0.9, eval_every=25, eval_samples=50)
    checks = []
    with pytest.raises(sft.WarmStartError, match=r"warm start reached \d+\.\d% greedy accuracy on 50 held-out "
                                                 r"training prompts after 40 steps \(the step cap\), short of its "
                                                 r"target 90%"):
        sft.train(model, tok, get_task("arith"), cfg, progress=False, on_check=lambda s, a: checks.append(s))
    assert checks == [25, 40]  # the cap fell between checks: the last weights were checked too


def test_target_accuracy_outside_zero_to_one_is_refused():
    with pytest.raises(UserError, match=r"target_accuracy must be in \(0, 1\], got 1.5"):
        sft.SFTConfig(target_accuracy=1.5).validate()
