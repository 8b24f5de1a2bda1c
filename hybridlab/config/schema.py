"""RunConfig: everything one RL run needs, as nested dataclasses, each field declaring how a
change of it applies to a running session (``setting``). The defaults are the embedded default
run: GRPO on ``arith`` with the tiny zoo model after a supervised warm start. How YAML and
``key=value`` overrides become a RunConfig is in ``loading.py``; checks across keys in
``hybridlab/run_config.py``.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional

from hybridlab.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


class ConfigError(UserError):
    """A configuration that cannot run; the message names the key."""


CHANGES = ("step", "live", "recreate", "remap", "fixed")


def setting(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, change: str = "step",
            workers: tuple[str, ...] = (), why: str = "", loss: bool = False) -> Any:
    """Return a config field that says how a change of it applies to a running session:

    - ``step`` (the default): the controller reads it as each step runs, so a change applies from
      the next step on;
    - ``live``: the running workers of the roles ``workers`` take it (``configure``), keeping
      their state;
    - ``recreate``: it is built into the workers of ``workers``, so a change re-creates them (with
      the trainers' state carried in memory);
    - ``remap``: it changes the device mapping (a remap);
    - ``fixed``: it cannot change once the session runs; ``why`` says why.

    ``loss``: one of the settings the actor's policy loss reads (sent with every update)."""
    if change not in CHANGES or (change in ("live", "recreate")) != bool(workers) or (change == "fixed") != bool(why):
        raise ValueError(f"setting: change={change!r} with workers={workers!r}, why={why!r}")
    meta = {"change": change, "workers": workers, "why": why, "loss": loss}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


@dataclasses.dataclass
class WarmStartConfig:
    """Supervised warm start before RL: trains until greedy accuracy on held-out training
    prompts reaches ``target_accuracy`` (never the test prompts that report the result), at
    most ``max_steps`` steps; short of the target the run stops with a message. 0 max_steps:
    start RL from the model as is. Why a target and not a step count: docs/benchmarks.md, "The default run"."""
    max_steps: int = 4000               # the tiny model on arith reaches 50% after ~1,000 (about 30 s)
    target_accuracy: float = 0.5        # leaves RL room to add 20 points, with reward dense enough to learn
    eval_every: int = 25                # steps between held-out checks (200 prompts: about 0.3 s)
    eval_samples: int = 200
    lr: float = 3e-3                    # warm-up, then cosine decay planned over max_steps
    warmup_steps: int = 50
    batch_size: int = 64


@dataclasses.dataclass
class DataConfig:
    """Where prompts come from: a task's generator, or verl-format files; with ``preferences``,
    preference pairs instead (TRL's columns, or made from the task)."""
    task: str = "arith"
    task_options: dict = dataclasses.field(default_factory=dict)
    train_files: object = None          # a parquet or JSONL file, or a list of them (read in order)
    test_files: object = None
    train_samples: int = 4000           # at most this many (0: every row of the files)
    test_samples: int = 500
    prompts_per_step: int = 32
    seed: int = 0
    truncate_prompts: bool = False      # keep the last tokens of a prompt too long for the context (else refused)
    # offline DPO: each step takes prompts_per_step preference pairs (TRL's columns in train_files,
    # else made from the task) instead of prompts to generate from
    preferences: bool = setting(False, change="fixed", why="the training data (prompts or preference pairs) is"
                                " read when the run starts")
    # a task's prompts as one user message, rendered with the model's chat template (datasets
    # whose prompt column holds chat messages are rendered so whatever this says)
    chat: bool = setting(False, change="fixed", why="the prompts and the warm start are prepared when the run starts")
    # a chat template (a file, or the Jinja text) for a model whose tokenizer has none, or to replace its own
    chat_template: Optional[str] = setting(None, change="fixed",
                                           why="the prompts and the warm start are prepared when the run starts")


@dataclasses.dataclass
class RolloutConfig:
    """Sampling on the rollout engines."""
    backend: str = setting("vllm", change="recreate", workers=("rollout",))
    n: int = 8
    temperature: float = setting(1.0, change="live", workers=("actor", "ref"))
    top_p: float = 1.0
    top_k: int = 0                      # 0: no top-k cut
    max_new_tokens: int = 8
    ignore_eos: bool = False            # generate exactly max_new_tokens (benchmarks)
    kv_cache_mb: int = setting(64, change="recreate", workers=("rollout",))
    # or "bfloat16": the engine's weights and compute (verl's rollout.dtype)
    dtype: str = setting("float32", change="recreate", workers=("rollout",))
    # vLLM: prefill a prompt once for its n samples (cache emptied every call)
    prefix_caching: bool = setting(False, change="recreate", workers=("rollout",))
    # Agentic rollouts (hybridlab.agents): the built-in agent's tools ("module:function", comma-separated) ...
    tools: Optional[str] = None
    # ... or an agent written against the OpenAI SDK: "module:function" naming async def run(client, sample)
    agent: Optional[str] = None
    # ... or a gym-style text environment: "module:Class" with reset(sample) and step(text)
    env: Optional[str] = None
    max_turns: int = 4                  # model turns per trajectory (each up to max_new_tokens)
    max_trajectory_tokens: int = 128    # tokens after the first prompt: model, tool and template ones together
    tool_timeout_s: float = 10.0        # a tool call running longer is cut off and answers that it timed out
    agent_timeout_s: float = 300.0      # an agent function (or environment) running longer scores reward.error_score
    max_in_flight: int = 64             # trajectories running at once on each engine


@dataclasses.dataclass
class KLControlConfig:
    """The coefficient of a KL reward penalty."""
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclasses.dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal, generate more to refill."""
    enable: bool = False
    max_num_gen_batches: int = 4


@dataclasses.dataclass
class OverlongConfig:
    """DAPO's soft overlong penalty on responses within ``len`` tokens of the maximum."""
    enable: bool = False
    len: int = 2
    penalty_factor: float = 1.0


@dataclasses.dataclass
class RolloutCorrectionConfig:
    """Importance weights and rejection against the rollout-vs-trainer mismatch, as verl's
    ``algorithm.rollout_correction`` (``hybridlab.algos.rollout_correction``). Decoupled (the
    default): the ``rollout_correction`` stage compares the actor's old log-probs with the
    rollout's. ``bypass_mode``: the rollout's log-probs are the old ones and the actor's loss
    is ``bypass_mode`` with ``loss_type`` ppo_clip or reinforce."""
    rollout_is: Optional[str] = None    # None (off), "token" or "sequence"
    rollout_is_threshold: object = 2.0  # a number (truncate) or a "lower_upper" string (IcePop); checked in run_config.py
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None    # comma-separated rejection criteria, e.g. "seq_mean_k1" (Geo-RS)
    rollout_rs_threshold: object = None  # one threshold, or one per criterion ("0.999_1.001,0.05")
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"         # bypass mode: "ppo_clip" or "reinforce"

    @property
    def enabled(self) -> bool:
        """True when weights or rejection are asked for (mismatch metrics are logged anyway)."""
        return self.rollout_is is not None or self.rollout_rs is not None


@dataclasses.dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping."""
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = dataclasses.field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = dataclasses.field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    gdpo_reward_keys: Optional[list] = None     # gdpo: the reward components (keys of the reward's dict answer)
    gdpo_reward_weights: Optional[list] = None  # gdpo: their weights (None: 1 each)


_ADAPTER_BUILT_IN = "the adapter's shape is built into the actor, its checkpoints and the rollout engines"


@dataclasses.dataclass
class LoraConfig:
    """LoRA on the actor (the fsdp2 backend, built with peft; verl's model.lora_rank, lora_alpha
    and target_modules). rank 0: full fine-tuning. With an adapter only the adapter trains; the
    reference is the base model with the adapter off, in the actor's processes (no weights of
    its own); checkpoints hold the adapter and its optimizer state."""
    rank: int = setting(0, change="fixed", why=_ADAPTER_BUILT_IN)
    alpha: float = setting(16.0, change="fixed", why=_ADAPTER_BUILT_IN)  # the update is scaled by alpha / rank
    dropout: float = setting(0.0, change="fixed", why=_ADAPTER_BUILT_IN)  # on the adapter's input, in training
    # "all-linear" (every linear layer but the output head) or a list of module names ("q_proj", ...)
    target_modules: object = setting("all-linear", change="fixed", why=_ADAPTER_BUILT_IN)
    # "adapter": each weight sync sends only the adapter, into vLLM's LoRA support (in memory);
    # "merged": the adapter folded into the base weights, sent as a full sync (any rollout backend)
    sync: str = setting("adapter", change="fixed", why="the rollout engines start with or without LoRA support")


@dataclasses.dataclass
class FSDPConfig:
    """Host-memory offload on the fsdp2 backend (verl's fsdp_config). On a CPU-only machine the
    weights and moments are in host memory already: both settings are accepted and change nothing."""
    param_offload: bool = False         # parameter shards (and so the optimizer step) in host memory
    optimizer_offload: bool = False     # AdamW's moments in host memory between steps


@dataclasses.dataclass
class ActorConfig:
    """The policy's optimizer and PPO objective."""
    lr: float = setting(1e-4, change="live", workers=("actor",))
    weight_decay: float = setting(0.0, change="live", workers=("actor",))
    grad_clip: float = setting(1.0, change="live", workers=("actor",))
    # Adam's first steps move every weight by ~lr: ramp up
    warmup_steps: int = setting(10, change="live", workers=("actor",))
    ppo_mini_batch_size: int = 16       # prompts per optimizer step (x rollout.n sequences)
    ppo_epochs: int = 1
    micro_batch_size: int = setting(64, change="live", workers=("actor", "ref"))  # sequences per forward/backward
    # >0: micro-batches by this token budget instead of micro_batch_size (verl's use_dynamic_bsz)
    micro_batch_tokens: int = setting(4096, change="live", workers=("actor", "ref"))
    # pack each micro-batch's sequences end to end (verl's use_remove_padding): the same log-probs
    # as the padded layout (tested to 1e-5), without computing the padding
    remove_padding: bool = setting(True, change="live", workers=("actor", "ref"))
    # or "bf16": matmuls in bf16 (autocast); weights, grads, AdamW stay fp32
    precision: str = setting("fp32", change="live", workers=("actor", "ref"))
    # training backend (verl's actor.strategy): "megatron" (TP, PP, DP), "fsdp2" (torch FSDP2 over
    # DP ranks, any transformers model) or "auto" (megatron where hybridlab converts the
    # architecture, else fsdp2); the reference follows the actor. A change re-creates the roles
    # with their state carried (HF layout either way).
    strategy: str = setting("auto", change="recreate", workers=("actor", "ref"))
    fsdp: FSDPConfig = setting(factory=FSDPConfig, change="recreate", workers=("actor", "ref"))
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # a name in hybridlab.algos.POLICY_LOSSES (verl's policy_loss.loss_mode and its section are
    # accepted too); its settings below
    policy_loss: str = setting("vanilla", loss=True)
    tau_pos: float = setting(1.0, loss=True)  # sapo: the gate's temperature for positive advantages
    tau_neg: float = setting(1.05, loss=True)  # sapo: ... for the others
    clip_cov_ratio: float = setting(0.0002, loss=True)  # clip_cov: share of tokens whose gradient is cut
    clip_cov_lb: float = setting(1.0, loss=True)  # clip_cov: the covariance band the tokens are drawn from
    clip_cov_ub: float = setting(5.0, loss=True)
    kl_cov_ratio: float = setting(0.0002, loss=True)  # kl_cov: share of tokens with the |log-ratio| penalty
    ppo_kl_coef: float = setting(0.1, loss=True)  # kl_cov: the penalty's coefficient
    dro_beta: Optional[float] = setting(None, loss=True)  # dro: the squared log-ratio penalty (required for dro)
    clip_ratio: float = setting(0.2, loss=True)
    clip_ratio_low: Optional[float] = setting(None, loss=True)
    clip_ratio_high: Optional[float] = setting(None, loss=True)
    clip_ratio_c: float = setting(3.0, loss=True)
    loss_agg_mode: str = setting("token-mean", loss=True)
    # seq-mean-token-sum-norm's divisor (None: the padded response length)
    loss_scale_factor: Optional[float] = setting(None, loss=True)
    entropy_coeff: float = setting(0.0, loss=True)
    use_rollout_log_probs: bool = True  # default dataflow: old log-probs = the rollout's where exact
    use_kl_loss: bool = setting(False, loss=True)
    kl_loss_coef: float = setting(0.001, loss=True)
    kl_loss_type: str = setting("low_var_kl", loss=True)


@dataclasses.dataclass
class CriticConfig:
    """The value model's optimizer and clipped loss (used by GAE)."""
    lr: float = setting(1e-3, change="live", workers=("critic",))
    weight_decay: float = setting(0.0, change="live", workers=("critic",))
    grad_clip: float = setting(1.0, change="live", workers=("critic",))
    warmup_steps: int = setting(0, change="live", workers=("critic",))
    ppo_mini_batch_size: int = 16
    ppo_epochs: int = 1
    micro_batch_size: int = setting(64, change="live", workers=("critic",))
    micro_batch_tokens: int = setting(4096, change="live", workers=("critic",))  # as actor.micro_batch_tokens
    remove_padding: bool = setting(True, change="live", workers=("critic",))  # as actor.remove_padding
    precision: str = setting("fp32", change="live", workers=("critic",))  # or "bf16", as actor.precision
    strategy: str = setting("auto", change="recreate", workers=("critic",))  # as actor.strategy
    fsdp: FSDPConfig = setting(factory=FSDPConfig, change="recreate", workers=("critic",))  # as actor.fsdp
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclasses.dataclass
class DPOConfig:
    """Preference optimisation (TRL's DPOConfig names): the loss types and their weights (a list
    adds them), beta and label_smoothing; read by the update_actor_dpo stage of online DPO.
    ``online``: the step is online DPO's (generate, reward, pair_best_worst, ref_logprob,
    update_actor_dpo, sync_weights) instead of the estimator's."""
    online: bool = False
    loss_type: object = "sigmoid"       # a name in hybridlab.algos.PREFERENCE_LOSSES, or a list of them
    loss_weights: Optional[list] = None  # one weight per loss type (None: 1 each)
    beta: float = 0.1                   # the strength of the reference
    label_smoothing: float = 0.0        # exo_pair: in (0, 1); robust: in [0, 0.5)

    @property
    def loss_types(self) -> list[str]:
        """The loss types as a list."""
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)


