"""The decode cache: keys, values and the mean-summary pyramid of a batch of rows, with per-row
lengths (Appendix B "Decode cache"), and its prefill and growth.

`pisa_jax.decode.decode_step` extends it one token per row. With packed prompts
(`prefill(..., segment_ids=...)`) a row keeps only its last document, shifted to position 0:
every later token belongs to that document and attends to nothing across a document boundary,
so the earlier documents' keys would never be read again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pisa_jax import _validation
from pisa_jax.geometry import level_offsets, level_sizes, round_summaries
from pisa_jax.spec import SelectionSpec

def bucket_capacity(num_tokens: int, block_size: int) -> int:
  """The capacity bucket of `num_tokens`: block_size times the next power of two of the blocks
  needed. Growth moves between buckets, so a jitted step sees O(log N) distinct shapes."""
  blocks = max(1, -(-int(num_tokens) // block_size))
  return block_size * (1 << (blocks - 1).bit_length())


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "summaries", "lengths"],
    meta_fields=["block_size", "branching", "growable"],
)
@dataclasses.dataclass(frozen=True)
class DecodeCache:
  """Keys, values and the mean-summary pyramid of a batch of rows, with per-row lengths.

  Row b holds tokens 0 .. lengths[b] - 1; everything at or past its length is ignored (and may
  hold stale values). Create one with `DecodeCache.create`, fill it with `prefill`, extend it
  with `decode_step`; it is a pytree (jit it, donate it).

  Attributes:
    k, v: `[B, capacity, HKV, D]` in the cache dtype (the model's layout).
    summaries: float32 (or bfloat16, `summary_dtype`) `[B, S, HKV, D]`: the pyramid's levels
      stacked along axis 1, leaves first (`level_offsets`; `levels()` splits them). Level l holds
      the `level_sizes[l - 1]` nodes of a pyramid over `capacity` keys; node i of level l is the
      mean of the existing children of Eq. 15 (the leaf: the mean of its valid keys), as
      `build_pyramid` computes it for the row's first lengths[b] keys (to float32 rounding; a
      bfloat16 pyramid rounds each float32 mean of its stored children once, as `build_pyramid`
      with that summary_dtype). Nodes a row has not reached are zero or stale.
    lengths: int32 `[B]`, tokens held per row.
    block_size: C, keys per leaf block.
    branching: g, children per upper node.
    growable: whether `grow` (and `decode_step`'s automatic growth) may reallocate the cache;
      with False, a token past capacity is an error.
  """

  k: Float[Array, "B N HKV D"]
  v: Float[Array, "B N HKV D"]
  summaries: Float[Array, "B S HKV D"]
  lengths: Int[Array, "B"]
  block_size: int
  branching: int
  growable: bool = True

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
             block_size: int | None = None, branching: int | None = None,
             summary_dtype=None, spec: SelectionSpec | None = None, dtype=jnp.bfloat16,
             growable: bool = True) -> "DecodeCache":
    """An empty cache (every length 0) for `capacity` tokens per row, rounded up to whole blocks.
    block_size, branching: the pyramid's C and g (default 64, 2); summary_dtype: its stored
    dtype, "float32" (default) or "bfloat16" (or `jnp.bfloat16`: half the pyramid's memory and
    the walk's loads, each mean computed in float32 and rounded once); or `spec`'s (a
    `pisa_jax.SelectionSpec`; a keyword must agree with it).

    Memory: 2 * B * capacity * HKV * D cache-dtype elements for keys and values, plus about
    2 * B * (capacity / C) * HKV * D summary_dtype elements for the pyramid (with g = 2).
    """
    for name, value in (("batch", batch), ("capacity", capacity), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
      if not _validation._is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    spec = SelectionSpec.merge(spec, block_size=block_size, branching=branching,
                               summary_dtype=summary_dtype)
    block_size, branching = spec.block_size, spec.branching
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{dtype=} must be a floating-point dtype (bfloat16, float16 or float32)")
    capacity = -(-int(capacity) // block_size) * block_size
    shape = (batch, capacity, num_kv_heads, head_dim)
    num_nodes = level_offsets(capacity, block_size, branching)[-1] + 1
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               summaries=jnp.zeros((batch, num_nodes, num_kv_heads, head_dim),
                                   jnp.dtype(spec.summary_dtype)),
               lengths=jnp.zeros((batch,), jnp.int32), block_size=block_size,
               branching=branching, growable=bool(growable))

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k.shape[3]

  @property
  def dtype(self):
    return self.k.dtype

  @property
  def summary_dtype(self) -> str:
    """The pyramid's stored dtype, "float32" or "bfloat16" (as `SelectionSpec.summary_dtype`)."""
    return self.summaries.dtype.name

  @property
  def level_sizes(self) -> tuple[int, ...]:
    """Nodes per level of the capacity's pyramid, leaves first (Eq. 10, 13)."""
    return level_sizes(self.capacity, self.block_size, self.branching)

  @property
  def level_offsets(self) -> tuple[int, ...]:
    """Where each level starts along axis 1 of `summaries`."""
    return level_offsets(self.capacity, self.block_size, self.branching)

  def levels(self) -> tuple[Float[Array, "B M HKV D"], ...]:
    """The pyramid's levels `[B, M_l, HKV, D]`, leaves first (views of `summaries`)."""
    return tuple(self.summaries[:, o:o + m] for o, m in zip(self.level_offsets, self.level_sizes))

  def prefill(self, k: Float[Array, "B T HKV D"], v: Float[Array, "B T HKV D"],
              lengths: Int[Array, "B"] | None = None, *,
              segment_ids: Int[Array, "B T"] | None = None) -> "DecodeCache":
    """A cache holding exactly these keys and values (whatever this one held before).

    Args:
      k, v: `[B, T, HKV, D]` in the cache dtype.
      lengths: int32 `[B]` valid tokens per row (default T for every row); positions at or past
        a row's length are padding and ignored. Checked when concrete.
      segment_ids: int32 `[B, T]`, packed documents (non-decreasing runs of equal ids). Row b
        keeps only its last document among its valid tokens, moved to position 0: the cache
        equals `prefill` of that document alone, and the row's length becomes the document's
        (the next token continues it; `decode_step(..., new_document=...)` starts another).

    Returns:
      The filled cache, its pyramid equal to `build_pyramid` of each row's valid keys. When T
      exceeds the capacity, a growable cache is reallocated to T's bucket (`bucket_capacity`);
      otherwise this raises.
    """
    self._check_tokens(k, "k", None)
    self._check_tokens(v, "v", k.shape[1])
    t = k.shape[1]
    if lengths is None:
      lengths = jnp.full((self.batch,), t, jnp.int32)
    else:
      if (not hasattr(lengths, "dtype") or not jnp.issubdtype(lengths.dtype, jnp.integer)
          or tuple(lengths.shape) != (self.batch,)):
        raise ValueError(f"lengths must be an int array [B] = [{self.batch}], got "
                         f"{getattr(lengths, 'dtype', type(lengths).__name__)} "
                         f"{tuple(getattr(lengths, 'shape', ()))}")
      if not isinstance(lengths, jax.core.Tracer):
        arr = np.asarray(lengths)
        if arr.min(initial=0) < 0 or arr.max(initial=0) > t:
          raise ValueError(f"lengths={arr.tolist()} must lie in [0, T={t}] (T = k.shape[1])")
    lengths = lengths.astype(jnp.int32)
    _validation.check_segment_ids(segment_ids, batch=self.batch, seq_len=t)
    if segment_ids is not None and t:
      k, v, lengths = last_document(k, v, lengths, segment_ids)
    capacity = self.capacity
    if t > capacity:
      if not self.growable:
        raise ValueError(f"k.shape[1]={t} tokens exceed cache.capacity={capacity} and the cache "
                         "was created with growable=False: create it with a larger capacity")
      capacity = bucket_capacity(t, self.block_size)
    k_cache, v_cache, summaries = _prefill(k, v, lengths, capacity=capacity,
                                           block_size=self.block_size, branching=self.branching,
                                           summary_dtype=self.summary_dtype)
    return dataclasses.replace(self, k=k_cache, v=v_cache, summaries=summaries, lengths=lengths)

  def grow(self, min_capacity: int) -> "DecodeCache":
    """A cache of at least `min_capacity` tokens per row holding the same rows (self if it
    already has that many).

    Growth doubles the capacity at least (the fixed fraction of Appendix B is 1), to a power-of-two
    number of blocks (`bucket_capacity`): over a generation to N tokens the cache is reallocated
    O(log N) times, each copy O(N), so O(1) amortised per token, and a jitted step recompiles only
    for each new bucket. Call it outside `jit` (it reads the lengths to refuse a cache that
    overflowed under `jit`); the existing nodes keep their ids at every level, and each new level
    above the old root holds the old root (its only child).
    """
    if not _validation._is_int(min_capacity):
      raise ValueError(f"{min_capacity=} must be an int")
    self.check_not_donated("DecodeCache.grow")
    if min_capacity <= self.capacity:
      return self
    if not self.growable:
      raise ValueError(f"{min_capacity=} exceeds cache.capacity={self.capacity} and the cache "
                       "was created with growable=False")
    if not isinstance(self.lengths, jax.core.Tracer):
      over = np.asarray(self.lengths) > self.capacity
      if over.any():
        raise ValueError(
            f"rows {np.flatnonzero(over).tolist()} have lengths past cache.capacity="
            f"{self.capacity}: a jitted decode_step ran past capacity and dropped their tokens "
            "(their outputs were NaN); grow before the step instead")
    capacity = bucket_capacity(max(int(min_capacity), 2 * self.capacity), self.block_size)
    k, v, summaries = _grow(self.k, self.v, self.summaries, capacity=capacity,
                            block_size=self.block_size, branching=self.branching)
    return dataclasses.replace(self, k=k, v=v, summaries=summaries)

  def check_not_donated(self, caller: str) -> None:
    """Raises ValueError if a buffer of this cache was donated to an earlier call and deleted.

    decode_step donates the cache it is given (donate=True): the cache it returns holds the
    buffers from then on. Reading a deleted one would raise jax's bare "Array has been deleted";
    this names the cause. A few microseconds of Python, nothing beside a step's dispatch; traced
    fields (under `jit`) and host arrays have no device buffers and are skipped.
    """
    for name in ("k", "v", "summaries", "lengths"):
      x = getattr(self, name)
      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
        raise ValueError(
            f"{caller}: cache.{name} was deleted because this cache was donated to an earlier "
            "decode_step (donate=True, the default) or to a jit with donate_argnames: use the "
            "cache that call returned (out, cache = decode_step(q, k, v, cache)), or pass "
            "donate=False to keep this one valid (a full copy of the cache per step)")

  def _check_tokens(self, x, name: str, seq_len: int | None) -> None:
    """x `[B, T, HKV, D]` in the cache dtype (T = seq_len when given)."""
    _validation.check_float(name, x)
    t = x.shape[1] if x.ndim == 4 else None
    expected = (self.batch, t if seq_len is None else seq_len, self.num_kv_heads, self.head_dim)
    if x.ndim != 4 or tuple(x.shape) != expected:
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B, T, HKV, D] = "
                       f"[{self.batch}, {'T' if seq_len is None else seq_len}, "
                       f"{self.num_kv_heads}, {self.head_dim}] (the cache's batch, KV heads and "
                       "head dim)")
    if x.dtype != self.dtype:
      raise TypeError(f"{name}.dtype={x.dtype} must equal the cache dtype {self.dtype} "
                      "(DecodeCache.create(dtype=...))")


