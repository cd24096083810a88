"""Helpers for checking kernels against the reference: float64 re-walks and near-tie proofs.

A selection kernel scores blocks in float32 in another summation order than the jnp reference, so
where two candidates' scores are within float32 rounding of each other the two may keep different
blocks. Such a row is accepted only with a proof: `decision_margin` re-walks the row in float64
(plain numpy loops over one (batch, query, KV head), independent of both implementations) and
returns the smallest relative gap between the last kept and the best dropped score over every
decision the row's selection made. A true mismatch has a large margin and fails the check.

`mismatch_margins` runs that proof over every row where two index arrays differ, and
`bsa_scores64` gives the float64 BSA score of every block of one row, to measure how far apart
two selectors' choices are. `nsa_mismatch_margins` is the proof for NSA's selection
(`pisa_jax.nsa_select_blocks`), from the compressed keys.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


def _round64(x: np.ndarray, summary_dtype: str) -> np.ndarray:
  """float64 means as a summary_dtype pyramid stores them (bfloat16: to nearest even)."""
  if summary_dtype == "float32":
    return x
  return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _levels64(k_td: np.ndarray, block_size: int, branching: int,
              summary_dtype: str = "float32") -> list[np.ndarray]:
  """float64 pyramid of one (batch, KV head): keys `[T, D]` -> levels `[M_l, D]`, leaves first.
  summary_dtype "bfloat16": each mean rounded once, and its parent pools the rounded values."""
  t = k_td.shape[0]
  m = -(-t // block_size)
  leaves = np.stack([k_td[i * block_size:(i + 1) * block_size].mean(0) for i in range(m)])
  levels = [_round64(leaves, summary_dtype)]
  while levels[-1].shape[0] > 1:
    x = levels[-1]
    levels.append(_round64(
        np.stack([x[i:i + branching].mean(0) for i in range(0, x.shape[0], branching)]),
        summary_dtype))
  return levels


def rel_gap(a: float, b: float) -> float:
  """|a - b| relative to the larger magnitude of the two."""
  return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _select64(cand, valid, forced, score, keep):
  """Select_K in float64; returns (kept ids, margin of the decision or inf if none was made)."""
  elig = [c for c, v in zip(cand, valid) if v]
  if len(elig) <= keep:
    return sorted(elig), np.inf
  kept = [c for c, v, f in zip(cand, valid, forced) if v and f]
  rest = sorted([(-s, c) for c, v, f, s in zip(cand, valid, forced, score) if v and not f])
  slots = keep - len(kept)
  chosen = rest[:slots]
  margin = np.inf
  if 0 < slots < len(rest):
    margin = rel_gap(-rest[slots - 1][0], -rest[slots][0])
  return sorted(kept + [c for _, c in chosen]), margin


def _reduce64(z: np.ndarray, selector: str) -> np.ndarray:
  """Per-head score over the last axis of z (Eq. 21, 33, 34)."""
  if selector == "pisa":
    m = z.max(-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[..., 0]
  mean = z.mean(-1)
  if selector == "pisa1":
    return mean
  return mean + 0.5 * z.var(-1)


def _query_rows(q, b: int, t: int, h: int, group: int) -> np.ndarray:
  """The group's query rows `[G, D]` in float64 (only this slice leaves the device)."""
  return np.asarray(q[b, t, h * group:(h + 1) * group], np.float64)


def _keys(k, b: int, h: int, cache: dict | None) -> np.ndarray:
  """One (batch, KV head)'s keys `[T, D]` in float64, cached per (b, h)."""
  if cache is not None and ("keys", b, h) in cache:
    return cache[("keys", b, h)]
  out = np.asarray(k[b, :, h], np.float64)
  if cache is not None:
    cache[("keys", b, h)] = out
  return out


def _levels(k, b: int, h: int, block_size: int, branching: int, cache: dict | None,
            summary_dtype: str = "float32"):
  """One (batch, KV head)'s float64 pyramid, cached per (b, h, block_size, branching, dtype)."""
  key = ("levels", b, h, block_size, branching, summary_dtype)
  if cache is not None and key in cache:
    return cache[key]
  out = _levels64(_keys(k, b, h, cache), block_size, branching, summary_dtype)
  if cache is not None:
    cache[key] = out
  return out


def bsa_scores64(q, k, b: int, t: int, h: int, *, block_size: int, scale: float,
                 cache: dict | None = None, summary_dtype: str = "float32") -> np.ndarray:
  """Row (b, t, h)'s float64 BSA score of each block before the current one, `[t // block_size]`.

  Each head's softmax over the mean-key summaries of every block complete at t, summed over the
  group (Eq. 4 with the summaries of Eq. 2): the softmax normalises over the (t + 1) // block_size
  leading blocks, so the current block joins the normaliser at its last position, but only the
  blocks before it are scored (it is forced).
  """
  hq, hkv = q.shape[2], k.shape[2]
  cur, done = t // block_size, (t + 1) // block_size
  if cur == 0:
    return np.zeros(0)
  # The leaves do not depend on branching.
  leaves = _levels(k, b, h, block_size, 2, cache, summary_dtype)[0]
  z = scale * _query_rows(q, b, t, h, hq // hkv) @ leaves[:done].T  # [G, done]
  p = np.exp(z - z.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True))[:, :cur].sum(0)


