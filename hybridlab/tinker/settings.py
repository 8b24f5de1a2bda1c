"""The Tinker service's settings: one dataclass, read from a YAML file and ``KEY=VALUE`` overrides.

    hybridlab serve tinker                          # the zoo's tiny model on 127.0.0.1, a free port
    hybridlab serve tinker model=small port=8700    # another model, a fixed port
"""
from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

import yaml

from hybridlab.config.loading import build
from hybridlab.config.schema import RolloutConfig
from hybridlab.errors import UserError

KEY_PREFIX = "tml-"  # the SDK refuses keys without it, before sending anything


@dataclasses.dataclass
class ServiceSettings:
    """What ``hybridlab serve tinker`` serves, where, and how much it holds."""

    model: str = "tiny"            # a zoo preset or a local checkpoint directory
    name: str = ""                 # the base_model clients name ("": hybridlab/<model's folder name>)
    host: str = "127.0.0.1"        # another address needs auth (an API key is always required)
    port: int = 0                  # 0: a free port, printed at start
    api_key: str = ""              # "": a fresh tml-... key, printed at start
    run_dir: str = "runs/tinker"   # tinker:// paths are folders under it
    hub_cache: str = ""            # where the model's tokenizer is published under its name ("": HF_HUB_CACHE)
    max_lora_rank: int = 32        # the largest rank a training client may ask for (the engine reserves it)
    lora_alpha: float = 32.0       # the adapters' scale is alpha / rank
    sampler_adapters: int = 8      # saved sampler weights kept in memory (oldest forgotten past it)
    batch_adapters: int = 4        # adapters vLLM mixes in one batch
    context: int = 0               # the longest prompt + completion, in tokens (0: the model's own)
    kv_cache_mb: int = RolloutConfig.kv_cache_mb
    seed: int = 0
    poll_s: float = 25.0           # how long a retrieve_future call waits for its result (the SDK times out at 45)

    def validate(self) -> "ServiceSettings":
        """Raise UserError naming every setting that cannot work; returns self."""
        problems = []
        if self.api_key and not self.api_key.startswith(KEY_PREFIX):
            problems.append(f"api_key must start with {KEY_PREFIX!r} (the Tinker SDK refuses other keys)")
        if not 0 <= self.port < 65536:
            problems.append(f"port must be in 0..65535, got {self.port}")
        if self.context < 0:
            problems.append(f"context must be 0 (the model's) or a token count, got {self.context}")
        for key in ("max_lora_rank", "sampler_adapters", "batch_adapters", "kv_cache_mb"):
            if getattr(self, key) < 1:
                problems.append(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.batch_adapters > self.sampler_adapters:
            problems.append(f"batch_adapters ({self.batch_adapters}) cannot exceed sampler_adapters"
                            f" ({self.sampler_adapters})")
        if not 0 < self.poll_s < 45:
            problems.append(f"poll_s must be in (0, 45): the SDK gives up on a poll after 45 s, got {self.poll_s}")
        if self.name and self.name.count("/") != 1:
            problems.append(f"name must look like org/model (one '/': the SDK and the cookbook read it so),"
                            f" got {self.name!r}")
        if problems:
            raise UserError("tinker service settings:\n  " + "\n  ".join(problems))
        return self

    def with_key(self) -> "ServiceSettings":
        """Return these settings with an API key: the given one, or a fresh random one."""
        return self if self.api_key else dataclasses.replace(self, api_key=KEY_PREFIX + secrets.token_urlsafe(24))


def load_settings(config: str | None = None, overrides: list[str] = ()) -> ServiceSettings:
    """Return the settings of a YAML file (optional) with ``KEY=VALUE`` overrides applied,
    validated; raises UserError naming an unknown key (and the known ones) or a bad value."""
    values: dict = {}
    if config:
        path = Path(config)
        if not path.is_file():
            raise UserError(f"{config}: no such settings file")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):  # checked before the overrides are set into it
            raise UserError(f"{config}: expected a mapping of settings, got {type(values).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"override {item!r}: expected KEY=VALUE")
        values[key.strip()] = yaml.safe_load(value)
    return build(ServiceSettings, values).validate()  # the run config's checks of keys and types
