"""LoRA on the fsdp2 backend: adapter-only training and syncs into vLLM, the reference as the
adapter-off base model, checkpoints in PEFT's format, remap and resume; on the real engines."""
import json

import pytest
import torch
from safetensors.torch import load_file

from hybridlab.config import ConfigError
from hybridlab.dataflow.roles import plan_update
from hybridlab.dataflow.session import RLSession
from hybridlab.protocol import Batch
from hybridlab.backend_checks import training_strategy
from hybridlab.run_config import load_config
from hybridlab.tasks import get_task
from hybridlab.workers.train import checkpoint
from hybridlab.workers.train.checkpoint import ADAPTER_CONFIG, ADAPTER_FILE
from tests.test_fsdp import ODD_LENGTH, TRAIN_DP2, length_reward
from tests.test_remap import actor_state, assert_equal_state
from tests.test_sync import GREEDY, hf_greedy
from tests.test_train import hf_logprobs

LORA = ["actor.lora.rank=8", "actor.lora.alpha=16"]
ONE_DEVICE = {"pools": {"main": {"devices": 1}},
              "roles": {r: {"pool": "main", "colocate": "engine"} for r in ("actor", "ref", "rollout", "reward")}}


def test_lora_settings_are_checked_before_anything_starts():
    assert training_strategy(load_config("grpo", LORA), "actor") == "fsdp2"  # auto: LoRA runs on fsdp2
    with pytest.raises(ConfigError, match=r"actor.lora.rank: LoRA runs on the fsdp2 backend .* and"
                                          r" actor.strategy=megatron"):
        load_config("grpo", [*LORA, "actor.strategy=megatron"])
    with pytest.raises(ConfigError, match=r"actor.lora.sync=adapter: needs rollout.backend=vllm"):
        load_config("grpo", [*LORA, "rollout.backend=hf"])
    load_config("grpo", [*LORA, "rollout.backend=hf", "actor.lora.sync=merged"])  # merged: any backend
    with pytest.raises(ConfigError, match=r"actor.lora.dropout: must lie in \[0, 1\), got 1.5"):
        load_config("grpo", [*LORA, "actor.lora.dropout=1.5"])
    with pytest.raises(ConfigError, match=r"actor.lora.sync: 'files' is not one of adapter, merged"):
        load_config("grpo", [*LORA, "actor.lora.sync=files"])
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules: \"all-linear\" or a list of module names"):
        load_config("grpo", [*LORA, "actor.lora.target_modules=q_proj"])
    with pytest.raises(ConfigError, match=r"mapping.roles.actor: tp=2, pp=1, but LoRA \(actor.lora.rank\) runs on the"
                                          r" fsdp2 backend"):
        load_config("grpo", [*LORA, "trainer.devices=2", "mapping={pools: {p: {devices: 2}}, roles: {actor: {pool: p,"
                             " tp: 2, colocate: e}, rollout: {pool: p, tp: 2, colocate: e}, reward: {pool: p, dp: 2,"
                             " colocate: e}}}"])
    load_config("grpo", ["critic.fsdp.param_offload=true"])  # GRPO has no critic: nothing to refuse
    with pytest.raises(ConfigError, match=r"mapping.roles.ref: with actor.lora the reference is the actor's base"
                                          r" model .* give ref the actor's colocate name"):
        load_config("grpo", [*LORA, "actor.use_kl_loss=true", "trainer.devices=2",
                             "mapping={pools: {p: {devices: 2}}, roles: {actor: {pool: p, colocate: e},"
                             " rollout: {pool: p, colocate: e}, reward: {pool: p, colocate: e}, ref: {pool: p}}}"])
    with pytest.raises(ConfigError, match=r"actor.fsdp.param_offload: offload is a setting of the fsdp2 backend,"
                                          r" and actor trains on megatron"):
        load_config("grpo", ["actor.fsdp.param_offload=true"])
    old = load_config("grpo", LORA)
    with pytest.raises(ConfigError, match=r"actor.lora.rank cannot change in a running session: the adapter's"
                                          r" shape is built into"):
        plan_update(old, load_config("grpo", ["actor.lora.rank=16"]), ["actor", "rollout"])
    offload = plan_update(old, load_config("grpo", [*LORA, "actor.fsdp.optimizer_offload=true"]), ["actor", "ref"])
    assert offload.recreate == {"actor", "ref"}


