"""Training workers built by hand in the tests: the settings they take, from the schema's defaults."""
from __future__ import annotations

import dataclasses

from hybridlab.workers.train.settings import TrainSettings, settings_for


def train_settings(section: str = "actor", *, optimizer: str = "adamw", **fields) -> TrainSettings:
    """Return ``settings_for(section, **fields)`` (micro-batches by rows unless ``fields`` say
    otherwise) with ``optimizer`` ("sgd": backends compared step for step)."""
    return dataclasses.replace(settings_for(section, **fields), optimizer=optimizer)
