"""The megatron-core training engine inside worker groups, checked against transformers."""
import functools
import inspect
import os
from pathlib import Path

import pytest
import torch

from hybridlab.batching import sequences_batch
from hybridlab.controller.calls import WorkerError
from hybridlab.controller.group import RoleClass
from hybridlab.controller.mapping import DeviceMapping
from hybridlab.controller.worker_set import WorkerSet
from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model
from hybridlab.workers.train import checkpoint
from hybridlab.workers.train.convert import hf_to_megatron, load_hf_state, megatron_to_hf
from hybridlab.workers.train.workers import ActorWorker, CriticWorker, RefWorker
from tests.train_settings import train_settings

OPTIM = {"lr": 1e-3, "grad_clip": 1.0}


def random_batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(3, 300, (lengths(2, 7),), generator=g).tolist() for _ in range(n)]
    responses = [torch.randint(3, 300, (lengths(1, 9),), generator=g).tolist() for _ in range(n)]
    return sequences_batch(prompts, responses, pad_id=0)


BATCH = random_batch()


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir: str, written: tuple):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_logprobs(model_dir, batch, sum_pi_squared: bool = False):
    """transformers' log-probs of the responses (and the sum of squared token probabilities).
    The model is loaded once per checkpoint (a folder written again is loaded again)."""
    written = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in Path(model_dir).glob("*.safetensors")))
    model = _hf_model(str(model_dir), written)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.double()
    r = batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -r - 1:-1], -1)
    picked = log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return (picked, log_probs.exp().square().sum(-1)) if sum_pi_squared else picked


def session_for(roles: dict, tp=1, pp=1, dp=1, colocate=True, ep=1):
    layout = {"pool": "p", "tp": tp, "pp": pp, "dp": dp, "ep": ep}
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": tp * pp * dp}},
                                       "roles": {r: {**layout, **({"colocate": "e"} if colocate else {})}
                                                 for r in roles}})
    return WorkerSet(mapping, roles, timeout=300).start()


def gathered(group) -> dict:
    out = {}
    for part in group.export_hf():
        out.update(part or {})
    return out


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)




@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "small", "tiny-qwen3moe"])
def test_hf_megatron_round_trip_is_exact(name):
    path = resolve_model(name)
    spec, hf = ModelSpec.from_hf(path), load_hf_state(path)
    for tp in (1, 2):
        for pp in (1, 2, 4):
            merged = {}
            for stage in range(pp):
                merged.update(megatron_to_hf([hf_to_megatron(hf, spec, tp, r, pp, stage) for r in range(tp)],
                                             spec, pp, stage))
            assert sorted(merged) == sorted(hf)
            assert all(torch.equal(merged[k], hf[k]) for k in hf), (tp, pp)


def test_a_critic_state_without_the_lm_head_converts_for_untied_models():
    """A critic's saved state has a value head instead of lm_head (untied Llama): its
    conversion back into a layout must not ask for lm_head (a remap re-creates critics so)."""
    path = resolve_model("tiny-llama")
    spec, hf = ModelSpec.from_hf(path), load_hf_state(path)
    assert not spec.tied
    critic_state = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    for pp, stage in ((1, 0), (2, 1)):
        shard = hf_to_megatron(critic_state, spec, 2, 1, pp, stage, head=False)
        full = hf_to_megatron(hf, spec, 2, 1, pp, stage)
        assert "output_layer.weight" not in shard and "output_layer.weight" in full
        assert all(torch.equal(shard[k], full[k]) for k in shard) and len(shard) == len(full) - 1
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf_to_megatron(critic_state, spec, 1, 0, 1, 0)


def test_impossible_layouts_are_rejected_before_launch(tmp_path):
    spec = ModelSpec.from_hf(resolve_model("tiny"))
    with pytest.raises(UserError, match="4 attention heads are not divisible by tp=3"):
        spec.check_layout(3, 1)
    with pytest.raises(UserError, match="2 key/value heads are not divisible by tp=4"):
        spec.check_layout(4, 1)
    with pytest.raises(UserError, match="4 layers are not divisible by pp=3"):
        spec.check_layout(1, 3)


