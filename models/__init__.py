"""Flax NNX decoder, its config type, the logical-axis sharding table and the pretrained loader.

Names are imported on first use (PEP 562): the config types load without jax or flax.
"""

import importlib

from pisa_jax.models.config import ATTENTION_KINDS, SPARSE_ATTENTION_KINDS, ModelConfig

_EXPORTS = {
    "Decoder": "pisa_jax.models.decoder",
    "compute_dtype": "pisa_jax.models.decoder",
    "count_params": "pisa_jax.models.decoder",
    "flops_per_token": "pisa_jax.models.decoder",
    "load_pretrained": "pisa_jax.models.pretrained",
    "LOGICAL_AXIS_RULES": "pisa_jax.models.sharding",
    "make_mesh": "pisa_jax.models.sharding",
    "param_shardings": "pisa_jax.models.sharding",
}

__all__ = [
    "ATTENTION_KINDS",
    "LOGICAL_AXIS_RULES",
    "SPARSE_ATTENTION_KINDS",
    "Decoder",
    "ModelConfig",
    "compute_dtype",
    "count_params",
    "flops_per_token",
    "load_pretrained",
    "make_mesh",
    "param_shardings",
]


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'pisa_jax.models' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
