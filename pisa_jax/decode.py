"""Autoregressive decoding with PISA: the decode cache and one decode step (Section 3.3
"Decoding", Eq. 30-31; Appendix B "Decode cache").

`DecodeCache` holds, for a batch of rows of different lengths, the keys, the values and every
level of the mean-summary pyramid. `decode_step` appends one token per row at the row's own
length (its leaf mean and its ancestor path updated: O(log N) summaries touched), selects its
blocks and attends to them, itself included. Its indices equal row t of `select_blocks` on the
whole sequence and its output row t of `sparse_attention`: selection at t scores only complete
nodes before t (the current path is forced and never scored), and a pyramid built token by token
holds the same means for those as the full-sequence pyramid (to float32 rounding).

Typical use (a jitted step recompiles once per capacity bucket, O(log N) times in a generation):

    cache = DecodeCache.create(batch, capacity, num_kv_heads, head_dim)
    cache = cache.prefill(k_prompt, v_prompt, lengths)            # [B, T, HKV, D]
    step = jax.jit(functools.partial(decode_step, top_k=8), donate_argnames="cache")
    for _ in range(n):
      if needed_capacity > cache.capacity:                        # host-side count, no sync
        cache = cache.grow(needed_capacity)
      out, cache = step(q, k, v, cache)                           # q [B, 1, HQ, D]

Called outside `jit`, `decode_step` grows the cache itself when a row would pass its capacity.
Packed documents: `prefill(..., segment_ids=...)` keeps each row's last document (in
`pisa_jax.decode_cache`, with the cache itself), and `decode_step(..., new_document=...)` starts
a new document in the flagged rows; token by token, a packed sequence then decodes to the rows of
`select_blocks` / `sparse_attention` with the same `segment_ids`.

Implementations ("xla" jnp reference, "pallas" kernels in `pisa_jax.kernels.decode`) are
registered per op: "decode_append" (the cache update: in "xla" a scatter of the new token and
its recomputed leaf-to-root path, in "pallas" one kernel), "decode_select", "decode_attention",
"decode_append_select", the step's append and selection together (in "pallas" the append
runs in the walk's launch), and "decode_step", the whole step `decode_step` runs (in "pallas"
Select_K of the leaves runs in the attention's launch).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from pisa_jax import _dispatch, _validation
from pisa_jax.decode_cache import DecodeCache, bucket_capacity
from pisa_jax.geometry import level_offsets, level_sizes, round_summaries
from pisa_jax.selection import _bsa_chunk, _walk_chunk
from pisa_jax.spec import SelectionSpec, takes_spec

__all__ = ["DECODE_SELECTORS", "DecodeCache", "bucket_capacity", "decode_append_reference",
           "decode_append_select_reference",
           "decode_attention_reference", "decode_select_reference", "decode_step",
           "decode_step_reference"]

_HIGHEST = lax.Precision.HIGHEST
# Selectors a decode step supports; "exact" scores every past block's raw keys (O(N C) a step).
DECODE_SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")


# ----------------------------------------------------------------------------- jnp reference


@functools.partial(jax.jit, static_argnames=("block_size", "branching"))
def decode_append_reference(
    k_new: Float[Array, "B HKV D"],
    v_new: Float[Array, "B HKV D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    branching: int,
):
  """Appends one token per row at `positions` (the rows' lengths) and updates its leaf and the
  leaf's ancestors (Appendix B: O(log N) summaries touched), as scatters that XLA performs in
  place when the caches are donated. A row whose position is past capacity is left unchanged.

  The leaf is recomputed as the mean of its raw keys and each ancestor as the mean of its existing
  children (Eq. 15), with `build_pyramid_reference`'s arithmetic, so the summaries stay those of
  `build_pyramid` rather than drifting with incremental updates. A bfloat16 pyramid (summaries'
  dtype) rounds each float32 mean once, and its parent pools the rounded value.

  Returns:
    (k_cache, v_cache, summaries).
  """
  b, capacity, hkv, d = k_cache.shape
  sizes = level_sizes(capacity, block_size, branching)
  offsets = level_offsets(capacity, block_size, branching)
  summary_dtype = summaries.dtype.name
  rows = jnp.arange(b)
  live = positions < capacity
  pos = jnp.minimum(positions, capacity - 1)
  write = jnp.where(live, positions, capacity)  # out of bounds: dropped
  k_cache = k_cache.at[rows, write].set(k_new.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[rows, write].set(v_new.astype(v_cache.dtype), mode="drop")
  # The current leaf: the mean of its keys up to pos (Eq. 2).
  leaf = pos // block_size
  key_pos = leaf[:, None] * block_size + jnp.arange(block_size)
  keys = k_cache[rows[:, None], jnp.minimum(key_pos, capacity - 1)].astype(jnp.float32)
  keys = jnp.where((key_pos <= pos[:, None])[..., None, None], keys, 0.0)
  new = round_summaries(
      keys.sum(axis=1) / (pos - leaf * block_size + 1).astype(jnp.float32)[:, None, None],
      summary_dtype)
  values, nodes = [new], [offsets[0] + leaf]
  node = leaf
  for level in range(1, len(sizes)):
    # Eq. 15: children before `node` are complete, `node` is new, later ones do not exist yet.
    parent = node // branching
    slot = node - parent * branching
    acc = jnp.zeros_like(new)
    for j in range(branching):
      child = jnp.minimum(parent * branching + j, node)
      x = summaries[rows, offsets[level - 1] + child].astype(jnp.float32)
      acc = acc + jnp.where((j == slot)[:, None, None], new,
                            jnp.where((j < slot)[:, None, None], x, 0.0))
    new = round_summaries(acc / (slot + 1).astype(jnp.float32)[:, None, None], summary_dtype)
    node = parent
    values.append(new)
    nodes.append(offsets[level] + node)
  nodes = jnp.where(live[:, None], jnp.stack(nodes, axis=1), summaries.shape[1])
  summaries = summaries.at[rows[:, None], nodes].set(
      jnp.stack(values, axis=1).astype(summaries.dtype), mode="drop")
  return k_cache, v_cache, summaries


@takes_spec
@functools.partial(jax.jit, static_argnames=("spec",))
def decode_select_reference(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    spec: SelectionSpec,
) -> Int[Array, "B HKV K"]:
  """Selection for the token at `positions` (already appended): the full-sequence reference's own
  per-query code (`select_blocks_reference`'s walk, or its BSA rule), one row at a time over the
  cache. The walk starts at the capacity pyramid's root; the levels above a row's own root hold
  one eligible node each and keep it unscored, so the result is the row's. Gathers only the
  candidates' children: O(log N) per row, except "bsa", which scores every leaf. spec: the
  selection (or its fields as keywords), its block size and branching the cache's."""
  capacity = k_cache.shape[1]
  sizes = level_sizes(capacity, spec.block_size, spec.branching)
  offsets = level_offsets(capacity, spec.block_size, spec.branching)
  levels = tuple(summaries[:, o:o + m] for o, m in zip(offsets, sizes))
  t = jnp.minimum(positions, capacity - 1).astype(jnp.int32)
  if spec.selector == "bsa":
    def row(t, q, leaves):
      return _bsa_chunk(t[None], q[None, None], None, None, leaves[None], spec=spec)[0, 0]

    return jax.vmap(row)(t, q, levels[0])

  def row(t, q, k, levels):
    return _walk_chunk(t[None], q[None, None], None, None, None, k[None],
                       tuple(level[None] for level in levels), spec=spec)[0, 0]

  return jax.vmap(row)(t, q, k_cache, levels)


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def decode_attention_reference(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    block_indices: Int[Array, "B HKV K"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    scale: float,
) -> Float[Array, "B HQ D"]:
  """Eq. 6 for the token at `positions`: softmax attention of each query head over the keys
  j <= t of its KV head's selected blocks (-1 and blocks after t's select nothing), in float32.
  Gathers K * C keys and values per (row, KV head). Returns `[B, HQ, D]` in q's dtype."""
  b, hq, d = q.shape
  capacity, hkv = k_cache.shape[1], k_cache.shape[2]
  t = jnp.minimum(positions, capacity - 1)[:, None, None, None]
  key_pos = jnp.maximum(block_indices, 0)[..., None] * block_size + jnp.arange(block_size)
  visible = (block_indices >= 0)[..., None] & (key_pos <= t)  # [B, HKV, K, C]
  gather = (jnp.arange(b)[:, None, None, None], jnp.minimum(key_pos, capacity - 1),
            jnp.arange(hkv)[None, :, None, None])
  # Unseen keys are zeroed (their NaN can't reach it); a seen NaN key's NaN denom passes `!= 0`.
  k_sel = jnp.where(visible[..., None], k_cache[gather].astype(jnp.float32), 0.0)
  v_sel = jnp.where(visible[..., None], v_cache[gather].astype(jnp.float32), 0.0)
  qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
  logits = scale * jnp.einsum("bhgd,bhkcd->bhgkc", qg, k_sel, precision=_HIGHEST)
  visible = visible[:, :, None]
  has_key = jnp.any(visible, axis=(-2, -1), keepdims=True)
  row_max = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=(-2, -1), keepdims=True)
  p = jnp.where(visible, jnp.exp(logits - jnp.where(has_key, row_max, 0.0)), 0.0)
  denom = p.sum(axis=(-2, -1))
  out = jnp.einsum("bhgkc,bhkcd->bhgd", p, v_sel, precision=_HIGHEST)
  out = jnp.where(denom[..., None] != 0, out / jnp.where(denom != 0, denom, 1.0)[..., None], 0.0)
  return out.reshape(b, hq, d).astype(q.dtype)


# ----------------------------------------------------------------------------- the decode step


def _step(q, k, v, cache: DecodeCache, new_document, *, spec: SelectionSpec, implementation: str):
  """One validated decode step: append, select, attend."""
  # A new document's first token takes position 0: the row's earlier tokens, summaries included,
  # become stale slots, as past a row's length (append rewrites the path it needs; selection
  # scores only nodes before the token, all of which it rewrote since).
  positions = cache.lengths if new_document is None else jnp.where(new_document, 0, cache.lengths)
  # Under jit the lengths are unknown to the caller's Python: inside `traced_checks(True)` this
  # reports a token past capacity through `checkify.checkify`.
  _validation.debug_check(
      jnp.all(positions < cache.capacity),
      f"decode_step: a row of length {{}} has no room for another token in cache.capacity="
      f"{cache.capacity}: grow the cache before the step (DecodeCache.grow)", jnp.max(positions))
  step = _dispatch.lookup("decode_step", implementation)
  k_cache, v_cache, summaries, idx, out, lengths = step(
      q[:, 0], k[:, 0], v[:, 0], cache.k, cache.v, cache.summaries, positions, spec=spec)
  cache = dataclasses.replace(cache, k=k_cache, v=v_cache, summaries=summaries, lengths=lengths)
  return out[:, None], cache, idx[:, None]


@takes_spec
def decode_append_select_reference(q, k_new, v_new, k_cache, v_cache, summaries, positions, *,
                                   spec: SelectionSpec):
  """`decode_append_reference`, then `decode_select_reference` on the updated cache:
  (k_cache, v_cache, summaries, indices). The kernels run both in fewer launches."""
  k_cache, v_cache, summaries = decode_append_reference(
      k_new, v_new, k_cache, v_cache, summaries, positions, block_size=spec.block_size,
      branching=spec.branching)
  idx = decode_select_reference(q, k_cache, summaries, positions, spec=spec)
  return k_cache, v_cache, summaries, idx


@takes_spec
def decode_step_reference(q, k_new, v_new, k_cache, v_cache, summaries, positions, *,
                          spec: SelectionSpec):
  """A whole step: `decode_append_select_reference`, then `decode_attention_reference`:
  (k_cache, v_cache, summaries, indices `[B, HKV, top_k]`, output `[B, HQ, D]`, lengths `[B]` =
  positions + 1). A row past capacity (possible only under jit) was dropped by the append: it
  says so loudly, with -1 indices and a NaN output."""
  k_cache, v_cache, summaries, idx = decode_append_select_reference(
      q, k_new, v_new, k_cache, v_cache, summaries, positions, spec=spec)
  out = decode_attention_reference(q, k_cache, v_cache, idx, positions,
                                   block_size=spec.block_size, scale=spec.scale)
  over = (positions >= k_cache.shape[1])[:, None, None]
  return (k_cache, v_cache, summaries, jnp.where(over, -1, idx),
          jnp.where(over, jnp.asarray(jnp.nan, out.dtype), out), positions + 1)


_STATIC = ("spec", "implementation")
_step_donating = jax.jit(_step, static_argnames=_STATIC, donate_argnames=("cache",))
_step_keeping = jax.jit(_step, static_argnames=_STATIC)


def _check_step(q, k, v, cache, new_document) -> None:
  if not isinstance(cache, DecodeCache):
    raise TypeError(f"cache must be a DecodeCache, got {type(cache).__name__}")
  # Before anything reads the cache (the lengths, outside jit).
  cache.check_not_donated("decode_step")
  if new_document is not None and (getattr(new_document, "dtype", None) != jnp.bool_
                                   or tuple(new_document.shape) != (cache.batch,)):
    raise ValueError(f"new_document must be a bool array [B] = [{cache.batch}], got "
                     f"{getattr(new_document, 'dtype', type(new_document).__name__)} "
                     f"{tuple(getattr(new_document, 'shape', ()))}")
  _validation.check_float("q", q)
  b, hkv, d = cache.batch, cache.num_kv_heads, cache.head_dim
  if q.ndim != 4 or q.shape[1] != 1:
    raise ValueError(f"{q.shape=} must be [B, 1, HQ, D]: decode_step takes one token per row")
  if q.dtype != cache.dtype:
    raise TypeError(f"q.dtype={q.dtype} must equal the cache dtype {cache.dtype} (queries and "
                    "keys meet in one dtype, as in select_blocks)")
  if q.shape[0] != b or q.shape[3] != d or q.shape[2] % hkv:
    raise ValueError(f"{q.shape=} must be [B, 1, HQ, D] = [{b}, 1, HQ, {d}] with HQ a multiple of "
                     f"the cache's num_kv_heads={hkv}")
  for name, x in (("k", k), ("v", v)):
    _validation.check_float(name, x)
    if tuple(x.shape) != (b, 1, hkv, d):
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B, 1, HKV, D] = [{b}, 1, {hkv}, "
                       f"{d}] (the cache's batch, KV heads and head dim; one token per row)")
    if x.dtype != cache.dtype:
      raise TypeError(f"{name}.dtype={x.dtype} must equal the cache dtype {cache.dtype} "
                      "(DecodeCache.create(dtype=...))")


def decode_step(
    q: Float[Array, "B 1 HQ D"],
    k: Float[Array, "B 1 HKV D"],
    v: Float[Array, "B 1 HKV D"],
    cache: DecodeCache,
    *,
    new_document: Bool[Array, "B"] | None = None,
    top_k: int | None = None,
    selector: str | None = None,
    beam: int | None = None,
    scale: float | None = None,
    spec: SelectionSpec | None = None,
    implementation: str | None = None,
    return_indices: bool = False,
    grow: bool = True,
    donate: bool = True,
):
  """One decode step: appends each row's token, selects its blocks and attends to them.

  The token of row b takes position t = cache.lengths[b]: its key and value are written there,
  its leaf's mean and the leaf's ancestors are updated (O(log N) summaries), then its query
  selects top_k leaf blocks of its row (Section 3.3 "Decoding": one fused walk over every level,
  the leaves included) and attends to the keys 0..t of those blocks, its own included. Row t of
  `select_blocks` / `sparse_attention` on the whole sequence gives the same indices / output.

  Args:
    q: queries `[B, 1, HQ, D]`, HQ a multiple of the cache's HKV.
    k, v: the new keys and values `[B, 1, HKV, D]`, in the cache dtype.
    cache: the `DecodeCache` to extend.
    new_document: bool `[B]`, rows whose token starts a new document (packed generation): it
      takes position 0 and attends to nothing before it, exactly as the first token of a fresh
      cache; the row's length becomes 1. None: every row continues its document.
    top_k, selector, beam, scale: as in `select_blocks`; selector one of "pisa", "pisa1",
      "pisa2", "bsa" ("exact" scores every past block's raw keys and does not decode).
    spec: those options as one `pisa_jax.SelectionSpec` (a keyword must agree with it); its
      block_size, branching and summary_dtype must be the cache's. Without one, the cache's are
      used.
    implementation: "xla" (jnp reference), "pallas" (kernels) or None (pallas on GPU, else xla).
    return_indices: also return the selected blocks.
    grow: outside `jit`, reallocate the cache (`DecodeCache.grow`) when a row's token would pass
      its capacity; with False, or a cache created with growable=False, that is a ValueError.
      Under `jit` the lengths are not known: a row past capacity gets NaN outputs and -1
      indices, its token is dropped, and `grow` refuses the cache afterwards; traced inside
      `pisa_jax.traced_checks(True)` and wrapped in `jax.experimental.checkify.checkify`, the
      step reports it as an error. Grow ahead of the
      step from a host-side count instead (`bucket_capacity` says which capacity a count needs).
    donate: outside `jit`, update the cache's buffers in place: the `cache` passed in is
      consumed (use the returned one; passing it again raises a ValueError that says so). False
      keeps it valid at the price of a full copy of the cache per step. Under `jit`, donate the
      cache to the jitted function instead.

  Returns:
    (out, cache), or (out, cache, indices) with `return_indices`: out `[B, 1, HQ, D]` in q's
    dtype; the updated cache (lengths + 1); indices int32 `[B, 1, HKV, top_k]`, ascending, -1
    padded.
  """
  options = dict(top_k=top_k, selector=selector, beam=beam, scale=scale,
                 implementation=implementation, return_indices=return_indices, grow=grow,
                 donate=donate)
  for name, value in options.items():
    if isinstance(value, jax.core.Tracer):
      raise TypeError(
          f"{name} is traced: decode_step was called under jax.jit with {name} as an argument, "
          "but it fixes shapes or compiled code and must be a Python value. Bind it before "
          f"jitting, functools.partial(decode_step, {name}=...), or mark it static")
  _check_step(q, k, v, cache, new_document)
  selection = dict(top_k=top_k, selector=selector, beam=beam, scale=scale)
  if spec is None:
    spec = _validation.resolve_spec("decode_step", None, q.shape[-1], block_size=cache.block_size,
                                    branching=cache.branching, summary_dtype=cache.summary_dtype,
                                    **selection)
  else:
    spec = _validation.resolve_spec("decode_step", spec, q.shape[-1], **selection)
    if (spec.block_size, spec.branching) != (cache.block_size, cache.branching):
      raise ValueError(f"spec.block_size={spec.block_size}, spec.branching={spec.branching} must "
                       f"be the cache's block_size={cache.block_size}, branching="
                       f"{cache.branching} (DecodeCache.create)")
    if spec.summary_dtype != cache.summary_dtype:
      raise ValueError(f"spec.summary_dtype={spec.summary_dtype!r} must be the cache's "
                       f"summary_dtype={cache.summary_dtype!r} (DecodeCache.create)")
  if spec.selector not in DECODE_SELECTORS:
    raise ValueError(f"selector={spec.selector!r} does not decode: expected one of "
                     f"{DECODE_SELECTORS} ('exact' scores the raw keys of every past block, O(N) "
                     "per token)")
  implementation = _dispatch.resolve_implementation(implementation)
  if not isinstance(cache.lengths, jax.core.Tracer):
    lengths = np.asarray(cache.lengths)
    if new_document is not None and not isinstance(new_document, jax.core.Tracer):
      lengths = np.where(np.asarray(new_document), 0, lengths)
    needed = int(lengths.max(initial=0)) + 1
    if needed > cache.capacity:
      if not grow:
        raise ValueError(f"a row of length {needed - 1} cannot take another token: "
                         f"cache.capacity={cache.capacity} and grow=False")
      if not cache.growable:
        raise ValueError(f"a row of length {needed - 1} cannot take another token: "
                         f"cache.capacity={cache.capacity} and the cache was created with "
                         "growable=False")
      cache = cache.grow(needed)
  step = _step_donating if donate else _step_keeping
  out, cache, idx = step(q, k, v, cache, new_document, spec=spec,
                         implementation=implementation)
  return (out, cache, idx) if return_indices else (out, cache)
