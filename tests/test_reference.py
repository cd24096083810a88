"""The jnp reference against the paper's rules: one test per rule, oracles,
properties, golden cases and bad input."""

from __future__ import annotations

import json
import math
import os
import pathlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import selection
import oracles
import tolerances

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")
GOLDEN = pathlib.Path(__file__).parent / "data" / "selection_golden.npz"


def make_qkv(seq_len, hq, hkv, d, seed=0, dtype=jnp.float32, batch=1):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (batch, seq_len, hq, d), dtype)
  k = jax.random.normal(kk, (batch, seq_len, hkv, d), dtype)
  v = jax.random.normal(kv, (batch, seq_len, hkv, d), dtype)
  return q, k, v


def select(q, k, **kw):
  return np.asarray(pisa_jax.select_blocks(q, k, implementation="xla", **kw))


def check_invariants(idx, seq_len, block_size, top_k):
  """Ascending, unique, eligible, forced present, count = min(top_k, eligible blocks)."""
  idx = idx.astype(np.int64)
  t = np.arange(seq_len)[None, :, None]
  cur = t // block_size
  valid = idx >= 0
  count = valid.sum(-1)
  np.testing.assert_array_equal(count, np.broadcast_to(np.minimum(top_k, cur + 1), count.shape))
  # Valid entries first, then padding.
  assert np.all(valid[..., :-1] | ~valid[..., 1:])
  v = np.where(valid, idx, np.iinfo(np.int64).max)
  assert np.all((v[..., 1:] > v[..., :-1]) | ~valid[..., 1:]), "not ascending / unique"
  c4 = cur[..., None]
  assert np.all(np.where(valid, idx <= c4, True)), "a block after the query's block was selected"
  for forced in (np.zeros_like(c4), c4 - 1, c4):
    present = np.any(idx == forced, axis=-1) | (forced[..., 0] < 0)
    assert np.all(present), "a forced block is missing"


# Rule 1: leaves are block_size consecutive keys, the last may be partial; summary = mean (Eq. 2).
def test_leaf_summaries_are_means_of_valid_keys():
  _, k, _ = make_qkv(70, 2, 2, 8, batch=2)
  pyr = pisa_jax.build_pyramid(k, block_size=16, branching=2, implementation="xla")
  leaves = np.asarray(pyr.summaries[0])
  kn = np.asarray(k)
  assert leaves.shape == (2, 5, 2, 8) and leaves.dtype == np.float32
  for i in range(5):
    np.testing.assert_allclose(leaves[:, i], kn[:, 16 * i:min(16 * i + 16, 70)].mean(1), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(pyr.counts[0]), [16, 16, 16, 16, 6])


# Rule 2: level l+1 averages up to `branching` valid children; levels until one root (Eq. 10-15).
@pytest.mark.parametrize("branching", [2, 3, 4])
def test_upper_levels_average_valid_children(branching):
  _, k, _ = make_qkv(333, 1, 3, 4, dtype=jnp.bfloat16)
  pyr = pisa_jax.build_pyramid(k, block_size=8, branching=branching, implementation="xla")
  expected = oracles.pyramid(np.asarray(k.astype(jnp.float32))[0], 8, branching)
  assert pyr.num_levels == len(expected) and pyr.summaries[-1].shape[1] == 1
  for got, want in zip(pyr.summaries, expected):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got)[0], want, atol=1e-5)
  for level in range(1, pyr.num_levels):
    below = pyr.summaries[level - 1].shape[1]
    want = [min(branching, below - j * branching) for j in range(pyr.summaries[level].shape[1])]
    np.testing.assert_array_equal(np.asarray(pyr.counts[level]), want)


def test_pyramid_is_a_pytree_that_jits():
  _, k, _ = make_qkv(100, 1, 2, 8)
  pyr = jax.jit(lambda x: pisa_jax.build_pyramid(x, block_size=8, implementation="xla"))(k)
  assert isinstance(pyr, pisa_jax.Pyramid) and pyr.block_size == 8 and pyr.seq_len == 100
  assert [s.shape[1] for s in pyr.summaries] == [13, 7, 4, 2, 1]


