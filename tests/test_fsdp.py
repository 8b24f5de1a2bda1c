"""The FSDP2 training backend against Megatron and transformers, on the real engines."""
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hybridlab.config import ConfigError
from hybridlab.controller.group import RoleClass
from hybridlab.dataflow.session import RLSession
from hybridlab.models.spec import ModelSpec
from hybridlab.models.zoo import resolve_model
from hybridlab.backend_checks import training_strategy
from hybridlab.run_config import load_config
from hybridlab.workers.train.backend import resolve_strategy
from hybridlab.workers.train.convert import load_hf_state
from hybridlab.workers.train.workers import ActorWorker
from hybridlab.protocol import Batch
from hybridlab.tasks import get_task
from hybridlab.workers.train import checkpoint
from tests.test_remap import actor_state, assert_equal_state
from tests.test_sync import GREEDY, hf_greedy
from tests.test_worker_faults import kill, pids, repeatable
from tests.test_train import BATCH, gathered, hf_logprobs, max_diff, session_for
from tests.train_settings import train_settings

TRAINING = ("actor", "ref", "critic")
ONE_DEVICE = {"pools": {"main": {"devices": 1}},
              "roles": {r: {"pool": "main", "colocate": "engine"} for r in (*TRAINING, "rollout", "reward")}}
# the trainers on two data-parallel ranks, the rollout in a process of its own: the sync sends
# whole tensors from FSDP's all-gather across processes (export_slices)
TRAIN_DP2 = {"pools": {"train": {"devices": 2}, "gen": {"devices": 1}},
             "roles": {**{r: {"pool": "train", "dp": 2, "colocate": "t"} for r in TRAINING},
                       "rollout": {"pool": "gen", "colocate": "g"}, "reward": {"pool": "gen", "colocate": "g"}}}
# metrics that are the numbers of the step, not of its timing (whitened advantages average to about
# 0 on any backend: their extremes are compared too)
COMPARED = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "actor/reward_kl_penalty", "critic/vf_loss",
            "critic/grad_norm", "advantages/mean", "advantages/max", "advantages/min", "response_length/mean")


def test_fsdp2_logprobs_and_gradients_equal_megatrons(ray_local):
    """Log-probs equal transformers' within 1e-5 padded and packed at DP 2, and one SFT loss's
    gradient on the same batch equals Megatron's within 1e-5: with SGD at lr 1 and no clipping a
    step moves each weight by exactly its gradient."""
    tiny = str(resolve_model("tiny"))
    sgd = {"lr": 1.0, "grad_clip": 0.0, "optimizer": "sgd"}
    mask = BATCH["response_mask"].bool()
    log_probs, sum_pi_squared = hf_logprobs(tiny, BATCH, sum_pi_squared=True)
    grads = {}
    for strategy, dp in (("megatron", 1), ("fsdp2", 2)):
        settings = train_settings(**sgd, micro_batch_size=3, strategy=strategy)
        roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=tiny, settings=settings))}
        with session_for(roles, dp=dp) as s:
            actor = s.groups["actor"]
            assert actor.settings()[0]["strategy"] == strategy
            out = actor.compute_log_prob(BATCH, sum_pi_squared=True)
            assert (out["old_log_probs"].double() - log_probs)[mask].abs().max() < 1e-5
            assert (out["sum_pi_squared"].double() - sum_pi_squared)[mask].abs().max() < 1e-6
            actor.configure(settings.but(micro_batch_tokens=40, remove_padding=True))  # packed, by tokens
            packed = actor.compute_log_prob(BATCH)["old_log_probs"]
            assert (packed - out["old_log_probs"])[mask].abs().max() < 1e-5
            actor.configure(settings)
            before = gathered(actor)
            assert actor.sft_step(BATCH)[0]["grad_norm"] > 1.0
            after = gathered(actor)
            grads[strategy] = {k: before[k] - after[k] for k in before}
    assert sorted(grads["fsdp2"]) == sorted(grads["megatron"])  # HF names, the same tensors
    assert max(g.abs().max().item() for g in grads["megatron"].values()) > 0.1
    assert max_diff(grads["fsdp2"], grads["megatron"]) < 1e-5


