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


# The first case covers every attention kernel in CI; the others add shapes and dtypes.
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
  """Items of 5 entries split every block's list (so a key block sums the 2C-row partials of
  several items of its own and of the block before); two runs are bit-identical and match the
  reference."""
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
  got = jax.jit(lambda *a: value_and_grads(packed_kernel(32, 0.2, config), *a))(
      q, k, v, do, idx, seg)
  assert_close(got, value_and_grads(reference(32, 0.2, True), q, k, v, do, idx, seg),
               jnp.float32)


def test_packed_inverted_index_lists_each_block_once_under_its_first_key():
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
          if i >= 0 and lo <= t:
            # Under the key-array block of the block's first key.
            want[lo // c].append((t, lo))
      # None in the padding block: every 2C-key window [nC, nC + 2C) ends within the keys.
      assert not want[num_blocks - 1]
      for n in range(num_blocks):
        got = []
        for it in range(item_offsets[b, h, n], item_offsets[b, h, n + 1]):
          assert item_block[b, h, it] == n
          assert 0 < item_end[b, h, it] - item_start[b, h, it] <= items
          sl = slice(item_start[b, h, it], item_end[b, h, it])
          got += list(zip(entry_query[b, h, sl], entry_lo[b, h, sl]))
        # By the block's first key, then queries ascending: a document block's entries are
        # contiguous (the single-lo items of the dk/dv kernel).
        assert got == sorted(want[n], key=lambda e: (e[1], e[0])), (b, h, n)


def test_packed_dkv_across_array_blocks_is_exact_and_repeatable():
  """T a multiple of C (the last array block is real, the padding block only reached through the
  window); documents of 1 and 2 tokens and others starting mid-block, each query selecting all
  its blocks, so nearly every block straddles two array blocks. Items of 2 entries: the reduce
  sums several partials from each side. Two runs are bit-identical."""
  rows = ([3, 1, 6, 2], [1, 2, 9])
  seg = segment_ids(rows)
  q, k, v, do = make_inputs(12, batch=2, hq=2, hkv=1, d=16, dtype=jnp.float32, seed=20)
  rel = np.concatenate([np.arange(n) for n in rows[0]] + [np.arange(n) for n in rows[1]])
  idx = np.where(np.arange(3)[None, :] <= (rel // 4)[:, None], np.arange(3)[None, :], -1)
  idx = jnp.asarray(idx.reshape(2, 12, 1, 3).astype(np.int32))
  config = attn.SparseAttentionConfig(items_entries=2, dkv_rows=16)
  fn = jax.jit(lambda *a: value_and_grads(packed_kernel(4, 0.3, config), *a))
  first, second = fn(q, k, v, do, idx, seg), fn(q, k, v, do, idx, seg)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert_close(first, value_and_grads(reference(4, 0.3, True), q, k, v, do, idx, seg),
               jnp.float32)
  for (b, s, n), want in zip(documents(rows), each_document_alone(rows, (q, k, v, do), idx, 4,
                                                                  0.3)):
    assert_close([x[b:b + 1, s:s + n] for x in first], want, jnp.float32, f"document {b, s, n}")


def test_packed_dkv_needs_a_padding_block():
  """The 2C-key window of the last query's block reads one block past it."""
  q5 = jnp.zeros((1, 8, 1, 1, 16))
  k = jnp.zeros((1, 8, 1, 16))
  with pytest.raises(ValueError, match=r"k.shape\[1\]=8 must hold a block of padding"):
    attention_backward.backward_dkv(
        q5, k, k, jnp.zeros((1, 8, 1, 2), jnp.int32), jnp.zeros((1, 8), jnp.int32), q5,
        jnp.zeros((1, 8, 1, 1)), jnp.zeros((1, 8, 1, 1)), block_size=4, scale=1.0,
        interpret=True, config=attn.SparseAttentionConfig())


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
  got = jax.jit(lambda *a: value_and_grads(packed_kernel(4, 0.25), *a))(q, k, v, do, idx, seg)
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
  by_name = {re.search(r"module @([A-Za-z0-9_]+)", m).group(1): m for m in captured}
  assert {"pisa_sparse_attention_fwd_packed", "pisa_sparse_attention_dq_packed",
          "pisa_sparse_attention_dkv_packed_single", "pisa_sparse_attention_dkv_packed_mixed",
          "pisa_sparse_attention_dkv_reduce_packed"} <= set(by_name)
  # A single-lo item holds C = 16 keys, a straddling one the 2C-key window: float32
  # accumulators of 16 and 32 x D = 64.
  assert "tensor<16x64xf32>" in by_name["pisa_sparse_attention_dkv_packed_single"]
  assert "tensor<32x64xf32>" not in by_name["pisa_sparse_attention_dkv_packed_single"]
  assert "tensor<32x64xf32>" in by_name["pisa_sparse_attention_dkv_packed_mixed"]


# Pyramid and selection. T = 111: documents of 1, 3, 5, 13 and 50 tokens, in two orders.
ROWS = ([1, 3, 5, 13, 3, 50, 1, 13, 5, 1, 3, 13], [13, 1, 1, 50, 5, 3, 13, 5, 3, 13, 1, 3])


@pytest.mark.parametrize("rows,block_size,branching", [
    (ROWS, 4, 2), pytest.param(MANY_ROWS, 2, 3, marks=pytest.mark.slow), (SHORT_ROWS, 16, 4)])
def test_pyramid_kernel_equals_reference_and_each_document_alone(rows, block_size, branching):
  seg = segment_ids(rows)
  k = jax.random.normal(jax.random.key(13), (seg.shape[0], seg.shape[1], 3, 12))
  got = pisa_jax.build_pyramid(k, block_size=block_size, branching=branching, segment_ids=seg,
                               implementation="pallas")
  want = pisa_jax.build_pyramid(k, block_size=block_size, branching=branching, segment_ids=seg,
                                implementation="xla")
  assert isinstance(got, pisa_jax.PackedPyramid)
  np.testing.assert_array_equal(got.first_node, want.first_node)
  for level in range(want.num_levels):
    np.testing.assert_allclose(got.summaries[level], want.summaries[level], atol=tol.PYRAMID_ATOL)
    np.testing.assert_array_equal(got.counts[level], want.counts[level])
  for b, s, n in documents(rows):
    alone = pisa_jax.build_pyramid(k[b:b + 1, s:s + n], block_size=block_size,
                                   branching=branching, implementation="xla")
    for level in range(alone.num_levels):
      first = int(got.first_node[b, s, level])
      m = alone.summaries[level].shape[1]
      np.testing.assert_allclose(got.summaries[level][b, first:first + m],
                                 alone.summaries[level][0], atol=tol.PYRAMID_ATOL)


def assert_selection_matches(got, want, q, k, proof):
  """Index rows equal, or differ only at a float32 near-tie proven by the float64 re-walk."""
  margins = testing.mismatch_margins(got, want, q, k, **proof)
  assert all(m < tol.SELECTION_NEAR_TIE_RTOL for *_, m in margins), margins


def selection_case(selector, block_size, top_k, branching, beam, *marks):
  return pytest.param(selector, block_size, top_k, branching, beam, marks=marks,
                      id=f"{selector}-C{block_size}-K{top_k}-g{branching}-beam{beam}")


# In CI: the fused packed walk (beam * g <= 16: "pisa" at K = 5), the two-stage kernels of
# wider beams (beam 9, g = 2: 18 slots) and BSA; `test_packed_walk.py` covers the fused walk.
# K > 3 everywhere: at K = 3 the forced first, previous and current blocks are the whole answer.
SELECTION_CASES = [
    selection_case("pisa", 4, 5, 2, None),
    selection_case("pisa", 4, 5, 2, 9),
    selection_case("bsa", 4, 5, 2, None),
    selection_case("pisa", 4, 3, 2, 6, pytest.mark.slow),
    selection_case("pisa1", 8, 4, 3, None, pytest.mark.slow),
    selection_case("pisa2", 4, 4, 2, 5, pytest.mark.slow),
    selection_case("pisa", 16, 3, 4, None, pytest.mark.slow),
]


@pytest.mark.parametrize("selector,block_size,top_k,branching,beam", SELECTION_CASES)
def test_selection_kernels_equal_reference_and_each_document_alone(selector, block_size, top_k,
                                                                    branching, beam):
  seg = segment_ids(ROWS)
  q, k, _, _ = make_inputs(111, batch=2, hq=4, hkv=2, d=8, dtype=jnp.float32, seed=14)
  selection = dict(block_size=block_size, top_k=top_k, branching=branching, selector=selector)
  got = pisa_jax.select_blocks(q, k, beam=beam, segment_ids=seg, implementation="pallas",
                               **selection)
  want = pisa_jax.select_blocks(q, k, beam=beam, segment_ids=seg, implementation="xla",
                                **selection)
  proof = dict(selection, scale=1 / np.sqrt(8), beam=beam or top_k)
  assert_selection_matches(got, want, q, k, proof)
  for b, s, n in documents(ROWS):
    qd, kd = q[b:b + 1, s:s + n], k[b:b + 1, s:s + n]
    alone = pisa_jax.select_blocks(qd, kd, beam=beam, implementation="xla", **selection)
    assert_selection_matches(got[b:b + 1, s:s + n], alone, qd, kd, proof)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1), (8, 1)])