# Rules 3 and 4: the hierarchical walk and its scores against an independent float64 loop.
@pytest.mark.parametrize("selector", ["pisa", "pisa1", "pisa2"])
@pytest.mark.parametrize(
    "seq_len,hq,hkv,d,block_size,top_k,branching",
    [(200, 4, 2, 16, 8, 3, 2), (257, 3, 1, 8, 4, 5, 2), (300, 8, 2, 32, 8, 4, 4), (129, 2, 2, 8, 4, 6, 3)],
    ids=lambda x: str(x))
def test_hierarchical_selection_matches_oracle(selector, seq_len, hq, hkv, d, block_size, top_k, branching):
  q, k, _ = make_qkv(seq_len, hq, hkv, d, seed=seq_len)
  scale = 1 / math.sqrt(d)
  got = select(q, k, block_size=block_size, top_k=top_k, branching=branching, selector=selector)[0]
  want = oracles.select_hierarchical(np.asarray(q)[0], np.asarray(k)[0], block_size=block_size,
                                     top_k=top_k, branching=branching, selector=selector, scale=scale)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("selector", ["pisa", "pisa2"])
def test_beam_matches_oracle(selector):
  q, k, _ = make_qkv(300, 4, 2, 16, seed=3)
  got = select(q, k, block_size=8, top_k=4, branching=2, selector=selector, beam=7)[0]
  want = oracles.select_hierarchical(np.asarray(q)[0], np.asarray(k)[0], block_size=8, top_k=4,
                                     branching=2, selector=selector, scale=0.25, beam=7)
  np.testing.assert_array_equal(got, want)


# Rule 3: a node is eligible when its first key is <= t; scores of the current path are never used.
@pytest.mark.parametrize("selector", SELECTORS + ("exact",))
def test_selection_of_query_t_ignores_keys_after_t(selector):
  q, k, _ = make_qkv(300, 4, 2, 16, seed=1)
  t0 = 170
  k2 = k.at[:, t0 + 1:].set(50.0 * jax.random.normal(jax.random.key(9), k[:, t0 + 1:].shape))
  a = select(q, k, block_size=8, top_k=4, selector=selector)
  b = select(q, k2, block_size=8, top_k=4, selector=selector)
  np.testing.assert_array_equal(a[:, :t0 + 1], b[:, :t0 + 1])


# Rule 3: when at most top_k candidates are eligible, all are kept without scoring.
@pytest.mark.parametrize("selector", SELECTORS)
def test_early_queries_keep_every_eligible_block(selector):
  q, k, _ = make_qkv(60, 2, 1, 8)
  idx = select(q, k, block_size=8, top_k=5, selector=selector)
  for t in range(40):
    cur = t // 8
    np.testing.assert_array_equal(idx[0, t, 0], list(range(cur + 1)) + [-1] * (4 - cur))


# Rule 3: the forced blocks count toward top_k and are present even when their keys score worst.
@pytest.mark.parametrize("selector", SELECTORS)
def test_forced_blocks_survive_hostile_scores(selector):
  q, k, _ = make_qkv(256, 2, 1, 8, seed=4)
  q = jnp.abs(q)
  # First, previous and current blocks of the last query get keys pointing away from every query.
  k = k.at[:, 0:8].set(-20.0).at[:, 232:256].set(-20.0)
  idx = select(q, k, block_size=8, top_k=3, selector=selector)
  np.testing.assert_array_equal(idx[0, 255, 0], [0, 30, 31])


# Rule 4: the three scores of Eq. 21, 33 and 34, in float32 whatever the input dtype.
def test_reduce_scores_formulas():
  from pisa_jax.selection import reduce_scores

  z = jnp.array([[0.5, -1.0, 2.0, 7.0]])
  valid = jnp.array([[True, True, True, False]])
  zz = np.array([0.5, -1.0, 2.0])
  np.testing.assert_allclose(reduce_scores(z, valid, "pisa"), [np.log(np.exp(zz).sum())], rtol=1e-6)
  np.testing.assert_allclose(reduce_scores(z, valid, "pisa1"), [zz.mean()], rtol=1e-6)
  np.testing.assert_allclose(reduce_scores(z, valid, "pisa2"), [zz.mean() + zz.var() / 2], rtol=1e-6)


