"""HiLS's Pallas kernels compiled for the GPU against the jnp reference.

CI runs them in the Pallas interpreter; here they compile through Triton. The selection kernel
must pick the reference's chunks (16-bit inputs score float32 landmark keys as a high + low
split, ~2^-17 relative, so a near tie may flip: at most 1 in 1000 (query, KV head) sets may
differ). The attention kernels, given the reference's chunks, must match the reference's output
and its gradients of q, k, v and the landmark queries within the suite's tolerances, write every
element (outputs land in memory filled with NaN first) and rerun bit-identically. The reference
attends those same chunks: choosing its own in another program, it may flip a near-tie (the
d128 case has one: t = 2877, KV head 0, chunks 31 and 23 are 2.4e-7 apart in float64 rank,
and that swap moves 93 output elements past the tolerance). Skipped without a CUDA GPU:

  python -m pytest -q -m gpu tests/test_gpu_hils.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax import hils
from pisa_jax.kernels import hils as hils_kernels

import tolerances as tol
from test_gpu_attention import poison

pytestmark = pytest.mark.gpu

# (T, HQ, HKV, D, C, K, W, dtype, documents): the public defaults at d128 and d64, group 3 in
# float32, a T not a multiple of C, packed documents.
CASES = [
    (4096, 32, 2, 128, 64, 32, 512, jnp.bfloat16, None),
    (4096, 32, 2, 64, 64, 32, 512, jnp.bfloat16, None),
    (1000, 6, 2, 64, 64, 8, 100, jnp.float32, None),
    (3000, 16, 2, 128, 32, 16, 256, jnp.float16, (1000, 17, 1983)),
]


def case_id(case):
  t, hq, hkv, d, c, top_k, w, dtype, docs = case
  return (f"T{t}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{top_k}-W{w}-{jnp.dtype(dtype).name}"
          + ("" if docs is None else f"-docs{len(docs)}"))


def inputs(case):
  t, hq, hkv, d, _, _, _, dtype, docs = case
  keys = jax.random.split(jax.random.key(t), 5)
  q, lq, do = (jax.random.normal(x, (1, t, hq, d), jnp.float32).astype(dtype)
               for x in (keys[0], keys[3], keys[4]))
  k, v = (jax.random.normal(x, (1, t, hkv, d), jnp.float32).astype(dtype) for x in keys[1:3])
  ids = None if docs is None else jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None],
                                              jnp.int32)
  return q, k, v, lq, do, ids


def options(case):
  _, _, _, d, c, top_k, w, _, _ = case
  return dict(chunk_size=c, top_k=top_k, window=w, scale=d ** -0.5)


@functools.partial(jax.jit, static_argnames=("chunk_size", "top_k", "window", "scale", "kernel"))
def value_and_grads(q, k, v, lq, do, ids, idx, *, chunk_size, top_k, window, scale, kernel):
  """(out, dq, dk, dv, dlq): the kernels or the reference, both on the given chunks."""
  def fn(q, k, v, lq):
    if not kernel:  # float32 rows, attending the kernel's chunks (near-ties cannot flip)
      out, _ = hils._run_queries(q, k, v, lq, ids, chunk_size=chunk_size, top_k=top_k,
                                 window=window, scale=scale, chunks=idx)
      return out
    start, first_slot, lk, lb = hils._landmarks_of_rows(k, lq, ids, chunk_size=chunk_size,
                                                        scale=scale)
    return hils_kernels.hils_chunk_attention_pallas(
        q, k, v, lq, lk, lb, idx, None if ids is None else start,
        None if ids is None else first_slot, chunk_size=chunk_size, window=window,
        num_window=hils.window_chunks(window, chunk_size), scale=scale, interpret=False)

  out, vjp = jax.vjp(fn, q, k, v, lq)
  return (out,) + tuple(vjp(do))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_select_kernel_matches_reference(case):
  q, k, _, lq, _, ids = inputs(case)
  opts = options(case)
  got = np.asarray(hils.hils_select_chunks_pallas(q, k, lq, ids, interpret=False, **opts))
  want = np.asarray(hils.hils_select_chunks_reference(q, k, lq, ids, **opts))
  differ = np.any(got != want, axis=-1)
  assert differ.mean() <= 1e-3, f"{int(differ.sum())} of {differ.size} chunk sets differ"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_kernels_match_reference(case):
  dtype = case[7]
  q, k, v, lq, do, ids = inputs(case)
  opts = options(case)
  idx = hils.hils_select_chunks_reference(q, k, lq, ids, **opts)
  run = functools.partial(value_and_grads, q, k, v, lq, do, ids, idx, kernel=True, **opts)
  jax.block_until_ready(run())  # compiled before the memory is poisoned
  nbytes = 12 * sum(x.size * x.dtype.itemsize for x in (q, k, v, lq, do)) + (64 << 20)
  poison(nbytes)
  got = run()
  poison(nbytes)
  again = run()
  f32 = lambda x: x.astype(jnp.float32)
  want = value_and_grads(f32(q), f32(k), f32(v), f32(lq), f32(do), ids, idx, kernel=False,
                         **opts)
  key = jnp.dtype(dtype).type
  for name, g, a, w in zip(("o", "dq", "dk", "dv", "dlandmark_q"), got, again, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(g), err_msg=f"{name}: runs differ")
    g = np.asarray(f32(g))
    assert np.isfinite(g).all(), f"{name}: {int((~np.isfinite(g)).sum())} non-finite entries"
    atol = tol.OUTPUT_ATOL[key] if name == "o" else tol.GRAD_ATOL[key]
    rtol = tol.OUTPUT_RTOL[key] if name == "o" else tol.GRAD_RTOL[key]
    np.testing.assert_allclose(g, np.asarray(w), atol=atol, rtol=rtol, err_msg=name)
