"""Scores inside the decode kernels: query-summary dots in float32 and the per-head reductions of
Eq. 21 / 33 / 34 (`pisa_jax.kernels._common`'s, the shift as (z - m) * c)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pisa_jax.kernels import _common
from pisa_jax.kernels._common import qk_dot
from pisa_jax.kernels.decode.layout import Geometry, load_rows


def summary_logits(qg, s_ref, rows, m_row, geo: Geometry):
  """qg @ summaries[rows].T, `[Gp, N]` float32. In "split" mode the float32 summary is the sum of
  its high half (bits truncated to bfloat16's, so exact) and the bfloat16 rounding of the rest;
  a bfloat16 pyramid meets bfloat16 queries in one bfloat16 dot (half the loads, one dot) and
  any other queries in a float32 one (16-bit products are exact in float32)."""
  s = load_rows(s_ref, rows, m_row, geo.d, geo.head_dim_padded)
  if geo.bf16_summary_dot:
    return qk_dot(qg, s, True)
  if not geo.split_summaries:
    return qk_dot(qg, s, False)
  return split_logits(qg, s)


def split_logits(qg, s):
  """qg `[Gp, Dp]` (bfloat16) @ s.T, s float32 `[N, Dp]`, as two bfloat16 dots: s's high half
  (bits truncated to bfloat16's, so exact) and the bfloat16 rounding of the rest, `[Gp, N]`."""
  bits = lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFFFF0000)
  hi = lax.bitcast_convert_type(bits, jnp.float32)
  return (qk_dot(qg, hi.astype(jnp.bfloat16), True)
          + qk_dot(qg, (s - hi).astype(jnp.bfloat16), True))


# The decode kernels shift Eq. 21's exponents as (z - m) * c; the selection kernels' fused
# multiply-add form (z c - m c) has not been measured here.
reduce_children = functools.partial(_common.reduce_children, fma_shift=False)
reduce_keys = functools.partial(_common.reduce_keys, fma_shift=False)