def test_fsdp2_refusals_and_the_auto_choice(tmp_path):
    with pytest.raises(ConfigError, match=r"mapping.roles.actor: tp=2, pp=1 needs actor.strategy=megatron; the"
                                          r" fsdp2 backend shards over data-parallel ranks only"):
        load_config("grpo", ["actor.strategy=fsdp2", "trainer.devices=2",
                             "mapping={pools: {p: {devices: 2}}, roles: {actor: {pool: p, tp: 2},"
                             " rollout: {pool: p, tp: 2, colocate: e}, reward: {pool: p, dp: 2, colocate: e}}}"])
    with pytest.raises(ConfigError, match=r"(?s)actor.strategy: the fsdp2 backend does not train Qwen3-MoE"
                                          r" \(transformers 5 fuses .*mapping.roles.actor: ep=2 is Megatron's expert parallelism,"
                                          r" and actor trains on the fsdp2 backend; use actor.strategy=megatron"):
        load_config("grpo", ["model=tiny-qwen3moe", "actor.strategy=fsdp2", "trainer.devices=2",
                             "mapping={pools: {p: {devices: 2}}, roles: {actor: {pool: p, dp: 2, ep: 2},"
                             " rollout: {pool: p, dp: 2, colocate: e}, reward: {pool: p, dp: 2, colocate: e}}}"])
    with pytest.raises(ConfigError, match=r"critic.strategy: 'deepspeed' is not one of auto, megatron, fsdp2"):
        load_config("ppo", ["critic.strategy=deepspeed"])
    with pytest.raises(ConfigError, match="actor.strategy: the zoo's gemma3 models have no Megatron conversion"):
        load_config("grpo", ["model=tiny-gemma3", "actor.strategy=megatron"])
    with pytest.raises(ConfigError, match="mapping.roles.actor: tp=2, pp=1 needs actor.strategy=megatron"):
        load_config("grpo", ["model=tiny-phi3", "trainer.devices=2",
                             "mapping={pools: {p: {devices: 2}}, roles: {actor: {pool: p, tp: 2},"
                             " rollout: {pool: p, tp: 2, colocate: e}, reward: {pool: p, dp: 2, colocate: e}}}"])
    assert training_strategy(load_config("grpo", ["model=tiny-gemma3"]), "actor") == "fsdp2"
    assert training_strategy(load_config("grpo", ["model=tiny"]), "actor") == "megatron"
    assert resolve_strategy("auto", resolve_model("tiny")) == "megatron"
    for name, backend in (("tiny", "megatron"), ("tiny-gemma3", "fsdp2")):  # with the spec the controller read
        assert resolve_strategy("auto", resolve_model(name), ModelSpec.read(resolve_model(name))) == backend
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert resolve_strategy("auto", gpt2) == "fsdp2"
    assert resolve_strategy("megatron", gpt2) == "megatron"


def test_fsdp2_trains_without_the_checkpoints_dropout(tmp_path):
    """Log-probs and the update must see the same model (Megatron's build has no dropout): a
    checkpoint's dropout settings are zeroed, so train mode computes what eval mode does."""
    from hybridlab.workers.train.fsdp_model import build_model

    source = resolve_model("tiny")
    (tmp_path / "dropout").mkdir()
    for f in source.iterdir():
        if f.is_file():
            (tmp_path / "dropout" / f.name).write_bytes(f.read_bytes())
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "dropout" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    model = build_model(str(tmp_path / "dropout"), value_head=False)
    assert model.config.attention_dropout == 0.0
    ids = BATCH["input_ids"][:2]
    with torch.no_grad():
        trained = model.train()(ids).logits
        assert torch.equal(trained, model.eval()(ids).logits)


