"""Pallas kernel for the pyramid of packed documents: the twin of
`pisa_jax.pyramid.build_packed_pyramid_reference` (Eq. 2, Eq. 7-15 per document).

The packed node layout (`pisa_jax.segments`) keeps every node's children consecutive: a leaf's
keys are one run of positions, and an upper node's children one run of slots of the level below.
So one kernel builds every level: parent p is the mean of the rows first[p] .. first[p] +
count[p] - 1 of the level below (the raw keys for the leaves), count[p] <= C for a leaf and <= g
above. The tables first / count are integer work on `[B, T]` done in jnp (one scatter per level
from the `Documents` geometry); the kernel does all the floating-point pooling, reading each
child row once. Inputs keep their native layout (`[B, N, HKV, D]` viewed as rows `[B*N*HKV, D]`),
gathered with clamped, masked 2-D index arrays as in `pisa_jax.kernels.pyramid`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax import segments
from pisa_jax.geometry import node_span
from pisa_jax.kernels._common import next_pow2
from pisa_jax.kernels.pyramid import (PyramidConfig, launch_pool, load_children, parent_tile,
                                      sum_children)
from pisa_jax.segments import PackedPyramid


def _run_pool_kernel(x_ref, first_ref, count_ref, o_ref, *, batch: int, num_children: int,
                     num_parents: int, group: int, hkv: int, d: int, node_tile: int):
  """Means of runs of child rows for `node_tile` parents of one (batch, KV head).

  x_ref: child rows `[B * num_children * HKV, D]`; first_ref / count_ref: int32
  `[B * num_parents]`, each parent's first child and number of children (<= group, 0 for an
  unused slot); o_ref: float32 rows `[B * num_parents * HKV + 1, Dp]`, the last a trash row.
  """
  i_b, i_h, o_parent = parent_tile(num_parents, node_tile, hkv)  # [NT] parent slots
  dp = next_pow2(d)
  m_parent = o_parent < num_parents
  o_col = jnp.arange(dp)
  c_col = jnp.minimum(o_col, d - 1)
  table_rows = i_b * num_parents + jnp.minimum(o_parent, num_parents - 1)
  b_first = plt.load(first_ref.at[table_rows], mask=m_parent, other=0)
  b_count = plt.load(count_ref.at[table_rows], mask=m_parent, other=0)

  def add_child(j, acc):
    # [NT] the j-th child of every parent; a child past the parent's count reads as zero.
    child = jnp.clip(b_first + j, 0, num_children - 1)
    m_child = m_parent & (j < b_count)
    rows = (i_b * num_children + child) * hkv + i_h
    return acc + load_children(x_ref, rows, m_child, o_col, c_col, d)

  # A loop runs up to the tile's largest count: the leaf level has T slots, of which only about
  # T / C plus one per document are used, so most tiles of a long row stop at once.
  acc = sum_children(add_child, group, node_tile, dp, bound=lambda: jnp.max(b_count))
  # Eq. 15 (Eq. 2 for the leaves): divide by the children that exist; an unused slot stays 0.
  mean = acc / jnp.maximum(b_count, 1).astype(jnp.float32)[:, None]
  # Masked stores go to the trash row (the interpreter rewrites a masked store's address).
  trash = batch * num_parents * hkv
  out_rows = jnp.where(m_parent, (i_b * num_parents + o_parent) * hkv + i_h, trash)
  plt.store(o_ref.at[out_rows[:, None], o_col[None, :]], mean)


def pool_runs(x2: Array, first: Int[Array, "B N"], count: Int[Array, "B N"], *, batch: int,
              num_children: int, group: int, hkv: int, d: int, interpret: bool,
              config: PyramidConfig | None = None) -> Array:
  """Means of runs of rows per (batch, KV head): children `[B*num_children*HKV, D]` and each
  parent's (first, count) `[B, N]` -> float32 `[B*N*HKV, D]`."""
  num_parents = first.shape[1]
  config = config or PyramidConfig.default(num_parents)
  tiles = -(-num_parents // config.node_tile)
  kernel = functools.partial(
      _run_pool_kernel, batch=batch, num_children=num_children, num_parents=num_parents,
      group=group, hkv=hkv, d=d, node_tile=config.node_tile)
  out = launch_pool(kernel, batch=batch, parents=num_parents, hkv=hkv, d=d, tiles=tiles,
                    config=config, interpret=interpret, name=f"pisa_pool_runs_g{group}")(
                        x2, first.reshape(-1), count.reshape(-1))
  return out[:-1, :d]


def run_tables(docs: segments.Documents, *, block_size: int, branching: int,
               capacities: tuple[int, ...]) -> list[tuple[Array, Array]]:
  """(first, count) int32 `[B, N_l]` of every level, leaves first: a leaf's first key position
  and number of keys, an upper node's first child slot and number of children. Written at the
  position where each node begins (its document's nodes of every level start at the document's
  first token); unused slots keep (0, 0)."""
  b, seq_len = docs.start.shape
  t = jnp.arange(seq_len, dtype=jnp.int32)
  rel = t - docs.start
  rows = jnp.arange(b)[:, None]
  tables = []
  for level, cap in enumerate(capacities, start=1):
    span = node_span(level, block_size, branching)
    node = docs.node[..., level - 1]
    begins = (node >= 0) & (rel % span == 0)
    slot = jnp.where(begins, node, cap)
    if level == 1:
      first = jnp.broadcast_to(t, (b, seq_len))
      count = jnp.minimum(block_size, docs.length - rel)
    else:
      # The children: the level below's nodes that start inside this node's span.
      first = docs.node[..., level - 2]
      below = node_span(level - 1, block_size, branching)
      count = jnp.minimum(branching, -(-(docs.length - rel) // below))
    zeros = jnp.zeros((b, cap), jnp.int32)
    tables.append((zeros.at[rows, slot].set(first, mode="drop"),
                   zeros.at[rows, slot].set(count, mode="drop")))
  return tables


def build_packed_pyramid_pallas(k: Float[Array, "B T HKV D"], segment_ids: Int[Array, "B T"], *,
                                block_size: int, branching: int, interpret: bool,
                                config: PyramidConfig | None = None) -> PackedPyramid:
  """Kernel twin of `build_packed_pyramid_reference`: float32 levels `[B, N_l, HKV, D]` in the
  packed layout, leaves first; one `pool_runs` launch per level."""
  b, t, hkv, d = k.shape
  docs = segments.documents(segment_ids, block_size, branching)
  caps = segments.packed_capacities(t, block_size, branching)
  tables = run_tables(docs, block_size=block_size, branching=branching, capacities=caps)
  rows, num_children, group = k.reshape(b * t * hkv, d), t, block_size
  summaries, counts = [], []
  for cap, (first, count) in zip(caps, tables):
    rows = pool_runs(rows, first, count, batch=b, num_children=num_children, group=group,
                     hkv=hkv, d=d, interpret=interpret, config=config)
    summaries.append(rows.reshape(b, cap, hkv, d))
    counts.append(count)
    num_children, group = cap, branching
  return PackedPyramid(tuple(summaries), tuple(counts), docs.first_node, block_size, branching, t)
