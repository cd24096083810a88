"""The two-stage selection (Algorithm 1; the paper's Q1/Q2/Q4), the default for candidate sets
wider than 16 slots:

1. `walk_kernel`, one program per (query, KV head): loads the group's query heads once and walks
   the pyramid to level 2 (`walk.walk_to_leaves`); only the level-1 candidates `[B*T*HKV, NC]` go
   back to HBM.
2. Leaf tiles (Algorithm 1, lines 16-22; Eq. 23-24), `sibling_tile_kernel`: the walk's last
   expansion (Eq. 18) puts the g children of each kept level-2 node in g consecutive slots, so
   the (query, kept level-2 node) entries with a leaf to score are grouped by that node with one
   stable sort outside the kernel (`sibling_scores_pallas`) and cut into tiles of at most
   `q_tile` queries. Each program loads its queries' group heads once and scores them against
   each of the node's g leaves (one dot per leaf): the queries, the leaf stage's largest load
   (O(N g K G_Q d), Section 3.4), are read once per g leaves, and the sort holds g times fewer
   items (faster on a GPU than one leaf a tile, with the same scores).
   Packed rows (`packed_walk`), whose leaves start on no block edge, use `leaf_tile_kernel`
   instead (`leaf_scores_pallas`): the (query, candidate leaf) pairs that need a score, grouped
   by leaf; each program loads one leaf's raw keys once and scores `q_tile` queries x the group's
   heads with one dot (Eq. 21 with l = 1: the exact raw-key LSE). Both compute every score with
   the same `[q_tile * heads, D] x [D, C]` dot and reduction.
3. `final_topk_kernel`: forced blocks first, then the top_k best scores, ascending, -1 padded.

Stages 2 and 3 number the (query, candidate) pairs row * NC + slot in int32 (jax without x64 has no
int64 arrays, and the argsort's positions are int32 too), so they run over ranges of rows of at
most MAX_PAIRS pairs each (`row_chunks`): one range up to B*T*HKV*NC = 2^30 pairs (T = 8M at
HKV = 2, NC = 64), several past it (4M tokens at HKV = 8, NC = 64 reach 2^31).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Int

from pisa_jax.kernels._common import MIN_DOT, next_pow2, qk_dot, reduce_keys
from pisa_jax.kernels.selection import topk
from pisa_jax.kernels.selection.config import SelectionConfig
from pisa_jax.kernels.selection.layout import (Geometry, launch, leaf_key_rows, level_table,
                                               load_group_queries, load_rows, offset_input,
                                               query_position, query_tile_program,
                                               stacked_summaries)
from pisa_jax.kernels.selection.walk import uses_pair_lse, walk_to_leaves

# Pairs per launch of stages 2 and 3: pair ids, sorted positions plus a tile (start + q_tile) and
# the trash slot after the last pair all stay far below 2^31 - 1.
MAX_PAIRS = 2**30


def walk_kernel(q_ref, s_ref, tab_ref, *refs, geo: Geometry, topk_impl: str,
                pair_lse: bool = False):
  """Stage 1 for one (query, KV head): writes its leaf candidates `[NC]`. refs: (cand_ref,), or
  (off_ref, cand_ref) with `geo.has_offset` (query row i_q at position off + i_q)."""
  off_ref, cand_ref = refs if geo.has_offset else (None, refs[0])
  i_b, i_h, i_q = query_tile_program(geo, 1)
  m_head = jnp.arange(geo.group_padded) < geo.group
  qg = load_group_queries(q_ref, geo, i_b, i_q, i_h, geo.group_padded)
  cand = walk_to_leaves(qg, m_head, i_b, query_position(i_q, off_ref), i_h, s_ref, tab_ref, geo,
                        topk_impl, pair_lse=pair_lse)
  cand_ref[(i_b * geo.num_queries + i_q) * geo.hkv + i_h, :] = cand


def leaf_tile_kernel(q_ref, k_ref, start_ref, bucket_ref, pair_ref, score_ref, *, geo: Geometry,
                     q_tile: int, num_pairs: int, trash: int, row0: int = 0,
                     packed: bool = False):
  """Stage 2 (Algorithm 1, lines 16-22): one leaf's keys against up to q_tile queries.

  start_ref `[NG]`: first sorted position of each tile (num_pairs when the tile is unused);
  bucket_ref `[num_pairs]`: sorted (batch, KV head, leaf) buckets; pair_ref `[num_pairs]`: the
  pair id ((row - row0) * NC + slot) at each sorted position, the rows from row0 on. Writes
  score_ref[pair] (score_ref[trash] when masked). packed: buckets are (batch, KV head, the leaf's
  first key position), a packed document's leaf starting on no block edge.
  """
  # Head rows per query: the group padded to a power of two, and >= 16 rows in all for the dot.
  heads = max(next_pow2(geo.group), MIN_DOT // q_tile)
  tile_rows = q_tile * heads
  i_g = pl.program_id(0)
  o_r = jnp.arange(tile_rows)
  o_e = jnp.arange(q_tile)
  start = jnp.max(plt.load(start_ref.at[jnp.full((q_tile,), i_g, jnp.int32)]))
  # Tiles are numbered densely from 0, so the unused ones (start == num_pairs) are the grid's
  # tail: the grid's static size bounds the tiles of every possible grouping. They exit here.
  @pl.when(start < num_pairs)
  def _():
    # Entry e of the tile is sorted position start + e; it belongs to the tile if it exists and has
    # the tile's bucket (a bucket's last tile may be short).
    pos_e = start + o_e
    bucket0 = jnp.max(plt.load(bucket_ref.at[jnp.full((q_tile,), start)]))
    bucket_e = plt.load(bucket_ref.at[jnp.minimum(pos_e, num_pairs - 1)])
    m_e = (pos_e < num_pairs) & (bucket_e == bucket0)
    pair_e = plt.load(pair_ref.at[jnp.minimum(pos_e, num_pairs - 1)])
    # A used tile's first entry is a live pair, so bucket0 is a real (batch, KV head, leaf).
    units = geo.seq_len if packed else geo.num_blocks
    leaf = bucket0 % units
    i_bh = bucket0 // units
    i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
    # [Q*heads] query rows: entry r // heads, head r % heads.
    e_r = o_r // heads
    j_r = o_r % heads
    pos_r = start + e_r
    m_r = (pos_r < num_pairs) & (j_r < geo.group)
    pair_r = plt.load(pair_ref.at[jnp.minimum(pos_r, num_pairs - 1)])
    bucket_r = plt.load(bucket_ref.at[jnp.minimum(pos_r, num_pairs - 1)])
    m_r = m_r & (bucket_r == bucket0)
    qk_row = pair_r // geo.num_slots  # (b * Tq + t) * HKV + h
    if row0:
      qk_row = qk_row + row0
    q_rows = (qk_row // geo.hkv) * geo.hq + i_h * geo.group + jnp.minimum(j_r, geo.group - 1)
    b_q = load_rows(q_ref, q_rows, m_r, geo)
    k_rows, m_load, m_key = leaf_key_rows(leaf, i_b, i_h, geo, leaf if packed else None)
    b_k = load_rows(k_ref, k_rows, m_load, geo)
    # [Q*heads, Cp]: every (query, head) of the tile against the leaf's raw keys, one dot.
    per_row = jnp.where(m_r, reduce_keys(qk_dot(b_q, b_k, geo.inputs_16bit), m_key, geo.selector,
                                         geo.scale, geo.approx_log), 0.0)
    # Eq. 22: sum each entry's heads, [Q].
    score_e = jnp.sum(jnp.where(e_r[None, :] == o_e[:, None], per_row[None, :], 0.0), axis=1)
    plt.store(score_ref.at[jnp.where(m_e, pair_e, trash)], score_e)


def sibling_tile_kernel(q_ref, k_ref, start_ref, bucket_ref, entry_ref, score_ref, *,
                        geo: Geometry, q_tile: int, num_entries: int, trash: int, row0: int = 0):
  """Stage 2 by sibling groups: the g leaves of one kept level-2 node against up to q_tile
  queries, the queries' group heads loaded once for all g.

  start_ref `[NT]`: first sorted position of each tile (num_entries when the tile is unused);
  bucket_ref `[num_entries]`: sorted (batch, KV head, level-2 node) buckets; entry_ref
  `[num_entries]`: the entry (row - row0) * NG + p at each sorted position, NG = NC // g groups
  per row, group p being slots p * g .. p * g + g - 1 (the children of one kept node, Eq. 18).
  Writes score_ref[(row - row0) * NC + p * g + j] for every child j (score_ref[trash] when
  masked). A child that needs no score (forced, after the query, past the sequence) gets some
  complete leaf's score, which the final Select_K never reads (`topk.final_select` keeps only
  the scores `topk.leaf_needs_score` asks for); a child that needs one is a complete past leaf.
  """
  # Head rows per query: the group padded to a power of two, and >= 16 rows in all for the dot.
  heads = max(next_pow2(geo.group), MIN_DOT // q_tile)
  tile_rows = q_tile * heads
  g, groups = geo.branching, geo.num_slots // geo.branching
  i_g = pl.program_id(0)
  o_r = jnp.arange(tile_rows)
  o_e = jnp.arange(q_tile)
  start = jnp.max(plt.load(start_ref.at[jnp.full((q_tile,), i_g, jnp.int32)]))
  # As in `leaf_tile_kernel`: the unused tiles are the grid's tail and exit here.
  @pl.when(start < num_entries)
  def _():
    last = num_entries - 1
    pos_e = start + o_e
    bucket0 = jnp.max(plt.load(bucket_ref.at[jnp.full((q_tile,), start)]))
    bucket_e = plt.load(bucket_ref.at[jnp.minimum(pos_e, last)])
    m_e = (pos_e < num_entries) & (bucket_e == bucket0)
    entry_e = plt.load(entry_ref.at[jnp.minimum(pos_e, last)])
    parents = -(-geo.num_blocks // g)
    node = bucket0 % parents
    i_bh = bucket0 // parents
    i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
    # [Q*heads] query rows: entry r // heads, head r % heads.
    e_r = o_r // heads
    j_r = o_r % heads
    pos_r = start + e_r
    m_r = (pos_r < num_entries) & (j_r < geo.group)
    entry_r = plt.load(entry_ref.at[jnp.minimum(pos_r, last)])
    bucket_r = plt.load(bucket_ref.at[jnp.minimum(pos_r, last)])
    m_r = m_r & (bucket_r == bucket0)
    qk_row = entry_r // groups  # (b * Tq + t) * HKV + h
    if row0:
      qk_row = qk_row + row0
    q_rows = (qk_row // geo.hkv) * geo.hq + i_h * geo.group + jnp.minimum(j_r, geo.group - 1)
    b_q = load_rows(q_ref, q_rows, m_r, geo)
    slot_e = (entry_e // groups) * geo.num_slots + (entry_e % groups) * g
    # The last complete leaf: a child past it is never scored, and its keys may not exist.
    complete = max(geo.seq_len // geo.block_size - 1, 0)
    for j in range(g):
      leaf = jnp.minimum(node * g + j, complete)
      k_rows, m_load, m_key = leaf_key_rows(leaf, i_b, i_h, geo)
      b_k = load_rows(k_ref, k_rows, m_load, geo)
      # [Q*heads, Cp]: the tile's queries against child j's raw keys, the dot and reduction of
      # `leaf_tile_kernel`, then Eq. 22 per entry.
      per_row = jnp.where(m_r, reduce_keys(qk_dot(b_q, b_k, geo.inputs_16bit), m_key,
                                           geo.selector, geo.scale, geo.approx_log), 0.0)
      score_e = jnp.sum(jnp.where(e_r[None, :] == o_e[:, None], per_row[None, :], 0.0), axis=1)
      plt.store(score_ref.at[jnp.where(m_e, slot_e + j, trash)], score_e)


def final_topk_kernel(cand_ref, score_ref, *refs, geo: Geometry, rows: int, num_rows: int,
                      topk_impl: str, row0: int = 0, packed: bool = False):
  """Stage 2 final Select_K for `rows` (query, KV head) rows: `[rows, NC]` -> `[rows, KP]`.
  cand_ref holds num_rows rows from row row0 of `[B*Tq*HKV, NC]` on. refs: (out_ref,), or
  (off_ref, out_ref) with `geo.has_offset`, or (rel_ref, out_ref) when packed: rel_ref
  `[num_rows]`, each row's query position in its document."""
  off_ref, out_ref = refs if geo.has_offset or packed else (None, refs[0])
  i_p = pl.program_id(0)
  o_row = i_p * rows + jnp.arange(rows)
  m_row = o_row < num_rows
  c_row = jnp.minimum(o_row, num_rows - 1)
  o_slot = jnp.arange(geo.num_slots)
  cand = plt.load(cand_ref.at[c_row[:, None], o_slot[None, :]])
  cand = jnp.where(m_row[:, None], cand, -1)
  score = plt.load(score_ref.at[(c_row[:, None] * geo.num_slots + o_slot[None, :])])
  if packed:
    t = plt.load(off_ref.at[c_row])[:, None]
  else:
    t = query_position(((c_row + row0 if row0 else c_row) // geo.hkv) % geo.num_queries,
                       off_ref)[:, None]
  out = topk.final_select(cand, score, t, geo, topk_impl)
  trash = num_rows
  plt.store(out_ref.at[jnp.where(m_row, o_row, trash)[:, None],
                       jnp.arange(geo.top_k_padded)[None, :]], out)


def leaf_candidates_pallas(q, k, summaries, geo: Geometry, *, interpret: bool,
                           config: SelectionConfig, offset=None) -> Int[Array, "R NC"]:
  """Stage 1: level-1 candidates `[B*Tq*HKV, NC]`."""
  b, t, hq, d = q.shape
  rows = b * t * geo.hkv
  pair_lse = uses_pair_lse(config, geo)
  stacked, table = stacked_summaries(summaries, geo, q.dtype), level_table(geo)
  name = f"pisa_select_walk_{config.topk_impl}" + ("_pair_lse" if pair_lse else "")
  return launch(functools.partial(walk_kernel, geo=geo, topk_impl=config.topk_impl,
                                  pair_lse=pair_lse),
                jax.ShapeDtypeStruct((rows, geo.num_slots), jnp.int32), rows, config,
                config.walk_warps, interpret, name, q.reshape(-1, d), stacked, table,
                *offset_input(offset))


def row_chunks(rows: int, num_slots: int) -> list[tuple[int, int]]:
  """Row ranges [start, stop) of `[rows, NC]` candidates, each of at most MAX_PAIRS pairs."""
  per = max(1, MAX_PAIRS // num_slots)
  return [(r, min(r + per, rows)) for r in range(0, rows, per)]


def leaf_scores_pallas(q, k, cand, geo: Geometry, *, interpret: bool, config: SelectionConfig,
                       row0: int = 0, offset=None, packed_rows=None):
  """Stage 2 key-tile scoring of candidates `[R, NC]`, rows row0 .. row0 + R - 1 of
  `[B*T*HKV, NC]`: float32 scores `[R * NC + 1]` of the pairs that need one (the last element is
  the trash slot of masked stores; unscored pairs are left unwritten). offset: None, or int32
  `[1]`, the position of q's first row among the keys. packed_rows: None, or int32 (rel, start)
  `[R]` each of packed rows: the query's position in its document and the document's start;
  cand then holds document leaf ids, leaf i's keys from start + i C on."""
  b, t, hq, d = q.shape
  rows = cand.shape[0]
  num_pairs = rows * geo.num_slots
  if num_pairs > MAX_PAIRS:
    raise ValueError(f"{num_pairs} pairs in one launch, past {MAX_PAIRS}: split with row_chunks")
  o_row = jnp.arange(row0, row0 + rows)  # (b * Tq + t) * HKV + h
  if packed_rows is None:
    t_row = ((o_row // geo.hkv) % t)[:, None]
    if offset is not None:
      t_row = t_row + offset[0]
    units, leaf = geo.num_blocks, jnp.maximum(cand, 0)
  else:
    # A packed leaf is named by its first key position, unique across documents.
    rel, first = packed_rows
    t_row = rel[:, None]
    units, leaf = t, first[:, None] + jnp.maximum(cand, 0) * geo.block_size
  need, _, _ = topk.leaf_needs_score(cand, t_row, geo)
  # Buckets are (batch, KV head, leaf); pairs that need no score go to the last bucket.
  num_buckets = b * geo.hkv * units
  q_tile = config.q_tile
  bh = (o_row // (t * geo.hkv)) * geo.hkv + o_row % geo.hkv
  bucket = jnp.where(need, bh[:, None] * units + leaf, num_buckets)
  bucket = bucket.reshape(-1)
  # Group the pairs by leaf, stably (by query inside a leaf). The per-bucket counts and offsets
  # are small ([B*HKV*M]), so no scan runs over the P pairs.
  order = jnp.argsort(bucket, stable=True).astype(jnp.int32)
  sorted_bucket = bucket[order]
  counts = jnp.zeros((num_buckets + 1,), jnp.int32).at[bucket].add(1)[:num_buckets]
  first = jnp.cumsum(counts) - counts  # first sorted position of each bucket
  pos = jnp.arange(num_pairs, dtype=jnp.int32)
  tiles = -(-counts // q_tile)
  first_tile = jnp.cumsum(tiles) - tiles  # tiles before each bucket
  live = sorted_bucket < num_buckets
  safe_bucket = jnp.minimum(sorted_bucket, num_buckets - 1)
  rank = pos - first[safe_bucket]
  tile_head = (rank % q_tile == 0) & live
  tile_id = first_tile[safe_bucket] + rank // q_tile
  # Static bound on the number of tiles: each bucket adds at most one partial tile.
  num_tiles = -(-num_pairs // q_tile) + min(num_pairs, num_buckets)
  starts = jnp.full((num_tiles,), num_pairs, jnp.int32).at[
      jnp.where(tile_head, tile_id, num_tiles)].set(pos, mode="drop")
  return launch(
      functools.partial(leaf_tile_kernel, geo=geo, q_tile=q_tile, num_pairs=num_pairs,
                        trash=num_pairs, row0=row0, packed=packed_rows is not None),
      jax.ShapeDtypeStruct((num_pairs + 1,), jnp.float32), num_tiles, config, config.leaf_warps,
      interpret, f"pisa_select_leaf_q{q_tile}", q.reshape(-1, d), k.reshape(-1, d), starts,
      sorted_bucket, order)


def tile_starts(sorted_bucket: Int[Array, "E"], num_buckets: int, q_tile: int) -> Int[Array, "NT"]:
  """The first sorted position of each tile of at most q_tile items of one bucket, over items
  sorted by bucket (values 0 .. num_buckets, the last one unused): `[NT]` for the static bound
  NT = ceil(E / q_tile) + min(E, num_buckets) on the tiles, unused tiles (the tail) E.

  Binary searches instead of per-item scatters: each bucket's first position is a search of the
  sorted items, each tile's bucket a search of the tiles' running count (`scan_unrolled`: one
  fused kernel of log2 steps each), so no pass over the E items runs besides the sort."""
  n = sorted_bucket.shape[0]
  first = jnp.searchsorted(sorted_bucket, jnp.arange(num_buckets + 1, dtype=jnp.int32),
                           side="left", method="scan_unrolled").astype(jnp.int32)
  counts = first[1:] - first[:-1]
  tiles = -(-counts // q_tile)
  tile_end = jnp.cumsum(tiles)  # tiles up to and including each bucket
  num_tiles = -(-n // q_tile) + min(n, num_buckets)
  tile = jnp.arange(num_tiles, dtype=jnp.int32)
  owner = jnp.searchsorted(tile_end, tile, side="right", method="scan_unrolled").astype(jnp.int32)
  safe = jnp.minimum(owner, num_buckets - 1)
  start = first[safe] + (tile - (tile_end[safe] - tiles[safe])) * q_tile
  return jnp.where(owner < num_buckets, start, n)


def sibling_scores_pallas(q, k, cand, geo: Geometry, *, interpret: bool, config: SelectionConfig,
                          row0: int = 0, offset=None):
  """Stage 2 by sibling groups (`sibling_tile_kernel`) of candidates `[R, NC]`, rows row0 ..
  row0 + R - 1 of `[B*T*HKV, NC]`: float32 scores `[R * NC + 1]`, as `leaf_scores_pallas`
  returns them (the last element the trash slot; slots of groups without a needed leaf are
  left unwritten). offset: None, or int32 `[1]`, the position of q's first row among the keys."""
  b, t, hq, d = q.shape
  rows = cand.shape[0]
  g = geo.branching
  groups = geo.num_slots // g
  num_pairs = rows * geo.num_slots
  if num_pairs > MAX_PAIRS:
    raise ValueError(f"{num_pairs} pairs in one launch, past {MAX_PAIRS}: split with row_chunks")
  o_row = jnp.arange(row0, row0 + rows)  # (b * Tq + t) * HKV + h
  t_row = ((o_row // geo.hkv) % t)[:, None]
  if offset is not None:
    t_row = t_row + offset[0]
  need, _, _ = topk.leaf_needs_score(cand, t_row, geo)

  def grouped(x):
    """`[R, NC]` -> `[R, NG, g]`: slot p * g + j at [p, j] (slots past NG * g stay empty:
    beam * g <= NC)."""
    return x[:, :groups * g].reshape(rows, groups, g)

  # A group's first child is valid wherever a sibling is (lower id, same parent), so it names
  # the kept level-2 node wherever the group needs a score.
  need_group = jnp.any(grouped(need), axis=-1)
  node = grouped(cand)[..., 0] // g
  parents = -(-geo.num_blocks // g)
  num_buckets = b * geo.hkv * parents
  bh = (o_row // (t * geo.hkv)) * geo.hkv + o_row % geo.hkv
  bucket = jnp.where(need_group, bh[:, None] * parents + node, num_buckets).reshape(-1)
  num_entries = rows * groups
  # Group the entries by node, stably (by query inside a node); the sort returns the sorted
  # buckets beside the entries.
  sorted_bucket, order = lax.sort((bucket, jnp.arange(num_entries, dtype=jnp.int32)),
                                  num_keys=1, is_stable=True)
  starts = tile_starts(sorted_bucket, num_buckets, config.q_tile)
  return launch(
      functools.partial(sibling_tile_kernel, geo=geo, q_tile=config.q_tile,
                        num_entries=num_entries, trash=num_pairs, row0=row0),
      jax.ShapeDtypeStruct((num_pairs + 1,), jnp.float32), starts.shape[0], config,
      config.leaf_warps, interpret, f"pisa_select_sibling_q{config.q_tile}", q.reshape(-1, d),
      k.reshape(-1, d), starts, sorted_bucket, order)


def final_topk_pallas(cand, scores, geo: Geometry, *, interpret: bool, config: SelectionConfig,
                      row0: int = 0, offset=None, rel=None):
  """Stage 2 final Select_K: candidates `[R, NC]` (rows row0 .. row0 + R - 1 of
  `[B*T*HKV, NC]`) and their scores -> `[R, KP]`. rel: None, or int32 `[R]` for packed rows,
  each query's position in its document."""
  rows = cand.shape[0]
  tile = config.topk_rows
  extra = offset_input(offset) if rel is None else (rel,)
  out = launch(functools.partial(final_topk_kernel, geo=geo, rows=tile, num_rows=rows,
                                 topk_impl=config.topk_impl, row0=row0, packed=rel is not None),
               jax.ShapeDtypeStruct((rows + 1, geo.top_k_padded), jnp.int32), -(-rows // tile),
               config, config.topk_warps, interpret, f"pisa_select_final_topk_{config.topk_impl}",
               cand, scores, *extra)
  return out[:rows]


def select_two_stage(q, k, summaries, geo: Geometry, *, interpret: bool,
                     config: SelectionConfig, offset=None):
  """The two-stage variant over the pyramid `summaries`: int32 `[B*Tq*HKV, KP]`; offset: None,
  or int32 `[1]` (`geo.has_offset`)."""
  cand = leaf_candidates_pallas(q, k, summaries, geo, interpret=interpret, config=config,
                                offset=offset)
  outs = []
  for r0, r1 in row_chunks(cand.shape[0], geo.num_slots):
    part = cand if r1 - r0 == cand.shape[0] else cand[r0:r1]
    scores = sibling_scores_pallas(q, k, part, geo, interpret=interpret, config=config, row0=r0,
                                   offset=offset)
    outs.append(final_topk_pallas(part, scores, geo, interpret=interpret, config=config, row0=r0,
                                  offset=offset))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs)
