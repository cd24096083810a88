"""The pyramid walk of one query (Algorithm 1, lines 5-14; Eq. 16-18): from the first level with
more than `beam` nodes down to level 2, scoring each candidate from its children's summaries
(Eq. 21/33/34), summing over the group's heads (Eq. 22), and keeping `beam` nodes per level with
the eligibility and forced-node rules. Shared by the fused kernel and the two-stage walk kernel."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pisa_jax.kernels._common import pick, reduce_children
from pisa_jax.kernels.selection import scoring, topk
from pisa_jax.kernels.selection.config import SelectionConfig
from pisa_jax.kernels.selection.layout import Geometry, load_table


def first_scored_level(geo: Geometry) -> int:
  """The highest level (>= 2) with more than `beam` nodes, or 1 when even level 2 has at most beam.

  Every level above it has at most beam nodes, so Select_K keeps each of its eligible nodes without
  looking at a score (Eq. 17's "keep all" case), and an ineligible node's children are ineligible
  too. The walk can therefore start at this level with all of its nodes as candidates (there are
  at most g * beam <= NC of them) and skip scoring the levels above: 3 of the 10 walked levels at
  128K with K = 8, 3 of 8 at 32K.
  """
  sizes = geo.level_sizes
  for level in range(len(sizes) - 1, 1, -1):
    if sizes[level - 1] > geo.beam:
      return level
  return 1


def group_child_score(child_logits, m_head, geo, pair_lse: bool, unshifted: bool):
  """`[NC]` scores of the candidates from their children: Eq. 21 over the g children
  (`child_logits(j)` gives `[Gp, NC]` logits of child j and its mask; the pair form where
  `uses_pair_lse`, g = 2 and "pisa", whose first child exists when the candidate is valid),
  then Eq. 22: the group's heads share one selection, scored by their sum."""
  if pair_lse:
    (z0, _), (z1, m1) = child_logits(0), child_logits(1)
    per_head = scoring.pair_lse(z0, z1, m1, geo.scale, geo.approx_log, unshifted)
  else:
    zs, masks = zip(*(child_logits(j) for j in range(geo.branching)))
    per_head = reduce_children(list(zs), list(masks), geo.selector, geo.scale, geo.approx_log,
                               unshifted)
  return jnp.sum(jnp.where(m_head[:, None], per_head, 0.0), axis=0)


def uses_pair_lse(config: SelectionConfig, geo: Geometry) -> bool:
  """`walk_pair_lse` applies to Eq. 21 with two children; other walks reduce as usual."""
  return config.walk_pair_lse and geo.branching == 2 and geo.selector == "pisa"


def walk_level(cand, cur, leaves_per_node, shift, n_child, child_row, qg, m_head, s_ref,
               geo: Geometry, topk_impl: str, pair_lse: bool, unshifted: bool):
  """One level of the walk (Eq. 16-18) for one query: the candidates `[NC]` of this level ->
  those of the level below, `[NC]`.

  cur: the query's current leaf; leaves_per_node / shift: the level's g^(l-1) as a value, or
  its log2 for a shift (`topk.ancestors`); n_child: the nodes of the level below;
  child_row(child): the stacked-summary row of a child index `[NC]` (clamped into n_child by
  the caller's layout). A node is eligible (its first key at or before t) iff it is at or
  before the current leaf's ancestor, which also keeps it below the level's node count (ceil
  sizes); forced: the ancestors of the first, previous and current leaves (Appendix B). Shared
  by the one-document walk and the packed documents' (`packed_walk.py`).
  """
  g = geo.branching
  anc_cur, _ = topk.ancestors(cur, leaves_per_node, shift)
  valid = (cand >= 0) & (cand <= anc_cur)
  forced = valid & topk.forced_nodes(cand, cur, leaves_per_node, shift)

  def child_logits(j):
    """[Gp, NC] logits of every head against child j of every candidate, and its mask."""
    child = jnp.where(valid, cand, 0) * g + j
    m_child = valid & (child < n_child)
    return scoring.summary_logits(qg, s_ref, child_row(child), m_child, geo), m_child

  score = group_child_score(child_logits, m_head, geo, pair_lse, unshifted)
  # Eq. 17 (Select_K, keep = beam) and Eq. 18 (the kept nodes' children).
  return topk.select_and_expand(cand, valid, forced, score, geo, topk_impl)


def walk_to_leaves(qg, m_head, i_b, t, i_h, s_ref, tab_ref, geo: Geometry, topk_impl: str,
                   pair_lse: bool = False, unshifted: bool = False):
  """Stage 1 for query t of KV head i_h: its level-1 candidates `[NC]` (leaf ids, -1 where empty or
  not eligible).

  qg: the query's group heads `[Gp, Dp]` (m_head `[Gp]` the real ones); s_ref: the stacked
  summaries (`layout.stacked_summaries`); tab_ref: the level table (`layout.level_table`). The
  levels are a loop (sizes and offsets read from the table), so the kernel's code does not grow
  with the number of levels. pair_lse: Eq. 21 by `scoring.pair_lse` (g = 2, "pisa"); unshifted:
  Eq. 21 without the max shift, in base 2 (`SelectionConfig.fused_unshifted_lse`).
  """
  sizes, g, nc = geo.level_sizes, geo.branching, geo.num_slots
  num_levels = len(sizes)
  slot = jnp.arange(nc)
  if num_levels == 1:
    return jnp.where(slot == 0, 0, -1)
  tab_size, tab_off, tab_pow = load_table(tab_ref, geo)
  g_pow2 = g & (g - 1) == 0

  def one_level(i, cand):
    level = num_levels - 1 - i  # L-1 down to 2
    off_child = pick(tab_off, level - 2)
    if g_pow2:
      # Scalar arithmetic instead of table picks (each a masked reduction over the table):
      # M_l = ceil(M_1 / g^(l-1)), nested ceilings being one ceiling.
      log2g = g.bit_length() - 1
      leaves_per_node, shift = None, (level - 1) * log2g
      s_child = (level - 2) * log2g
      n_child = (sizes[0] + (1 << s_child) - 1) >> s_child
    else:
      leaves_per_node, shift = pick(tab_pow, level - 1), None
      n_child = pick(tab_size, level - 2)

    def child_row(child):
      return off_child + (i_b * n_child + jnp.minimum(child, n_child - 1)) * geo.hkv + i_h

    return walk_level(cand, t // geo.block_size, leaves_per_node, shift, n_child, child_row, qg,
                      m_head, s_ref, geo, topk_impl, pair_lse, unshifted)

  # Every node of the first scored level is a candidate (the levels above keep all their
  # eligible nodes); the per-level eligibility mask drops the ones after t.
  first_level = first_scored_level(geo)
  cand = jnp.where(slot < sizes[first_level - 1], slot, -1)
  start = num_levels - 1 - first_level
  if start < num_levels - 2:
    cand = lax.fori_loop(start, num_levels - 2, one_level, cand)
  return jnp.where((cand >= 0) & (cand < sizes[0]) & (cand * geo.block_size <= t), cand, -1)
