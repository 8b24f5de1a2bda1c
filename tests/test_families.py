"""The model families users bring (Qwen3, Qwen3-MoE, Llama 3, Mistral) on Megatron, checked against
transformers; every config setting the build would not reproduce is refused by name."""
import json

import pytest
from safetensors.torch import save_file
import torch

from hybridlab.controller.group import RoleClass
from hybridlab.errors import UserError
from hybridlab.models.spec import ModelSpec, rope_inv_freq
from hybridlab.models.zoo import model_config, resolve_model
from hybridlab.workers.train.convert import load_hf_state
from hybridlab.workers.train.workers import ActorWorker
from tests.test_train import BATCH, OPTIM, gathered, hf_logprobs, random_batch, session_for
from tests.train_settings import train_settings


def config_of(name: str, **changes) -> dict:
    """The config.json dict of a zoo family (tiny), with changes."""
    return {**json.loads(model_config("tiny", name).to_json_string()), **changes}


@pytest.mark.parametrize("changes,named", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    # transformers 5 writes the scaling under rope_parameters with rope_scaling null
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                "original_max_position_embeddings": 128}}, "rope type 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
])
def test_every_setting_the_build_does_not_reproduce_is_refused_by_name(changes, named):
    with pytest.raises(UserError, match="this llama checkpoint cannot be converted to Megatron: .*" + named.replace(
            "(", r"\(")):
        ModelSpec.from_hf(config_of("llama", **changes))


def test_qwen2_keeps_its_qkv_bias_and_a_qwen3_layer_type_is_named():
    assert ModelSpec.from_hf(config_of("qwen2", attention_bias=True)).qkv_bias
    with pytest.raises(UserError, match="layer_types 'chunked_attention'"):
        ModelSpec.from_hf(config_of("qwen3", layer_types=["full_attention", "chunked_attention"] * 2))
    with pytest.raises(UserError, match="unsupported architecture 'gpt2': hybridlab converts llama, mistral, qwen2, "
                                        "qwen3, qwen3_moe checkpoints"):
        ModelSpec.from_hf({"model_type": "gpt2"})


def test_llama3_rope_reads_either_spelling_and_equals_transformers_frequencies():
    """The Llama 3 scaling of the zoo's tiny-llama3 (original length 64, not megatron's fixed
    8,192) from `rope_parameters` and from the older `rope_scaling`: one spec, and frequencies
    equal to those of transformers' own Llama rotary embedding."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    new = config_of("llama3")
    rope = dict(new["rope_parameters"])
    old = {**new, "rope_parameters": None, "rope_theta": rope.pop("rope_theta"), "rope_scaling": rope}
    spec = ModelSpec.from_hf(new)
    assert ModelSpec.from_hf(old) == spec and dict(spec.rope)["original_max_position_embeddings"] == 64
    reference = LlamaRotaryEmbedding(model_config("tiny", "llama3")).inv_freq
    assert torch.equal(rope_inv_freq(spec), reference)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32))
    assert (reference - plain).abs().max() > 1e-3  # the scaling changes them


def test_mistral_context_is_its_sliding_window_and_qwen_windows_follow_use_sliding_window():
    assert ModelSpec.from_hf(config_of("mistral")).context == 256
    assert ModelSpec.from_hf(config_of("mistral", sliding_window=None)).context == 512
    assert ModelSpec.from_hf(config_of("qwen3", sliding_window=128)).context == 512  # use_sliding_window false
    windowed = config_of("qwen3", sliding_window=128, use_sliding_window=True, max_window_layers=2)
    windowed.pop("layer_types")
    assert ModelSpec.from_hf(windowed).context == 128


TRAINED_AT_TP2: dict = {}  # weights after one step at TP 2, per family, compared with other layouts below


@pytest.fixture(scope="module")
def families(ray_local):
    return {name: str(resolve_model(f"tiny-{name}")) for name in ("qwen3", "llama3", "mistral", "qwen3moe")}


def logprob_gap(model_dir, lp) -> float:
    mask = BATCH["response_mask"].bool()
    return (lp.double() - hf_logprobs(model_dir, BATCH))[mask].abs().max().item()


@pytest.mark.parametrize("name", ["qwen3", "llama3", "mistral"])
def test_tp2_logprobs_equal_transformers_before_and_after_a_step(families, name, tmp_path):
    """Both directions: the checkpoint converted into two TP shards gives transformers'
    log-probs; after one step the shards converted back into an HF checkpoint give the trained
    shards' log-probs in transformers."""
    from hybridlab.workers.train import checkpoint

    model_dir = families[name]
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=model_dir,
                                                         settings=train_settings(**OPTIM, micro_batch_size=4), tp=2))}
    with session_for(roles, tp=2) as s:
        actor = s.groups["actor"]
        assert logprob_gap(model_dir, actor.compute_log_prob(BATCH)["old_log_probs"]) < 1e-5
        actor.sft_step(BATCH)
        trained = actor.compute_log_prob(BATCH)["old_log_probs"]
        TRAINED_AT_TP2[name] = gathered(actor)
        out = checkpoint.export_hf(actor, model_dir, tmp_path / name)
    assert logprob_gap(out, trained) < 1e-5
    assert max((a - load_hf_state(model_dir)[k]).abs().max() for k, a in load_hf_state(out).items()) > 5e-4