RESULTS: dict = {}  # weights after one step, per layout, and the TP 2 checkpoint: made by the tests below


@pytest.fixture(scope="module")
def tiny(ray_local):
    return str(resolve_model("tiny"))


def test_tp1_logprobs_match_transformers_and_sft_step(tiny, tmp_path_factory):
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny,
                                                         settings=train_settings(**OPTIM, micro_batch_size=3)))}
    with session_for(roles) as s:
        out = s.groups["actor"].compute_log_prob(BATCH, sum_pi_squared=True)
        mask = BATCH["response_mask"].bool()
        log_probs, sum_pi_squared = hf_logprobs(tiny, BATCH, sum_pi_squared=True)
        assert (out["old_log_probs"].double() - log_probs)[mask].abs().max() < 1e-5
        assert (out["sum_pi_squared"].double() - sum_pi_squared)[mask].abs().max() < 1e-6
        assert out["entropy"].shape == BATCH["responses"].shape and (out["entropy"][mask] > 0).all()
        metrics = s.groups["actor"].sft_step(BATCH)[0]
        assert metrics["sft_loss"] == pytest.approx(5.76, abs=0.1) and metrics["lr"] == 1e-3
        RESULTS["tp1"] = gathered(s.groups["actor"])


def test_tp2_actor_and_colocated_ref(tiny, tmp_path_factory):
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny,
                                                         settings=train_settings(**OPTIM, micro_batch_size=3), tp=2)),
             "ref": RoleClass(RefWorker, kwargs=dict(model_dir=tiny, settings=train_settings(), tp=2))}
    with session_for(roles, tp=2) as s:
        actor, ref = s.groups["actor"], s.groups["ref"]
        assert [p["pid"] for p in actor.placements] == [p["pid"] for p in ref.placements]
        mask = BATCH["response_mask"].bool()
        out = actor.compute_log_prob(BATCH, sum_pi_squared=True)  # vocabulary split over the TP ranks
        lp = out["old_log_probs"]
        log_probs, sum_pi_squared = hf_logprobs(tiny, BATCH, sum_pi_squared=True)
        assert (lp.double() - log_probs)[mask].abs().max() < 1e-5
        assert (out["sum_pi_squared"].double() - sum_pi_squared)[mask].abs().max() < 1e-6
        assert torch.equal(ref.compute_ref_log_prob(BATCH)["ref_log_prob"], lp)
        actor.sft_step(BATCH)
        RESULTS["tp2"] = gathered(actor)
        # The reference is frozen: its log-probs did not move with the actor's step.
        assert torch.equal(ref.compute_ref_log_prob(BATCH)["ref_log_prob"], lp)
        ckpt = checkpoint.save_checkpoint(actor, tiny, tmp_path_factory.mktemp("ckpt") / "tp2")
        RESULTS["ckpt"] = ckpt
        actor.sft_step(BATCH)
        RESULTS["tp2_two_steps"] = gathered(actor)


