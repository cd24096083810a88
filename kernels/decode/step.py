"""A whole decode step in three launches: `decode_step_pallas`.

1. the append and the walk (`select.append_walk`), one program per (batch row, KV head);
2. one program per (row, KV head, candidate leaf): the leaf's score from its raw keys where
   Select_K needs it (Eq. 21 with l = 1) and, from the same dot, the leaf's attention partial
   (Eq. 6 over its keys j <= t: running max m, sum l and unnormalised output o, base 2);
3. one program per (row, KV head): Select_K of the leaves (Eq. 17), then the log-sum-exp merge of
   the kept leaves' partials, written in q's dtype.

Every leaf the final Select_K can keep is a candidate of launch 2, so the partials it merges are
exactly split-K flash-decoding over the selected blocks with one block per split. Launch 2 reads
each candidate's values as well as its keys; the separate attention kernel read the kept leaves'
keys and values again, and its merge ran as XLA fusions: this way a step is three launches, not
four plus the merge (H200 figures in WORKSPACE.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pisa_jax.kernels.decode.attention import decode_attention_pallas, weighted_values
from pisa_jax.kernels.decode.config import DecodeConfig
from pisa_jax.kernels.decode.layout import Geometry, launch, load_row, load_rows, load_scalar
from pisa_jax.kernels.decode.scoring import LOG2E, dot_t, reduce_keys
from pisa_jax.kernels.decode.select import (_launch_opts, _leaf_slots, _prepare, _row,
                                            _select_k, _sorted_ids, append_walk,
                                            decode_append_select_pallas)


def _leaf_attend_kernel(pos_ref, q_ref, k_ref, v_ref, cand_ref, score_ref, o_ref, m_ref, l_ref,
                        *, geo: Geometry):
  """Launch 2, per (row, KV head, candidate slot): the slot's leaf score (0 where Select_K needs
  none) and its attention partial: o `[Gp, Dp]`, m and l `[Gp]` (m = -inf, l = 0, o = 0 for an
  empty slot; no key or value is loaded for it)."""
  c = geo.block_size
  i_bh, i_slot = pl.program_id(0), pl.program_id(1)
  i_b, i_h, cur, qg, m_head = _row(pos_ref, q_ref, i_bh, geo)
  t = jnp.clip(load_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  cand = cand_ref[pl.ds(i_bh, 1), :].reshape(geo.nc)
  valid, _, need = _leaf_slots(cand, cur, geo)
  hit = jnp.arange(geo.nc) == i_slot
  live = jnp.sum((hit & valid).astype(jnp.int32)) > 0
  scored = jnp.sum((hit & need).astype(jnp.int32)) > 0
  leaf = jnp.clip(jnp.sum(jnp.where(hit, cand, 0)), 0, cur)
  o_key = jnp.arange(geo.cp)
  in_block = o_key < c
  key_pos = leaf * c + o_key
  visible = live & in_block & (key_pos <= t)
  rows = (i_b * geo.capacity + jnp.minimum(key_pos, geo.capacity - 1)) * geo.hkv + i_h
  keys = load_rows(k_ref, rows, visible, geo.d, geo.dp)
  vals = load_rows(v_ref, rows, visible, geo.d, geo.dp)
  z = dot_t(qg, keys, geo.key_mode)  # [Gp, Cp], unscaled
  # A scored leaf is complete and before the current one: all of its keys are visible, and its
  # score is the selection kernels' (Eq. 21 / 33 / 34 summed over the group's heads, Eq. 22).
  per_head = reduce_keys(z, in_block, geo.selector, geo.scale)
  score = jnp.where(scored, jnp.sum(jnp.where(m_head, per_head, 0.0)), 0.0)
  s = jnp.where(visible[None, :], z * (geo.scale * LOG2E), -jnp.inf)
  m = jnp.max(s, axis=1)
  p = jnp.exp2(s - jnp.where(m == -jnp.inf, 0.0, m)[:, None])
  row = i_bh * geo.nc + i_slot
  score_ref[pl.ds(i_bh, 1), pl.ds(i_slot, 1)] = jnp.broadcast_to(score, (1, 1))
  o_ref[pl.ds(row * geo.gp, geo.gp), :] = weighted_values(p, vals, geo.key_mode)
  m_ref[pl.ds(row, 1), :] = m[None, :]
  l_ref[pl.ds(row, 1), :] = jnp.sum(p, axis=1)[None, :]


def _final_merge_kernel(pos_ref, cand_ref, score_ref, o_ref, m_ref, l_ref, idx_ref, out_ref, *,
                        geo: Geometry):
  """Launch 3, per (row, KV head): Select_K over the scored candidates (their ids ascending into
  idx `[1, KP]`), then the kept leaves' partials merged by log-sum-exp into out `[Gp, Dp]`. A row
  past capacity (its token dropped) gets -1 ids and NaN outputs."""
  i_bh = pl.program_id(0)
  i_b = i_bh // geo.hkv
  pos = load_scalar(pos_ref, i_b)
  cur = jnp.clip(pos, 0, geo.capacity - 1) // geo.block_size
  over = pos >= geo.capacity
  cand = cand_ref[pl.ds(i_bh, 1), :].reshape(geo.nc)
  scores = score_ref[pl.ds(i_bh, 1), :].reshape(geo.nc)
  valid, forced, need = _leaf_slots(cand, cur, geo)
  kept, _ = _select_k(cand, valid, forced, jnp.where(need, scores, 0.0), geo.top_k)
  idx_ref[pl.ds(i_bh, 1), :] = jnp.where(over, -1, _sorted_ids(cand, kept, geo.kp))[None, :]
  # Two passes, as the reference's softmax: the kept partials' max first, then the weighted sums.
  first = i_bh * geo.nc
  m = jnp.where(kept[:, None], m_ref[pl.ds(first, geo.nc), :], -jnp.inf)  # [NC, Gp]
  m_all = jnp.max(m, axis=0)
  m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  o_head = jnp.arange(geo.gp)
  # The kept mask as bits of int32 words, so that the loop reads slot i's flag with a shift, not
  # a reduction over the slots per iteration.
  slot = jnp.arange(geo.nc)
  words = [jnp.sum(jnp.where(kept & ((slot >> 5) == w), jnp.left_shift(1, slot & 31), 0))
           for w in range(-(-geo.nc // 32))]

  def body(i, carry):
    total, acc = carry
    word = words[0]
    for w in range(1, len(words)):
      word = jnp.where((i >> 5) == w, words[w], word)
    keep_i = (jnp.right_shift(word, i & 31) & 1) == 1
    m_i = load_row(m_ref, first + i, keep_i, geo.gp, geo.gp)
    l_i = load_row(l_ref, first + i, keep_i, geo.gp, geo.gp)
    w = jnp.where(keep_i & (m_i != -jnp.inf), jnp.exp2(m_i - m_all), 0.0)
    o_i = load_rows(o_ref, (first + i) * geo.gp + o_head, keep_i & (o_head >= 0), geo.dp,
                    geo.dp)
    return total + w * l_i, acc + w[:, None] * o_i

  total, acc = lax.fori_loop(0, geo.nc, body, (jnp.zeros((geo.gp,), jnp.float32),
                                               jnp.zeros((geo.gp, geo.dp), jnp.float32)))
  # != 0 rather than > 0: a NaN total (a NaN key it saw) must reach the output, not zero it.
  out = jnp.where(total[:, None] != 0, acc / jnp.where(total != 0, total, 1.0)[:, None], 0.0)
  out = jnp.where(over, jnp.nan, out)
  out_ref[pl.ds(i_bh * geo.gp, geo.gp), :] = out.astype(out_ref.dtype)


def decode_step_pallas(
    q: Float[Array, "B HQ D"],
    k_new: Float[Array, "B HKV D"],
    v_new: Float[Array, "B HKV D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    branching: int,
    top_k: int,
    beam: int,
    selector: str,
    scale: float,
    interpret: bool,
    config: DecodeConfig | None = None,
):
  """Kernel twin of `decode_step_reference`: append, select and attend for the token at
  `positions` in three launches (BSA: its append, its scan, the attention kernel).

  Returns:
    (k_cache, v_cache, summaries, indices, out): the caches as `decode_append_pallas` returns
    them (in place when donated), indices int32 `[B, HKV, top_k]` as `decode_select_pallas`, out
    `[B, HQ, D]` in q's dtype; a row at or past capacity gets -1 indices and NaN outputs.
  """
  b, hq, d = q.shape
  capacity = k_cache.shape[1]
  positions = positions.astype(jnp.int32)
  opts = dict(block_size=block_size, branching=branching, top_k=top_k, beam=beam,
              selector=selector, scale=scale, interpret=interpret, config=config)
  if selector == "bsa":
    k_cache, v_cache, summaries, idx = decode_append_select_pallas(
        q, k_new, v_new, k_cache, v_cache, summaries, positions, **opts)
    out = decode_attention_pallas(q, k_cache, v_cache, idx, positions, block_size=block_size,
                                  scale=scale, interpret=interpret, config=config)
    over = (positions >= capacity)[:, None, None]
    return (k_cache, v_cache, summaries, jnp.where(over, -1, idx),
            jnp.where(over, jnp.asarray(jnp.nan, out.dtype), out))
  geo, config = _prepare(q, k_cache, block_size=block_size, branching=branching, top_k=top_k,
                         beam=beam, selector=selector, scale=scale, config=config)
  q_rows, k_rows, v_rows, s_rows, cand = append_walk(
      q, k_new, v_new, k_cache, v_cache, summaries, positions, geo=geo, config=config,
      interpret=interpret)
  rows = b * geo.hkv
  launch_opts = _launch_opts(config, interpret)
  name = f"pisa_decode_step_{selector}"
  f32 = jnp.float32
  partials = launch(
      functools.partial(_leaf_attend_kernel, geo=geo),
      [jax.ShapeDtypeStruct((rows, geo.nc), f32),
       jax.ShapeDtypeStruct((rows * geo.nc * geo.gp, geo.dp), f32),
       jax.ShapeDtypeStruct((rows * geo.nc, geo.gp), f32),
       jax.ShapeDtypeStruct((rows * geo.nc, geo.gp), f32)],
      (rows, geo.nc), name=name + "_leaves", **launch_opts)(
          positions, q_rows, k_rows, v_rows, cand)
  idx, out = launch(
      functools.partial(_final_merge_kernel, geo=geo),
      [jax.ShapeDtypeStruct((rows, geo.kp), jnp.int32),
       jax.ShapeDtypeStruct((rows * geo.gp, geo.dp), q.dtype)],
      (rows,), name=name + "_final", **launch_opts)(positions, cand, *partials)
  out = out.reshape(b, geo.hkv, geo.gp, geo.dp)[:, :, :geo.group, :d].reshape(b, hq, d)
  return (k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape),
          s_rows.reshape(summaries.shape), idx[:, :top_k].reshape(b, geo.hkv, top_k), out)
