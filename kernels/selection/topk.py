"""Select_K inside the kernels (Eq. 17 with the forced-node rule of Appendix B) and the Eq. 18
expansion of kept nodes to their children, without sorts.

Three forms with the same result: "passes" (`keep` dependent passes of max / lowest-index
argmax), "rank" (one broadcast compare `[..., N, N]` and one sum give every candidate its rank in
(score descending, node id ascending)) and "rank_folded", the rank with fewer instructions per
compared pair for wide candidate sets (validity folded into the ranking key, Eq. 18's expansion
from `N / g` parent slots). Reductions run over the last axis, so every helper works on `[N]` and
`[rows, N]`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pisa_jax.kernels._common import BIG, pair_axes, rank_by_id, rank_by_key, rank_key
from pisa_jax.kernels.selection.layout import Geometry


def ancestors(cur, leaves_per_node, shift=None):
  """The ancestors (nodes of `leaves_per_node` leaves) of the current leaf and of the previous
  one (-1 when cur = 0). With `shift` = log2(leaves_per_node) (g a power of two) a shift: a
  division by a runtime value is ~20 SASS instructions."""
  prev = jnp.maximum(cur - 1, 0)
  if shift is not None:
    anc_cur, anc_prev = cur >> shift, prev >> shift
  else:
    anc_cur, anc_prev = cur // leaves_per_node, prev // leaves_per_node
  return anc_cur, jnp.where(cur >= 1, anc_prev, -1)


def forced_nodes(cand, cur, leaves_per_node, shift=None):
  """Ancestors (nodes of `leaves_per_node` leaves) of the first, previous and current leaves
  (Appendix B)."""
  anc_cur, anc_prev = ancestors(cur, leaves_per_node, shift)
  return (cand == 0) | (cand == anc_prev) | (cand == anc_cur)


def top_mask(cand, valid, forced, score, keep: int):
  """Select_K of Eq. 17 with the forced-node rule by passes: which candidates are kept, bool.

  If at most `keep` candidates are valid all are kept; otherwise forced ones first, then NaN scores,
  then the highest scores (`rank_key`), ties to the lower node id.
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  key = rank_key(score, forced | keep_all)

  # A loop, not an unrolled Python loop: Triton compile time grows with the unrolled code.
  def pick_one(_, taken):
    avail = valid & ~taken
    k_avail = jnp.where(avail, key, -jnp.inf)
    best = jnp.max(k_avail, axis=-1, keepdims=True)
    pick = jnp.min(jnp.where(avail & (k_avail == best), cand, BIG), axis=-1, keepdims=True)
    return taken | (avail & (cand == pick))

  return lax.fori_loop(0, keep, pick_one, jnp.zeros(cand.shape, jnp.bool_))


def sorted_kept(cand, taken, width: int):
  """The kept node ids ascending, -1 padded: `[..., N]` -> `[..., width]`."""
  out = jnp.full(cand.shape[:-1] + (width,), -1, jnp.int32)
  slot = lax.broadcasted_iota(jnp.int32, out.shape, out.ndim - 1)

  def next_smallest(r, carry):
    out, prev = carry
    nxt = jnp.min(jnp.where(taken & (cand > prev), cand, BIG), axis=-1, keepdims=True)
    out = jnp.where((slot == r) & (nxt < BIG), nxt, out)
    return out, jnp.where(nxt < BIG, nxt, prev)

  prev = jnp.full(cand.shape[:-1] + (1,), -1, jnp.int32)
  return lax.fori_loop(0, width, next_smallest, (out, prev))[0]


