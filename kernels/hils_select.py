"""Pallas (Triton) HiLS chunk selection: the chunk scores fused with their top-k.

The twin of `pisa_jax.hils.hils_select_chunks_reference` given the landmarks. For query i, KV
head h and each of its G query heads g (the module docstring of `pisa_jax.hils` gives the rules):
  lse_win_g    log sum exp of the window's logits scale * q_g . k_j, j in [lo_i, i];
  s^_gc        scale * lq_g . k'_gc + b'_gc for the chunks before the window (landmark slots
               [slot_lo_i, slot_hi_i): a document's chunks are consecutive slots);
  lse_total_g  logaddexp(lse_win_g, LSE_c s^_gc);
  rank_c       max_g (s^_gc - lse_total_g): the top_k chunks by rank, ties to the lower chunk.

One program per (run of BT queries, KV head): every score is a tensor-core dot of BT landmark
queries with a tile of BN landmark keys of one head (landmark keys are per query head, so the
group's heads are a loop, not dot rows). Two passes over the slots: the first accumulates each
head's log-sum-exp, the second forms the group's rank tile and merges it into a running top-k
of BT rows (`_common.running_top_k`: K passes of a row max over the tile and the K kept; a tile
none of whose ranks beats a row's K-th is skipped). The `[T, HQ, N]` scores never reach memory:
per query the kernel writes its K chunks. Cost: two passes of 2 T N HQ D multiply-adds (four
dots each for 16-bit inputs: a float32 landmark key is scored as its 16-bit high part plus the
rounding of the remainder, ~2^-17 relative, as the selection kernels score float32 summaries).
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

from pisa_jax.kernels._common import LOG2E, call_kernel, next_pow2, qk_dot, running_top_k


@dataclasses.dataclass(frozen=True)
class HiLSSelectConfig:
  """Tiles and launch of the selection kernel.

  Attributes:
    query_tile: BT, queries per program (the M of every dot), a power of two >= 16.
    slot_tile: BN, landmark slots per step, a power of two >= 16.
    key_tile: keys per step of the window's log-sum-exp, a power of two >= 16.
    num_warps, num_stages: the launch.
  """

  query_tile: int = 64
  slot_tile: int = 64
  key_tile: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("query_tile", "slot_tile", "key_tile"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 16 (a tensor-core dot)")


def _online_lse(carry, b_x):
  """(max, sum) of a base-2 log-sum-exp over rows `[BT]`, updated with b_x `[BT, M]`."""
  b_m, b_l = carry
  m_new = jnp.maximum(b_m, jnp.max(b_x, axis=1))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  b_l = b_l * jnp.exp2(b_m - m_use) + jnp.sum(jnp.exp2(b_x - m_use[:, None]), axis=1)
  return m_new, b_l


def _select_kernel(q_ref, lq_ref, k_ref, lk_ref, lb_ref, lo_ref, slot_lo_ref, slot_hi_ref,
                   idx_ref, *, group: int, top_k: int, kp: int, scale: float, split: bool,
                   query_tile: int, slot_tile: int, key_tile: int):
  """One program: queries t0 .. t0 + BT - 1, KV head h. q_ref, lq_ref `[Tp, G, D]`, k_ref
  `[Tk, D]`, lk_ref `[Np, G, D]` (split: `[Np, 2, G, D]`, high and low parts), lb_ref `[Np, G]`,
  lo_ref / slot_lo_ref / slot_hi_ref `[Tp]` (window's first key, eligible slots). Writes
  idx_ref `[Tp, KP]`: the kept slots in rank order, -1 past them."""
  bt, bn, bk = query_tile, slot_tile, key_tile
  t0 = pl.program_id(0) * bt
  o_t = t0 + jnp.arange(bt)
  b_lo = lo_ref[pl.ds(t0, bt)]
  b_slo = slot_lo_ref[pl.ds(t0, bt)]
  b_shi = slot_hi_ref[pl.ds(t0, bt)]
  qk2 = scale * LOG2E
  inputs_16bit = q_ref.dtype != jnp.float32
  key_first = jnp.min(b_lo) // bk
  key_last = (t0 + bt - 1) // bk
  slot_first = jnp.min(b_slo) // bn
  slot_last = -(-jnp.max(b_shi) // bn)
  o_gp = jnp.arange(next_pow2(group))

  def chunk_logits(g, b_lq, j):
    """Base-2 chunk scores `[BT, BN]` of head g for slots j BN .., -inf where not eligible."""
    o_n = j * bn + jnp.arange(bn)
    rows = pl.ds(pl.multiple_of(j * bn, bn), bn)
    if split:
      z = (qk_dot(b_lq, lk_ref[rows, 0, g, :], True) + qk_dot(b_lq, lk_ref[rows, 1, g, :], True))
    else:
      z = qk_dot(b_lq, lk_ref[rows, g, :], inputs_16bit)
    b_s = (z * scale + lb_ref[rows, g][None, :]) * LOG2E
    eligible = (o_n[None, :] >= b_slo[:, None]) & (o_n[None, :] < b_shi[:, None])
    return jnp.where(eligible, b_s, -jnp.inf), o_n

  def head_lse(g, lse_tot):
    b_q = q_ref[pl.ds(t0, bt), g, :]
    b_lq = lq_ref[pl.ds(t0, bt), g, :]

    def window_step(j, carry):
      o_k = j * bk + jnp.arange(bk)
      b_k = k_ref[pl.ds(pl.multiple_of(j * bk, bk), bk), :]
      b_s = qk_dot(b_q, b_k, inputs_16bit) * qk2
      visible = (o_k[None, :] >= b_lo[:, None]) & (o_k[None, :] <= o_t[:, None])
      return _online_lse(carry, jnp.where(visible, b_s, -jnp.inf))

    def chunk_step(j, carry):
      return _online_lse(carry, chunk_logits(g, b_lq, j)[0])

    init = (jnp.full((bt,), -jnp.inf, jnp.float32), jnp.zeros((bt,), jnp.float32))
    carry = lax.fori_loop(key_first, key_last + 1, window_step, init)
    b_m, b_l = lax.fori_loop(slot_first, slot_last, chunk_step, carry)
    # The window holds the query's own key: b_l >= 1 for every real query.
    lse = b_m + jnp.log2(jnp.where(b_l > 0, b_l, 1.0))
    return jnp.where(o_gp[:, None] == g, lse[None, :], lse_tot)

  lse_tot = lax.fori_loop(0, group, head_lse, jnp.zeros((o_gp.shape[0], bt), jnp.float32))
  o_col = jnp.arange(kp)

  def rank_step(j, carry):
    best_v, best_i = carry

    def head_rank(g, b_r):
      b_lq = lq_ref[pl.ds(t0, bt), g, :]
      b_s, _ = chunk_logits(g, b_lq, j)
      lse = jnp.sum(jnp.where(o_gp[:, None] == g, lse_tot, 0.0), axis=0)
      return jnp.maximum(b_r, b_s - lse[:, None])

    b_r = lax.fori_loop(0, group, head_rank, jnp.full((bt, bn), -jnp.inf, jnp.float32))
    o_n = j * bn + jnp.arange(bn)
    return running_top_k(best_v, best_i, b_r, o_n, o_col, top_k)

  init = (jnp.full((bt, kp), -jnp.inf, jnp.float32), jnp.full((bt, kp), -1, jnp.int32))
  _, best_i = lax.fori_loop(slot_first, slot_last, rank_step, init)
  idx_ref[pl.ds(t0, bt), :] = best_i


def hils_select_slots_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    landmark_q: Float[Array, "B T HQ D"],
    landmark_k: Float[Array, "B N HQ D"],
    landmark_bias: Float[Array, "B N HQ"],
    window_lo: Int[Array, "B T"],
    slot_lo: Int[Array, "B T"],
    slot_hi: Int[Array, "B T"],
    *,
    top_k: int,
    scale: float,
    interpret: bool,
    config: HiLSSelectConfig | None = None,
) -> Int[Array, "B T HKV K"]:
  """The top_k landmark slots of each query and KV head, in rank order, -1 past the eligible.

  Args:
    q, landmark_q `[B, T, HQ, D]`, k `[B, T, HKV, D]` (one dtype); landmark_k `[B, N, HQ, D]`,
      landmark_bias `[B, N, HQ]` (float32).
    window_lo: int32 `[B, T]`, the first key of each query's window (its last key is itself).
    slot_lo, slot_hi: int32 `[B, T]`, the landmark slots of the chunks before the window.
    top_k, scale: K and the logit scale; interpret: the Pallas interpreter instead of Triton.
  """
  config = config or HiLSSelectConfig()
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  n = landmark_k.shape[1]
  bt, bn, bk = config.query_tile, config.slot_tile, config.key_tile
  kp = next_pow2(top_k)
  dp = max(16, next_pow2(d))
  tp = -(-t // bt) * bt
  tk = -(-tp // bk) * bk
  np_ = max(1, -(-n // bn)) * bn
  dtype = q.dtype
  landmark_k = landmark_k.astype(jnp.float32)
  if dp != d:
    pad = ((0, 0), (0, 0), (0, 0), (0, dp - d))
    q, k, landmark_q, landmark_k = (jnp.pad(x, pad) for x in (q, k, landmark_q, landmark_k))
  # Padding queries see only their own position and no slot: their rows are sliced off.
  rows_pad = ((0, 0), (0, tp - t))
  q, landmark_q = (jnp.pad(x, rows_pad + ((0, 0), (0, 0))) for x in (q, landmark_q))
  k = jnp.pad(k, ((0, 0), (0, tk - t), (0, 0), (0, 0)))
  pos = jnp.arange(tp, dtype=jnp.int32)[None, :]
  window_lo = jnp.where(pos < t, jnp.pad(window_lo, rows_pad), pos)
  slot_lo = jnp.pad(slot_lo, rows_pad)
  slot_hi = jnp.pad(slot_hi, rows_pad)
  landmark_k = jnp.pad(landmark_k, ((0, 0), (0, np_ - n), (0, 0), (0, 0)))
  landmark_bias = jnp.pad(landmark_bias.astype(jnp.float32), ((0, 0), (0, np_ - n), (0, 0)))
  split = dtype != jnp.float32
  lk = landmark_k.reshape(b, np_, hkv, g, dp)
  if split:
    finfo = jnp.finfo(dtype)
    # The high part by reduce_precision (a 16-bit round trip may be folded away by XLA).
    hi = lax.reduce_precision(lk, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
    lk = jnp.stack([hi.astype(dtype), (lk - hi).astype(dtype)], axis=2)
    lk_spec = pl.BlockSpec((None, np_, 2, None, g, dp), lambda i, h, bb: (bb, 0, 0, h, 0, 0))
  else:
    lk_spec = pl.BlockSpec((None, np_, None, g, dp), lambda i, h, bb: (bb, 0, h, 0, 0))
  q_spec = pl.BlockSpec((None, tp, None, g, dp), lambda i, h, bb: (bb, 0, h, 0, 0))
  k_spec = pl.BlockSpec((None, tk, None, dp), lambda i, h, bb: (bb, 0, h, 0))
  lb_spec = pl.BlockSpec((None, np_, None, g), lambda i, h, bb: (bb, 0, h, 0))
  row_spec = pl.BlockSpec((None, tp), lambda i, h, bb: (bb, 0))
  out_spec = pl.BlockSpec((None, tp, None, kp), lambda i, h, bb: (bb, 0, h, 0))
  kernel = functools.partial(_select_kernel, group=g, top_k=top_k, kp=kp, scale=scale,
                             split=split, query_tile=bt, slot_tile=bn, key_tile=bk)
  idx = call_kernel(pl.pallas_call(
      kernel,
      grid=(tp // bt, hkv, b),
      in_specs=[q_spec, q_spec, k_spec, lk_spec, lb_spec, row_spec, row_spec, row_spec],
      out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct((b, tp, hkv, kp), jnp.int32),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="hils_select_chunks",
  ), q.reshape(b, tp, hkv, g, dp), landmark_q.reshape(b, tp, hkv, g, dp), k, lk,
      landmark_bias.reshape(b, np_, hkv, g), window_lo, slot_lo, slot_hi)
  return idx[:, :t, :, :top_k]
