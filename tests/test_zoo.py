"""Zoo models: deterministic, right-sized, loadable by transformers and by vLLM unchanged."""
import hashlib

import pytest
import torch

from hybridlab.errors import UserError
from hybridlab.models import zoo


def _weights_digest(path) -> str:
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].numpy().tobytes())
    return h.hexdigest()


def test_build_is_deterministic_from_the_seed(tmp_path, tiny_dir):
    again = zoo.build("tiny", tmp_path / "a", seed=0)
    other = zoo.build("tiny", tmp_path / "b", seed=1)
    assert _weights_digest(again) == _weights_digest(tiny_dir)
    assert _weights_digest(other) != _weights_digest(tiny_dir)
    assert (again / "tokenizer.json").read_text() == (tiny_dir / "tokenizer.json").read_text()


def test_rebuild_replaces_whole_and_refuses_foreign_dirs(tmp_path):
    out = zoo.build("tiny", tmp_path / "m")
    (out / "stale.txt").write_text("old")
    zoo.build("tiny", out, seed=2)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folders left behind
    foreign = tmp_path / "notes"
    foreign.mkdir()
    with pytest.raises(UserError, match="is not a model directory"):
        zoo.build("tiny", foreign)


@pytest.mark.parametrize("name,low,high", [("tiny", 0.5e6, 0.7e6), ("small", 5e6, 7e6), ("mid", 20e6, 30e6),
                                           ("tiny-llama", 0.5e6, 0.7e6)])
def test_preset_sizes(name, low, high):
    assert low <= zoo.count_parameters(name) <= high


def test_unknown_preset_lists_presets():
    with pytest.raises(UserError, match=r"a zoo name is a preset \(tiny, small, mid\), optionally with a family"
                                        r" \(-llama, -llama3, -qwen3, -mistral, -qwen3moe, -gemma3, -phi3; without one: qwen2\)"):
        zoo.resolve_model("huge")
    with pytest.raises(UserError, match="unknown zoo model 'tiny-gpt2'"):
        zoo.resolve_model("tiny-gpt2")
    with pytest.raises(UserError, match="does not exist"):
        zoo.resolve_model("./no/such/dir")


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_llama_dir"])
def test_tokenizer_round_trips_through_autotokenizer(request, fixture):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(fixture))
    text = "a b\nc 12+34=46 reverse abc= 3 5 7 to 22:"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok("1234", add_special_tokens=False).input_ids] == list("1234")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == zoo.VOCAB_SIZE


def test_resolve_caches_and_accepts_user_checkpoints(tiny_dir, tmp_path):
    assert zoo.resolve_model("tiny") == tiny_dir
    assert zoo.resolve_model(str(tiny_dir)) == tiny_dir
    with pytest.raises(UserError, match="no config.json"):
        zoo.resolve_model(str(tmp_path))


def _hf_prompt_logprobs(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits.double(), -1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_llama_dir"])
def test_vllm_loads_zoo_checkpoints_unchanged(request, fixture, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = request.getfixturevalue(fixture)
    ids = [19, 20, 13, 21, 22, 31, 22, 24]
    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=128, seed=0)
    try:
        out = llm.generate(TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        vllm_lp = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert vllm_lp == pytest.approx(_hf_prompt_logprobs(path, ids), abs=1e-4)


def _build_counted(out: str) -> None:
    """In a child process: ask for ``out`` with a build that counts itself and takes a while."""
    import time
    from pathlib import Path

    from hybridlab.atomic import built_once

    def build() -> None:
        with open(Path(out).parent / "builds", "a") as f:
            f.write("x")
        time.sleep(0.5)  # the others ask while this one builds
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")

    built_once(Path(out), build)


def test_a_cached_model_directory_asked_for_by_processes_at_once_is_built_once(tmp_path):
    import multiprocessing

    out = tmp_path / "cache" / "model"
    procs = [multiprocessing.get_context("fork").Process(target=_build_counted, args=(str(out),)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert (tmp_path / "cache" / "builds").read_text() == "x" and (out / "config.json").is_file()