def test_lora_trains_the_adapter_alone_syncs_it_into_vllm_and_resumes_after_a_remap(ray_local, tiny_dir,
                                                                                   tmp_path):
    """Two GRPO steps with a KL loss train only the adapter: each sync sends the adapter's bytes,
    and the next rollout sampled through it (vLLM's log-probs equal the actor's); the reference
    is the base model (its log-probs equal transformers' on the checkpoint). The checkpoint is a
    PEFT adapter that gives vLLM's greedy tokens in transformers. A remap to two DP ranks with a
    rollout of its own carries adapter and moments and syncs across processes; a resume carries them."""
    run = tmp_path / "run"
    overrides = [f"model={tiny_dir}", "warm_start.max_steps=0", "data.prompts_per_step=4", "rollout.n=4",
                 "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=4", "data.test_samples=8", *LORA,
                 "trainer.progress=false", f"mapping={ONE_DEVICE}", *length_reward(tmp_path, ODD_LENGTH),
                 "actor.use_rollout_log_probs=false",
                 "actor.use_kl_loss=true", "actor.lr=1e-2", "actor.warmup_steps=0", f"trainer.run_dir={run}"]
    prompts = Batch(objects={"prompt_ids": [p for p in _prompt_ids(tiny_dir)]})
    with RLSession("grpo", overrides) as rl:
        assert rl.training_backends() == {"actor": "fsdp2", "ref": "fsdp2"}
        first = rl.step()
        rl.update("actor.lr=5e-3")  # a live setting reaches the LoRA actor (and its ref) between steps
        assert rl.workers.groups["actor"].settings()[0]["optim"]["lr"] == 5e-3
        second = rl.step()
        adapter = actor_state(rl)
        adapter_bytes = sum(t.numel() * 4 for k, t in adapter.items() if k.startswith("model/"))
        assert all(".lora_A." in k or ".lora_B." in k for k in adapter if k.startswith("model/"))
        assert second.metrics["sync/bytes"] == adapter_bytes  # the adapter, not the base model
        assert 0 < adapter_bytes < 0.4 * sum(t.numel() * 4 for t in load_file(f"{tiny_dir}/model.safetensors").values())
        assert first.metrics["actor/grad_norm"] > 0 and second.metrics["actor/kl_loss"] > 0
        batch = second.batch
        mask = batch["response_mask"].bool()
        assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
        base = hf_logprobs(str(tiny_dir), batch)
        assert (batch["ref_log_prob"].double() - base)[mask].abs().max() < 1e-5  # the adapter off: the base model
        assert (batch["old_log_probs"].double() - base)[mask].abs().max() > 1e-3  # the adapter on: moved
        greedy = rl.workers.groups["rollout"].generate(prompts, GREEDY)["responses"]
        exported = checkpoint.export_hf(rl.workers.groups["actor"], tiny_dir, tmp_path / "exported")  # merged
        saved = rl.save_checkpoint() / "actor"
        assert (saved / ADAPTER_FILE).is_file() and not (saved / "model.safetensors").exists()
        assert json.loads((saved / ADAPTER_CONFIG).read_text())["r"] == 8

        rl.remap(TRAIN_DP2 | {"roles": {r: TRAIN_DP2["roles"][r] for r in ("actor", "ref", "rollout", "reward")}})
        assert_equal_state(adapter, actor_state(rl))
        third = rl.step()
        assert third.metrics["sync/bytes"] == adapter_bytes  # one copy to the one rollout rank
        batch = third.batch
        mask = batch["response_mask"].bool()  # sampled with the adapter sent across processes
        assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
        before_resume = actor_state(rl)
        rl.save_checkpoint()
    assert torch.equal(greedy, hf_greedy(_merged(tiny_dir, saved, tmp_path / "merged"), prompts))
    assert torch.equal(greedy, hf_greedy(exported, prompts))
    with pytest.raises(ConfigError, match="actor.lora.alpha cannot change when resuming"):
        RLSession.resume(run, ["actor.lora.alpha=32"])
    with RLSession.resume(run) as resumed:
        assert_equal_state(before_resume, actor_state(resumed))
        fourth = resumed.step()
        batch = fourth.batch  # sampled through the adapter the resume installed
        mask = batch["response_mask"].bool()
        assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
        assert fourth.metrics["sync/bytes"] == adapter_bytes


def _prompt_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(s.prompt, add_special_tokens=False).input_ids for s in get_task("arith").split("test", 8)]


def _merged(base_dir, adapter_dir, out):
    """The base model with a saved adapter folded in by peft itself, saved as a plain checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out
