"""Block selection: PISA's pyramid walk (Section 3.2, Appendix B), its variants, and flat baselines.

Every selector returns, per query position t and KV head, the leaf blocks to attend to:
int32 `[B, T, HKV, top_k]`, ascending, padded with -1 when fewer than top_k blocks are eligible.
The jnp reference here is the contract that the Pallas kernels in `pisa_jax.kernels` reproduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _dispatch, _validation, segments
from pisa_jax.geometry import node_span
from pisa_jax.kernels import packed_pyramid as packed_pyramid_kernels
from pisa_jax.kernels.selection import packed as packed_selection_kernels
from pisa_jax.kernels.selection import packed_walk as packed_walk_kernels
from pisa_jax.pyramid import build_pyramid_reference
from pisa_jax.spec import SelectionSpec, takes_spec

_HIGHEST = lax.Precision.HIGHEST
# Select_K's ranking keys: a NaN score ranks as the largest float32, every other score is clamped
# strictly below it (and above -inf, the mark of an ineligible candidate).
_NAN_RANK = float(np.finfo(np.float32).max)
_SCORE_LIMIT = float(np.nextafter(np.float32(_NAN_RANK), np.float32(0)))


def reduce_scores(z: Float[Array, "... R"], valid, selector: str) -> Float[Array, "..."]:
  """One candidate's score for one query head from its children's logits z (masked by `valid`).

  Eq. 21 ("pisa"): log-sum-exp; Eq. 33 ("pisa1"): the mean; Eq. 34 ("pisa2"): the mean plus half
  the population variance.
  """
  if selector == "pisa":
    return jax.nn.logsumexp(jnp.where(valid, z, -jnp.inf), axis=-1)
  count = jnp.maximum(valid.sum(axis=-1), 1).astype(jnp.float32)
  mean = jnp.where(valid, z, 0.0).sum(axis=-1) / count
  if selector == "pisa1":
    return mean
  var = jnp.where(valid, jnp.square(z - mean[..., None]), 0.0).sum(axis=-1) / count
  return mean + 0.5 * var


def forced_leaves(positions: Int[Array, "Tc"], block_size: int) -> tuple[Array, Array]:
  """The first, previous and current leaf block of each query, `[Tc, 3]`, and which exist."""
  cur = positions // block_size
  leaves = jnp.stack([jnp.zeros_like(cur), cur - 1, cur], axis=-1)
  return leaves, leaves >= 0


def _sort_ascending_padded(idx: Int[Array, "... K"]) -> Int[Array, "... K"]:
  """Sorts valid indices ascending, with the -1 padding moved to the end."""
  big = jnp.iinfo(jnp.int32).max
  srt = jnp.sort(jnp.where(idx < 0, big, idx), axis=-1)
  return jnp.where(srt == big, -1, srt)


def _keep(cand, valid, forced, scores, keep: int):
  """Select_K of Eq. 17 with the forced-node rule of Appendix B.

  Args:
    cand: int32 `[..., n]` candidate node ids (ascending among the valid ones).
    valid: `[..., n]` eligible and existing.
    forced: `[..., n]` forced nodes (always also valid).
    scores: float32 `[..., n]` group-summed scores (unused for forced nodes).
    keep: how many nodes to keep.

  Returns:
    int32 `[..., keep]` kept node ids ascending, -1 padded.
  """
  # If the eligible candidates number <= keep, all are kept without scoring.
  keep_all = valid.sum(axis=-1, keepdims=True) <= keep
  # Forced nodes first (+inf), then NaN scores (the largest float), then the highest scores
  # (clamped inside the float range, so -inf still marks only the ineligible). A NaN score comes
  # from a NaN query or key: ranking it first keeps that key's block in the selection, where
  # attention turns it into a NaN output instead of dropping it silently. lax.top_k breaks ties
  # by array position, and candidates are ordered by node id, so ties go to the lower index.
  key = jnp.where(jnp.isnan(scores), _NAN_RANK, jnp.clip(scores, -_SCORE_LIMIT, _SCORE_LIMIT))
  key = jnp.where(forced, jnp.inf, key)
  key = jnp.where(keep_all, 0.0, key)
  key = jnp.where(valid, key, -jnp.inf)
  n = key.shape[-1]
  if n < keep:
    key = jnp.pad(key, [(0, 0)] * (key.ndim - 1) + [(0, keep - n)], constant_values=-jnp.inf)
    cand = jnp.pad(cand, [(0, 0)] * (cand.ndim - 1) + [(0, keep - n)], constant_values=-1)
  values, slots = lax.top_k(key, keep)
  kept = jnp.take_along_axis(cand, slots, axis=-1)
  return _sort_ascending_padded(jnp.where(values == -jnp.inf, -1, kept))


def _expand(kept: Int[Array, "B Tc H n"], branching: int) -> Int[Array, "B Tc H m"]:
  """Eq. 18: kept nodes expand to their children (-1 stays -1)."""
  child = kept[..., None] * branching + jnp.arange(branching)
  return jnp.where(kept[..., None] >= 0, child, -1).reshape(*kept.shape[:3], -1)


def _first_top_k(cand: Int[Array, "B Tc H n"], top_k: int) -> Int[Array, "B Tc H K"]:
  """The leaf candidates as top_k slots, -1 padded."""
  if cand.shape[-1] < top_k:
    cand = jnp.pad(cand, [(0, 0)] * 3 + [(0, top_k - cand.shape[-1])], constant_values=-1)
  return cand[..., :top_k]


def _child_scores(qg, source, base, count, *, width, scale, selector):
  """Group-summed scores `[B, Tc, HKV, n]` of candidates whose children are the rows base ..
  base + count - 1 (count <= width) of source `[B, N, HKV, D]` (raw keys, or the summaries one
  level down): Eq. 21 / 33 / 34 per head over the children's logits, Eq. 22 over the group."""
  b, hkv = source.shape[0], source.shape[2]
  b_idx = jnp.arange(b)[:, None, None, None, None]
  h_idx = jnp.arange(hkv)[None, None, :, None, None]
  child = base[..., None] + jnp.arange(width)
  vecs = source[b_idx, jnp.clip(child, 0, source.shape[1] - 1), h_idx].astype(jnp.float32)
  # [B, Tc, HKV, G, n, R] logits of every query head against every child.
  z = scale * jnp.einsum("bthgd,bthnrd->bthgnr", qg, vecs, precision=_HIGHEST)
  child_valid = jnp.arange(width) < count[..., None]
  return reduce_scores(z, child_valid[:, :, :, None], selector).sum(axis=3)


