"""The Pallas kernels of context parallelism: selection and attention for a run of queries at a
query offset inside a longer sequence (a sequence shard), against the jnp references at that
offset; and at offset 0, the same Triton IR as the kernels without an offset."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tolerances
from pisa_jax.attention import sparse_attention_reference_at
from pisa_jax.kernels import attention as attn
from pisa_jax.kernels.selection import SelectionConfig, select_blocks_pallas
from pisa_jax.selection import select_blocks_reference_offset
from pisa_jax.testing import mismatch_margins, random_block_indices

F32 = jnp.float32


def _qkv(seed, b, t, hq, hkv, d, dtype=F32):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, hq, d), F32).astype(dtype)
  k = jax.random.normal(keys[1], (b, t, hkv, d), F32).astype(dtype)
  v = jax.random.normal(keys[2], (b, t, hkv, d), F32).astype(dtype)
  w = jax.random.normal(keys[3], (b, t, hq, d), F32)
  return q, k, v, w


# (T, Tq, offset, HQ, HKV, D, C, K): offset 0, an offset that is not a multiple of C, the last
# shard; T not a multiple of C; GQA groups 1, 2, 3.
ATTENTION_CASES = [
    (64, 32, 0, 4, 2, 16, 8, 4),
    (100, 40, 37, 6, 2, 16, 8, 4),
    (100, 25, 75, 3, 3, 24, 16, 3),
    (96, 48, 48, 4, 1, 16, 8, 5),
]


@pytest.mark.parametrize("t,tq,offset,hq,hkv,d,c,top_k", ATTENTION_CASES)
def test_attention_at_offset_matches_the_reference(t, tq, offset, hq, hkv, d, c, top_k):
  q_all, k, v, w_all = _qkv(t + offset, 2, t, hq, hkv, d)
  q, w = q_all[:, offset:offset + tq], w_all[:, offset:offset + tq]
  idx = jnp.asarray(random_block_indices(offset, t, hkv, top_k, c, batch=2,
                                         thin_rows=0.2)[:, offset:offset + tq])
  scale = d ** -0.5

  def loss(fn, q, k, v, off):
    out = fn(q, k, v, idx, off, block_size=c, scale=scale)
    return jnp.sum(out * w), out

  grads = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True), static_argnums=0)
  kernel = functools.partial(attn.sparse_attention_pallas_at, interpret=True)
  # The offset traced (as under shard_map), then as a Python int.
  (_, out), got = grads(kernel, q, k, v, jnp.int32(offset))
  (_, ref), want = grads(sparse_attention_reference_at, q, k, v, jnp.int32(offset))
  np.testing.assert_allclose(out, ref, atol=tolerances.OUTPUT_ATOL[F32],
                             rtol=tolerances.OUTPUT_RTOL[F32])
  for name, g, r in zip(("dq", "dk", "dv"), got, want):
    assert g.shape == r.shape, name
    np.testing.assert_allclose(g, r, atol=tolerances.GRAD_ATOL[F32],
                               rtol=tolerances.GRAD_RTOL[F32], err_msg=name)
  # Keys after the shard's last query get no gradient from it.
  np.testing.assert_array_equal(got[1][:, offset + tq:], 0.0)
  static = jax.jit(lambda q, k, v: kernel(q, k, v, idx, offset, block_size=c, scale=scale))
  np.testing.assert_array_equal(static(q, k, v), out)


# (T, Tq, offset, HQ, HKV, D, K, selector, C, g, config): offset 0, offsets that are not a
# multiple of C, the last shard; T not a multiple of C; GQA groups 1, 2, 3; the fused kernel
# (rank top-k, pair and unshifted LSE), the two-stage pipeline (rank and passes) and BSA.
PASSES = SelectionConfig(variant="two_stage", q_tile=4, topk_impl="passes", topk_rows=32,
                         walk_pair_lse=False, fused_unshifted_lse=False)
SELECTION_CASES = [
    (300, 100, 0, 6, 2, 64, 4, "pisa", 16, 2, SelectionConfig()),
    (300, 100, 137, 4, 2, 64, 4, "pisa", 16, 2, SelectionConfig()),
    (300, 100, 200, 3, 1, 64, 8, "pisa", 16, 2, SelectionConfig(variant="two_stage")),
    (250, 50, 200, 4, 2, 32, 4, "pisa", 16, 2, PASSES),
    (250, 50, 123, 2, 1, 64, 4, "pisa2", 16, 3, dataclasses.replace(PASSES, q_tile=2)),
    (250, 125, 125, 6, 2, 64, 5, "bsa", 16, 2, SelectionConfig(bsa_q_tile=4, bsa_block_tile=16)),
    (250, 50, 37, 3, 1, 64, 4, "bsa", 8, 2, SelectionConfig(bsa_q_tile=8, bsa_block_tile=16)),
]


def _select_inputs(seed, t, hq, hkv, d):
  kq, kk = jax.random.split(jax.random.key(seed))
  q = jax.random.normal(kq, (1, t, hq, d), F32)
  k = jax.random.normal(kk, (1, t, hkv, d), F32)
  # A few keys scaled up, as in the golden cases, so that scores are rarely near-ties.
  return q, k * jnp.where(jax.random.uniform(kk, (1, t, hkv, 1)) < 0.05, 3.0, 1.0)


@pytest.mark.parametrize("t,tq,offset,hq,hkv,d,top_k,selector,c,g,config", SELECTION_CASES)
def test_selection_at_offset_matches_the_reference(t, tq, offset, hq, hkv, d, top_k, selector, c,
                                                   g, config):
  q_all, k = _select_inputs(t + tq + offset, t, hq, hkv, d)
  q = q_all[:, offset:offset + tq]
  kw = dict(block_size=c, top_k=top_k, branching=g, selector=selector, scale=d ** -0.5,
            beam=top_k)
  kernel = jax.jit(lambda q, k, off: select_blocks_pallas(q, k, interpret=True, config=config,
                                                          query_offset=off, **kw))
  out = kernel(q, k, jnp.int32(offset))
  ref = select_blocks_reference_offset(q, k, jnp.int32(offset), **kw)
  assert out.shape == ref.shape == (1, tq, hkv, top_k)
  # Every row keeps min(K, cur + 1) blocks of its own position, cur = (offset + i) // C.
  n_valid = np.minimum(top_k, (offset + np.arange(tq)) // c + 1)
  assert ((np.asarray(out) >= 0).sum(-1) == n_valid[None, :, None]).all()
  # Rows may differ only where a float64 re-walk proves a near-tie.
  margins = mismatch_margins(out, ref, q_all, k, positions=offset + np.arange(tq), **kw)
  assert all(m < tolerances.SELECTION_NEAR_TIE_RTOL for *_, m in margins), margins
  # The offset as a Python int bakes it in: the same rows.
  np.testing.assert_array_equal(
      select_blocks_pallas(q, k, interpret=True, config=config, query_offset=offset, **kw), out)


def _lowered(captured, fn, *shapes):
  """Triton IR of every kernel `fn` launches, lowered for sm_90, by kernel name."""
  start = len(captured)
  jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
  return {re.search(r"module @([A-Za-z0-9_]+)", m).group(1): m for m in captured[start:]}


_DEFAULT = SelectionConfig.default(seq_len=0, group=4)


@pytest.mark.parametrize("selector,config", [
    ("pisa", None), ("pisa", dataclasses.replace(_DEFAULT, variant="two_stage")),
    ("pisa", dataclasses.replace(_DEFAULT, variant="two_stage", topk_impl="passes")),
    ("bsa", None)], ids=["fused", "two-stage", "passes", "bsa"])
def test_selection_at_offset_zero_lowers_to_the_same_ir(captured, selector, config):
  q = jax.ShapeDtypeStruct((1, 1024, 8, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
  kw = dict(block_size=64, top_k=8, branching=2, selector=selector, scale=0.125, beam=8,
            interpret=False, config=config)
  plain = _lowered(captured, lambda q, k: select_blocks_pallas(q, k, **kw), q, k)
  at_zero = _lowered(captured, lambda q, k: select_blocks_pallas(q, k, query_offset=0, **kw), q, k)
  assert plain == at_zero
  # A traced offset (a shard of 256 queries) lowers too: the same kernels, one more input.
  traced = _lowered(captured, lambda q, k, off: select_blocks_pallas(q, k, query_offset=off, **kw),
                    jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.bfloat16), k,
                    jax.ShapeDtypeStruct((), jnp.int32))
  assert set(traced) == set(plain)


def test_attention_at_offset_zero_lowers_to_the_same_ir(captured):
  q = jax.ShapeDtypeStruct((1, 1024, 6, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((1, 1024, 2, 8), jnp.int32)

  def grads(attend):
    def loss(q, k, v, idx, *off):
      return jnp.sum(attend(q, k, v, idx, *off).astype(F32))
    return jax.grad(loss, argnums=(0, 1, 2))

  kw = dict(block_size=64, scale=0.125, interpret=False)
  plain = _lowered(captured, grads(functools.partial(attn.sparse_attention_pallas, **kw)),
                   q, kv, kv, idx)
  at_zero = _lowered(captured, grads(lambda q, k, v, i: attn.sparse_attention_pallas_at(
      q, k, v, i, 0, **kw)), q, kv, kv, idx)
  assert plain == at_zero and {"pisa_sparse_attention_fwd", "pisa_sparse_attention_dq",
                               "pisa_sparse_attention_dkv"} <= set(plain)
  traced = _lowered(captured, grads(functools.partial(attn.sparse_attention_pallas_at, **kw)),
                    jax.ShapeDtypeStruct((1, 256, 6, 64), jnp.bfloat16), kv, kv,
                    jax.ShapeDtypeStruct((1, 256, 2, 8), jnp.int32),
                    jax.ShapeDtypeStruct((), jnp.int32))
  assert {"pisa_sparse_attention_fwd_offset", "pisa_sparse_attention_dq_offset",
          "pisa_sparse_attention_dkv_offset"} <= set(traced)
