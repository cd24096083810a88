"""Named presets and the run config: `get_config("tiny")`, `apply_overrides`, `validate`.

`ModelConfig` is defined beside the model (`pisa_jax.models.config`) and re-exported here.
"""

from pisa_jax.configs.base import (
    Config,
    DataConfig,
    TrainConfig,
    apply_overrides,
    validate,
    warmup_steps,
)
from pisa_jax.configs.presets import PRESETS, get_config
from pisa_jax.models.config import ATTENTION_KINDS, ModelConfig

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
