"""What every kernel family shares: launch helpers, row loads, and the score math of selection and
decode written once (the q . k dot, Eq. 21 / 33 / 34 over children or a leaf's raw keys, the
ranking key and the all-pairs rank that Select_K orders candidates by)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pisa_jax.spec import SelectionSpec

INT32_MAX = 2**31 - 1
# Triton's tensor-core dots need every dimension >= 16.
MIN_DOT = 16
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
BIG = 2**30  # larger than any node or block id: marks an empty slot
# Select_K's ranking key, the reference's (`pisa_jax.selection._keep`): a NaN score ranks as the
# largest float32, every other score is clamped strictly below it. Raw scores would compare NaN
# false against everything, so a NaN candidate would be picked by no pass and ranks would collide.
NAN_RANK = float(np.finfo(np.float32).max)
SCORE_LIMIT = float(np.nextafter(np.float32(NAN_RANK), np.float32(0)))


# ----------------------------------------------------------------------------- shapes


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (Pallas Triton values need power-of-two shapes)."""
  return 1 << max(0, int(n) - 1).bit_length()


def pow2_at_least(n: int, floor: int) -> int:
  return max(floor, next_pow2(n))


def candidate_slots(beam: int, branching: int) -> int:
  """NC, the candidate slots per walk level below the root: up to beam * branching children,
  padded to a power of two >= 16 (a dot dimension)."""
  return pow2_at_least(beam * branching, MIN_DOT)


@dataclasses.dataclass(frozen=True)
class KernelGeometry:
  """The static shapes of one kernel call and the (resolved) selection it computes: what the
  selection and decode families' `Geometry` share. Every in-kernel value has power-of-two
  shapes, so the group's heads, the head dim, the block, the candidates and top_k are padded.

  Attributes:
    batch, hq, hkv, d: B, query heads, KV heads and head dim of the inputs.
    spec: the `SelectionSpec`, resolved (its scale and beam filled in).
  """

  batch: int
  hq: int
  hkv: int
  d: int
  spec: SelectionSpec

  def __post_init__(self):
    if not self.spec.is_resolved:
      raise ValueError(f"spec={self.spec} must be resolved: spec.resolved(head_dim)")

  @property
  def block_size(self) -> int:
    return self.spec.block_size

  @property
  def top_k(self) -> int:
    return self.spec.top_k

  @property
  def branching(self) -> int:
    return self.spec.branching

  @property
  def selector(self) -> str:
    return self.spec.selector

  @property
  def scale(self) -> float:
    return self.spec.scale

  @property
  def beam(self) -> int:
    """Nodes kept per walk level (top_k for the flat "bsa")."""
    return self.spec.kept_per_level

  @property
  def group(self) -> int:
    return self.hq // self.hkv

  @property
  def group_padded(self) -> int:
    return pow2_at_least(self.group, MIN_DOT)

  @property
  def head_dim_padded(self) -> int:
    return pow2_at_least(self.d, MIN_DOT)

  @property
  def block_padded(self) -> int:
    return pow2_at_least(self.block_size, MIN_DOT)

  @property
  def num_slots(self) -> int:
    """NC, candidate slots per level below the root: up to beam * branching children."""
    return candidate_slots(self.beam, self.branching)

  @property
  def top_k_padded(self) -> int:
    return next_pow2(self.top_k)


# ----------------------------------------------------------------------------- launches, tables


def int32_table(rows, name: str):
  """A small table built on the host from Python ints (level sizes, offsets, powers) as an int32
  jnp array; raises ValueError naming it where an entry does not fit int32, instead of numpy's
  OverflowError or a silent wrap."""
  table = np.asarray(rows, np.int64)
  if table.size and (table.max() > INT32_MAX or table.min() < -INT32_MAX - 1):
    raise ValueError(f"{name} holds {int(table.max())}, past int32 (max {INT32_MAX})")
  return jnp.asarray(table.astype(np.int32))


@contextlib.contextmanager
def triton_deprecation_silenced():
  """JAX 0.11 deprecates the Pallas Triton backend in favour of Mosaic GPU. It still works, and
  every kernel stays behind the `implementation=` switch, so that one warning is silenced where a
  kernel is called."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*deprecated.*Mosaic GPU.*")
    yield


def call_kernel(fn, *args):
  """Calls a Pallas kernel with the Triton deprecation warning silenced."""
  with triton_deprecation_silenced():
    return fn(*args)


def dot_precision(dtype):
  """float32 inputs get IEEE float32 dots (not TF32), so the f32 path meets the 1e-4 tolerance."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def pallas_launch(kernel, out_shape, grid, *, warps: int, stages: int, interpret: bool,
                  name: str, aliases=None):
  """One `pallas_call` without block specs (the kernels index their refs themselves);
  `aliases` maps input indices to the outputs they are donated to."""
  with triton_deprecation_silenced():
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases or {},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=name)


