"""Preference losses (``hybridlab.algos.preference``) against TRL 1.16's DPOTrainer: the loss
and its metrics for every loss type on the same pairs, policy and reference."""
import pytest
import torch

from hybridlab.algos.preference import (PREFERENCE_LOSSES, PreferencePairs, PreferenceSettings,
                                        check_preference_settings, preference_loss)
from hybridlab.errors import UserError
from tests.train_settings import train_settings

PAIRS = {"prompt": ["1+2=", "3+4=", "5+6=", "7+1="], "chosen": ["3", "7", "11", "8"],
         "rejected": ["4", "12", "10", "9 9"]}  # responses of different lengths: the normalised losses differ
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@pytest.fixture(scope="module")
def trl_dpo(tiny_dir, tmp_path_factory):
    """TRL's DPOTrainer on the tiny model against a perturbed reference, its first batch, and
    the pairs' sequence log-probs computed here with transformers."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    policy, ref = (AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32) for _ in range(2))
    with torch.no_grad():
        for p in ref.parameters():  # the log-ratios are then not zero, and every loss depends on them
            p.add_(0.05 * torch.randn_like(p))
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4, beta=0.1,
                     bf16=False, report_to=[], use_cpu=True, save_strategy="no", max_steps=1)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_dict(PAIRS),
                         processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()

    def logps(model):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        token = torch.log_softmax(logits.double(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return (token * batch["completion_mask"][:, 1:]).sum(-1).chunk(2)  # the batch is [chosen..., rejected...]

    (chosen, rejected), (ref_chosen, ref_rejected) = logps(policy), logps(ref)
    tokens = batch["completion_mask"][:, 1:].sum(-1).double().chunk(2)
    return trainer, batch, PreferencePairs(chosen, rejected, ref_chosen, ref_rejected, *tokens)


CASES = [[name] for name in PREFERENCE_LOSSES if name != "sft"] + [["sigmoid", "sft"], ["ipo", "apo_zero", "sft"]]


@pytest.mark.parametrize("types", CASES, ids=["+".join(c) for c in CASES])
def test_each_loss_type_equals_trls_with_its_metrics(trl_dpo, types):
    trainer, batch, pairs = trl_dpo
    weights = [1.0, 0.5, 2.0][:len(types)] if len(types) > 1 else None
    smoothing = 0.1 if {"exo_pair", "robust"} & set(types) else 0.0
    trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = types, weights or [1.0], smoothing
    trainer._metrics["train"].clear()
    theirs = trainer.compute_loss(trainer.model, batch).item()
    ours, metrics = preference_loss(pairs, types, weights, PreferenceSettings(beta=0.1, label_smoothing=smoothing))
    assert float(ours) == pytest.approx(theirs, abs=1e-5)
    assert abs(theirs - 0.6931) > 1e-3 or types != ["sigmoid"]  # log 2 would mean log-ratios of zero
    for key in METRICS:
        assert metrics[key] == pytest.approx(trainer._metrics["train"][key][-1], abs=1e-5), key


def test_the_log_ratios_are_not_zero(trl_dpo):
    """The comparison above is a real one: policy and reference differ on every response."""
    pairs = trl_dpo[2]
    assert pairs.chosen_logratios.abs().min() > 1e-3 and pairs.rejected_logratios.abs().min() > 1e-3


def test_pairs_are_tokenized_as_trls_dpo_trainer_does(trl_dpo):
    """Text pairs (end-of-sequence added where missing), text pairs whose prompt is their shared
    start, chat pairs with a prompt column and chat pairs whose prompt is their shared first
    messages: the prompt, chosen and rejected ids equal those of DPOTrainer's dataset preparation."""
    from datasets import Dataset

    from hybridlab.dataflow.pairs import pair_ids
    from hybridlab.tasks.preferences import pair_from_row

    trainer = trl_dpo[0]
    tokenizer = trainer.processing_class
    user = [{"role": "user", "content": "12+30="}]
    said = [[{"role": "assistant", "content": text}] for text in ("42", "52 or so")]
    forms = {"text": [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in zip(*PAIRS.values())]
             + [{"prompt": "9+9=", "chosen": "18" + tokenizer.eos_token, "rejected": "81"}],
             "implicit text prompt": [{"chosen": "Q: 12+30? A: 42", "rejected": "Q: 12+30? A: 52"}],
             "chat": [{"prompt": user, "chosen": said[0], "rejected": said[1]}],
             "implicit chat prompt": [{"chosen": user + said[0], "rejected": user + said[1]}]}
    for form, rows in forms.items():
        theirs = trainer._prepare_dataset(Dataset.from_list(rows), tokenizer, trainer.args, form)
        for i, row in enumerate(rows):
            ours = pair_ids(tokenizer, pair_from_row(row, f"row {i}"))
            assert ours == (theirs[i]["prompt_ids"], theirs[i]["chosen_ids"], theirs[i]["rejected_ids"]), form
            assert ours[1][-1] == tokenizer.eos_token_id or "chat" in form