def test_a_ppo_run_on_fsdp2_equals_megatrons_remaps_to_dp2_and_resumes(ray_local, trained_dir, tmp_path):
    """The same seeded PPO steps (actor, ref and critic) on either backend give the same
    numbers; on FSDP2 a remap to two DP ranks carries weights and AdamW moments bit for bit, the
    weight sync to a rollout in another process lands, and a resume carries the state."""
    # two actor mini-batches: the whole batch's whitened advantages average to zero, so with one the
    # policy loss at ratio 1 was too (7e-9 on both backends); the second half sees the first's update
    base = [f"model={trained_dir}", "warm_start.max_steps=0", "data.prompts_per_step=4", "rollout.n=2",
            "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=4",
            "data.test_samples=8", "trainer.progress=false", f"mapping={ONE_DEVICE}"]
    steps = {}
    for strategy in ("megatron", "fsdp2"):
        run = tmp_path / strategy
        with RLSession("ppo", [*base, f"actor.strategy={strategy}", f"critic.strategy={strategy}",
                               f"trainer.run_dir={run}"]) as rl:
            steps[strategy] = [rl.step().metrics for _ in range(3)]
            if strategy == "megatron":
                continue
            assert rl.training_backends() == {"actor": "fsdp2", "ref": "fsdp2", "critic": "fsdp2"}
            assert json.loads((run / "environment.json").read_text())["training_backends"]["critic"] == "fsdp2"
            before = actor_state(rl)
            assert sorted(rl.remap(TRAIN_DP2).roles_recreated) == ["actor", "critic", "ref", "reward", "rollout"]
            assert_equal_state(before, actor_state(rl))
            batch = rl.step().batch
            mask = batch["response_mask"].bool()  # the rollout sampled with the synced weights
            assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
            saved = actor_state(rl)
            rl.save_checkpoint()
    # the losses compared below are not all zero (a comparison of zeros would pass whatever the
    # backend): the value loss on every step, the policy loss on the steps after the first by a margin
    # (here 6.1e-4, 0.024 and 0.031: the first step's is its two halves' imbalance alone)
    assert all(m["critic/vf_loss"] > 1e-4 for m in steps["megatron"])
    assert max(abs(m["actor/pg_loss"]) for m in steps["megatron"][1:]) > 1e-3
    for step, (megatron, fsdp2) in enumerate(zip(steps["megatron"], steps["fsdp2"])):
        for key in COMPARED:
            assert fsdp2[key] == pytest.approx(megatron[key], abs=1e-4), (step, key)
    with RLSession.resume(tmp_path / "fsdp2") as resumed:
        assert resumed.mapping.to_dict() == rl.mapping.to_dict()
        assert_equal_state(saved, actor_state(resumed))
        assert torch.equal(saved["step"], torch.tensor(8))  # AdamW's: 4 steps of two mini-batches
        reference = resumed.step().metrics
        trainers = pids(resumed, "actor")  # the actor's, ref's and critic's two FSDP processes
        kill(resumed, "actor")
        again = resumed.step()  # recreated, rolled back to the step-4 checkpoint, step 5 again
        assert again.step == 5 and pids(resumed, "actor") != trainers
        assert repeatable(again.metrics) == repeatable(reference)
        assert resumed.state.restarts[-1]["recreated"] == ["actor", "critic", "ref"]


# a reward that varies within each group on an untrained model, so that GRPO's advantages and
# gradients are not zero
ODD_LENGTH = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
             "    return float(len(solution_str) % 2)\n"
# the answer's length itself: two answers of a group almost never tie
LENGTH = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return float(len(solution_str))\n"


def length_reward(folder: Path, source: str = LENGTH) -> list[str]:
    """Write ``source`` (ODD_LENGTH or LENGTH) to ``folder``/reward.py; returns the overrides
    that score a run with it."""
    (folder / "reward.py").write_text(source)
    return ["reward.kind=function", f"reward.function={folder / 'reward.py'}:compute_score"]
ACTOR_ONLY = {"pools": {"main": {"devices": 1}},
              "roles": {r: {"pool": "main", "colocate": "engine"} for r in ("actor", "rollout", "reward")}}


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-phi3"])
def test_an_architecture_without_a_converter_trains_on_fsdp2_and_syncs_into_vllm(ray_local, name, tmp_path):
    """Gemma 3 (text) and Phi-3 (fused qkv and gate/up tensors) have no Megatron conversion:
    ``auto`` trains them with FSDP2. Two GRPO steps move the weights; the second step's rollout
    sampled with the first step's synced weights (its log-probs equal the actor's), and after
    the last sync vLLM's greedy tokens equal transformers' on the actor's exported weights."""
    model_dir = str(resolve_model(name))
    overrides = [f"model={model_dir}", "warm_start.max_steps=0", "data.prompts_per_step=4", "rollout.n=4",
                 "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=4", "data.test_samples=8",
                 "trainer.progress=false", f"mapping={ACTOR_ONLY}", *length_reward(tmp_path, ODD_LENGTH),
                 "actor.use_rollout_log_probs=false",
                 "actor.lr=1e-2", "actor.warmup_steps=0", f"trainer.run_dir={tmp_path / 'run'}"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = Batch(objects={"prompt_ids": [tokenizer(s.prompt, add_special_tokens=False).input_ids
                                            for s in get_task("arith").split("test", 8)]})
    with RLSession("grpo", overrides) as rl:
        assert rl.training_backends() == {"actor": "fsdp2"}
        first, second = rl.step(), rl.step()
        assert first.metrics["actor/grad_norm"] > 0 and second.metrics["actor/grad_norm"] > 0
        batch = second.batch
        mask = batch["response_mask"].bool()
        assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
        greedy = rl.workers.groups["rollout"].generate(prompts, GREEDY)["responses"]
        exported = checkpoint.export_hf(rl.workers.groups["actor"], model_dir, tmp_path / "exported")
    assert max_diff(load_hf_state(exported), load_hf_state(model_dir)) > 1e-3  # the steps moved the weights
    assert torch.equal(greedy, hf_greedy(exported, prompts))