def test_wide_beam_selection_on_16bit_inputs(hq, hkv):
  """bfloat16 q and k through the packed two-stage: leaf tiles score a document leaf's raw keys
  from its first key position (no block edge), the walk the high + low split of the float32
  summaries; the same selection as the reference up to proven near-ties, and each document's."""
  seg = segment_ids(ROWS)
  q, k, _, _ = make_inputs(111, batch=2, hq=hq, hkv=hkv, d=16, dtype=jnp.bfloat16, seed=21)
  # K = 5: two leaves beyond the forced three are chosen by their scores.
  selection = dict(block_size=4, top_k=5, branching=2, selector="pisa")
  got = pisa_jax.select_blocks(q, k, beam=9, segment_ids=seg, implementation="pallas",
                               **selection)
  want = pisa_jax.select_blocks(q, k, beam=9, segment_ids=seg, implementation="xla", **selection)
  proof = dict(selection, scale=1 / np.sqrt(16), beam=9)
  assert_selection_matches(got, want, q, k, proof)
  for b, s, n in documents(ROWS):
    qd, kd = q[b:b + 1, s:s + n], k[b:b + 1, s:s + n]
    alone = pisa_jax.select_blocks(qd, kd, beam=9, implementation="xla", **selection)
    assert_selection_matches(got[b:b + 1, s:s + n], alone, qd, kd, proof)


