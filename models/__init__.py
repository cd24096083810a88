"""Flax NNX decoder and the logical-axis sharding table."""

from pisa_jax.models.decoder import Decoder, compute_dtype, count_params, flops_per_token
from pisa_jax.models.sharding import LOGICAL_AXIS_RULES, make_mesh, param_shardings

__all__ = [
    "LOGICAL_AXIS_RULES",
    "Decoder",
    "compute_dtype",
    "count_params",
    "flops_per_token",
    "make_mesh",
    "param_shardings",
]