# ----------------------------------------------------------------------------- loads


def load_rows(ref, rows, m_row, d: int, dp: int):
  """Rows `[N]` of a `[*, D]` ref as `[N, Dp]`, masked rows and padded columns zero."""
  o_col = jnp.arange(dp)
  if d == dp:
    # No column clamp or column mask: Triton then sees each row as Dp contiguous, aligned
    # elements and issues 128-bit loads (with the clamp it issued one scalar load, address and
    # predicate per element: a third of the selection walk's instructions).
    return plt.load(ref.at[rows[:, None], o_col[None, :]], mask=m_row[:, None], other=0.0)
  # D not a power of two (48, say): clamp the columns into the row and mask the padding.
  return plt.load(ref.at[rows[:, None], jnp.minimum(o_col, d - 1)[None, :]],
                  mask=m_row[:, None] & (o_col < d)[None, :], other=0.0)


def dkv_tile_step(b_k, b_v, b_q, b_do, b_lse2, b_delta, visible_of, b_dk, b_dv, *,
                  qk_scale: float, precision):
  """One step of a key tile's dk / dv accumulation over R query rows (Eq. 6's backward).

  Args:
    b_k, b_v: the tile's keys and values `[W, D]`; b_q, b_do: the rows' queries and output
      cotangents `[R, D]`; b_lse2: each row's log-sum-exp in base 2 `[R]`; b_delta: each row's
      sum(out * dout) `[R]`.
    visible_of: called after the scores are formed (so that the traced program keeps this
      order), returns the bool `[W, R]` of the (key, row) pairs that attend.
    b_dk, b_dv: float32 `[W, D]` accumulators.
    qk_scale: the softmax scale times log2(e) (scores in base 2).

  Returns:
    The updated (b_dk, b_dv).
  """
  # [W, R]
  b_s = jnp.dot(b_k, b_q.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
  visible = visible_of()
  b_dp = jnp.dot(b_v, b_do.T, precision=precision, preferred_element_type=jnp.float32)
  b_p = jnp.where(visible, jnp.exp2(b_s - b_lse2[None, :]), 0.0)
  # Masked again: a hidden pair's dp (a NaN value) or delta (a query whose output is NaN) must
  # not reach that key's dk through p = 0 (0 * NaN = NaN). dp comes before the dv dot so that
  # both selects sit together (fewer live predicates, fewer spills at d = 128).
  b_ds = b_p * jnp.where(visible, b_dp - b_delta[None, :], 0.0)
  b_dv = b_dv + jnp.dot(b_p.astype(b_do.dtype), b_do, precision=precision,
                        preferred_element_type=jnp.float32)
  b_dk = b_dk + jnp.dot(b_ds.astype(b_q.dtype), b_q, precision=precision,
                        preferred_element_type=jnp.float32)
  return b_dk, b_dv


def stored_summary(mean, summary_dtype: str):
  """A float32 mean as a pyramid stores it and as its parent reads it back: (stored, float32).
  A bfloat16 pyramid rounds it once, by a conversion (Triton keeps the round trip; the jnp
  reference rounds with `pisa_jax.geometry.round_summaries`, to the same nearest even value);
  a float32 one returns it twice, untouched."""
  if summary_dtype == "float32":
    return mean, mean
  rounded = mean.astype(jnp.bfloat16)
  return rounded, rounded.astype(jnp.float32)


def pick(vec, i):
  """vec[i] for a value (no dynamic indexing of values in Triton kernels)."""
  return jnp.sum(jnp.where(jnp.arange(vec.shape[0]) == i, vec, 0))


# ----------------------------------------------------------------------------- scores


def qk_dot(a, b, inputs_16bit: bool):
  """a @ b.T in float32: a `[R, Dp]`, b `[N, Dp]` -> `[R, N]`.

  inputs_16bit: both in the same 16-bit dtype (the products are exact, the accumulation float32);
  otherwise float32 operands at IEEE precision.
  """
  dims = (((1,), (1,)), ((), ()))
  if not inputs_16bit:
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                           precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                           preferred_element_type=jnp.float32)
  return lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)