def decision_margin(q, k, b: int, t: int, h: int, *, block_size: int, top_k: int, branching: int,
                    selector: str, scale: float, beam: int, cache: dict | None = None,
                    summary_dtype: str = "float32") -> float:
  """Smallest relative score gap at a scored decision of row (b, t, h), walked in float64.

  q `[B, T, HQ, D]` and k `[B, T, HKV, D]` may be numpy or jax arrays of any float dtype: only
  the row's query heads and its KV head's keys are copied and upcast. `cache` (a dict the caller
  keeps across rows) holds each (b, h)'s float64 keys and pyramid. summary_dtype "bfloat16":
  the walk scores a bfloat16 pyramid's summaries (`_levels64`).
  """
  hq, hkv = q.shape[2], k.shape[2]
  seq_len = k.shape[1]
  cur = t // block_size
  forced_leaves = [x for x in (0, cur - 1, cur) if x >= 0]
  if selector == "bsa":
    m = -(-seq_len // block_size)
    cand = list(range(m))
    valid = [c <= cur for c in cand]
    forced = [c in forced_leaves for c in cand]
    p = bsa_scores64(q, k, b, t, h, block_size=block_size, scale=scale, cache=cache,
                     summary_dtype=summary_dtype)
    score = [p[c] if c < cur else 0.0 for c in cand]
    return _select64(cand, valid, forced, score, top_k)[1]
  qg = _query_rows(q, b, t, h, hq // hkv)  # [G, D]
  levels = _levels(k, b, h, block_size, branching, cache, summary_dtype)
  margin = np.inf
  cand = [0]
  for level in range(len(levels), 0, -1):
    keep = top_k if level == 1 else beam
    span = block_size * branching ** (level - 1)
    valid = [c < levels[level - 1].shape[0] and c * span <= t for c in cand]
    anc = {x // branching ** (level - 1) for x in forced_leaves}
    forced = [v and c in anc for c, v in zip(cand, valid)]
    score = []
    for c, v in zip(cand, valid):
      if not v:
        score.append(0.0)
        continue
      if level == 1:
        children = _keys(k, b, h, cache)[c * block_size:min((c + 1) * block_size, seq_len)]
      else:
        children = levels[level - 2][c * branching:(c + 1) * branching]
      score.append(float(_reduce64(scale * qg @ children.T, selector).sum()))
    kept, level_margin = _select64(cand, valid, forced, score, keep)
    margin = min(margin, level_margin)
    cand = [c * branching + j for c in kept for j in range(branching)] if level > 1 else kept
  return margin


def mismatch_margins(out, ref, q, k, *, positions=None, max_rows: int | None = None,
                     **selection) -> list[tuple[int, int, int, float]]:
  """`(b, t, h, margin)` of every row where index arrays `out` and `ref` differ.

  out, ref: int32 `[B, P, HKV, K]`, the rows of positions `positions` (default: all of 0..T-1).
  The margin is `decision_margin` of the row in float64; with `max_rows`, rows past the first
  `max_rows` mismatches get margin NaN (not proven). `selection`: block_size, top_k, branching,
  selector, scale, beam (and summary_dtype, default "float32") as passed to the selection.
  """
  out, ref = np.asarray(out), np.asarray(ref)
  if out.shape != ref.shape:
    raise ValueError(f"index arrays differ in shape: {out.shape} vs {ref.shape}")
  pos = np.arange(out.shape[1]) if positions is None else np.asarray(positions)
  cache: dict = {}
  rows = []
  for n, (b, i, h) in enumerate(np.argwhere(np.any(out != ref, axis=-1))):
    b, t, h = int(b), int(pos[i]), int(h)
    margin = (decision_margin(q, k, b, t, h, cache=cache, **selection)
              if max_rows is None or n < max_rows else float("nan"))
    rows.append((b, t, h, margin))
  return rows


def nsa_scores64(q, k_cmp, b: int, t: int, h: int, *, block_length: int, stride: int,
                 select_block_size: int, scale: float) -> np.ndarray:
  """Row (b, t, h)'s float64 NSA score of selection blocks 0 .. t // l' (Eq. 8-10), one document
  a row: each head's softmax over the compressed blocks complete at t, block i credited to
  selection block j once per d-token piece they share, summed over the group."""
  hq, hkv = q.shape[2], k_cmp.shape[2]
  cur = t // select_block_size
  seen = max(0, min((t + 1 - block_length) // stride + 1, k_cmp.shape[1]))
  score = np.zeros(cur + 1)
  if seen == 0:
    return score
  z = scale * _query_rows(q, b, t, h, hq // hkv) @ np.asarray(k_cmp[b, :seen, h], np.float64).T
  p = np.exp(z - z.max(-1, keepdims=True))
  p = (p / p.sum(-1, keepdims=True)).sum(0)  # [seen]
  i = np.arange(seen)[:, None]
  j = np.arange(cur + 1)[None, :]
  shared = (np.minimum(i * stride + block_length, (j + 1) * select_block_size)
            - np.maximum(i * stride, j * select_block_size))
  return p @ (np.maximum(shared, 0) / stride)


def _nsa_document(segment_ids, b: int, t: int, *, block_length: int, stride: int):
  """(start, first): the document start of row b's position t and the document's first
  compressed slot in the packed layout (`pisa_jax.nsa`: each document's blocks after the
  earlier documents'); (0, 0) without segment_ids."""
  if segment_ids is None:
    return 0, 0
  ids = np.asarray(segment_ids[b])
  starts = [0] + [int(i) for i in np.flatnonzero(ids[1:] != ids[:-1]) + 1]
  bounds = starts + [len(ids)]
  first = 0
  for i, start in enumerate(starts):
    if start <= t < bounds[i + 1]:
      return start, first
    first += max(0, (bounds[i + 1] - start - block_length) // stride + 1)
  raise ValueError(f"{t=} is not a position of row {b}")


def nsa_mismatch_margins(out, ref, q, k_cmp, *, block_length: int, stride: int,
                         select_block_size: int, top_n: int, scale: float,
                         max_rows: int | None = None,
                         segment_ids=None) -> list[tuple[int, int, int, float]]:
  """`(b, t, h, margin)` of every row where NSA index arrays `out` and `ref` `[B, T, HKV, n]`
  differ: the relative gap, in float64 (`nsa_scores64`), between the last kept and the best
  dropped of the scored blocks; with `max_rows`, later rows get NaN. segment_ids: None (one
  document a row), or the packed rows' `[B, T]` ids (k_cmp in the packed slot layout, indices
  document-relative): each row scored within its document."""
  out, ref = np.asarray(out), np.asarray(ref)
  if out.shape != ref.shape:
    raise ValueError(f"index arrays differ in shape: {out.shape} vs {ref.shape}")
  rows = []
  for n, (b, t, h) in enumerate(np.argwhere(np.any(out != ref, axis=-1))):
    b, t, h = int(b), int(t), int(h)
    if max_rows is not None and n >= max_rows:
      rows.append((b, t, h, float("nan")))
      continue
    start, first = _nsa_document(segment_ids, b, t, block_length=block_length, stride=stride)
    cur = (t - start) // select_block_size
    # The document alone: its queries from its start, its compressed blocks from its first slot
    # (nsa_scores64 reads only the blocks complete at t - start).
    score = nsa_scores64(q[b:b + 1, start:], k_cmp[b:b + 1, first:], 0, t - start, h,
                         block_length=block_length, stride=stride,
                         select_block_size=select_block_size, scale=scale)
    cand = list(range(cur + 1))
    forced = [c in (0, cur - 1, cur) for c in cand]
    score = [s if not f else 0.0 for s, f in zip(score, forced)]
    rows.append((b, t, h, _select64(cand, [True] * len(cand), forced, score, top_n)[1]))
  return rows


def random_block_indices(seed: int, seq_len: int, num_kv_heads: int, top_k: int,
                         block_size: int, *, batch: int = 1, thin_rows: float = 0.0) -> np.ndarray:
  """Valid causal block indices for attention tests and benchmarks, int32 `[B, T, HKV, K]`.

  Each row holds min(K, cur + 1) distinct blocks <= cur = t // block_size, the current block
  among them and the other K - 1 drawn uniformly from the past, ascending, then -1. With
  `thin_rows`, that fraction of rows keeps only its first n of those (n uniform in 0..all, so
  some rows lose the current block and some keep no block at all), padded with -1.
  """
  rng = np.random.default_rng(seed)
  shape = (batch, seq_len, num_kv_heads)
  cur = (np.arange(seq_len) // block_size)[None, :, None, None]
  m = top_k - 1
  # K-1 distinct past blocks from [0, cur): sorted draws from [0, cur - m] plus 0..m-1.
  span = np.maximum(cur - m + 1, 1)
  past = np.sort(np.floor(rng.random(shape + (m,)) * span).astype(np.int64), axis=-1)
  past = past + np.arange(m)
  # Rows with fewer than K-1 past blocks take all of them, then -1.
  all_past = np.broadcast_to(np.arange(m), past.shape)
  past = np.where(cur < m, np.where(all_past < cur, all_past, -1), past)
  idx = np.concatenate([past, np.broadcast_to(cur, shape + (1,))], axis=-1)
  idx = np.sort(np.where(idx < 0, np.iinfo(np.int64).max, idx), axis=-1)
  idx = np.where(idx == np.iinfo(np.int64).max, -1, idx)
  if thin_rows:
    count = (idx >= 0).sum(-1, keepdims=True)
    keep = np.floor(rng.random(shape + (1,)) * (count + 1)).astype(np.int64)
    thin = rng.random(shape + (1,)) < thin_rows
    idx = np.where(thin & (np.arange(top_k) >= keep), -1, idx)
  return idx.astype(np.int32)