def test_bf16_compute_keeps_fp32_weights_and_moments_and_switches_live(tiny):
    """actor precision bf16: matmuls under autocast, so log-probs move off the fp32 ones (by a
    bf16-sized amount); a live switch to fp32 gives transformers' log-probs again; bf16 steps
    learn while the weights stay fp32 (the gradients and AdamW moments follow their dtype)."""
    settings = train_settings(**OPTIM, micro_batch_size=3, precision="bf16")
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny, settings=settings))}
    with session_for(roles) as s:
        actor = s.groups["actor"]
        mask = BATCH["response_mask"].bool()
        reference = hf_logprobs(tiny, BATCH)
        gap = (actor.compute_log_prob(BATCH)["old_log_probs"].double() - reference)[mask].abs().max()
        assert 1e-4 < gap < 0.2
        actor.configure(settings.but(precision="fp32"))
        assert actor.settings()[0]["precision"] == "fp32"
        assert (actor.compute_log_prob(BATCH)["old_log_probs"].double() - reference)[mask].abs().max() < 1e-5
        actor.configure(settings)
        losses = [actor.sft_step(BATCH)[0]["sft_loss"] for _ in range(3)]
        assert losses[2] < losses[0]
        assert {t.dtype for t in gathered(actor).values()} == {torch.float32}
        padded = actor.compute_log_prob(BATCH)["old_log_probs"]
        actor.configure(settings.but(remove_padding=True, micro_batch_tokens=40))  # packed under bf16 too
        packed = actor.compute_log_prob(BATCH)["old_log_probs"]
        assert (packed - padded)[mask].abs().max() < 0.1  # bf16 rounding apart, the same numbers
        assert actor.sft_step(BATCH)[0]["padded_token_share"] < 0.5
        with pytest.raises(WorkerError, match="precision must be one of fp32, bf16, got 'fp16'"):
            actor.configure(settings.but(precision="fp16"))


def test_pp2_logprobs_and_step(tiny):
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny,
                                                         settings=train_settings(**OPTIM, micro_batch_size=3), pp=2))}
    with session_for(roles, pp=2) as s:
        lp = s.groups["actor"].compute_log_prob(BATCH)["old_log_probs"]
        mask = BATCH["response_mask"].bool()
        assert (lp.double() - hf_logprobs(tiny, BATCH))[mask].abs().max() < 1e-5
        s.groups["actor"].sft_step(BATCH)
        RESULTS["pp2"] = gathered(s.groups["actor"])


def test_tp2_dp2_step(tiny):
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny,
                                                         settings=train_settings(**OPTIM, micro_batch_size=3), tp=2))}
    with session_for(roles, tp=2, dp=2) as s:
        s.groups["actor"].sft_step(BATCH)
        RESULTS["tp2dp2"] = gathered(s.groups["actor"])
        # Megatron's 30-odd gloo groups in each process share one transport device, so one event-loop
        # thread polls for them all (controller/gloo_device.py), where each group's own device had one
        for pid in (p["pid"] for p in s.groups["actor"].placements):
            names = thread_names(pid)
            assert names.count("gloo_tcp_loop") == 1 and names.count("pt_gloo_runloop") > 20, sorted(set(names))
            # ... on the interface GLOO_SOCKET_IFNAME names (the suite's: lo), as each group's own did
            assert tcp_addresses(pid) <= {"127.0.0.1", "0.0.0.0", "::1", "::", "::ffff:127.0.0.1"}, tcp_addresses(pid)


def thread_names(pid: int) -> list[str]:
    """The names of process ``pid``'s threads (one that ends meanwhile is left out)."""
    names = []
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            names.append(Path(f"/proc/{pid}/task/{thread}/comm").read_text().strip())
        except OSError:
            continue
    return names


def tcp_addresses(pid: int) -> set[str]:
    """The addresses at either end of process ``pid``'s TCP sockets."""
    import psutil

    return {end.ip for c in psutil.Process(pid).net_connections(kind="tcp") for end in (c.laddr, c.raddr) if end}


