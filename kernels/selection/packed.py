"""Pallas scoring kernels for selection over packed documents (segment_ids).

What is fused, and what is not: these kernels compute the floating-point scores of the packed
walk, the part of selection that reads keys and summaries, and the document walk around them
is the jnp reference's (`pisa_jax.selection`, `_packed_walk_chunk` / `_packed_bsa_chunk`): its
candidate bookkeeping, the forced blocks and Select_K (`lax.top_k`) run in XLA between one
kernel launch per level, so a level's candidates make a round trip through HBM. They serve the
selections the fused packed walk (`packed_walk.py`, beam * g <= 16) does not take: "bsa" and
wider beams. "exact" (reference-only, as unpacked) has no kernel.

  child_scores_pallas: one level of the hierarchical walk. Candidate c of query t, KV head h has
    its children at consecutive rows base .. base + count - 1 of a row array (the document's
    raw keys for the leaves, its slots of the packed level below otherwise: the packed layout
    keeps both runs contiguous), and its score is Eq. 21 ("pisa", log-sum-exp), Eq. 33 ("pisa1",
    mean) or Eq. 34 ("pisa2", mean + variance / 2) of the children's logits, summed over the
    group's query heads (Eq. 22).
  bsa_scores_pallas: the flat BSA scores of a query's document leaves: per head a softmax over
    the document's blocks complete at the query (Eq. 4 on the mean keys of Eq. 2), summed over
    the group, for each complete block before the query's current one; zero elsewhere.

Both run one program per (query, KV head, batch) and compute in float32 at IEEE precision, as
the reference does, so their scores differ from it only in summation order (a near-tie in the
walk can flip, as between the unpacked kernels and their reference).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import call_kernel, next_pow2
from pisa_jax.kernels.selection.config import MIN_DOT, pow2_at_least
from pisa_jax.kernels.selection.scoring import qk_dot

_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _dot_t(a, b):
  """a @ b.T in float32 at IEEE precision: a `[R, Dp]`, b `[N, Dp]` -> `[R, N]`."""
  return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), (((1,), (1,)), ((), ())),
                         precision=_HIGHEST, preferred_element_type=jnp.float32)


def _load_group(q_ref, t, group: int, rows: int, dtype=jnp.float32):
  """The group's query heads of query t from a `[Tc, G, Dp]` ref, as `[rows, Dp]` of dtype."""
  if rows == group:
    return q_ref[t].astype(dtype)
  return plt.load(q_ref.at[t, pl.ds(0, rows), :], mask=(jnp.arange(rows) < group)[:, None],
                  other=0.0).astype(dtype)


def _reduce_children(z, m_child, count, selector: str):
  """Per-head score `[R]` of one candidate from its children's logits z `[R, W]` (Eq. 21, 33,
  34); m_child `[W]` marks the children that exist, count of them."""
  if selector == "pisa":
    z = jnp.where(m_child[None, :], z, -jnp.inf)
    top = jnp.max(z, axis=1)
    # A candidate without children has top = -inf: shift by 0 so no inf - inf appears.
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    return shift + jnp.log(jnp.sum(jnp.exp(z - shift[:, None]), axis=1))
  n = jnp.maximum(count, 1).astype(jnp.float32)
  mean = jnp.sum(jnp.where(m_child[None, :], z, 0.0), axis=1) / n
  if selector == "pisa1":
    return mean
  var = jnp.sum(jnp.where(m_child[None, :], jnp.square(z - mean[:, None]), 0.0), axis=1) / n
  return mean + 0.5 * var


