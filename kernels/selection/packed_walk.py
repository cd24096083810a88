"""The fused selection kernel over packed documents (segment_ids): `fused.py` with per-query
document geometry. One program per (query, KV head) walks every level of its own document's
pyramid (Algorithm 1, lines 5-14; Eq. 16-18), scores its candidate leaves on their raw keys and
runs the final Select_K, in one launch, where `packed.py` scores one level per launch and leaves
Select_K to XLA.

Everything the walk reads is its document's, as if the document ran alone from position 0
(`pisa_jax.segments`):
  - the query's position rel = t - start in its document gives the current block rel // C (never
    t // C: a document may start mid-block), its forced nodes (Appendix B) and its eligibility
    (nodes at or before the current leaf's ancestor);
  - the document has M_1 = ceil(L / C) leaves and M_l = ceil(M_1 / g^(l-1)) nodes at level l
    (Eq. 10, 13); node i of its level l lies at packed slot first_node_l + i, so a candidate's
    children are consecutive rows of the packed level below;
  - a leaf's keys are the C positions from start + leaf * C (contiguous, not block-aligned).
Per-query integers come from a `[B*T, DP]` int32 document table built in XLA (`document_table`),
which also resolves each level's packed slot to its row in the stacked summaries, so a walk level
picks one table entry, as the unpacked walk picks one level-table offset.

Which configurations: "pisa", "pisa1" and "pisa2" at NC = 16 candidate slots (beam * g <= 16),
the unpacked fused kernel's domain (`SelectionConfig.default`); `covers` is the one rule. Wider
candidate sets (K = 32, beams) take the two-stage pipeline of the unpacked selection
(`select_packed_two_stage`, `two_stage.py`): this walk to level 2 in one launch, then the leaf
tiles, each a leaf's C keys loaded once for the queries that need its score (a packed leaf is
named by its first key position), then the final Select_K at each query's document position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax import geometry
from pisa_jax.kernels._common import (INT32_MAX, MIN_DOT, int32_table, next_pow2, pick, qk_dot,
                                      reduce_keys)
from pisa_jax.kernels.selection import topk, two_stage
from pisa_jax.kernels.selection.config import SelectionConfig, candidate_slots
from pisa_jax.kernels.selection.fused import (bounded_select, key_norm_bounds,
                                              score_needed_leaves)
from pisa_jax.kernels.selection.layout import (Geometry, launch, load_group_queries, load_rows,
                                               make_geometry, stacked_summaries)
from pisa_jax.kernels.selection.walk import uses_pair_lse, walk_level
from pisa_jax.spec import SelectionSpec, takes_spec

HIERARCHICAL = ("pisa", "pisa1", "pisa2")
# Columns of the document table: the document's start, its leaves M_1, its first scored level
# and that level's node count; from DOC_FIRST on, the stacked-summary row of its first node at
# levels 1..L-1 (KV head 0).
DOC_START, DOC_LEAVES, DOC_LEVEL, DOC_NODES, DOC_FIRST = range(5)


def covers_two_stage(selector: str, beam: int, branching: int) -> bool:
  """Whether the packed two-stage pipeline takes this selection: a hierarchical selector whose
  walk needs more than the fused kernel's 16 candidate slots."""
  return selector in HIERARCHICAL and candidate_slots(beam, branching) > MIN_DOT


def covers(selector: str, beam: int, branching: int) -> bool:
  """Whether the fused packed kernel takes this selection: a hierarchical selector whose walk
  fits the unpacked fused kernel's NC = 16 candidate slots (beam * g <= 16; K = 8, g = 2 is the
  paper's setting)."""
  return selector in HIERARCHICAL and candidate_slots(beam, branching) == MIN_DOT


