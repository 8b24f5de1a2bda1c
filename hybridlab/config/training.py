"""The training roles' sections of a run's config: the actor (optimizer, PPO objective, LoRA,
FSDP2 offload), the critic and preference optimisation (verl's and TRL's names)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from hybridlab.config.setting import setting


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