def test_packed_token_budget_micro_batches_give_the_padded_numbers_at_tp2_pp2(tiny):
    """actor.remove_padding + actor.micro_batch_tokens: each micro-batch's sequences packed end
    to end (attention kept inside each) in micro-batches cut by a token budget. The log-probs are
    transformers' (zeros at the padding), the step's weights are the padded step's, and the
    padded share of computed tokens drops; a live switch back gives the padded layout's share."""
    settings = train_settings(**OPTIM, micro_batch_size=3, micro_batch_tokens=40, remove_padding=True)
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny, settings=settings, tp=2, pp=2))}
    mask = BATCH["response_mask"].bool()
    real, width = int(BATCH["attention_mask"].sum()), BATCH["attention_mask"].shape[1]
    with session_for(roles, tp=2, pp=2) as s:
        actor = s.groups["actor"]
        lp = actor.compute_log_prob(BATCH)["old_log_probs"]
        assert (lp.double() - hf_logprobs(tiny, BATCH))[mask].abs().max() < 1e-5
        assert lp[~mask].abs().max() == 0.0
        packed_share = actor.sft_step(BATCH)[0]["padded_token_share"]
        RESULTS["packed_tp2pp2"] = gathered(actor)
        # Packed micro-batches are padded only to the longest pack (one activation shape between
        # pipeline stages); padded, 3 micro-batches of 3 rows (one repeated) of the full width.
        assert 0.0 < packed_share < 0.5 * (1 - real / (8 * width))
        actor.configure(settings.but(remove_padding=False, micro_batch_tokens=0))
        assert actor.settings()[0]["remove_padding"] is False
        assert actor.compute_log_prob(BATCH)["old_log_probs"][~mask].abs().max() > 0  # the padded layout again
        assert actor.sft_step(BATCH)[0]["padded_token_share"] == pytest.approx(1 - real / (9 * width))


MAKERS = {"tp1": test_tp1_logprobs_match_transformers_and_sft_step, "tp2": test_tp2_actor_and_colocated_ref,
          "ckpt": test_tp2_actor_and_colocated_ref, "tp2_two_steps": test_tp2_actor_and_colocated_ref,
          "pp2": test_pp2_logprobs_and_step, "tp2dp2": test_tp2_dp2_step,
          "packed_tp2pp2": test_packed_token_budget_micro_batches_give_the_padded_numbers_at_tp2_pp2}


def made(key: str, tiny: str, tmp_path_factory) -> object:
    """Return ``RESULTS[key]``, running the test that makes it first when it has not run (a test
    chosen alone with ``pytest -k NAME``): every test sets up what it compares with."""
    if key not in RESULTS:
        maker = MAKERS[key]
        if "tmp_path_factory" in inspect.signature(maker).parameters:
            maker(tiny, tmp_path_factory)
        else:
            maker(tiny)
    return RESULTS[key]


def test_one_step_gives_the_same_weights_in_every_layout(tiny, tmp_path_factory):
    original = load_hf_state(tiny)
    results = {key: made(key, tiny, tmp_path_factory) for key in ("tp1", "tp2", "pp2", "tp2dp2", "packed_tp2pp2")}
    assert max_diff(results["tp1"], original) > 5e-4          # the step moved the weights
    for layout in ("tp2", "pp2", "tp2dp2", "packed_tp2pp2"):
        # 1e-4 is a tenth of the step (lr 1e-3): AdamW's first step is +-lr per element, so a
        # wrong gradient anywhere would show as a difference of up to 2e-3. Micro-batches split
        # differently per layout (3+3+2 rows at DP1, 3+1 at DP2) and still give the same step.
        assert max_diff(results[layout], results["tp1"]) < 1e-4, layout


def test_checkpoint_saved_at_tp2_resumes_at_tp1(tiny, tmp_path_factory):
    ckpt = made("ckpt", tiny, tmp_path_factory)
    at_tp2, after_two_steps = made("tp2", tiny, tmp_path_factory), made("tp2_two_steps", tiny, tmp_path_factory)
    assert (ckpt / "optimizer" / "adamw.safetensors").is_file() and (ckpt / "config.json").is_file()
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]  # what vLLM loads
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=str(ckpt),
                                                         settings=train_settings(**OPTIM, micro_batch_size=3)))}
    with session_for(roles) as s:
        assert max_diff(gathered(s.groups["actor"]), at_tp2) == 0.0
        assert checkpoint.load_optimizer(s.groups["actor"], ckpt) == 1
        s.groups["actor"].sft_step(BATCH)
        assert max_diff(gathered(s.groups["actor"]), after_two_steps) < 1e-4


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_small_logprobs_match_transformers(ray_local, tp, pp):
    small = str(resolve_model("small"))
    roles = {"actor": RoleClass(RefWorker, kwargs=dict(model_dir=small,
                                                       settings=train_settings(micro_batch_size=4), tp=tp, pp=pp))}
    with session_for(roles, tp=tp, pp=pp) as s:
        lp = s.groups["actor"].compute_ref_log_prob(BATCH)["ref_log_prob"]
    mask = BATCH["response_mask"].bool()
    assert (lp.double() - hf_logprobs(small, BATCH))[mask].abs().max() < 1e-5


