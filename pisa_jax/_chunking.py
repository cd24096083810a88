"""Query chunking for the jnp reference: bounded memory without a Python loop over T."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# Elements of float32 temporaries one chunk may hold (about 256 MB): at T = 32768 on a 24 GB
# CPU machine the reference then needs a few hundred MB, whatever the sequence length.
CHUNK_ELEMENTS = 1 << 26


def query_chunk_size(seq_len: int, elements_per_query: int) -> int:
  """Queries per chunk so that one chunk's temporaries stay near `CHUNK_ELEMENTS`."""
  chunk = max(1, CHUNK_ELEMENTS // max(1, elements_per_query))
  if chunk >= seq_len:
    return seq_len
  return 1 << (chunk.bit_length() - 1)


def map_query_chunks(fn: Callable, chunk: int, per_query: tuple, shared: tuple = (),
                     positions=None):
  """Applies `fn(positions, *per_query_chunks, *shared)` to chunks of queries with `lax.map`.

  Args:
    fn: maps int32 positions `[Tc]` and arrays `[B, Tc, ...]` to a pytree of arrays `[B, Tc, ...]`.
    chunk: Tc, queries per chunk.
    per_query: arrays `[B, T, ...]` split along T (the first one an array; None passes through
      as None).
    shared: arguments passed whole to every call.
    positions: int32 `[T]`, the sequence position of each per_query row; None: 0..T-1.

  Returns:
    `fn`'s outputs for all T queries, `[B, T, ...]`.
  """
  seq_len = per_query[0].shape[1]
  num_chunks = -(-seq_len // chunk)
  padded = num_chunks * chunk
  if positions is None:
    positions = jnp.arange(padded, dtype=jnp.int32)
  else:
    # Padding rows take position 0 (a valid position); their outputs are dropped.
    positions = jnp.pad(positions.astype(jnp.int32), (0, padded - seq_len))
  positions = positions.reshape(num_chunks, chunk)

  def split(x):
    if x is None:
      return None
    x = jnp.pad(x, [(0, 0), (0, padded - seq_len)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], num_chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  if num_chunks == 1:
    out = fn(positions[0], *[None if x is None else split(x)[0] for x in per_query], *shared)
    return jax.tree.map(lambda y: y[:, :seq_len], out)
  out = jax.lax.map(lambda xs: fn(xs[0], *xs[1], *shared), (positions, tuple(split(x) for x in per_query)))

  def merge(y):
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], padded, *y.shape[3:])[:, :seq_len]

  return jax.tree.map(merge, out)