def _walk_chunk(positions, q, start, length, first_node, k, summaries, *, spec: SelectionSpec):
  """The walk (Eq. 16-18, Appendix B) for one chunk of queries: q `[B, Tc, HQ, D]` -> int32
  `[B, Tc, HKV, top_k]`.

  One document (start, length, first_node None): the sequence, its pyramid `summaries` (levels
  `[B, M_l, HKV, D]`). Packed rows: start, length `[B, Tc]` and first_node `[B, Tc, L]` from
  `segments.documents`, summaries the `PackedPyramid` levels; the walk starts at the top level a
  T-token document could have, and above a document's root a level holds one node
  (`segments.level_node_counts`), kept unscored, so from the root down it makes the document's
  own decisions on the same candidates in the same order. One document is the packed case of a
  single document at 0 of length T, whose nodes start at slot 0 of every level.
  """
  block_size, top_k, beam, branching = spec.block_size, spec.top_k, spec.beam, spec.branching
  b, tc, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, tc, hkv, hq // hkv, d)
  child_scores = functools.partial(_child_scores, scale=spec.scale, selector=spec.selector)
  rel = positions[None, :] - (0 if start is None else start)  # the position in the document
  leaves, leaf_exists = forced_leaves(rel, block_size)  # [B or 1, Tc, 3]
  t = rel[:, :, None, None]

  def size(level):
    """The document's nodes at `level`: M_l, or `[B, Tc, 1, 1]` for packed rows."""
    if start is None:
      return summaries[level - 1].shape[1]
    counts = segments.level_node_counts(first_node, length, level, block_size, branching)
    return counts[:, :, None, None]

  def first(array, level):
    """The document's first slot at `level` of the packed layout (0 for one document)."""
    return 0 if start is None else array[:, :, level - 1][:, :, None, None]

  # Eq. 16-18: the walk starts at the root, A^(L) = {1}.
  cand = jnp.zeros((b, tc, hkv, 1), jnp.int32)
  for level in range(len(summaries), 0, -1):
    keep = top_k if level == 1 else beam
    span = node_span(level, block_size, branching)
    # A node is eligible when its first key position is <= t.
    valid = (cand >= 0) & (cand < size(level)) & (cand * span <= t)
    # Forced nodes at this level: the ancestors of the first, previous and current leaves.
    ancestors = leaves // (branching ** (level - 1))
    forced = valid & jnp.any(
        (cand[..., :, None] == ancestors[:, :, None, None, :]) & leaf_exists[:, :, None, None, :],
        axis=-1)
    n = cand.shape[-1]
    if n <= keep:
      kept = _sort_ascending_padded(jnp.where(valid, cand, -1))
    else:
      safe = jnp.where(valid, cand, 0)
      if level == 1:
        # Eq. 21 with l = 1: the block's raw keys (the exact LSE), from the document's start.
        source, width = k, block_size
        base = (0 if start is None else start[:, :, None, None]) + safe * block_size
        count = (k.shape[1] if start is None else length[:, :, None, None]) - safe * block_size
      else:
        # The children's summaries, at the document's slots of the level below.
        source, width = summaries[level - 2], branching
        base = first(first_node, level - 1) + safe * branching
        count = size(level - 1) - safe * branching
      count = jnp.where(valid, jnp.clip(count, 0, width), 0)
      scores = child_scores(qg, source, base, count, width=width)
      kept = _keep(cand, valid, forced, jnp.where(valid, scores, 0.0), keep)
    cand = kept if level == 1 else _expand(kept, branching)
  return _first_top_k(cand, top_k)


