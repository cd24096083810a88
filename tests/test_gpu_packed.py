"""Packed documents (segment_ids) through the Pallas kernels compiled for the GPU.

`test_packed_pallas.py` runs the same kernels in the Pallas interpreter; here they compile through
Triton, where some behaviour differs (Triton's max / min drop a NaN operand, masked loads and
64-bit offsets are real). Attention: the output and dq, dk, dv against the jnp reference on
float32-upcast inputs, into NaN-poisoned memory, two runs bit-identical. Selection: the fused
packed walk (K = 8) and the packed two-stage of wide sets (K = 32) against the reference, mismatches only at float64-proven near-ties. Rows mix documents of
one token, shorter than a block, starting and ending mid-block, and thousands of tokens. The
decoder's dense kind on the same rows runs on cuDNN with a same-document mask: each document
against float32 XLA attention of it alone.
Skipped without a CUDA GPU (`-m gpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import testing

import tolerances as tol
from test_gpu_attention import assert_outputs_match, poison
from test_packed_pallas import documents, segment_ids

pytestmark = pytest.mark.gpu

# T = 4096 in every row: short documents around block edges (C = 64), then long ones.
ROWS = ([1, 63, 2, 130, 1, 700, 3, 1200, 1996], [2000, 5, 64, 1, 1, 2025])


def inputs(seed, t, hq, hkv, d, dtype):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = ((len(ROWS), t, hq, d), (len(ROWS), t, hkv, d), (len(ROWS), t, hkv, d),
            (len(ROWS), t, hq, d))
  return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(keys, shapes))


def document_block_indices(hkv, top_k, block_size, seed=0):
  """Random valid document-relative indices `[B, T, HKV, K]`, a fifth of the rows thinned."""
  out = np.full((len(ROWS), sum(ROWS[0]), hkv, top_k), -1, np.int32)
  for i, (b, s, n) in enumerate(documents(ROWS)):
    out[b, s:s + n] = testing.random_block_indices(seed + i, n, hkv, top_k, block_size,
                                                   thin_rows=0.2)[0]
  return jnp.asarray(out)


@functools.partial(jax.jit, static_argnames=("block_size", "implementation"))
def value_and_grads(q, k, v, idx, seg, do, *, block_size, implementation):
  fn = functools.partial(pisa_jax.sparse_attention, block_size=block_size, segment_ids=seg,
                         implementation=implementation)
  out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
  return (out,) + tuple(vjp(do))


@pytest.mark.parametrize("hq,hkv,d,top_k,dtype", [(32, 2, 64, 8, jnp.bfloat16),
                                                  (32, 2, 128, 32, jnp.bfloat16),
                                                  (8, 4, 96, 8, jnp.float32)])
def test_packed_attention_matches_reference(hq, hkv, d, top_k, dtype):
  t, c = sum(ROWS[0]), 64
  q, k, v, do = inputs(d + top_k, t, hq, hkv, d, dtype)
  idx = document_block_indices(hkv, top_k, c, seed=d)
  seg = segment_ids(ROWS)
  run = functools.partial(value_and_grads, block_size=c, implementation="pallas")
  jax.block_until_ready(run(q, k, v, idx, seg, do))  # compiled before the memory is poisoned
  nbytes = 8 * sum(x.size * x.dtype.itemsize for x in (q, k, v, do)) + (64 << 20)
  poison(nbytes)
  got = run(q, k, v, idx, seg, do)
  poison(nbytes)
  again = run(q, k, v, idx, seg, do)
  f32 = lambda x: x.astype(jnp.float32)
  want = value_and_grads(f32(q), f32(k), f32(v), idx, seg, f32(do), block_size=c,
                         implementation="xla")
  assert_outputs_match(got, again, want, dtype)


@pytest.mark.parametrize("d,top_k,selector", [(64, 8, "pisa"), (128, 32, "pisa"),
                                              (64, 8, "bsa")])
def test_packed_selection_matches_reference(d, top_k, selector):
  t, c = sum(ROWS[0]), 64
  q, k, _, _ = inputs(d + top_k + 1, t, 32, 2, d, jnp.bfloat16)
  seg = segment_ids(ROWS)
  selection = dict(block_size=c, top_k=top_k, branching=2, selector=selector)
  got = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="pallas", **selection)
  want = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="xla", **selection)
  unproven = []
  for b, s, n in documents(ROWS):
    # Margins of the document alone (positions from 0): the rules the packed rows follow.
    margins = testing.mismatch_margins(got[b:b + 1, s:s + n], want[b:b + 1, s:s + n],
                                       q[b:b + 1, s:s + n], k[b:b + 1, s:s + n],
                                       scale=d ** -0.5, beam=top_k, max_rows=16, **selection)
    unproven += [(b, s, *m) for m in margins if not m[3] < tol.SELECTION_NEAR_TIE_RTOL]
  assert not unproven, unproven[:8]


def test_decoder_dense_packed_attention_on_cudnn_keeps_to_each_document():
  """The decoder's dense kind on packed rows (cuDNN with a same-document mask and is_causal)
  equals float32 XLA attention of each document alone, output and gradients: a cross-document
  leak or a dropped mask would show here, not in the CPU suite (which runs the XLA path)."""
  from pisa_jax.models.decoder import _attend_within_documents

  dtype = jnp.bfloat16
  q, k, v, do = inputs(3, sum(ROWS[0]), 8, 2, 64, dtype)
  ids = segment_ids(ROWS)
  cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
  out, vjp = jax.vjp(lambda q, k, v: _attend_within_documents(cudnn, q, k, v, ids), q, k, v)
  got = (out, *vjp(do))
  alone = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
  key = jnp.dtype(dtype).type
  for b, s, n in documents(ROWS):
    part = lambda x: x[b:b + 1, s:s + n].astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
      ref, ref_vjp = jax.vjp(alone, part(q), part(k), part(v))
      want = (ref, *ref_vjp(part(do)))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
      atol = tol.OUTPUT_ATOL[key] if name == "o" else tol.GRAD_ATOL[key]
      rtol = tol.OUTPUT_RTOL[key] if name == "o" else tol.GRAD_RTOL[key]
      np.testing.assert_allclose(np.asarray(part(g)), np.asarray(w), atol=atol, rtol=rtol,
                                 err_msg=f"{name}, document at row {b}, {s}..{s + n - 1}")
