"""verl's ``main_ppo`` keys and what each becomes in hybridlab: one table, read by ``translate``
and printed as docs/verl.md's table (``tests/test_verl_keys.py`` checks that the two agree).

Each key gets one of three treatments:

- **translated** (``to``): hybridlab's setting with the same meaning and units, its value passed
  through ``convert``; a key that several verl keys decide together (the micro-batch token budget,
  the devices, the layouts, the steps) names its target and is computed in ``translate.py``;
- **noted** (``note``): an engine detail with no meaning on hybridlab's engines, accepted and
  listed once at start with the reason;
- **refused** (``refuse``): values that ask for something hybridlab does not do are refused with
  the reason; the others are translated.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

AR = "actor_rollout_ref."
A, R, REF, M = AR + "actor.", AR + "rollout.", AR + "ref.", AR + "model."


@dataclasses.dataclass(frozen=True)
class Key:
    """One verl key: where it goes, or why it changes nothing here, and which values are refused."""
    verl: str
    to: str = ""                                          # hybridlab's key, or what a joint rule sets
    note: str = ""                                        # accepted with a note: why it changes nothing
    refuse: Callable[[Any], str] | None = None            # the reason a value is refused ("" when accepted)
    convert: Callable[[Any], Any] | None = None           # verl's value -> hybridlab's
    joint: bool = False                                   # computed in translate.py with other keys

    @property
    def treatment(self) -> str:
        """Return the treatment as docs/verl.md shows it: translated, noted or refused, and
        whether some values are refused."""
        if not self.to and not self.note:
            return "refused"
        base = "noted" if self.note else "translated"
        return base + ("; other values refused" if self.refuse is not None else "")

    @property
    def becomes(self) -> str:
        """Return what the key becomes (its hybridlab setting), or why it is noted or refused."""
        if self.note:
            return self.note
        if not self.to:
            return self.refuse(None) if self.refuse else ""
        return self.to if self.joint else f"`{self.to}`"


def only(allowed: tuple, why: str) -> Callable[[Any], str]:
    """Return a check refusing any value outside ``allowed`` with ``why``."""
    return lambda value: "" if value in allowed else f"{why} (accepted: {', '.join(map(str, allowed))})"


def noted_when(verl: str, allowed: tuple, why: str) -> Key:
    """Return a key accepted with the note ``why`` for the ``allowed`` values, and refused with
    the same reason for any other."""
    return Key(verl, note=why, refuse=only(allowed, why))


def at_most_one(why: str) -> Callable[[Any], str]:
    """Return a check refusing a parallel size above 1 with ``why``."""
    return lambda value: "" if value in (None, 1, -1) else why


def local_model(value: Any) -> str:
    """Refuse a hub model id: hybridlab loads local checkpoints (and its zoo presets) only."""
    text = str(value)
    if "/" in text and not Path(text).expanduser().exists():
        return (f"{text!r} is not a local directory; hybridlab loads local checkpoints only (no hub downloads):"
                " download the model first and give its path")
    return ""


def _top_k(value: Any) -> int:
    return 0 if value in (None, -1) else int(value)


def _strategy(value: Any) -> str:
    return {"fsdp": "fsdp2", "fsdp2": "fsdp2", "dp": "fsdp2", "megatron": "megatron"}[value]


_STRATEGY = only(("fsdp", "fsdp2", "dp", "megatron"), "hybridlab trains on FSDP2 or Megatron-core")
_SPEED = "speed and memory only: the computed numbers do not depend on it"
_VLLM = "a vLLM engine setting for speed and memory; hybridlab's rollout engine sizes itself (rollout.kv_cache_mb)"
_LOGPROB = ("hybridlab's log-prob passes use the actor's micro-batches (actor.micro_batch_size and"
            " actor.micro_batch_tokens); the numbers do not depend on them")
_REF_LAYOUT = "the reference runs in the actor's processes and layout (the hybrid engine); set the actor's"
_OFFLOAD = "host-memory offload of a Megatron role: memory only (on CPU machines the weights are in host memory)"
_NO_SP = "hybridlab has no Ulysses or context sequence parallelism"
_MEGATRON = "Megatron kernel fusions and recomputation: " + _SPEED
_REWARD_MODEL_ROLLOUT = ("a generative reward model's engine: hybridlab's reward models are sequence-classification"
                         " checkpoints (reward_model.model.path)")

KEYS: list[Key] = [
    # data
    Key("data.train_files", "data.train_files"),
    Key("data.val_files", "data.test_files"),
    Key("data.train_batch_size", "data.prompts_per_step"),
    Key("data.max_response_length", "rollout.max_new_tokens"),
    Key("data.max_prompt_length", note="hybridlab checks every prompt against the model's context minus"
        " data.max_response_length when the run starts, and refuses a longer one by file and row (data.truncation=left:"
        " keeps its last tokens)"),
    Key("data.truncation", "data.truncate_prompts", refuse=only(("error", "left"), "hybridlab refuses long prompts or"
        " keeps their last tokens"), convert=lambda v: v == "left"),
    Key("data.filter_overlong_prompts", note="over-long prompts are refused by file and row before the run starts,"
        " never dropped in silence"),
    noted_when("data.shuffle", (True,), "hybridlab draws each step's prompts in a seeded random order (data.seed)"),
    Key("data.seed", "data.seed"),
    Key("data.return_raw_chat", note="chat prompts are kept as messages and rendered with the template anyway"),
    noted_when("data.prompt_key", ("prompt",), "hybridlab reads the prompt column 'prompt'"),
    Key("data.image_key", refuse=lambda v: "image prompts are not supported: hybridlab trains on text only"),
    Key("data.val_batch_size", note="the evaluation scores every validation prompt in one pass"),
    # the model
    Key(M + "path", "model", refuse=local_model),
    Key(M + "use_remove_padding", "actor.remove_padding"),
    Key(M + "enable_gradient_checkpointing", note="activation recomputation: " + _SPEED),
    Key(M + "use_fused_kernels", note="fused kernels: " + _SPEED),
    Key(M + "use_shm", note="loading the checkpoint through shared memory: speed only"),
    Key(M + "lora_rank", "actor.lora.rank"),
    Key(M + "lora_alpha", "actor.lora.alpha"),
    Key(M + "target_modules", "actor.lora.target_modules"),
    # the actor
    Key(A + "strategy", "actor.strategy", refuse=_STRATEGY, convert=_strategy),
    Key(A + "optim.lr", "actor.lr"),
    Key(A + "optim.weight_decay", "actor.weight_decay"),
    Key(A + "optim.clip_grad", "actor.grad_clip"),
    Key(A + "grad_clip", "actor.grad_clip"),
    Key(A + "optim.lr_warmup_steps", "actor.warmup_steps (in optimizer steps)", joint=True),
    Key(A + "optim.lr_warmup_steps_ratio", "actor.warmup_steps (in optimizer steps)", joint=True),
    Key(A + "ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    Key(A + "ppo_epochs", "actor.ppo_epochs"),
    Key(A + "ppo_micro_batch_size_per_gpu", "actor.micro_batch_size"),
    Key(A + "use_dynamic_bsz", "actor.micro_batch_tokens (0 when false)", joint=True),
    Key(A + "ppo_max_token_len_per_gpu", "actor.micro_batch_tokens (when use_dynamic_bsz)", joint=True),
    Key(A + "clip_ratio", "actor.clip_ratio"),
    Key(A + "clip_ratio_low", "actor.clip_ratio_low"),
    Key(A + "clip_ratio_high", "actor.clip_ratio_high"),
    Key(A + "clip_ratio_c", "actor.clip_ratio_c"),
    Key(A + "loss_agg_mode", "actor.loss_agg_mode"),
    Key(A + "entropy_coeff", "actor.entropy_coeff"),
    Key(A + "use_kl_loss", "actor.use_kl_loss"),
    Key(A + "kl_loss_coef", "actor.kl_loss_coef"),
    Key(A + "kl_loss_type", "actor.kl_loss_type"),
    Key(A + "policy_loss.loss_mode", "actor.policy_loss"),
    Key(A + "fsdp_config.param_offload", "actor.fsdp.param_offload"),
    Key(A + "fsdp_config.optimizer_offload", "actor.fsdp.optimizer_offload"),
    Key(A + "fsdp_config.fsdp_size", refuse=only((-1, None), "hybridlab shards FSDP2 over all the role's DP ranks"),
        note="FSDP2 shards over all the role's data-parallel ranks"),
    Key(A + "ulysses_sequence_parallel_size", refuse=at_most_one(_NO_SP), note=_NO_SP + "; 1 is the same"),
    Key(A + "use_torch_compile", note="torch.compile: " + _SPEED),
    Key(A + "megatron.tensor_model_parallel_size", "mapping: actor, ref and critic tp", joint=True),
    Key(A + "megatron.pipeline_model_parallel_size", "mapping: actor, ref and critic pp", joint=True),
    Key(A + "megatron.expert_model_parallel_size", "mapping: actor, ref and critic ep", joint=True),
    Key(A + "megatron.expert_tensor_parallel_size", refuse=at_most_one("hybridlab's experts use the role's tensor"
        " parallelism; expert_tensor_parallel_size above 1 is not supported"), note="1: the experts are not split"),
    Key(A + "megatron.context_parallel_size", refuse=at_most_one(_NO_SP), note=_NO_SP + "; 1 is the same"),
    Key(A + "megatron.param_offload", note=_OFFLOAD),
    Key(A + "megatron.optimizer_offload", note=_OFFLOAD),
    Key(A + "megatron.grad_offload", note=_OFFLOAD),
    Key(A + "megatron.use_mbridge", note="hybridlab converts Hugging Face weights to Megatron's layout itself"),
    *(Key(A + "megatron.override_transformer_config." + name, note=_MEGATRON) for name in (
        "recompute_method", "recompute_granularity", "recompute_num_layers", "gradient_accumulation_fusion",
        "moe_permute_fusion", "apply_rope_fusion", "moe_enable_deepep", "moe_token_dispatcher_type")),
    noted_when(A + "megatron.override_transformer_config.moe_router_dtype", ("fp32",),
               "hybridlab's router computes in fp32"),
    # the rollout
    Key(R + "name", "rollout.backend", refuse=only(("vllm",), "hybridlab's rollout engine is vLLM")),
    Key(R + "mode", refuse=only(("async", "sync"), "verl's rollout modes are async and sync"),
        note="hybridlab's rollout workers generate each step's batch (asynchrony: trainer.off_policy)"),
    Key(R + "n", "rollout.n"),
    Key(R + "temperature", "rollout.temperature"),
    Key(R + "top_p", "rollout.top_p"),
    Key(R + "top_k", "rollout.top_k", convert=_top_k),
    Key(R + "tensor_model_parallel_size", "mapping: rollout tp", joint=True),
    Key(R + "gpu_memory_utilization", note=_VLLM),
    Key(R + "enable_chunked_prefill", note=_VLLM),
    Key(R + "enforce_eager", note="CUDA graphs on or off: " + _SPEED),
    Key(R + "free_cache_engine", note="hybridlab's engine frees and rebuilds its cache around each weight sync itself"),
    Key(R + "load_format", note="the rollout engine starts from the actor's weights through hybridlab's sync"),
    Key(R + "layered_summon", note="hybridlab's weight sync gathers layer by layer already (reshard plan buckets)"),
    Key(R + "max_num_batched_tokens", note=_VLLM),
    Key(R + "max_num_seqs", note=_VLLM),
    Key(R + "max_model_len", note="the engine's context is the model's"),
    Key(R + "engine_kwargs.vllm.disable_mm_preprocessor_cache", note="image inputs only"),
    Key(R + "checkpoint_engine.update_weights_bucket_megabytes", note="hybridlab's sync sizes its buckets itself"),
    Key(R + "log_prob_micro_batch_size_per_gpu", note=_LOGPROB),
    Key(R + "log_prob_use_dynamic_bsz", note=_LOGPROB),
    Key(R + "log_prob_max_token_len_per_gpu", note=_LOGPROB),
    Key(R + "val_kwargs.do_sample", "evaluation.temperature (0, greedy, when false)", joint=True),
    Key(R + "val_kwargs.temperature", "evaluation.temperature (when do_sample)", joint=True),
    Key(R + "val_kwargs.n", "evaluation.n"),
    Key(R + "val_kwargs.top_p", "evaluation.top_p"),
    Key(R + "val_kwargs.top_k", "evaluation.top_k", convert=_top_k),
    Key(R + "multi_turn.tool_config_path", refuse=lambda v: "verl's tool configs are not read; hybridlab's agent"
        " rollouts take rollout.tools, rollout.agent or rollout.env (docs/agents.md)"),
    # the reference
    Key(REF + "log_prob_micro_batch_size_per_gpu", note=_LOGPROB),
    Key(REF + "log_prob_use_dynamic_bsz", note=_LOGPROB),
    Key(REF + "log_prob_max_token_len_per_gpu", note=_LOGPROB),
    Key(REF + "fsdp_config.param_offload", note="the reference follows actor.fsdp (it runs in the actor's processes)"),
    *(Key(REF + "megatron." + name, note=_REF_LAYOUT + "'s") for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
        "expert_tensor_parallel_size", "context_parallel_size", "param_offload")),
    # the critic
    Key("critic.model.path", "the actor's model (the critic starts from it; another path is refused)", joint=True),
    Key("critic.strategy", "critic.strategy", refuse=_STRATEGY, convert=_strategy),
    Key("critic.optim.lr", "critic.lr"),
    Key("critic.optim.weight_decay", "critic.weight_decay"),
    Key("critic.optim.clip_grad", "critic.grad_clip"),
    Key("critic.grad_clip", "critic.grad_clip"),
    Key("critic.ppo_mini_batch_size", "critic.ppo_mini_batch_size"),
    Key("critic.ppo_epochs", "critic.ppo_epochs"),
    Key("critic.ppo_micro_batch_size_per_gpu", "critic.micro_batch_size"),
    Key("critic.use_dynamic_bsz", "critic.micro_batch_tokens (0 when false)", joint=True),
    Key("critic.ppo_max_token_len_per_gpu", "critic.micro_batch_tokens (when use_dynamic_bsz)", joint=True),
    Key("critic.cliprange_value", "critic.cliprange_value"),
    Key("critic.loss_agg_mode", "critic.loss_agg_mode"),
    Key("critic.model.use_remove_padding", "critic.remove_padding"),
    Key("critic.model.enable_gradient_checkpointing", note="activation recomputation: " + _SPEED),
    Key("critic.model.fsdp_config.param_offload", "critic.fsdp.param_offload"),
    Key("critic.model.fsdp_config.optimizer_offload", "critic.fsdp.optimizer_offload"),
    # the algorithm: verl's names are hybridlab's
    *(Key(f"algorithm.{name}", f"algorithm.{name}") for name in (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty",
        "kl_ctrl.type", "kl_ctrl.kl_coef", "kl_ctrl.target_kl", "kl_ctrl.horizon")),
    # rewards: verl 0.9's section and the legacy keys
    *(key for prefix in ("reward.", "") for key in (  # verl 0.9's reward section, and the legacy keys
        Key(prefix + "custom_reward_function.path", "reward.kind=function, reward.function=PATH:NAME", joint=True),
        Key(prefix + "custom_reward_function.name", "reward.function=PATH:NAME", joint=True),
        Key(prefix + "custom_reward_function.reward_kwargs", "reward.function_kwargs"))),
    Key("reward.reward_manager.name", "the reward manager (naive, dapo, gdpo)", joint=True),
    Key("reward_model.reward_manager", "the reward manager (naive, dapo, gdpo)", joint=True),
    Key("reward.num_workers", note="the reward role runs on the rollout's devices (dataflow/roles.py)"),
    Key("reward.reward_model.enable", "reward.kind=model", joint=True),
    Key("reward.reward_model.model_path", "reward.model"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.log", note="the overlong penalty is always logged"
        " (reward/overlong_penalty)"),
    Key("reward_model.reward_kwargs.max_resp_len", note="the overlong penalty counts to data.max_response_length"),
    Key("reward_model.enable", "reward.kind=model", joint=True),
    Key("reward_model.model.path", "reward.model"),
    Key("reward_model.use_reward_loop", note="how verl schedules reward calls; hybridlab's reward role is one stage"),
    # the code sources: verl sends code to a Sandbox Fusion service; hybridlab runs it in its own sandbox
    *(k for prefix in ("reward.", "reward_model.") for k in (
        Key(prefix + "sandbox_fusion.url", note="code answers run in hybridlab's own sandbox (docs/sandbox.md)"),
        Key(prefix + "sandbox_fusion.max_concurrent", "sandbox.parallel"),
        Key(prefix + "sandbox_fusion.memory_limit_mb", "sandbox.memory_mb"))),
    Key("reward_model.num_workers", note="the reward role runs on the rollout's devices (dataflow/roles.py)"),
    *(Key(f"reward_model.rollout.{name}", refuse=lambda v: _REWARD_MODEL_ROLLOUT)
      for name in ("name", "gpu_memory_utilization", "tensor_model_parallel_size", "prompt_length",
                   "response_length")),
    # the trainer
    Key("trainer.project_name", "trainer.project_name"),
    Key("trainer.experiment_name", "name"),
    Key("trainer.logger", "trainer.logger", convert=lambda v: [v] if isinstance(v, str) else list(v)),
    Key("trainer.n_gpus_per_node", "trainer.devices (n_gpus_per_node x nnodes)", joint=True),
    Key("trainer.nnodes", "trainer.devices (n_gpus_per_node x nnodes)", joint=True),
    Key("trainer.total_epochs", "trainer.steps (epochs x train rows // train_batch_size)", joint=True),
    Key("trainer.total_training_steps", "trainer.steps", joint=True),
    Key("trainer.test_freq", "trainer.eval_every", convert=lambda v: max(0, int(v))),
    Key("trainer.save_freq", "trainer.save_every", convert=lambda v: max(0, int(v))),
    Key("trainer.val_before_train", refuse=only((True,), "hybridlab always evaluates before the first step"),
        note="hybridlab evaluates before the first step"),
    # verl counts steps from 1 and skips the actor's update while critic_warmup is above the step
    Key("trainer.critic_warmup", "trainer.critic_warmup", convert=lambda v: max(0, int(v) - 1)),
    Key("trainer.resume_mode", "hybridlab train: auto resumes from trainer.default_local_dir's latest checkpoint"
        " when it has one, disable starts afresh, resume_path resumes trainer.resume_from_path",
        refuse=only(("auto", "disable", "resume_path"), "verl's resume modes"), joint=True),
    Key("trainer.resume_from_path", "resume_path: a run directory (its latest checkpoint) or a checkpoint (step-N);"
        " trainer.default_local_dir goes on from it (another run's checkpoint is linked in first)", joint=True),
    Key("trainer.default_local_dir", "trainer.run_dir"),
    Key("trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoints"),
    Key("trainer.rollout_data_dir", "trainer.rollout_data_dir",
        convert=lambda v: os.path.abspath(os.path.expanduser(v)) if v else None),  # verl's: from where it started
    Key("trainer.log_val_generations", note="the validation generations are in the run directory's records"),
    Key("model_engine", "actor.strategy and critic.strategy", refuse=_STRATEGY, joint=True),
]

# prefixes whose every key is accepted with a note
NOTED_PREFIXES = {"ray_kwargs.": "hybridlab starts or attaches to Ray itself (hybridlab train --ray-address)"}

BY_KEY: dict[str, Key] = {k.verl: k for k in KEYS}


def lookup(key: str) -> Key | None:
    """Return the table's entry for ``key`` (a noted prefix's entry made on the fly), or None."""
    if key in BY_KEY:
        return BY_KEY[key]
    for prefix, note in NOTED_PREFIXES.items():
        if key.startswith(prefix):
            return Key(key, note=note)
    return None


def markdown_table() -> str:
    """Return docs/verl.md's table: every covered key, its treatment and what it becomes."""
    rows = ["| verl key | treatment | becomes, or why |", "|---|---|---|"]
    for key in [*KEYS, *(Key(prefix + "*", note=note) for prefix, note in NOTED_PREFIXES.items())]:
        rows.append(f"| `{key.verl}` | {key.treatment} | {key.becomes.replace('|', '/')} |")
    return "\n".join(rows)
