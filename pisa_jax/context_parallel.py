"""Attention for one shard of a sequence split over devices (context parallelism).

Each device holds the queries, keys and values of T / N consecutive positions, starting at
`query_offset = axis_index * T / N`. `sequence_sharded` gathers every key and value over the mesh
axis (`lax.all_gather`; its transpose, a reduce-scatter, sums each device's share of dk and dv in
the backward pass) and runs an `*_at` function on the local queries against all of them:

  pisa_attention_at   PISA: the pyramid of all keys, selection and Eq. 6 for the local queries at
                      their global positions (eligibility, the forced first / previous / current
                      blocks and causality read the position in the whole sequence)
  dense_attention_at  causal dense attention of the local queries over all keys

The rows equal those of the unsharded call. Load balance: under contiguous shards the late
queries have more eligible blocks, but selection walks a fixed number of levels with a fixed
number of candidates per level and attention reads top_k blocks, so every query costs the same
(O(log T) selection, O(K C) attention) and every shard the same. The reference's shapes do not
depend on the offset at all; `benchmarks.context_parallel` measures it per shard. Dense attention
under contiguous shards is not balanced (the last shard sees all T keys, the first T / N): it is
the side-by-side baseline, not a tuned one.

Both implementations take the offset: "xla" the jnp references (`select_blocks_reference_offset`,
`sparse_attention_reference_at`), "pallas" the kernels with a query-offset input (an int32 `[1]`
array, since `lax.axis_index` is traced under `shard_map`), registered (`pisa_jax._ops`) as the ops
"select_blocks_offset" and "sparse_attention_offset".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from pisa_jax import _dispatch, _validation, checkpoint_names
from pisa_jax.spec import SelectionSpec


def _check_at(q, k, v, query_offset) -> tuple[int, int]:
  """Checks q `[B, Tq, HQ, D]` against k, v `[B, T, HKV, D]` and a concrete offset; (Tq, T)."""
  for name, x, layout in (("q", q, "[B, Tq, HQ, D]"), ("k", k, "[B, T, HKV, D]"),
                          ("v", v, "[B, T, HKV, D]")):
    _validation.check_float(name, x)
    _validation.check_rank4(name, x, layout)
  b, tq, hq, d = q.shape
  if k.shape[0] != b or k.shape[3] != d or k.shape[1] < tq:
    raise ValueError(f"k.shape={tuple(k.shape)} must be [B={b}, T >= Tq={tq}, HKV, D={d}] "
                     f"(q.shape={tuple(q.shape)})")
  if hq % k.shape[2]:
    raise ValueError(f"query heads HQ={hq} must be a multiple of key/value heads HKV={k.shape[2]}")
  _validation.check_v(v, k)
  if k.dtype != q.dtype:
    raise TypeError(f"q and k must have the same dtype, got q {q.dtype} and k {k.dtype}")
  if not isinstance(query_offset, jax.core.Tracer):
    offset = int(query_offset)
    if offset < 0 or offset + tq > k.shape[1]:
      raise ValueError(f"query_offset={offset} must be in [0, T - Tq] = [0, {k.shape[1] - tq}]: "
                       f"the queries are positions query_offset .. query_offset + Tq - 1 of the "
                       f"T = {k.shape[1]} keys")
  return tq, k.shape[1]


def pisa_attention_at(
    q: Float[Array, "B Tq HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    query_offset: Int[Array, ""] | int,
    *,
    block_size: int | None = None,
    top_k: int | None = None,
    branching: int | None = None,
    selector: str | None = None,
    scale: float | None = None,
    beam: int | None = None,
    summary_dtype=None,
    spec: SelectionSpec | None = None,
    implementation: str | None = None,
) -> Float[Array, "B Tq HQ D"]:
  """`pisa_attention` for the queries at positions query_offset .. query_offset + Tq - 1.

  Args:
    q: those queries `[B, Tq, HQ, D]`.
    k, v: every key and value of the sequence `[B, T, HKV, D]`, q's dtype.
    query_offset: int32 scalar, the position of q's first row; may be traced (under
      `shard_map`, `lax.axis_index(axis) * Tq`).
    The options (and `spec=`) are `pisa_attention`'s. implementation: "xla", "pallas" or None
      ("pallas" on a GPU, "xla" elsewhere); selector="exact" has no kernel and needs "xla".

  Returns:
    `[B, Tq, HQ, D]` in q's dtype: rows query_offset .. query_offset + Tq - 1 of
    `pisa_attention(q_all, k, v, ...)`. Differentiable in q, k and v; dk and dv are the local
    queries' share of the gradients.
  """
  _validation.check_static("pisa_attention_at", implementation=implementation)
  _check_at(q, k, v, query_offset)
  spec = _validation.resolve_spec("pisa_attention_at", spec, q.shape[-1], block_size=block_size,
                                  top_k=top_k, branching=branching, selector=selector,
                                  scale=scale, beam=beam, summary_dtype=summary_dtype)
  if spec.selector == "exact" and _dispatch.resolve_implementation(implementation) != "xla":
    raise ValueError(f"selector={spec.selector!r} exists only in the reference: pass "
                     f"implementation='xla' for it (got implementation={implementation!r})")
  offset = jnp.asarray(query_offset, jnp.int32)
  select = _jitted(_dispatch.lookup("select_blocks_offset", implementation))
  block_indices = select(lax.stop_gradient(q), lax.stop_gradient(k), offset, spec=spec)
  # Selected in a jit and tagged, as in `pisa_attention`: a remat policy can keep the indices,
  # and a checkpointed backward then drops the selection (`checkpoint_names`).
  block_indices = checkpoint_name(lax.stop_gradient(block_indices), checkpoint_names.BLOCK_INDICES)
  attend = _dispatch.lookup("sparse_attention_offset", implementation)
  return attend(q, k, v, block_indices, offset, block_size=spec.block_size, scale=spec.scale)


@functools.cache
def _jitted(select: Callable) -> Callable:
  return jax.jit(select, static_argnames=("spec",))


def dense_attention_at(
    q: Float[Array, "B Tq HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    query_offset: Int[Array, ""] | int,
    *,
    implementation: str | None = None,
) -> Float[Array, "B Tq HQ D"]:
  """Causal dense attention of the queries at query_offset .. query_offset + Tq - 1 over all T
  keys: `jax.nn.dot_product_attention` under a `[Tq, T]` mask (key j visible when j <= the
  query's position). implementation: `jax.nn.dot_product_attention`'s ("xla", "cudnn", None)."""
  tq, t = _check_at(q, k, v, query_offset)
  positions = jnp.asarray(query_offset, jnp.int32) + jnp.arange(tq, dtype=jnp.int32)
  mask = jnp.arange(t, dtype=jnp.int32)[None, :] <= positions[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None],
                                      implementation=implementation)


def sequence_sharded(attend_at: Callable, axis_name: str) -> Callable:
  """`attend(q, k, v)` for use inside `shard_map` over `axis_name`, with q, k, v each device's
  consecutive shard `[B, T / N, H, D]` of the sequence: gathers all keys and values over the
  axis and returns `attend_at(q, k_all, v_all, query_offset)` for the local queries."""

  def attend(q, k, v):
    offset = lax.axis_index(axis_name) * q.shape[1]
    k_all = lax.all_gather(k, axis_name, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis_name, axis=1, tiled=True)
    return attend_at(q, k_all, v_all, offset)

  return attend
