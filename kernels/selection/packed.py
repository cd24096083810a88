"""The Pallas scoring kernel of flat BSA selection over packed documents (segment_ids).

  bsa_scores_pallas: the flat BSA scores of a query's document leaves: per head a softmax over
    the document's blocks complete at the query (Eq. 4 on the mean keys of Eq. 2), summed over
    the group, for each complete block before the query's current one; zero elsewhere.

One program per (query, KV head, batch), in float32 at IEEE precision as the reference, so its
scores differ from it only in summation order. The flat top-k around it is the jnp reference's
(`pisa_jax.selection._packed_bsa_chunk`). The hierarchical selectors have their own kernels
(`packed_walk.py`: the fused walk, or the two-stage pipeline for wide candidate sets).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import LOG2E, MIN_DOT, call_kernel, pow2_at_least, qk_dot


def _load_group(q_ref, t, group: int, rows: int):
  """The group's query heads of query t from a `[Tc, G, Dp]` ref, as float32 `[rows, Dp]`."""
  if rows == group:
    return q_ref[t].astype(jnp.float32)
  return plt.load(q_ref.at[t, pl.ds(0, rows), :], mask=(jnp.arange(rows) < group)[:, None],
                  other=0.0).astype(jnp.float32)


def _pad_columns(x, dp: int):
  return x if x.shape[-1] == dp else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dp - x.shape[-1])])


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
  scale2 = scale * LOG2E

  def logits(i):
    block = i * tile + o_m
    m_block = block < jnp.minimum(num_complete, num_blocks)
    slot = jnp.clip(first + block, 0, num_rows - 1)
    b_x = plt.load(x_ref.at[slot[:, None], o_d[None, :]], mask=m_block[:, None], other=0.0)
    # [R, tile] base-2 logits, Eq. 4 on the mean keys.
    return block, jnp.where(m_block[None, :], qk_dot(b_q, b_x, False) * scale2, -jnp.inf)

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
