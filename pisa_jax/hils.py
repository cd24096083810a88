"""HiLS: chunk-sparse attention routed by learned landmarks, with a two-level softmax.

HiLS (Hu et al., 2026, "Hierarchical sparse attention done right") splits each document into
chunks of C tokens and attends, for query i, to a sliding window of recent keys and to the K
chunks before the window that its learned chunk scores rank highest. The chunk scores enter the
output's weights, so the language-model loss trains the routing. Per query head h:

  landmark     mu_c = the landmark query of chunk c's last token (a low-rank projection that the
               caller adds to the query projection);
               p_j = softmax_j(mu_c . k_j / sqrt(d)) over the chunk's C keys,
               k'_c = sum_j p_j k_j (landmark key), b'_c = -sum_j p_j log p_j (entropy bias);
  chunk score  s^_ic = lq_i . k'_c / sqrt(d) + b'_c, lq_i the landmark query of token i: a first
               order estimate of log sum_{j in c} exp(q_i . k_j / sqrt(d));
  eligible     chunks c < floor((r - W + 1) / C), r the query's position in its document, W the
               window: complete chunks that end before the window's first chunk boundary;
  window       keys from floor((r - W + 1) / C) C (0 at least) to r: the W most recent keys,
               widened back to a chunk boundary, so that the window and the eligible chunks
               cover the past without gap or overlap;
  selection    per KV head the top_k eligible chunks by max over its query heads of
               s^_ic - log(exp(lse_window) + sum_{c' eligible} exp(s^_ic')), under stop_gradient;
               -1 where fewer are eligible; ties to the lower chunk;
  output       one softmax over the window's logits s_ij, the selected chunks' estimates s^_ic and
               a zero logit (softmax1):
                 o_i = [sum_{j in window} e^{s_ij} v_j + sum_{c in TopK} e^{s^_ic} o_ic]
                       / [sum_{j in window} e^{s_ij} + sum_{c in TopK} e^{s^_ic} + 1],
               o_ic = sum_{j in c} (e^{s_ij} / Z_ic) v_j, so a key of chunk c weighs
               [e^{s_ij} / Z_ic] [e^{s^_ic} / (the denominator)]: the two-level softmax, with the
               window and the zero logit beside the chunks. Gradients reach the landmark query
               (both uses) and the keys through s^; the selection has none.

What is taken from the public implementation (Tencent-Hunyuan/HiLS-Attention, PyTorch and
TileLang: `models/FlashHiLS/hils_attention.py`, `ops/chunk_attn_pool_tilelang.py`,
`ops/topk_head_softmax.py`, `ops/flex_attn_tilelang.py`, `ops/hils_fwd_bwd_head.py`, and its
published 345M configuration: chunk 64, top-k 32, window 512, landmark rank 64):
  - The landmark query is the query projection plus a rank-r correction, lq = W_q x + B A x
    (`lmk_q_lora_dim`), RoPE'd at its own token like the query. It serves twice: at a chunk's
    last token as the chunk's prior query mu_c, and at every token i as the query of the chunk
    scores (not q_i itself). Landmarks are per query head; GQA groups share the selection.
  - RoPE is applied to keys before pooling: k'_c is a weighted mean of rotated keys and gets no
    rotation of its own. Its positions are HoPE (standard RoPE frequencies, the pairs whose
    period exceeds half the training length set to zero). The decoder's RoPE keeps the
    highest-frequency pairs of a full RoPE as well: `model.rope_fraction=1.0` with
    `model.rope_max_period=4096` is the public setting score for score (tests/test_model.py);
    the presets keep the paper's half of each head (Appendix C) for every kind, so that kinds
    compare on one backbone.
  - No chunk is forced into the top-k: the current and recent chunks are the window's, whose
    exact log-sum-exp competes with the chunk scores in one softmax, with a zero logit
    (`enable_softmax1`, on by default) as a sink. The selection score is the group maximum of
    each head's normalised log-probability, as in the public kernel.
  - One scale, 1 / sqrt(d), for the pooling, the chunk scores and the attention logits.
  - An incomplete (current) chunk never has a landmark; it is always inside the window.
Where we differ:
  - The public model inserts a landmark token after every C - 1 text tokens (an extra vocabulary
    entry whose key is masked everywhere, whose query is mu_c). We insert nothing: mu_c is the
    landmark query of the chunk's last text token, whose key is an ordinary key of its chunk
    (pooled, attended in the window and in the chunk). Chunks hold C text tokens.
  - The public q, k and landmark query pass through per-head RMSNorm (QK-norm). Ours are the
    decoder's projections, as for every other kind: raw by default; with `model.qk_norm` the
    query and key are normed and the landmark query is the normed query plus the rank-r
    correction, which is not normed.
  - Packed documents (`segment_ids`): each document has its own chunk grid from its first token
    and is computed exactly as if alone (the public kernels accept only chunk-aligned documents).

The references ("xla") are float32 inside whatever the input dtype, rounded to the input dtype
once. The attention runs over query chunks (`pisa_jax._chunking`) under `jax.checkpoint`, so
memory is bounded independently of T in the forward and the backward; the gradients are jax's
autodiff of that computation (dk and dv accumulate through gathers). `hils_attention` and
`hils_select_chunks` also have Pallas kernels ("pallas", the default on a GPU):
`kernels.hils_select` (the chunk scores fused with their top-k) and `kernels.hils` (the window
and the chunks in one two-level softmax, forward and backward); `hils_landmarks` and
`hils_chunk_scores` are the reference only (None means "xla"; "pallas" raises).
Inputs are taken to be finite: a non-finite key reaches every query whose selection or score
reads its chunk's landmark.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _dispatch, _validation, segments

_HIGHEST = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- geometry


def _chunk_geometry(segment_ids, batch: int, seq_len: int, chunk_size: int):
  """Where each token's document starts and where the row's complete chunks lie.

  Returns:
    start: int32 `[B, T]`, the first position of each token's document (0 without documents).
    first_slot: int32 `[B, T]`, the landmark slot of chunk 0 of each token's document: chunk j
      of that document has slot first_slot + j.
    ends: int32 `[B, N]`, N = T // C, the last position of the chunk in each slot; the row's
      complete chunks fill the first slots, documents in order (a complete chunk uses C tokens:
      a row never has more than N).
    slot_valid: bool `[B, N]`, whether a slot holds a chunk.
  """
  if segment_ids is None:
    segment_ids = jnp.zeros((batch, seq_len), jnp.int32)
  num_slots = seq_len // chunk_size
  start, _ = segments.document_bounds(segment_ids)
  t = jnp.arange(seq_len, dtype=jnp.int32)
  is_end = (t - start + 1) % chunk_size == 0
  count = jnp.cumsum(is_end, axis=1, dtype=jnp.int32)
  rows = jnp.arange(batch)[:, None]
  ends = jnp.zeros((batch, num_slots), jnp.int32).at[
      rows, jnp.where(is_end, count - 1, num_slots)].set(
          jnp.broadcast_to(t, (batch, seq_len)), mode="drop")
  slot_valid = jnp.arange(num_slots) < count[:, -1:]
  # Chunks that end before a document's first token: the slots of the documents before it.
  before = count - is_end.astype(jnp.int32)
  first_slot = jnp.take_along_axis(before, start, axis=1)
  return start, first_slot, ends, slot_valid


def window_chunks(window: int, chunk_size: int) -> int:
  """Chunk-grid blocks a query's window can touch: it holds at most W + C - 1 keys from a
  chunk boundary, so ceil((W - 1) / C) + 1 blocks."""
  return -(-(window - 1) // chunk_size) + 1


def _num_eligible(rel, window: int, chunk_size: int):
  """Chunks before the window of a query at document position `rel`: floor((r - W + 1) / C), at
  least 0. They are complete and end before r - W + 1."""
  return jnp.maximum((rel - window + 1) // chunk_size, 0)


# ----------------------------------------------------------------------------- landmarks


def _landmarks(k, prior, ends, slot_valid, *, chunk_size: int, scale: float):
  """Landmark keys `[B, N, HQ, D]` and entropy biases `[B, N, HQ]` of the chunks that end at
  positions ends `[B, N]` of k `[B, T, HKV, D]`, float32 (zero where slot_valid is False).
  prior `[B, N, HQ, D]`: each chunk's prior query, the landmark query of its last token."""
  b, seq_len, hkv, d = k.shape
  hq = prior.shape[2]
  num_slots = ends.shape[1]
  rows = jnp.arange(b)[:, None, None]
  pos = jnp.clip(ends[..., None] - (chunk_size - 1) + jnp.arange(chunk_size), 0, seq_len - 1)
  keys = k[rows, pos].astype(jnp.float32)  # [B, N, C, HKV, D]
  prior = prior.astype(jnp.float32).reshape(b, num_slots, hkv, hq // hkv, d)
  logits = scale * jnp.einsum("bnhgd,bnchd->bnhgc", prior, keys, precision=_HIGHEST)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  p = jnp.exp(log_p)
  landmark_k = jnp.einsum("bnhgc,bnchd->bnhgd", p, keys, precision=_HIGHEST)
  landmark_bias = -jnp.sum(p * log_p, axis=-1)
  valid = slot_valid[:, :, None, None]
  landmark_k = jnp.where(valid[..., None], landmark_k, 0.0).reshape(b, num_slots, hq, d)
  landmark_bias = jnp.where(valid, landmark_bias, 0.0).reshape(b, num_slots, hq)
  return landmark_k, landmark_bias


def _priors(landmark_q, ends):
  """The prior query of each chunk, `[B, N, HQ, D]`: landmark_q `[B, T, HQ, D]` at its last
  token."""
  return landmark_q[jnp.arange(landmark_q.shape[0])[:, None], ends]


def _document_chunk_scores(landmark_q, landmark_k, landmark_bias, first_slot, *, scale):
  """s^ `[B, Tq, HQ, N]` of each query against chunk j of its own document (slot first_slot + j),
  unmasked: entries past the document's chunks are finite and meaningless."""
  num_slots = landmark_k.shape[1]
  by_slot = scale * jnp.einsum("bthd,bnhd->bthn", landmark_q, landmark_k, precision=_HIGHEST)
  by_slot = by_slot + jnp.swapaxes(landmark_bias, 1, 2)[:, None]
  slot = jnp.clip(first_slot[..., None] + jnp.arange(num_slots), 0, num_slots - 1)
  return jnp.take_along_axis(by_slot, slot[:, :, None, :], axis=-1)


def _log_sum_exp(x, mask, axis):
  """log sum exp over the masked entries of x; -inf where none is."""
  masked = jnp.where(mask, x, -jnp.inf)
  peak = jnp.max(masked, axis=axis, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  total = jnp.sum(jnp.where(mask, jnp.exp(masked - peak), 0.0), axis=axis)
  return jnp.where(jnp.any(mask, axis=axis), jnp.squeeze(peak, axis) + jnp.log(total), -jnp.inf)


# ----------------------------------------------------------------------------- one run of queries


def _gather_keys(x, start, rel_pos, heads=None):
  """x `[B, T, HKV, D]` at document positions rel_pos `[B, Tq, ...]` of the documents that start
  at start `[B, Tq]`, clipped into the row: `[B, Tq, ..., HKV, D]`, or `[B, Tq, ..., D]` when
  heads (int32, broadcast against rel_pos) picks one KV head per entry."""
  b, seq_len = x.shape[:2]
  pos = jnp.clip(start.reshape(start.shape + (1,) * (rel_pos.ndim - 2)) + rel_pos, 0,
                 seq_len - 1)
  rows = jnp.arange(b).reshape((b,) + (1,) * (rel_pos.ndim - 1))
  return (x[rows, pos] if heads is None else x[rows, pos, heads]).astype(jnp.float32)


def _attend_rows(rel, start, first_slot, q, landmark_q, chunks, k, v, landmark_k, landmark_bias,
                 *, chunk_size: int, top_k: int, window: int, scale: float,
                 select_only: bool = False):
  """HiLS for a run of queries, float32.

  Args:
    rel, start, first_slot: int32 `[B, Tq]`: each query's position in its document, the
      document's start in the row, the slot of the document's chunk 0.
    q, landmark_q: float32 `[B, Tq, HQ, D]`; k, v: `[B, T, HKV, D]`, the row's keys (at least up
      to each query; gathered, then made float32); landmark_k `[B, N, HQ, D]`, landmark_bias
      `[B, N, HQ]` float32 (`_landmarks`).
    chunks: None, or int32 `[B, Tq, HKV, K']`: document chunks to attend instead of this
      function's own top-k (any order, -1 unused), so that a kernel given some chunks can be
      compared with the reference on exactly those; a near-tie in the chunk scores may
      otherwise select differently in two programs.

  Returns:
    out `[B, Tq, HQ, D]` (None with select_only) and the selected document chunks, int32
    `[B, Tq, HKV, min(top_k, N)]` in score order, -1 where fewer are eligible.
  """
  b, tq, hq, d = q.shape
  hkv = k.shape[2]
  group = hq // hkv
  num_slots = landmark_k.shape[1]
  qg = q.reshape(b, tq, hkv, group, d)
  n_eligible = _num_eligible(rel, window, chunk_size)  # [B, Tq]

  # The window: document keys from the first block past the eligible chunks up to the query.
  win_rel = n_eligible[..., None] * chunk_size + jnp.arange(
      window_chunks(window, chunk_size) * chunk_size)
  win_visible = win_rel <= rel[..., None]  # [B, Tq, L]
  keep = win_visible[..., None, None]
  # Keys and values no query sees are zeroed: a weight of zero must not meet a NaN.
  k_win = jnp.where(keep, _gather_keys(k, start, win_rel), 0.0)  # [B, Tq, L, HKV, D]
  v_win = jnp.where(keep, _gather_keys(v, start, win_rel), 0.0)
  s_win = scale * jnp.einsum("bthgd,btlhd->bthgl", qg, k_win, precision=_HIGHEST)
  s_win = jnp.where(win_visible[:, :, None, None, :], s_win, -jnp.inf)

  if num_slots == 0:  # T < C: no chunk has a landmark, the window is everything
    idx = jnp.zeros((b, tq, hkv, 0), jnp.int32)
    if select_only:
      return None, idx
    return _combine(s_win, v_win, None, None).reshape(b, tq, hq, d), idx

  s_hat = _document_chunk_scores(landmark_q, landmark_k, landmark_bias, first_slot,
                                 scale=scale).reshape(b, tq, hkv, group, num_slots)
  eligible = (jnp.arange(num_slots) < n_eligible[..., None])[:, :, None, None, :]

  # Selection (no gradient): each head's chunk probability in the softmax over the window's
  # mass and every eligible chunk's estimate, the group's largest per chunk, then the top_k.
  s_hat_sg = lax.stop_gradient(s_hat)
  lse_win = lax.stop_gradient(_log_sum_exp(s_win, win_visible[:, :, None, None, :], -1))
  lse_total = jnp.logaddexp(lse_win, _log_sum_exp(s_hat_sg, eligible, -1))
  rank = jnp.max(jnp.where(eligible, s_hat_sg - lse_total[..., None], -jnp.inf), axis=3)
  if chunks is None:
    best, idx = lax.top_k(rank, min(top_k, num_slots))  # ties: the lower chunk first
    idx = jnp.where(best > -jnp.inf, idx, -1).astype(jnp.int32)  # [B, Tq, HKV, K]
  else:
    idx = chunks.astype(jnp.int32)
  if select_only:
    return None, idx
  valid = idx >= 0

  # The selected chunks' keys: every one is complete and before the window.
  chunk_rel = jnp.maximum(idx, 0)[..., None] * chunk_size + jnp.arange(chunk_size)
  heads = jnp.arange(hkv)[:, None, None]
  k_sel = jnp.where(valid[..., None, None], _gather_keys(k, start, chunk_rel, heads), 0.0)
  v_sel = jnp.where(valid[..., None, None], _gather_keys(v, start, chunk_rel, heads), 0.0)
  s_chunk = scale * jnp.einsum("bthgd,bthkcd->bthgkc", qg, k_sel, precision=_HIGHEST)
  lse_chunk = jax.nn.logsumexp(s_chunk, axis=-1)  # log Z_ic
  s_hat_sel = jnp.take_along_axis(s_hat, jnp.maximum(idx, 0)[:, :, :, None, :], axis=-1)
  # A chunk key's logit in the shared softmax: s_ij - log Z_ic + s^_ic, so that the chunk's keys
  # together weigh e^{s^_ic}.
  a_chunk = jnp.where(valid[:, :, :, None, :, None],
                      s_chunk + (s_hat_sel - lse_chunk)[..., None], -jnp.inf)
  return _combine(s_win, v_win, a_chunk, v_sel).reshape(b, tq, hq, d), idx


def _combine(s_win, v_win, a_chunk, v_chunk):
  """One softmax over the window's keys (logits s_win `[B, Tq, HKV, G, L]`, values v_win
  `[B, Tq, L, HKV, D]`), the selected chunks' keys (logits a_chunk `[B, Tq, HKV, G, K, C]`,
  values v_chunk `[B, Tq, HKV, K, C, D]`, or None) and a zero logit: `[B, Tq, HKV, G, D]`."""
  peak = jnp.maximum(jnp.max(s_win, axis=-1), 0.0)
  if a_chunk is not None:
    peak = jnp.maximum(peak, jnp.max(a_chunk, axis=(-2, -1)))
  peak = lax.stop_gradient(peak)
  e_win = jnp.exp(s_win - peak[..., None])
  numer = jnp.einsum("bthgl,btlhd->bthgd", e_win, v_win, precision=_HIGHEST)
  # The zero logit (softmax1): e^{0 - peak} in the denominator only.
  denom = jnp.sum(e_win, axis=-1) + jnp.exp(-peak)
  if a_chunk is not None:
    e_chunk = jnp.exp(a_chunk - peak[..., None, None])
    numer = numer + jnp.einsum("bthgkc,bthkcd->bthgd", e_chunk, v_chunk, precision=_HIGHEST)
    denom = denom + jnp.sum(e_chunk, axis=(-2, -1))
  return numer / denom[..., None]


# ----------------------------------------------------------------------------- references


def _query_chunk(batch, seq_len, hq, hkv, d, num_slots, *, chunk_size, top_k, window) -> int:
  """Queries per chunk of `_attend_rows` so that its float32 temporaries (gathered keys and
  values, logits and weights of the window and the selected chunks, chunk scores) stay near
  `_chunking.CHUNK_ELEMENTS`."""
  keys = window_chunks(window, chunk_size) * chunk_size + min(top_k, num_slots) * chunk_size
  per_query = batch * (hkv * keys * 2 * d + hq * keys * 4 + hq * num_slots * 4)
  return _chunking.query_chunk_size(seq_len, per_query)


def _prepare(k, landmark_q, segment_ids, *, chunk_size, scale):
  start, first_slot, ends, slot_valid = _chunk_geometry(segment_ids, k.shape[0], k.shape[1],
                                                        chunk_size)
  landmark_k, landmark_bias = _landmarks(k, _priors(landmark_q, ends), ends, slot_valid,
                                         chunk_size=chunk_size, scale=scale)
  rel = jnp.arange(k.shape[1], dtype=jnp.int32) - start
  return rel, start, first_slot, landmark_k, landmark_bias


def _run_queries(q, k, v, landmark_q, segment_ids, *, chunk_size, top_k, window, scale,
                 select_only=False, chunks=None):
  """`_attend_rows` over every query of float32 rows, in query chunks under `jax.checkpoint`
  (the backward recomputes a chunk's temporaries instead of keeping every chunk's); chunks as
  `_attend_rows`'."""
  b, seq_len, hq, d = q.shape
  hkv = k.shape[2]
  rel, start, first_slot, landmark_k, landmark_bias = _prepare(
      k, landmark_q, segment_ids, chunk_size=chunk_size, scale=scale)
  attend = functools.partial(_attend_rows, chunk_size=chunk_size, top_k=top_k, window=window,
                             scale=scale, select_only=select_only)
  fn = jax.checkpoint(lambda _, *args: attend(*args))
  chunk = _query_chunk(b, seq_len, hq, hkv, d, seq_len // chunk_size, chunk_size=chunk_size,
                       top_k=top_k, window=window)
  return _chunking.map_query_chunks(
      fn, chunk, (rel, start, first_slot, q, landmark_q, chunks),
      (k, v, landmark_k, landmark_bias))


def _f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


@functools.partial(jax.jit, static_argnames=("chunk_size", "top_k", "window", "scale"))
def hils_attention_reference(q, k, v, landmark_q, segment_ids=None, *, chunk_size: int,
                             top_k: int, window: int, scale: float):
  """jnp reference of `hils_attention`; arguments are already validated."""
  out, _ = _run_queries(*_f32(q, k, v, landmark_q), segment_ids, chunk_size=chunk_size,
                        top_k=top_k, window=window, scale=scale)
  return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("chunk_size", "top_k", "window", "scale"))
def hils_select_chunks_reference(q, k, landmark_q, segment_ids=None, *, chunk_size: int,
                                 top_k: int, window: int, scale: float):
  """jnp reference of `hils_select_chunks`; arguments are already validated."""
  q, k, landmark_q = _f32(q, k, landmark_q)
  _, idx = _run_queries(q, k, k, landmark_q, segment_ids, chunk_size=chunk_size, top_k=top_k,
                        window=window, scale=scale, select_only=True)
  idx = _sort_ascending_padded(idx)
  return jnp.pad(idx, [(0, 0)] * 3 + [(0, top_k - idx.shape[-1])], constant_values=-1)


def _sort_ascending_padded(idx):
  """Valid chunk indices ascending, the -1 padding after them."""
  big = jnp.iinfo(jnp.int32).max
  srt = jnp.sort(jnp.where(idx < 0, big, idx), axis=-1)
  return jnp.where(srt == big, -1, srt)


@functools.partial(jax.jit, static_argnames=("chunk_size", "scale"))
def hils_landmarks_reference(k, landmark_q, segment_ids=None, *, chunk_size: int, scale: float):
  """jnp reference of `hils_landmarks`; arguments are already validated."""
  k32, lq32 = _f32(k, landmark_q)
  _, _, ends, slot_valid = _chunk_geometry(segment_ids, k.shape[0], k.shape[1], chunk_size)
  landmark_k, landmark_bias = _landmarks(k32, _priors(lq32, ends), ends, slot_valid,
                                         chunk_size=chunk_size, scale=scale)
  return landmark_k.astype(k.dtype), landmark_bias


@functools.partial(jax.jit, static_argnames=("chunk_size", "window", "scale"))
def hils_chunk_scores_reference(landmark_q, landmark_k, landmark_bias, segment_ids=None, *,
                                chunk_size: int, window: int, scale: float):
  """jnp reference of `hils_chunk_scores`; arguments are already validated."""
  b, seq_len = landmark_q.shape[:2]
  start, first_slot, _, _ = _chunk_geometry(segment_ids, b, seq_len, chunk_size)
  lq32, lk32, lb32 = _f32(landmark_q, landmark_k, landmark_bias)
  scores = _document_chunk_scores(lq32, lk32, lb32, first_slot, scale=scale)
  n_eligible = _num_eligible(jnp.arange(seq_len, dtype=jnp.int32) - start, window, chunk_size)
  eligible = jnp.arange(landmark_k.shape[1]) < n_eligible[..., None]
  return jnp.where(eligible[:, :, None, :], scores, -jnp.inf)


def _landmarks_of_rows(k, landmark_q, segment_ids, *, chunk_size, scale):
  """The rows' chunk geometry and float32 landmarks (`_chunk_geometry`, `_landmarks`)."""
  start, first_slot, ends, slot_valid = _chunk_geometry(segment_ids, k.shape[0], k.shape[1],
                                                        chunk_size)
  landmark_k, landmark_bias = _landmarks(k.astype(jnp.float32),
                                         _priors(landmark_q.astype(jnp.float32), ends), ends,
                                         slot_valid, chunk_size=chunk_size, scale=scale)
  return start, first_slot, landmark_k, landmark_bias


def _select_pallas(q, k, landmark_q, landmark_k, landmark_bias, start, first_slot, *,
                   chunk_size, top_k, window, scale, interpret):
  """The selection kernel's document-relative chunks `[B, T, HKV, K]`, in rank order."""
  from pisa_jax.kernels import hils_select  # the kernels import only base modules

  rel = jnp.arange(q.shape[1], dtype=jnp.int32) - start
  n_eligible = _num_eligible(rel, window, chunk_size)
  slots = hils_select.hils_select_slots_pallas(
      q, k, landmark_q, landmark_k, landmark_bias, start + n_eligible * chunk_size, first_slot,
      first_slot + n_eligible, top_k=top_k, scale=scale, interpret=interpret)
  return jnp.where(slots >= 0, slots - first_slot[:, :, None, None], -1)


def hils_select_chunks_pallas(q, k, landmark_q, segment_ids=None, *, chunk_size: int, top_k: int,
                              window: int, scale: float, interpret: bool):
  """`hils_select_chunks` with the chunk scores and their top-k in one Pallas kernel
  (`kernels.hils_select`: the `[T, HQ, N]` scores never reach memory) and the landmarks in XLA;
  arguments are already validated."""
  start, first_slot, landmark_k, landmark_bias = _landmarks_of_rows(
      k, landmark_q, segment_ids, chunk_size=chunk_size, scale=scale)
  idx = _select_pallas(q, k, landmark_q, landmark_k, landmark_bias, start, first_slot,
                       chunk_size=chunk_size, top_k=top_k, window=window, scale=scale,
                       interpret=interpret)
  return _sort_ascending_padded(idx)


def hils_attention_pallas(q, k, v, landmark_q, segment_ids=None, *, chunk_size: int, top_k: int,
                          window: int, scale: float, interpret: bool, config=None):
  """`hils_attention` on the Pallas kernels: the selection (`kernels.hils_select`) and the
  attention (`kernels.hils`, forward and backward). The landmarks stay in XLA: a softmax-weighted
  sum over each chunk's C keys is O(T * HQ * D), one pass of the keys with no reduction across
  chunks, which XLA fuses; its autodiff carries the chunk scores' gradient on to k and
  landmark_q. Arguments are already validated."""
  from pisa_jax.kernels import hils as hils_kernels  # the kernels import only base modules

  start, first_slot, landmark_k, landmark_bias = _landmarks_of_rows(
      k, landmark_q, segment_ids, chunk_size=chunk_size, scale=scale)
  # The selection has no gradient: its kernel is never differentiated.
  idx = _select_pallas(*(lax.stop_gradient(x) for x in (q, k, landmark_q, landmark_k,
                                                          landmark_bias)),
                       start, first_slot, chunk_size=chunk_size, top_k=top_k, window=window,
                       scale=scale, interpret=interpret)
  packed = segment_ids is not None
  return hils_kernels.hils_chunk_attention_pallas(
      q, k, v, landmark_q, landmark_k, landmark_bias, idx, start if packed else None,
      first_slot if packed else None, chunk_size=chunk_size, window=window,
      num_window=window_chunks(window, chunk_size), scale=scale, interpret=interpret,
      config=config)


# ----------------------------------------------------------------------------- public functions


def _check_options(*, chunk_size=64, top_k=32, window=512) -> None:
  for name, value, why in (("chunk_size", chunk_size, "tokens per chunk"),
                           ("top_k", top_k, "chunks each query selects"),
                           ("window", window, "keys of the sliding window, the query's own "
                            "key included")):
    if not _validation._is_int(value) or value < 1:
      raise ValueError(f"{name}={value!r} must be an int >= 1: the {why}")


def _check_landmark_q(landmark_q, q) -> None:
  _validation.check_float("landmark_q", landmark_q)
  if tuple(landmark_q.shape) != tuple(q.shape):
    raise ValueError(f"landmark_q.shape={tuple(landmark_q.shape)} must equal "
                     f"q.shape={tuple(q.shape)} [B, T, HQ, D]")
  if landmark_q.dtype != q.dtype:
    raise TypeError(f"landmark_q and q must have the same dtype, got landmark_q "
                    f"{landmark_q.dtype} and q {q.dtype}")


def _lookup(op: str, implementation, *, has_kernel: bool = True):
  # None: the platform's default where a kernel exists, the reference elsewhere.
  if implementation is None and not has_kernel:
    implementation = "xla"
  return _dispatch.lookup(op, implementation)


def hils_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    landmark_q: Float[Array, "B T HQ D"],
    *,
    chunk_size: int = 64,
    top_k: int = 32,
    window: int = 512,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """HiLS attention (the module docstring gives every rule): a sliding window of `window` keys
  widened to a chunk boundary, plus the `top_k` chunks before it that the landmark scores rank
  highest, in one softmax where a chunk weighs by its score (the two-level softmax).

  Args:
    q: queries `[B, T, HQ, D]`, RoPE applied.
    k: keys `[B, T, HKV, D]`, q's dtype, RoPE applied (landmark keys pool them as they are).
    v: values `[B, T, HKV, D]`, q's dtype.
    landmark_q: landmark queries `[B, T, HQ, D]`, q's dtype, RoPE applied: token t's is the
      query of its chunk scores, and the prior query of the chunk it ends.
    chunk_size: C, tokens per chunk (landmarks exist for complete chunks only).
    top_k: K, chunks selected per query and KV head.
    window: W >= 1, the sliding window (W = 1: the current chunk's keys up to the query).
    scale: logit scale, default 1/sqrt(D).
    segment_ids: None, or int32 `[B, T]` non-decreasing within a row (packed documents): each
      document has its own chunk grid from its first token and every output row is the one it
      would have alone.
    implementation: "xla" (jnp reference), "pallas" (the kernels: selection and attention,
      forward and backward; the landmarks in XLA) or None ("pallas" on a GPU, else "xla").

  Options (chunk_size, top_k, window, scale, implementation) are static under `jax.jit`.

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k, v and landmark_q (the chunk scores
    enter the weights; the choice of chunks has no gradient).
  """
  _validation.check_static("hils_attention", chunk_size=chunk_size, top_k=top_k, window=window,
                           scale=scale, implementation=implementation)
  b, t, _, _, d = _validation.check_qk(q, k)
  _validation.check_v(v, k)
  _check_landmark_q(landmark_q, q)
  _check_options(chunk_size=chunk_size, top_k=top_k, window=window)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  _validation.check_implementation(implementation)
  attend = _lookup("hils_attention", implementation)
  return attend(q, k, v, landmark_q, segment_ids, chunk_size=int(chunk_size), top_k=int(top_k),
                window=int(window), scale=_validation.resolve_scale(scale, d))


def hils_select_chunks(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    landmark_q: Float[Array, "B T HQ D"],
    *,
    chunk_size: int = 64,
    top_k: int = 32,
    window: int = 512,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Int[Array, "B T HKV K"]:
  """The chunks `hils_attention` attends to beside its window: int32 `[B, T, HKV, top_k]`,
  document-relative chunk numbers ascending, -1 padded where fewer than top_k chunks precede
  the window. Arguments as in `hils_attention` (q and k enter through the window's
  log-sum-exp, which each chunk's score competes with)."""
  _validation.check_static("hils_select_chunks", chunk_size=chunk_size, top_k=top_k,
                           window=window, scale=scale, implementation=implementation)
  b, t, _, _, d = _validation.check_qk(q, k)
  _check_landmark_q(landmark_q, q)
  _check_options(chunk_size=chunk_size, top_k=top_k, window=window)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  _validation.check_implementation(implementation)
  select = _lookup("hils_select_chunks", implementation)
  return select(q, k, landmark_q, segment_ids, chunk_size=int(chunk_size), top_k=int(top_k),
                window=int(window), scale=_validation.resolve_scale(scale, d))


def hils_landmarks(
    k: Float[Array, "B T HKV D"],
    landmark_q: Float[Array, "B T HQ D"],
    *,
    chunk_size: int = 64,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> tuple[Float[Array, "B N HQ D"], Float[Array, "B N HQ"]]:
  """Landmark keys k'_c (k's dtype) and entropy biases b'_c (float32) of every complete chunk.

  Slot c of N = T // C holds chunk c; with segment_ids, the row's complete chunks in order
  (document by document, each on its own grid), the unused slots zero. Differentiable in k and
  landmark_q (through the prior query of each chunk's last token).
  """
  _validation.check_static("hils_landmarks", chunk_size=chunk_size, scale=scale,
                           implementation=implementation)
  _validation.check_float("k", k)
  _validation.check_rank4("k", k, "[B, T, HKV, D]")
  _validation.check_float("landmark_q", landmark_q)
  _validation.check_rank4("landmark_q", landmark_q, "[B, T, HQ, D]")
  b, t, hkv, d = k.shape
  if (landmark_q.shape[0], landmark_q.shape[1], landmark_q.shape[3]) != (b, t, d) or (
      landmark_q.shape[2] % hkv):
    raise ValueError(f"landmark_q.shape={tuple(landmark_q.shape)} must be [B, T, HQ, D] = "
                     f"[{b}, {t}, HQ, {d}] with HQ a multiple of HKV={hkv}")
  _check_options(chunk_size=chunk_size)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  _validation.check_implementation(implementation)
  pool = _lookup("hils_landmarks", implementation, has_kernel=False)
  return pool(k, landmark_q, segment_ids, chunk_size=int(chunk_size),
              scale=_validation.resolve_scale(scale, d))


def hils_chunk_scores(
    landmark_q: Float[Array, "B T HQ D"],
    landmark_k: Float[Array, "B N HQ D"],
    landmark_bias: Float[Array, "B N HQ"],
    *,
    chunk_size: int = 64,
    window: int = 512,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ N"]:
  """The chunk scores s^_tc = landmark_q_t . k'_c * scale + b'_c, float32 `[B, T, HQ, N]`:
  entry c is chunk c of the query's own document, -inf where that chunk is not before the
  query's window. landmark_k, landmark_bias as `hils_landmarks` returns them. This is the
  O(T^2 / C) array by definition (`hils_attention` builds it a query chunk at a time)."""
  _validation.check_static("hils_chunk_scores", chunk_size=chunk_size, window=window,
                           scale=scale, implementation=implementation)
  _validation.check_float("landmark_q", landmark_q)
  _validation.check_rank4("landmark_q", landmark_q, "[B, T, HQ, D]")
  b, t, hq, d = landmark_q.shape
  _check_options(chunk_size=chunk_size, window=window)
  if tuple(landmark_k.shape) != (b, t // chunk_size, hq, d):
    raise ValueError(f"landmark_k.shape={tuple(getattr(landmark_k, 'shape', ()))} must be "
                     f"[B, T // chunk_size, HQ, D] = [{b}, {t // chunk_size}, {hq}, {d}]")
  if tuple(landmark_bias.shape) != (b, t // chunk_size, hq):
    raise ValueError(f"landmark_bias.shape={tuple(getattr(landmark_bias, 'shape', ()))} must "
                     f"be [B, T // chunk_size, HQ] = [{b}, {t // chunk_size}, {hq}]")
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  _validation.check_implementation(implementation)
  score = _lookup("hils_chunk_scores", implementation, has_kernel=False)
  return score(landmark_q, landmark_k, landmark_bias, segment_ids, chunk_size=int(chunk_size),
               window=int(window), scale=_validation.resolve_scale(scale, d))
