"""Block-sparse attention over selected leaf blocks (Eq. 6), and the full PISA layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pisa_jax import _chunking, _dispatch, _validation
from pisa_jax.kernels import attention as attention_kernels
from pisa_jax.selection import select_blocks

_HIGHEST = lax.Precision.HIGHEST


def _sparse_attention_chunk(positions, q, block_indices, k, v, *, block_size, scale):
  """Eq. 6 for one chunk of queries: q `[B, Tc, HQ, D]`, block_indices `[B, Tc, HKV, K]`."""
  b, tc, hq, d = q.shape
  seq_len, hkv = k.shape[1], k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, tc, hkv, hq // hkv, d)
  # Key positions of every selected block: [B, Tc, HKV, K, C].
  key_pos = jnp.maximum(block_indices, 0)[..., None] * block_size + jnp.arange(block_size)
  # Keys after the query inside the current block, past the end of the sequence, and in -1
  # padding slots are invisible.
  visible = ((block_indices >= 0)[..., None] & (key_pos < seq_len)
             & (key_pos <= positions[None, :, None, None, None]))
  gather_pos = jnp.minimum(key_pos, seq_len - 1)
  b_idx = jnp.arange(b)[:, None, None, None, None]
  h_idx = jnp.arange(hkv)[None, None, :, None, None]
  k_sel = k[b_idx, gather_pos, h_idx].astype(jnp.float32)
  v_sel = v[b_idx, gather_pos, h_idx].astype(jnp.float32)
  logits = scale * jnp.einsum("bthgd,bthkcd->bthgkc", qg, k_sel, precision=_HIGHEST)
  p, denom = _masked_exp(logits, visible[:, :, :, None], axes=(-2, -1))
  out = jnp.einsum("bthgkc,bthkcd->bthgd", p, v_sel, precision=_HIGHEST)
  return _normalise(out, denom).reshape(b, tc, hq, d).astype(q.dtype)


def _masked_exp(logits, visible, axes):
  """Unnormalised softmax weights over the visible keys (reduced over `axes`) and their sum.

  exp of the masked logits, not a masked exp: a hidden logit far above the visible ones would
  overflow to inf, and the backward pass would multiply it by the mask's zero (NaN).
  """
  row_max = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=axes, keepdims=True)
  row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  p = jnp.exp(jnp.where(visible, logits, -jnp.inf) - row_max)
  return p, p.sum(axis=axes)


def _normalise(out, denom):
  """out / denom per row; a query with no visible key gets zeros, never NaN."""
  return jnp.where(denom[..., None] > 0, out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def _sparse_attention_masked(q, k, v, block_indices, *, block_size, scale):
  """Eq. 6 as dense attention under the selection's mask: `[B, T, HQ, D]`.

  The same softmax over the same visible keys as `_sparse_attention_chunk`, written with a
  `[B, HKV, G, T, T]` mask instead of gathered blocks: cheaper when the selected keys are a large
  share of T (short sequences: the README's main job), whose gathers and their scatter-add
  gradients dominate on a CPU.
  """
  b, seq_len, hq, d = q.shape
  hkv = k.shape[2]
  num_blocks = -(-seq_len // block_size)
  # [B, T, HKV, M]: which leaf blocks each (query, KV head) selected; -1 matches none.
  chosen = jnp.any(block_indices[..., None] == jnp.arange(num_blocks), axis=-2)
  key_block = jnp.arange(seq_len) // block_size
  pos = jnp.arange(seq_len)
  # [B, HKV, T, T]: key j visible to query t.
  visible = (jnp.take(chosen, key_block, axis=-1) & (pos[None, :] <= pos[:, None])[None, :, None])
  visible = jnp.moveaxis(visible, 2, 1)[:, :, None]
  qg = q.astype(jnp.float32).reshape(b, seq_len, hkv, hq // hkv, d)
  logits = scale * jnp.einsum("bthgd,bshd->bhgts", qg, k.astype(jnp.float32), precision=_HIGHEST)
  p, denom = _masked_exp(logits, visible, axes=-1)
  out = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32), precision=_HIGHEST)
  denom = jnp.moveaxis(denom, 3, 1)  # [B, T, HKV, G]
  return _normalise(out, denom).reshape(b, seq_len, hq, d).astype(q.dtype)


def uses_masked_formulation(batch: int, seq_len: int, num_heads: int, top_k: int,
                            block_size: int) -> bool:
  """Whether the reference takes the masked form: when T <= 2 * K * C its `[T, T]` logits are at
  most twice the `[T, K * C]` of the gathered form, and it avoids the gathers; and only while its
  unchunked `[B, HQ, T, T]` temporaries stay within the gathered form's per-chunk bound."""
  return (seq_len <= 2 * top_k * block_size
          and batch * num_heads * seq_len * seq_len <= _chunking.CHUNK_ELEMENTS)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "masked"))