@pytest.mark.parametrize("selector", SELECTORS)
def test_low_precision_inputs_score_like_their_float32_upcast(selector):
  q, k, _ = make_qkv(200, 4, 2, 16, seed=5, dtype=jnp.bfloat16)
  low = select(q, k, block_size=8, top_k=4, selector=selector)
  up = select(q.astype(jnp.float32), k.astype(jnp.float32), block_size=8, top_k=4, selector=selector)
  np.testing.assert_array_equal(low, up)


# Rule 5: GQA heads share one selection scored by the sum of their scores (Eq. 22).
@pytest.mark.parametrize("selector", SELECTORS)
def test_identical_group_heads_select_like_one_head(selector):
  q, k, _ = make_qkv(200, 1, 1, 16, seed=6)
  one = select(q, k, block_size=8, top_k=4, selector=selector)
  three = select(jnp.repeat(q, 3, axis=2), k, block_size=8, top_k=4, selector=selector)
  np.testing.assert_array_equal(one, three)


def test_group_heads_are_summed_not_averaged_away():
  # Head 0 alone prefers block A, head 1 alone prefers block B; the group picks what the sum picks.
  q, k, _ = make_qkv(128, 2, 1, 8, seed=7)
  # K = 5: at K = 3 the forced first, previous and current blocks would be the whole answer.
  got = select(q, k, block_size=8, top_k=5, selector="pisa")[0]
  want = oracles.select_hierarchical(np.asarray(q)[0], np.asarray(k)[0], block_size=8, top_k=5,
                                     branching=2, selector="pisa", scale=1 / math.sqrt(8))
  np.testing.assert_array_equal(got, want)


# Rule 6: "bsa" against an exhaustive computation written separately.
@pytest.mark.parametrize("seq_len,hq,hkv,block_size,top_k", [(150, 4, 2, 8, 3), (333, 6, 2, 16, 5), (64, 2, 1, 4, 8)])
def test_bsa_matches_exhaustive(seq_len, hq, hkv, block_size, top_k):
  q, k, _ = make_qkv(seq_len, hq, hkv, 16, seed=seq_len)
  got = select(q, k, block_size=block_size, top_k=top_k, selector="bsa")[0]
  want = oracles.select_flat(np.asarray(q)[0], np.asarray(k)[0], block_size=block_size, top_k=top_k,
                             scale=0.25, selector="bsa")
  np.testing.assert_array_equal(got, want)


def test_exact_matches_exhaustive():
  q, k, _ = make_qkv(200, 4, 2, 16, seed=8)
  got = select(q, k, block_size=8, top_k=5, selector="exact")[0]
  want = oracles.select_flat(np.asarray(q)[0], np.asarray(k)[0], block_size=8, top_k=5,
                             scale=0.25, selector="exact")
  np.testing.assert_array_equal(got, want)


# Rule 7: ties go to the lower block index; ascending output with -1 padding; default scale.
@pytest.mark.parametrize("selector", SELECTORS + ("exact",))
def test_ties_go_to_the_lower_block_index(selector):
  q, _, _ = make_qkv(256, 2, 1, 8)
  k = jnp.zeros((1, 256, 1, 8))
  idx = select(q, k, block_size=8, top_k=5, selector=selector)
  np.testing.assert_array_equal(idx[0, 255, 0], [0, 1, 2, 30, 31])
  np.testing.assert_array_equal(idx[0, 100, 0], [0, 1, 2, 11, 12])


def test_default_scale_is_inverse_sqrt_head_dim():
  q, k, _ = make_qkv(200, 2, 1, 16)
  np.testing.assert_array_equal(select(q, k, block_size=8, top_k=4),
                                select(q, k, block_size=8, top_k=4, scale=0.25))
  assert not np.array_equal(select(q, k, block_size=8, top_k=4),
                            select(q, k, block_size=8, top_k=4, scale=3.0))


# Properties over random shapes.
# 12 examples in CI, 25 with PISA_SLOW=1.
@hypothesis.settings(max_examples=25 if os.environ.get("PISA_SLOW") == "1" else 12,
                     deadline=None, derandomize=True,
                     phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])