def flat_top_k(scores: Float[Array, "B Tc H M"], positions, *, block_size: int, top_k: int):
  """Flat Select_K over all leaf blocks with the forced-block rule, for "bsa", "exact" and the
  full-attention reference set of `selection_quality`.

  Blocks 0..cur are eligible; the first, previous and current blocks are forced; if at most top_k
  are eligible all are kept; the rest go to the highest scores, ties to the lower index.
  positions: `[Tc]`, or `[B, Tc]` (packed rows: each query's position in its document).
  """
  num_blocks = scores.shape[-1]
  blocks = jnp.arange(num_blocks, dtype=jnp.int32)
  if positions.ndim == 1:
    cur = (positions // block_size)[None, :, None, None]
  else:
    cur = (positions // block_size)[:, :, None, None]
  valid = blocks <= cur
  forced = valid & ((blocks == 0) | (blocks == cur - 1) | (blocks == cur))
  cand = jnp.broadcast_to(blocks, scores.shape)
  return _keep(cand, valid, forced, scores, top_k)


def _bsa_chunk(positions, q, start, first_leaf, leaves, *, spec: SelectionSpec, num_blocks=None,
               bsa_scores=None):
  """BSA for one chunk: per-head softmax over the blocks complete at t, summed over the group, as
  the score of each complete block before the current one.

  One document (start, first_leaf None): the leaf summaries `[B, M, HKV, D]` are the sequence's.
  Packed rows: each query scores its document's leaves, the `num_blocks` (= ceil(T / C), the most
  a document has) packed slots from its first leaf `[B, Tc]`. bsa_scores: None, or a kernel
  (qg, leaves, first_leaf, rel) -> the group-summed scores.
  """
  block_size, top_k, scale = spec.block_size, spec.top_k, spec.scale
  b, tc, hq, d = q.shape
  hkv = leaves.shape[2]
  qg = q.astype(jnp.float32).reshape(b, tc, hkv, hq // hkv, d)
  rel = positions[None, :] - (0 if start is None else start)  # the position in the document
  if bsa_scores is not None:
    return flat_top_k(bsa_scores(qg, leaves, first_leaf, rel), rel, block_size=block_size,
                      top_k=top_k)
  # Eq. 4 with the mean-key summaries of Eq. 2, over the document's blocks.
  if first_leaf is None:
    blocks = jnp.arange(leaves.shape[1])
    z = scale * jnp.einsum("bthgd,bmhd->bthgm", qg, leaves, precision=_HIGHEST)
  else:
    blocks = jnp.arange(num_blocks)
    slot = jnp.minimum(first_leaf[:, :, None] + blocks, leaves.shape[1] - 1)
    doc_leaves = leaves[jnp.arange(b)[:, None, None], slot]  # [B, Tc, M, HKV, D]
    z = scale * jnp.einsum("bthgd,btmhd->bthgm", qg, doc_leaves, precision=_HIGHEST)
  t = rel[:, :, None, None, None]
  # The softmax normalises over every block whose last key is at or before t (fla's NSA, which
  # the paper's BSA follows): the current block too when t is its last position.
  complete = blocks < (t + 1) // block_size
  past = blocks < t // block_size  # the scored candidates; the current block is forced
  probs = jax.nn.softmax(jnp.where(complete, z, -jnp.inf), axis=-1, where=complete)
  probs = jnp.where(past, probs, 0.0)
  return flat_top_k(probs.sum(axis=3), rel, block_size=block_size, top_k=top_k)


def block_log_mass(positions, q, k, *, block_size: int, scale: float, causal_in_block: bool):
  """Per-head raw-key LSE of every leaf block, `[B, Tc, HKV, G, M]` (Eq. 55).

  With `causal_in_block`, keys after the query are left out (the diagnostic's a(B)); without it,
  every key of the block counts (the "exact" selector scores only complete past blocks anyway).
  """
  b, tc, hq, d = q.shape
  seq_len, hkv = k.shape[1], k.shape[2]
  num_blocks = -(-seq_len // block_size)
  qg = q.astype(jnp.float32).reshape(b, tc, hkv, hq // hkv, d)
  z = scale * jnp.einsum("bthgd,bshd->bthgs", qg, k.astype(jnp.float32), precision=_HIGHEST)
  pad = num_blocks * block_size - seq_len
  z = jnp.pad(z, [(0, 0)] * 4 + [(0, pad)]).reshape(*z.shape[:4], num_blocks, block_size)
  key_pos = jnp.arange(num_blocks * block_size).reshape(num_blocks, block_size)
  visible = key_pos < seq_len
  if causal_in_block:
    visible = visible & (key_pos <= positions[None, :, None, None, None, None])
  return jax.nn.logsumexp(jnp.where(visible, z, -jnp.inf), axis=-1)


def _exact_chunk(positions, q, start, length, k, *, spec: SelectionSpec):
  """Exhaustive selection: every complete past block of the query's document by its exact
  raw-key LSE, summed over heads. One document (start, length None): `block_log_mass`. Packed
  rows: the document's window of the same `[T]` logits, its keys from its start."""
  block_size, top_k, scale = spec.block_size, spec.top_k, spec.scale
  if start is None:
    lse = block_log_mass(positions, q, k, block_size=block_size, scale=scale,
                         causal_in_block=False)
  else:
    b, tc, hq, d = q.shape
    seq_len, hkv = k.shape[1], k.shape[2]
    num_blocks = -(-seq_len // block_size)
    qg = q.astype(jnp.float32).reshape(b, tc, hkv, hq // hkv, d)
    z = scale * jnp.einsum("bthgd,bshd->bthgs", qg, k.astype(jnp.float32), precision=_HIGHEST)
    offset = jnp.arange(num_blocks * block_size)
    key_pos = jnp.minimum(start[:, :, None] + offset, seq_len - 1)
    z = jnp.take_along_axis(z, key_pos[:, :, None, None, :], axis=-1)
    visible = (offset < length[:, :, None])[:, :, None, None, :]
    z = jnp.where(visible, z, -jnp.inf).reshape(*z.shape[:4], num_blocks, block_size)
    lse = jax.nn.logsumexp(z, axis=-1)
  rel = positions[None, :] - (0 if start is None else start)
  cur = (rel // block_size)[:, :, None, None]
  scores = jnp.where(jnp.arange(lse.shape[-1]) < cur, lse.sum(axis=3), 0.0)
  return flat_top_k(scores, rel, block_size=block_size, top_k=top_k)


@takes_spec
@functools.partial(jax.jit, static_argnames=("spec",))
def select_blocks_reference(q, k, *, spec: SelectionSpec):
  """jnp reference of `select_blocks`; the spec already checked and resolved (or its fields as
  keywords)."""
  return _select(q, k, None, None, spec)


@takes_spec
@functools.partial(jax.jit, static_argnames=("spec",))
def select_blocks_reference_offset(q, k, query_offset, *, spec: SelectionSpec):
  """Rows query_offset .. query_offset + Tq - 1 of `select_blocks_reference(q_all, k, ...)`, any
  selector: q `[B, Tq, HQ, D]` those queries, k `[B, T, HKV, D]` every key (the pyramid is all
  of k's), query_offset an int32 scalar, traced or not (a device's place in a sharded sequence)."""
  positions = query_offset + jnp.arange(q.shape[1], dtype=jnp.int32)
  return _select(q, k, positions, None, spec)


@takes_spec
@functools.partial(jax.jit, static_argnames=("spec",))
def select_blocks_packed_reference(q, k, segment_ids, *, spec: SelectionSpec):
  """jnp reference of `select_blocks` with segment_ids; arguments are already validated. Against
  the one-document reference: the walk scores the same candidates per query (levels above a short
  document's root kept unscored); "bsa" gathers each query's document leaves `[M, HKV, D]` beside
  the same `[M]` scores per head; "exact" takes the document's window of the same `[T]` logits."""
  return _select(q, k, None, segment_ids, spec)


@takes_spec
@functools.partial(jax.jit, static_argnames=("spec", "interpret"))
def select_blocks_packed_pallas(q, k, segment_ids, *, spec: SelectionSpec, interpret: bool):
  """`select_blocks` with segment_ids on the Pallas kernels, for "pisa", "pisa1", "pisa2" and
  "bsa" ("exact" is reference-only, as without segment_ids).

  What runs where: the packed pyramid is `kernels.packed_pyramid`. Where
  `kernels.selection.packed_walk.covers` (beam * g <= 16: the default K = 8, g = 2) the whole
  walk is one fused kernel launch; wider sets (K = 32, beams) take the two-stage pipeline of
  the unpacked selection with document geometry (`packed_walk.select_packed_two_stage`); "bsa"
  scores in `kernels.selection.packed` with its flat top-k in XLA.
  """
  return _select(q, k, None, segment_ids, spec, interpret=interpret)


def _select(q, k, positions, segment_ids, spec: SelectionSpec, interpret=None):
  """The selection of the queries q at positions (None: q holds all T, at 0 .. T-1), of one
  document (segment_ids None) or of packed documents (`pisa_jax.segments`: a query selects among
  its own document's blocks, in the document's numbering, with everything its document's, as the
  document would run alone from position 0).

  interpret None runs the reference; a bool (packed rows only) the Pallas kernels in that mode:
  the packed pyramid, then the fused packed walk, the packed two-stage or the BSA scores.
  """
  b, n_queries, hq, d = q.shape
  seq_len, hkv = k.shape[1], k.shape[2]
  block_size, branching, selector = spec.block_size, spec.branching, spec.selector
  num_blocks = -(-seq_len // block_size)
  docs = None if segment_ids is None else segments.documents(segment_ids, block_size, branching)
  start, length, first_node = (None, None, None) if docs is None else (
      docs.start, docs.length, docs.first_node)
  if selector == "exact":
    # Packed rows: twice the logits, all T of them and the document's window of them.
    per_query = (3 if docs is None else 6) * b * hq * num_blocks * block_size
    fn = functools.partial(_exact_chunk, spec=spec)
    return _chunking.map_query_chunks(fn, _chunking.query_chunk_size(n_queries, per_query),
                                      (q, start, length), (k,), positions=positions)
  kernels = interpret is not None
  if docs is None:
    pyramid = build_pyramid_reference(k, block_size=block_size, branching=branching,
                                      summary_dtype=spec.summary_dtype)
  elif kernels:
    pyramid = packed_pyramid_kernels.build_packed_pyramid_pallas(
        k, segment_ids, block_size=block_size, branching=branching, interpret=interpret)
  else:
    pyramid = segments.packed_pyramid(k, docs, block_size=block_size, branching=branching)
  if kernels and spec.hierarchical:
    # As unpacked: the fused walk (every level in one launch) at beam * g <= 16 candidate slots,
    # the two-stage pipeline (walk, leaf tiles, final Select_K) past them.
    fused = packed_walk_kernels.covers(selector, spec.beam, branching)
    return (packed_walk_kernels.select_packed_fused if fused else
            packed_walk_kernels.select_packed_two_stage)(
        q, k, start, length, first_node, pyramid.summaries, spec=spec, interpret=interpret)
  if selector == "bsa":
    # Packed rows: each query's document's leaves, [M, HKV, D], beside the scores.
    per_query = 3 * b * hq * num_blocks + (0 if docs is None else b * num_blocks * hkv * d)
    scores = functools.partial(packed_selection_kernels.bsa_scores_pallas,
                               block_size=block_size, num_blocks=num_blocks, scale=spec.scale,
                               interpret=interpret) if kernels else None
    fn = functools.partial(_bsa_chunk, spec=spec, num_blocks=num_blocks, bsa_scores=scores)
    first_leaf = None if docs is None else first_node[..., 0]
    return _chunking.map_query_chunks(fn, _chunking.query_chunk_size(n_queries, per_query),
                                      (q, start, first_leaf), (pyramid.summaries[0],),
                                      positions=positions)
  fn = functools.partial(_walk_chunk, spec=spec)
  return _chunking.map_query_chunks(fn, _walk_chunk_size(q, k, spec),
                                    (q, start, length, first_node), (k, pyramid.summaries),
                                    positions=positions)


def _walk_chunk_size(q, k, spec: SelectionSpec) -> int:
  """Queries per chunk of the walk: its gathered children `[Tc, HKV, max(K, beam) g, max(C, g)]`
  and their logits stay near CHUNK_ELEMENTS."""
  b, n_queries, hq, d = q.shape
  hkv = k.shape[2]
  width = max(spec.top_k, spec.beam) * spec.branching
  return _chunking.query_chunk_size(
      n_queries, b * hkv * width * max(spec.block_size, spec.branching) * (d + hq // hkv))


@takes_spec
def select_blocks_reference_at(q, k, positions, *, spec: SelectionSpec, chunk: int | None = None):
  """The hierarchical reference for some query positions only (long-sequence spot checks).

  Selection for query t depends only on q_t and the pyramid of all keys (eligibility and the
  forced rule read t), so these rows equal `select_blocks_reference`'s rows at `positions`.

  Args:
    q: the queries at `positions`, `[B, P, HQ, D]`; k: all keys `[B, T, HKV, D]`.
    positions: int32 `[P]`, each in [0, T).
    chunk: queries per `lax.map` step; None sizes it as the full reference does.

  Returns:
    int32 `[B, P, HKV, top_k]`.
  """
  if not spec.hierarchical:
    raise ValueError(f"selector={spec.selector!r} must be 'pisa', 'pisa1' or 'pisa2' (the "
                     "hierarchical walk)")
  if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.ndim != 1:
    raise TypeError(f"positions must be a 1-D integer array [P], got {positions.dtype} "
                    f"{positions.shape}")
  if not isinstance(positions, jax.core.Tracer):
    bad = (positions < 0) | (positions >= k.shape[1])
    if bool(jnp.any(bad)):
      raise ValueError(f"positions must lie in [0, {k.shape[1]}) (T = k.shape[1]), got "
                       f"{positions[bad][:4].tolist()}")
  if q.shape[1] != positions.shape[0]:
    raise ValueError(f"q.shape[1]={q.shape[1]} must equal positions.shape[0]="
                     f"{positions.shape[0]}: q holds the queries at those positions")
  pyramid = build_pyramid_reference(k, block_size=spec.block_size, branching=spec.branching,
                                    summary_dtype=spec.summary_dtype)
  fn = functools.partial(_walk_chunk, spec=spec)
  return _chunking.map_query_chunks(fn, chunk or _walk_chunk_size(q, k, spec),
                                    (q, None, None, None), (k, pyramid.summaries),
                                    positions=positions)


def select_blocks(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    *,
    block_size: int | None = None,
    top_k: int | None = None,
    branching: int | None = None,
    selector: str | None = None,
    scale: float | None = None,
    beam: int | None = None,
    summary_dtype=None,
    spec: SelectionSpec | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Int[Array, "B T HKV K"]:
  """Selects top_k leaf blocks per query position and KV head.

  Args:
    q: queries `[B, T, HQ, D]`.
    k: keys `[B, T, HKV, D]`; HQ must be a multiple of HKV. Causal: query t sees keys 0..t.
    block_size: C, keys per leaf block (default 64).
    top_k: K, blocks selected per query (>= 3: first, previous and current are forced; default
      8).
    branching: g, children per upper pyramid node (default 2).
    selector: "pisa" (LSE, Eq. 21; the default), "pisa1" (mean, Eq. 33), "pisa2" (mean +
      variance / 2, Eq. 34), "bsa" (flat, per-head softmax over mean-key summaries summed over
      the group) or "exact" (flat, exact raw-key LSE of every complete past block: PISA's upper
      bound; xla only).
    scale: logit scale, default 1/sqrt(D).
    beam: nodes kept at each level above the leaves (None: top_k, the paper's rule); the leaf
      level always keeps top_k. Hierarchical selectors only.
    summary_dtype: the pyramid's stored dtype, "float32" (default) or "bfloat16" (or
      `jnp.bfloat16`): each mean computed in float32 and rounded once; scores accumulate in
      float32, a bfloat16 query meets a bfloat16 summary in one dot. Not with segment_ids.
    spec: the seven options above as one `pisa_jax.SelectionSpec` (its defaults are the ones
      listed); an option also passed as a keyword must agree with it.
    segment_ids: None, or int32 `[B, T]` non-decreasing within a row: packed documents (runs of
      equal ids). Each query then selects as its document would alone from position 0: the
      document's own block grid from its first token, its own pyramid, forced blocks and
      eligibility, and indices are the document's own block numbers (`pisa_jax.segments`).
      On "pallas" see `select_blocks_packed_pallas` for what runs in kernels.
    implementation: "xla" (jnp reference), "pallas" (kernel) or None (pallas on GPU, else xla).

  Options (everything but q and k) fix shapes or compiled code: under `jax.jit` pass them as
  static arguments or bind them first, e.g. `jax.jit(select_blocks, static_argnames=("top_k",))`.

  Non-finite inputs: a NaN query or key makes the scores it enters NaN, and Select_K ranks a NaN
  score after the forced blocks and before every number (ties to the lower index), so the block
  of a NaN key is kept wherever there is room and attention shows the NaN. A query whose scores
  are all NaN keeps its forced blocks, then the lowest block indices.

  Returns:
    int32 `[B, T, HKV, top_k]`: leaf block indices ascending, -1 padded when fewer than top_k
    blocks are eligible (min(top_k, t // block_size + 1) are valid, t the query's position in its
    document).
  """
  _validation.check_static("select_blocks", implementation=implementation)
  _, _, _, _, d = _validation.check_qk(q, k)
  spec = _validation.resolve_spec("select_blocks", spec, d, block_size=block_size, top_k=top_k,
                                  branching=branching, selector=selector, scale=scale, beam=beam,
                                  summary_dtype=summary_dtype)
  _validation.check_segment_ids(segment_ids, batch=q.shape[0], seq_len=q.shape[1])
  if spec.selector == "exact" and _dispatch.resolve_implementation(implementation) != "xla":
    raise ValueError(
        f"selector={spec.selector!r} exists only in the reference: pass implementation='xla' "
        "for it")
  if segment_ids is not None:
    _validation.check_packed_summary_dtype(spec)
    return _dispatch.lookup("select_blocks_packed", implementation)(q, k, segment_ids, spec=spec)
  return _dispatch.lookup("select_blocks", implementation)(q, k, spec=spec)