def log2(x, approx: bool = False):
  """log2 of non-negative float32 values (0 -> -inf).

  approx: the MUFU's `lg2.approx` (one instruction, absolute error ~2^-22 over the full range
  per the PTX ISA: on the shifted sums of exponentials, >= 1, and on the unshifted ones, in
  [2^-100, 2^107], alike; .ftz flushes only subnormal inputs, which neither gives it) instead of
  libdevice's `log2f`, a 25-instruction polynomial that was a sixth of the selection walk's
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
  whose exponents are bounded (`selection.scoring.UNSHIFTED_EXP2`)."""
  c = scale * LOG2E
  terms = [jnp.exp2(z * c) if m is None else jnp.where(m[None, :], jnp.exp2(z * c), 0.0)
           for z, m in zip(zs, masks)]
  return log2(functools.reduce(jnp.add, terms), approx_log)


def reduce_children(zs, masks, selector: str, scale: float, approx_log: bool = False,
                    unshifted: bool = False, fma_shift: bool = True):
  """Per-head score of each candidate from its children's logits (natural units; base 2 with
  `unshifted`).

  zs: list over children of `[Gp, N]` unscaled dot products q . s (the logits are scale * zs);
  masks: list of `[N]` child-exists masks. Eq. 21 ("pisa"): log-sum-exp; Eq. 33 ("pisa1"): mean;
  Eq. 34 ("pisa2"): mean + population variance / 2. unshifted ("pisa"): log2 of the plain sum
  of 2^(c z), for programs whose exponents are bounded.

  LSE(scale * z) = scale * m + ln 2 * log2(sum 2^(c z - c m)) with c = scale * log2(e) (scale > 0,
  so the max commutes with it). fma_shift: each exponent as z * c - m * c, one fused multiply-add
  (the selection kernels); otherwise (z - m) * c (the decode kernels).
  """
  if selector == "pisa" and unshifted:
    return unshifted_lse(zs, masks, scale, approx_log)
  if selector == "pisa":
    c = scale * LOG2E
    m = functools.reduce(jnp.maximum,
                         [jnp.where(v[None, :], z, -jnp.inf) for z, v in zip(zs, masks)])
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    if fma_shift:
      mc = m_safe * c

      def shifted(z):
        return jnp.exp2(z * c - mc)
    else:
      def shifted(z):
        return jnp.exp2((z - m_safe) * c)
    total = sum(jnp.where(v[None, :], shifted(z), 0.0) for z, v in zip(zs, masks))
    return m_safe * scale + log2(total, approx_log) * LN2
  zs = [z * scale for z in zs]
  count = jnp.maximum(sum(v.astype(jnp.float32) for v in masks), 1.0)[None, :]
  mean = sum(jnp.where(v[None, :], z, 0.0) for z, v in zip(zs, masks)) / count
  if selector == "pisa1":
    return mean
  var = sum(jnp.where(v[None, :], jnp.square(z - mean), 0.0) for z, v in zip(zs, masks)) / count
  return mean + 0.5 * var


def reduce_keys(z, m_key, selector: str, scale: float, approx_log: bool = False,
                unshifted: bool = False, fma_shift: bool = True):
  """Per-row score over one leaf's raw keys (Eq. 21 / 33 / 34 with l = 1): z `[R, Cp]` unscaled
  dot products q . k, m_key `[Cp]` valid keys or None (every column is a key: the block is a
  power of two >= 16 and only complete past leaves are scored) -> `[R]`. unshifted and
  fma_shift as in `reduce_children`."""
  if selector == "pisa" and unshifted:
    e = jnp.exp2(z * (scale * LOG2E))
    if m_key is not None:
      e = jnp.where(m_key[None, :], e, 0.0)
    return log2(jnp.sum(e, axis=1), approx_log)
  if selector == "pisa":
    # Eq. 21 at the leaves: the exact raw-key LSE, as in `reduce_children` (no per-element mask
    # when every column is a key).
    c = scale * LOG2E
    if m_key is not None:
      z = jnp.where(m_key[None, :], z, -jnp.inf)
    m = jnp.max(z, axis=1)
    m_safe = m if m_key is None else jnp.where(m == -jnp.inf, 0.0, m)
    if fma_shift:
      e = jnp.exp2(z * c - (m_safe * c)[:, None])
    else:
      e = jnp.exp2((z - m_safe[:, None]) * c)
    total = jnp.sum(e, axis=1)
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


# ----------------------------------------------------------------------------- Select_K order


def rank_key(score, first=None):
  """Scores as ranking keys: `first` (forced nodes, or every node when all are kept) +inf, then
  NaN (a NaN query or key keeps its block, where attention shows the NaN), then the numbers."""
  key = jnp.where(jnp.isnan(score), NAN_RANK, jnp.clip(score, -SCORE_LIMIT, SCORE_LIMIT))
  return key if first is None else jnp.where(first, jnp.inf, key)


