"""Split-K flash-decoding over the selected blocks: program (batch row x KV head, split) runs the
online softmax (Eq. 6) over its share of the K blocks, and a jnp merge combines the splits by
log-sum-exp."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import next_pow2
from pisa_jax.kernels.decode.config import DecodeConfig, default_attend_blocks
from pisa_jax.kernels.decode.layout import (Geometry, launch, load_group_queries, load_rows,
                                            load_scalar, make_geometry)
from pisa_jax.kernels.decode.scoring import LOG2E, dot_t


def _attend_kernel(pos_ref, q_ref, k_ref, v_ref, idx_ref, o_ref, m_ref, l_ref, *,
                   geo: Geometry, blocks: int, splits: int):
  """Program (batch row x KV head, split): the online softmax (Eq. 6) of the group's heads over
  selected slots split * blocks .. split * blocks + blocks - 1; writes the unnormalised output
  `[Gp, Dp]`, the running max m and sum l `[Gp]` (base 2) for `_merge_splits`."""
  c, top_k = geo.block_size, geo.top_k
  i_bh, i_s = pl.program_id(0), pl.program_id(1)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  t = jnp.clip(load_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  cur = t // c
  qg, _ = load_group_queries(q_ref, i_b, i_h, geo)
  o_key = jnp.arange(geo.cp)
  qk_scale = geo.scale * LOG2E

  def body(j, carry):
    m, l, acc = carry
    slot = i_s * blocks + j
    blk = load_scalar(idx_ref, i_bh * top_k + jnp.minimum(slot, top_k - 1))
    # -1 padding, blocks after the current one and slots past top_k select nothing.
    ok = (slot < top_k) & (blk >= 0) & (blk <= cur)
    key_pos = jnp.clip(blk, 0, cur) * c + o_key
    visible = ok & (o_key < c) & (key_pos <= t)
    rows = (i_b * geo.capacity + jnp.minimum(key_pos, geo.capacity - 1)) * geo.hkv + i_h
    keys = load_rows(k_ref, rows, visible, geo.d, geo.dp)
    vals = load_rows(v_ref, rows, visible, geo.d, geo.dp)
    s = jnp.where(visible[None, :], dot_t(qg, keys, geo.key_mode) * qk_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_use[:, None])
    alpha = jnp.exp2(m - m_use)
    if geo.key_mode == "native":
      pv = jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    else:
      pv = jnp.dot(p, vals.astype(jnp.float32), precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

  init = (jnp.full((geo.gp,), -jnp.inf, jnp.float32), jnp.zeros((geo.gp,), jnp.float32),
          jnp.zeros((geo.gp, geo.dp), jnp.float32))
  m, l, acc = lax.fori_loop(0, blocks, body, init)
  row = i_bh * splits + i_s
  o_ref[row] = acc
  m_ref[row] = m
  l_ref[row] = l


def _merge_splits(o, m, l):
  """Log-sum-exp merge of the splits: o `[R, S, Gp, Dp]`, m, l `[R, S, Gp]` (base 2) ->
  `[R, Gp, Dp]`. A row that saw no key gets zeros."""
  m_all = jnp.max(m, axis=1, keepdims=True)
  m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.where(m == -jnp.inf, 0.0, jnp.exp2(m - m_all))
  total = jnp.sum(w * l, axis=1)
  out = jnp.sum(w[..., None] * o, axis=1)
  # != 0 rather than > 0: a NaN total (a NaN key it saw) must reach the output, not zero it.
  return jnp.where(total[..., None] != 0, out / jnp.where(total != 0, total, 1.0)[..., None], 0.0)


def decode_attention_pallas(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    block_indices: Int[Array, "B HKV K"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: DecodeConfig | None = None,
) -> Float[Array, "B HQ D"]:
  """Kernel twin of `decode_attention_reference`: Eq. 6 for the token at `positions` over the
  keys j <= t of its selected blocks, split-K over programs. Returns `[B, HQ, D]` in q's dtype."""
  b, hq, d = q.shape
  hkv, top_k = k_cache.shape[2], block_indices.shape[-1]
  # The walk's fields (branching, beam, selector) are unused by the attention kernel.
  geo = make_geometry(q, k_cache, block_size=block_size, branching=2, top_k=top_k, beam=top_k,
                      selector="pisa", scale=scale)
  config = config or DecodeConfig.default(head_dim=d)
  blocks = min(config.attend_blocks or default_attend_blocks(b, hkv, top_k), next_pow2(top_k))
  splits = -(-top_k // blocks)
  rows = b * hkv * splits
  call = launch(functools.partial(_attend_kernel, geo=geo, blocks=blocks, splits=splits),
                [jax.ShapeDtypeStruct((rows, geo.gp, geo.dp), jnp.float32),
                 jax.ShapeDtypeStruct((rows, geo.gp), jnp.float32),
                 jax.ShapeDtypeStruct((rows, geo.gp), jnp.float32)],
                (b * hkv, splits), warps=config.attend_warps, stages=config.num_stages,
                interpret=interpret, name="pisa_decode_attention")
  o, m, l = call(positions.astype(jnp.int32), q.reshape(-1, d), k_cache.reshape(-1, d),
                 v_cache.reshape(-1, d), block_indices.astype(jnp.int32).reshape(-1))
  out = _merge_splits(o.reshape(b * hkv, splits, geo.gp, geo.dp),
                      m.reshape(b * hkv, splits, geo.gp), l.reshape(b * hkv, splits, geo.gp))
  return out[:, :geo.group, :d].reshape(b, hq, d).astype(q.dtype)
