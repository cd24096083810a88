"""The decode append kernel: the new token's key and value into the cache, then its leaf's and
every ancestor's summary (Eq. 15), in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pisa_jax.geometry import level_offsets
from pisa_jax.kernels._common import MIN_DOT, load_rows, next_pow2, pallas_launch, stored_summary
from pisa_jax.kernels.decode.config import DecodeConfig
from pisa_jax.kernels.decode.layout import load_row, load_scalar, store_row


def append_token(i_bh, pos_ref, kn_ref, vn_ref, k_ref, v_ref, s_ref, ko_ref, vo_ref, so_ref, *,
                 capacity: int, hkv: int, d: int, block_size: int, branching: int,
                 offsets: tuple[int, ...], summary_dtype: str = "float32") -> None:
  """(Batch row, KV head) i_bh: append the token at position pos = the row's length, then update
  its leaf (the mean of the block's raw keys) and every ancestor (the mean of its existing
  children, Eq. 15), leaves first. k_ref / v_ref / s_ref are aliased to ko_ref / vo_ref / so_ref:
  only rows below pos and complete siblings are read, never a row this program writes. A
  bfloat16 pyramid (summary_dtype) stores each float32 mean rounded once, and the parent pools
  the rounded value, as `decode_append_reference`."""
  dp = max(MIN_DOT, next_pow2(d))
  cp = max(MIN_DOT, next_pow2(block_size))
  num_nodes = offsets[-1] + 1
  i_b, i_h = i_bh // hkv, i_bh % hkv
  pos_raw = load_scalar(pos_ref, i_b)
  # A token past capacity is dropped: every store is masked off (the caller poisons the row).
  live = pos_raw < capacity
  pos = jnp.minimum(pos_raw, capacity - 1)
  k_new = load_row(kn_ref, i_bh, True, d, dp)  # [Dp]
  v_new = load_row(vn_ref, i_bh, True, d, dp)
  row = (i_b * capacity + pos) * hkv + i_h
  store_row(ko_ref, row, k_new, live, d, dp)
  store_row(vo_ref, row, v_new, live, d, dp)
  # The current leaf: the mean of its keys up to pos, the new one taken from the input.
  leaf = pos // block_size
  o_key = jnp.arange(cp)
  key_pos = leaf * block_size + o_key
  m_old = (o_key < block_size) & (key_pos < pos)
  rows = (i_b * capacity + jnp.minimum(key_pos, capacity - 1)) * hkv + i_h
  keys = load_rows(k_ref, rows, m_old, d, dp).astype(jnp.float32)
  keys = jnp.where((key_pos == pos)[:, None], k_new.astype(jnp.float32)[None, :], keys)
  stored, new = stored_summary(
      jnp.sum(keys, axis=0) / (pos - leaf * block_size + 1).astype(jnp.float32), summary_dtype)
  node = leaf
  store_row(so_ref, (i_b * num_nodes + offsets[0] + node) * hkv + i_h, stored, live, d, dp)
  for level in range(1, len(offsets)):
    # Eq. 15 for the parent: its children before `node` are complete and unchanged, `node`
    # holds the new mean, and the ones after it do not exist yet. Summed in child order.
    parent = node // branching
    slot = node - parent * branching
    acc = jnp.zeros((dp,), jnp.float32)
    for j in range(branching):
      child = jnp.minimum(parent * branching + j, node)
      x = load_row(s_ref, (i_b * num_nodes + offsets[level - 1] + child) * hkv + i_h, j < slot,
                   d, dp)
      if summary_dtype != "float32":
        x = x.astype(jnp.float32)
      acc = acc + jnp.where(j == slot, new, x)
    stored, new = stored_summary(acc / (slot + 1).astype(jnp.float32), summary_dtype)
    node = parent
    store_row(so_ref, (i_b * num_nodes + offsets[level] + node) * hkv + i_h, stored, live, d, dp)


def _append_kernel(pos_ref, kn_ref, vn_ref, k_ref, v_ref, s_ref, ko_ref, vo_ref, so_ref, **geo):
  """One program per (batch row, KV head)."""
  append_token(pl.program_id(0), pos_ref, kn_ref, vn_ref, k_ref, v_ref, s_ref, ko_ref, vo_ref,
               so_ref, **geo)


def append_geometry(k_cache, summaries, block_size: int, branching: int) -> dict:
  """`append_token`'s static arguments for a cache `[B, N, HKV, D]` and its pyramid."""
  _, capacity, hkv, d = k_cache.shape
  return dict(capacity=capacity, hkv=hkv, d=d, block_size=block_size, branching=branching,
              offsets=level_offsets(capacity, block_size, branching),
              summary_dtype=summaries.dtype.name)


def decode_append_pallas(
    k_new: Float[Array, "B HKV D"],
    v_new: Float[Array, "B HKV D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    branching: int,
    interpret: bool,
    config: DecodeConfig | None = None,
):
  """Kernel twin of `decode_append_reference`: the caches with the token appended at `positions`
  and the leaf / ancestor summaries updated, in place when the caller donates them.

  Returns:
    (k_cache, v_cache, summaries), same shapes and dtypes.
  """
  config = config or DecodeConfig()
  b, _, hkv, d = k_cache.shape
  kernel = functools.partial(_append_kernel,
                             **append_geometry(k_cache, summaries, block_size, branching))
  shapes = [jax.ShapeDtypeStruct((x.size // d, d), x.dtype) for x in (k_cache, v_cache, summaries)]
  call = pallas_launch(kernel, shapes, (b * hkv,), warps=config.append_warps, stages=1,
                       interpret=interpret, name="pisa_decode_append", aliases={3: 0, 4: 1, 5: 2})
  k_rows, v_rows, s_rows = call(
      positions.astype(jnp.int32), k_new.astype(k_cache.dtype).reshape(-1, d),
      v_new.astype(v_cache.dtype).reshape(-1, d), k_cache.reshape(-1, d), v_cache.reshape(-1, d),
      summaries.reshape(-1, d))
  return (k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape),
          s_rows.reshape(summaries.shape))
