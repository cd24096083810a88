"""NSA decoding: a cache of keys, values and compressed tokens, extended one token per row.

`NSACache` holds each row's raw keys and values (the selected and window branches read them) and
its compressed keys and values (float32, slot i the block [i d, i d + l), as `nsa_compress`
lays out one document). `nsa_decode_step` appends one token per row at its own length t: it
writes the key and value, compresses the block that ends at t if one does ((t + 1 - l) a
multiple of d), then runs the three branches for the query at t with the very functions of the
prefill (`pisa_jax.nsa`), so that its output equals the prefill's row t to float32 rounding.
Under `jit` a row past its cache's capacity drops its token and outputs NaN, as the dense cache
of `pisa_jax.models.decoder` does; `grow` (outside `jit`) makes room.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _validation, nsa
from pisa_jax.attention import attend_selected
from pisa_jax.decode_cache import append_chunk, last_document


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "k_cmp", "v_cmp", "lengths"],
                   meta_fields=["compression", "block_length", "stride"])
@dataclasses.dataclass(frozen=True)
class NSACache:
  """Keys, values and compressed tokens of a batch of rows with per-row lengths.

  Attributes:
    k, v: `[B, N, HKV, D]` in the cache dtype; row b holds tokens 0 .. lengths[b] - 1.
    k_cmp, v_cmp: float32 `[B, Nc, HKV, D]`, Nc = `nsa.num_compressed_slots(N, l, d, False)`:
      slot i holds the compressed block [i d, i d + l) once the row holds its last token (zeros
      or stale before).
    lengths: int32 `[B]`.
    compression, block_length, stride: as `nsa.nsa_compress`' options.
  """

  k: Float[Array, "B N HKV D"]
  v: Float[Array, "B N HKV D"]
  k_cmp: Float[Array, "B Nc HKV D"]
  v_cmp: Float[Array, "B Nc HKV D"]
  lengths: Int[Array, "B"]
  compression: str = "mlp"
  block_length: int = 32
  stride: int = 16

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
             compression: str = "mlp", block_length: int = 32, stride: int = 16,
             dtype=jnp.bfloat16) -> "NSACache":
    """An empty cache (every length 0) for `capacity` tokens per row."""
    for name, value in (("batch", batch), ("capacity", capacity), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
      if not _validation._is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    nsa.check_options(compression=compression, block_length=block_length, stride=stride,
                      select_block_size=stride)
    shape = (batch, capacity, num_kv_heads, head_dim)
    slots = nsa.num_compressed_slots(capacity, block_length, stride, packed=False)
    compressed = jnp.zeros((batch, slots, num_kv_heads, head_dim), jnp.float32)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), k_cmp=compressed,
               v_cmp=compressed, lengths=jnp.zeros((batch,), jnp.int32),
               compression=compression, block_length=int(block_length), stride=int(stride))

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def prefill(self, k: Float[Array, "B T HKV D"], v: Float[Array, "B T HKV D"],
              lengths: Int[Array, "B"], *, key_mlp: nsa.CompressionMLP | None = None,
              value_mlp: nsa.CompressionMLP | None = None,
              segment_ids: Int[Array, "B T"] | None = None) -> "NSACache":
    """A cache holding each row's first lengths[b] keys and values (with segment_ids, only its
    last document, moved to position 0) and every compressed block complete among them."""
    if segment_ids is not None:
      k, v, lengths = last_document(k, v, lengths.astype(jnp.int32), segment_ids)
    t = k.shape[1]
    if t > self.capacity:
      raise ValueError(f"k.shape[1]={t} tokens exceed the cache capacity {self.capacity}")
    lengths = lengths.astype(jnp.int32)
    keep = (jnp.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
    pad = ((0, 0), (0, self.capacity - t), (0, 0), (0, 0))

    def fill(x):
      return jnp.pad(jnp.where(keep, x, jnp.zeros((), x.dtype)).astype(self.k.dtype), pad)

    k, v = fill(k), fill(v)
    # The prefill's compression of the whole rows, on the cache's keys (what decoding reads);
    # a block is kept once the row holds its last token.
    layout = nsa._layout(None, self.capacity, block_length=self.block_length, stride=self.stride)
    slots = self.k_cmp.shape[1]
    done = (jnp.arange(slots) * self.stride + self.block_length <= lengths[:, None])[..., None, None]

    def compress(x, mlp):
      out = nsa._compress(x.astype(jnp.float32), layout, mlp, block_length=self.block_length,
                          compression=self.compression)
      return jnp.where(done, out, 0.0)

    return dataclasses.replace(self, k=k, v=v, k_cmp=compress(k, key_mlp),
                               v_cmp=compress(v, value_mlp), lengths=lengths)

  def grow(self, min_capacity: int) -> "NSACache":
    """Room for at least `min_capacity` tokens: twice the capacity or more (self if it already
    has that many), so a jitted step sees O(log N) shapes."""
    if min_capacity <= self.capacity:
      return self
    capacity = max(int(min_capacity), 2 * self.capacity)
    slots = nsa.num_compressed_slots(capacity, self.block_length, self.stride, packed=False)

    def pad(x, n):
      return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))

    return dataclasses.replace(self, k=pad(self.k, capacity), v=pad(self.v, capacity),
                               k_cmp=pad(self.k_cmp, slots), v_cmp=pad(self.v_cmp, slots))


def _append(cache: NSACache, k, v, key_mlp, value_mlp):
  """The token of each row written at its length, and the block it completes compressed."""
  b, capacity = cache.k.shape[:2]
  rows = jnp.arange(b)
  t = cache.lengths
  write = jnp.where(t < capacity, t, capacity)  # out of bounds: dropped
  k_all = cache.k.at[rows, write].set(k[:, 0].astype(cache.k.dtype), mode="drop")
  v_all = cache.v.at[rows, write].set(v[:, 0].astype(cache.v.dtype), mode="drop")
  # Eq. 7: block i = (t + 1 - l) / d ends at t.
  ended = t + 1 - cache.block_length
  completes = (ended >= 0) & (ended % cache.stride == 0) & (t < capacity)
  slot = jnp.where(completes, ended // cache.stride, cache.k_cmp.shape[1])
  layout = nsa._Layout(slot_start=jnp.maximum(ended, 0)[:, None], slot_valid=completes[:, None],
                       first=None, end=None, start=None, rel=None)

  def compress(x, mlp, store):
    block = nsa._compress(x.astype(jnp.float32), layout, mlp, block_length=cache.block_length,
                          compression=cache.compression)  # [B, 1, HKV, D]
    return store.at[rows, slot].set(block[:, 0], mode="drop")

  return dataclasses.replace(
      cache, k=k_all, v=v_all, k_cmp=compress(k_all, key_mlp, cache.k_cmp),
      v_cmp=compress(v_all, value_mlp, cache.v_cmp), lengths=t + 1)


def _gather_rows(x, positions, visible):
  """x `[B, N, HKV, D]` at positions `[B, Tq, HKV, K, C]` -> `[B, Tq, HKV, K, C, D]` float32,
  zeros where not visible."""
  b, capacity, hkv, _ = x.shape
  b_idx = jnp.arange(b)[:, None, None, None, None]
  h_idx = jnp.arange(hkv)[None, None, :, None, None]
  pos = jnp.clip(positions, 0, capacity - 1)
  return jnp.where(visible[..., None], x[b_idx, pos, h_idx].astype(jnp.float32), 0.0)


def _attend_queries(q32, gates, t, cache: NSACache, *, select_block_size: int, top_n: int,
                    window: int, scale: float):
  """The three branches of float32 queries `[B, Tq, HQ, D]` at positions t `[B, Tq]` of rows
  whose cache holds every key up to each (one document from position 0), with the prefill's own
  per-chunk functions: `[B, Tq, HQ, D]` float32."""
  b, tq, hq, d = q32.shape
  hkv = cache.k.shape[2]
  group = hq // hkv
  # Compressed attention and selection (`first` 0: one document from position 0).
  ended = t + 1 - cache.block_length
  end = jnp.where(ended >= 0, ended // cache.stride + 1, 0)
  first = jnp.zeros_like(end)
  out_cmp, lse = nsa._compressed_chunk(None, q32, first, end, cache.k_cmp, cache.v_cmp,
                                       scale=scale)
  num_blocks = -(-cache.capacity // select_block_size)
  indices = nsa._select_chunk(
      None, q32, lse, first, end, t, cache.k_cmp, block_length=cache.block_length,
      stride=cache.stride, select_block_size=select_block_size, top_n=top_n, scale=scale,
      num_doc_blocks=cache.k_cmp.shape[1], num_blocks=num_blocks)  # [B, Tq, HKV, n]
  # Selected branch (Eq. 6 over the chosen blocks' keys at or before t).
  qg = q32.reshape(b, tq, hkv, group, d)
  key_pos = jnp.maximum(indices, 0)[..., None] * select_block_size + jnp.arange(select_block_size)
  visible = (indices >= 0)[..., None] & (key_pos <= t[:, :, None, None, None])
  out_slc, _ = attend_selected(qg, _gather_rows(cache.k, key_pos, visible),
                               _gather_rows(cache.v, key_pos, visible), visible, scale=scale)
  # Window branch: keys t - w < j <= t, as one selected "block" of w keys.
  win_pos = jnp.broadcast_to(
      (t[..., None] - window + 1 + jnp.arange(window))[:, :, None, None, :],
      (b, tq, hkv, 1, window))
  win_visible = win_pos >= 0
  out_win, _ = attend_selected(qg, _gather_rows(cache.k, win_pos, win_visible),
                               _gather_rows(cache.v, win_pos, win_visible), win_visible,
                               scale=scale)
  g = gates.astype(jnp.float32)[..., None]  # [B, Tq, HQ, 3, 1]
  return (g[:, :, :, 0] * out_cmp + g[:, :, :, 1] * out_slc.reshape(b, tq, hq, d)
          + g[:, :, :, 2] * out_win.reshape(b, tq, hq, d))


@functools.partial(jax.jit, static_argnames=("select_block_size", "top_n", "window", "scale"))
def nsa_decode_step_reference(q, k, v, gates, cache: NSACache, key_mlp, value_mlp, *,
                              select_block_size: int, top_n: int, window: int, scale: float):
  """jnp reference of `nsa_decode_step`; arguments are already validated."""
  t = cache.lengths  # [B]: each row's query position
  full = t >= cache.capacity
  cache = _append(cache, k, v, key_mlp, value_mlp)
  out = _attend_queries(q.astype(jnp.float32), gates, t[:, None], cache,
                        select_block_size=select_block_size, top_n=top_n, window=window,
                        scale=scale)
  out = jnp.where(full[:, None, None, None], jnp.nan, out)
  return out.astype(q.dtype), cache


def nsa_prefill_chunk(q, k, v, gates, cache: NSACache, lengths, offset, *,
                      key_mlp: nsa.CompressionMLP | None = None,
                      value_mlp: nsa.CompressionMLP | None = None, select_block_size: int = 64,
                      top_n: int = 16, window: int = 512, scale: float | None = None):
  """A chunk of a prompt read after `offset` tokens (chunked prefill), jnp.

  q, gates `[B, S, HQ, ...]` and k, v `[B, S, HKV, D]` (RoPE applied) are the tokens at
  positions offset .. offset + S - 1; row b's first lengths[b] of them are real (rows with
  lengths[b] > 0 hold exactly offset tokens; the cache has room for offset + S). Their keys and
  values are appended, and so is every compressed block whose last token is one of them (Eq. 7,
  as `_append` does a token at a time); each query then attends as row offset + s of
  `nsa_attention` over the whole prompt. Rows with lengths[b] == 0 keep their cache (their
  outputs are meaningless).

  Returns:
    The outputs `[B, S, HQ, D]` in q's dtype and the cache.
  """
  b, s, hq, d = q.shape
  hkv = k.shape[2]
  scale = _validation.resolve_scale(scale, d)
  lengths = lengths.astype(jnp.int32)
  k_all, v_all, held = append_chunk(cache.k, cache.v, k, v, cache.lengths, lengths, offset)
  # Block i covers [i d, i d + l): the blocks ending in [offset, offset + S) are at most
  # S // d + 1 slots from the first one.
  l, stride, num_slots = cache.block_length, cache.stride, cache.k_cmp.shape[1]
  first = jnp.maximum(-((l - 1 - offset) // stride), 0)  # ceil((offset - l + 1) / d), >= 0
  slots = first + jnp.arange(s // stride + 2, dtype=jnp.int32)  # [M]
  ends = slots * stride + l - 1
  valid = ((ends[None, :] >= offset) & (ends[None, :] < offset + lengths[:, None])
           & (slots[None, :] < num_slots))  # [B, M]
  layout = nsa._Layout(slot_start=jnp.broadcast_to(slots * stride, valid.shape),
                       slot_valid=valid, first=None, end=None, start=None, rel=None)
  write = jnp.where(valid, slots[None, :], num_slots)  # out of range: dropped
  rows = jnp.arange(b)[:, None]

  def compress(x, mlp, store):
    blocks = nsa._compress(x.astype(jnp.float32), layout, mlp, block_length=l,
                           compression=cache.compression)  # [B, M, HKV, D]
    return store.at[rows, write].set(blocks, mode="drop")

  cache = dataclasses.replace(cache, k=k_all, v=v_all, k_cmp=compress(k_all, key_mlp, cache.k_cmp),
                              v_cmp=compress(v_all, value_mlp, cache.v_cmp), lengths=held)
  t = jnp.broadcast_to(offset + jnp.arange(s, dtype=jnp.int32), (b, s))
  keys = top_n * select_block_size + window
  per_query = b * (2 * hkv * keys * d + hq * keys * 2 + hq * cache.k_cmp.shape[1] * 3)
  attend = functools.partial(_attend_queries, cache=cache, select_block_size=select_block_size,
                             top_n=top_n, window=window, scale=scale)
  out = _chunking.map_query_chunks(lambda _, q, g, t: attend(q, g, t),
                                   _chunking.query_chunk_size(s, per_query),
                                   (q.astype(jnp.float32), gates, t))
  return out.astype(q.dtype), cache


def nsa_decode_step(
    q: Float[Array, "B 1 HQ D"],
    k: Float[Array, "B 1 HKV D"],
    v: Float[Array, "B 1 HKV D"],
    gates: Float[Array, "B 1 HQ 3"],
    cache: NSACache,
    *,
    key_mlp: nsa.CompressionMLP | None = None,
    value_mlp: nsa.CompressionMLP | None = None,
    select_block_size: int = 64,
    top_n: int = 16,
    window: int = 512,
    scale: float | None = None,
    implementation: str | None = None,
) -> tuple[Float[Array, "B 1 HQ D"], NSACache]:
  """One token per row through `nsa_attention`, at each row's length, with its cache extended.

  Args:
    q, k, v, gates: the token of each row, shaped as `nsa_attention`'s with T = 1.
    cache: the rows' `NSACache` (its compression, l and d are the layer's).
    key_mlp, value_mlp, select_block_size, top_n, window, scale: as `nsa_attention`'s.
    implementation: "xla" or None (the jnp reference, the only implementation); "pallas" raises.

  Returns:
    The output `[B, 1, HQ, D]` in q's dtype (row t of `nsa_attention` over the row's tokens
    0 .. t, to float32 rounding; NaN for a row past capacity) and the extended cache.
  """
  _validation.check_static("nsa_decode_step", select_block_size=select_block_size, top_n=top_n,
                           window=window, scale=scale, implementation=implementation)
  if not isinstance(cache, NSACache):
    raise TypeError(f"cache must be an NSACache, got {type(cache).__name__}")
  b, t, hq, hkv, d = _validation.check_qk(q, k)
  _validation.check_v(v, k)
  if t != 1 or cache.k.shape[0] != b or cache.k.shape[2:] != k.shape[2:]:
    raise ValueError(f"q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)} must be one token per "
                     f"row of the cache's [B, N, HKV, D] = {list(cache.k.shape)}")
  nsa.check_options(compression=cache.compression, block_length=cache.block_length,
                    stride=cache.stride, select_block_size=select_block_size, top_n=top_n,
                    window=window)
  nsa._check_gates(gates, batch=b, seq_len=1, num_heads=hq)
  for name, mlp in (("key_mlp", key_mlp), ("value_mlp", value_mlp)):
    nsa._check_mlp(mlp, name, compression=cache.compression, block_length=cache.block_length,
                   head_dim=d)
  step = nsa._xla_only("nsa_decode_step", implementation)
  return step(q, k, v, gates, cache, key_mlp, value_mlp, select_block_size=int(select_block_size),
              top_n=int(top_n), window=int(window), scale=_validation.resolve_scale(scale, d))