# ----------------------------------------------------------------------------- prefill and growth


def append_chunk(cache_k: Float[Array, "B N H D"], cache_v: Float[Array, "B N H D"],
                 k: Float[Array, "B S H D"], v: Float[Array, "B S H D"],
                 cache_lengths: Int[Array, "B"], lengths: Int[Array, "B"], offset):
  """A chunked prefill's write (`generate(..., prefill_chunk=S)`): row b's first lengths[b] keys
  and values of the chunk at positions offset .. offset + lengths[b] - 1 (the chunk's padding
  stays zero), and each row's new length: offset + lengths[b], or its old one where
  lengths[b] == 0. offset may be traced. Returns (k, v, lengths int32)."""
  real = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, :, None, None]
  k_all, v_all = (jax.lax.dynamic_update_slice_in_dim(
      old, jnp.where(real, new, jnp.zeros((), new.dtype)).astype(old.dtype), offset, axis=1)
      for old, new in ((cache_k, k), (cache_v, v)))
  return k_all, v_all, jnp.where(lengths > 0, offset + lengths, cache_lengths).astype(jnp.int32)


@jax.jit
def last_document(k: Float[Array, "B T H D"], v: Float[Array, "B T H D"], lengths: Int[Array, "B"],
                  segment_ids: Int[Array, "B T"]):
  """Each row's last document among its first lengths[b] tokens, moved to position 0.

  Returns:
    (k, v, lengths): k and v `[B, T, H, D]` holding row b's tokens start_b .. lengths[b] - 1 at
    0 .. lengths[b] - start_b - 1 (the rest is padding), and those document lengths, where start_b
    is the first position of the document of token lengths[b] - 1 (0 for an empty row).
  """
  t = k.shape[1]
  last = segment_ids[jnp.arange(k.shape[0]), jnp.maximum(lengths - 1, 0)]
  # Ids are non-decreasing: the document's first position is the first id equal to its own.
  start = jnp.where(lengths > 0, jnp.argmax(segment_ids == last[:, None], axis=1), 0)
  start = start.astype(jnp.int32)
  index = jnp.minimum(start[:, None] + jnp.arange(t), t - 1)[:, :, None, None]
  shift = lambda x: jnp.take_along_axis(x, index, axis=1)
  return shift(k), shift(v), lengths - start


