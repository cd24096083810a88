"""HiLS decoding: a cache of keys, values and the landmarks of complete chunks, and one step.

A row's cache holds its keys and values and, per complete chunk, the landmark key and entropy
bias that `pisa_jax.hils` pools from them (float32, as the forward pass computes them). A step
appends each row's token; when that token completes a chunk (its position p has (p + 1) % C == 0)
the chunk's landmark is pooled once, by the token's own landmark query (the prior query of a
chunk is its last token's), and stored: landmarks are never recomputed. The step's query then
scores every cached landmark before its window, selects, and attends exactly as `hils_attention`
does for row p of the whole sequence (the same `_attend_rows`), so decoding equals the forward
pass to float32 rounding. The public implementation's cache does the same: its prior cache
appends the landmarks of newly completed chunks and keeps the rest.

Packed prompts keep each row's last document (`pisa_jax.decode_cache.last_document`), which the
next tokens continue from its position 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _dispatch, _validation
from pisa_jax.decode import bucket_capacity
from pisa_jax.decode_cache import append_chunk, last_document
from pisa_jax.hils import _attend_rows, _check_options, _landmarks, _priors, _query_chunk


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "landmark_k", "landmark_bias", "lengths"],
    meta_fields=["chunk_size"],
)
@dataclasses.dataclass(frozen=True)
class HiLSCache:
  """Keys, values and chunk landmarks of a batch of rows with per-row lengths.

  Attributes:
    k, v: `[B, N, HKV, D]`; row b holds tokens 0 .. lengths[b] - 1, the rest zero or stale.
    landmark_k: float32 `[B, N // C, HQ, D]`, slot c the landmark key of the row's chunk c once
      it is complete (zero before); landmark_bias: float32 `[B, N // C, HQ]`, its entropy bias.
    lengths: int32 `[B]`.
    chunk_size: C.
  """

  k: Float[Array, "B N HKV D"]
  v: Float[Array, "B N HKV D"]
  landmark_k: Float[Array, "B M HQ D"]
  landmark_bias: Float[Array, "B M HQ"]
  lengths: Int[Array, "B"]
  chunk_size: int

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, num_heads: int, head_dim: int,
             *, chunk_size: int, dtype) -> "HiLSCache":
    _check_options(chunk_size=chunk_size)
    shape = (batch, capacity, num_kv_heads, head_dim)
    slots = capacity // chunk_size
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               landmark_k=jnp.zeros((batch, slots, num_heads, head_dim), jnp.float32),
               landmark_bias=jnp.zeros((batch, slots, num_heads), jnp.float32),
               lengths=jnp.zeros((batch,), jnp.int32), chunk_size=int(chunk_size))

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def prefill(self, k: Float[Array, "B T HKV D"], v: Float[Array, "B T HKV D"],
              landmark_q: Float[Array, "B T HQ D"], lengths: Int[Array, "B"], *,
              scale: float | None = None,
              segment_ids: Int[Array, "B T"] | None = None) -> "HiLSCache":
    """A cache holding each row's first lengths[b] keys and values (RoPE applied, as the layer
    attends with them) and the landmarks of its complete chunks, pooled by landmark_q; with
    segment_ids, only each row's last document, moved to position 0."""
    lengths = lengths.astype(jnp.int32)
    if segment_ids is not None:
      landmark_q, _, _ = last_document(landmark_q, landmark_q, lengths, segment_ids)
      k, v, lengths = last_document(k, v, lengths, segment_ids)
    b, t = k.shape[:2]
    if t > self.capacity:
      raise ValueError(f"k.shape[1]={t} tokens exceed the cache capacity {self.capacity}")
    c = self.chunk_size
    scale = _validation.resolve_scale(scale, k.shape[-1])
    ends = jnp.broadcast_to(jnp.arange(t // c, dtype=jnp.int32) * c + c - 1, (b, t // c))
    landmark_k, landmark_bias = _landmarks(k, _priors(landmark_q, ends), ends,
                                           ends < lengths[:, None], chunk_size=c, scale=scale)
    slots = self.landmark_k.shape[1] - t // c
    keep = (jnp.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
    pad = ((0, 0), (0, self.capacity - t), (0, 0), (0, 0))

    def fill(x):
      return jnp.pad(jnp.where(keep, x, jnp.zeros((), x.dtype)).astype(self.k.dtype), pad)

    return HiLSCache(k=fill(k), v=fill(v),
                     landmark_k=jnp.pad(landmark_k, ((0, 0), (0, slots), (0, 0), (0, 0))),
                     landmark_bias=jnp.pad(landmark_bias, ((0, 0), (0, slots), (0, 0))),
                     lengths=lengths, chunk_size=c)

  def grow(self, min_capacity: int) -> "HiLSCache":
    """Room for at least `min_capacity` tokens: at least double, a power-of-two number of chunks
    (self if it already has that many), so a jitted step sees O(log N) shapes."""
    if min_capacity <= self.capacity:
      return self
    c = self.chunk_size
    capacity = bucket_capacity(max(int(min_capacity), 2 * self.capacity), c)
    grow_by = capacity // c - self.landmark_k.shape[1]
    pad = ((0, 0), (0, capacity - self.capacity), (0, 0), (0, 0))
    return HiLSCache(k=jnp.pad(self.k, pad), v=jnp.pad(self.v, pad),
                     landmark_k=jnp.pad(self.landmark_k, ((0, 0), (0, grow_by), (0, 0), (0, 0))),
                     landmark_bias=jnp.pad(self.landmark_bias, ((0, 0), (0, grow_by), (0, 0))),
                     lengths=self.lengths, chunk_size=c)


def hils_decode_step(
    q: Float[Array, "B 1 HQ D"],
    k: Float[Array, "B 1 HKV D"],
    v: Float[Array, "B 1 HKV D"],
    landmark_q: Float[Array, "B 1 HQ D"],
    cache: HiLSCache,
    *,
    top_k: int = 32,
    window: int = 512,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[Float[Array, "B 1 HQ D"], HiLSCache]:
  """One token per row at its cache length: append it (and the landmark of a chunk it
  completes), then HiLS attention of its query over the row (`hils_attention`'s rules).

  Args:
    q, landmark_q: `[B, 1, HQ, D]`; k, v: `[B, 1, HKV, D]`, RoPE applied at each row's position,
      q's dtype.
    cache: the rows so far; top_k, window, scale as in `hils_attention` (chunk_size is the
      cache's).
    implementation: "xla" or None (the jnp reference; no kernel yet: "pallas" raises).

  Returns:
    The output `[B, 1, HQ, D]` in q's dtype and the cache one token longer. A row with no room
    left (only possible under `jit`; outside it, `grow` first) drops its token and outputs NaN.
  """
  _validation.check_static("hils_decode_step", top_k=top_k, window=window, scale=scale,
                           implementation=implementation)
  b, n, hkv, d = cache.k.shape
  hq = cache.landmark_k.shape[2]
  for name, x, heads in (("q", q, hq), ("k", k, hkv), ("v", v, hkv),
                         ("landmark_q", landmark_q, hq)):
    _validation.check_float(name, x)
    if tuple(x.shape) != (b, 1, heads, d):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B, 1, H, D] = [{b}, 1, {heads}, "
                       f"{d}] for this cache")
  _check_options(top_k=top_k, window=window)
  _validation.check_implementation(implementation)
  step = _dispatch.lookup("hils_decode_step", "xla" if implementation is None else implementation)
  return step(q, k, v, landmark_q, cache, top_k=int(top_k), window=int(window),
              scale=_validation.resolve_scale(scale, d))


def hils_decode_step_reference(q, k, v, landmark_q, cache: HiLSCache, *, top_k: int,
                               window: int, scale: float):
  """jnp reference of `hils_decode_step`; arguments are already validated."""
  b, n = cache.k.shape[:2]
  c = cache.chunk_size
  pos = cache.lengths
  rows = jnp.arange(b)
  write = jnp.where(pos < n, pos, n)  # out of bounds: dropped
  k_cache = cache.k.at[rows, write].set(k[:, 0].astype(cache.k.dtype), mode="drop")
  v_cache = cache.v.at[rows, write].set(v[:, 0].astype(cache.v.dtype), mode="drop")
  # The token completes chunk (p + 1) / C - 1 when (p + 1) % C == 0: its landmark, pooled by this
  # token's landmark query over the chunk's keys (now all in the cache).
  completes = ((pos + 1) % c == 0) & (pos < n)
  new_k, new_bias = _landmarks(k_cache, landmark_q, pos[:, None], completes[:, None],
                               chunk_size=c, scale=scale)
  slot = jnp.where(completes, (pos + 1) // c - 1, cache.landmark_k.shape[1])
  landmark_k = cache.landmark_k.at[rows, slot].set(new_k[:, 0], mode="drop")
  landmark_bias = cache.landmark_bias.at[rows, slot].set(new_bias[:, 0], mode="drop")
  zeros = jnp.zeros((b, 1), jnp.int32)
  out, _ = _attend_rows(pos[:, None], zeros, zeros, q.astype(jnp.float32),
                        landmark_q.astype(jnp.float32), None, k_cache, v_cache, landmark_k,
                        landmark_bias, chunk_size=c, top_k=top_k, window=window, scale=scale)
  out = jnp.where((pos >= n)[:, None, None, None], jnp.nan, out)
  return out.astype(q.dtype), HiLSCache(k=k_cache, v=v_cache, landmark_k=landmark_k,
                                        landmark_bias=landmark_bias, lengths=pos + 1,
                                        chunk_size=c)


def hils_prefill_chunk(q, k, v, landmark_q, cache: HiLSCache, lengths, offset, *,
                       top_k: int = 32, window: int = 512, scale: float | None = None):
  """A chunk of a prompt read after `offset` tokens (chunked prefill), jnp.

  q, landmark_q `[B, S, HQ, D]` and k, v `[B, S, HKV, D]` (RoPE applied) are the tokens at
  positions offset .. offset + S - 1; row b's first lengths[b] of them are real (rows with
  lengths[b] > 0 hold exactly offset tokens; the cache has room for offset + S). Their keys and
  values are appended, and so is the landmark of every chunk that one of them completes (pooled
  by the completing token's landmark query, as `prefill` and the step do); each query then
  attends as row offset + s of `hils_attention` over the whole prompt. Rows with lengths[b] == 0
  keep their cache (their outputs are meaningless).

  Returns:
    The outputs `[B, S, HQ, D]` in q's dtype and the cache.
  """
  b, s, hq, d = q.shape
  hkv = k.shape[2]
  c = cache.chunk_size
  scale = _validation.resolve_scale(scale, d)
  lengths = lengths.astype(jnp.int32)
  offset = jnp.asarray(offset, jnp.int32)
  k_all, v_all, held = append_chunk(cache.k, cache.v, k, v, cache.lengths, lengths, offset)
  # The chunks that end inside this one: slots offset // C .. (offset + S) // C, each valid where
  # its last token is a real one of the row.
  slots = offset // c + jnp.arange(s // c + 1, dtype=jnp.int32)  # [M]
  ends = slots * c + c - 1
  valid = (ends[None, :] >= offset) & (ends[None, :] < offset + lengths[:, None])  # [B, M]
  local = jnp.clip(ends - offset, 0, s - 1)
  prior = landmark_q.astype(jnp.float32)[:, local]  # [B, M, HQ, D]
  new_k, new_bias = _landmarks(k_all, prior, jnp.broadcast_to(ends, (b, ends.shape[0])), valid,
                               chunk_size=c, scale=scale)
  num_slots = cache.landmark_k.shape[1]
  write = jnp.where(valid, slots[None, :], num_slots)  # out of range: dropped
  rows = jnp.arange(b)[:, None]
  landmark_k = cache.landmark_k.at[rows, write].set(new_k, mode="drop")
  landmark_bias = cache.landmark_bias.at[rows, write].set(new_bias, mode="drop")

  rel = jnp.broadcast_to(offset + jnp.arange(s, dtype=jnp.int32), (b, s))
  zeros = jnp.zeros((b, s), jnp.int32)
  attend = functools.partial(_attend_rows, chunk_size=c, top_k=top_k, window=window, scale=scale)
  chunk = _query_chunk(b, s, hq, hkv, d, num_slots, chunk_size=c, top_k=top_k, window=window)
  out, _ = _chunking.map_query_chunks(
      lambda _, *args: attend(*args), chunk,
      (rel, zeros, zeros, q.astype(jnp.float32), landmark_q.astype(jnp.float32), None),
      (k_all, v_all, landmark_k, landmark_bias))
  return out.astype(q.dtype), HiLSCache(k=k_all, v=v_all, landmark_k=landmark_k,
                                        landmark_bias=landmark_bias, lengths=held,
                                        chunk_size=c)