def test_qwen3_pp2_logprobs_and_step_equal_tp1(families, tmp_path):
    """QK-norm and tied embeddings split over two pipeline stages: transformers' log-probs, and
    the step's weights equal those of one stage (the tied embedding's gradient from both) and
    of two TP ranks (each holds part of the shared q/k norms' gradient)."""
    qwen3 = families["qwen3"]
    results = {}
    for pp in (2, 1):
        roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=qwen3,
                                                             settings=train_settings(**OPTIM, micro_batch_size=4),
                                                                                     pp=pp))}
        with session_for(roles, pp=pp) as s:
            assert logprob_gap(qwen3, s.groups["actor"].compute_log_prob(BATCH)["old_log_probs"]) < 1e-5
            s.groups["actor"].sft_step(BATCH)
            results[pp] = gathered(s.groups["actor"])
    if "qwen3" not in TRAINED_AT_TP2:  # chosen alone (`pytest -k NAME`): make the TP 2 step here
        test_tp2_logprobs_equal_transformers_before_and_after_a_step(families, "qwen3", tmp_path)
    for other in (results[2], TRAINED_AT_TP2["qwen3"]):
        assert max((other[k] - results[1][k]).abs().max() for k in results[1]) < 1e-4


def test_qwen3moe_spec_reads_the_experts_and_which_layers_are_sparse():
    spec = ModelSpec.from_hf(config_of("qwen3moe"))
    assert (spec.moe.experts, spec.moe.top_k, spec.moe.intermediate, spec.moe.norm_topk_prob) == (4, 2, 64, True)
    assert spec.moe.sparse_layers == (1, 2, 3) and spec.moe.aux_loss_coef == 0.01
    every_second = config_of("qwen3moe", mlp_only_layers=[], decoder_sparse_step=2)
    assert ModelSpec.from_hf(every_second).moe.sparse_layers == (1, 3)
    assert "the expert MLP width 64 is not divisible by tp=128" in spec.layout_problems(128, 1)


