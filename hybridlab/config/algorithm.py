"""The ``algorithm`` section of a run's config: advantage estimation and reward shaping, with
DAPO's group filter and overlong penalty and the rollout-correction weights (verl's names)."""
from __future__ import annotations

import dataclasses
from typing import Optional


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
    rollout_is_threshold: object = 2.0  # a number (truncate) or a "lower_upper" string (IcePop); checked in algos/checks.py
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
