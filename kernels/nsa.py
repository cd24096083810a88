"""Pallas (Triton) attention over one contiguous range of keys per query: NSA's compressed and
sliding-window branches, forward and backward.

Both branches are the same computation with different ranges: query t attends to the keys
[first[t], end[t]) of its row, and key j is seen by queries inside [key_first[j], key_end[j])
(a superset is enough: the per-query range decides visibility, the per-key one only bounds the
backward's loop).
  compressed attention  keys are the compressed blocks (`pisa_jax.nsa`): first is the first
                        block of t's document, end one past the last complete at t; the cost
                        is O(T * N * D), N ~ T / d.
  sliding window        keys are the tokens: first = max(document start, t - w + 1), end = t + 1;
                        O(T * w * D).
The ranges are made by the API (`pisa_jax.nsa`), which knows the layouts; these kernels know
only ranges.

Layout: q and o are viewed as `[B, T, HKV, G, D]`; a program owns `block_queries` consecutive
queries of one KV head and stacks their G heads (padded to a power of two Gp) as the M rows of
its dots, R = block_queries * Gp >= 16 (tensor-core dots need 16; a GQA group alone may be 1).
Inputs are padded outside the kernels so that every load and store is in bounds and unmasked:
queries to a multiple of block_queries (padded rows have an empty range), heads to Gp, head dim
to a power of two >= 16, keys to a multiple of block_keys (never inside a range).

Forward: one online softmax (base 2) over the key tiles the program's rows reach; it writes the
output and the natural-log log-sum-exp (-inf, and a zero output, for a row with no key), which
NSA's selection needs (Eq. 8 scores blocks by exp(logit - lse)). Backward (`jax.custom_vjp`):
delta = rowsum(o * do) - dlse in XLA (a cotangent of the lse is exact: d lse / d logit = p); a
dq kernel over the same key tiles as the forward; a dk / dv kernel per key tile that walks the
query tiles in its keys' query range, cut into parts where key tiles are few (the compressed
attention's: the first is seen by every query), their float32 partials summed in a fixed order.
Every program owns its outputs: no atomics, bit-identical run to run.

NaN: a NaN key or value reaches every row of the programs whose tiles hold it, not only the rows
that see it (p = 0 does not cancel it in the dot), as the jnp reference's dense einsum does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import LN2, LOG2E, MIN_DOT, call_kernel, dot_precision
from pisa_jax.kernels._common import dkv_tile_step, next_pow2, pow2_at_least

# Larger than any position: the empty minimum of a range's start.
_NO_KEY = 2**30


@dataclasses.dataclass(frozen=True)
class RangeAttentionConfig:
  """Tile sizes and Triton launch parameters of the three kernels.

  Attributes:
    rows: M of a program's dots, block_queries * Gp (a power of two >= 16); a group wider than
      `rows` takes one query a program.
    block_keys: keys per tile of the forward and dq loops, and per dk / dv program (a power of
      two >= 16).
    fwd_num_warps, fwd_num_stages, dq_num_warps, dq_num_stages, dkv_num_warps, dkv_num_stages:
      the launches.
    dkv_min_programs, dkv_max_splits: the dk / dv launch cuts each key tile's query range into
      up to dkv_max_splits parts (float32 partials, summed in a fixed order) until it has at
      least dkv_min_programs programs (`dkv_splits`); 1 part writes dk, dv directly.
  """

  rows: int = 64
  block_keys: int = 64
  fwd_num_warps: int = 4
  fwd_num_stages: int = 2
  dq_num_warps: int = 4
  dq_num_stages: int = 2
  dkv_num_warps: int = 4
  dkv_num_stages: int = 2
  dkv_min_programs: int = 1024
  dkv_max_splits: int = 32

  def __post_init__(self):
    for name in ("rows", "block_keys"):
      value = getattr(self, name)
      if value < MIN_DOT or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT} (a tensor-core dot)")

  @classmethod
  def default(cls, *, head_dim: int) -> "RangeAttentionConfig":
    """64 rows by 64 keys on 4 warps, the tile of a flash-attention forward at d <= 64; at
    d = 128, 32 keys a tile keep the float32 accumulators and the [R, S] scores in registers."""
    dp = pow2_at_least(head_dim, MIN_DOT)
    return cls(rows=64, block_keys=64 if dp <= 64 else 32)

  def block_queries(self, group: int) -> int:
    return max(1, self.rows // next_pow2(group))


def _row_indices(t0, block_queries: int, gp: int, dp: int):
  """The rows of a query tile: query and head of each of the R = block_queries * Gp rows, and
  the `[R, Dp]` index arrays of a gathered `[T, Gp, Dp]` load."""
  o_r = jnp.arange(block_queries * gp)
  o_t = t0 + o_r // gp
  o_g = o_r % gp
  o_d = jnp.arange(dp)
  shape = (o_r.shape[0], dp)
  i_t = jnp.broadcast_to(o_t[:, None], shape)
  i_g = jnp.broadcast_to(o_g[:, None], shape)
  return o_t, o_g, (i_t, i_g, jnp.broadcast_to(o_d[None, :], shape))


def _tile_span(first, end, block: int):
  """The tiles of `block` (keys, or queries) that hold any row's range [first, end): (lo, n)."""
  has = end > first
  lo = jnp.min(jnp.where(has, first, _NO_KEY))
  hi = jnp.max(jnp.where(has, end, 0))
  lo_tile = lax.div(jnp.minimum(lo, hi), block)
  return lo_tile, jnp.maximum(lax.div(hi + block - 1, block) - lo_tile, 0)