def stacked_offsets(capacities, geo: Geometry) -> list[int]:
  """First row of each packed level 1..L-1 in the stacked summaries (`[B, N_l, HKV]` rows per
  level). Raises where a summary row (two per node for 16-bit inputs) or a key row would pass
  int32: the walk's row arithmetic is int32."""
  per_node = geo.batch * geo.hkv
  offsets = [per_node * o for o in geometry.stacked_offsets(capacities[:-1])]
  rows = max(2 * per_node * sum(capacities[:-1]), geo.batch * geo.seq_len * max(geo.hq, geo.hkv))
  if rows > INT32_MAX:
    raise ValueError(f"q / k / packed summaries of {rows} rows: past int32 (max {INT32_MAX}) in "
                     "the packed walk's row arithmetic")
  return offsets


def document_table(start: Int[Array, "B T"], length: Int[Array, "B T"],
                   first_node: Int[Array, "B T L"], capacities, geo: Geometry
                   ) -> Int[Array, "BT DP"]:
  """int32 `[B*T, DP]`, per query: its document's start, M_1 = ceil(length / C) leaves, first
  scored level f and M_f, and for levels 1..L-1 the row of its first node in the stacked
  summaries (for KV head 0; -1 where the document has no such level: the walk reads only levels
  below f, which every document scoring at f has). capacities: the packed levels' slots N_l.

  f is the highest level >= 2 with M_l > beam (1 when there is none). The levels above keep
  every eligible node without a score (Eq. 17's keep-all case; above the document's root a level
  has one node, as in the reference walk), so the walk starts at f with all of its M_f <= g *
  beam <= NC nodes as candidates, the unpacked kernel's `walk.first_scored_level` per document.
  """
  c, g, beam = geo.block_size, geo.branching, geo.beam
  num_levels = first_node.shape[-1]
  leaves = (length + c - 1) // c
  level, nodes = jnp.ones_like(leaves), leaves
  for lv in range(2, num_levels + 1):
    per_node = g ** (lv - 1)  # < g * M_1 <= g * T: int32
    more = leaves > beam * per_node
    level = jnp.where(more, lv, level)
    nodes = jnp.where(more, (leaves + per_node - 1) // per_node, nodes)
  batch = jnp.arange(start.shape[0], dtype=jnp.int32)[:, None]
  rows = [jnp.where(first_node[..., i] >= 0,
                    off + (batch * cap + first_node[..., i]) * geo.hkv, -1)
          for i, (off, cap) in enumerate(zip(stacked_offsets(capacities, geo), capacities))]
  cols = [start, leaves, level, nodes] + rows
  width = next_pow2(len(cols))
  cols += [jnp.zeros_like(start)] * (width - len(cols))
  return jnp.stack(cols, axis=-1).astype(jnp.int32).reshape(-1, width)


def powers_table(geo: Geometry, num_levels: int):
  """int32 `[LP]`: g^(l-1) for levels l = 1..L, padded with 1 to LP = next_pow2(L + 1) (as
  `layout.level_table`); read only for g not a power of two."""
  lp = next_pow2(num_levels + 1)
  return int32_table([geo.branching ** i if i < num_levels else 1 for i in range(lp)],
                     "the packed walk's powers of g")


def _load_vector(ref, row, width: int):
  """Row `row` of a `[N, width]` int32 ref as a `[width]` value."""
  return plt.load(ref.at[jnp.full((width,), row, jnp.int32), jnp.arange(width)])


def packed_walk_to_leaves(qg, m_head, i_h, rel, doc, tab_pow, s_ref, geo: Geometry,
                          topk_impl: str, pair_lse: bool, unshifted: bool):
  """The document walk of one query: its level-1 candidates `[NC]` (document leaf ids, -1 where
  empty or not eligible). rel: the query's position in its document; doc: its document-table
  row `[DP]`; tab_pow: `powers_table` `[LP]`."""
  g, nc = geo.branching, geo.num_slots
  leaves, first_level = pick(doc, DOC_LEAVES), pick(doc, DOC_LEVEL)
  slot = jnp.arange(nc)
  cur = rel // geo.block_size  # the current leaf in the document's own grid
  g_pow2 = g & (g - 1) == 0
  log2g = g.bit_length() - 1

  def one_level(i, cand):
    level = first_level - i  # f down to 2
    # Stacked row (KV head 0) of the document's first node at level - 1, the children's level.
    first_row = pick(doc, DOC_FIRST + level - 2)
    if g_pow2:
      # Shifts, not divisions by a runtime value; M_(l-1) = ceil(M_1 / g^(l-2)).
      leaves_per_node, shift = None, (level - 1) * log2g
      s_child = (level - 2) * log2g
      n_child = (leaves + (1 << s_child) - 1) >> s_child
    else:
      leaves_per_node, shift = pick(tab_pow, level - 1), None
      per_child = pick(tab_pow, level - 2)
      n_child = (leaves + per_child - 1) // per_child

    def child_row(child):
      # The document's nodes of a level are consecutive packed rows from its first one.
      return first_row + jnp.minimum(child, n_child - 1) * geo.hkv + i_h

    # Eligibility and the forced nodes read the document's own current leaf and M_l.
    return walk_level(cand, cur, leaves_per_node, shift, n_child, child_row, qg, m_head, s_ref,
                      geo, topk_impl, pair_lse, unshifted)

  cand = jnp.where(slot < pick(doc, DOC_NODES), slot, -1)
  cand = lax.fori_loop(0, first_level - 1, one_level, cand)
  return jnp.where((cand >= 0) & (cand < leaves) & (cand * geo.block_size <= rel), cand, -1)


def document_leaf_score(qg, m_head, leaf, i_b, i_h, start, k_ref, geo: Geometry,
                        unshifted: bool):
  """Group-summed raw-key score of one complete past leaf of the query's document (Eq. 21/33/34
  with l = 1, then Eq. 22): its keys are positions start + leaf * C .. + C - 1, all inside the
  document and before the query (only leaves before the previous one are scored)."""
  o_key = jnp.arange(geo.block_padded)
  pos = start + leaf * geo.block_size + o_key
  rows = (i_b * geo.seq_len + pos) * geo.hkv + i_h
  if geo.block_padded == geo.block_size:
    m_load, m_key = jnp.full((geo.block_padded,), True), None
  else:
    m_load = m_key = o_key < geo.block_size
    rows = (i_b * geo.seq_len + jnp.minimum(pos, geo.seq_len - 1)) * geo.hkv + i_h
  b_k = load_rows(k_ref, rows, m_load, geo)
  per_head = reduce_keys(qk_dot(qg, b_k, geo.inputs_16bit), m_key, geo.selector, geo.scale,
                         geo.approx_log, unshifted)
  return jnp.sum(jnp.where(m_head, per_head, 0.0))


def packed_select(qg, m_head, i_b, i_h, rel, doc, tab_pow, k_ref, s_ref, geo: Geometry,
                  topk_impl: str, pair_lse: bool, unshifted: bool = False):
  """Walk, leaf scores and final Select_K of one (query, KV head): `[1, KP]` sorted document
  leaf ids. As `fused.fused_select`, only the leaves that need a score are scored."""
  cand = packed_walk_to_leaves(qg, m_head, i_h, rel, doc, tab_pow, s_ref, geo, topk_impl,
                               pair_lse, unshifted)

  def leaf_scorer():
    start = pick(doc, DOC_START)
    return lambda leaf: document_leaf_score(qg, m_head, leaf, i_b, i_h, start, k_ref, geo,
                                            unshifted)

  scores = score_needed_leaves(cand, rel, geo, leaf_scorer)
  return topk.final_select(cand[None, :], scores[None, :], rel, geo, topk_impl, by_column=True)


def _query_program(q_ref, pow_ref, doc_ref, geo: Geometry):
  """What a packed walk program (one query, one KV head) loads first: (i_bh, t, i_b, i_h, the
  head mask `[Gp]`, the group's queries `[Gp, Dp]`, the query's document-table row `[DP]`, the
  powers table `[LP]`)."""
  i_p = pl.program_id(0)
  i_bh, t = i_p // geo.seq_len, i_p % geo.seq_len
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  m_head = jnp.arange(geo.group_padded) < geo.group
  qg = load_group_queries(q_ref, geo, i_b, t, i_h, geo.group_padded)
  doc = _load_vector(doc_ref, i_b * geo.seq_len + t, doc_ref.shape[1])
  tab_pow = plt.load(pow_ref.at[jnp.arange(pow_ref.shape[0])])
  return i_bh, t, i_b, i_h, m_head, qg, doc, tab_pow


def packed_fused_kernel(q_ref, k_ref, s_ref, pow_ref, doc_ref, *refs, geo: Geometry,
                        topk_impl: str, pair_lse: bool = False, unshifted: bool = False):
  """Every level of the query's document, the leaves included, for one (query, KV head); writes
  its `[1, KP]` leaf ids. refs: (out_ref,) or, with `unshifted`, (kn2_ref, out_ref) as in
  `fused.fused_kernel` (max_t |k_t|^2 over the row bounds every document's keys too)."""
  kn2_ref, out_ref = refs if unshifted else (None, refs[0])
  i_bh, t, i_b, i_h, m_head, qg, doc, tab_pow = _query_program(q_ref, pow_ref, doc_ref, geo)
  rel = t - pick(doc, DOC_START)
  select = functools.partial(packed_select, qg, m_head, i_b, i_h, rel, doc, tab_pow, k_ref, s_ref,
                             geo, topk_impl, pair_lse)
  out = bounded_select(select, qg, m_head, kn2_ref, i_bh, geo) if unshifted else select()
  row = (i_b * geo.seq_len + t) * geo.hkv + i_h
  out_ref[pl.ds(row, 1), :] = out


def _walk_inputs(q, k, start, length, first_node, summaries, config, spec, interpret, *,
                 fused: bool):
  """(geo, config, stacked summaries, powers table, document table) of a packed walk, the fused
  one or the two-stage one (each checks that it covers the spec); config None picks
  `SelectionConfig.default` for the geometry's candidate slots."""
  if not (covers if fused else covers_two_stage)(spec.selector, spec.beam, spec.branching):
    kind, rule = ("fused packed walk", "<=") if fused else ("packed two-stage selection", ">")
    raise ValueError(f"selector={spec.selector!r}, beam={spec.beam}, branching={spec.branching}: "
                     f"the {kind} takes a selector in {HIERARCHICAL} with beam * branching "
                     f"{rule} {MIN_DOT}")
  b, t, hq, d = q.shape
  geo = make_geometry(q, k, spec=spec, interpret=interpret)
  config = config or SelectionConfig.default(seq_len=t, group=hq // geo.hkv,
                                             candidates=geo.num_slots)
  stacked = stacked_summaries(summaries, geo, q.dtype)
  capacities = [s.shape[1] for s in summaries]
  doc = document_table(start, length, first_node, capacities, geo)
  return geo, config, stacked, powers_table(geo, len(capacities)), doc


@takes_spec
def select_packed_fused(q: Float[Array, "B T HQ D"], k: Float[Array, "B T HKV D"],
                        start: Int[Array, "B T"], length: Int[Array, "B T"],
                        first_node: Int[Array, "B T L"],
                        summaries: tuple[Float[Array, "B N HKV D"], ...], *,
                        spec: SelectionSpec, interpret: bool,
                        config: SelectionConfig | None = None) -> Int[Array, "B T HKV K"]:
  """The fused packed walk: int32 `[B, T, HKV, top_k]` document leaf ids ascending, -1 padded.

  start, length, first_node: `segments.Documents` fields; summaries: the `PackedPyramid` levels
  (leaves first, `segments.packed_capacities` slots each); the rest as `select_blocks_pallas`.
  config: None picks `SelectionConfig.default` (the fused variant here).
  """
  selector, top_k = spec.selector, spec.top_k
  b, t, _, d = q.shape
  geo, config, stacked, powers, doc = _walk_inputs(
      q, k, start, length, first_node, summaries, config, spec, interpret, fused=True)
  rows = b * t * geo.hkv
  pair_lse = uses_pair_lse(config, geo)
  unshifted = config.fused_unshifted_lse and selector == "pisa"
  kn2 = (key_norm_bounds(k),) if unshifted else ()
  name = (f"pisa_select_packed_fused_{selector}_{config.topk_impl}"
          + ("_pair_lse" if pair_lse else "") + ("_unshifted" if unshifted else ""))
  out = launch(functools.partial(packed_fused_kernel, geo=geo, topk_impl=config.topk_impl,
                                 pair_lse=pair_lse, unshifted=unshifted),
               jax.ShapeDtypeStruct((rows, geo.top_k_padded), jnp.int32), rows, config,
               config.walk_warps, interpret, name, q.reshape(-1, d), k.reshape(-1, d), stacked,
               powers, doc, *kn2)
  return out[:, :top_k].reshape(b, t, geo.hkv, top_k)


def packed_walk_kernel(q_ref, s_ref, pow_ref, doc_ref, cand_ref, *, geo: Geometry,
                       topk_impl: str, pair_lse: bool = False):
  """Two-stage stage 1 for one (query, KV head): its document walk down to level 2, writing the
  level-1 candidates `[NC]` (document leaf ids) as `two_stage.walk_kernel` does."""
  _, t, i_b, i_h, m_head, qg, doc, tab_pow = _query_program(q_ref, pow_ref, doc_ref, geo)
  cand = packed_walk_to_leaves(qg, m_head, i_h, t - pick(doc, DOC_START), doc, tab_pow, s_ref,
                               geo, topk_impl, pair_lse, False)
  cand_ref[(i_b * geo.seq_len + t) * geo.hkv + i_h, :] = cand


@takes_spec
def select_packed_two_stage(q: Float[Array, "B T HQ D"], k: Float[Array, "B T HKV D"],
                            start: Int[Array, "B T"], length: Int[Array, "B T"],
                            first_node: Int[Array, "B T L"],
                            summaries: tuple[Float[Array, "B N HKV D"], ...], *,
                            spec: SelectionSpec, interpret: bool,
                            config: SelectionConfig | None = None) -> Int[Array, "B T HKV K"]:
  """The packed selection of wide candidate sets (`covers_two_stage`), arguments and result as
  `select_packed_fused`: the document walk to level 2, then `two_stage`'s leaf tiles and final
  Select_K given each row's document start and position in it."""
  selector, top_k = spec.selector, spec.top_k
  b, t, _, d = q.shape
  geo, config, stacked, powers, doc = _walk_inputs(
      q, k, start, length, first_node, summaries, config, spec, interpret, fused=False)
  rows = b * t * geo.hkv
  pair_lse = uses_pair_lse(config, geo)
  name = (f"pisa_select_packed_walk_{selector}_{config.topk_impl}"
          + ("_pair_lse" if pair_lse else ""))
  cand = launch(functools.partial(packed_walk_kernel, geo=geo, topk_impl=config.topk_impl,
                                  pair_lse=pair_lse),
                jax.ShapeDtypeStruct((rows, geo.num_slots), jnp.int32), rows, config,
                config.walk_warps, interpret, name, q.reshape(-1, d), stacked, powers, doc)
  # Per (query, KV head) row: the query's position in its document and the document's start.
  start_rows = jnp.repeat(start.reshape(-1), geo.hkv)
  rel_rows = jnp.repeat((jnp.arange(t, dtype=jnp.int32)[None, :] - start).reshape(-1), geo.hkv)
  outs = []
  for r0, r1 in two_stage.row_chunks(rows, geo.num_slots):
    part = cand if r1 - r0 == rows else cand[r0:r1]
    rel, first = rel_rows[r0:r1], start_rows[r0:r1]
    scores = two_stage.leaf_scores_pallas(q, k, part, geo, interpret=interpret, config=config,
                                          row0=r0, packed_rows=(rel, first))
    outs.append(two_stage.final_topk_pallas(part, scores, geo, interpret=interpret,
                                            config=config, row0=r0, rel=rel))
  out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
  return out[:, :top_k].reshape(b, t, geo.hkv, top_k)
