"""Named presets and the config types: `get_config("tiny")`, `apply_overrides`, `validate`."""

from pisa_jax.configs.base import (
    ATTENTION_KINDS,
    Config,
    DataConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    validate,
    warmup_steps,
)
from pisa_jax.configs.presets import PRESETS, get_config

__all__ = [
    "ATTENTION_KINDS",
    "PRESETS",
    "Config",
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "apply_overrides",
    "get_config",
    "validate",
    "warmup_steps",
]