# ----------------------------------------------------------------------------- forward kernel


def _fwd_kernel(q_ref, k_ref, v_ref, first_ref, end_ref, o_ref, lse_ref, *, scale: float,
                block_queries: int, block_keys: int):
  """One program: query tile i, KV head h. q_ref, o_ref `[Tp, Gp, Dp]`, k_ref / v_ref
  `[Np, Dp]`, first_ref / end_ref `[Tp]`, lse_ref `[Tp, Gp]`."""
  gp, dp = q_ref.shape[1], q_ref.shape[2]
  o_t, o_g, idx = _row_indices(pl.program_id(0) * block_queries, block_queries, gp, dp)
  # [R, Dp]
  b_q = plt.load(q_ref.at[idx])
  # [R]: each row's key range.
  b_first = plt.load(first_ref.at[o_t])
  b_end = plt.load(end_ref.at[o_t])
  precision = dot_precision(b_q.dtype)
  qk_scale = scale * LOG2E
  lo_tile, num_tiles = _tile_span(b_first, b_end, block_keys)

  def body(j, carry):
    b_m, b_l, b_acc = carry
    start = pl.multiple_of((lo_tile + j) * block_keys, block_keys)
    # [S, Dp]
    b_k = k_ref[pl.ds(start, block_keys), :]
    b_v = v_ref[pl.ds(start, block_keys), :]
    o_s = start + jnp.arange(block_keys)
    # [R, S]: base-2 logits of the keys in each row's range.
    visible = (o_s[None, :] >= b_first[:, None]) & (o_s[None, :] < b_end[:, None])
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_s = jnp.where(visible, b_s, -jnp.inf)
    m_new = jnp.maximum(b_m, jnp.max(b_s, axis=1))
    # Until a row has seen a key its max is -inf; shift by 0 so no inf - inf appears.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(b_m - m_use)
    b_p = jnp.exp2(b_s - m_use[:, None])
    b_l = b_l * alpha + jnp.sum(b_p, axis=1)
    b_acc = b_acc * alpha[:, None] + jnp.dot(
        b_p.astype(b_v.dtype), b_v, precision=precision, preferred_element_type=jnp.float32)
    return m_new, b_l, b_acc

  rows = block_queries * gp
  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, dp), jnp.float32))
  b_m, b_l, b_acc = lax.fori_loop(0, num_tiles, body, init)
  # A row with no key has l = 0 and acc = 0: zeros and lse = -inf.
  has_key = b_l > 0
  b_o = b_acc / jnp.where(has_key, b_l, 1.0)[:, None]
  b_lse = jnp.where(has_key, (b_m + jnp.log2(jnp.where(has_key, b_l, 1.0))) * LN2, -jnp.inf)
  plt.store(o_ref.at[idx], b_o.astype(o_ref.dtype))
  plt.store(lse_ref.at[o_t, o_g], b_lse)


def _query_specs(tp: int, gp: int, dp: int, np_: int):
  """BlockSpecs of a (tile, KV head, batch) grid: one batch entry's and KV head's whole q-like
  `[Tp, Gp, Dp]`, k-like `[Np, Dp]`, lse-like `[Tp, Gp]` and per-query `[Tp]` / per-key `[Np]`
  rows; the kernels index them themselves."""
  q_spec = pl.BlockSpec((None, tp, None, gp, dp), lambda i, h, b: (b, 0, h, 0, 0))
  kv_spec = pl.BlockSpec((None, np_, None, dp), lambda i, h, b: (b, 0, h, 0))
  lse_spec = pl.BlockSpec((None, tp, None, gp), lambda i, h, b: (b, 0, h, 0))
  per_query = pl.BlockSpec((None, tp), lambda i, h, b: (b, 0))
  per_key = pl.BlockSpec((None, np_), lambda i, h, b: (b, 0))
  return q_spec, kv_spec, lse_spec, per_query, per_key


