"""Packed documents (segment_ids) through the Pallas kernels, in interpret mode on CPU.

Every kernel is compared with the packed jnp reference and with each document run alone from
position 0 (the contract of `pisa_jax.segments`), gradients included. Document lengths are ugly on
purpose: 1, shorter than a block, starting and ending mid-block, and rows of many documents.
Interpret mode starts every output as NaN, so an element a kernel never writes fails the
finiteness checks.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import testing
from pisa_jax.kernels import attention as attn
from pisa_jax.kernels import attention_backward
import tolerances as tol

# T = 63: documents of one token, shorter than a block and crossing block edges for C = 4 and 8.
SHORT_ROWS = ([5, 1, 22, 1, 5, 29], [29, 5, 22, 1, 1, 5])
# T = 85: two dozen documents of 1-4 tokens, then one long enough for several blocks.
MANY_ROWS = ([1, 2, 3, 1, 4, 2, 1, 3, 3, 1, 2, 4, 1, 1, 2, 3, 4, 1, 2, 1, 3, 2, 1, 1, 36],)


def segment_ids(rows) -> jax.Array:
  return jnp.asarray(np.stack([np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32))


def documents(rows):
  """(row, start, length) of every document."""
  for b, lengths in enumerate(rows):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for s, n in zip(starts, lengths):
      yield b, int(s), int(n)


def make_inputs(seq_len, *, batch, hq, hkv, d, dtype, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = ((batch, seq_len, hq, d), (batch, seq_len, hkv, d), (batch, seq_len, hkv, d),
            (batch, seq_len, hq, d))
  return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(keys, shapes))


def document_block_indices(rows, hkv, top_k, block_size, seed=0):
  """Random valid document-relative indices `[B, T, HKV, K]`, some rows thinned to fewer blocks."""
  out = np.full((len(rows), sum(rows[0]), hkv, top_k), -1, np.int32)
  for i, (b, s, n) in enumerate(documents(rows)):
    out[b, s:s + n] = testing.random_block_indices(seed + i, n, hkv, top_k, block_size,
                                                   thin_rows=0.2)[0]
  return jnp.asarray(out)


def value_and_grads(attend, q, k, v, do, *args):
  out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *args), q, k, v)
  return (out,) + tuple(vjp(do))


def packed_kernel(block_size, scale, config=None):
  def attend(q, k, v, idx, seg):
    return attn.sparse_attention_packed_pallas(q, k, v, idx, seg, block_size=block_size,
                                               scale=scale, interpret=True, config=config)
  return attend


def reference(block_size, scale, segmented):
  def attend(q, k, v, idx, *seg):
    return pisa_jax.sparse_attention(q, k, v, idx, block_size=block_size, scale=scale,
                                     segment_ids=seg[0] if segmented else None,
                                     implementation="xla")
  return attend


def each_document_alone(rows, per_query, idx, block_size, scale):
  """The one-document reference's output and gradients of every document run alone, in one
  batch: each document from row position 0, padded at its end to the longest. The padding comes
  after the document's queries (causal: their outputs do not see it) and carries a zero
  cotangent (so it adds nothing to the document's dk and dv)."""
  docs = list(documents(rows))
  width = max(n for _, _, n in docs)

  def stack(x, fill):
    return jnp.stack([jnp.pad(x[b, s:s + n], [(0, width - n)] + [(0, 0)] * (x.ndim - 2),
                              constant_values=fill) for b, s, n in docs])

  q, k, v, do = (stack(x, 0.0) for x in per_query)
  out = jax.jit(lambda *a: value_and_grads(reference(block_size, scale, False), *a))(
      q, k, v, do, stack(idx, -1))
  return [[x[i:i + 1, :n] for x in out] for i, (_, _, n) in enumerate(docs)]


def assert_close(got, want, dtype, err_msg=""):
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    g = np.asarray(jnp.asarray(g).astype(jnp.float32))
    assert np.all(np.isfinite(g)), f"{name} has non-finite (unwritten or NaN) entries {err_msg}"
    atol = (tol.OUTPUT_ATOL if name == "out" else tol.GRAD_ATOL)[dtype]
    rtol = (tol.OUTPUT_RTOL if name == "out" else tol.GRAD_RTOL)[dtype]
    np.testing.assert_allclose(g, np.asarray(w, np.float32), atol=atol, rtol=rtol,
                               err_msg=f"{name} {err_msg}")


def attention_case(rows, hq, hkv, d, c, k, dtype, *marks):
  name = (f"T{sum(rows[0])}-docs{sum(map(len, rows))}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{k}-"
          f"{jnp.dtype(dtype).name}")
  return pytest.param((rows, hq, hkv, d, c, k, dtype), id=name, marks=marks)


# The first case (about 20 s on two cores: three compilations) covers every kernel in CI.
ATTENTION_CASES = [
    attention_case(SHORT_ROWS, 6, 2, 8, 4, 3, jnp.float32),
    attention_case(SHORT_ROWS, 4, 1, 64, 8, 4, jnp.bfloat16, pytest.mark.slow),
    attention_case(MANY_ROWS, 2, 2, 16, 2, 3, jnp.float32, pytest.mark.slow),
    attention_case(MANY_ROWS, 3, 1, 48, 16, 3, jnp.float32, pytest.mark.slow),
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_kernels_equal_reference_and_each_document_alone(case):
  rows, hq, hkv, d, c, top_k, dtype = case
  seg = segment_ids(rows)
  q, k, v, do = make_inputs(seg.shape[1], batch=seg.shape[0], hq=hq, hkv=hkv, d=d, dtype=dtype,
                            seed=len(rows[0]) + c)
  idx = document_block_indices(rows, hkv, top_k, c, seed=c)
  scale = d ** -0.5
  got = jax.jit(lambda *a: value_and_grads(packed_kernel(c, scale), *a))(q, k, v, do, idx, seg)
  assert got[0].dtype == dtype
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  want = jax.jit(lambda *a: value_and_grads(reference(c, scale, True), *a))(*f32, idx, seg)
  assert_close(got, want, dtype)
  # Each document alone, through the one-document reference (dtype tolerances: bf16 rounds).
  for (b, s, n), want in zip(documents(rows), each_document_alone(rows, f32, idx, c, scale)):
    assert_close([x[b:b + 1, s:s + n] for x in got], want, dtype, f"document {b, s, n}")


def test_split_work_items_are_bitwise_repeatable():
  """Items of 5 entries split every block's list (both parts of unaligned blocks); two runs are
  bit-identical and match the reference."""
  seg = segment_ids(SHORT_ROWS)
  q, k, v, do = make_inputs(63, batch=2, hq=2, hkv=1, d=16, dtype=jnp.float32, seed=9)
  idx = document_block_indices(SHORT_ROWS, 1, 4, 4, seed=9)
  config = attn.SparseAttentionConfig(items_entries=5, dkv_rows=16, fwd_step_keys=0)
  fn = jax.jit(lambda *a: value_and_grads(packed_kernel(4, 0.3, config), *a))
  first, second = fn(q, k, v, do, idx, seg), fn(q, k, v, do, idx, seg)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  want = value_and_grads(reference(4, 0.3, True), q, k, v, do, idx, seg)
  assert_close(first, want, jnp.float32)


def test_forward_in_sub_block_steps():
  """`fwd_step_keys` streams an unaligned document block in steps of 16 keys."""
  rows = ([7, 40, 1, 22], [70])
  seg = segment_ids(rows)
  q, k, v, do = make_inputs(70, batch=2, hq=4, hkv=2, d=32, dtype=jnp.float32, seed=10)
  idx = document_block_indices(rows, 2, 3, 32, seed=10)
  config = attn.SparseAttentionConfig(fwd_step_keys=16)
  got = value_and_grads(packed_kernel(32, 0.2, config), q, k, v, do, idx, seg)
  assert_close(got, value_and_grads(reference(32, 0.2, True), q, k, v, do, idx, seg),
               jnp.float32)


def test_packed_inverted_index_lists_both_parts_of_every_block():
  rows = SHORT_ROWS
  seg = segment_ids(rows)
  c, top_k, items = 4, 3, 3
  idx = np.array(document_block_indices(rows, 2, top_k, c, seed=4))
  starts = np.asarray(pisa_jax.segments.document_bounds(seg)[0])
  num_blocks = -(-63 // c) + 1
  out = jax.tree.map(np.asarray, attention_backward.packed_inverted_index(
      jnp.asarray(idx), jnp.asarray(starts), num_blocks=num_blocks, block_size=c,
      items_entries=items))
  entry_query, item_block, item_start, item_end, item_offsets, entry_lo = out
  for b in range(2):
    for h in range(2):
      want = {n: [] for n in range(num_blocks)}
      for t in range(63):
        for i in idx[b, t, h]:
          lo = starts[b, t] + i * c
          if i < 0 or lo > t:
            continue
          # The key-array blocks holding the block's keys at or before the query.
          for n in sorted({lo // c, min(lo + c - 1, t) // c}):
            want[n].append((t, lo))
      for n in range(num_blocks):
        got = []
        for it in range(item_offsets[b, h, n], item_offsets[b, h, n + 1]):
          assert item_block[b, h, it] == n
          assert 0 < item_end[b, h, it] - item_start[b, h, it] <= items
          sl = slice(item_start[b, h, it], item_end[b, h, it])
          got += list(zip(entry_query[b, h, sl], entry_lo[b, h, sl]))
        assert got == want[n], (b, h, n)


def test_non_finite_inputs_reach_exactly_the_queries_that_see_them():
  """A NaN key poisons the outputs of the queries of its document that select it and are at or
  after it, nothing else: the neighbouring documents, whose blocks overlap its key-array block,
  stay finite."""
  rows = ([5, 6, 9, 12],)
  seg = segment_ids(rows)
  q, k, v, do = make_inputs(32, batch=1, hq=2, hkv=1, d=16, dtype=jnp.float32, seed=11)
  # Every query selects all of its document's blocks (C = 4, K = 3 covers 12 tokens).
  rel = np.concatenate([np.arange(n) for n in rows[0]])
  idx = np.where(np.arange(3)[None, :] <= (rel // 4)[:, None], np.arange(3)[None, :], -1)
  idx = jnp.asarray(idx[None, :, None, :].astype(np.int32))
  k = k.at[0, 13, 0, 3].set(jnp.nan)  # document 2 (positions 11..19), its position 2
  got = value_and_grads(packed_kernel(4, 0.25), q, k, v, do, idx, seg)
  bad = ~np.isfinite(np.asarray(got[0])[0]).all(axis=(1, 2))
  np.testing.assert_array_equal(np.nonzero(bad)[0], np.arange(13, 20))
  want = value_and_grads(reference(4, 0.25, True), q, k, v, do, idx, seg)
  np.testing.assert_array_equal(np.isfinite(np.asarray(want[0])), np.isfinite(np.asarray(got[0])))


def test_packed_kernels_lower_for_sm90(captured):
  seg = segment_ids(SHORT_ROWS)
  q, k, v, do = make_inputs(63, batch=2, hq=4, hkv=2, d=64, dtype=jnp.bfloat16, seed=12)
  idx = document_block_indices(SHORT_ROWS, 2, 3, 16, seed=12)

  def loss(q, k, v):
    out = attn.sparse_attention_packed_pallas(q, k, v, idx, seg, block_size=16, scale=0.1,
                                              interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))
  names = {re.search(r"module @([A-Za-z0-9_]+)", m).group(1) for m in captured}
  assert {"pisa_sparse_attention_fwd_packed", "pisa_sparse_attention_dq_packed",
          "pisa_sparse_attention_dkv_packed", "pisa_sparse_attention_dkv_reduce"} <= names