@pytest.mark.slow
@pytest.mark.parametrize("selector", ["pisa", "bsa"])
def test_selection_kernels_on_a_row_of_many_documents(selector):
  lengths = list(np.random.default_rng(2).integers(1, 4, 140))
  lengths[-1] += 300 - sum(lengths)
  rows = (lengths,)
  seg = segment_ids(rows)
  q, k, _, _ = make_inputs(300, batch=1, hq=4, hkv=2, d=8, dtype=jnp.float32, seed=2)
  selection = dict(block_size=2, top_k=4, branching=2, selector=selector)
  got = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="pallas", **selection)
  want = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="xla", **selection)
  assert_selection_matches(got, want, q, k, dict(selection, scale=1 / np.sqrt(8), beam=4))


@pytest.mark.slow
def test_pisa_attention_on_pallas_equals_each_document_alone():
  """Every stage on the kernels (pyramid, selection, attention and its backward) against each
  document alone on the reference, output and gradients."""
  seg = segment_ids(SHORT_ROWS)
  q, k, v, do = make_inputs(63, batch=2, hq=4, hkv=2, d=8, dtype=jnp.float32, seed=15)

  def attend(q, k, v, *seg):
    return pisa_jax.pisa_attention(q, k, v, block_size=4, top_k=3,
                                   segment_ids=seg[0] if seg else None,
                                   implementation="pallas" if seg else "xla")

  got = jax.jit(lambda *a: value_and_grads(attend, *a))(q, k, v, do, seg)
  run_alone = jax.jit(lambda *a: value_and_grads(attend, *a))
  for b, s, n in documents(SHORT_ROWS):
    want = run_alone(*(x[b:b + 1, s:s + n] for x in (q, k, v, do)))
    assert_close([x[b:b + 1, s:s + n] for x in got], want, jnp.float32, f"document {b, s, n}")