def pair_axes(by_column: bool):
  """How an all-pairs compare over the last axis `[..., N]` lays out candidate i (whose count is
  wanted) and candidate j (counted): (expand as i, expand as j, the axis to sum j over). By row,
  i is the row of the `[..., N, N]` compare; by column, i is the column, and the count comes out
  in the layout of a row vector `[..., None, :]`."""
  rows, cols = (lambda x: x[..., :, None]), (lambda x: x[..., None, :])
  return (cols, rows, -2) if by_column else (rows, cols, -1)


def rank_by_key(cand, valid, key, by_column: bool = False):
  """Each candidate's rank in (key descending, node id ascending) among the valid ones,
  `[..., N]`: the number of valid candidates before it, from one broadcast compare `[..., N, N]`
  and one sum instead of a sort (ids are distinct, so the order is strict)."""
  as_i, as_j, over_j = pair_axes(by_column)
  k_i, k_j, c_i, c_j = as_i(key), as_j(key), as_i(cand), as_j(cand)
  before = as_j(valid) & ((k_j > k_i) | ((k_j == k_i) & (c_j < c_i)))
  return jnp.sum(before.astype(jnp.int32), axis=over_j)


def rank_by_id(cand, taken, by_column: bool = False):
  """Each candidate's rank by node id among the taken ones, `[..., N]`: a taken candidate's slot
  in the ascending list of the taken ids."""
  as_i, as_j, over_j = pair_axes(by_column)
  before = as_j(taken) & (as_j(cand) < as_i(cand))
  return jnp.sum(before.astype(jnp.int32), axis=over_j)


# ----------------------------------------------------------------------------- running top-k


def _merge_top_k(best_v, best_i, b_r, o_n, o_col, top_k: int):
  """The top_k of the kept `[R, KP]` and the tile `[R, N]` (higher ids: ties to the kept)."""
  bt, kp = best_v.shape
  tile_i = jnp.broadcast_to(o_n[None, :], b_r.shape)

  def take(p, carry):
    kv, tv, nv, ni = carry
    m_k = jnp.max(kv, axis=1)
    m = jnp.maximum(m_k, jnp.max(tv, axis=1))
    from_kept = m_k >= m
    pick = jnp.where(from_kept,
                     jnp.min(jnp.where(kv == m[:, None], best_i, BIG), axis=1),
                     jnp.min(jnp.where(tv == m[:, None], tile_i, BIG), axis=1))
    nv = jnp.where(o_col[None, :] == p, m[:, None], nv)
    ni = jnp.where(o_col[None, :] == p, jnp.where(m > -jnp.inf, pick, -1)[:, None], ni)
    kv = jnp.where(from_kept[:, None] & (best_i == pick[:, None]), -jnp.inf, kv)
    tv = jnp.where(~from_kept[:, None] & (tile_i == pick[:, None]), -jnp.inf, tv)
    return kv, tv, nv, ni

  init = (best_v, b_r, jnp.full((bt, kp), -jnp.inf, jnp.float32),
          jnp.full((bt, kp), -1, jnp.int32))
  return lax.fori_loop(0, top_k, take, init)[2:]


def running_top_k(best_v, best_i, b_r, o_n, o_col, top_k: int):
  """One tile of a running top_k over candidate tiles, for R rows at once (no `[R, N]` scores of
  the whole row in memory): (values, ids) `[R, KP]`, KP >= top_k.

  best_v, best_i: the kept values, descending, and their ids (-inf and -1 in empty columns and
  in columns >= top_k). b_r: the tile's values `[R, N]` (-inf: not a candidate), of ids o_n `[N]`,
  every id above those of earlier tiles. o_col: `jnp.arange(KP)`. The merge (top_k passes of a
  row max over kept and tile, each picking the lowest id among equal values) runs only where
  some row's tile beats its K-th kept value; an equal value never displaces a kept one, so ties
  go to the lower id, as `lax.top_k` sends them in the references.
  """
  # The K-th kept value of each row (kept values are in descending order): a tile that beats it
  # nowhere changes nothing (a tie goes to the kept, lower slot).
  kth = jnp.max(jnp.where(o_col[None, :] == top_k - 1, best_v, -jnp.inf), axis=1)
  beats = jnp.max((b_r > kth[:, None]).astype(jnp.int32)) > 0  # no reduce_or in Triton
  return lax.cond(beats, lambda: _merge_top_k(best_v, best_i, b_r, o_n, o_col, top_k),
                  lambda: (best_v, best_i))
