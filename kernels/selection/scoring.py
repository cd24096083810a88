"""Scores inside the selection kernels: query-key dots in float32, and the per-head reductions of a
candidate's children (Eq. 21 log-sum-exp, Eq. 33 mean, Eq. 34 mean + variance / 2) over pyramid
summaries or a leaf's raw keys, in the shifted, pair and unshifted forms of Eq. 21.

Scores are float32 whatever the input dtype: 16-bit inputs are exact in a 16-bit tensor-core dot
with float32 accumulation; float32 inputs use an IEEE float32 dot. On the GPU, log2 is the MUFU's
`lg2.approx` (`log2`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from pisa_jax.kernels.selection.layout import Geometry, load_rows

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The unshifted log-sum-exp (`SelectionConfig.fused_unshifted_lse`) runs where every exponent
# c * z of the program lies in [-UNSHIFTED_EXP2, UNSHIFTED_EXP2]: every term 2^(c z) of a sum
# is then a normal float32 (>= 2^-100: none flushes to zero, where a shift by the maximum would
# flush terms below 2^-126 of it), and a sum of up to 2^27 terms stays below float32's 2^128, so
# the shift is not needed for range; each exponential's relative rounding is the same either
# way. (Trained models' |q| |k| can exceed the bound: their programs take the shifted branch.)
UNSHIFTED_EXP2 = 100.0


def qk_dot(a, b, inputs_16bit: bool):
  """a @ b.T in float32: a `[R, Dp]`, b `[N, Dp]` -> `[R, N]`.

  inputs_16bit: both in the same 16-bit dtype (the products are exact, the accumulation float32);
  otherwise float32 operands at IEEE precision. (Float32 summaries against 16-bit queries:
  `summary_logits`.)
  """
  dims = (((1,), (1,)), ((), ()))
  if not inputs_16bit:
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                           precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                           preferred_element_type=jnp.float32)
  return lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)


def summary_logits(a, s_ref, rows, m_row, geo: Geometry):
  """a @ summaries[rows].T in float32, `[R, N]`: a `[R, Dp]`, rows / m_row `[N]`.

  With 16-bit inputs the summaries ref holds every float32 summary row r as two 16-bit rows, its
  high part at 2r and the rounding of the remainder at 2r + 1 (`layout.summary_rows`). Otherwise
  it holds the float32 rows.
  """
  if geo.inputs_16bit:
    # Relative error ~2^-17: the products are exact, the accumulation float32.
    return (qk_dot(a, load_rows(s_ref, 2 * rows, m_row, geo), True)
            + qk_dot(a, load_rows(s_ref, 2 * rows + 1, m_row, geo), True))
  return qk_dot(a, load_rows(s_ref, rows, m_row, geo), False)


def log2(x, approx: bool):
  """log2 of non-negative float32 values (0 -> -inf).

  approx: the MUFU's `lg2.approx` (one instruction, absolute error ~2^-22 over the full range
  per the PTX ISA: on the shifted sums of exponentials, >= 1, and on the unshifted ones, in
  [2^-100, 2^107], alike; .ftz flushes only subnormal inputs, which neither gives it) instead of
  libdevice's `log2f`, a 25-instruction polynomial that was a sixth of the walk kernel's
  instructions. GPU only: the interpreter has no inline assembly, so interpret mode (CI) takes
  `jnp.log2`.
  """
  if not approx:
    return jnp.log2(x)
  [y] = plt.elementwise_inline_asm("lg2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f",
                                   pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape,
                                                                                     x.dtype)])
  return y


def unshifted_lse(zs, masks, scale: float, approx_log: bool = False):
  """Eq. 21 in base 2 without the max shift: log2(sum_j 2^(c z_j)) over the children's `[Gp, N]`
  unscaled logits zs, each masked by its `[N]` mask (None: always present). Only for programs
  whose exponents are bounded (`UNSHIFTED_EXP2`, `unshifted_ok`)."""
  c = scale * LOG2E
  terms = [jnp.exp2(z * c) if m is None else jnp.where(m[None, :], jnp.exp2(z * c), 0.0)
           for z, m in zip(zs, masks)]
  return log2(functools.reduce(jnp.add, terms), approx_log)


def pair_lse(z0, z1, m1, scale: float, approx_log: bool = False, unshifted: bool = False):
  """Eq. 21 for a candidate with two children, `[Gp, N]` -> `[Gp, N]` per-head scores.

  z0, z1: unscaled dot products with the first and second child; m1 `[N]`: the second child
  exists. LSE(s * z0, s * z1) = s * max + ln(1 + e^(s * (min - max))), in base 2 with
  c = s * log2(e): one exponential and one logarithm per head, no running maximum. The first
  child exists whenever the candidate is valid; for an invalid candidate (its loads masked to
  zero) the score is finite and unused, since every consumer masks candidates by validity.
  unshifted: log2(2^(c z0) + 2^(c z1)), Eq. 21 in base 2 (log2 e times the natural score), for
  programs whose exponents are bounded.
  """
  if unshifted:
    return unshifted_lse([z0, z1], [None, m1], scale, approx_log)
  c = scale * LOG2E
  z1 = jnp.where(m1[None, :], z1, -jnp.inf)
  hi, lo = jnp.maximum(z0, z1), jnp.minimum(z0, z1)
  # Triton lowers maximum/minimum to maxnum/minnum, which drop a NaN operand: a NaN child would
  # score as its sibling. Put the NaN back so the candidate ranks as in the reference.
  hi = jnp.where(jnp.isnan(z0) | jnp.isnan(z1), jnp.nan, hi)
  # lo = -inf (no second child): exp2(-inf) = 0 and the score is s * z0.
  return hi * scale + log2(1.0 + jnp.exp2((lo - hi) * c), approx_log) * LN2


def reduce_children(zs, masks, selector: str, scale: float, approx_log: bool = False,
                    unshifted: bool = False):
  """Per-head score of each candidate from its children's logits (natural units; base 2 with
  `unshifted`).

  zs: list over children of `[Gp, N]` unscaled dot products q . s (the logits are scale * zs);
  masks: list of `[N]` child-exists masks. Eq. 21 ("pisa"): log-sum-exp; Eq. 33 ("pisa1"): mean;
  Eq. 34 ("pisa2"): mean + population variance / 2. unshifted ("pisa"): as in `pair_lse`.
  """
  if selector == "pisa" and unshifted:
    return unshifted_lse(zs, masks, scale, approx_log)
  if selector == "pisa":
    # LSE(scale * z) = scale * m + ln 2 * log2(sum 2^(c * z - c * m)) with c = scale * log2(e)
    # (scale > 0, so the max commutes with it): one fused multiply-add per exponential instead of
    # a multiply by scale, a subtraction and a multiply by log2(e).
    c = scale * LOG2E
    m = functools.reduce(jnp.maximum,
                         [jnp.where(v[None, :], z, -jnp.inf) for z, v in zip(zs, masks)])
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    mc = m_safe * c
    total = sum(jnp.where(v[None, :], jnp.exp2(z * c - mc), 0.0) for z, v in zip(zs, masks))
    return m_safe * scale + log2(total, approx_log) * LN2
  zs = [z * scale for z in zs]
  count = jnp.maximum(sum(v.astype(jnp.float32) for v in masks), 1.0)[None, :]
  mean = sum(jnp.where(v[None, :], z, 0.0) for z, v in zip(zs, masks)) / count
  if selector == "pisa1":
    return mean
  var = sum(jnp.where(v[None, :], jnp.square(z - mean), 0.0) for z, v in zip(zs, masks)) / count
  return mean + 0.5 * var


def reduce_keys(z, m_key, selector: str, scale: float, approx_log: bool = False,
                unshifted: bool = False):
  """Per-row score over one leaf's raw keys: z `[R, Cp]` unscaled dot products q . k, m_key
  `[Cp]` valid keys or None (every column is a key: the block is a power of two >= 16 and only
  complete past leaves are scored) -> `[R]`. unshifted ("pisa"): as in `pair_lse`, in base 2:
  no row maximum and no shift."""
  if selector == "pisa" and unshifted:
    e = jnp.exp2(z * (scale * LOG2E))
    if m_key is not None:
      e = jnp.where(m_key[None, :], e, 0.0)
    return log2(jnp.sum(e, axis=1), approx_log)
  if selector == "pisa":
    # Eq. 21 at the leaves: the exact raw-key LSE, as in `reduce_children` (one fused
    # multiply-add per exponential; no per-element mask when every column is a key).
    c = scale * LOG2E
    if m_key is not None:
      z = jnp.where(m_key[None, :], z, -jnp.inf)
    m = jnp.max(z, axis=1)
    m_safe = m if m_key is None else jnp.where(m == -jnp.inf, 0.0, m)
    total = jnp.sum(jnp.exp2(z * c - (m_safe * c)[:, None]), axis=1)
    return m_safe * scale + log2(total, approx_log) * LN2
  z = z * scale
  if m_key is None:
    m_key = jnp.full((z.shape[1],), True)
  count = jnp.maximum(jnp.sum(m_key.astype(jnp.float32)), 1.0)
  mean = jnp.sum(jnp.where(m_key[None, :], z, 0.0), axis=1) / count
  if selector == "pisa1":
    return mean
  var = jnp.sum(jnp.where(m_key[None, :], jnp.square(z - mean[:, None]), 0.0), axis=1) / count
  return mean + 0.5 * var


def unshifted_ok(qg, m_head, kn2, scale: float):
  """Whether every exponent c * z of a program lies within +-UNSHIFTED_EXP2: qg `[Gp, Dp]` its
  query heads (m_head `[Gp]` the real ones), kn2 the largest squared key norm of its (batch, KV
  head). Cauchy-Schwarz: |c q_h . k| <= c |q_h| |k| for every key and every summary (a mean of
  keys). NaN or inf inputs fail the compare."""
  q32 = qg.astype(jnp.float32)
  qn2 = jnp.max(jnp.where(m_head, jnp.sum(q32 * q32, axis=1), 0.0))
  return qn2 * kn2 <= (UNSHIFTED_EXP2 / (abs(scale) * LOG2E)) ** 2