@hypothesis.given(
    seq_len=st.integers(1, 600),
    block_size=st.integers(4, 64),
    top_k=st.integers(3, 8),
    branching=st.sampled_from([2, 4]),
    group=st.sampled_from([1, 2, 3, 4, 16]),
    hkv=st.integers(1, 2),
    d=st.integers(8, 128),
    selector=st.sampled_from(SELECTORS),
    extra_beam=st.sampled_from([None, 0, 1, 5]),
    seed=st.integers(0, 2**16),
)
def test_selection_invariants(seq_len, block_size, top_k, branching, group, hkv, d, selector, extra_beam, seed):
  q, k, _ = make_qkv(seq_len, group * hkv, hkv, d, seed=seed)
  beam = None if extra_beam is None or selector == "bsa" else top_k + extra_beam
  idx = select(q, k, block_size=block_size, top_k=top_k, branching=branching, selector=selector, beam=beam)
  assert idx.shape == (1, seq_len, hkv, top_k) and idx.dtype == np.int32
  check_invariants(idx, seq_len, block_size, top_k)


@pytest.mark.parametrize("selector", SELECTORS)
def test_top_k_covering_every_leaf_selects_everything(selector):
  q, k, _ = make_qkv(100, 2, 1, 8)
  idx = select(q, k, block_size=8, top_k=13, selector=selector)
  for t in (0, 50, 99):
    np.testing.assert_array_equal(idx[0, t, 0], list(range(t // 8 + 1)) + [-1] * (12 - t // 8))


@pytest.mark.parametrize("seq_len,block_size,top_k", [(250, 8, 16), (96, 4, 12)])
def test_pisa_without_upper_pruning_is_exhaustive_lse(seq_len, block_size, top_k):
  # ceil(M / 2) <= top_k: no level above the leaves can drop a node, so the leaf level sees every
  # eligible block with its exact raw-key LSE.
  q, k, _ = make_qkv(seq_len, 4, 2, 16, seed=11)
  assert -(-(-(-seq_len // block_size)) // 2) <= top_k
  np.testing.assert_array_equal(select(q, k, block_size=block_size, top_k=top_k, selector="pisa"),
                                select(q, k, block_size=block_size, top_k=top_k, selector="exact"))


def test_beam_equal_top_k_changes_nothing_and_wide_beam_is_exact():
  q, k, _ = make_qkv(500, 4, 2, 16, seed=12)
  base = select(q, k, block_size=8, top_k=4)
  np.testing.assert_array_equal(base, select(q, k, block_size=8, top_k=4, beam=4))
  np.testing.assert_array_equal(select(q, k, block_size=8, top_k=4, beam=64),
                                select(q, k, block_size=8, top_k=4, selector="exact"))
  wide = select(q, k, block_size=8, top_k=4, beam=6)
  check_invariants(wide, 500, 8, 4)


# Rule 8: sparse attention. The reference has two forms of Eq. 6 (gathered blocks; a dense [T, T]
# mask for short sequences): the rule tests below run each of them.
@pytest.fixture(params=["gathered", "masked"])
def formulation(request, monkeypatch):
  from pisa_jax import attention
  monkeypatch.setattr(attention, "uses_masked_formulation",
                      lambda *args: request.param == "masked")
  jax.clear_caches()  # the jitted reference chose its form when it was traced
  yield request.param
  jax.clear_caches()


@pytest.mark.parametrize("seq_len,hq,hkv,d,block_size", [(100, 4, 2, 16, 8), (64, 3, 1, 32, 16), (1, 2, 2, 8, 4)])
def test_all_blocks_selected_equals_dense_causal(seq_len, hq, hkv, d, block_size, formulation):
  q, k, v = make_qkv(seq_len, hq, hkv, d, batch=2)
  m = -(-seq_len // block_size)
  idx = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (2, seq_len, hkv, m))
  out = pisa_jax.sparse_attention(q, k, v, idx, block_size=block_size, implementation="xla")
  dense = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  np.testing.assert_allclose(out, dense, atol=tolerances.DENSE_MATCH_ATOL)


def test_sparse_attention_ignores_padding_and_future_keys(formulation):
  q, k, v = make_qkv(40, 2, 1, 8)
  idx = jnp.full((1, 40, 1, 3), -1, jnp.int32).at[..., 0].set(jnp.arange(40)[None, :, None] // 8)
  with_pad = pisa_jax.sparse_attention(q, k, v, idx, block_size=8, implementation="xla")
  # Attention to the current block only, keys j <= t: a local causal window.
  mask = (jnp.arange(40)[:, None] >= jnp.arange(40)[None, :]) & (jnp.arange(40)[:, None] // 8 == jnp.arange(40)[None, :] // 8)
  local = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation="xla")
  np.testing.assert_allclose(with_pad, local, atol=1e-5)


def test_query_with_no_visible_key_gets_zeros(formulation):
  q, k, v = make_qkv(24, 2, 1, 8)
  idx = jnp.full((1, 24, 1, 2), -1, jnp.int32).at[0, 3, 0, 0].set(2)  # a future block only
  out = np.asarray(pisa_jax.sparse_attention(q, k, v, idx, block_size=8, implementation="xla"))
  assert np.all(np.isfinite(out)) and np.all(out == 0.0)
  grads = jax.grad(lambda q: pisa_jax.sparse_attention(q, k, v, idx, block_size=8, implementation="xla").sum())(q)
  assert np.all(np.isfinite(np.asarray(grads)))


def test_hidden_huge_logits_leave_gradients_finite(formulation):
  # A future key (hidden from queries before it) whose logit dwarfs every visible one: the softmax
  # must exponentiate masked logits, or exp overflows and the backward pass multiplies inf by 0.
  q, k, v = make_qkv(32, 2, 1, 8, seed=3)
  q = q.at[0, :16].set(10.0)
  k = k.at[0, 20].set(30.0)  # logit 10 * 30 * 8 / sqrt(8) ~ 850 for queries 0..15, hidden
  idx = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (1, 32, 1, 4))
  grads = jax.grad(lambda q, k, v: jnp.sum(pisa_jax.sparse_attention(
      q, k, v, idx, block_size=8, implementation="xla")), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))


def masked_dense(q, k, v, idx, block_size):
  """Dense attention with the mask of a fixed selection, float32 at HIGHEST."""
  b, seq_len, hq, d = q.shape
  hkv = k.shape[2]
  pos = jnp.arange(seq_len)
  chosen = jnp.any((pos[None, None, None, :] // block_size)[..., None] == idx[:, :, :, None, :], axis=-1)
  mask = chosen & (pos[None, None, None, :] <= pos[None, :, None, None])  # [B, T, HKV, S]
  mask = jnp.repeat(mask, hq // hkv, axis=2)
  kk = jnp.repeat(k, hq // hkv, axis=2)
  vv = jnp.repeat(v, hq // hkv, axis=2)
  logits = jnp.einsum("bthd,bshd->bths", q, kk, precision="highest") / math.sqrt(d)
  w = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
  return jnp.einsum("bths,bshd->bthd", w, vv, precision="highest")


@pytest.mark.parametrize("selector", ["pisa", "bsa"])
def test_pisa_attention_gradients_equal_masked_dense(selector, formulation):
  q, k, v = make_qkv(150, 6, 2, 16, seed=13)
  w = jax.random.normal(jax.random.key(1), q.shape)
  idx = pisa_jax.select_blocks(q, k, block_size=8, top_k=4, selector=selector, implementation="xla")

  def loss_sparse(q, k, v):
    return jnp.sum(w * pisa_jax.pisa_attention(q, k, v, block_size=8, top_k=4, selector=selector,
                                               implementation="xla"))

  def loss_dense(q, k, v):
    return jnp.sum(w * masked_dense(q, k, v, idx, 8))

  out_s = pisa_jax.pisa_attention(q, k, v, block_size=8, top_k=4, selector=selector, implementation="xla")
  np.testing.assert_allclose(out_s, masked_dense(q, k, v, idx, 8), atol=1e-5)
  gs = jax.grad(loss_sparse, argnums=(0, 1, 2))(q, k, v)
  gd = jax.grad(loss_dense, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(gs, gd):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_public_functions_jit_and_vmap():
  q, k, v = make_qkv(70, 4, 2, 8, batch=3)
  f = jax.jit(lambda q, k, v: pisa_jax.pisa_attention(q, k, v, block_size=8, top_k=3, implementation="xla"))
  out = f(q, k, v)
  vm = jax.vmap(lambda q, k, v: pisa_jax.pisa_attention(q[None], k[None], v[None], block_size=8, top_k=3,
                                                        implementation="xla")[0])(q, k, v)
  np.testing.assert_allclose(out, vm, atol=1e-6)


# selection_quality (Section 4.4, Appendix D.2).
def test_selection_quality_of_the_reference_set_is_perfect():
  q, k, _ = make_qkv(160, 4, 2, 16, seed=14)
  mass, ref = oracles.full_attention_reference_set(np.asarray(q)[0], np.asarray(k)[0], block_size=8,
                                                   top_k=4, scale=0.25)
  quality = pisa_jax.selection_quality(q, k, jnp.asarray(ref, jnp.int32)[None], block_size=8)
  np.testing.assert_allclose([quality.recall, quality.mass_ratio], [1.0, 1.0], atol=1e-6)
  rows = (np.arange(160) // 8 + 1) > 4
  want_captured = np.take_along_axis(mass, ref, axis=-1).sum(-1)[rows].mean()
  np.testing.assert_allclose(quality.captured_mass, want_captured, atol=1e-5)
  assert int(quality.num_rows) == rows.sum() * 2


def test_selection_quality_scores_a_worse_selection_lower():
  q, k, _ = make_qkv(160, 4, 2, 16, seed=14)
  idx = pisa_jax.select_blocks(q, k, block_size=8, top_k=4, selector="pisa1", implementation="xla")
  _, ref = oracles.full_attention_reference_set(np.asarray(q)[0], np.asarray(k)[0], block_size=8,
                                                top_k=4, scale=0.25)
  quality = pisa_jax.selection_quality(q, k, idx, block_size=8)
  got = np.asarray(idx)[0]
  rows = (np.arange(160) // 8 + 1) > 4
  overlap = np.array([[len(set(got[t, h]) & set(ref[t, h])) / 4 for h in range(2)] for t in range(160)])
  np.testing.assert_allclose(quality.recall, overlap[rows].mean(), atol=1e-6)
  assert float(quality.recall) < 1.0


# Golden cases from an independent float64 implementation.
def golden_cases():
  data = np.load(GOLDEN)
  meta = json.loads(str(data["meta_json"]))
  return [(c, s) for c in meta for s in c["selectors"]]


@pytest.mark.parametrize("case,selector", golden_cases(),
                         ids=lambda x: f"T{x['T']}-HQ{x['HQ']}-HKV{x['HKV']}-D{x['D']}-C{x['block_size']}-K{x['top_k']}-g{x['branching']}" if isinstance(x, dict) else x)
def test_golden(case, selector):
  data = np.load(GOLDEN)
  i = case["case"]
  q, k, v = (jnp.asarray(data[f"c{i}_{n}"])[None] for n in "qkv")
  kw = dict(block_size=case["block_size"])
  idx = pisa_jax.select_blocks(q, k, top_k=case["top_k"], branching=case["branching"], selector=selector,
                               implementation="xla", **kw)
  np.testing.assert_array_equal(np.asarray(idx)[0], data[f"c{i}_idx_{selector}"])
  out = pisa_jax.sparse_attention(q, k, v, idx, implementation="xla", **kw)
  np.testing.assert_allclose(np.asarray(out)[0], data[f"c{i}_out_{selector}"], atol=tolerances.GOLDEN_OUTPUT_ATOL)
  quality = pisa_jax.selection_quality(q, k, idx, **kw)
  np.testing.assert_allclose(np.array(quality[:3]), data[f"c{i}_quality_{selector}"],
                             atol=tolerances.GOLDEN_QUALITY_ATOL, equal_nan=True)


# Bad input: every case names the argument and the expected value.
@pytest.mark.parametrize("call,error,match", [
    (lambda q, k, v: pisa_jax.select_blocks(q[0], k), ValueError, "q must have rank 4"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k[:, :, :, :4]), ValueError, "head dim"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k[:, :10]), ValueError, "k length 10 must equal q length"),
    (lambda q, k, v: pisa_jax.select_blocks(q, jnp.concatenate([k, k]), ), ValueError, "k batch"),
    (lambda q, k, v: pisa_jax.select_blocks(q[:, :, :3], k), ValueError, "multiple of key/value heads"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, block_size=0), ValueError, "block_size=0 must be"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, branching=1), ValueError, "branching=1 must be"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, top_k=2), ValueError, "top_k=2 must be an int >= 3"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, selector="nsa"), ValueError, "selector='nsa' is unknown"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, implementation="cuda"), ValueError, "implementation='cuda' is unknown"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, top_k=4, beam=3), ValueError, "beam=3 must be None or an int >= top_k"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, selector="bsa", beam=9), ValueError, "beam=9 applies only"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, scale=-1.0), ValueError, "scale=-1.0 must be"),
    (lambda q, k, v: pisa_jax.select_blocks(q, k, selector="exact", implementation="pallas"), ValueError, "only in the reference"),
    (lambda q, k, v: pisa_jax.select_blocks(q.astype(jnp.int32), k), TypeError, "q must be a floating-point"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v.astype(jnp.int8), jnp.zeros((1, 20, 2, 3), jnp.int32)), TypeError, "v must be a floating-point"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v[:, :, :1], jnp.zeros((1, 20, 2, 3), jnp.int32)), ValueError, "v.shape"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v, jnp.zeros((1, 20, 2), jnp.int32)), ValueError, "block_indices.shape"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v, jnp.zeros((1, 20, 2, 3), jnp.float32)), TypeError, "block_indices must be an integer"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v, jnp.full((1, 20, 2, 3), 5, jnp.int32), block_size=8), ValueError, r"must lie in \[-1, 3\)"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v, jnp.full((1, 20, 2, 3), -2, jnp.int32), block_size=8), ValueError, "must lie in"),
    (lambda q, k, v: pisa_jax.sparse_attention(q, k, v, jnp.zeros((1, 20, 2, 3), jnp.int32), block_size=8), ValueError, "must not repeat"),
    (lambda q, k, v: pisa_jax.build_pyramid(k, block_size=-3), ValueError, "block_size=-3"),
    (lambda q, k, v: pisa_jax.build_pyramid(k.astype(jnp.int32)), TypeError, "k must be a floating-point"),
    (lambda q, k, v: pisa_jax.pisa_attention(q, k, v, top_k=1), ValueError, "top_k=1"),
    (lambda q, k, v: pisa_jax.selection_quality(q, k, jnp.zeros((1, 20, 1, 3), jnp.int32)), ValueError, "block_indices.shape"),
    (lambda q, k, v: pisa_jax.selection_quality(q, k, jnp.full((1, 20, 2, 2), -1, jnp.int32)), ValueError, r"block_indices.shape\[-1\]=2 must be >= 3"),
])
def test_bad_input_is_rejected_with_a_named_argument(call, error, match):
  q, k, v = make_qkv(20, 4, 2, 8)
  with pytest.raises(error, match=match):
    call(q, k, v)


