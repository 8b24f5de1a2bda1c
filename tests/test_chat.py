"""Chat prompts rendered with the model's template, and every path stopping at every end id the
checkpoint lists."""
import json
import shutil

import pytest
import torch

import hybridlab.algos as A
from hybridlab.errors import UserError
from hybridlab.evaluate import greedy_texts, load_hf
from hybridlab.protocol import Batch
from hybridlab.tasks import get_task
from hybridlab.workers.rollout.worker import RolloutWorker

GREEDY = {"temperature": 0, "max_tokens": 6}


def arith_prompts(tokenizer, n=8) -> list[list[int]]:
    return [tokenizer(s.prompt, add_special_tokens=False).input_ids for s in get_task("arith").split("test", n)]


@pytest.fixture(scope="module")
def second_end(trained_dir, tmp_path_factory):
    """The trained model with one more end id in generation_config.json: a token its greedy
    answers hold in the middle. Returns (model dir, that id, the greedy answers without it)."""
    _, tok = load_hf(trained_dir)
    prompts = arith_prompts(tok)
    plain = RolloutWorker(str(trained_dir), backend="hf").generate(Batch(objects={"prompt_ids": prompts}), GREEDY)
    end = int(plain["responses"][0, 1])
    out = tmp_path_factory.mktemp("chat") / "second-end"
    shutil.copytree(trained_dir, out)
    generation = json.loads((out / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 4, end]
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out, end, plain


def cut_at(responses: torch.Tensor, end: int) -> list[list[int]]:
    """Each row up to and including the first ``end`` (pad 0 dropped)."""
    out = []
    for row in responses.tolist():
        row = [t for t in row if t != 0]
        out.append(row[:row.index(end) + 1] if end in row else row)
    return out


def test_the_transformers_backend_and_evaluation_stop_at_a_second_end_id(second_end):
    model_dir, end, plain = second_end
    stopped = RolloutWorker(str(model_dir), backend="hf").generate(
        Batch(objects={"prompt_ids": plain.objects["prompt_ids"]}), GREEDY)
    expected = cut_at(plain["responses"], end)
    assert [r for r in stopped["responses"].tolist()] != plain["responses"].tolist()
    assert cut_at(stopped["responses"], end) == expected
    assert stopped["response_mask"].sum(1).tolist() == [len(r) for r in expected]   # the mask ends there too
    model, tok = load_hf(model_dir)
    texts = greedy_texts(model, tok, plain.objects["prompt_ids"], 6)
    assert texts == [tok.decode(r, skip_special_tokens=True) for r in expected]


def test_vllm_stops_where_the_transformers_backend_does(ray_local, second_end):
    from hybridlab.controller.group import RoleClass
    from hybridlab.controller.mapping import DeviceMapping
    from hybridlab.controller.worker_set import WorkerSet

    model_dir, end, plain = second_end
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 1}}, "roles": {"rollout": {"pool": "p"}}})
    roles = {"rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=str(model_dir), max_model_len=64))}
    with WorkerSet(mapping, roles, timeout=300) as s:
        out = s.groups["rollout"].generate(Batch(objects={"prompt_ids": plain.objects["prompt_ids"]}), GREEDY)
    assert cut_at(out["responses"], end) == cut_at(plain["responses"], end)


def chat_rows(path, n=16):
    rows = [{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": s.prompt}],
             "data_source": "arith", "reward_model": {"ground_truth": s.ground_truth}}
            for s in get_task("arith").split("train", n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_chat_data_for_a_model_without_a_template_is_refused_naming_the_file(tmp_path, tiny_dir, monkeypatch):
    from hybridlab.dataflow import session as session_module
    from hybridlab.dataflow.session import RLSession

    def reached(**_):
        raise AssertionError("the session reached Ray before it checked the chat template")

    monkeypatch.setattr(session_module, "connect", reached)  # the name the session calls
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in bare.glob("chat_template.*"):
        extra.unlink()
    chat_rows(tmp_path / "chat.jsonl")
    common = [f"model={bare}", f"data.train_files={tmp_path / 'chat.jsonl'}", "warm_start.max_steps=0"]
    rl = RLSession(None, [*common, f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match=r"chat.jsonl: row 1: the prompt is a list of chat messages, but the tokenizer"
                                        r" of .*bare has no chat template.*set data.chat_template"):
        rl.start()
    # a template supplied by the run (the Jinja text) makes the same data usable
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    rl = RLSession(None, [*common, f"data.chat_template={template}", f"trainer.run_dir={tmp_path / 'run2'}"])
    with pytest.raises(AssertionError, match="reached Ray"):  # every prompt rendered: on to Ray
        rl.start()
    assert rl.tokenizer.decode(rl.state.prompts.ids[0]).startswith("[system] Add.\n[user] ")


def test_a_chat_jsonl_trains_on_the_ids_of_the_chat_template(ray_local, trained_dir, tmp_path):
    from transformers import AutoTokenizer

    from hybridlab.dataflow.session import RLSession

    from tests.test_fsdp import length_reward

    rows = chat_rows(tmp_path / "chat.jsonl")
    # the arithmetic model answers chat-rendered prompts wrongly: a reward by the answer's length
    # differs within a group, and pass@k gives each group's best answer an advantage of its own, so
    # the loss checked at ratio 1 is not zero (GRPO's cancel out over answers of one token count)
    rl = RLSession("grpo", [f"model={trained_dir}", f"data.train_files={tmp_path / 'chat.jsonl'}",
                            "warm_start.max_steps=0", "trainer.devices=1", "data.prompts_per_step=4", "rollout.n=2",
                            "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=4", "trainer.progress=false",
                            *length_reward(tmp_path),
                            "algorithm.adv_estimator=grpo_passk",
                            "actor.use_rollout_log_probs=false", f"trainer.run_dir={tmp_path / 'run'}"])
    with rl:
        result = rl.step()
    assert "old_logprob" in [name for name, _ in result.stages]  # the actor scores the sequences itself
    tokenizer = AutoTokenizer.from_pretrained(trained_dir)
    by_prompt = {json.dumps(r["prompt"]): r["prompt"] for r in rows}
    rendered = {tuple(tokenizer.apply_chat_template(m, add_generation_prompt=True)["input_ids"])
                for m in by_prompt.values()}
    used = {tuple(ids) for ids in result.batch.objects["prompt_ids"]}
    assert used <= rendered and len(used) == 4
    assert tokenizer.decode(next(iter(used))).startswith("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n")
    # the trainer computed on the same sequences: its log-probs of the sampled tokens are vLLM's
    b = result.batch
    width = b["input_ids"].shape[1] - b["responses"].shape[1]
    for i, ids in enumerate(b.objects["prompt_ids"]):
        assert b["input_ids"][i, width - len(ids):width].tolist() == ids
    mask = b["response_mask"].bool()
    assert (b["old_log_probs"] - b["rollout_log_probs"])[mask].abs().max() < 1e-4
    # one mini-batch, so the update saw ratio 1: its loss is the aggregate of -advantages on these tokens
    expected = A.agg_loss(-b["advantages"], mask.float(), rl.cfg.actor.loss_agg_mode)
    assert abs(float(expected)) > 1e-3
    assert result.metrics["actor/pg_loss"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)


def test_a_task_in_chat_form_renders_for_the_rollout_and_the_warm_start(tiny_dir):
    from hybridlab import sft
    from hybridlab.dataflow.prompts import load_samples, tokenize_prompts
    from hybridlab.run_config import load_config

    _, tok = load_hf(tiny_dir)
    samples = load_samples(load_config(overrides=["data.chat=true", "data.train_samples=3"]), "train")
    expected = [tok.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True)["input_ids"]
                for s in samples]
    assert tokenize_prompts(samples, tok) == expected
    assert tok.decode(expected[0]) == f"<|im_start|>user\n{samples[0].prompt}<|im_end|>\n<|im_start|>assistant\n"
    examples = sft.encode_examples(tok, samples, end=4)
    assert [ids[:n] for ids, n in examples] == expected and all(ids[-1] == 4 for ids, _ in examples)


def test_a_chat_template_that_is_neither_a_file_nor_jinja_is_refused_when_the_config_loads(tmp_path):
    from hybridlab.config import ConfigError
    from hybridlab.run_config import load_config

    with pytest.raises(ConfigError, match=r"data.chat_template: no file '.*missing.jinja' \(give a template file"):
        load_config(overrides=[f"data.chat_template={tmp_path / 'missing.jinja'}"])
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_config(overrides=[f"data.chat_template={tmp_path / 't.jinja'}"]).data.chat_template
