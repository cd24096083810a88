"""The decode selection (Eq. 30-31) in three launches: one program per (batch row, KV head) walks
the pyramid to the leaf candidates, one per (row, KV head, candidate) scores a leaf from its raw
keys, one per (row, KV head) keeps top_k leaves by Select_K; `decode_select_pallas`, which
launches them or the flat BSA kernel, and `decode_append_select_pallas`, a step's append and
selection with the append in the walk's launch (a program of its own beside the walk's); the
launches `decode_step_pallas` shares (`append_walk`, `leaf_scores`, `leaf_select`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import (int32_table, load_rows, next_pow2, pallas_launch, pick,
                                      qk_dot, rank_by_id, rank_by_key, rank_key)
from pisa_jax.kernels.decode.append import append_geometry, append_token, decode_append_pallas
from pisa_jax.kernels.decode.bsa import select_bsa
from pisa_jax.kernels.decode.config import DecodeConfig
from pisa_jax.kernels.decode.layout import (Geometry, load_group_queries, load_scalar,
                                            make_geometry)
from pisa_jax.kernels.decode.scoring import reduce_children, reduce_keys, summary_logits
from pisa_jax.spec import SelectionSpec, takes_spec

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")


def _select_k(cand, valid, forced, score, keep: int, *, may_keep_all: bool = True):
  """Select_K of Eq. 17 with Appendix B's forced nodes: (kept mask, rank). If at most `keep`
  candidates are valid all are kept; otherwise forced ones first, then the highest scores, ties
  to the lower node id (the reference's `_keep`). `may_keep_all=False` where more than `keep`
  are always valid skips counting them."""
  key = rank_key(score)
  if may_keep_all:
    key = jnp.where(jnp.sum(valid.astype(jnp.int32)) <= keep, jnp.inf, key)
  rank = rank_by_key(cand, valid, jnp.where(forced, jnp.inf, key), by_column=True)
  return valid & (rank < keep), rank


def _expand(cand, kept, rank, branching: int, width: int):
  """Eq. 18: the kept node of rank p fills slots p * g .. p * g + g - 1 with its children."""
  if branching == 2:
    # Each rank's node `[width / 2]`, then its two children side by side: half the all-pairs
    # compare of the general form below.
    o_rank = jnp.arange(width // 2)
    hit = kept[None, :] & (rank[None, :] == o_rank[:, None])
    first = jnp.max(jnp.where(hit, cand[None, :] * 2, -1), axis=1)
    second = jnp.where(first >= 0, first + 1, -1)
    return jnp.stack([first, second], axis=-1).reshape(width)
  slot = jnp.arange(width)
  hit = kept[None, :] & (rank[None, :] == (slot // branching)[:, None])
  return jnp.max(jnp.where(hit, cand[None, :] * branching + (slot % branching)[:, None], -1),
                 axis=1)


def kept_ids(cand, kept, order, width: int):
  """The kept ids ascending, -1 padded, `[width]` (`order` from `_common.rank_by_id`)."""
  slot = jnp.arange(width)
  hit = kept[None, :] & (order[None, :] == slot[:, None])
  return jnp.max(jnp.where(hit, cand[None, :], -1), axis=1)


def _current_leaf(pos_ref, i_b, geo: Geometry):
  """The leaf of row i_b's token (its position clamped into the capacity)."""
  return jnp.clip(load_scalar(pos_ref, i_b), 0, geo.capacity - 1) // geo.block_size


def _row(pos_ref, q_ref, i_bh, geo: Geometry):
  """The program's batch row, KV head, current leaf and the group's queries `[Gp, Dp]`."""
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  qg, m_head = load_group_queries(q_ref, i_b, i_h, geo)
  return i_b, i_h, _current_leaf(pos_ref, i_b, geo), qg, m_head


def _walk(qg, m_head, s_ref, tab_ref, i_b, i_h, cur, geo: Geometry):
  """The walk of Eq. 16-18 down to the leaf candidates `[NC]` (-1 padded)."""
  g, nc = geo.branching, geo.num_slots
  num_levels = len(geo.sizes)
  num_nodes = geo.num_nodes
  slot = jnp.arange(nc)
  lp = tab_ref.shape[1]
  o_lvl = jnp.arange(lp)
  offs = plt.load(tab_ref.at[jnp.zeros((lp,), jnp.int32), o_lvl])
  pows = plt.load(tab_ref.at[jnp.ones((lp,), jnp.int32), o_lvl])  # g^(l-1) at index l - 1
  # The walk starts at the highest level with more than `beam` eligible nodes (0 .. cur // g^(l-1)):
  # every level above keeps all of its eligible nodes without a score (Eq. 17's "keep all"), and
  # the start level's eligible nodes, at most g * beam of them, are all candidates. Level 1 when
  # even level 2 has at most beam: the candidates are then the leaves 0 .. cur.
  level_no = o_lvl + 1
  deep = (level_no >= 2) & (level_no <= num_levels) & (cur // pows >= geo.beam)
  start = 1 + jnp.sum(deep.astype(jnp.int32))
  pw0 = pick(pows, start - 1)
  cand0 = jnp.where(slot <= cur // pw0, slot, -1)

  def walk_level(i, carry):
    cand, pw = carry  # pw = g^(level - 1): leaves per node at this level
    level = start - i
    pw_child = pw // g
    off_child = pick(offs, level - 2)
    anc, anc_child = cur // pw, cur // pw_child
    anc_prev = jnp.where(cur >= 1, (cur - 1) // pw, -1)
    # Eligible: the node's first key is at or before t. Forced: an ancestor of the first,
    # previous or current leaf (Appendix B); its score is never used.
    valid = (cand >= 0) & (cand <= anc)
    forced = valid & ((cand == 0) | (cand == anc_prev) | (cand == anc))
    first = jnp.where(valid, cand, 0) * g

    def rows(child):
      return (i_b * num_nodes + off_child + jnp.minimum(child, anc_child)) * geo.hkv + i_h

    masks = [valid & (first + j <= anc_child) for j in range(g)]
    if g == 2:
      # Both children in one gather and one dot (candidate i's at rows 2i, 2i + 1), split after:
      # fewer, larger loads.
      both = jnp.stack([first, first + 1], axis=-1).reshape(2 * nc)
      m_both = jnp.stack([valid, valid], axis=-1).reshape(2 * nc) & (both <= anc_child)
      z = summary_logits(qg, s_ref, rows(both), m_both, geo).reshape(geo.group_padded, nc, 2)
      zs = [jnp.squeeze(part, -1) for part in jnp.split(z, 2, axis=-1)]
    else:
      zs = [summary_logits(qg, s_ref, rows(first + j), m, geo) for j, m in enumerate(masks)]
    per_head = reduce_children(zs, masks, geo.selector, geo.scale)
    # Eq. 22: the group's heads share one selection, scored by their sum.
    score = jnp.sum(jnp.where(m_head[:, None], per_head, 0.0), axis=0)
    # More than beam candidates are valid at every level: the start level has more than beam
    # eligible nodes, and below it the beam kept nodes have g children each, but for the
    # current leaf's ancestor (at least one): g * (beam - 1) + 1 > beam.
    kept, rank = _select_k(cand, valid, forced, score, geo.beam, may_keep_all=False)
    return _expand(cand, kept, rank, g, nc), pw_child

  cand, _ = lax.fori_loop(0, start - 1, walk_level, (cand0, pw0))
  return cand


def _leaf_slots(cand, cur, geo: Geometry):
  """(valid, forced, need) `[NC]` of the leaf candidates: Eq. 21 with l = 1 scores a leaf only
  where Select_K needs it (not forced, and more than top_k eligible)."""
  valid = (cand >= 0) & (cand <= cur)
  forced = valid & ((cand == 0) | (cand == cur - 1) | (cand == cur))
  need = valid & ~forced & (jnp.sum(valid.astype(jnp.int32)) > geo.top_k)
  return valid, forced, need


def _leaf_keys(k_ref, leaf, i_b, i_h, m_load, geo: Geometry):
  """The raw keys `[Cp, Dp]` of leaf `leaf` (a scalar). A scored leaf is complete and before
  the current one: all of its keys exist."""
  key_pos = jnp.minimum(leaf * geo.block_size + jnp.arange(geo.block_padded), geo.capacity - 1)
  rows = (i_b * geo.capacity + key_pos) * geo.hkv + i_h
  return load_rows(k_ref, rows, m_load, geo.d, geo.head_dim_padded)


def _leaf_score(qg, m_head, leaf_keys, geo: Geometry):
  """A leaf's score from its raw keys, summed over the group's heads (Eq. 21, 22)."""
  m_key = jnp.arange(geo.block_padded) < geo.block_size
  z = qk_dot(qg, leaf_keys, geo.inputs_16bit)
  per_head = reduce_keys(z, m_key, geo.selector, geo.scale)
  return jnp.sum(jnp.where(m_head, per_head, 0.0))


def leaf_select(cand, cur, scores, geo: Geometry):
  """Select_K of the leaf candidates `[NC]` of a row whose current leaf is `cur`, from their
  scores `[NC]` (`_leaf_kernel`'s): (kept mask, each kept leaf's slot in ascending id order)."""
  valid, forced, need = _leaf_slots(cand, cur, geo)
  kept, _ = _select_k(cand, valid, forced, jnp.where(need, scores, 0.0), geo.top_k)
  return kept, rank_by_id(cand, kept, by_column=True)


# The selection is three launches, so that at small B the leaves' key loads (up to NC - 3 leaves
# of C keys each) spread over many SMs: one program per (row, KV head) scored them one after the
# other, serialised on one SM (slower in every sweep; WORKSPACE.md, "Tried and dropped").


def _walk_kernel(pos_ref, q_ref, s_ref, tab_ref, cand_ref, *, geo: Geometry):
  """Launch 1, per (row, KV head): the walk; writes the leaf candidates `[NC]`."""
  _walk_program(pl.program_id(0), pos_ref, q_ref, s_ref, tab_ref, cand_ref, geo)


def _walk_program(i_bh, pos_ref, q_ref, s_ref, tab_ref, cand_ref, geo: Geometry):
  i_b, i_h, cur, qg, m_head = _row(pos_ref, q_ref, i_bh, geo)
  cand_ref[pl.ds(i_bh, 1), :] = _walk(qg, m_head, s_ref, tab_ref, i_b, i_h, cur, geo)[None, :]


def _append_walk_kernel(pos_ref, kn_ref, vn_ref, q_ref, k_ref, v_ref, s_ref, tab_ref, ko_ref,
                        vo_ref, so_ref, cand_ref, *, geo: Geometry, append: dict):
  """Launch 1 of a whole step, program (row x KV head, role): role 0 the append, role 1 the walk,
  side by side on two SMs (the append's O(log N) chain of loads ran before the walk in one
  program). The walk need not see the append's writes: they are the current leaf and its
  ancestors, all forced at every level (their scores, whatever a racing read gives, are never
  used), and a non-forced candidate's children are not ancestors of the current leaf. Only the
  append program writes its (row, KV head)'s cache rows."""
  # Program ids are read outside the branches (interpret mode lowers none inside a `when`).
  i_bh, role = pl.program_id(0), pl.program_id(1)

  @pl.when(role == 0)
  def _():
    append_token(i_bh, pos_ref, kn_ref, vn_ref, k_ref, v_ref, s_ref, ko_ref, vo_ref, so_ref,
                 **append)

  @pl.when(role == 1)
  def _():
    _walk_program(i_bh, pos_ref, q_ref, s_ref, tab_ref, cand_ref, geo)


def _leaf_kernel(pos_ref, q_ref, k_ref, cand_ref, score_ref, *, geo: Geometry):
  """Launch 2, per (row, KV head, candidate slot): the slot's leaf score from its raw keys (0
  where Select_K needs none; its keys are then not loaded)."""
  i_bh, i_slot = pl.program_id(0), pl.program_id(1)
  i_b, i_h, cur, qg, m_head = _row(pos_ref, q_ref, i_bh, geo)
  cand = cand_ref[pl.ds(i_bh, 1), :].reshape(geo.num_slots)
  _, _, need = _leaf_slots(cand, cur, geo)
  hit = need & (jnp.arange(geo.num_slots) == i_slot)
  live = jnp.sum(hit.astype(jnp.int32)) > 0
  m_key = (jnp.arange(geo.block_padded) < geo.block_size) & live
  leaf_keys = _leaf_keys(k_ref, jnp.sum(jnp.where(hit, cand, 0)), i_b, i_h, m_key, geo)
  score = jnp.where(live, _leaf_score(qg, m_head, leaf_keys, geo), 0.0)
  score_ref[pl.ds(i_bh, 1), pl.ds(i_slot, 1)] = jnp.broadcast_to(score, (1, 1))


def _final_kernel(pos_ref, cand_ref, score_ref, out_ref, *, geo: Geometry):
  """Launch 3, per (row, KV head): Select_K over the scored candidates."""
  i_bh = pl.program_id(0)
  cand = cand_ref[pl.ds(i_bh, 1), :].reshape(geo.num_slots)
  scores = score_ref[pl.ds(i_bh, 1), :].reshape(geo.num_slots)
  kept, order = leaf_select(cand, _current_leaf(pos_ref, i_bh // geo.hkv, geo), scores, geo)
  out_ref[pl.ds(i_bh, 1), :] = kept_ids(cand, kept, order, geo.top_k_padded)[None, :]


def _launch_opts(config: DecodeConfig, interpret: bool, *, walk: bool = False) -> dict:
  warps = (config.walk_warps or config.select_warps) if walk else config.select_warps
  return dict(warps=warps, stages=config.num_stages, interpret=interpret)


def leaf_scores(positions, q_rows, k_rows, cand, geo: Geometry, config: DecodeConfig,
                interpret: bool):
  """Launch 2 after the walk's candidates `[B * HKV, NC]`: their scores `[B * HKV, NC]`."""
  rows = geo.batch * geo.hkv
  return pallas_launch(functools.partial(_leaf_kernel, geo=geo),
                       jax.ShapeDtypeStruct((rows, geo.num_slots), jnp.float32),
                       (rows, geo.num_slots),
                       name=f"pisa_decode_select_{geo.selector}_leaves",
                       **_launch_opts(config, interpret))(positions, q_rows, k_rows, cand)


def _scored_leaves(positions, q_rows, k_rows, cand, geo: Geometry, config: DecodeConfig,
                   interpret: bool):
  """Launches 2 and 3 after the walk's candidates `[B * HKV, NC]`: the leaf ids `[B * HKV, KP]`."""
  scores = leaf_scores(positions, q_rows, k_rows, cand, geo, config, interpret)
  return pallas_launch(functools.partial(_final_kernel, geo=geo),
                       jax.ShapeDtypeStruct((geo.batch * geo.hkv, geo.top_k_padded), jnp.int32),
                       (geo.batch * geo.hkv,), name=f"pisa_decode_select_{geo.selector}_final",
                       **_launch_opts(config, interpret))(positions, cand, scores)


def _level_table(geo: Geometry, branching: int):
  """int32 `[2, LP]`: each level's row offset and g^(l-1), padded to a power of two."""
  lp = next_pow2(len(geo.sizes) + 1)
  return int32_table([list(geo.offsets) + [0] * (lp - len(geo.sizes)),
                      [branching ** i if i < len(geo.sizes) else 1 for i in range(lp)]],
                     "the decode level table")


def prepare(q, k_cache, summaries, spec: SelectionSpec, config: DecodeConfig | None):
  """The static geometry and the config of a selection (the selector and the pyramid's dtype
  checked)."""
  if spec.selector not in SELECTORS:
    raise ValueError(f"selector={spec.selector!r} has no decode kernel: expected one of "
                     f"{SELECTORS}")
  if summaries.dtype.name != spec.summary_dtype:
    raise ValueError(f"summaries.dtype={summaries.dtype.name} must be "
                     f"spec.summary_dtype={spec.summary_dtype!r}")
  geo = make_geometry(q, k_cache, spec)
  return geo, config or DecodeConfig.default(head_dim=q.shape[-1], candidate_slots=geo.num_slots)


@takes_spec
def decode_select_pallas(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    spec: SelectionSpec,
    interpret: bool,
    config: DecodeConfig | None = None,
) -> Int[Array, "B HKV K"]:
  """Kernel twin of `decode_select_reference`: the leaf blocks of the token at `positions`
  (already appended), int32 `[B, HKV, top_k]`, ascending, -1 padded. spec: the selection
  (`SelectionSpec`, or its fields as keywords), its block size and branching the cache's."""
  geo, config = prepare(q, k_cache, summaries, spec, config)
  selector, top_k = spec.selector, spec.top_k
  b, _, d = q.shape
  hkv = k_cache.shape[2]
  rows = (q.reshape(-1, d), k_cache.reshape(-1, d), summaries.reshape(-1, d))
  positions = positions.astype(jnp.int32)
  if selector == "bsa":
    out = select_bsa(positions, rows[0], rows[2], geo, config, interpret)
  else:
    cand = pallas_launch(functools.partial(_walk_kernel, geo=geo),
                         jax.ShapeDtypeStruct((b * hkv, geo.num_slots), jnp.int32), (b * hkv,),
                         name=f"pisa_decode_select_{selector}_walk",
                         **_launch_opts(config, interpret, walk=True))(
                             positions, rows[0], rows[2], _level_table(geo, spec.branching))
    out = _scored_leaves(positions, rows[0], rows[1], cand, geo, config, interpret)
  return out[:, :top_k].reshape(b, hkv, top_k)


@takes_spec
def decode_append_select_pallas(
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
  """Kernel twin of `decode_append_select_reference`: `decode_append_pallas` then
  `decode_select_pallas`, the append run in the walk's launch (one launch fewer per step).

  Returns:
    (k_cache, v_cache, summaries, indices): the caches as `decode_append_pallas` returns them
    (in place when donated), indices as `decode_select_pallas`.
  """
  if spec.selector == "bsa":
    # BSA's one kernel scans every leaf, the current one included: it needs the append first.
    k_cache, v_cache, summaries = decode_append_pallas(
        k_new, v_new, k_cache, v_cache, summaries, positions, block_size=spec.block_size,
        branching=spec.branching, interpret=interpret, config=config)
    idx = decode_select_pallas(q, k_cache, summaries, positions, spec=spec, interpret=interpret,
                               config=config)
    return k_cache, v_cache, summaries, idx
  top_k = spec.top_k
  geo, config = prepare(q, k_cache, summaries, spec, config)
  positions = positions.astype(jnp.int32)
  q_rows = q.reshape(-1, q.shape[-1])
  k_rows, v_rows, s_rows, cand = append_walk(q_rows, k_new, v_new, k_cache, v_cache, summaries,
                                             positions, geo, config, interpret)
  out = _scored_leaves(positions, q_rows, k_rows, cand, geo, config, interpret)
  return (k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape),
          s_rows.reshape(summaries.shape), out[:, :top_k].reshape(geo.batch, geo.hkv, top_k))


def append_walk(q_rows, k_new, v_new, k_cache, v_cache, summaries, positions, geo: Geometry,
                config: DecodeConfig, interpret: bool):
  """Launch 1 of a step: the append and the walk. Returns the caches as rows `[*, D]` (in place
  when donated) and the leaf candidates `[B * HKV, NC]`."""
  d = geo.d
  caches = (k_cache.reshape(-1, d), v_cache.reshape(-1, d), summaries.reshape(-1, d))
  kernel = functools.partial(_append_walk_kernel, geo=geo,
                             append=append_geometry(k_cache, summaries, geo.block_size,
                                                    geo.branching))
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in caches]
  return pallas_launch(
      kernel, shapes + [jax.ShapeDtypeStruct((geo.batch * geo.hkv, geo.num_slots), jnp.int32)],
      (geo.batch * geo.hkv, 2), name=f"pisa_decode_select_{geo.selector}_append_walk",
      aliases={4: 0, 5: 1, 6: 2}, **_launch_opts(config, interpret, walk=True))(
          positions, k_new.astype(k_cache.dtype).reshape(-1, d),
          v_new.astype(v_cache.dtype).reshape(-1, d), q_rows, *caches,
          _level_table(geo, geo.branching))