@pytest.mark.parametrize("selector,beam", [("pisa", 6), ("pisa2", 4)])
def test_reference_at_positions_equals_full_rows(selector, beam):
  # The spot-check reference (used by the 1M-token kernel check) returns exactly the full
  # reference's rows at the requested positions, in their order, chunk padding included.
  q = jax.random.normal(jax.random.key(0), (2, 700, 6, 32))
  k = jax.random.normal(jax.random.key(1), (2, 700, 3, 32))
  kw = dict(block_size=16, top_k=4, branching=2, selector=selector, scale=0.2, beam=beam)
  full = np.asarray(selection.select_blocks_reference(q, k, **kw))
  pos = jnp.asarray([699, 0, 5, 350, 17, 640, 333, 64, 63])
  sub = selection.select_blocks_reference_at(q[:, pos], k, pos, chunk=4, **kw)
  np.testing.assert_array_equal(np.asarray(sub), full[:, np.asarray(pos)])
  with pytest.raises(ValueError, match="selector"):
    selection.select_blocks_reference_at(q[:, pos], k, pos, **dict(kw, selector="bsa"))
  with pytest.raises(ValueError, match="positions must lie"):
    selection.select_blocks_reference_at(q[:, :2], k, jnp.asarray([3, 700]), **kw)
  with pytest.raises(ValueError, match="positions.shape"):
    selection.select_blocks_reference_at(q[:, :3], k, jnp.asarray([3, 7]), **kw)
  with pytest.raises(TypeError, match="positions must be a 1-D integer"):
    selection.select_blocks_reference_at(q[:, :2], k, jnp.asarray([3.0, 7.0]), **kw)


