"""Pallas sparse attention compiled for the GPU against the jnp reference, forward and gradients.

CI runs the kernels in the Pallas interpreter; here they compile through Triton. Each case checks
the output and dq, dk, dv elementwise against the reference on float32-upcast inputs with the
suite's tolerances (tests/tolerances.py: |got - want| <= atol + rtol |want|), bf16 / f16 / f32,
GQA groups 1 to 32, head dims 48 to 128, T not a multiple of C, rows with fewer than K blocks or
none. Outputs land in device memory filled with NaN first (`poison`), so an element a kernel never
writes fails the finiteness check; two runs must be bit-identical (the backward sums its partials
in a fixed order). Skipped without a CUDA GPU; the whole GPU suite runs with

  python -m pytest -q -m gpu tests/test_gpu_*.py
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pisa_jax
from pisa_jax.testing import random_block_indices

import tolerances as tol

pytestmark = pytest.mark.gpu

# (T, HQ, HKV, D, C, K, dtype, indices): "random" valid causal indices with a fifth of the rows
# thinned (fewer blocks, some without the current block, some empty), or "pisa" (PISA's own).
CASES = [
    (4096, 32, 2, 128, 64, 32, jnp.bfloat16, "random"),
    (4096, 32, 2, 64, 64, 8, jnp.float32, "random"),
    (4096, 32, 2, 64, 64, 8, jnp.bfloat16, "pisa"),
    (1000, 6, 2, 64, 64, 8, jnp.bfloat16, "random"),
    (777, 8, 8, 48, 64, 5, jnp.float16, "random"),
    (2048, 32, 1, 64, 64, 16, jnp.bfloat16, "random"),
    (300, 3, 1, 128, 64, 64, jnp.float32, "random"),
    (1500, 8, 4, 96, 32, 8, jnp.float16, "random"),
    (2500, 16, 4, 128, 64, 8, jnp.float32, "pisa"),
    (63, 4, 2, 64, 64, 3, jnp.bfloat16, "random"),
]


def case_id(case):
  t, hq, hkv, d, c, top_k, dtype, indices = case
  return f"T{t}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{top_k}-{jnp.dtype(dtype).name}-{indices}"


def inputs(seed, t, hq, hkv, d, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, do = (jax.random.normal(x, (1, t, hq, d), jnp.float32).astype(dtype) for x in keys[::3])
  k, v = (jax.random.normal(x, (1, t, hkv, d), jnp.float32).astype(dtype) for x in keys[1:3])
  return q, k, v, do


def poison(nbytes: int) -> None:
  """Fills `nbytes` of free device memory with all-ones bits (NaN in f32, bf16 and f16) and frees
  it: the allocator places the next outputs there, so an unwritten element reads NaN."""
  jax.block_until_ready(jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32))


@functools.partial(jax.jit, static_argnames=("block_size", "implementation"))
def value_and_grads(q, k, v, idx, do, *, block_size, implementation):
  fn = functools.partial(pisa_jax.sparse_attention, block_size=block_size,
                         implementation=implementation)
  out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
  return (out,) + tuple(vjp(do))


def test_poison_reaches_unwritten_outputs():
  # A kernel that writes only the first of two rows: after `poison`, the second row is NaN. If
  # the allocator stops reusing the poisoned memory, this fails and the finiteness checks below
  # no longer prove every element was written.
  def half(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  x = jnp.ones((1, 256), jnp.float32)
  call = jax.jit(lambda x: pl.pallas_call(
      half, grid=(1,), in_specs=[pl.BlockSpec((1, 256), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((1, 256), lambda i: (0, 0)),
      out_shape=jax.ShapeDtypeStruct((2, 256), jnp.float32))(x))
  call.lower(x).compile()
  poison(64 << 20)
  out = np.asarray(call(x))
  assert (out[0] == 1).all()
  # Seen on the H200 with XLA_PYTHON_CLIENT_PREALLOCATE=false: the output then comes from fresh,
  # zeroed memory, and the poison proves nothing. Run the GPU tests with the default allocator.
  assert np.isnan(out[1]).all(), (
      "the allocator did not hand back the poisoned memory: unset XLA_PYTHON_CLIENT_PREALLOCATE "
      f"(now {os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')!r}) and XLA_PYTHON_CLIENT_ALLOCATOR "
      f"(now {os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR')!r})")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_attention_matches_reference(case):
  t, hq, hkv, d, c, top_k, dtype, indices = case
  q, k, v, do = inputs(t, t, hq, hkv, d, dtype)
  if indices == "pisa":
    idx = pisa_jax.select_blocks(q, k, block_size=c, top_k=top_k, implementation="pallas")
  else:
    idx = jnp.asarray(random_block_indices(t, t, hkv, top_k, c, thin_rows=0.2))
  run = functools.partial(value_and_grads, block_size=c, implementation="pallas")
  jax.block_until_ready(run(q, k, v, idx, do))  # compiled before the memory is poisoned
  nbytes = 8 * sum(x.size * x.dtype.itemsize for x in (q, k, v, do)) + (64 << 20)
  poison(nbytes)
  got = run(q, k, v, idx, do)
  poison(nbytes)
  again = run(q, k, v, idx, do)
  f32 = lambda x: x.astype(jnp.float32)
  want = value_and_grads(f32(q), f32(k), f32(v), idx, f32(do), block_size=c, implementation="xla")
  assert got[0].dtype == dtype
  assert_outputs_match(got, again, want, dtype)


def assert_outputs_match(got, again, want, dtype):
  """(o, dq, dk, dv) of two kernel runs bit-identical, finite, and within the suite's tolerances
  of the float32 reference's."""
  f32 = lambda x: x.astype(jnp.float32)
  key = jnp.dtype(dtype).type
  for name, g, a, w in zip(("o", "dq", "dk", "dv"), got, again, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(g), err_msg=f"{name}: runs differ")
    g = np.asarray(f32(g))
    assert np.isfinite(g).all(), f"{name}: {int((~np.isfinite(g)).sum())} non-finite entries"
    atol = tol.OUTPUT_ATOL[key] if name == "o" else tol.GRAD_ATOL[key]
    rtol = tol.OUTPUT_RTOL[key] if name == "o" else tol.GRAD_RTOL[key]
    np.testing.assert_allclose(g, np.asarray(w), atol=atol, rtol=rtol, err_msg=name)