def _forward(q5, k, v, first, end, *, scale, interpret, config):
  """Padded q5 `[B, Tp, HKV, Gp, Dp]`, k / v `[B, Np, HKV, Dp]`, ranges `[B, Tp]` ->
  (o5 like q5, lse float32 `[B, Tp, HKV, Gp]`)."""
  b, tp, hkv, gp, dp = q5.shape
  np_ = k.shape[1]
  block_queries = config.block_queries(gp)
  q_spec, kv_spec, lse_spec, per_query, _ = _query_specs(tp, gp, dp, np_)
  kernel = functools.partial(_fwd_kernel, scale=scale, block_queries=block_queries,
                             block_keys=config.block_keys)
  return call_kernel(pl.pallas_call(
      kernel,
      grid=(tp // block_queries, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, per_query, per_query],
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, tp, hkv, gp), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.fwd_num_warps,
                                         num_stages=config.fwd_num_stages),
      interpret=interpret,
      name="nsa_range_attention_fwd",
  ), q5, k, v, first, end)


# ----------------------------------------------------------------------------- dq kernel


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, first_ref, end_ref, dq_ref, *,
               scale: float, block_queries: int, block_keys: int):
  """One program: query tile i, KV head h; the forward's loop, dq = scale * sum ds k."""
  gp, dp = q_ref.shape[1], q_ref.shape[2]
  o_t, o_g, idx = _row_indices(pl.program_id(0) * block_queries, block_queries, gp, dp)
  b_q = plt.load(q_ref.at[idx])
  b_do = plt.load(do_ref.at[idx])
  # Rows without a key carry lse = -inf; every entry of theirs is masked below.
  b_lse2 = plt.load(lse_ref.at[o_t, o_g]) * LOG2E
  b_delta = plt.load(delta_ref.at[o_t, o_g])
  b_first = plt.load(first_ref.at[o_t])
  b_end = plt.load(end_ref.at[o_t])
  precision = dot_precision(b_q.dtype)
  qk_scale = scale * LOG2E
  lo_tile, num_tiles = _tile_span(b_first, b_end, block_keys)

  def body(j, b_dq):
    start = pl.multiple_of((lo_tile + j) * block_keys, block_keys)
    b_k = k_ref[pl.ds(start, block_keys), :]
    b_v = v_ref[pl.ds(start, block_keys), :]
    o_s = start + jnp.arange(block_keys)
    visible = (o_s[None, :] >= b_first[:, None]) & (o_s[None, :] < b_end[:, None])
    # [R, S]
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_p = jnp.where(visible, jnp.exp2(b_s - b_lse2[:, None]), 0.0)
    b_dp = jnp.dot(b_do, b_v.T, precision=precision, preferred_element_type=jnp.float32)
    b_ds = b_p * jnp.where(visible, b_dp - b_delta[:, None], 0.0)
    return b_dq + jnp.dot(b_ds.astype(b_k.dtype), b_k, precision=precision,
                          preferred_element_type=jnp.float32)

  b_dq = lax.fori_loop(0, num_tiles, body, jnp.zeros((block_queries * gp, dp), jnp.float32))
  plt.store(dq_ref.at[idx], (b_dq * scale).astype(dq_ref.dtype))