@pytest.mark.parametrize("seq_len,hq,hkv,d,block_size,top_k", [
    (100, 6, 2, 16, 8, 5), pytest.param(130, 3, 1, 32, 8, 16, marks=pytest.mark.slow),
    (64, 4, 4, 8, 16, 3)])
def test_masked_and_gathered_reference_agree(seq_len, hq, hkv, d, block_size, top_k):
  from pisa_jax.attention import sparse_attention_reference
  q, k, v = make_qkv(seq_len, hq, hkv, d, batch=2, seed=seq_len)
  idx = pisa_jax.select_blocks(q, k, block_size=block_size, top_k=top_k, implementation="xla")
  idx = idx.at[:, 5:9, :, 0].set(-1)  # padding entries, and rows left with no visible key
  idx = idx.at[:, 2].set(-1)

  def run(masked):
    return sparse_attention_reference(q, k, v, idx, block_size=block_size, scale=0.3,
                                      masked=masked)

  np.testing.assert_allclose(run(True), run(False), atol=1e-5)
  assert np.all(np.asarray(run(True))[:, 2] == 0.0)

  def grads(masked):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(sparse_attention_reference(
        q, k, v, idx, block_size=block_size, scale=0.3, masked=masked))), argnums=(0, 1, 2))(q, k, v)

  for a, b in zip(grads(True), grads(False)):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