def test_critic_values_learn_a_target_at_tp2(tiny, tmp_path):
    def value_loss(outputs, micro):
        mask = micro["response_mask"].float()
        err = ((outputs["values"] - 1.0) ** 2 * mask).sum()
        return err / micro["global_tokens"], {"value_loss": err / mask.sum()}

    settings = train_settings("critic", lr=3e-3, micro_batch_size=4)
    roles = {"critic": RoleClass(CriticWorker, kwargs=dict(model_dir=tiny, settings=settings, tp=2))}
    with session_for(roles, tp=2) as s:
        critic = s.groups["critic"]
        values = critic.compute_values(BATCH)["values"]
        assert values.shape == BATCH["responses"].shape and values.abs().max() == 0  # zero-initialised head
        losses = [m["value_loss"] for m in critic.update_critic([BATCH] * 8, value_loss)[0]]
        assert losses[0] == pytest.approx(1.0) and losses[-1] < 0.2
        # packed micro-batches by a token budget give the padded layout's values (at the responses)
        mask = BATCH["response_mask"].bool()
        padded = critic.compute_values(BATCH)["values"]
        critic.configure(settings.but(remove_padding=True, micro_batch_tokens=40))
        packed = critic.compute_values(BATCH)["values"]
        assert (packed - padded)[mask].abs().max() < 1e-5 and (padded[mask] - 1.0).abs().mean() < 0.5
        out = checkpoint.export_hf(critic, tiny, tmp_path / "critic")
        assert (out / "value_head.safetensors").is_file()


ENGINE_IMPORTS = """
import inspect, os, pickle, socket, sys, torch
from hybridlab.config import RunConfig
from hybridlab.workers.train.engine import MegatronEngine
from hybridlab.workers.train.settings import TrainSettings
sock = socket.socket(); sock.bind(("127.0.0.1", 0))
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
sock.close()
compile_before = torch.compile
MegatronEngine(sys.argv[1], TrainSettings.of(RunConfig()), spec=pickle.loads(bytes.fromhex(sys.argv[2])))
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu  # loaded for certain: scanned below
def compiled_in(value):  # a function torch.compile wrapped, or a class with such methods
    found = [value] + (list(vars(value).values()) if isinstance(value, type) else [])
    return any(inspect.isfunction(f) and "_torchdynamo_orig_callable" in f.__dict__ for f in found)
compiled = sorted({f"{value.__module__}.{value.__qualname__}" for name, module in list(sys.modules.items())
                   if name.startswith("megatron.") and module is not None
                   for value in list(vars(module).values()) if compiled_in(value)})
print([torch.compile is compile_before, jit.jit_fuser is jit.noop_decorator,
       "torch._inductor.compile_fx" in sys.modules, "wandb" in sys.modules, "transformers" in sys.modules, compiled])
import wandb  # a worker's own import of W&B still works
"""


def test_a_megatron_engine_starts_without_compiling_unused_kernels_or_importing_transformers(tiny_dir):
    """Megatron's fused kernels stay plain functions (every fusion is off, so none runs), so a
    training process never imports Inductor's compiler or W&B for them; torch.compile is itself.
    Given the checkpoint's spec as the controller read it, the engine never imports transformers."""
    import pickle
    import subprocess
    import sys

    from hybridlab.models.spec import ModelSpec

    spec = pickle.dumps(ModelSpec.read(tiny_dir)).hex()
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", ENGINE_IMPORTS, str(tiny_dir), spec],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # every fused kernel (bias_swiglu, bias_geglu, ...) among the modules scanned: none compiled
    assert done.stdout.strip().splitlines()[-1] == "[True, True, False, False, False, []]"