@dataclasses.dataclass
class RewardConfig:
    """How responses are scored: ``rule`` (the task's scorer), ``function`` (an import path
    ``module:fn`` or ``file.py:fn`` with verl's compute_score signature) or ``model``."""
    kind: str = setting("rule", change="recreate", workers=("reward",))
    function: Optional[str] = setting(None, change="recreate", workers=("reward",))
    # keyword arguments the function is called with besides verl's four (verl's reward_kwargs)
    function_kwargs: dict = setting(factory=dict, change="recreate", workers=("reward",))
    model: Optional[str] = None
    format_score: float = setting(0.0, change="recreate", workers=("reward",))
    error_score: float = setting(0.0, change="recreate", workers=("reward",))
    # >0: score each batch in a child process, cut off after this long
    timeout_s: float = setting(0.0, change="recreate", workers=("reward",))
    # openai/gsm8k: strict (the number after the last "#### ", verl's default) or flexible (the last number)
    gsm8k_extraction: str = setting("strict", change="recreate", workers=("reward",))
    # the MATH and DAPO sources: rules (verl's string checks) or math-verify (an algebraic check)
    math_verifier: str = setting("rules", change="recreate", workers=("reward",))


@dataclasses.dataclass
class TrainerConfig:
    """The loop: steps, time limit, evaluation, logging and the run directory."""
    steps: int = 1000
    max_minutes: float = 8.5            # RL loop budget (a guard: the default run's 1,000 steps take ~7 min; 0: none)
    eval_every: int = 50
    run_dir: Optional[str] = setting(None, change="fixed", why="the run's records are being written there")
    seed: int = setting(0, change="fixed", why="the run's random streams were seeded from it when the workers started")
    off_policy: bool = False
    max_staleness: int = 1              # off-policy: rollouts generated ahead (each at most this many updates stale)
    # verl's key: the trackers fed every step's metrics, of console, tensorboard, wandb, mlflow
    logger: list = setting(factory=lambda: ["console", "tensorboard"], change="fixed",
                           why="the trackers are opened with the session")
    project_name: str = setting("hybridlab", change="fixed", why="the trackers' runs were opened under it")
    mlflow_uri: str = setting("", change="fixed", why="the MLflow run was opened there")  # "": RUN_DIR/mlruns
    # the hub: spans, metrics, device samples -> telemetry.jsonl
    telemetry: bool = setting(True, change="fixed", why="the telemetry hub is started (or not) with the session")
    devices: int = setting(1, change="remap")
    progress: bool = True
    critic_warmup: int = 0              # the run's first N steps update the critic only, not the actor
    save_every: int = 100               # checkpoint every N steps (0: only at the end and on a stop)
    keep_checkpoints: int = 2           # the newest N complete checkpoints stay on disk
    max_bad_updates: int = 3            # steps in a row with a NaN/inf update (skipped) before the run stops
    max_restarts: int = 3               # dead or stuck workers re-created in a run before it stops
    call_deadline_s: float = 0.0        # a worker call with no answer by then is stuck (0: derived, below)
    call_deadline_floor_s: float = 120.0  # derived deadline: 5x the longest recent call of its stage, at least this
    spare_processes: int = 0            # warmed-up worker processes kept for remaps and re-created roles
    advise_every: int = 20              # the mapping advisor: measured step against its prediction (0: off)
    advisor_profile: str = "local"      # its device profile: local (hybridlab calibrate), h100, h200, a100, h20, a file
    # CPU nodes: pin each worker process to its devices' share of the cores
    verl_names: bool = False            # also log metrics under verl's names (set for runs read the verl way)
    bind_threads: bool = setting(False, change="fixed",
                                 why="worker processes are pinned to their cores (or not) when the session starts them")


