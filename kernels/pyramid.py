"""Pallas kernel for the key-summary pyramid (Section 3.2, Eq. 7-15): the twin of
`pisa_jax.pyramid.build_pyramid_reference`.

A few passes: the first (`_pool_kernel`) pools `block_size` raw keys into each leaf's float32 mean;
each further pass (`_subtree_kernel`) builds up to log_g(32) upper levels at once, one program per
subtree of one (batch, KV head), so a pyramid over 1M keys takes 1 + 3 launches (g = 2) instead of one per
level (each level a separate Triton kernel made compile time, not run time, the cost). Every child
row is read once; Eq. 15 divides by the number of children that exist. Inputs keep their native layout: `[B, T, HKV, D]` is viewed as rows `[B*T*HKV, D]` and
gathered with clamped, masked 2-D index arrays, so no transpose or pad ever copies the keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float

from pisa_jax.kernels._common import next_pow2, pallas_launch, stored_summary

from pisa_jax.geometry import Pyramid, level_sizes


@dataclasses.dataclass(frozen=True)
class PyramidConfig:
  """Tile sizes of the pooling kernel.

  Attributes:
    node_tile: parents pooled per program (a power of two).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining stages.
  """

  node_tile: int = 16
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if self.node_tile < 1 or self.node_tile & (self.node_tile - 1):
      raise ValueError(f"node_tile={self.node_tile} must be a power of two")

  @classmethod
  def default(cls, num_nodes: int) -> "PyramidConfig":
    """Heuristic: 16 parents per program, fewer for tiny levels (one program is enough)."""
    return cls(node_tile=min(16, next_pow2(num_nodes)))


def load_children(x_ref, rows, m_child, o_col, c_col, d: int):
  """Child rows `[N]` of x_ref as float32 `[N, Dp]`: masked rows and the columns past D read as
  zero. The columns are clamped as well as masked: out-of-range indices read garbage on the GPU
  and NaN in the interpreter."""
  return plt.load(x_ref.at[rows[:, None], c_col[None, :]],
                  mask=m_child[:, None] & (o_col < d)[None, :], other=0.0).astype(jnp.float32)


def parent_tile(num_parents: int, node_tile: int, hkv: int):
  """This program's (batch, KV head) and its `[NT]` parent ids, in a grid over (batch, KV head,
  tile of node_tile parents)."""
  tiles = pl.cdiv(num_parents, node_tile)
  i_p = pl.program_id(0)
  i_bh, i_tile = i_p // tiles, i_p % tiles
  i_b, i_h = i_bh // hkv, i_bh % hkv
  return i_b, i_h, i_tile * node_tile + jnp.arange(node_tile)


def sum_children(add_child, group: int, node_tile: int, dp: int, bound=None):
  """float32 `[NT, Dp]`: add_child(j, acc) for the children j of every parent, unrolled up to 8
  children, else a loop to `bound()` (None: all `group`)."""
  acc = jnp.zeros((node_tile, dp), jnp.float32)
  if group <= 8:
    for j in range(group):
      acc = add_child(j, acc)
    return acc
  return jax.lax.fori_loop(0, group if bound is None else bound(), add_child, acc)


def _pool_kernel(x_ref, o_ref, *, batch: int, num_children: int, group: int,
                 num_parents: int, hkv: int, d: int, node_tile: int,
                 summary_dtype: str = "float32"):
  """Mean of `group` consecutive child rows for `node_tile` parents of one (batch, KV head).

  x_ref: rows `[B * num_children * HKV, D]`; o_ref: rows `[B * num_parents * HKV, D]` (float32,
  or bfloat16: each mean computed in float32 and rounded once).
  """
  i_b, i_h, o_parent = parent_tile(num_parents, node_tile, hkv)
  dp = next_pow2(d)
  o_col = jnp.arange(dp)
  c_col = jnp.minimum(o_col, d - 1)  # `load_children`
  m_parent = o_parent < num_parents

  def add_child(j, acc):
    # [NT] the j-th child of every parent; a missing child (past the end) reads as zero.
    child = o_parent * group + j
    m_child = m_parent & (child < num_children)
    rows = (i_b * num_children + jnp.minimum(child, num_children - 1)) * hkv + i_h
    return acc + load_children(x_ref, rows, m_child, o_col, c_col, d)

  acc = sum_children(add_child, group, node_tile, dp)
  # Eq. 15: divide by the number of children that exist (the last node may be partial).
  count = jnp.clip(num_children - o_parent * group, 1, group).astype(jnp.float32)
  # A masked store still rewrites its address in the interpreter, so masked rows go to a trash
  # row (the last one) instead of aliasing a real parent; the caller drops it.
  trash = batch * num_parents * hkv
  out_rows = jnp.where(m_parent, (i_b * num_parents + o_parent) * hkv + i_h, trash)
  plt.store(o_ref.at[out_rows[:, None], o_col[None, :]],
            stored_summary(acc / count[:, None], summary_dtype)[0])


def launch_pool(kernel, *, batch: int, parents, hkv: int, d: int, tiles: int,
                config: PyramidConfig, interpret: bool, name: str, dtype=jnp.float32):
  """One pooling launch over (batch, KV head, tile of parents): outputs (float32, or `dtype`) of
  `B * P * HKV + 1` rows `[Dp]` for each parent count P of `parents` (the last row of each a
  trash row for masked stores), one output or a list."""
  shapes = [jax.ShapeDtypeStruct((batch * p * hkv + 1, next_pow2(d)), dtype)
            for p in ([parents] if isinstance(parents, int) else parents)]
  return pallas_launch(kernel, shapes[0] if isinstance(parents, int) else shapes,
                       (batch * hkv * tiles,), warps=config.num_warps, stages=config.num_stages,
                       interpret=interpret, name=name)


def _dtype_options(summary_dtype: str) -> tuple[dict, dict, str]:
  """A kernel's summary_dtype keyword, the launch's output dtype and a name suffix: nothing new
  for float32 (its kernels and names are unchanged), bfloat16 outputs and "_bf16" otherwise."""
  if summary_dtype == "float32":
    return {}, {}, ""
  return dict(summary_dtype=summary_dtype), dict(dtype=jnp.dtype(summary_dtype)), "_bf16"


def pool_rows(x2: Array, *, batch: int, num_children: int, group: int, hkv: int, d: int,
              interpret: bool, config: PyramidConfig | None = None,
              summary_dtype: str = "float32") -> Array:
  """Means of `group` consecutive rows per (batch, KV head): `[B*N*HKV, D]` -> float32 (or
  summary_dtype) `[B*ceil(N/group)*HKV, D]` (row layout `(b, n, h)`)."""
  num_parents = -(-num_children // group)
  config = config or PyramidConfig.default(num_parents)
  tiles = -(-num_parents // config.node_tile)
  kernel_dtype, out_dtype, suffix = _dtype_options(summary_dtype)
  kernel = functools.partial(
      _pool_kernel, batch=batch, num_children=num_children, group=group,
      num_parents=num_parents, hkv=hkv, d=d, node_tile=config.node_tile, **kernel_dtype)
  out = launch_pool(kernel, batch=batch, parents=num_parents, hkv=hkv, d=d, tiles=tiles,
                    config=config, interpret=interpret, name=f"pisa_pool_g{group}{suffix}",
                    **out_dtype)(x2)
  return out[:-1, :d]


def leaf_summaries_pallas(k: Float[Array, "B T HKV D"], *, block_size: int, interpret: bool,
                          config: PyramidConfig | None = None,
                          summary_dtype: str = "float32") -> Float[Array, "B M HKV D"]:
  """Level 1 only (Eq. 2): float32 (or summary_dtype) `[B, M, HKV, D]` leaf means, for the flat
  BSA selector."""
  b, t, hkv, d = k.shape
  m = -(-t // block_size)
  leaves = pool_rows(k.reshape(b * t * hkv, d), batch=b, num_children=t, group=block_size,
                     hkv=hkv, d=d, interpret=interpret, config=config,
                     summary_dtype=summary_dtype)
  return leaves.reshape(b, m, hkv, d)


def _subtree_kernel(x_ref, *o_refs, batch: int, num_children: int, branching: int,
                    sizes: tuple[int, ...], hkv: int, d: int, summary_dtype: str = "float32"):
  """Several upper levels in one pass: a program owns one subtree of g^s children of one
  (batch, KV head) and builds its s parent levels in registers.

  Each level is Eq. 15 as a float32 dot at IEEE precision with a 0/1 pooling matrix
  `P[i, j] = (j // g == i) & child j exists` (exact: at most g non-zero terms), divided by the
  number of children that exist. x_ref: child rows `[B * num_children * HKV, D]`; o_refs[r]: level
  r's rows `[B * sizes[r] * HKV + 1, Dp]`, the last row a trash row for masked stores. A bfloat16
  pyramid rounds each level once, and the level above pools the rounded values.
  """
  g = branching
  span = g ** len(sizes)  # children per subtree
  tiles = pl.cdiv(num_children, span)
  i_p = pl.program_id(0)
  i_bh, i_tile = i_p // tiles, i_p % tiles
  i_b, i_h = i_bh // hkv, i_bh % hkv
  dp = next_pow2(d)
  o_col = jnp.arange(dp)
  c_col = jnp.minimum(o_col, d - 1)
  rows_c = max(16, next_pow2(span))
  o_child = jnp.arange(rows_c)
  child = i_tile * span + o_child
  m_child = (o_child < span) & (child < num_children)
  x_rows = (i_b * num_children + jnp.minimum(child, num_children - 1)) * hkv + i_h
  b_x = load_children(x_ref, x_rows, m_child, o_col, c_col, d)
  width = span
  for o_ref, num_parents in zip(o_refs, sizes):
    width //= g
    rows_p = max(16, next_pow2(width))
    o_par = jnp.arange(rows_p)
    parent = i_tile * width + o_par
    m_par = (o_par < width) & (parent < num_parents)
    pool = ((o_child[None, :] // g == o_par[:, None]) & m_child[None, :]).astype(jnp.float32)
    total = jax.lax.dot_general(pool, b_x, (((1,), (0,)), ((), ())),
                                precision=(jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST),
                                preferred_element_type=jnp.float32)
    count = jnp.maximum(jnp.sum(pool, axis=1), 1.0)
    b_store, b_x = stored_summary(total / count[:, None], summary_dtype)
    trash = batch * num_parents * hkv
    out_rows = jnp.where(m_par, (i_b * num_parents + parent) * hkv + i_h, trash)
    plt.store(o_ref.at[out_rows[:, None], o_col[None, :]], b_store)
    o_child, m_child = o_par, m_par


def pool_levels(x2: Array, *, batch: int, num_children: int, branching: int,
                sizes: tuple[int, ...], hkv: int, d: int, interpret: bool,
                config: PyramidConfig | None = None,
                summary_dtype: str = "float32") -> list[Array]:
  """Upper levels `sizes` (consecutive, each ceil(previous / g)) in one launch:
  `[B*N*HKV, D]` children -> float32 (or summary_dtype) `[B*M_l*HKV, D]` per level."""
  config = config or PyramidConfig()
  span = branching ** len(sizes)
  tiles = -(-num_children // span)
  kernel_dtype, out_dtype, suffix = _dtype_options(summary_dtype)
  kernel = functools.partial(_subtree_kernel, batch=batch, num_children=num_children,
                             branching=branching, sizes=tuple(sizes), hkv=hkv, d=d,
                             **kernel_dtype)
  outs = launch_pool(kernel, batch=batch, parents=list(sizes), hkv=hkv, d=d, tiles=tiles,
                     config=config, interpret=interpret,
                     name=f"pisa_pool_levels_g{branching}{suffix}", **out_dtype)(x2)
  return [o[:-1, :d] for o in outs]


def build_pyramid_pallas(k: Float[Array, "B T HKV D"], *, block_size: int, branching: int,
                         interpret: bool, config: PyramidConfig | None = None,
                         summary_dtype: str = "float32") -> Pyramid:
  """Kernel twin of `build_pyramid_reference`: float32 (or summary_dtype) levels
  `[B, M_l, HKV, D]`, leaves first.

  Args:
    k: keys `[B, T, HKV, D]`, any float dtype (pooled in float32).
    block_size: C, keys per leaf.
    branching: g, children per upper node.
    interpret: run the Pallas interpreter (CPU) instead of compiling through Triton.
    config: tile sizes; None picks `PyramidConfig.default` per level.
    summary_dtype: "float32" or "bfloat16": each mean computed in float32 from the stored
      children (or the raw keys) and rounded once.
  """
  b, t, hkv, d = k.shape
  sizes = level_sizes(t, block_size, branching)
  # Pass 1: the leaves from the raw keys (the only pass that reads O(T) data).
  rows = pool_rows(k.reshape(b * t * hkv, d), batch=b, num_children=t, group=block_size, hkv=hkv,
                   d=d, interpret=interpret, config=config, summary_dtype=summary_dtype)
  levels = [rows]
  # Then subtrees of g^s children per program, s levels per pass (a subtree of at most 32 nodes:
  # 64 made the float32 pooling dot spill registers on sm_90).
  per_pass = max(1, int(math.floor(math.log(32, branching) + 1e-9)))
  done = 1
  while done < len(sizes):
    chunk = sizes[done:done + per_pass]
    levels += pool_levels(levels[-1], batch=b, num_children=sizes[done - 1], branching=branching,
                          sizes=chunk, hkv=hkv, d=d, interpret=interpret, config=config,
                          summary_dtype=summary_dtype)
    done += len(chunk)
  summaries = tuple(x.reshape(b, m, hkv, d) for x, m in zip(levels, sizes))
  counts, num_children, group = [], t, block_size
  for size in sizes:
    counts.append(jnp.clip(num_children - jnp.arange(size) * group, 0, group).astype(jnp.int32))
    num_children, group = size, branching
  return Pyramid(summaries, tuple(counts), block_size, branching, t)
