"""TrainSettings: what a training role's workers and engines take from the run's config, as one
value: the role's config section (``actor`` for the actor and the reference, ``critic``), the
run's seed and the temperature its log-probs are taken at. Every default is the schema's
(``hybridlab/config/schema.py``): workers and engines state none of their own.

    settings = TrainSettings.of(cfg, "actor")
    ActorWorker(model_dir, settings, tp=2)          # built from it
    worker.configure(TrainSettings.of(new_cfg))     # live changes: the same typed value
"""
from __future__ import annotations

import dataclasses

from hybridlab.config.schema import RunConfig
from hybridlab.config.training import ActorConfig, CriticConfig, LoraConfig
from hybridlab.workers.train.backend import OptimConfig, check_precision


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """A training role's settings: its config section, the run's seed, the log-prob temperature."""

    section: ActorConfig | CriticConfig
    seed: int
    temperature: float   # the rollout's sampling temperature; log-probs of greedy samples (0) at 1
    optimizer: str = "adamw"  # not a config setting: "sgd" compares backends step for step (tests)

    @classmethod
    def of(cls, cfg: RunConfig, section: str = "actor") -> "TrainSettings":
        """Return the settings of ``section``'s role(s) under ``cfg``."""
        return cls(getattr(cfg, section), cfg.trainer.seed, cfg.rollout.temperature or 1.0)

    def but(self, **fields) -> "TrainSettings":
        """Return these settings with section fields changed (``but(precision="bf16")``)."""
        return dataclasses.replace(self, section=dataclasses.replace(self.section, **fields))

    @property
    def lora(self) -> LoraConfig | None:
        """The actor's adapter settings (the reference shares them), or None: full fine-tuning."""
        lora = getattr(self.section, "lora", None)
        return lora if lora is not None and lora.rank > 0 else None

    def optim(self) -> OptimConfig:
        """Return the optimizer settings of the section (its schedule: constant after warm-up)."""
        s = self.section
        return OptimConfig(lr=s.lr, weight_decay=s.weight_decay, grad_clip=s.grad_clip, warmup_steps=s.warmup_steps,
                           optimizer=self.optimizer)


# How the benchmarks and the worker tests build workers by hand: micro-batches by row count,
# unpacked, no warm-up (their figures and references were made so).
BY_ROWS = {"micro_batch_tokens": 0, "remove_padding": False, "warmup_steps": 0}


def settings_for(section: str = "actor", **fields) -> TrainSettings:
    """Return the default config's settings of ``section`` with ``BY_ROWS`` and then section
    ``fields`` changed: for workers built by hand (benchmarks, tests)."""
    return TrainSettings.of(RunConfig(), section).but(**{**BY_ROWS, **fields})


def apply_live(engine, settings: TrainSettings) -> None:
    """Set an engine's live settings (``backend.TrainEngine``'s attributes) from ``settings``:
    precision, log-prob temperature, the micro-batches' token budget and packing."""
    s = settings.section
    engine.precision = check_precision(s.precision)
    engine.temperature = settings.temperature
    engine.micro_batch_tokens, engine.remove_padding = s.micro_batch_tokens, s.remove_padding
