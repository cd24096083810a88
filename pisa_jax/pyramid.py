"""The key-summary pyramid (Section 3.2, Eq. 7-15): mean pooling from the leaves to one root.

Two layouts, two references: one document's level l is exactly `[B, M_l, HKV, D]`, each node the
mean of a fixed run of rows (a reshape and a sum); packed documents' levels hold every
document's nodes at static capacities (`pisa_jax.segments`: N_1 = T leaf slots), each node a
segment sum. One document as a packed row would hold T leaf slots instead of T / C and sum in
another order (the means then differ in the last bit from the ones the decode cache and the
golden cases pin), so the one-document pyramid keeps its own code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pisa_jax import _dispatch, _validation, segments
from pisa_jax.geometry import Pyramid, round_summaries
from pisa_jax.segments import PackedPyramid
from pisa_jax.spec import SelectionSpec


def _mean_pool(x: Float[Array, "B N H D"], group: int, num_valid: int):
  """Means of consecutive groups of `group` rows along axis 1, over the rows that exist."""
  b, n, h, d = x.shape
  m = -(-n // group)
  x = jnp.pad(x, ((0, 0), (0, m * group - n), (0, 0), (0, 0)))
  total = x.reshape(b, m, group, h, d).sum(axis=2)
  counts = jnp.clip(num_valid - jnp.arange(m) * group, 0, group).astype(jnp.int32)
  return total / counts[None, :, None, None].astype(jnp.float32), counts


@functools.partial(jax.jit, static_argnames=("block_size", "branching", "summary_dtype"))
def build_pyramid_reference(k, *, block_size: int, branching: int,
                            summary_dtype: str = "float32") -> Pyramid:
  """jnp reference of `build_pyramid`; k is already validated. Each mean is computed in float32
  and rounded once to summary_dtype; the level above pools the rounded values."""
  seq_len = k.shape[1]
  # Eq. 2 / Eq. 15 with l = 0: a leaf is the mean of its valid keys; the last may be partial.
  leaves, leaf_counts = _mean_pool(k.astype(jnp.float32), block_size, seq_len)
  summaries, counts = [round_summaries(leaves, summary_dtype)], [leaf_counts]
  while summaries[-1].shape[1] > 1:
    # Eq. 15: the mean of up to `branching` valid children, divided by how many exist.
    parent, parent_counts = _mean_pool(summaries[-1], branching, summaries[-1].shape[1])
    summaries.append(round_summaries(parent, summary_dtype))
    counts.append(parent_counts)
  dtype = jnp.dtype(summary_dtype)
  return Pyramid(tuple(s.astype(dtype) for s in summaries), tuple(counts), block_size, branching,
                 seq_len)


@functools.partial(jax.jit, static_argnames=("block_size", "branching"))
def build_packed_pyramid_reference(k, segment_ids, *, block_size: int,
                                   branching: int) -> PackedPyramid:
  """jnp reference of `build_pyramid` with segment_ids; arguments are already validated."""
  docs = segments.documents(segment_ids, block_size, branching)
  return segments.packed_pyramid(k, docs, block_size=block_size, branching=branching)


def build_pyramid(
    k: Float[Array, "B T HKV D"],
    *,
    block_size: int | None = None,
    branching: int | None = None,
    spec: SelectionSpec | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    summary_dtype=None,
    implementation: str | None = None,
) -> Pyramid | PackedPyramid:
  """Builds the mean-summary pyramid of the keys.

  Args:
    k: keys `[B, T, HKV, D]`, any float dtype; summaries are float32 (or summary_dtype).
    block_size: C, keys per leaf block (default 64).
    branching: g, children merged into each upper node (default 2).
    spec: a `pisa_jax.SelectionSpec` whose block_size and branching to use (an option also
      passed as a keyword must agree with it).
    segment_ids: None, or int32 `[B, T]` non-decreasing within a row: packed documents (runs of
      equal ids), each summarised on its own block grid from its first token
      (`pisa_jax.segments`).
    implementation: "xla" (jnp reference), "pallas" (kernel) or None (pallas on GPU, else xla).

  Options (block_size, branching, implementation) fix shapes or compiled code: under `jax.jit`
  pass them as static arguments or bind them first.

  Returns:
    Without segment_ids, a `Pyramid` with levels `[B, M_l, HKV, D]` from the leaves to a single
    root. With them, a `PackedPyramid`: every document's own pyramid (what `build_pyramid` of
    the document alone returns), its nodes at consecutive slots of `[B, N_l, HKV, D]` per level
    from `first_node`.
  """
  _validation.check_static("build_pyramid", implementation=implementation)
  _validation.check_float("k", k)
  _validation.check_rank4("k", k, "[B, T, HKV, D]")
  if k.shape[1] < 1:
    raise ValueError(f"sequence length T={k.shape[1]} must be >= 1")
  spec = _validation.resolve_spec("build_pyramid", spec, k.shape[-1], block_size=block_size,
                                  branching=branching, summary_dtype=summary_dtype)
  _validation.check_segment_ids(segment_ids, batch=k.shape[0], seq_len=k.shape[1])
  if segment_ids is not None:
    _validation.check_packed_summary_dtype(spec)
    build = _dispatch.lookup("build_pyramid_packed", implementation)
    return build(k, segment_ids, block_size=spec.block_size, branching=spec.branching)
  build = _dispatch.lookup("build_pyramid", implementation)
  return build(k, block_size=spec.block_size, branching=spec.branching,
               summary_dtype=spec.summary_dtype)