# The reference in low precision: float32 sums, one rounding, bit-identical gradients.
def equations(jaxpr):
  """Every equation of a jaxpr, those of its sub-jaxprs (cond branches, scans, custom rules) too."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from equations(sub)


@pytest.mark.parametrize("seq_len,c", [(2048, 64), (512, 32)], ids=["gathered", "masked"])
def test_bf16_gradients_are_float32_sums_rounded_once(seq_len, c):
  # PISA's own indices at 16 / 2 heads, d 64, K 8: block 0 is selected by every query, so its dk
  # and dv sum T queries' contributions. Against float32 gradients of the same bf16-rounded
  # inputs, the bf16 run may differ only by the final rounding of each output.
  from pisa_jax.attention import sparse_attention_reference, uses_masked_formulation
  hq, hkv, d, top_k = 16, 2, 64, 8
  assert uses_masked_formulation(1, seq_len, hq, top_k, c) == (seq_len == 512)
  q, k, v = make_qkv(seq_len, hq, hkv, d, seed=21, dtype=jnp.bfloat16)
  do = jax.random.normal(jax.random.key(22), q.shape, jnp.bfloat16)
  idx = pisa_jax.select_blocks(q, k, block_size=c, top_k=top_k, implementation="xla")

  @jax.jit
  def value_and_grads(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: sparse_attention_reference(
        q, k, v, idx, block_size=c, scale=d ** -0.5), q, k, v)
    return (out,) + vjp(do)

  low = value_and_grads(q, k, v, do)
  again = value_and_grads(q, k, v, do)
  f32 = lambda x: x.astype(jnp.float32)
  high = value_and_grads(f32(q), f32(k), f32(v), f32(do))
  for name, a, b, w in zip(("o", "dq", "dk", "dv"), low, again, high):
    assert a.dtype == jnp.bfloat16, name
    np.testing.assert_array_equal(np.asarray(f32(a)), np.asarray(f32(b)), err_msg=name)
    rel = float(jnp.linalg.norm(f32(a) - w) / jnp.linalg.norm(w))
    assert rel < tolerances.REFERENCE_LOW_PRECISION_REL_RMS, (name, rel)


def test_reference_gradients_have_no_float_scatter():
  # A float scatter-add (the transpose of a gather) is non-deterministic on a GPU, whose atomics
  # add in a different order each run: neither formulation's backward may contain one.
  from pisa_jax.attention import sparse_attention_reference
  q, k, v = make_qkv(200, 4, 2, 16, seed=23, dtype=jnp.bfloat16)
  idx = pisa_jax.select_blocks(q, k, block_size=8, top_k=4, implementation="xla")
  for masked in (True, False):
    grad = jax.grad(lambda q, k, v: jnp.sum(sparse_attention_reference(
        q, k, v, idx, block_size=8, scale=0.25, masked=masked).astype(jnp.float32)),
        argnums=(0, 1, 2))
    scatters = [e for e in equations(jax.make_jaxpr(grad)(q, k, v).jaxpr)
                if e.primitive.name.startswith("scatter")]
    assert scatters  # the walk reaches the backward: the inverted index counts with an int scatter
    for eqn in scatters:
      assert jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.integer), (masked, eqn)
