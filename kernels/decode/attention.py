"""Split-K flash-decoding over the selected blocks: program (batch row x KV head, split) runs the
online softmax (Eq. 6) over its share of the K blocks (`attend`, which the step's fused Select_K
and attention launch shares), and a merge kernel combines the splits by log-sum-exp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import LOG2E, load_rows, next_pow2, pallas_launch, qk_dot
from pisa_jax.kernels.decode.config import DecodeConfig, default_attend_blocks
from pisa_jax.kernels.decode.layout import (Geometry, load_group_queries, load_scalar,
                                            make_geometry, store_row)
from pisa_jax.spec import SelectionSpec


def attend(block_at, qg, k_ref, v_ref, i_b, i_h, t, first_slot, *, geo: Geometry, blocks: int):
  """The online softmax (Eq. 6) of the group's heads `qg` over the selected slots first_slot ..
  first_slot + blocks - 1 of row i_b's token at position t; `block_at(slot)` gives the slot's
  block and whether it selects one. Returns the running max m and sum l `[Gp]` (base 2) and the
  unnormalised output `[Gp, Dp]`, float32."""
  c = geo.block_size
  cur = t // c
  o_key = jnp.arange(geo.block_padded)
  qk_scale = geo.scale * LOG2E

  def body(j, carry):
    m, l, acc = carry
    blk, ok = block_at(first_slot + j)
    # Blocks after the current one and slots that select nothing contribute no key.
    ok = ok & (blk >= 0) & (blk <= cur)
    key_pos = jnp.clip(blk, 0, cur) * c + o_key
    visible = ok & (o_key < c) & (key_pos <= t)
    rows = (i_b * geo.capacity + jnp.minimum(key_pos, geo.capacity - 1)) * geo.hkv + i_h
    keys = load_rows(k_ref, rows, visible, geo.d, geo.head_dim_padded)
    vals = load_rows(v_ref, rows, visible, geo.d, geo.head_dim_padded)
    s = jnp.where(visible[None, :], qk_dot(qg, keys, geo.inputs_16bit) * qk_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_use[:, None])
    alpha = jnp.exp2(m - m_use)
    if geo.inputs_16bit:
      pv = jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    else:
      pv = jnp.dot(p, vals.astype(jnp.float32), precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

  gp = geo.group_padded
  init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
          jnp.zeros((gp, geo.head_dim_padded), jnp.float32))
  return lax.fori_loop(0, blocks, body, init)


def _attend_kernel(pos_ref, q_ref, k_ref, v_ref, idx_ref, o_ref, m_ref, l_ref, *,
                   geo: Geometry, blocks: int, splits: int):
  """Program (batch row x KV head, split): `attend` over the split's share of the indices
  `[B * HKV * K]`; writes the partials (o, m, l) for `merge_splits`."""
  i_bh, i_s = pl.program_id(0), pl.program_id(1)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  qg, _ = load_group_queries(q_ref, i_b, i_h, geo)

  def block_at(slot):
    blk = load_scalar(idx_ref, i_bh * geo.top_k + jnp.minimum(slot, geo.top_k - 1))
    return blk, slot < geo.top_k  # -1 padding selects nothing too (`attend`)

  t = jnp.clip(load_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  m, l, acc = attend(block_at, qg, k_ref, v_ref, i_b, i_h, t, i_s * blocks, geo=geo,
                     blocks=blocks)
  store_partials(o_ref, m_ref, l_ref, i_bh * splits + i_s, m, l, acc)


def store_partials(o_ref, m_ref, l_ref, row, m, l, acc):
  o_ref[row] = acc
  m_ref[row] = m
  l_ref[row] = l


def split_plan(geo: Geometry, config: DecodeConfig) -> tuple[int, int]:
  """(selected blocks per attention program, programs per (row, KV head))."""
  blocks = min(config.attend_blocks or default_attend_blocks(geo.batch, geo.hkv, geo.top_k),
               next_pow2(geo.top_k))
  return blocks, -(-geo.top_k // blocks)


def partial_shapes(geo: Geometry, splits: int) -> list[jax.ShapeDtypeStruct]:
  """The attention programs' outputs: o `[R, Gp, Dp]`, m and l `[R, Gp]`, R = B * HKV * splits."""
  rows = geo.batch * geo.hkv * splits
  return [jax.ShapeDtypeStruct((rows, geo.group_padded, geo.head_dim_padded), jnp.float32),
          jax.ShapeDtypeStruct((rows, geo.group_padded), jnp.float32),
          jax.ShapeDtypeStruct((rows, geo.group_padded), jnp.float32)]


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, geo: Geometry, splits: int):
  """Program (batch row x KV head, query head of the group): the log-sum-exp merge (base 2) of
  the head's partials from the `splits` programs into its output row `[D]`."""
  i_bh, i_g = pl.program_id(0), pl.program_id(1)
  sp = max(2, next_pow2(splits))
  o_split = jnp.arange(sp)
  m_split = o_split < splits
  rows = (i_bh * splits + jnp.minimum(o_split, splits - 1)) * geo.group_padded + i_g
  m = plt.load(m_ref.at[rows], mask=m_split, other=-jnp.inf)
  l = plt.load(l_ref.at[rows], mask=m_split, other=0.0)
  o = load_rows(o_ref, rows, m_split, geo.head_dim_padded, geo.head_dim_padded)  # [Sp, Dp]
  m_all = jnp.max(m)
  m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.where(m == -jnp.inf, 0.0, jnp.exp2(m - m_all))
  total = jnp.sum(w * l)
  out = jnp.sum(w[:, None] * o, axis=0)
  # != 0 rather than > 0: a NaN total (a NaN key seen, a row past capacity) reaches the output.
  out = jnp.where(total != 0, out / jnp.where(total != 0, total, 1.0), 0.0)
  store_row(out_ref, i_bh * geo.group + i_g, out.astype(out_ref.dtype), True, geo.d,
            geo.head_dim_padded)