def _child_scores_kernel(q_ref, x_ref, base_ref, count_ref, o_ref, *, group: int, rows: int,
                         width: int, num_cand: int, num_rows: int, scale: float, selector: str,
                         exact_16bit: bool):
  """One program: query t, KV head h. q_ref `[Tc, G, Dp]`, x_ref `[N, Dp]` (this head's rows),
  base_ref / count_ref `[Tc, n]`, o_ref `[Tc, n_p]` float32. exact_16bit: q and x hold the same
  16-bit dtype, so their dot runs on it (exact products, float32 accumulation)."""
  t = pl.program_id(0)
  # [R, Dp]
  b_q = _load_group(q_ref, t, group, rows, x_ref.dtype if exact_16bit else jnp.float32)
  m_head = jnp.arange(rows) < group
  width_p = pow2_at_least(width, MIN_DOT)
  o_w = jnp.arange(width_p)
  o_d = jnp.arange(x_ref.shape[-1])
  o_c = jnp.arange(o_ref.shape[-1])

  def body(c, acc):
    base = base_ref[t, c]
    count = count_ref[t, c]
    m_child = o_w < count
    slot = jnp.clip(base + o_w, 0, num_rows - 1)
    # [W, Dp] the candidate's children, missing ones zero (their logits are masked anyway).
    b_x = plt.load(x_ref.at[slot[:, None], o_d[None, :]], mask=m_child[:, None], other=0.0)
    # [R, W]
    z = (qk_dot(b_q, b_x, True) if exact_16bit else _dot_t(b_q, b_x)) * scale
    per_head = _reduce_children(z, m_child, count, selector)
    # Eq. 22: the group's heads summed (padded heads dropped).
    score = jnp.sum(jnp.where(m_head, per_head, 0.0))
    return jnp.where(o_c == c, score, acc)

  o_ref[t] = lax.fori_loop(0, num_cand, body, jnp.zeros(o_c.shape, jnp.float32))


def _pad_columns(x, dp: int):
  return x if x.shape[-1] == dp else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - x.shape[-1])])


