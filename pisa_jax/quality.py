"""Block-selection quality against full attention (Section 4.4, Appendix D.2, Eq. 35-36, 55-57)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _dispatch, _validation
from pisa_jax.selection import block_log_mass, flat_top_k
from pisa_jax.spec import SelectionSpec


class SelectionQuality(NamedTuple):
  """Fractions in [0, 1], averaged over the (b, t, KV head) rows with more than K eligible blocks.

  NaN when no row has more than K eligible blocks (every selector then keeps them all).
  """

  recall: Float[Array, ""]  # Recall@K, Eq. 35 (the forced blocks count).
  captured_mass: Float[Array, ""]  # Eq. 57: the share of full-attention mass retained.
  mass_ratio: Float[Array, ""]  # Eq. 36: captured mass over the reference set's mass.
  num_rows: Int[Array, ""]  # rows averaged over.


def _quality_chunk(positions, q, block_indices, k, *, block_size, scale):
  top_k = block_indices.shape[-1]
  # Eq. 55: a(B), the log of the full-attention weight of block B's visible keys, per query head.
  log_mass = block_log_mass(positions, q, k, block_size=block_size, scale=scale, causal_in_block=True)
  # Eq. 56: P(B), each head's normalised block mass averaged over the group. Blocks after the
  # query have no visible key, so their mass is exactly zero.
  head_mass = jax.nn.softmax(log_mass, axis=-1)
  mass = head_mass.mean(axis=3)
  # The full-attention reference set: forced blocks, then the highest grouped masses.
  reference = flat_top_k(mass, positions, block_size=block_size, top_k=top_k)
  selected_valid = block_indices >= 0
  in_reference = jnp.any(
      (block_indices[..., :, None] == reference[..., None, :]) & (reference[..., None, :] >= 0), axis=-1)
  recall = jnp.sum(in_reference & selected_valid, axis=-1) / top_k

  def mass_of(idx):
    # Entries outside [0, M) (padding; out-of-range indices of an unchecked call) pick nothing.
    real = (idx >= 0) & (idx < mass.shape[-1])
    picked = jnp.take_along_axis(mass, jnp.where(real, idx, 0), axis=-1)
    return jnp.sum(jnp.where(real, picked, 0.0), axis=-1)

  captured = mass_of(block_indices)
  ratio = captured / mass_of(reference)
  eligible = positions // block_size + 1
  counted = jnp.broadcast_to((eligible > top_k)[None, :, None], recall.shape)
  return recall.astype(jnp.float32), captured, ratio, counted


@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def selection_quality_reference(q, k, block_indices, *, block_size: int,
                                scale: float) -> SelectionQuality:
  """jnp reference of `selection_quality`; arguments are already validated."""
  b, seq_len, hq, _ = q.shape
  num_blocks = -(-seq_len // block_size)
  chunk = _chunking.query_chunk_size(seq_len, 3 * b * hq * num_blocks * block_size)
  fn = functools.partial(_quality_chunk, block_size=block_size, scale=scale)
  recall, captured, ratio, counted = _chunking.map_query_chunks(
      fn, chunk, (q, block_indices.astype(jnp.int32)), (k,))
  num_rows = counted.sum()

  def average(x):
    return jnp.where(num_rows > 0, jnp.sum(jnp.where(counted, x, 0.0)) / jnp.maximum(num_rows, 1), jnp.nan)

  return SelectionQuality(average(recall), average(captured), average(ratio), num_rows)


def selection_quality(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    *,
    block_size: int | None = None,
    scale: float | None = None,
    spec: SelectionSpec | None = None,
    implementation: str | None = None,
) -> SelectionQuality:
  """Recall@K, captured mass and attention-mass ratio of a selection against full attention.

  The reference set keeps the forced blocks (first, previous, current) and fills the remaining
  K - 3 slots with the eligible blocks of highest full-attention mass P(B), each query head's
  normalised block mass averaged over the heads of the KV group (Eq. 55-56). This costs
  O(T^2) time (chunked over queries, so memory stays bounded): it is a diagnostic.

  Args:
    q: queries `[B, T, HQ, D]` (post-RoPE, as the model attends with them).
    k: keys `[B, T, HKV, D]`.
    block_indices: int32 `[B, T, HKV, K]` from a selector, -1 padded. Checked as in
      `sparse_attention`: concrete indices raise, traced ones report inside
      `pisa_jax.traced_checks(True)` and `jax.experimental.checkify.checkify`; an unchecked call
      ignores out-of-range entries like -1 and counts a repeated block once per repetition
      (recall and mass can then exceed 1).
    block_size: C, keys per leaf block (default 64).
    scale: logit scale, default 1/sqrt(D).
    spec: the `pisa_jax.SelectionSpec` that selected the blocks, instead of (or agreeing with)
      block_size and scale.
    implementation: "xla" or None: the jnp reference, the only implementation of this
      diagnostic; "pallas" raises.

  Options (block_size, scale, implementation) are static under `jax.jit`, as in
  `sparse_attention`.

  Returns:
    `SelectionQuality` of scalar fractions, averaged over rows with more than K eligible blocks.
  """
  _validation.check_static("selection_quality", implementation=implementation)
  # One implementation, whatever the platform: None means it on a GPU too.
  quality = _dispatch.lookup("selection_quality",
                             "xla" if implementation is None else implementation)
  b, t, _, hkv, d = _validation.check_qk(q, k)
  spec = _validation.resolve_spec("selection_quality", spec, d, block_size=block_size,
                                  scale=scale)
  _validation.check_block_indices(
      block_indices, batch=b, seq_len=t, num_kv_heads=hkv, block_size=spec.block_size)
  if block_indices.shape[-1] < _validation.NUM_FORCED:
    raise ValueError(
        f"block_indices.shape[-1]={block_indices.shape[-1]} must be >= 3: the reference set keeps "
        f"the first, previous and current blocks")
  return quality(q, k, block_indices, block_size=spec.block_size, scale=spec.scale)