def routing_reference(model_dir, batch, micro_batch_size: int) -> dict[str, float]:
    """The routing metrics of one update computed from transformers' model: tokens per expert
    (top-k of each real token's router softmax, summed over sparse layers), the busiest
    expert's load over the mean, and Megatron's load-balancing loss, E / (k T^2) sum_e
    tokens_e * sum_t p_te per micro-batch of T real tokens, averaged over micro-batches and layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    spec = ModelSpec.from_hf(model_dir)
    k, experts = spec.moe.top_k, spec.moe.experts
    inputs: dict[int, torch.Tensor] = {}
    for layer in spec.moe.sparse_layers:
        model.model.layers[layer].mlp.register_forward_pre_hook(
            lambda module, args, layer=layer: inputs.__setitem__(layer, args[0]))
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              position_ids=batch["position_ids"])
    counts, losses, loads = torch.zeros(experts), [], []
    for layer in spec.moe.sparse_layers:
        gate = model.model.layers[layer].mlp.gate.weight
        layer_counts = torch.zeros(experts)
        for start in range(0, len(batch), micro_batch_size):
            real = batch["attention_mask"][start:start + micro_batch_size].bool()
            probs = torch.softmax(inputs[layer][start:start + micro_batch_size][real] @ gate.T, -1)
            routed = torch.zeros_like(probs).scatter(1, probs.topk(k, -1).indices, 1.0).sum(0)
            layer_counts += routed
            losses.append(float(experts / (k * len(probs) ** 2) * (routed * probs.sum(0)).sum()))
        counts += layer_counts
        loads.append(float(layer_counts.max() / layer_counts.mean()))
    return {**{f"moe/expert_tokens/{e}": float(n) for e, n in enumerate(counts)},
            "moe/expert_load_max": max(loads), "moe/load_balancing_loss": sum(losses) / len(losses)}


def test_qwen3moe_logprobs_and_a_step_agree_at_tp1_tp2_pp2_and_ep2(families, tmp_path):
    """Routed experts, a dense first layer and tied embeddings at TP 1, TP 2, PP 2 and EP 2 (two
    data-parallel ranks with two experts each):
    transformers' log-probs before a step, and after it the same gradient norm (the
    load-balancing loss included: each TP rank routes every token, and the experts' gradient
    is counted once) and the same weights. Each layout's routing metrics (tokens per expert,
    the load-balancing loss) equal those computed from transformers' routers, and the trained
    shards exported back to an HF checkpoint give their log-probs in transformers."""
    from hybridlab.workers.train import checkpoint

    moe = families["qwen3moe"]
    reference = routing_reference(moe, BATCH, micro_batch_size=4)
    assert sum(v for k, v in reference.items() if "tokens" in k) == 3 * 2 * int(BATCH["attention_mask"].sum())
    results = {}
    for tp, pp, ep in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)):
        roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=moe,
                                                             settings=train_settings(**OPTIM, micro_batch_size=4), tp=tp,
                                                                                     pp=pp, ep=ep))}
        with session_for(roles, tp=tp, pp=pp, dp=ep, ep=ep) as s:
            assert logprob_gap(moe, s.groups["actor"].compute_log_prob(BATCH)["old_log_probs"]) < 1e-5
            if ep > 1:  # 7 rows: 4 on one EP rank, 3 on the other, which fills its micro-batch with padding
                odd = random_batch(7, seed=1)
                gap = (s.groups["actor"].compute_log_prob(odd)["old_log_probs"].double() - hf_logprobs(moe, odd))
                assert gap[odd["response_mask"].bool()].abs().max() < 1e-5
            metrics = s.groups["actor"].sft_step(BATCH)[0]
            results[tp, pp, ep] = metrics["grad_norm"], gathered(s.groups["actor"])
            trained = s.groups["actor"].compute_log_prob(BATCH)["old_log_probs"]
            assert logprob_gap(checkpoint.export_hf(s.groups["actor"], moe, tmp_path / f"{tp}{pp}{ep}"), trained) < 1e-5
        assert {k: metrics[k] for k in reference} == pytest.approx(reference, rel=1e-5), (tp, pp, ep)
    norm, weights = results[1, 1, 1]
    assert any(".mlp.experts.3.down_proj" in k for k in weights) and "model.layers.0.mlp.gate_proj.weight" in weights
    for layout in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        assert results[layout][0] == pytest.approx(norm, rel=1e-5), layout
        assert max((results[layout][1][k] - weights[k]).abs().max() for k in weights) < 1e-4, layout


def test_an_unconverted_architecture_goes_to_fsdp2_and_megatron_refuses_it_by_name(tmp_path):
    """``auto`` trains what Megatron cannot reproduce with FSDP2; ``megatron`` asked for names
    the architecture or the setting before any worker starts; what transformers cannot build is
    refused whatever the strategy."""
    from hybridlab.config import ConfigError
    from hybridlab.backend_checks import training_strategy
    from hybridlab.run_config import load_config

    for name, config in (("gpt2", {"model_type": "gpt2", "n_layer": 2}),
                         ("yarn", config_of("qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                     "rope_theta": 1e4})),
                         ("unknown", {"model_type": "no_such_llm"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        if name != "unknown":  # the spec reads tensor names and shapes from the weight files
            save_file({"w": torch.zeros(2, 2)}, str(tmp_path / name / "model.safetensors"))
    for name in ("gpt2", "yarn"):
        cfg = load_config(overrides=[f"model={tmp_path / name}"])
        assert training_strategy(cfg, "actor") == training_strategy(cfg, "critic") == "fsdp2"
    with pytest.raises(ConfigError, match="model: unsupported architecture 'gpt2': hybridlab converts llama, mistral,"
                                          r" qwen2, qwen3, qwen3_moe checkpoints to Megatron \(the fsdp2 backend trains other"
                                          r" architectures\) \(actor.strategy=megatron; auto or fsdp2 trains it"):
        load_config(overrides=[f"model={tmp_path / 'gpt2'}", "actor.strategy=megatron"])
    with pytest.raises(ConfigError, match="model: this qwen3 checkpoint cannot be converted to Megatron: rope type"
                                          " 'yarn' \\(supported: default, linear, llama3\\) \\(critic.strategy=megatron"):
        load_config(overrides=[f"model={tmp_path / 'yarn'}", "critic.strategy=megatron"])
    with pytest.raises(ConfigError, match="transformers cannot read this checkpoint's config"):
        load_config(overrides=[f"model={tmp_path / 'unknown'}"])
    (tmp_path / "gpt2" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="gpt2: no model\\*.safetensors weights found"):
        load_config(overrides=[f"model={tmp_path / 'gpt2'}"])


def test_a_prompt_past_mistrals_sliding_window_is_named(families):
    """Within its window, windowed attention is full attention: a run's prompt plus its response
    must fit the window, and a longer prompt is refused naming the window, not the context."""
    from transformers import AutoTokenizer

    from hybridlab.dataflow.prompts import PromptFit, tokenize_prompts
    from hybridlab.run_config import load_config
    from hybridlab.tasks import Sample

    cfg = load_config(overrides=[f"model={families['mistral']}", "rollout.max_new_tokens=200"])
    fit = PromptFit.of(cfg, families["mistral"])
    assert (fit.context, fit.room) == (256, 56)
    tokenizer = AutoTokenizer.from_pretrained(families["mistral"])
    with pytest.raises(UserError, match="more than the 56 that fit \\(the model's sliding window of 256 minus"
                                        " rollout.max_new_tokens=200\\)"):
        tokenize_prompts([Sample(prompt="1+2=" * 40, ground_truth="3", data_source="arith")], tokenizer, fit)


@pytest.mark.parametrize("name", ["qwen3", "llama3", "mistral", "qwen3moe"])
def test_vllm_greedy_tokens_after_steps_and_a_sync_equal_transformers(families, name, tmp_path):
    """Steps on the actor, the weights resharded into a colocated vLLM engine: its greedy
    tokens equal transformers' on the same weights (exported), and differ from before."""
    from hybridlab.controller.mapping import DeviceMapping
    from hybridlab.controller.worker_set import WorkerSet
    from hybridlab.reshard.plan import RolloutLayout, TrainerLayout
    from hybridlab.reshard.transfer import sync_weights
    from hybridlab.workers.rollout.worker import RolloutWorker
    from hybridlab.workers.train import checkpoint
    from tests.test_sync import GREEDY, hf_greedy

    model_dir = families[name]
    mapping = DeviceMapping.from_dict({"pools": {"p": {"devices": 1}},
                                       "roles": {"actor": {"pool": "p", "colocate": "hybrid"},
                                                 "rollout": {"pool": "p", "colocate": "hybrid"}}})
    roles = {"actor": RoleClass(ActorWorker, kwargs=dict(model_dir=model_dir, settings=train_settings(lr=2e-2))),
             "rollout": RoleClass(RolloutWorker, kwargs=dict(model_dir=model_dir, max_model_len=64))}
    from transformers import AutoTokenizer

    from hybridlab.protocol import Batch
    from hybridlab.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = Batch(objects={"prompt_ids": [tokenizer(s.prompt, add_special_tokens=False).input_ids
                                            for s in get_task("arith").split("test", 8)]})
    with WorkerSet(mapping, roles, timeout=300) as s:
        actor, rollout = s.groups["actor"], s.groups["rollout"]
        before = rollout.generate(prompts, GREEDY)["responses"]
        for _ in range(4):  # a sharper model than random init: greedy choices without near-ties
            actor.sft_step(BATCH)
        sync_weights(actor, rollout, ModelSpec.from_hf(model_dir), TrainerLayout(), RolloutLayout())
        after = rollout.generate(prompts, GREEDY)
        exported = checkpoint.export_hf(actor, model_dir, tmp_path / name)
    assert torch.equal(after["responses"], hf_greedy(exported, prompts))
    assert not torch.equal(after["responses"], before)
    # and the engine's log-probs are transformers' on the exported weights (every tensor synced)
    mask = after["response_mask"].bool()
    assert (after["rollout_log_probs"].double() - hf_logprobs(exported, after))[mask].abs().max() < 1e-4