def child_scores_pallas(qg: Float[Array, "B Tc HKV G D"], source: Float[Array, "B N HKV D"],
                        base: Int[Array, "B Tc HKV n"], count: Int[Array, "B Tc HKV n"], *,
                        width: int, scale: float, selector: str, interpret: bool,
                        q_dtype=jnp.float32) -> Float[Array, "B Tc HKV n"]:
  """Group-summed scores of candidates whose children are rows base .. base + count - 1
  (count <= width) of source, per (query, KV head); entries with count 0 are -inf for "pisa",
  0 otherwise (the walk masks them). q_dtype: the queries' dtype before qg's float32 cast; where
  it is source's 16-bit dtype (the leaf level scores raw keys) the dots run on that dtype: the
  products are exact, as at IEEE float32, on tensor cores instead of a float32 FMA loop."""
  b, tc, hkv, g, d = qg.shape
  exact_16bit = jnp.dtype(q_dtype) == source.dtype and source.dtype.itemsize == 2
  if exact_16bit:
    qg = qg.astype(source.dtype)  # exact: qg holds q_dtype values cast to float32
  n_rows = source.shape[1]
  num_cand = base.shape[-1]
  dp = pow2_at_least(d, MIN_DOT)
  rows = pow2_at_least(g, MIN_DOT)
  n_p = next_pow2(num_cand)
  kernel = functools.partial(_child_scores_kernel, group=g, rows=rows, width=width,
                             num_cand=num_cand, num_rows=n_rows, scale=scale, selector=selector,
                             exact_16bit=exact_16bit)
  q_spec = pl.BlockSpec((None, tc, None, g, dp), lambda i, h, bb: (bb, 0, h, 0, 0))
  x_spec = pl.BlockSpec((None, n_rows, None, dp), lambda i, h, bb: (bb, 0, h, 0))
  cand_spec = pl.BlockSpec((None, tc, None, num_cand), lambda i, h, bb: (bb, 0, h, 0))
  out_spec = pl.BlockSpec((None, tc, None, n_p), lambda i, h, bb: (bb, 0, h, 0))
  out = call_kernel(pl.pallas_call(
      kernel,
      grid=(tc, hkv, b),
      in_specs=[q_spec, x_spec, cand_spec, cand_spec],
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct((b, tc, hkv, n_p), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name=f"pisa_select_packed_{selector}_w{width}",
  ), _pad_columns(qg, dp), _pad_columns(source, dp), base.astype(jnp.int32),
      count.astype(jnp.int32))
  return out[..., :num_cand]


def _bsa_scores_kernel(q_ref, x_ref, first_ref, rel_ref, o_ref, *, group: int, rows: int,
                       block_size: int, num_blocks: int, num_rows: int, tile: int, scale: float):
  """One program: query t, KV head h. x_ref `[N, Dp]` this head's packed leaves; first_ref,
  rel_ref `[Tc]` the query's first leaf slot and position in its document; o_ref `[Tc, Mp]`."""
  t = pl.program_id(0)
  b_q = _load_group(q_ref, t, group, rows)
  m_head = jnp.arange(rows) < group
  first = first_ref[t]
  rel = rel_ref[t]
  # Blocks whose last key is at or before the query (the softmax's support, fla's NSA rule),
  # and those before the query's current block (the scored ones; the current one is forced).
  num_complete = lax.div(rel + 1, block_size)
  num_past = lax.div(rel, block_size)
  o_m = jnp.arange(tile)
  o_d = jnp.arange(x_ref.shape[-1])
  scale2 = scale * math.log2(math.e)

  def logits(i):
    block = i * tile + o_m
    m_block = block < jnp.minimum(num_complete, num_blocks)
    slot = jnp.clip(first + block, 0, num_rows - 1)
    b_x = plt.load(x_ref.at[slot[:, None], o_d[None, :]], mask=m_block[:, None], other=0.0)
    # [R, tile] base-2 logits, Eq. 4 on the mean keys.
    return block, jnp.where(m_block[None, :], _dot_t(b_q, b_x) * scale2, -jnp.inf)

  def normaliser(i, carry):
    b_m, b_l = carry
    _, z = logits(i)
    m_new = jnp.maximum(b_m, jnp.max(z, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    b_l = b_l * jnp.exp2(b_m - m_use) + jnp.sum(jnp.exp2(z - m_use[:, None]), axis=1)
    return m_new, b_l

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
  b_m, b_l = lax.fori_loop(0, lax.div(num_complete + tile - 1, tile), normaliser, init)
  m_use = jnp.where(b_m == -jnp.inf, 0.0, b_m)
  inv_l = 1.0 / jnp.where(b_l > 0, b_l, 1.0)

  def write(i, _):
    block, z = logits(i)
    probs = jnp.exp2(z - m_use[:, None]) * inv_l[:, None]
    probs = jnp.where(m_head[:, None] & (block < num_past)[None, :], probs, 0.0)
    o_ref[t, pl.ds(pl.multiple_of(i * tile, tile), tile)] = jnp.sum(probs, axis=0)
    return 0

  lax.fori_loop(0, o_ref.shape[-1] // tile, write, 0)


def bsa_scores_pallas(qg: Float[Array, "B Tc HKV G D"], leaves: Float[Array, "B N HKV D"],
                      first_leaf: Int[Array, "B Tc"], rel: Int[Array, "B Tc"], *,
                      block_size: int, num_blocks: int, scale: float,
                      interpret: bool) -> Float[Array, "B Tc HKV M"]:
  """Flat BSA scores of each query's document blocks 0 .. num_blocks - 1 (the document's leaves
  at packed slots first_leaf + i), group-summed softmax probabilities, zero from the current
  block on."""
  b, tc, hkv, g, d = qg.shape
  n_rows = leaves.shape[1]
  dp = pow2_at_least(d, MIN_DOT)
  rows = pow2_at_least(g, MIN_DOT)
  tile = min(64, pow2_at_least(num_blocks, MIN_DOT))
  width = -(-num_blocks // tile) * tile
  kernel = functools.partial(_bsa_scores_kernel, group=g, rows=rows, block_size=block_size,
                             num_blocks=num_blocks, num_rows=n_rows, tile=tile, scale=scale)
  q_spec = pl.BlockSpec((None, tc, None, g, dp), lambda i, h, bb: (bb, 0, h, 0, 0))
  x_spec = pl.BlockSpec((None, n_rows, None, dp), lambda i, h, bb: (bb, 0, h, 0))
  pos_spec = pl.BlockSpec((None, tc), lambda i, h, bb: (bb, 0))
  out_spec = pl.BlockSpec((None, tc, None, width), lambda i, h, bb: (bb, 0, h, 0))
  out = call_kernel(pl.pallas_call(
      kernel,
      grid=(tc, hkv, b),
      in_specs=[q_spec, x_spec, pos_spec, pos_spec],
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct((b, tc, hkv, width), jnp.float32),
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="pisa_select_packed_bsa",
  ), _pad_columns(qg, dp), _pad_columns(leaves, dp), first_leaf.astype(jnp.int32),
      rel.astype(jnp.int32))
  return out[..., :num_blocks]