def sparse_attention_reference(q, k, v, block_indices, *, block_size: int, scale: float,
                               masked: bool | None = None):
  """jnp reference of `sparse_attention`; arguments are already validated.

  masked: None picks by `uses_masked_formulation`; True / False force the masked or the gathered
  form (both are Eq. 6; the tests pin them equal).
  """
  b, seq_len, hq, d = q.shape
  hkv, top = k.shape[2], block_indices.shape[-1]
  block_indices = lax.stop_gradient(block_indices.astype(jnp.int32))
  if masked is None:
    masked = uses_masked_formulation(b, seq_len, hq, top, block_size)
  if masked:
    return _sparse_attention_masked(q, k, v, block_indices, block_size=block_size, scale=scale)
  chunk = _chunking.query_chunk_size(seq_len, b * hkv * top * block_size * (2 * d + 2 * hq // hkv))
  fn = functools.partial(_sparse_attention_chunk, block_size=block_size, scale=scale)
  return _chunking.map_query_chunks(fn, chunk, (q, block_indices), (k, v))


def sparse_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    *,
    block_size: int = 64,
    scale: float | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """Causal attention of each query over the keys of its selected blocks (Eq. 6).

  Query t, head hq attends to key positions j <= t inside the blocks `block_indices[b, t, hkv]`
  of its KV head `hkv = hq // (HQ // HKV)`; -1 entries are ignored and a query with no visible key
  gets zeros.

  Args:
    q: queries `[B, T, HQ, D]`.
    k: keys `[B, T, HKV, D]`.
    v: values `[B, T, HKV, D]`.
    block_indices: int32 `[B, T, HKV, K]`, entries in [-1, ceil(T / block_size)), no repeats in a
      row. Values are checked when concrete; under `jit`, out-of-range entries are not detected.
    block_size: C, keys per leaf block.
    scale: logit scale, default 1/sqrt(D).
    implementation: "xla" (jnp reference), "pallas" (kernel) or None (pallas on GPU, else xla).

  Returns:
    `[B, T, HQ, D]` in q's dtype. Differentiable in q, k and v; the indices get no gradient.
  """
  b, t, _, hkv, d = _validation.check_qk(q, k)
  _validation.check_v(v, k)
  _validation.check_block_size(block_size)
  _validation.check_block_indices(
      block_indices, batch=b, seq_len=t, num_kv_heads=hkv, block_size=int(block_size))
  return _attend(q, k, v, block_indices, block_size=int(block_size),
                 scale=_validation.resolve_scale(scale, d), implementation=implementation)


def _attend(q, k, v, block_indices, *, block_size: int, scale: float, implementation):
  """Dispatches validated arguments to the reference or the kernel."""
  attend = _dispatch.lookup("sparse_attention", implementation)
  return attend(q, k, v, block_indices, block_size=block_size, scale=scale)


def pisa_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    *,
    block_size: int = 64,
    top_k: int = 8,
    branching: int = 2,
    selector: str = "pisa",
    scale: float | None = None,
    beam: int | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """PISA attention: select blocks (no gradient through the choice), then attend to them.

  Appendix B: during backpropagation the selected indices are held fixed; gradients flow through
  attention on the selected entries only. Arguments as in `select_blocks` and `sparse_attention`.

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k and v.
  """
  _validation.check_v(v, k)
  block_indices = select_blocks(
      lax.stop_gradient(q), lax.stop_gradient(k), block_size=block_size, top_k=top_k,
      branching=branching, selector=selector, scale=scale, beam=beam,
      implementation=implementation)
  # select_blocks has validated every argument, and its indices are valid by construction: no
  # second check (which would copy concrete indices to the host on every eager call).
  return _attend(q, k, v, lax.stop_gradient(block_indices), block_size=int(block_size),
                 scale=_validation.resolve_scale(scale, q.shape[-1]), implementation=implementation)


_dispatch.register(
    "sparse_attention",
    xla=sparse_attention_reference,
    pallas=_dispatch.with_interpret(attention_kernels.sparse_attention_pallas),
)