def _ragged_pyramid(k, lengths, block_size: int, branching: int, summary_dtype: str):
  """The pyramid of each row's first lengths[b] keys, levels `[B, M_l(T), HKV, D]` leaves first
  in summary_dtype: `build_pyramid_reference`'s arithmetic (zero padding, sums, division by the
  existing count, each mean rounded once) with per-row counts. k `[B, T, HKV, D]` is zero at and
  past each row's length."""
  b, t, hkv, d = k.shape
  m = -(-t // block_size)
  x = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, m * block_size - t), (0, 0), (0, 0)))
  total = x.reshape(b, m, block_size, hkv, d).sum(axis=2)
  # Eq. 2 / Eq. 15 with l = 0: a leaf is the mean of its valid keys.
  counts = jnp.clip(lengths[:, None] - jnp.arange(m) * block_size, 0, block_size)
  level = jnp.where(counts[..., None, None] > 0,
                    total / jnp.maximum(counts, 1)[..., None, None].astype(jnp.float32), 0.0)
  levels = [round_summaries(level, summary_dtype)]
  existing = -(-lengths // block_size)  # nodes of the row at this level
  while levels[-1].shape[1] > 1:
    n = levels[-1].shape[1]
    parents = -(-n // branching)
    x = jnp.pad(levels[-1], ((0, 0), (0, parents * branching - n), (0, 0), (0, 0)))
    total = x.reshape(b, parents, branching, hkv, d).sum(axis=2)
    # Eq. 15: the mean of the children that exist.
    counts = jnp.clip(existing[:, None] - jnp.arange(parents) * branching, 0, branching)
    levels.append(round_summaries(
        jnp.where(counts[..., None, None] > 0,
                  total / jnp.maximum(counts, 1)[..., None, None].astype(jnp.float32), 0.0),
        summary_dtype))
    existing = -(-existing // branching)
  return [level.astype(jnp.dtype(summary_dtype)) for level in levels]


def _stack_levels(levels, capacity: int, block_size: int, branching: int):
  """Levels of a pyramid over fewer keys, `[B, M_l, HKV, D]`, placed in the capacity's stacked
  layout `[B, S, HKV, D]`: each level zero-padded to the capacity's size, and each level above
  the given root holding that root (its only existing child) at node 0."""
  sizes = level_sizes(capacity, block_size, branching)
  out = []
  for i, m in enumerate(sizes):
    level = levels[i] if i < len(levels) else levels[-1][:, :1]
    out.append(jnp.pad(level, ((0, 0), (0, m - level.shape[1]), (0, 0), (0, 0))))
  return jnp.concatenate(out, axis=1)


@functools.partial(jax.jit, static_argnames=("capacity", "block_size", "branching",
                                             "summary_dtype"))
def _prefill(k, v, lengths, *, capacity: int, block_size: int, branching: int,
             summary_dtype: str):
  b, t, hkv, d = k.shape
  keep = (jnp.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
  k = jnp.where(keep, k, jnp.zeros((), k.dtype))
  v = jnp.where(keep, v, jnp.zeros((), v.dtype))
  pad = ((0, 0), (0, capacity - t), (0, 0), (0, 0))
  num_nodes = level_offsets(capacity, block_size, branching)[-1] + 1
  if t == 0:
    summaries = jnp.zeros((b, num_nodes, hkv, d), jnp.dtype(summary_dtype))
  else:
    summaries = _stack_levels(_ragged_pyramid(k, lengths, block_size, branching, summary_dtype),
                              capacity, block_size, branching)
  return jnp.pad(k, pad), jnp.pad(v, pad), summaries


@functools.partial(jax.jit, static_argnames=("capacity", "block_size", "branching"))
def _grow(k, v, summaries, *, capacity: int, block_size: int, branching: int):
  old = k.shape[1]
  pad = ((0, 0), (0, capacity - old), (0, 0), (0, 0))
  levels = [summaries[:, o:o + m] for o, m in zip(level_offsets(old, block_size, branching),
                                                  level_sizes(old, block_size, branching))]
  return jnp.pad(k, pad), jnp.pad(v, pad), _stack_levels(levels, capacity, block_size, branching)