# ----------------------------------------------------------------------------- dk / dv kernel


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, first_ref, end_ref,
                key_first_ref, key_end_ref, dk_ref, dv_ref, *, scale: float, block_queries: int,
                block_keys: int, splits: int):
  """One program: part s of key tile n (program n * splits + s), KV head h. Walks its share of
  the query tiles of its keys' query ranges [key_first, key_end) (the s-th of `splits` equal
  runs), each query tile's G heads as the rows; dk_ref / dv_ref `[Np, Dp]`, split s's."""
  gp, dp = q_ref.shape[1], q_ref.shape[2]
  tile, part = lax.div(pl.program_id(0), splits), lax.rem(pl.program_id(0), splits)
  start = pl.multiple_of(tile * block_keys, block_keys)
  b_k = k_ref[pl.ds(start, block_keys), :]
  b_v = v_ref[pl.ds(start, block_keys), :]
  o_s = start + jnp.arange(block_keys)
  precision = dot_precision(b_k.dtype)
  qk_scale = scale * LOG2E
  lo_tile, num_tiles = _tile_span(key_first_ref[pl.ds(start, block_keys)],
                                  key_end_ref[pl.ds(start, block_keys)], block_queries)
  share = lax.div(num_tiles + splits - 1, splits)
  lo_tile = lo_tile + part * share
  num_tiles = jnp.clip(num_tiles - part * share, 0, share)

  def body(j, carry):
    b_dk, b_dv = carry
    o_t, o_g, idx = _row_indices((lo_tile + j) * block_queries, block_queries, gp, dp)
    # [R, Dp] rows of block_queries queries x Gp heads.
    b_q = plt.load(q_ref.at[idx])
    b_do = plt.load(do_ref.at[idx])
    b_lse2 = plt.load(lse_ref.at[o_t, o_g]) * LOG2E
    b_delta = plt.load(delta_ref.at[o_t, o_g])
    # Each row's key range [first, end); the [S, R] pairs inside it attend.
    b_first = plt.load(first_ref.at[o_t])
    b_end = plt.load(end_ref.at[o_t])
    return dkv_tile_step(
        b_k, b_v, b_q, b_do, b_lse2, b_delta,
        lambda: (o_s[:, None] >= b_first[None, :]) & (o_s[:, None] < b_end[None, :]),
        b_dk, b_dv, qk_scale=qk_scale, precision=precision)

  zeros = jnp.zeros((block_keys, dp), jnp.float32)
  b_dk, b_dv = lax.fori_loop(0, num_tiles, body, (zeros, zeros))
  dk_ref[pl.ds(start, block_keys), :] = (b_dk * scale).astype(dk_ref.dtype)
  dv_ref[pl.ds(start, block_keys), :] = b_dv.astype(dv_ref.dtype)


def _backward(q5, k, v, first, end, key_first, key_end, o5, lse, do5, dlse, *, scale, interpret,
              config):
  b, tp, hkv, gp, dp = q5.shape
  np_ = k.shape[1]
  block_queries = config.block_queries(gp)
  # d lse / d logit = p: the lse's cotangent joins delta (ds = p (dp - delta + dlse)). Rows
  # without a key have p = 0 everywhere; their (-inf lse) cotangent is dropped.
  delta = jnp.sum(o5.astype(jnp.float32) * do5.astype(jnp.float32), axis=-1)
  delta = delta - jnp.where(jnp.isfinite(lse), dlse, 0.0)
  q_spec, kv_spec, lse_spec, per_query, per_key = _query_specs(tp, gp, dp, np_)
  kw = dict(scale=scale, block_queries=block_queries, block_keys=config.block_keys)
  dq5 = call_kernel(pl.pallas_call(
      functools.partial(_dq_kernel, **kw),
      grid=(tp // block_queries, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec, per_query, per_query],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
      compiler_params=plt.CompilerParams(num_warps=config.dq_num_warps,
                                         num_stages=config.dq_num_stages),
      interpret=interpret,
      name="nsa_range_attention_dq",
  ), q5, k, v, do5, lse, delta, first, end)
  key_tiles = np_ // config.block_keys
  splits = dkv_splits(key_tiles * hkv * b, config)
  if splits == 1:
    part_spec, part_shapes = kv_spec, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (k, v)]
  else:
    # Split s of every key tile writes float32 partials [s]; summed below in split order.
    part_spec = pl.BlockSpec((None, None, np_, None, dp),
                             lambda i, h, bb: (lax.rem(i, splits), bb, 0, h, 0))
    part_shapes = [jax.ShapeDtypeStruct((splits,) + k.shape, jnp.float32)] * 2
  dk, dv = call_kernel(pl.pallas_call(
      functools.partial(_dkv_kernel, splits=splits, **kw),
      grid=(key_tiles * splits, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, lse_spec, lse_spec, per_query, per_query,
                per_key, per_key],
      out_specs=[part_spec, part_spec],
      out_shape=part_shapes,
      compiler_params=plt.CompilerParams(num_warps=config.dkv_num_warps,
                                         num_stages=config.dkv_num_stages),
      interpret=interpret,
      name="nsa_range_attention_dkv" + ("_split" if splits > 1 else ""),
  ), q5, k, v, do5, lse, delta, first, end, key_first, key_end)
  if splits > 1:
    # An elementwise chain in a fixed order: the same sums run to run.
    dk, dv = (functools.reduce(jnp.add, [x[s] for s in range(splits)]).astype(y.dtype)
              for x, y in ((dk, k), (dv, v)))
  return dq5, dk, dv


