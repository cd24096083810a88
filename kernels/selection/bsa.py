"""The flat BSA selection kernel: per query head a softmax over the leaf summaries of the blocks
complete at t (Eq. 4 with the mean-key summaries of Eq. 2), summed over the group's heads, and the
top_k - 3 best past blocks beside the forced first, previous and current ones. The twin of the
"bsa" selector of `select_blocks_reference`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pisa_jax.kernels._common import BIG, LOG2E, MIN_DOT, next_pow2, rank_key
from pisa_jax.kernels.pyramid import leaf_summaries_pallas
from pisa_jax.kernels.selection import scoring, topk
from pisa_jax.kernels.selection.config import SelectionConfig
from pisa_jax.kernels.selection.layout import (Geometry, launch, load_rows, offset_input,
                                               query_position, query_tile_program, summary_rows)


def bsa_kernel(q_ref, s_ref, *refs, geo: Geometry, q_tile: int, block_tile: int):
  """Flat BSA for q_tile queries of one KV head, without materialising `[T, M]` scores.

  Pass 1: per (query, head) online max / sum of exp over the blocks complete at t, the current
  one too when t is its last position (the softmax normaliser of fla's NSA, which the paper's BSA
  follows). Pass 2: the normalised probabilities summed over the group's heads, merged block tile
  by block tile into a running top-(top_k - 3) of the non-forced past blocks.

  refs: (out_ref,), or (off_ref, out_ref) with `geo.has_offset`: query row r sits at position
  off + r, which sets its complete, current and forced blocks.
  """
  off_ref, out_ref = refs if geo.has_offset else (None, refs[0])
  n_q = geo.num_queries
  # Head rows per query: the group padded to a power of two, and >= 16 rows in all for the dot.
  heads = max(next_pow2(geo.group), MIN_DOT // q_tile)
  tile_rows = q_tile * heads
  i_b, i_h, i_tile = query_tile_program(geo, q_tile)
  t0 = i_tile * q_tile
  o_r = jnp.arange(tile_rows)
  e_r, j_r = o_r // heads, o_r % heads
  t_r = t0 + e_r  # query rows; their positions are query_position(row)
  m_r = (t_r < n_q) & (j_r < geo.group)
  q_rows = ((i_b * n_q + jnp.minimum(t_r, n_q - 1)) * geo.hq + i_h * geo.group
            + jnp.minimum(j_r, geo.group - 1))
  b_q = load_rows(q_ref, q_rows, m_r, geo)
  done_r = ((query_position(t_r, off_ref) + 1) // geo.block_size)[:, None]  # complete at t
  o_e = jnp.arange(q_tile)
  t_e = t0 + o_e
  cur_e = (query_position(jnp.minimum(t_e, n_q - 1), off_ref) // geo.block_size)[:, None]
  num_blocks = geo.num_blocks
  t_last = query_position(jnp.minimum(t0 + q_tile - 1, n_q - 1), off_ref)
  # Block tiles that hold a candidate (a block before the current one) of some query of the tile,
  # and those that hold a block of some query's normaliser (up to one block more).
  n_steps = pl.cdiv(t_last // geo.block_size, block_tile)
  n_norm_steps = pl.cdiv((t_last + 1) // geo.block_size, block_tile)
  o_blk = jnp.arange(block_tile)
  scale2 = geo.scale * LOG2E

  def logits(i):
    blk = i * block_tile + o_blk
    rows = (i_b * num_blocks + jnp.minimum(blk, num_blocks - 1)) * geo.hkv + i_h
    # [Q*heads, BT] base-2 logits; Eq. 4 over the blocks complete at t only.
    z2 = scale2 * scoring.summary_logits(b_q, s_ref, rows, blk < num_blocks, geo)
    return blk, jnp.where(blk[None, :] < done_r, z2, -jnp.inf)

  def normaliser(i, carry):
    m, l = carry
    _, z2 = logits(i)
    m_new = jnp.maximum(m, jnp.max(z2, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    l = l * jnp.exp2(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe)) + jnp.sum(
        jnp.exp2(z2 - m_safe), axis=1, keepdims=True)
    return m_new, l

  m0 = jnp.full((tile_rows, 1), -jnp.inf, jnp.float32)
  m, l = lax.fori_loop(0, n_norm_steps, normaliser,
                       (m0, jnp.zeros((tile_rows, 1), jnp.float32)))
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  # l is 0 for a row without complete blocks; NaN must pass (not `l > 0`): on the GPU the max
  # skips a NaN logit (maxnum), and the reference's softmax makes the whole row NaN.
  inv_l = jnp.where(m_r[:, None] & (l != 0), 1.0 / jnp.where(l != 0, l, 1.0), 0.0)
  n_best = geo.top_k - 3
  bp = next_pow2(max(n_best, 1))
  o_best = jnp.arange(bp)[None, :]

  def merge(i, carry):
    best_v, best_i = carry
    blk, z2 = logits(i)
    p = jnp.exp2(z2 - m_safe) * inv_l
    # [Q, BT] group-summed probabilities (Eq. 22 for BSA).
    ps = jnp.sum(jnp.where((e_r[None, :] == o_e[:, None])[:, :, None], p[None, :, :], 0.0), axis=1)
    blk2 = jnp.broadcast_to(blk[None, :], ps.shape)
    # Candidates: past blocks that are not forced (0, cur - 1 and cur are kept anyway).
    m_cand = (blk2 < cur_e) & (blk2 != 0) & (blk2 != cur_e - 1)
    # Ranked by `rank_key`: a NaN probability above every number (a raw NaN compares false).
    cv = jnp.where(m_cand, rank_key(ps), -jnp.inf)

    # Insert while some row has a candidate strictly better than its worst kept entry: the best
    # candidate (lowest block on ties) replaces the worst entry (highest block on ties; earlier
    # tiles hold lower blocks, so an equal newcomer never displaces it). Later tiles rarely beat
    # the running top-(K-3), so this loop usually runs zero or one time.
    def improvable(c):
      best_v, _, cv = c
      gain = (jnp.max(cv, axis=1) > jnp.min(best_v, axis=1)).astype(jnp.int32)
      return jnp.max(gain) > 0

    def insert(c):
      best_v, best_i, cv = c
      m2 = jnp.max(cv, axis=1, keepdims=True)
      i2 = jnp.min(jnp.where(cv == m2, blk2, BIG), axis=1, keepdims=True)
      wv = jnp.min(best_v, axis=1, keepdims=True)
      wi = jnp.max(jnp.where(best_v == wv, best_i, -1), axis=1, keepdims=True)
      # Empty slots share the index BIG: replace exactly one slot.
      ws = jnp.max(jnp.where((best_v == wv) & (best_i == wi), o_best, -1), axis=1, keepdims=True)
      do = m2 > wv
      hit = do & (o_best == ws)
      best_v = jnp.where(hit, m2, best_v)
      best_i = jnp.where(hit, i2, best_i)
      cv = jnp.where(do, jnp.where(blk2 == i2, -jnp.inf, cv), -jnp.inf)
      return best_v, best_i, cv

    best_v, best_i, _ = lax.while_loop(improvable, insert, (best_v, best_i, cv))
    return best_v, best_i

  # Slots past top_k - 3 hold +inf so they are never the worst entry, and no block.
  best_v = jnp.where(o_best < n_best, -jnp.inf, jnp.inf) + jnp.zeros((q_tile, bp), jnp.float32)
  best_i = jnp.full((q_tile, bp), BIG, jnp.int32)
  if n_best > 0:
    best_v, best_i = lax.fori_loop(0, n_steps, merge, (best_v, best_i))
  # Kept set: every eligible block when at most top_k are (blocks 0..cur), else the forced
  # 0, cur - 1, cur plus the running best; then ascending.
  kp = geo.top_k_padded
  o_slot = jnp.arange(kp)[None, :]
  keep_all = cur_e + 1 <= geo.top_k
  # [Q, KP]: slot s < bp holds best_i[:, s] (a one-hot reduction: no concatenation in kernels).
  best_w = jnp.sum(jnp.where(o_slot[:, :, None] == o_best[:, None, :], best_i[:, None, :], 0),
                   axis=2)
  best_w = jnp.where((o_slot < n_best) & (best_w < BIG), best_w, BIG)
  chosen = jnp.where(o_slot == n_best, 0, best_w)
  chosen = jnp.where(o_slot == n_best + 1, cur_e - 1, chosen)
  chosen = jnp.where(o_slot == n_best + 2, cur_e, chosen)
  chosen = jnp.where(keep_all, jnp.where(o_slot <= cur_e, o_slot, BIG), chosen)
  out = topk.sorted_kept(chosen, chosen < BIG, kp)
  m_e = t_e < n_q
  trash = geo.batch * n_q * geo.hkv
  out_rows = jnp.where(m_e, (i_b * n_q + t_e) * geo.hkv + i_h, trash)
  plt.store(out_ref.at[out_rows[:, None], jnp.arange(kp)[None, :]], out)


def select_bsa(q, k, geo: Geometry, *, interpret: bool, config: SelectionConfig, offset=None):
  """BSA over the leaf means of k: int32 `[B*Tq*HKV, KP]`; offset: None, or int32 `[1]`
  (`geo.has_offset`)."""
  b, t, hq, d = q.shape
  leaves = leaf_summaries_pallas(k, block_size=geo.block_size, interpret=interpret,
                                 summary_dtype=geo.spec.summary_dtype)
  q_tile = config.bsa_q_tile
  n_tiles = -(-t // q_tile)
  rows = b * t * geo.hkv
  out = launch(functools.partial(bsa_kernel, geo=geo, q_tile=q_tile,
                                 block_tile=config.bsa_block_tile),
               jax.ShapeDtypeStruct((rows + 1, geo.top_k_padded), jnp.int32),
               b * geo.hkv * n_tiles, config, config.leaf_warps, interpret, "bsa_select",
               q.reshape(-1, d), summary_rows(leaves.reshape(-1, d), geo, q.dtype),
               *offset_input(offset))
  return out[:rows]
