"""The fused packed walk kernel (`kernels.selection.packed_walk`), in interpret mode on CPU.

Its indices are compared with the packed reference (`implementation="xla"`) and with each
document run alone from position 0, on documents of 1 token, shorter than a block, starting and
ending mid-block, rows of many documents and T not a multiple of C; a mismatch is accepted only
where the float64 re-walk of that document proves a near-tie. Also: which selections it takes
(the routing rule), and its lowering to sm_90 Triton IR at 128K tokens.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import testing
from pisa_jax.geometry import level_sizes
from pisa_jax.kernels.selection import layout, packed_walk, walk
import tolerances as tol

# T = 111: documents of 1, 3, 5, 13 and 50 tokens, in two orders.
ROWS = ([1, 3, 5, 13, 3, 50, 1, 13, 5, 1, 3, 13], [13, 1, 1, 50, 5, 3, 13, 5, 3, 13, 1, 3])
# T = 63: documents of one token, shorter than a block, crossing block edges.
SHORT_ROWS = ([5, 1, 22, 1, 5, 29], [29, 5, 22, 1, 1, 5])
# T = 85: two dozen documents of 1-4 tokens, then one long enough for several levels.
MANY_ROWS = ([1, 2, 3, 1, 4, 2, 1, 3, 3, 1, 2, 4, 1, 1, 2, 3, 4, 1, 2, 1, 3, 2, 1, 1, 36],)
# T = 301: a document of 257 tokens (129 leaves of C = 2: a walk of five scored levels).
DEEP_ROWS = ([7, 257, 37],)


def segment_ids(rows) -> jax.Array:
  return jnp.asarray(np.stack([np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32))


def documents(rows):
  """(row, start, length) of every document."""
  for b, lengths in enumerate(rows):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for s, n in zip(starts, lengths):
      yield b, int(s), int(n)


def inputs(rows, hq, hkv, d, dtype, q_scale, seed):
  seq_len = sum(rows[0])
  kq, kk = jax.random.split(jax.random.key(seed))
  q = q_scale * jax.random.normal(kq, (len(rows), seq_len, hq, d), jnp.float32)
  k = jax.random.normal(kk, (len(rows), seq_len, hkv, d), jnp.float32)
  return q.astype(dtype), k.astype(dtype)


def assert_same_or_near_tie(got, want, q, k, proof, where):
  """Index rows equal, or differ only at a near-tie the float64 re-walk of q, k proves."""
  margins = testing.mismatch_margins(got, want, q, k, **proof)
  assert all(m < tol.SELECTION_NEAR_TIE_RTOL for *_, m in margins), (where, margins)


def case(rows, hq, hkv, d, c, top_k, g, beam, selector, dtype, q_scale=1.0, *marks):
  name = (f"T{sum(rows[0])}-docs{sum(map(len, rows))}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{top_k}-g{g}-"
          f"beam{beam}-{selector}-{jnp.dtype(dtype).name}" + ("-shifted" if q_scale > 1 else ""))
  return pytest.param((rows, hq, hkv, d, c, top_k, g, beam, selector, dtype, q_scale), id=name,
                      marks=marks)


# K > 3: at K = 3 the forced first, previous and current blocks are the whole answer.
CASES = [
    case(ROWS, 4, 2, 8, 4, 5, 2, 5, "pisa", jnp.float32),
    case(SHORT_ROWS, 4, 1, 16, 8, 4, 2, 4, "pisa", jnp.bfloat16),
    # Group 1, g = 3 (the general Eq. 21 reduction), logits too large for the unshifted branch.
    case(MANY_ROWS, 2, 2, 8, 2, 5, 3, 5, "pisa", jnp.float32, 40.0),
    case(DEEP_ROWS, 4, 1, 8, 2, 4, 2, 4, "pisa", jnp.float32, 1.0, pytest.mark.slow),
    case(ROWS, 4, 1, 8, 4, 4, 4, 4, "pisa1", jnp.float32, 1.0, pytest.mark.slow),
    case(MANY_ROWS, 4, 2, 16, 2, 4, 2, 8, "pisa2", jnp.bfloat16, 1.0, pytest.mark.slow),
    case(SHORT_ROWS, 2, 1, 48, 16, 4, 2, 4, "pisa", jnp.bfloat16, 1.0, pytest.mark.slow),
]


@pytest.mark.parametrize("params", CASES)
def test_fused_packed_walk_equals_reference_and_each_document_alone(params):
  rows, hq, hkv, d, c, top_k, g, beam, selector, dtype, q_scale = params
  assert packed_walk.covers(selector, beam, g)
  seg = segment_ids(rows)
  q, k = inputs(rows, hq, hkv, d, dtype, q_scale, seed=sum(rows[0]) + c)
  selection = dict(block_size=c, top_k=top_k, branching=g, selector=selector, beam=beam)
  got = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="pallas", **selection)
  assert got.shape == (len(rows), seg.shape[1], hkv, top_k) and got.dtype == jnp.int32
  want = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="xla", **selection)
  proof = dict(selection, scale=d ** -0.5)
  q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
  for b, s, n in documents(rows):
    qd, kd = q[b:b + 1, s:s + n], k[b:b + 1, s:s + n]
    mine = got[b:b + 1, s:s + n]
    # Document block ids: -1 or below the document's own block count, ascending.
    leaves = np.asarray(mine)
    assert np.all((leaves >= -1) & (leaves < -(-n // c))), (b, s, n)
    alone = pisa_jax.select_blocks(qd, kd, implementation="xla", **selection)
    assert_same_or_near_tie(mine, want[b:b + 1, s:s + n], q32[b:b + 1, s:s + n],
                            k32[b:b + 1, s:s + n], proof, ("reference", b, s, n))
    assert_same_or_near_tie(mine, alone, q32[b:b + 1, s:s + n], k32[b:b + 1, s:s + n], proof,
                            ("alone", b, s, n))


def test_non_finite_key_ranks_as_in_the_reference():
  """A NaN key makes the scores of its leaf and the leaf's ancestors NaN, which Select_K ranks
  after the forced nodes and before every number, in the kernel as in the reference; its
  (batch, KV head) takes the shifted Eq. 21 (the unshifted bound fails on NaN)."""
  rows = ([5, 40, 18],)
  seg = segment_ids(rows)
  q, k = inputs(rows, 4, 2, 8, jnp.float32, 1.0, seed=5)
  k = k.at[0, 5 + 9, 1, 3].set(jnp.nan)  # document 1, its leaf 2 (C = 4), KV head 1
  selection = dict(block_size=4, top_k=4, branching=2, selector="pisa", beam=4)
  # The packed pyramid first, so that a mismatch below is the walk's: document 1's nodes hold
  # NaN exactly where the reference's do (its leaf 2 and that leaf's ancestors, KV head 1).
  pyramids = [pisa_jax.build_pyramid(k, block_size=4, branching=2, segment_ids=seg,
                                     implementation=impl) for impl in ("pallas", "xla")]
  for level, size in enumerate(level_sizes(40, 4, 2)):
    first = int(pyramids[1].first_node[0, 5, level])
    got_nan, want_nan = (np.isnan(np.asarray(p.summaries[level][0, first:first + size]))
                         for p in pyramids)
    np.testing.assert_array_equal(got_nan, want_nan, err_msg=f"pyramid level {level + 1}")
    assert want_nan[2 >> level, 1].any() and not want_nan[:, 0].any(), level
  got = np.asarray(pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="pallas",
                                          **selection))
  want = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="xla", **selection)
  np.testing.assert_array_equal(got, np.asarray(want))
  # Every query of document 1 that scores leaf 2 (its current block 4 or later) keeps it in
  # its one unforced slot.
  assert np.all(np.any(got[0, 5 + 16:45, 1] == 2, axis=-1))


@pytest.mark.parametrize("block_size,branching,beam", [(4, 2, 3), (2, 3, 5), (8, 4, 4)])
def test_document_table_is_each_documents_own_geometry(block_size, branching, beam):
  """Per query: its document's start, leaves, first scored level and that level's nodes as the
  document's own geometry gives them alone (`walk.first_scored_level`), then its first slots."""
  seg = segment_ids(ROWS)
  q, k = inputs(ROWS, 2, 1, 8, jnp.float32, 1.0, seed=4)
  kw = dict(block_size=block_size, top_k=3, branching=branching, selector="pisa", scale=0.3,
            beam=beam)
  docs = pisa_jax.segments.documents(seg, block_size, branching)
  caps = pisa_jax.segments.packed_capacities(111, block_size, branching)
  geo = layout.make_geometry(q, k, **kw)
  table = np.asarray(packed_walk.document_table(docs.start, docs.length, docs.first_node, caps,
                                                geo)).reshape(2, 111, -1)
  # Level l's first row in the stacked summaries, then KV head 0 of the document's first node.
  offsets = np.cumsum([0] + [2 * cap for cap in caps[:-2]])
  first = np.asarray(docs.first_node)[..., :len(caps) - 1]
  rows = np.where(first >= 0, offsets + np.arange(2)[:, None, None] * np.asarray(caps[:-1])
                  + first, -1)
  for b, s, n in documents(ROWS):
    alone = layout.make_geometry(q[:, :n], k[:, :n], **kw)
    level = walk.first_scored_level(alone)
    want = [s, alone.level_sizes[0], level, alone.level_sizes[level - 1]]
    np.testing.assert_array_equal(table[b, s:s + n, :4], np.broadcast_to(want, (n, 4)))
    np.testing.assert_array_equal(table[b, s:s + n, 4:3 + len(caps)], rows[b, s:s + n])