def test_preference_settings_are_checked_by_name():
    assert check_preference_settings(["exo_pair"], None, 0.0, 0.1) == [
        "dpo.label_smoothing: exo_pair needs it in (0, 1), got 0.0"]
    assert check_preference_settings(["robust"], None, 0.5, 0.1) == [
        "dpo.label_smoothing: robust needs it in [0, 0.5), got 0.5"]
    assert check_preference_settings(["sigmoid", "sft"], [1.0], 0.0, 0.0) == [
        "dpo.loss_weights: 1 weight(s) for 2 loss type(s)", "dpo.beta: must be positive, got 0.0"]
    pairs = PreferencePairs(*(torch.zeros(1) for _ in range(6)))
    with pytest.raises(UserError, match="unknown preference loss 'dpo'.*sigmoid"):
        preference_loss(pairs, ["dpo"])


def test_dpo_on_megatron_and_fsdp2_trains_as_trls_dpo_trainer(ray_local, tiny_dir, tmp_path):
    """Three DPO steps (sigmoid, and a weighted ipo + sft list) on the actor equal TRL's
    DPOTrainer on the same pairs, reference and AdamW: the first step's loss and metrics within
    1e-5, the weights after three steps within 1e-4. Megatron packs micro-batches by a token
    budget that fits about one pair (first fit, longest rows first, yet a pair never straddles two
    micro-batches), at TP2 for the first loss and PP2 for the second; FSDP2 runs two data-parallel
    ranks of two pairs each."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    import ray

    from hybridlab.algos.preference import dpo_loss_fn
    from hybridlab.batching import preference_batch
    from hybridlab.controller.group import RoleClass
    from hybridlab.workers.train.workers import ActorWorker
    from tests.test_train import gathered, hf_logprobs, max_diff, session_for

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / "ref")
    optim = {"lr": 1e-3, "grad_clip": 1.0, "warmup_steps": 0}

    def actor_roles(strategy: str, rows: int, split: dict) -> dict:
        settings = train_settings(**optim, micro_batch_size=rows, strategy=strategy)
        return {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=str(tiny_dir), settings=settings, **split))}

    # One FSDP2 session (two data-parallel ranks of two pairs each) serves both losses: before the
    # second it is set back to the model's weights with zero AdamW moments at step 0, which is what a
    # new session starts from. Megatron's layout differs per loss (TP2, then PP2): a session each.
    fsdp2 = session_for(actor_roles("fsdp2", 4, {}), dp=2)
    fresh = fsdp2.groups["actor"].checkpoint_state()
    for part in filter(None, fresh):
        part.update(exp_avg={k: torch.zeros_like(v) for k, v in part["model"].items()},
                    exp_avg_sq={k: torch.zeros_like(v) for k, v in part["model"].items()}, adam_step=0.0)
    fresh_ref = ray.put(fresh)
    try:
        for (types, weights), split in (((["sigmoid"], None), {"tp": 2}), ((["ipo", "sft"], [1.0, 0.5]), {"pp": 2})):
            args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, beta=0.1, report_to=[],
                             bf16=False, use_cpu=True, save_strategy="no", max_steps=3, learning_rate=1e-3,
                             logging_steps=1, lr_scheduler_type="constant", loss_type=types, loss_weights=weights,
                             seed=0)
            trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32),
                                 ref_model=AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32),
                                 args=args, train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
            trl_batch = next(iter(trainer.get_train_dataloader()))
            trainer.train()
            first = trainer.state.log_history[0]
            theirs = {k: v.detach() for k, v in trainer.model.state_dict().items()}

            # the same pairs in verl's layout: prompt ids, then each pair's chosen and rejected response
            ids, completion = trl_batch["input_ids"], trl_batch["completion_mask"].bool()
            real = trl_batch["attention_mask"].bool()
            prompts = [ids[i][real[i] & ~completion[i]].tolist() for i in range(len(ids))]
            responses = [ids[i][completion[i]].tolist() for i in range(len(ids))]
            half = len(ids) // 2
            batch = preference_batch(prompts[:half], responses[:half], responses[half:], tokenizer.pad_token_id)
            batch.tensors["ref_log_prob"] = hf_logprobs(str(tmp_path / "ref"), batch).float()
            loss_fn = dpo_loss_fn(types, weights, beta=0.1)
            with session_for(actor_roles("megatron", 2, split), **split) as megatron:
                actor = megatron.groups["actor"]
                actor.configure(train_settings(**optim, micro_batch_size=2, strategy="megatron", micro_batch_tokens=16,
                                                remove_padding=True))
                runs = {"megatron": (actor.update_actor([batch] * 3, loss_fn)[0], gathered(actor))}
            actor = fsdp2.groups["actor"]
            actor.load_state([fresh_ref])
            reset = gathered(actor)
            assert max_diff(reset, {k: v for k, v in gathered_initial(tiny_dir).items() if k in reset}) == 0
            runs["fsdp2"] = (actor.update_actor([batch] * 3, loss_fn)[0], gathered(actor))
            for strategy, (metrics, ours) in runs.items():
                for key in ("loss", *METRICS):
                    assert metrics[0][key] == pytest.approx(first[key], abs=1e-5), (types, strategy, key)
                # the loss's scale (each micro-batch's and rank's share) shows in the gradient norm
                assert metrics[0]["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4), (types, strategy)
                assert max_diff(ours, {k: theirs[k] for k in ours}) < 1e-4, (types, strategy)
                assert max_diff(ours, {k: v for k, v in gathered_initial(tiny_dir).items() if k in ours}) > 1e-3
    finally:
        fsdp2.shutdown()


def gathered_initial(model_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def test_a_grpo_session_switches_to_online_dpo_and_back(ray_local, tiny_dir, tmp_path):
    """A running GRPO session (no reference role) switches live to online DPO: the reference
    is built in the running processes of the actor and rollout (neither is re-created, no weights
    move), each step pairs every
    prompt's best sample with its worst (ties dropped and counted) and takes a DPO step on them,
    and the rollout samples with the updated weights; then back to GRPO."""
    from hybridlab.config import ConfigError
    from hybridlab.dataflow.session import RLSession
    from hybridlab.run_config import load_config
    from tests.test_remap import actor_state, assert_equal_state

    from tests.test_fsdp import ODD_LENGTH, length_reward

    # samples of one prompt differ in length: pairs to make
    overrides = [f"model={tiny_dir}", *length_reward(tmp_path, ODD_LENGTH),
                 "warm_start.max_steps=0", "data.prompts_per_step=8", "rollout.n=4",
                 "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=8", "data.test_samples=8",
                 "trainer.progress=false", "actor.lr=1e-3", "actor.warmup_steps=0",
                 f"trainer.run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing: exo_pair needs it in \(0, 1\), got 0.0"):
        load_config("online_dpo", ["dpo.loss_type=exo_pair"])
    with pytest.raises(ConfigError, match=r"rollout.n: pair_best_worst pairs a prompt's best sample with its worst,"
                                          r" so it needs at least 2 samples per prompt, got 1"):
        load_config("online_dpo", ["rollout.n=1"])
    with RLSession("grpo", overrides) as rl:
        rl.step()
        assert "ref" not in rl.workers.groups
        before, pids = actor_state(rl), [p["pid"] for p in rl.workers.groups["actor"].placements]
        rl.update("dpo.online=true", "dpo.beta=0.2")
        report = rl.state.remaps[-1]
        assert "ref" in rl.workers.groups  # the switch started the reference, in the actor's processes
        assert (report.roles_added, report.roles_recreated, report.processes_started, report.bytes_moved) == \
            (["ref"], [], 0, 0)
        assert [p["pid"] for p in rl.workers.groups["ref"].placements] == pids
        assert_equal_state(before, actor_state(rl))  # the actor was not touched
        step = rl.step()
        m = step.metrics
        assert [name for name, _ in step.stages][2:5] == ["pair_best_worst", "ref_logprob", "update_actor_dpo"]
        with pytest.raises(ConfigError, match=r"update_actor_dpo: input '@pairs' is not produced by any earlier stage;"
                                              r" add a stage that produces it \(pair_best_worst\)"):
            load_config("online_dpo", ["dataflow=[generate, reward, ref_logprob, update_actor_dpo, sync_weights]"])
        pairs = m["dpo/pairs"]
        assert pairs + m["dpo/dropped_prompts"] == 8 and pairs > 0
        assert len(step.batch) == 2 * pairs  # the step's batch is its pairs, chosen then rejected
        scores = step.batch["token_level_scores"].sum(-1)
        assert bool((scores[0::2] > scores[1::2]).all())  # each chosen sample scored above its rejected one
        assert m["actor/grad_norm"] > 0 and m["sync/bytes"] > 0  # a DPO step was taken and synced
        assert {"actor/loss", *METRICS} <= set(m)  # TRL's names
        # back to GRPO, the old log-probs computed by the actor: the rollout sampled with the DPO-updated
        # weights, so its log-probs are the actor's (a sync that never landed would leave them apart)
        rl.update("dpo.online=false", "actor.use_rollout_log_probs=false")
        back = rl.step()
        assert "advantages/mean" in back.metrics and "dpo/pairs" not in back.metrics
        assert "old_logprob" in [name for name, _ in back.stages]
        mask = back.batch["response_mask"].bool()
        assert (back.batch["old_log_probs"] - back.batch["rollout_log_probs"])[mask].abs().max() < 1e-4


def test_offline_dpo_trains_on_a_preference_file(ray_local, tiny_dir, tmp_path):
    """The dpo preset on pairs from a JSONL file in TRL's columns: each step's batch is the pairs
    (chosen row, then rejected), the reference scores them, the actor takes a DPO step and the
    rollout gets its weights; on the same four pairs every step, the loss falls and the margin grows."""
    from hybridlab.dataflow.session import RLSession
    from hybridlab.tasks import get_task
    from hybridlab.tasks.preferences import save_preferences, task_pairs

    pairs = task_pairs(get_task("arith"), "train", 4, seed=0)
    path = save_preferences(pairs, tmp_path / "pairs.jsonl")
    overrides = [f"model={tiny_dir}", f"data.train_files={path}", "warm_start.max_steps=0", "data.prompts_per_step=4",
                 "actor.lr=1e-3", "actor.warmup_steps=0", "trainer.progress=false",
                 f"trainer.run_dir={tmp_path / 'run'}"]
    with RLSession("dpo", overrides) as rl:
        steps = [rl.step() for _ in range(3)]
        assert sorted(rl.workers.groups) == ["actor", "ref", "reward", "rollout"]  # rollout, reward: the evaluation
        tokenizer = rl.tokenizer
        rows = rl.decoded(steps[0].batch, limit=2)  # what the notebook's batch table shows: a pair's two rows
        rows_after_ref = rl.inspect(steps[0], "ref_logprob").rows
    first = steps[0]
    assert [name for name, _ in first.stages] == ["ref_logprob", "update_actor_dpo", "sync_weights"]
    batch = first.batch
    chosen = {tokenizer.decode(r[m.bool()]) for r, m in zip(batch["responses"][0::2], batch["response_mask"][0::2])}
    assert chosen == {p.chosen + tokenizer.eos_token for p in pairs}
    assert batch["uid"][0::2] == batch["uid"][1::2]  # each pair's two rows share its uid
    pair = next(p for p in pairs if p.prompt == rows[0]["prompt"])
    assert [(r["prompt"], r["response"]) for r in rows] == [(pair.prompt, pair.chosen), (pair.prompt, pair.rejected)]
    assert rows_after_ref[0]["response"] == pair.chosen and "ref_logp" in rows_after_ref[0]
    losses = [s.metrics["actor/loss"] for s in steps]
    assert losses[2] < losses[1] < losses[0], losses
    assert steps[2].metrics["rewards/margins"] > steps[0].metrics["rewards/margins"]
    assert all(s.metrics["sync/bytes"] > 0 for s in steps)


def test_explain_describes_the_online_dpo_update():
    from hybridlab.explain import explain
    from hybridlab.run_config import load_config

    lines = explain(load_config("online_dpo", ["dpo.beta=0.2"])).lines
    assert [line for line in lines if line.startswith("actor update")] == [
        "actor update (megatron backend): online DPO, one pair per prompt whose samples score differently (at most"
        " 32), 1 optimizer step(s) on all of them per step; dpo.loss_type sigmoid, beta 0.2"]
    offline = explain(load_config("dpo", ["data.prompts_per_step=16"]))
    assert offline.lines[1:3] == [
        "per step: 16 preference pairs (data.prompts_per_step) x 2 (chosen, rejected) = 32 sequences",
        "tokens per step: 32 x (prompt 5.8 mean / 6 max + up to 4 new) = about 314, at most 320"]
    assert "offline DPO, the step's 16 pairs" in offline.lines[3]