def keep_and_expand(cand, valid, forced, score, keep: int, branching: int, width: int):
  """Select_K of Eq. 17 (as `top_mask`) fused with the Eq. 18 expansion: `[N]` -> `[width]`.

  The node picked by pass p fills slots p * g .. p * g + g - 1 with its children as it is picked,
  so no separate compaction loop runs (one max and one min reduction per kept node). The slot
  order (by rank) does not matter: the next level's Select_K is order-free and the leaves are
  sorted at the end.
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  key = rank_key(score, forced | keep_all)
  slot = jnp.arange(width)
  o_parent, o_child = slot // branching, slot % branching

  def pick_one(p, carry):
    taken, out = carry
    avail = valid & ~taken
    k_avail = jnp.where(avail, key, -jnp.inf)
    best = jnp.max(k_avail, axis=-1, keepdims=True)
    pick = jnp.min(jnp.where(avail & (k_avail == best), cand, BIG), axis=-1, keepdims=True)
    out = jnp.where((o_parent == p) & (pick < BIG), pick * branching + o_child, out)
    return taken | (avail & (cand == pick)), out

  init = (jnp.zeros(cand.shape, jnp.bool_), jnp.full((width,), -1, jnp.int32))
  return lax.fori_loop(0, min(keep, width // branching), pick_one, init)[1]


def rank_keep(cand, valid, forced, score, keep: int, by_column: bool = False):
  """Select_K of Eq. 17 with the forced-node rule, by rank: `[..., N]` -> (kept, rank).

  The same set as `top_mask`: the order is `rank_key` descending (forced nodes, and every node when
  at most `keep` are valid, count as +inf) with ties to the lower node id, a strict total order on
  the valid candidates (their ids are distinct). rank_i = #{valid j before i in that order}
  (`_common.rank_by_key`), so the valid ranks are 0..n_valid-1 and the kept nodes are those
  ranked below `keep`.

  by_column: candidate i is the compare's column and the sum runs down the rows (axis -2), so the
  rank comes out in the layout of a row vector `[..., None, :]`, the one `expand_rank` broadcasts
  it in; summed along the rows instead, Triton converts it between the two layouts. Same ranks,
  fewer instructions and registers in the fused kernel's walk level (offline SASS).
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  rank = rank_by_key(cand, valid, rank_key(score, forced | keep_all), by_column)
  return valid & (rank < keep), rank


def sorted_kept_rank(cand, taken, width: int, by_column: bool = False):
  """`sorted_kept` in one pass: a kept node's output slot is its rank by node id among the kept
  (ids are distinct), read back with a one-hot max. `[..., N]` -> `[..., width]`, -1 padded.
  by_column: as in `rank_keep`, the position comes out in the layout it is read back in."""
  pos = rank_by_id(cand, taken, by_column)
  slot = lax.broadcasted_iota(jnp.int32, cand.shape[:-1] + (width, 1), cand.ndim - 1)
  hit = taken[..., None, :] & (pos[..., None, :] == slot)
  return jnp.max(jnp.where(hit, cand[..., None, :], -1), axis=-1)


def expand_rank(cand, taken, rank, branching: int, width: int):
  """Eq. 18 by rank: kept node of rank p fills slots p * g .. p * g + g - 1 with its children, so
  no compaction loop runs. `[N]` -> `[width]` candidate ids (-1 empty)."""
  slot = jnp.arange(width)
  o_parent, o_child = slot // branching, slot % branching
  hit = taken[None, :] & (rank[None, :] == o_parent[:, None])
  return jnp.max(jnp.where(hit, cand[None, :] * branching + o_child[:, None], -1), axis=1)


def rank_keep_folded(cand, valid, forced, score, keep: int, by_column: bool = False):
  """`rank_keep` with validity folded into the ranking key: (kept, rank), the same kept set.

  An invalid candidate's key is -inf, below every valid key (`rank_key` clamps numbers to
  +-SCORE_LIMIT and forced nodes are +inf), so a valid candidate's rank counts only valid ones
  without a validity term per compared pair; an invalid candidate's rank is meaningless and it
  is never kept. One test fewer per pair of the `[..., N, N]` compare, which is most of a wide
  walk level's instructions (NC = 64: 4,096 pairs against 64 candidates' dots).
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  key = jnp.where(valid, rank_key(score, forced | keep_all), -jnp.inf)
  as_i, as_j, over_j = pair_axes(by_column)
  k_i, k_j, c_i, c_j = as_i(key), as_j(key), as_i(cand), as_j(cand)
  before = (k_j > k_i) | ((k_j == k_i) & (c_j < c_i))
  rank = jnp.sum(before.astype(jnp.int32), axis=over_j)
  return valid & (rank < keep), rank


def sorted_kept_folded(cand, taken, width: int, by_column: bool = False):
  """`sorted_kept_rank` with the kept mask folded into the ids (a dropped candidate counts as
  BIG, after every id): one compare per pair for each kept node's output slot."""
  as_i, as_j, over_j = pair_axes(by_column)
  ids = jnp.where(taken, cand, BIG)
  pos = jnp.sum((as_j(ids) < as_i(cand)).astype(jnp.int32), axis=over_j)
  slot = lax.broadcasted_iota(jnp.int32, cand.shape[:-1] + (width, 1), cand.ndim - 1)
  hit = taken[..., None, :] & (pos[..., None, :] == slot)
  return jnp.max(jnp.where(hit, cand[..., None, :], -1), axis=-1)