def dkv_splits(programs: int, config: RangeAttentionConfig) -> int:
  """Parts each dk / dv key tile's query range is cut into, so that `programs` key tiles (times
  heads and batch) make at least `config.dkv_min_programs` programs: the compressed attention
  has few key tiles (N ~ T / d), and the first of them is seen by every later query."""
  return max(1, min(config.dkv_max_splits, -(-config.dkv_min_programs // programs)))


# ----------------------------------------------------------------------------- custom_vjp op


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _range_attention_core(q5, k, v, first, end, key_first, key_end, scale, interpret, config):
  return _forward(q5, k, v, first, end, scale=scale, interpret=interpret, config=config)


def _core_fwd(q5, k, v, first, end, key_first, key_end, scale, interpret, config):
  o5, lse = _forward(q5, k, v, first, end, scale=scale, interpret=interpret, config=config)
  return (o5, lse), (q5, k, v, first, end, key_first, key_end, o5, lse)


def _core_bwd(scale, interpret, config, residuals, cotangents):
  q5, k, v, first, end, key_first, key_end, o5, lse = residuals
  do5, dlse = cotangents
  dq5, dk, dv = _backward(q5, k, v, first, end, key_first, key_end, o5, lse,
                          do5.astype(q5.dtype), dlse, scale=scale, interpret=interpret,
                          config=config)
  # The ranges are integers: no cotangent.
  return dq5, dk, dv, None, None, None, None


_range_attention_core.defvjp(_core_fwd, _core_bwd)


def range_attention_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B N HKV D"],
    v: Float[Array, "B N HKV D"],
    first: Int[Array, "B T"],
    end: Int[Array, "B T"],
    key_first: Int[Array, "B N"],
    key_end: Int[Array, "B N"],
    *,
    scale: float,
    interpret: bool,
    config: RangeAttentionConfig | None = None,
) -> tuple[Float[Array, "B T HQ D"], Float[Array, "B T HQ"]]:
  """Attention of each query over the keys [first[t], end[t]) of its row (module docstring).

  Args:
    q: queries `[B, T, HQ, D]`; k, v: keys and values `[B, N, HKV, D]`, HQ a multiple of HKV.
    first, end: int32 `[B, T]`, 0 <= first, end <= N; an empty range (end <= first) gives a zero
      output and lse -inf.
    key_first, key_end: int32 `[B, N]`, the queries that may see key j lie in
      [key_first[j], key_end[j]) (0 <= key_first, key_end <= T; a superset is allowed).
    scale: logit scale. interpret: the Pallas interpreter instead of Triton.
    config: tiles and launches; None picks `RangeAttentionConfig.default`.

  Returns:
    out `[B, T, HQ, D]` in the inputs' common dtype and lse float32 `[B, T, HQ]` (natural log),
    both differentiable in q, k and v under `jax.custom_vjp`; the ranges get no gradient.
  """
  b, t, hq, d = q.shape
  n, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  config = RangeAttentionConfig.default(head_dim=d) if config is None else config
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  gp, dp = next_pow2(g), pow2_at_least(d, MIN_DOT)
  block_queries = config.block_queries(gp)
  tp = -(-t // block_queries) * block_queries
  np_ = -(-n // config.block_keys) * config.block_keys
  # Zero padding changes no dot product; padded queries get an empty range, padded keys lie in
  # no range, padded heads and columns are sliced off (autodiff handles pad and slice).
  q5 = jnp.pad(q.astype(dtype).reshape(b, t, hkv, g, d),
               [(0, 0), (0, tp - t), (0, 0), (0, gp - g), (0, dp - d)])
  k, v = (jnp.pad(x.astype(dtype), [(0, 0), (0, np_ - n), (0, 0), (0, dp - d)]) for x in (k, v))
  first, end = (jnp.pad(x.astype(jnp.int32), [(0, 0), (0, tp - t)]) for x in (first, end))
  key_first = jnp.pad(key_first.astype(jnp.int32), [(0, 0), (0, np_ - n)], constant_values=tp)
  key_end = jnp.pad(key_end.astype(jnp.int32), [(0, 0), (0, np_ - n)])
  ranges = [lax.stop_gradient(x) for x in (first, end, key_first, key_end)]
  o5, lse = _range_attention_core(q5, k, v, *ranges, float(scale), bool(interpret), config)
  out = o5[:, :t, :, :g, :d].reshape(b, t, hq, d)
  return out, lse[:, :t, :, :g].reshape(b, t, hq)
