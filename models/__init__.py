"""Flax NNX decoder, its config type and the logical-axis sharding table."""

from pisa_jax.models.config import ATTENTION_KINDS, SPARSE_ATTENTION_KINDS, ModelConfig
from pisa_jax.models.decoder import Decoder, compute_dtype, count_params, flops_per_token
from pisa_jax.models.sharding import LOGICAL_AXIS_RULES, make_mesh, param_shardings

__all__ = [
    "ATTENTION_KINDS",
    "LOGICAL_AXIS_RULES",
    "SPARSE_ATTENTION_KINDS",
    "Decoder",
    "ModelConfig",
    "compute_dtype",
    "count_params",
    "flops_per_token",
    "make_mesh",
    "param_shardings",
]