def expand_pairs(cand, taken, rank, width: int):
  """`expand_rank` at g = 2 from `width / 2` parent slots: the kept node of rank p is found with
  one compare per (parent slot, candidate), half of `expand_rank`'s (output slot, candidate)
  grid, then its children 2 c and 2 c + 1 fill slots 2 p and 2 p + 1 (the same layout).
  `[N]` -> `[width]` candidate ids (-1 empty)."""
  ranked = jnp.where(taken, rank, -1)
  hit = ranked[None, :] == jnp.arange(width // 2)[:, None]
  parent = jnp.max(jnp.where(hit, cand[None, :], -1), axis=1)
  first = jnp.where(parent >= 0, 2 * parent, -1)
  return jnp.stack([first, jnp.where(parent >= 0, first + 1, -1)], axis=-1).reshape(width)


def select_and_expand(cand, valid, forced, score, geo: Geometry, topk_impl: str):
  """One walk level's Select_K (keep = beam) and Eq. 18 expansion to `[NC]` child candidates."""
  if topk_impl == "rank_folded":
    taken, rank = rank_keep_folded(cand, valid, forced, score, geo.beam, by_column=True)
    if geo.branching == 2:
      return expand_pairs(cand, taken, rank, geo.num_slots)
    return expand_rank(cand, taken, rank, geo.branching, geo.num_slots)
  if topk_impl == "rank":
    taken, rank = rank_keep(cand, valid, forced, score, geo.beam, by_column=True)
    return expand_rank(cand, taken, rank, geo.branching, geo.num_slots)
  return keep_and_expand(cand, valid, forced, score, geo.beam, geo.branching, geo.num_slots)


def leaf_needs_score(cand, t, geo: Geometry):
  """Which level-1 candidates are ranked by score: eligible, not forced, and more eligible
  candidates than top_k. `cand` `[..., NC]`, t broadcastable to it. Returns (need, valid,
  forced)."""
  valid = cand >= 0
  cur = t // geo.block_size
  forced = forced_nodes(cand, cur, 1)
  many = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) > geo.top_k
  return valid & ~forced & many, valid, forced


def final_select(cand, score, t, geo: Geometry, topk_impl: str, by_column: bool = False):
  """Leaf Select_K (Eq. 17 at l = 1) and ascending order: `[..., NC]` -> `[..., KP]`.

  by_column (rank top-k): the layout choice of `rank_keep`; it shortens the fused kernel's
  one-query select and costs the final top-k kernel's `[rows, NC]` select registers, so each
  caller picks.
  """
  need, valid, forced = leaf_needs_score(cand, t, geo)
  score = jnp.where(need, score, 0.0)
  if topk_impl == "rank_folded":
    taken, _ = rank_keep_folded(cand, valid, forced, score, geo.top_k, by_column=by_column)
    return sorted_kept_folded(cand, taken, geo.top_k_padded, by_column=by_column)
  if topk_impl == "rank":
    taken, _ = rank_keep(cand, valid, forced, score, geo.top_k, by_column=by_column)
    return sorted_kept_rank(cand, taken, geo.top_k_padded, by_column=by_column)
  taken = top_mask(cand, valid, forced, score, geo.top_k)
  return sorted_kept(cand, taken, geo.top_k_padded)
