"""The key-summary pyramid (Section 3.2, Eq. 7-15): mean pooling from the leaves to one root."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pisa_jax import _dispatch, _validation
from pisa_jax.geometry import Pyramid, level_sizes, node_span
from pisa_jax.kernels import pyramid as pyramid_kernels


def _mean_pool(x: Float[Array, "B N H D"], group: int, num_valid: int):
  """Means of consecutive groups of `group` rows along axis 1, over the rows that exist."""
  b, n, h, d = x.shape
  m = -(-n // group)
  x = jnp.pad(x, ((0, 0), (0, m * group - n), (0, 0), (0, 0)))
  total = x.reshape(b, m, group, h, d).sum(axis=2)
  counts = jnp.clip(num_valid - jnp.arange(m) * group, 0, group).astype(jnp.int32)
  return total / counts[None, :, None, None].astype(jnp.float32), counts


@functools.partial(jax.jit, static_argnames=("block_size", "branching"))
def build_pyramid_reference(k, *, block_size: int, branching: int) -> Pyramid:
  """jnp reference of `build_pyramid`; k is already validated."""
  seq_len = k.shape[1]
  # Eq. 2 / Eq. 15 with l = 0: a leaf is the mean of its valid keys; the last may be partial.
  leaves, leaf_counts = _mean_pool(k.astype(jnp.float32), block_size, seq_len)
  summaries, counts = [leaves], [leaf_counts]
  while summaries[-1].shape[1] > 1:
    # Eq. 15: the mean of up to `branching` valid children, divided by how many exist.
    parent, parent_counts = _mean_pool(summaries[-1], branching, summaries[-1].shape[1])
    summaries.append(parent)
    counts.append(parent_counts)
  return Pyramid(tuple(summaries), tuple(counts), block_size, branching, seq_len)


def build_pyramid(
    k: Float[Array, "B T HKV D"],
    *,
    block_size: int = 64,
    branching: int = 2,
    implementation: str | None = None,
) -> Pyramid:
  """Builds the mean-summary pyramid of the keys.

  Args:
    k: keys `[B, T, HKV, D]`, any float dtype; summaries are float32.
    block_size: C, keys per leaf block.
    branching: g, children merged into each upper node.
    implementation: "xla" (jnp reference), "pallas" (kernel) or None (pallas on GPU, else xla).

  Options (block_size, branching, implementation) fix shapes or compiled code: under `jax.jit`
  pass them as static arguments or bind them first.

  Returns:
    A `Pyramid` with levels `[B, M_l, HKV, D]` from the leaves to a single root.
  """
  _validation.check_static("build_pyramid", block_size=block_size, branching=branching,
                           implementation=implementation)
  _validation.check_float("k", k)
  _validation.check_rank4("k", k, "[B, T, HKV, D]")
  if k.shape[1] < 1:
    raise ValueError(f"sequence length T={k.shape[1]} must be >= 1")
  _validation.check_block_size(block_size)
  _validation.check_branching(branching)
  build = _dispatch.lookup("build_pyramid", implementation)
  return build(k, block_size=int(block_size), branching=int(branching))


_dispatch.register(
    "build_pyramid",
    xla=build_pyramid_reference,
    pallas=_dispatch.with_interpret(pyramid_kernels.build_pyramid_pallas),
)
