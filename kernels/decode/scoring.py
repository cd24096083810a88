"""Scores inside the decode kernels: query-key and query-summary dots in float32, the per-head
reductions of Eq. 21 / 33 / 34, and the ranking key Select_K orders scores by."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from pisa_jax.kernels.decode.layout import Geometry, load_rows

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Select_K's ranking keys, as the reference's `_keep`: a NaN score ranks as the largest float32
# (after the forced nodes' +inf, before every number), every other score is clamped below it.
_NAN_RANK = float(np.finfo(np.float32).max)
_SCORE_LIMIT = float(np.nextafter(np.float32(_NAN_RANK), np.float32(0)))


def dot_t(a, b, mode: str):
  """a @ b.T in float32: "f32" at IEEE precision, "native" in the operands' 16-bit dtype."""
  dims = (((1,), (1,)), ((), ()))
  if mode == "f32":
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                           precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                           preferred_element_type=jnp.float32)
  return lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)


def summary_logits(qg, s_ref, rows, m_row, geo: Geometry):
  """qg @ summaries[rows].T, `[Gp, N]` float32. In "split" mode the float32 summary is the sum of
  its high half (bits truncated to bfloat16's, so exact) and the bfloat16 rounding of the rest."""
  s = load_rows(s_ref, rows, m_row, geo.d, geo.dp)
  if geo.score_mode != "split":
    return dot_t(qg, s, "f32")
  return split_logits(qg, s)


def split_logits(qg, s):
  """qg `[Gp, Dp]` (bfloat16) @ s.T, s float32 `[N, Dp]`, as two bfloat16 dots: s's high half
  (bits truncated to bfloat16's, so exact) and the bfloat16 rounding of the rest, `[Gp, N]`."""
  bits = lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFFFF0000)
  hi = lax.bitcast_convert_type(bits, jnp.float32)
  return (dot_t(qg, hi.astype(jnp.bfloat16), "native")
          + dot_t(qg, (s - hi).astype(jnp.bfloat16), "native"))


def reduce_children(zs, masks, selector: str, scale: float):
  """Per-head score of each candidate from its children's unscaled logits `[Gp, N]` (one per
  child, each masked by `[N]`): Eq. 21 (log-sum-exp, in base 2 then back), 33 or 34."""
  if selector == "pisa":
    c = scale * LOG2E
    m = functools.reduce(jnp.maximum,
                         [jnp.where(v[None, :], z, -jnp.inf) for z, v in zip(zs, masks)])
    m = jnp.where(m == -jnp.inf, 0.0, m)
    total = sum(jnp.where(v[None, :], jnp.exp2((z - m) * c), 0.0) for z, v in zip(zs, masks))
    return m * scale + jnp.log2(total) * LN2
  zs = [z * scale for z in zs]
  count = jnp.maximum(sum(v.astype(jnp.float32) for v in masks), 1.0)[None, :]
  mean = sum(jnp.where(v[None, :], z, 0.0) for z, v in zip(zs, masks)) / count
  if selector == "pisa1":
    return mean
  var = sum(jnp.where(v[None, :], jnp.square(z - mean), 0.0) for z, v in zip(zs, masks)) / count
  return mean + 0.5 * var


def reduce_keys(z, m_key, selector: str, scale: float):
  """Per-head score over one leaf's raw keys: z `[Gp, Cp]` unscaled logits, m_key `[Cp]`."""
  if selector == "pisa":
    c = scale * LOG2E
    z = jnp.where(m_key[None, :], z, -jnp.inf)
    m = jnp.max(z, axis=1)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    total = jnp.sum(jnp.exp2((z - m[:, None]) * c), axis=1)
    return m * scale + jnp.log2(total) * LN2
  z = z * scale
  count = jnp.maximum(jnp.sum(m_key.astype(jnp.float32)), 1.0)
  mean = jnp.sum(jnp.where(m_key[None, :], z, 0.0), axis=1) / count
  if selector == "pisa1":
    return mean
  var = jnp.sum(jnp.where(m_key[None, :], jnp.square(z - mean[:, None]), 0.0), axis=1) / count
  return mean + 0.5 * var


def rank_key(score):
  """A score as a ranking key: NaN above every number (a NaN query or key keeps its block, so
  attention shows the NaN), numbers clamped inside the float range."""
  return jnp.where(jnp.isnan(score), _NAN_RANK, jnp.clip(score, -_SCORE_LIMIT, _SCORE_LIMIT))
