"""Scores inside the selection kernels: the pyramid summaries (float32 or bfloat16) against the
queries (`summary_logits`), Eq. 21 for a pair of children (`pair_lse`), and the bound under which a
program takes the unshifted form of Eq. 21 (`unshifted_ok`). The dots and the reductions of
Eq. 21 / 33 / 34 that decode shares are in `pisa_jax.kernels._common`.

Scores are float32 whatever the input dtype: 16-bit inputs are exact in a 16-bit tensor-core dot
with float32 accumulation; float32 inputs use an IEEE float32 dot. On the GPU, log2 is the MUFU's
`lg2.approx` (`_common.log2`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pisa_jax.kernels._common import LN2, LOG2E, log2, qk_dot, unshifted_lse
from pisa_jax.kernels.selection.layout import Geometry, load_rows

# The unshifted log-sum-exp (`SelectionConfig.fused_unshifted_lse`) runs where every exponent
# c * z of the program lies in [-UNSHIFTED_EXP2, UNSHIFTED_EXP2]: every term 2^(c z) of a sum
# is then a normal float32 (>= 2^-100: none flushes to zero, where a shift by the maximum would
# flush terms below 2^-126 of it), and a sum of up to 2^27 terms stays below float32's 2^128, so
# the shift is not needed for range; each exponential's relative rounding is the same either
# way. (Trained models' |q| |k| can exceed the bound: their programs take the shifted branch.)
# A bfloat16 summary may exceed the largest key norm by its rounding, a factor <= 1 + 2^-8: its
# exponents stay below 100.4, still normal terms and sums far below 2^128.
UNSHIFTED_EXP2 = 100.0


def summary_logits(a, s_ref, rows, m_row, geo: Geometry):
  """a @ summaries[rows].T in float32, `[R, N]`: a `[R, Dp]`, rows / m_row `[N]`.

  With 16-bit inputs against float32 summaries the ref holds every summary row r as two 16-bit
  rows, its high part at 2r and the rounding of the remainder at 2r + 1 (`layout.summary_rows`).
  Otherwise it holds the rows: bfloat16 queries meet a bfloat16 pyramid in one bfloat16 dot,
  anything else meets it in an IEEE float32 dot (the products of 16-bit values are exact).
  """
  if geo.bf16_summary_dot:
    return qk_dot(a, load_rows(s_ref, rows, m_row, geo), True)
  if geo.split_summaries:
    # Relative error ~2^-17: the products are exact, the accumulation float32.
    return (qk_dot(a, load_rows(s_ref, 2 * rows, m_row, geo), True)
            + qk_dot(a, load_rows(s_ref, 2 * rows + 1, m_row, geo), True))
  return qk_dot(a, load_rows(s_ref, rows, m_row, geo), False)


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


def unshifted_ok(qg, m_head, kn2, scale: float):
  """Whether every exponent c * z of a program lies within +-UNSHIFTED_EXP2: qg `[Gp, Dp]` its
  query heads (m_head `[Gp]` the real ones), kn2 the largest squared key norm of its (batch, KV
  head). Cauchy-Schwarz: |c q_h . k| <= c |q_h| |k| for every key and every summary (a mean of
  keys). NaN or inf inputs fail the compare."""
  q32 = qg.astype(jnp.float32)
  qn2 = jnp.max(jnp.where(m_head, jnp.sum(q32 * q32, axis=1), 0.0))
  return qn2 * kn2 <= (UNSHIFTED_EXP2 / (abs(scale) * LOG2E)) ** 2