@dataclasses.dataclass
class RunConfig:
    """One RL run."""
    name: str = setting("grpo", change="fixed", why="the run directory and its records carry it")
    model: str = setting("tiny", change="fixed",
                         why="every role's weights start from it (start a new session for another model)")
    warm_start: WarmStartConfig = setting(factory=WarmStartConfig, change="fixed",
                                          why="the warm start ran before the workers started from its checkpoint")
    data: DataConfig = setting(factory=DataConfig, change="fixed",
                               why="the prompt stream and the test set are built from it; changing it would make a"
                                   " different run")
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    dataflow: Optional[list] = None     # stage names; None: follow the settings (validate.default_dataflow)
    mapping: Optional[dict] = setting(None, change="remap")  # a DeviceMapping dict; None: all roles colocated

    def to_dict(self) -> dict:
        """Return the config as plain data (what ``config.yaml`` in the run directory holds)."""
        return dataclasses.asdict(self)


def config_fields(cls: type | None = None, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Return every field of the config (default: RunConfig) by dotted key, sections first and
    then their fields, in declaration order."""
    out = []
    for f in dataclasses.fields(cls or RunConfig):
        key = f"{prefix}{f.name}"
        out.append((key, f))
        hint = typing.get_type_hints(cls or RunConfig)[f.name]
        if dataclasses.is_dataclass(hint):
            out += config_fields(hint, key + ".")
    return out


def setting_keys(change: str, role: str | None = None) -> tuple[str, ...]:
    """Return the dotted keys declared with ``change`` (see ``setting``), those the workers of
    ``role`` take when a role is given."""
    return tuple(key for key, f in config_fields() if f.metadata.get("change") == change
                 and (role is None or role in f.metadata["workers"]))
