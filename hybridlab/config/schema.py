"""RunConfig: everything one RL run needs, as nested dataclasses, each field declaring how a
change of it applies to a running session (``setting.py``); the training roles' sections are
in ``training.py``, the algorithm's in ``algorithm.py``. The defaults are the embedded default
run: GRPO on ``arith`` with the tiny zoo model after a supervised warm start. How YAML and
``key=value`` overrides become a RunConfig is in ``loading.py``; the numeric settings' ranges in
``bounds.py``; the checks across keys are listed in ``hybridlab/run_config.py``.
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Optional

from hybridlab.config.algorithm import AlgorithmConfig
from hybridlab.config.setting import setting
from hybridlab.config.training import ActorConfig, CriticConfig, DPOConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


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
    # ... or a gym-style text environment: "module:Class" with reset(sample) and step(text); or an
    # OpenEnv environment: a server's URL (comma-separated for several) or an Environment subclass
    env: Optional[str] = None
    env_adapter: Optional[str] = None   # OpenEnv: "module:Class", a subclass of agents.openenv_env.OpenEnvAdapter
    max_turns: int = 4                  # model turns per trajectory (each up to max_new_tokens)
    max_trajectory_tokens: int = 128    # tokens after the first prompt: model, tool and template ones together
    tool_timeout_s: float = 10.0        # a tool call running longer is cut off and answers that it timed out
    agent_timeout_s: float = 300.0      # an agent function (or environment) running longer scores reward.error_score
    max_in_flight: int = 64             # trajectories running at once on each engine


@dataclasses.dataclass
class EvaluationConfig:
    """How the test prompts are answered when the run evaluates (verl's rollout.val_kwargs): one
    greedy answer each by default; with ``n`` > 1 and ``temperature`` > 0, ``n`` sampled answers,
    reported as their mean (and, under verl's names, best@N, worst@N and maj@N)."""
    n: int = 1
    temperature: float = 0.0            # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0: no top-k cut


@dataclasses.dataclass
class SandboxConfig:
    """Where model-written code runs (``hybridlab.sandbox``): each execution in its own bubblewrap
    sandbox, as an unprivileged user in a pids cgroup, within these limits (docs/sandbox.md)."""
    python: str = "/usr/bin/python3"    # the interpreter inside (/usr is mounted read-only)
    read_only: list = dataclasses.field(default_factory=list)  # more host directories, mounted read-only
    wall_s: float = 10.0                # an execution running longer is ended
    cpu_s: float = 10.0
    memory_mb: int = 512                # address space
    processes: int = 32                 # at once, its first included
    file_mb: int = 16                   # the largest file it writes, and its private directory's size
    open_files: int = 64
    output_kb: int = 1024               # stdout or stderr above this ends it
    test_timeout_s: float = 5.0         # code tasks: each test case
    parallel: int = 4                   # code answers scored at once by a reward worker


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
    # streaming rollouts (dataflow/stream.py): the rollout engines generate continuously, a step trains
    # the first data.prompts_per_step groups to finish, a sync does not wait for samples in flight;
    # max_staleness then bounds the updates between a trained sample's oldest token and the trainer
    streaming: bool = False             # switched in a running session between steps (the prompts in flight go back)
    partial_rollouts: str = "keep"      # streaming, at a sync: samples in flight keep their KV cache, or "recompute" it
    stale_samples: str = "train"        # streaming: a finished sample past max_staleness is trained ("train") or "drop"ped
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
    # verl's key: each step's trained samples -> DIR/{step}.jsonl (dataflow/generations.py; relative: under run_dir)
    rollout_data_dir: Optional[str] = None
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
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    actor: ActorConfig = dataclasses.field(default_factory=ActorConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    sandbox: SandboxConfig = setting(factory=SandboxConfig, change="recreate", workers=("reward", "rollout"))
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
