"""A whole decode step in four launches (the walk selectors): append + walk, the leaf scores,
Select_K of the leaves fused with the split-K attention, whose programs also write the step's
indices and the rows' new lengths and poison a row past capacity, then the merge kernel. BSA
composes its own append + select with the attention kernel.

Each dependent launch costs device time however little it does: with a separate Select_K
launch, XLA's merge and its small fusions for the past-capacity rows and the lengths, a step was
eight kernels; it is these four and one copy. Every attention program of a (row, KV head) ranks
the same candidates (an `[NC, NC]` compare), so Select_K's answer needs no launch of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import pallas_launch
from pisa_jax.kernels.decode.attention import (attend, decode_attention_pallas, merge_splits,
                                               partial_shapes, split_plan, store_partials)
from pisa_jax.kernels.decode.config import DecodeConfig
from pisa_jax.kernels.decode.layout import Geometry, load_group_queries, load_scalar
from pisa_jax.kernels.decode.select import (append_walk, decode_append_select_pallas, kept_ids,
                                            leaf_scores, leaf_select, prepare)
from pisa_jax.spec import SelectionSpec, takes_spec


def _select_attend_kernel(pos_ref, q_ref, k_ref, v_ref, cand_ref, score_ref, o_ref, m_ref,
                          l_ref, idx_ref, len_ref, *, geo: Geometry, blocks: int, splits: int):
  """Program (batch row x KV head, split): Select_K of the row's leaf candidates `[NC]` from
  their scores, then `attend` over the split's share of the kept leaves in ascending order (the
  order of the indices, so the sums are those of the separate kernels). Split 0 writes the
  indices `[KP]` (-1 for a row past capacity), split 0 of KV head 0 the row's length + 1; a row
  past capacity writes a NaN sum, which the merge turns into a NaN output."""
  i_bh, i_s = pl.program_id(0), pl.program_id(1)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  pos = load_scalar(pos_ref, i_b)
  t = jnp.clip(pos, 0, geo.capacity - 1)
  cand = cand_ref[pl.ds(i_bh, 1), :].reshape(geo.num_slots)
  scores = score_ref[pl.ds(i_bh, 1), :].reshape(geo.num_slots)
  kept, order = leaf_select(cand, t // geo.block_size, scores, geo)

  def block_at(slot):
    hit = kept & (order == slot)
    return jnp.sum(jnp.where(hit, cand, 0)), jnp.sum(hit.astype(jnp.int32)) > 0

  qg, _ = load_group_queries(q_ref, i_b, i_h, geo)
  m, l, acc = attend(block_at, qg, k_ref, v_ref, i_b, i_h, t, i_s * blocks, geo=geo,
                     blocks=blocks)
  over = pos >= geo.capacity
  store_partials(o_ref, m_ref, l_ref, i_bh * splits + i_s, m, jnp.where(over, jnp.nan, l), acc)

  @pl.when(i_s == 0)
  def _():
    ids = kept_ids(cand, kept, order, geo.top_k_padded)
    idx_ref[pl.ds(i_bh, 1), :] = jnp.where(over, -1, ids)[None, :]

  @pl.when((i_s == 0) & (i_h == 0))
  def _():
    len_ref[pl.ds(i_b, 1), :] = jnp.broadcast_to(pos + 1, (1, 1))


@takes_spec
def decode_step_pallas(
    q: Float[Array, "B HQ D"],
    k_new: Float[Array, "B HKV D"],
    v_new: Float[Array, "B HKV D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    spec: SelectionSpec,
    interpret: bool,
    config: DecodeConfig | None = None,
):
  """Kernel twin of `decode_step_reference`: append, select and attend for the tokens at
  `positions`. Returns (k_cache, v_cache, summaries, indices `[B, HKV, top_k]`, output
  `[B, HQ, D]` in q's dtype, lengths `[B]` = positions + 1); a row past capacity gets -1
  indices, a NaN output and its caches unchanged. spec: the selection (`SelectionSpec`, or its
  fields as keywords), its block size and branching the cache's."""
  b = q.shape[0]
  selector, top_k = spec.selector, spec.top_k
  positions = positions.astype(jnp.int32)
  if selector == "bsa":
    k_cache, v_cache, summaries, idx = decode_append_select_pallas(
        q, k_new, v_new, k_cache, v_cache, summaries, positions, spec=spec, interpret=interpret,
        config=config)
    out = decode_attention_pallas(q, k_cache, v_cache, idx, positions, block_size=spec.block_size,
                                  scale=spec.scale, interpret=interpret, config=config)
    over = positions >= k_cache.shape[1]
    return (k_cache, v_cache, summaries, jnp.where(over[:, None, None], -1, idx),
            jnp.where(over[:, None, None], jnp.asarray(jnp.nan, out.dtype), out), positions + 1)
  geo, config = prepare(q, k_cache, summaries, spec, config)
  q_rows = q.reshape(-1, geo.d)
  k_rows, v_rows, s_rows, cand = append_walk(q_rows, k_new, v_new, k_cache, v_cache, summaries,
                                             positions, geo, config, interpret)
  scores = leaf_scores(positions, q_rows, k_rows, cand, geo, config, interpret)
  blocks, splits = split_plan(geo, config)
  bh = b * geo.hkv
  o, m, l, idx, lengths = pallas_launch(
      functools.partial(_select_attend_kernel, geo=geo, blocks=blocks, splits=splits),
      partial_shapes(geo, splits) + [jax.ShapeDtypeStruct((bh, geo.top_k_padded), jnp.int32),
                                     jax.ShapeDtypeStruct((b, 1), jnp.int32)],
      (bh, splits), warps=config.attend_warps, stages=config.num_stages, interpret=interpret,
      name=f"pisa_decode_{selector}_select_attend")(positions, q_rows, k_rows, v_rows, cand,
                                                    scores)
  return (k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape),
          s_rows.reshape(summaries.shape), idx[:, :top_k].reshape(b, geo.hkv, top_k),
          merge_splits(o, m, l, geo, splits, q.dtype, interpret=interpret), lengths.reshape(b))
