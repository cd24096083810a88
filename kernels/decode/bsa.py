"""The flat BSA decode kernel, O(N / C) per step as BSA is: each head's softmax over the leaf
summaries of the blocks complete at t, summed over the group, and the top_k - 3 best past blocks
beside the forced first, previous and current ones."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pisa_jax.kernels._common import BIG, LOG2E, next_pow2, pallas_launch, rank_key
from pisa_jax.kernels.decode.config import DecodeConfig
from pisa_jax.kernels.decode.layout import Geometry, load_group_queries, load_scalar
from pisa_jax.kernels.decode.scoring import summary_logits


def _bsa_kernel(pos_ref, q_ref, s_ref, out_ref, *, geo: Geometry, block_tile: int):
  """Flat BSA for one (batch row, KV head), O(N / C): each head's softmax over the mean-key
  summaries of the complete blocks (those whose last key is at or before t), summed over the
  group (Eq. 4, 22); forced first, previous and current blocks, then the top_k - 3 best of the
  others, merged tile by tile into a running set by rank (score descending, id ascending)."""
  c = geo.block_size
  num_nodes = geo.num_nodes
  num_leaves = geo.sizes[0]
  i_bh = pl.program_id(0)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  t = jnp.clip(load_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  cur = t // c
  complete = (t + 1) // c
  qg, m_head = load_group_queries(q_ref, i_b, i_h, geo)
  o_blk = jnp.arange(block_tile)
  c2 = geo.scale * LOG2E

  def logits(i):
    blk = i * block_tile + o_blk
    rows = (i_b * num_nodes + jnp.minimum(blk, num_leaves - 1)) * geo.hkv + i_h
    z2 = c2 * summary_logits(qg, s_ref, rows, blk < complete, geo)  # [Gp, BT], base 2
    return blk, jnp.where((blk < complete)[None, :], z2, -jnp.inf)

  def normaliser(i, carry):
    m, l = carry
    _, z2 = logits(i)
    m_new = jnp.maximum(m, jnp.max(z2, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    l = l * jnp.exp2(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe)) + jnp.sum(
        jnp.exp2(z2 - m_safe[:, None]), axis=1)
    return m_new, l

  m, l = lax.fori_loop(0, pl.cdiv(complete, block_tile), normaliser,
                       (jnp.full((geo.group_padded,), -jnp.inf, jnp.float32),
                        jnp.zeros((geo.group_padded,), jnp.float32)))
  m = jnp.where(m == -jnp.inf, 0.0, m)
  inv_l = jnp.where(m_head & (l > 0), 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
  n_best = geo.top_k - 3
  bp = next_pow2(max(n_best, 1))
  o_best = jnp.arange(bp)

  def merge(i, carry):
    best_v, best_i = carry
    blk, z2 = logits(i)
    # [BT]: the group-summed probability of every block; candidates are blocks 1 .. cur - 2.
    ps = rank_key(jnp.sum(jnp.exp2(z2 - m[:, None]) * inv_l[:, None], axis=0))
    m_tile = (blk >= 1) & (blk <= cur - 2)
    m_best = best_i < BIG
    # Ranks in the union of the running set and the tile, by (score desc, id asc).
    before_tt = m_tile[:, None] & ((ps[:, None] > ps[None, :])
                                   | ((ps[:, None] == ps[None, :]) & (blk[:, None] < blk[None, :])))
    before_bt = m_best[:, None] & ((best_v[:, None] > ps[None, :])
                                   | ((best_v[:, None] == ps[None, :])
                                      & (best_i[:, None] < blk[None, :])))
    before_tb = m_tile[:, None] & ((ps[:, None] > best_v[None, :])
                                   | ((ps[:, None] == best_v[None, :])
                                      & (blk[:, None] < best_i[None, :])))
    before_bb = m_best[:, None] & ((best_v[:, None] > best_v[None, :])
                                   | ((best_v[:, None] == best_v[None, :])
                                      & (best_i[:, None] < best_i[None, :])))
    r_tile = (jnp.sum(before_tt.astype(jnp.int32), axis=0)
              + jnp.sum(before_bt.astype(jnp.int32), axis=0))
    r_best = (jnp.sum(before_tb.astype(jnp.int32), axis=0)
              + jnp.sum(before_bb.astype(jnp.int32), axis=0))
    hit_t = m_tile[None, :] & (r_tile[None, :] == o_best[:, None])  # [BP, BT]
    hit_b = m_best[None, :] & (r_best[None, :] == o_best[:, None])  # [BP, BP]
    new_v = jnp.maximum(jnp.max(jnp.where(hit_t, ps[None, :], -jnp.inf), axis=1),
                        jnp.max(jnp.where(hit_b, best_v[None, :], -jnp.inf), axis=1))
    new_i = jnp.minimum(jnp.min(jnp.where(hit_t, blk[None, :], BIG), axis=1),
                        jnp.min(jnp.where(hit_b, best_i[None, :], BIG), axis=1))
    live = o_best < n_best
    return jnp.where(live, new_v, -jnp.inf), jnp.where(live, new_i, BIG)

  best_v = jnp.full((bp,), -jnp.inf, jnp.float32)
  best_i = jnp.full((bp,), BIG, jnp.int32)
  if n_best > 0:
    best_v, best_i = lax.fori_loop(0, pl.cdiv(jnp.maximum(cur - 1, 0), block_tile), merge,
                                   (best_v, best_i))
  # Output ascending: 0, the best (ids in 1 .. cur - 2) by id, cur - 1, cur; or, when at most
  # top_k blocks are eligible, every block 0 .. cur.
  kp = geo.top_k_padded
  o_out = jnp.arange(kp)
  m_best = best_i < BIG
  pos = jnp.sum((m_best[:, None] & (best_i[:, None] < best_i[None, :])).astype(jnp.int32), axis=0)
  placed = jnp.max(jnp.where(m_best[None, :] & (pos[None, :] + 1 == o_out[:, None]),
                             best_i[None, :], -1), axis=1)
  chosen = jnp.where(o_out == 0, 0, placed)
  chosen = jnp.where(o_out == n_best + 1, cur - 1, chosen)
  chosen = jnp.where(o_out == n_best + 2, cur, chosen)
  chosen = jnp.where(cur + 1 <= geo.top_k, jnp.where(o_out <= cur, o_out, -1), chosen)
  out_ref[pl.ds(i_bh, 1), :] = chosen[None, :]


def select_bsa(positions, q_rows, s_rows, geo: Geometry, config: DecodeConfig, interpret: bool):
  """The BSA kernel over every (batch row, KV head): int32 `[B * HKV, KP]`, ascending, -1 padded.
  q_rows `[B * HQ, D]` and s_rows (the stacked summaries) `[B * S * HKV, D]`."""
  call = pallas_launch(functools.partial(_bsa_kernel, geo=geo, block_tile=config.bsa_block_tile),
                       jax.ShapeDtypeStruct((geo.batch * geo.hkv, geo.top_k_padded), jnp.int32),
                       (geo.batch * geo.hkv,), warps=config.bsa_warps, stages=config.num_stages,
                       interpret=interpret, name="pisa_decode_select_bsa")
  return call(positions, q_rows, s_rows)