def merge_splits(o, m, l, geo: Geometry, splits: int, dtype, *, interpret: bool):
  """The partials of `partial_shapes` merged into the output `[B, HQ, D]` in `dtype`, one
  program per query head: a row that saw no key gets zeros, a NaN sum gives NaN. (XLA fused the
  same merge into three or four kernels, each a dependent launch.)"""
  out = pallas_launch(functools.partial(_merge_kernel, geo=geo, splits=splits),
                      jax.ShapeDtypeStruct((geo.batch * geo.hq, geo.d), dtype),
                      (geo.batch * geo.hkv, geo.group), warps=4, stages=1, interpret=interpret,
                      name="pisa_decode_merge")(o.reshape(-1, geo.head_dim_padded),
                                                m.reshape(-1), l.reshape(-1))
  return out.reshape(geo.batch, geo.hq, geo.d)


def decode_attention_pallas(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    block_indices: Int[Array, "B HKV K"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: DecodeConfig | None = None,
) -> Float[Array, "B HQ D"]:
  """Kernel twin of `decode_attention_reference`: Eq. 6 for the token at `positions` over the
  keys j <= t of its selected blocks, split-K over programs. Returns `[B, HQ, D]` in q's dtype."""
  d, top_k = q.shape[-1], block_indices.shape[-1]
  # A flat spec: the walk's fields (branching, beam, selector) are unused by the attention.
  geo = make_geometry(q, k_cache, SelectionSpec(block_size=block_size, top_k=top_k, scale=scale,
                                                selector="bsa"))
  config = config or DecodeConfig.default(head_dim=d)
  blocks, splits = split_plan(geo, config)
  call = pallas_launch(functools.partial(_attend_kernel, geo=geo, blocks=blocks, splits=splits),
                       partial_shapes(geo, splits), (geo.batch * geo.hkv, splits),
                       warps=config.attend_warps, stages=config.num_stages, interpret=interpret,
                       name="pisa_decode_attention")
  o, m, l = call(positions.astype(jnp.int32), q.reshape(-1, d), k_cache.reshape(-1, d),
                 v_cache.reshape(-1, d), block_indices.astype(jnp.int32).reshape(-1))
  return merge_splits(o, m, l, geo, splits, q.dtype, interpret=interpret)