ACTOR_EP2 = {"pools": {"train": {"devices": 2}, "gen": {"devices": 1}},
             "roles": {"actor": {"pool": "train", "dp": 2, "ep": 2},
                       "rollout": {"pool": "gen", "colocate": "g"}, "reward": {"pool": "gen", "colocate": "g"}}}


def imports_transformers(rl, role: str) -> bool:
    """Whether any process of ``role`` has imported transformers (a training process on its own
    does not need it: the controller hands it the checkpoint's ModelSpec)."""
    import ray

    hosts = rl.workers.groups[role].hostset.hosts
    return any("transformers" in names for names in ray.get([h.loaded_modules.remote() for h in hosts]))


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe"])
def test_a_run_remaps_the_actor_and_resumes_with_its_state_exact(families, name, tmp_path):
    """Two GRPO steps on the checkpoint as a user gives it (`model=DIR`); a remap of the actor
    (Qwen3 to TP 2; Qwen3-MoE to EP 2, its experts split over two data-parallel ranks) and a
    resume from a checkpoint both carry the weights and AdamW moments bit for bit (QK-norm,
    tied embeddings and the experts and routers included), the next sync lands (the rollout's
    log-probs are the actor's), and the run goes on."""
    from hybridlab.dataflow.session import RLSession
    from tests.test_fsdp import length_reward
    from tests.test_remap import ACTOR_TP2, SEPARATE, actor_state, assert_equal_state, fixed_batch

    # the untrained model scores 0 on every prompt: a reward by the answer's length differs within a
    # group, so the steps move the weights and fill the moments the remap and the resume must carry
    overrides = [f"model={families[name]}", "warm_start.max_steps=0", "data.prompts_per_step=4", "rollout.n=2",
                 "rollout.max_new_tokens=6", "actor.ppo_mini_batch_size=4", "data.test_samples=8",
                 "trainer.progress=false", f"mapping={SEPARATE}", *length_reward(tmp_path), "actor.lr=1e-2",
                 "actor.warmup_steps=0"]
    with RLSession("grpo", [*overrides, f"trainer.run_dir={tmp_path / 'run'}"]) as rl:
        initial = actor_state(rl)
        for _ in range(2):
            rl.step()
        assert not imports_transformers(rl, "actor")  # the controller's spec: its process never reads the config
        before = actor_state(rl)
        assert max(float((before[k] - initial[k]).abs().max()) for k in before if k.startswith("model/")) > 1e-3
        assert min(float(before[k].abs().max()) for k in before if k.startswith("exp_avg/")) > 0  # every tensor's
        assert rl.remap(ACTOR_EP2 if name == "qwen3moe" else ACTOR_TP2).roles_recreated == ["actor"]
        assert_equal_state(before, actor_state(rl))
        assert not imports_transformers(rl, "actor")  # the remap's new processes (every rank) too
        assert any(k.endswith("q_norm.weight") for k in before)
        if name == "qwen3moe":
            assert any(k.endswith("experts.3.down_proj.weight") for k in before) and any(
                k.endswith("mlp.gate.weight") for k in before)
        rl.step()
        batch = fixed_batch(rl)
        mask = batch["response_mask"].bool()
        actor = rl.workers.groups["actor"].compute_log_prob(batch)["old_log_probs"]
        assert (actor - batch["rollout_log_probs"])[mask].abs().max() < 1e-4
        saved = actor_state(rl)
        rl.save_checkpoint()
    with RLSession.resume(tmp_path / "run") as resumed:
        assert resumed.state.step_count == 3 and resumed.mapping == rl.mapping
        assert_equal_state(saved, actor_state(resumed))
        resumed.step()
        assert actor_state(resumed)["step"].item() == 4