def test_exact_selector_stays_reference_only():
  seg = segment_ids(SHORT_ROWS)
  q, k, _, _ = make_inputs(63, batch=2, hq=4, hkv=2, d=8, dtype=jnp.float32, seed=16)
  with pytest.raises(ValueError, match="selector='exact' exists only in the reference"):
    pisa_jax.select_blocks(q, k, block_size=4, top_k=3, selector="exact", segment_ids=seg,
                           implementation="pallas")


def test_packed_selection_kernels_lower_for_sm90(captured):
  """Beam 9 (18 candidate slots) takes the two-stage kernels (walk, leaf tiles, final top-k),
  beam 3 the fused walk."""
  seg = segment_ids(SHORT_ROWS)
  q, k, _, _ = make_inputs(63, batch=2, hq=32, hkv=2, d=64, dtype=jnp.bfloat16, seed=17)
  for selector, beam in [(s, b) for s in ("pisa", "pisa1", "pisa2") for b in (3, 9)] + [
      ("bsa", 3)]:
    jax.jit(lambda q, k: pisa_jax.selection.select_blocks_packed_pallas(
        q, k, seg, block_size=2, top_k=3, branching=2, selector=selector, scale=0.125, beam=beam,
        interpret=False)).trace(q, k).lower(lowering_platforms=("cuda",))
  names = {re.search(r"module @([A-Za-z0-9_]+)", m).group(1) for m in captured}
  assert {"pisa_pool_runs_g2", "pisa_select_packed_bsa"} <= names, names
  assert {"pisa_select_packed_fused_pisa_rank_pair_lse_unshifted",
          "pisa_select_packed_fused_pisa1_rank", "pisa_select_packed_fused_pisa2_rank"} <= names
  assert {"pisa_select_packed_walk_pisa_rank_folded_pair_lse",
          "pisa_select_packed_walk_pisa1_rank_folded", "pisa_select_packed_walk_pisa2_rank_folded",
          "pisa_select_leaf_q8", "pisa_select_final_topk_rank_folded"} <= names, names


def test_unpacked_attention_kernels_keep_their_inputs(captured):
  """The packed code sits behind a static flag: without segment_ids the kernels take exactly the
  inputs they always took (a document-start input or entry start would show up here)."""
  q, k, v, do = make_inputs(100, batch=1, hq=8, hkv=2, d=64, dtype=jnp.bfloat16, seed=18)
  idx = jnp.asarray(testing.random_block_indices(18, 100, 2, 3, 16))

  def loss(q, k, v):
    out = attn.sparse_attention_pallas(q, k, v, idx, block_size=16, scale=0.1, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",))
  signature = {re.search(r"tt.func public @([A-Za-z0-9_]+)", m).group(1):
               len(re.findall(r"%arg\d+:", m.split("\n", 2)[1])) for m in captured}
  # fwd: q, k, v, indices -> o, lse; dq: + o, do, lse -> dq, delta; dk/dv: q, k, v, do, lse,
  # delta, the entries and the three item tables -> two partials; reduce: offsets, partials -> dk, dv.
  assert signature == {"pisa_sparse_attention_fwd": 6, "pisa_sparse_attention_dq": 9,
                       "pisa_sparse_attention_dkv": 12, "pisa_sparse_attention_dkv_reduce": 5}


def test_unpacked_selection_kernel_keeps_its_inputs(captured):
  """The fused packed walk has its own kernel: the unpacked fused selection kernel still takes q,
  k, the stacked summaries, the level table and max |k|^2, and writes the indices."""
  q, k, _, _ = make_inputs(1000, batch=1, hq=32, hkv=2, d=64, dtype=jnp.bfloat16, seed=19)
  jax.jit(lambda q, k: pisa_jax.kernels.selection.select_blocks_pallas(
      q, k, block_size=64, top_k=8, branching=2, selector="pisa", scale=0.125, beam=8,
      interpret=False)).trace(q, k).lower(lowering_platforms=("cuda",))
  signature = {re.search(r"tt.func public @([A-Za-z0-9_]+)", m).group(1):
               len(re.findall(r"%arg\d+:", m.split("\n", 2)[1])) for m in captured}
  assert signature["pisa_select_fused_rank_pair_lse_unshifted"] == 6, signature