def kernel_names(fn, *args) -> set[str]:
  return set(re.findall(r"name=(pisa\w+)", str(jax.make_jaxpr(fn)(*args))))


def test_routing_rule():
  """Hierarchical selectors at beam * g <= 16 run the fused packed walk, one launch for every
  level; wider beams the packed two-stage (walk, leaf tiles, final top-k); "bsa" its own."""
  seg = segment_ids(SHORT_ROWS)
  q, k = inputs(SHORT_ROWS, 4, 2, 8, jnp.float32, 1.0, seed=3)

  def names(**kw):
    select = lambda q, k: pisa_jax.selection.select_blocks_packed_pallas(
        q, k, seg, block_size=4, scale=0.3, interpret=True, **kw)
    return sorted(n for n in kernel_names(select, q, k) if "select" in n)

  assert names(top_k=3, branching=2, selector="pisa", beam=8) == [
      "pisa_select_packed_fused_pisa_rank_pair_lse_unshifted"]
  assert names(top_k=3, branching=2, selector="pisa", beam=9) == [
      "pisa_select_final_topk_rank_folded", "pisa_select_leaf_q8",
      "pisa_select_packed_walk_pisa_rank_folded_pair_lse"]
  assert names(top_k=3, branching=3, selector="pisa2", beam=6) == [
      "pisa_select_final_topk_rank_folded", "pisa_select_leaf_q8",
      "pisa_select_packed_walk_pisa2_rank_folded"]
  assert names(top_k=3, branching=2, selector="bsa", beam=3) == ["pisa_select_packed_bsa"]
  with pytest.raises(ValueError, match="beam=9"):
    packed_walk.select_packed_fused(q, k, *([None] * 4), block_size=4, top_k=3, branching=2,
                                    selector="pisa", scale=0.3, beam=9, interpret=True)
  with pytest.raises(ValueError, match="beam=8"):
    packed_walk.select_packed_two_stage(q, k, *([None] * 4), block_size=4, top_k=3, branching=2,
                                        selector="pisa", scale=0.3, beam=8, interpret=True)


