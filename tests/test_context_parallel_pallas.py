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
from pisa_jax.testing import random_block_indices

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


@pytest.mark.parametrize("t,tq,offset,hq,hkv,d,c,top_k", ATTENTION_CASES,
                         ids=lambda *a: None)
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