def document_lengths(seq_len: int, seed: int) -> list[int]:
  """Documents of 2K-16K tokens filling seq_len, as in `benchmarks/packed.py`."""
  rng = np.random.default_rng(seed)
  lengths = []
  while sum(lengths) < seq_len:
    lengths.append(int(rng.integers(2048, 16385)))
  lengths[-1] -= sum(lengths) - seq_len
  return lengths


def test_fused_packed_walk_lowers_for_sm90_at_128k(captured):
  """The default setting (HQ 32, HKV 2, D 64, C 64, K 8, bf16) on 128K tokens of packed documents
  lowers to one selection kernel, whose row arithmetic stays int32 (no i64 in its IR)."""
  seq_len = 1 << 17
  seg = segment_ids((document_lengths(seq_len, 0),))
  q = jax.ShapeDtypeStruct((1, seq_len, 32, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, seq_len, 2, 64), jnp.bfloat16)
  jax.jit(lambda q, k: pisa_jax.selection.select_blocks_packed_pallas(
      q, k, seg, block_size=64, top_k=8, branching=2, selector="pisa", scale=0.125, beam=8,
      interpret=False)).trace(q, k).lower(lowering_platforms=("cuda",))
  modules = {re.search(r"module @([A-Za-z0-9_]+)", m).group(1): m for m in captured}
  select = [n for n in modules if "select" in n]
  assert select == ["pisa_select_packed_fused_pisa_rank_pair_lse_unshifted"], select
  assert "i64" not in modules[select[0]]
