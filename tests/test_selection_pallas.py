"""Pallas pyramid and selection kernels (interpret mode on CPU) against the jnp reference.

Indices must equal the reference's. The only allowed exception is a row whose selection contains a
near-tie: `decision_margin` re-walks that row in float64 (numpy, independent of both
implementations) and returns the smallest relative gap between the last kept and the best dropped
score over every level where scores decided; a mismatching row must have a margin below
SELECTION_NEAR_TIE_RTOL, which proves the mismatch is a float32 summation-order flip.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax.kernels import _common
from pisa_jax.kernels.pyramid import build_pyramid_pallas
from pisa_jax.kernels.selection import SelectionConfig, layout, scoring, select_blocks_pallas, topk
from pisa_jax.pyramid import build_pyramid_reference
from pisa_jax.selection import select_blocks_reference
from pisa_jax.testing import decision_margin

from tolerances import PYRAMID_ATOL, SELECTION_NEAR_TIE_RTOL

GOLDEN = pathlib.Path(__file__).parent / "data" / "selection_golden.npz"


def assert_same_or_near_tie(out, ref, q, k, *, block_size, top_k, branching, selector, scale,
                            beam):
  """Indices equal, except rows proven to be near-ties by `decision_margin`."""
  out, ref = np.asarray(out), np.asarray(ref)
  assert out.shape == ref.shape and out.dtype == ref.dtype == np.int32
  bad = np.argwhere(np.any(out != ref, axis=-1))
  cache = {}
  for b, t, h in bad:
    margin = decision_margin(q, k, int(b), int(t), int(h), block_size=block_size, top_k=top_k,
                             branching=branching, selector=selector, scale=scale, beam=beam,
                             cache=cache)
    assert margin < SELECTION_NEAR_TIE_RTOL, (
        f"row b={b} t={t} h={h}: kernel {out[b, t, h]} != reference {ref[b, t, h]} "
        f"with decision margin {margin:.3g} >= {SELECTION_NEAR_TIE_RTOL}")
  return len(bad)


# ---------------------------------------------------------------------------------------------
# Cases.


def _inputs(seed, t, hq, hkv, d, dtype=jnp.float32, b=1):
  kq, kk = jax.random.split(jax.random.PRNGKey(seed))
  q = jax.random.normal(kq, (b, t, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, t, hkv, d), jnp.float32)
  # A few keys scaled up, as in the golden cases, so that scores are rarely near-ties.
  k = k * jnp.where(jax.random.uniform(kk, (b, t, hkv, 1)) < 0.05, 3.0, 1.0)
  return q, k.astype(dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "top_k", "branching", "selector",
                                             "scale", "beam", "config"))
def _kernel(q, k, *, block_size, top_k, branching, selector, scale, beam, config):
  return select_blocks_pallas(q, k, block_size=block_size, top_k=top_k, branching=branching,
                              selector=selector, scale=scale, beam=beam, interpret=True,
                              config=config)


def _kernel_names(q, k, config, **kw):
  """The Pallas kernels a selection call launches (their names in its jaxpr)."""
  fn = lambda q, k: _kernel(q, k, config=config, **kw)
  return set(re.findall(r"pisa_select_[a-z_0-9]+", str(jax.make_jaxpr(fn)(q, k))))


def _check(t, hq, hkv, d, top_k, selector, *, block_size=64, branching=2, beam=None,
           config=None, dtype=jnp.float32, seed=0, b=1):
  q, k = _inputs(seed, t, hq, hkv, d, dtype, b)
  beam = top_k if beam is None else beam
  kw = dict(block_size=block_size, top_k=top_k, branching=branching, selector=selector,
            scale=float(d) ** -0.5, beam=beam)
  out = _kernel(q, k, config=config, **kw)
  ref = select_blocks_reference(q.astype(jnp.float32), k.astype(jnp.float32), **kw)
  # Structure: ascending valid ids then -1, min(top_k, cur + 1) of them.
  o = np.asarray(out)
  n_valid = np.minimum(top_k, np.arange(t) // block_size + 1)
  assert ((o >= 0).sum(-1) == n_valid[None, :, None]).all()
  return assert_same_or_near_tie(out, ref, q.astype(jnp.float32), k.astype(jnp.float32), **kw)


# The passes top-k, the general reduction of the children and the shifted Eq. 21: the forms the
# field defaults (rank, pair LSE, unshifted LSE) replaced, still selectable and tested.
PLAIN = dict(topk_impl="passes", topk_rows=32, walk_pair_lse=False, fused_unshifted_lse=False)
TWO = SelectionConfig(variant="two_stage", q_tile=4, **PLAIN)
FUSED = SelectionConfig(variant="fused", **PLAIN)
ULSE = dataclasses.replace(FUSED, fused_unshifted_lse=True)
# (T, HQ, HKV, D, top_k, selector, block_size, branching, config)
CI_CASES = [
    (1000, 16, 1, 64, 8, "pisa", 64, 2, TWO),
    (300, 6, 2, 128, 3, "pisa", 16, 2, FUSED),
    (65, 2, 2, 64, 3, "pisa1", 16, 2, dataclasses.replace(TWO, q_tile=2)),
    (600, 4, 2, 64, 4, "pisa", 8, 2, TWO),
    (300, 2, 1, 128, 8, "pisa2", 16, 3, dataclasses.replace(TWO, q_tile=1)),
    (1000, 16, 1, 64, 8, "bsa", 64, 2, SelectionConfig(bsa_q_tile=4, bsa_block_tile=16)),
    (300, 3, 1, 64, 3, "bsa", 16, 2, SelectionConfig(bsa_q_tile=8, bsa_block_tile=16)),
    (63, 3, 1, 128, 16, "pisa", 8, 2, TWO),
    (64, 1, 1, 64, 3, "pisa2", 16, 2, FUSED),
    (1, 2, 2, 64, 8, "pisa", 64, 2, TWO),
    # The field defaults (the fused kernel with the rank top-k, the pair and unshifted LSE) at
    # group 3 (odd and even counts of needed leaves).
    (1000, 3, 1, 64, 8, "pisa", 64, 2, SelectionConfig()),
    # The unshifted Eq. 21 branch (`fused_unshifted_lse`; these logits are within its bound) at
    # D = 128, D = 48 (padded) and g = 3 (the general reduction of the children).
    (300, 6, 2, 128, 3, "pisa", 16, 2, ULSE),
    (300, 4, 2, 48, 8, "pisa", 16, 2, ULSE),
    (300, 2, 1, 64, 4, "pisa", 16, 3, ULSE),
]


def _case_id(c):
  t, hq, hkv, d, top_k, sel, bs, g, cfg = c
  return (f"T{t}-HQ{hq}-HKV{hkv}-D{d}-C{bs}-g{g}-K{top_k}-{sel}-{cfg.variant}-q{cfg.q_tile}"
          f"-{cfg.topk_impl}" + ("-pair" if cfg.walk_pair_lse else "")
          + ("-unshifted" if cfg.fused_unshifted_lse else ""))


@pytest.mark.parametrize("case", CI_CASES, ids=_case_id)
def test_selection_matches_reference(case):
  t, hq, hkv, d, top_k, selector, bs, g, cfg = case
  _check(t, hq, hkv, d, top_k, selector, block_size=bs, branching=g, config=cfg)


SLOW_CASES = [
    (t, hkv * grp, hkv, d, top_k, sel, 64 if t >= 1000 else 16, 2, cfg)
    for t in (1, 63, 64, 65, 300, 1000)
    for grp, hkv in ((1, 2), (2, 1), (3, 1), (16, 1))
    for d in (64, 128)
    for top_k in (3, 8, 16)
    for sel in ("pisa", "pisa1", "pisa2", "bsa")
    for cfg in ((TWO, FUSED) if sel != "bsa" else (TWO,))
    if (t + grp + d + top_k) % 7 == 0  # a fixed, spread-out sixth of the full product
]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_case_id)
def test_selection_matrix_slow(case):
  t, hq, hkv, d, top_k, selector, bs, g, cfg = case
  _check(t, hq, hkv, d, top_k, selector, block_size=bs, branching=g, config=cfg)


# ---------------------------------------------------------------------------------------------
# The rank-based in-kernel top-k (topk_impl="rank").

RANK = dataclasses.replace(TWO, topk_impl="rank", topk_rows=8)
RANK_FUSED = dataclasses.replace(FUSED, topk_impl="rank")
FOLDED = dataclasses.replace(RANK, topk_impl="rank_folded")
FOLDED_FUSED = dataclasses.replace(FUSED, topk_impl="rank_folded")
# (T, HQ, HKV, D, top_k, selector, block_size, branching, beam, config); beam > top_k in most, so
# the walk keeps more nodes than the leaves do.
RANK_CI_CASES = [
    (1000, 16, 1, 64, 8, "pisa", 64, 2, 12, RANK),
    (300, 6, 2, 64, 8, "pisa", 16, 2, 8, RANK),
    (300, 3, 1, 64, 3, "pisa1", 16, 2, 5, RANK_FUSED),
    (65, 2, 2, 64, 3, "pisa2", 8, 3, 4, RANK),
    (1, 16, 1, 64, 8, "pisa", 64, 2, 9, RANK),
    # The folded rank: g = 2 (pair expansion), g = 3 (the general one), the fused kernel.
    (1000, 16, 1, 64, 8, "pisa", 64, 2, 12, FOLDED),
    (65, 2, 2, 64, 3, "pisa2", 8, 3, 4, FOLDED),
    (300, 3, 1, 64, 3, "pisa1", 16, 2, 5, FOLDED_FUSED),
]


@pytest.mark.parametrize("top_k,beam,impl", [(8, 8, "rank"), (8, 16, "rank_folded"),
                                             (32, 32, "rank_folded"), (8, 64, "passes")])
def test_default_config_picks_topk_by_candidates(top_k, beam, impl):
  # The default takes the rank top-k up to 64 candidate slots (measured faster there on the H200;
  # folded past 16) and the passes above (the rank's [NC, NC] compares would not fit);
  # select_blocks_pallas must pass its NC so that the kernels it launches follow.
  q, k = _inputs(0, 200, 4, 1, 64, jnp.float32, 1)
  kw = dict(block_size=4, top_k=top_k, branching=2, selector="pisa", scale=0.125, beam=beam)
  geo = layout.make_geometry(q, k, **kw)
  default = SelectionConfig.default(seq_len=200, group=4, candidates=geo.num_slots)
  assert default.topk_impl == impl
  # NC = 16 (K = 8, beam 8) takes the fused per-query kernel, wider sets the two-stage walk.
  assert default.variant == ("fused" if geo.num_slots == 16 else "two_stage")
  names = _kernel_names(q, k, None, **kw)
  walk = {n for n in names if n.startswith(("pisa_select_walk", "pisa_select_fused"))}
  kind = "fused" if geo.num_slots == 16 else "walk"
  # g = 2 with "pisa": the walk takes the pair form of Eq. 21 by default, and the fused kernel
  # its unshifted branch.
  assert walk == {f"pisa_select_{kind}_{impl}_pair_lse" + ("_unshifted" if kind == "fused" else "")}
  if geo.num_slots <= 64:
    _check(200, 4, 1, 64, top_k, "pisa", block_size=4, branching=2, beam=beam, config=None)


def _rank_case_id(c):
  t, hq, hkv, d, top_k, sel, bs, g, beam, cfg = c
  return (f"T{t}-HQ{hq}-HKV{hkv}-D{d}-C{bs}-g{g}-K{top_k}-beam{beam}-{sel}-{cfg.variant}"
          f"-{cfg.topk_impl}")


@pytest.mark.parametrize("case", RANK_CI_CASES, ids=_rank_case_id)
def test_rank_topk_matches_reference(case):
  t, hq, hkv, d, top_k, selector, bs, g, beam, cfg = case
  _check(t, hq, hkv, d, top_k, selector, block_size=bs, branching=g, beam=beam, config=cfg)


RANK_SLOW_CASES = [
    (t, hkv * grp, hkv, 64, top_k, sel, 64 if t >= 1000 else 16, 2, beam, cfg)
    for t in (1, 65, 300, 1000)
    for grp, hkv in ((1, 2), (3, 1), (16, 1))
    for top_k in (3, 8)
    for beam in (top_k, top_k + 5)
    for sel in ("pisa", "pisa1", "pisa2")
    for cfg in (RANK, RANK_FUSED)
    if (t + grp + top_k + beam + len(sel)) % 5 == 0  # a fixed, spread-out fifth of the product
]


@pytest.mark.slow
@pytest.mark.parametrize("case", RANK_SLOW_CASES, ids=_rank_case_id)
def test_rank_topk_matrix_slow(case):
  t, hq, hkv, d, top_k, selector, bs, g, beam, cfg = case
  _check(t, hq, hkv, d, top_k, selector, block_size=bs, branching=g, beam=beam, config=cfg)


def _tied_rows(seed, rows, n):
  """Candidate rows with many exact score ties: distinct ids in shuffled slots (-1 holes), small
  integer scores, forced nodes, and rows with few valid candidates (the keep-all rule)."""
  rng = np.random.default_rng(seed)
  cand = np.stack([rng.permutation(4 * n)[:n] for _ in range(rows)]).astype(np.int32)
  n_valid = rng.integers(0, n + 1, size=(rows, 1))
  valid = np.argsort(rng.random((rows, n)), axis=1) < n_valid
  cand = np.where(valid, cand, -1)
  forced = valid & (rng.random((rows, n)) < 0.15)
  score = rng.integers(-2, 3, size=(rows, n)).astype(np.float32)
  return jnp.asarray(cand), jnp.asarray(valid), jnp.asarray(forced), jnp.asarray(score)


@pytest.mark.parametrize("keep", [1, 3, 8])
def test_rank_helpers_equal_the_passes_on_ties(keep):
  # Exact ties are rare with random float scores, so the kernels' tests seldom reach the tie
  # rule; here integer scores make them common, forced nodes may even outnumber `keep` (both
  # implementations then keep the lowest ids), and ids are shuffled over the slots so that ties
  # must go to the lower node id, not to the lower slot.
  n = 16
  cand, valid, forced, score = _tied_rows(keep, 400, n)
  want = jax.jit(topk.top_mask, static_argnums=4)(cand, valid, forced, score, keep)
  got, rank = jax.jit(topk.rank_keep, static_argnums=4)(cand, valid, forced, score, keep)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The valid ranks are a permutation of 0..n_valid-1.
  r, v = np.asarray(rank), np.asarray(valid)
  for row in range(r.shape[0]):
    np.testing.assert_array_equal(np.sort(r[row][v[row]]), np.arange(v[row].sum()))
  np.testing.assert_array_equal(np.asarray(topk.sorted_kept_rank(cand, got, 8)),
                                np.asarray(topk.sorted_kept(cand, want, 8)))
  # Expansion: both place the kept node of rank p (forced first, then score descending, ties to
  # the lower id) in slots p * g .. p * g + g - 1, so the layouts are equal, not only the sets.
  g = 2
  expand_rank = jax.jit(topk.expand_rank, static_argnums=(3, 4))
  keep_expand = jax.jit(topk.keep_and_expand, static_argnums=(4, 5, 6))
  for row in range(40):
    a = np.asarray(expand_rank(cand[row], got[row], rank[row], g, 2 * n))
    b = np.asarray(keep_expand(cand[row], valid[row], forced[row], score[row], keep, g, 2 * n))
    np.testing.assert_array_equal(a, b)
    kept_by_rank = np.asarray(cand[row])[np.argsort(np.where(np.asarray(got[row]), r[row], 99))]
    for p in range(int(np.asarray(got[row]).sum())):
      np.testing.assert_array_equal(a[p * g:(p + 1) * g], kept_by_rank[p] * g + np.arange(g))
    assert np.all(a[int(np.asarray(got[row]).sum()) * g:] == -1)


@pytest.mark.parametrize("n,keep", [(16, 3), (32, 8), (64, 32), (64, 5)])
def test_folded_rank_helpers_equal_the_rank_ones_on_ties(n, keep):
  # "rank_folded" (validity folded into the key, the kept mask into the ids, the g = 2
  # expansion from n / 2 parent slots) against "rank" on rows full of exact ties, forced nodes
  # and keep-all rows: the same kept set, the same sorted output and the same expansion layout.
  cand, valid, forced, score = _tied_rows(n + keep, 300, n)
  want, rank = jax.jit(topk.rank_keep, static_argnums=4)(cand, valid, forced, score, keep)
  for by_column in (False, True):
    got, rank_f = jax.jit(topk.rank_keep_folded, static_argnums=(4, 5))(
        cand, valid, forced, score, keep, by_column)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    v = np.asarray(valid)
    np.testing.assert_array_equal(np.where(v, rank_f, -1), np.where(v, rank, -1))
    width = 1 << (keep - 1).bit_length()
    np.testing.assert_array_equal(
        np.asarray(topk.sorted_kept_folded(cand, got, width, by_column)),
        np.asarray(topk.sorted_kept_rank(cand, want, width, by_column)))
  expand_pairs = jax.jit(topk.expand_pairs, static_argnums=3)
  expand_rank = jax.jit(topk.expand_rank, static_argnums=(3, 4))
  for row in range(60):
    np.testing.assert_array_equal(
        np.asarray(expand_pairs(cand[row], want[row], rank[row], n)),
        np.asarray(expand_rank(cand[row], want[row], rank[row], 2, n)))


def test_rank_and_passes_bit_identical():
  q, k = _inputs(7, 300, 4, 1, 64)
  kw = dict(block_size=16, top_k=4, branching=2, selector="pisa", scale=0.125, beam=6)
  want = np.asarray(_kernel(q, k, config=TWO, **kw))
  for cfg in (RANK, RANK_FUSED, dataclasses.replace(RANK, topk_impl="rank_folded"),
              dataclasses.replace(RANK_FUSED, topk_impl="rank_folded")):
    np.testing.assert_array_equal(np.asarray(_kernel(q, k, config=cfg, **kw)), want)


@pytest.mark.parametrize("t,hq,hkv,variant,dtype,topk_impl", [
    (1000, 8, 2, "fused", jnp.float32, "rank"),
    (300, 3, 1, "two_stage", jnp.float32, "passes"),
    (333, 16, 1, "fused", jnp.bfloat16, "rank"),
])
def test_pair_lse_walk_matches_reference(t, hq, hkv, variant, dtype, topk_impl):
  # Eq. 21 for two children as max + log(1 + exp(-|d|)). T = 1000 and 333 at C = 8 leave the last
  # node of several levels with one child, so the second child's -inf branch runs; such a node is
  # eligible only as the current leaf's ancestor, i.e. forced, so its score is never read here:
  # test_pair_lse_formula pins that branch.
  cfg = dataclasses.replace(TWO, variant=variant, walk_pair_lse=True, topk_impl=topk_impl)
  q, k = _inputs(0, t, hq, hkv, 64, dtype, 1)
  kw = dict(block_size=8, top_k=4, branching=2, selector="pisa", scale=0.125, beam=4)
  assert any(n.endswith("_pair_lse") for n in _kernel_names(q, k, cfg, **kw))
  # Inapplicable (g = 3, or another selector): the general reduction runs.
  assert not any("_pair_lse" in n for n in _kernel_names(q, k, cfg, **{**kw, "branching": 3}))
  assert not any("_pair_lse" in n
                 for n in _kernel_names(q, k, cfg, **{**kw, "selector": "pisa2"}))
  _check(t, hq, hkv, 64, 4, "pisa", block_size=8, config=cfg, dtype=dtype)


@pytest.mark.parametrize("shape", [(16,), (3, 16), (2, 32)])
def test_rank_by_column_equals_by_row(shape):
  # The two layouts of the rank top-k compute the same ranks, kept sets and sorted outputs, ties
  # (equal scores, several forced nodes, fewer valid nodes than keep) included.
  rng = np.random.default_rng(0)
  for _ in range(20):
    cand = jnp.asarray(rng.permutation(100)[:shape[-1]] * np.ones(shape, np.int64), jnp.int32)
    valid = jnp.asarray(rng.random(shape) < 0.8)
    forced = valid & jnp.asarray(rng.random(shape) < 0.15)
    score = jnp.asarray(rng.integers(0, 4, shape).astype(np.float32))  # many exact ties
    keep = int(rng.integers(1, shape[-1]))
    taken_r, rank_r = topk.rank_keep(cand, valid, forced, score, keep)
    taken_c, rank_c = topk.rank_keep(cand, valid, forced, score, keep, by_column=True)
    np.testing.assert_array_equal(np.asarray(taken_r), np.asarray(taken_c))
    np.testing.assert_array_equal(np.where(valid, rank_r, -1), np.where(valid, rank_c, -1))
    np.testing.assert_array_equal(
        np.asarray(topk.sorted_kept_rank(cand, taken_r, 8)),
        np.asarray(topk.sorted_kept_rank(cand, taken_c, 8, by_column=True)))


def test_pair_lse_formula():
  z0 = jax.random.normal(jax.random.PRNGKey(1), (16, 16)) * 30.0
  z1 = jax.random.normal(jax.random.PRNGKey(2), (16, 16)) * 30.0
  m1 = jnp.arange(16) % 3 != 0
  got = scoring.pair_lse(z0, z1, m1, 0.125)
  want = jnp.where(m1[None, :], jnp.logaddexp(0.125 * z0, 0.125 * z1), 0.125 * z0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
  # The unshifted form is the same score in base 2 (logits within its bound here).
  got2 = scoring.pair_lse(z0, z1, m1, 0.125, unshifted=True)
  np.testing.assert_allclose(np.asarray(got2), np.asarray(want) * np.log2(np.e), rtol=2e-6,
                             atol=2e-6)


@pytest.mark.parametrize("selector", ["pisa", "pisa1", "pisa2"])
def test_unshifted_reductions_equal_shifted_in_base_2(selector):
  # `reduce_keys` and `reduce_children` with unshifted=True: Eq. 21 times log2(e) for "pisa"
  # (partial keys masked), the unchanged mean forms otherwise.
  reduce_children, reduce_keys = _common.reduce_children, _common.reduce_keys

  z = jax.random.normal(jax.random.PRNGKey(4), (16, 64)) * 20.0
  m_key = jnp.arange(64) < 37
  unit = np.log2(np.e) if selector == "pisa" else 1.0
  for mask in (None, m_key):
    np.testing.assert_allclose(
        np.asarray(reduce_keys(z, mask, selector, 0.125, unshifted=True)),
        np.asarray(reduce_keys(z, mask, selector, 0.125)) * unit, rtol=2e-6, atol=2e-6)
  zs, masks = [z[:, :16], z[:, 16:32], z[:, 32:48]], [m_key[:16], m_key[16:32], m_key[32:48]]
  np.testing.assert_allclose(
      np.asarray(reduce_children(zs, masks, selector, 0.125, unshifted=True)),
      np.asarray(reduce_children(zs, masks, selector, 0.125)) * unit, rtol=2e-6, atol=2e-6)


def _unshifted_case(key_scale: float, dtype=jnp.float32):
  """Two batch rows: row 0 at ordinary logits, row 1 with keys scaled by key_scale."""
  q, k = _inputs(3, 300, 4, 2, 64, jnp.float32, 2)
  k = k * jnp.asarray([1.0, key_scale])[:, None, None, None]
  kw = dict(block_size=16, top_k=8, branching=2, selector="pisa", scale=0.125, beam=8)
  return q.astype(dtype), k.astype(dtype), kw


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_unshifted_lse_takes_the_shifted_branch_on_large_logits(dtype):
  # The default at K = 8 (NC = 16): the fused kernel computes Eq. 21 without the max shift in
  # each program whose Cauchy-Schwarz bound allows it. Row 1's keys are scaled by 40, so its
  # logits reach far past 2^128 in base 2 and its programs must take the shifted branch; row 0's
  # take the unshifted one. Both must match the reference.
  q, k, kw = _unshifted_case(40.0, dtype)
  cfg = SelectionConfig.default(seq_len=300, group=2, candidates=16)
  assert cfg.fused_unshifted_lse
  assert any(n.endswith("_unshifted") for n in _kernel_names(q, k, cfg, **kw))
  out = _kernel(q, k, config=cfg, **kw)
  q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
  assert_same_or_near_tie(out, select_blocks_reference(q32, k32, **kw), q32, k32, **kw)


def test_unshifted_bound_per_program():
  # The branch each program of the case above takes: row 0 (ordinary logits) unshifted, row 1
  # (keys x 40) shifted, and NaN or inf queries shifted.
  q, k, kw = _unshifted_case(40.0)
  kn2 = jnp.max(jnp.sum(jnp.square(k), axis=-1), axis=1)  # [B, HKV]
  m_head = jnp.arange(16) < 2
  qg = jnp.zeros((16, 64)).at[:2].set(q[0, 100, :2])
  assert bool(scoring.unshifted_ok(qg, m_head, kn2[0, 0], kw["scale"]))
  qg1 = jnp.zeros((16, 64)).at[:2].set(q[1, 100, :2])
  assert not bool(scoring.unshifted_ok(qg1, m_head, kn2[1, 0], kw["scale"]))
  for bad in (jnp.nan, jnp.inf):
    assert not bool(scoring.unshifted_ok(qg.at[1, 3].set(bad), m_head, kn2[0, 0], kw["scale"]))
  # Padded heads do not count, however large.
  assert bool(scoring.unshifted_ok(qg.at[5].set(1e6), m_head, kn2[0, 0], kw["scale"]))


def test_fused_unshifted_lse_bound_is_what_keeps_large_logits_right(monkeypatch):
  # Proof that the test above can fail: with the bound lifted, every program takes the unshifted
  # branch, and row 1's overflowing sums (inf scores, ties broken by index) select other blocks.
  q, k, kw = _unshifted_case(40.0)
  cfg = SelectionConfig.default(seq_len=300, group=2, candidates=16)
  monkeypatch.setattr(scoring, "UNSHIFTED_EXP2", float("inf"))
  out = np.asarray(select_blocks_pallas(q, k, interpret=True, config=cfg, **kw))
  ref = np.asarray(select_blocks_reference(q, k, **kw))
  np.testing.assert_array_equal(out[0], ref[0])  # ordinary logits: unshifted is exact enough
  assert np.any(out[1] != ref[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk_impl="sort"), "topk_impl"),
    (dict(variant="dense"), "variant"),
    (dict(q_tile=3), "q_tile"),
    (dict(topk_rows=0), "topk_rows"),
    (dict(bsa_q_tile=6), "bsa_q_tile"),
    (dict(bsa_block_tile=8), "bsa_block_tile"),
])
def test_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SelectionConfig(**kwargs)


@pytest.mark.parametrize("dtype,d,variant,unshifted", [
    (jnp.bfloat16, 64, "two_stage", False), (jnp.bfloat16, 48, "two_stage", False),
    (jnp.float16, 64, "two_stage", False), (jnp.float16, 64, "fused", False),
    (jnp.float16, 64, "fused", True)])
def test_16bit_scores_in_f32(dtype, d, variant, unshifted):
  # 16-bit inputs take the tensor-core path (exact products, summaries split once into 16-bit
  # high / low rows: float16's narrower exponent included); the reference gets the same values
  # upcast to float32. Both load paths (whole rows at D = 64, clamped and masked columns at
  # D = 48), and the fused kernel's shifted and unshifted Eq. 21.
  _check(300, 8, 2, d, 8, "pisa", block_size=16, dtype=dtype, b=2,
         config=dataclasses.replace(TWO, variant=variant, q_tile=2,
                                    fused_unshifted_lse=unshifted))


def test_split_summary_rows_reconstruct_float32():
  # The "split" layout: row 2r + row 2r + 1 (16-bit high part + rounding of the remainder) is the
  # float32 summary to ~2^-17 relative, and float32 queries keep the float32 rows.
  rows = jax.random.normal(jax.random.PRNGKey(0), (37, 64), jnp.float32) * 3.0
  q16, k16 = _inputs(0, 8, 2, 1, 64, jnp.bfloat16, 1)
  geo = layout.make_geometry(q16, k16, block_size=4, top_k=3, branching=2, selector="pisa",
                             scale=0.125, beam=3)
  split = layout.summary_rows(rows, geo, jnp.bfloat16)
  assert split.shape == (74, 64) and split.dtype == jnp.bfloat16
  back = split[0::2].astype(jnp.float32) + split[1::2].astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(back), np.asarray(rows), rtol=2.0 ** -16, atol=0)
  assert not np.array_equal(np.asarray(split[1::2]), np.zeros((37, 64)))  # a real low part
  q32, k32 = _inputs(0, 8, 2, 1, 64, jnp.float32, 1)
  geo32 = layout.make_geometry(q32, k32, block_size=4, top_k=3, branching=2, selector="pisa",
                               scale=0.125, beam=3)
  assert layout.summary_rows(rows, geo32, jnp.float32) is rows


@pytest.mark.parametrize("d", [64, 48])
def test_split_summary_logits_are_float32_accurate(d):
  # The walk's summary logits from 16-bit queries and split summaries (high and low halves, two
  # gathers and two dots), computed in a kernel, against float32 dots. The low half carries ~2^-9
  # of each summary, which the selection tests rarely notice at CI shapes (dropping it passed
  # them; the H200's 128K check caught it once, 4,792 rows off): this compares the logits
  # themselves (~2^-17 relative when both halves count). D = 48 pads columns.
  from jax.experimental import pallas as pl

  q16, k16 = _inputs(1, 8, 16, 2, d, jnp.bfloat16, 1)
  geo = layout.make_geometry(q16, k16, block_size=4, top_k=3, branching=2, selector="pisa",
                             scale=0.125, beam=3)
  summaries = jax.random.normal(jax.random.PRNGKey(2), (40, d), jnp.float32)
  split = layout.summary_rows(summaries, geo, jnp.bfloat16)
  rows = jnp.asarray([3, 0, 39, 17, 17, 5, 22, 9, 1, 30, 2, 11, 38, 7, 25, 4], jnp.int32)
  m_row = jnp.arange(16) != 5  # one masked row: its logits are zero
  t, i_h = 6, 1

  def kernel(q_ref, s_ref, rows_ref, mask_ref, out_ref):
    qg = layout.load_group_queries(q_ref, geo, 0, t, i_h, geo.group_padded)
    out_ref[...] = scoring.summary_logits(qg, s_ref, rows_ref[...], mask_ref[...] != 0, geo)

  out_shape = jax.ShapeDtypeStruct((geo.group_padded, 16), jnp.float32)
  got = pl.pallas_call(kernel, out_shape=out_shape,
                       interpret=True)(q16.reshape(-1, d), split, rows, m_row.astype(jnp.int32))
  qg = q16[0, t, i_h * geo.group:(i_h + 1) * geo.group].astype(jnp.float32)
  want = jnp.where(m_row[None, :], jnp.dot(qg, summaries[rows].T,
                                           precision=jax.lax.Precision.HIGHEST), 0.0)
  assert got.shape == (16, 16)
  np.testing.assert_allclose(np.asarray(got[:geo.group]), np.asarray(want), rtol=0,
                             atol=2.0 ** -15 * float(jnp.max(jnp.abs(want))))
  np.testing.assert_array_equal(np.asarray(got[geo.group:]), 0.0)  # padded heads


def test_beam_none_equals_beam_top_k_and_wider_beam_matches_reference():
  q, k = _inputs(3, 300, 2, 1, 64)
  kw = dict(block_size=8, top_k=4, branching=2, selector="pisa", implementation="pallas")
  none = pisa_jax.select_blocks(q, k, beam=None, **kw)
  same = pisa_jax.select_blocks(q, k, beam=4, **kw)
  np.testing.assert_array_equal(np.asarray(none), np.asarray(same))
  # A wider beam above the leaves against the reference; it must change some rows,
  # otherwise the beam would not be reaching the kernel.
  wide = pisa_jax.select_blocks(q, k, beam=7, **kw)
  assert np.any(np.asarray(wide) != np.asarray(none))
  ref_kw = dict(block_size=8, top_k=4, branching=2, selector="pisa", scale=0.125, beam=7)
  assert_same_or_near_tie(wide, select_blocks_reference(q, k, **ref_kw), q, k, **ref_kw)


def test_two_runs_bit_identical_and_variants_agree():
  q, k = _inputs(5, 200, 4, 1, 64)
  kw = dict(block_size=16, top_k=4, branching=2, selector="pisa", scale=0.125, beam=4)
  a = _kernel(q, k, config=TWO, **kw)
  b = _kernel(q, k, config=TWO, **kw)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for cfg in (FUSED,):
    np.testing.assert_array_equal(np.asarray(_kernel(q, k, config=cfg, **kw)), np.asarray(a))


@pytest.mark.parametrize("t,hq,hkv,d,top_k,beam,bs,g,dtype,b,q_tile,selector", [
    (300, 4, 2, 64, 8, 8, 8, 2, jnp.float32, 1, 8, "pisa"),  # NC = 16
    (333, 3, 1, 64, 4, 5, 8, 3, jnp.float32, 1, 4, "pisa"),  # g = 3: slot 15 in no group
    (200, 16, 1, 64, 32, 32, 4, 2, jnp.bfloat16, 2, 8, "pisa"),  # K = 32, two batch rows
    (301, 2, 1, 48, 6, 6, 12, 4, jnp.float32, 1, 2, "pisa2"),  # g = 4, C = 12 padded, D = 48
])
def test_sibling_scores_equal_leaf_scores(t, hq, hkv, d, top_k, beam, bs, g, dtype, b, q_tile,
                                          selector):
  # The unpacked two-stage leaf stage holds a kept level-2 node's g children in one tile
  # (`sibling_scores_pallas`), packed rows one leaf a tile (`leaf_scores_pallas`). Both score a
  # needed (query, leaf) pair with the same dot and reduction, so given the same candidates their
  # scores agree bit for bit wherever the final Select_K reads one; the selection runs the
  # sibling tiles and matches the reference.
  from pisa_jax.kernels.selection import two_stage

  q, k = _inputs(t, t, hq, hkv, d, dtype, b)
  kw = dict(block_size=bs, top_k=top_k, branching=g, selector=selector, scale=float(d) ** -0.5,
            beam=beam)
  config = SelectionConfig(variant="two_stage", q_tile=q_tile, topk_rows=1)
  assert {n for n in _kernel_names(q, k, config, **kw) if "_q" in n} == {
      f"pisa_select_sibling_q{q_tile}"}
  geo = layout.make_geometry(q, k, interpret=True, **kw)
  summaries = build_pyramid_pallas(k, block_size=bs, branching=g, interpret=True).summaries
  cand = two_stage.leaf_candidates_pallas(q, k, summaries, geo, interpret=True, config=config)
  t_row = ((jnp.arange(cand.shape[0]) // hkv) % t)[:, None]
  need = np.asarray(topk.leaf_needs_score(cand, t_row, geo)[0]).reshape(-1)
  assert need.any()
  sibling, leaf = (np.asarray(score(q, k, cand, geo, interpret=True, config=config))
                   for score in (two_stage.sibling_scores_pallas, two_stage.leaf_scores_pallas))
  # The last element is the trash slot of masked stores; pairs needing no score are unwritten.
  assert sibling.shape == leaf.shape == (need.size + 1,)
  sibling, leaf = sibling[:-1][need], leaf[:-1][need]
  assert np.isfinite(sibling).all()
  np.testing.assert_array_equal(sibling.view(np.uint32), leaf.view(np.uint32))
  got = _kernel(q, k, config=config, **kw)
  q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
  assert_same_or_near_tie(got, select_blocks_reference(q32, k32, **kw), q32, k32, **kw)


@pytest.mark.parametrize("q_tile", [1, 2, 8])
def test_tile_starts_cut_each_bucket_into_tiles(q_tile):
  # Items sorted by bucket (empty buckets, long and short runs, the unused bucket at the end):
  # each tile starts at the first item of its bucket or q_tile items after the previous tile
  # of that bucket, tiles are numbered densely in bucket order, and the unused tail reads E.
  from pisa_jax.kernels.selection import two_stage

  rng = np.random.default_rng(q_tile)
  num_buckets = 9
  counts = rng.integers(0, 20, size=num_buckets) * (rng.random(num_buckets) < 0.7)
  items = np.repeat(np.arange(num_buckets + 1), list(counts) + [5]).astype(np.int32)
  got = np.asarray(two_stage.tile_starts(jnp.asarray(items), num_buckets, q_tile))
  want = [first + r for first, c in zip(np.cumsum(counts) - counts, counts)
          for r in range(0, c, q_tile)]
  assert got.shape == (-(-len(items) // q_tile) + min(len(items), num_buckets),)
  np.testing.assert_array_equal(got[:len(want)], want)
  np.testing.assert_array_equal(got[len(want):], len(items))


@pytest.mark.parametrize("case,selectors", [
    (2, ("pisa", "bsa")),
    pytest.param(2, ("pisa1", "pisa2"), marks=pytest.mark.slow),
    *[pytest.param(c, None, marks=pytest.mark.slow) for c in (0, 1, 3, 4, 5, 6)]])
def test_golden_cases(case, selectors):
  z = np.load(GOLDEN)
  meta = json.loads(str(z["meta_json"]))[case]
  q, k = z[f"c{case}_q"][None], z[f"c{case}_k"][None]
  for selector in selectors or meta["selectors"]:
    kw = dict(block_size=meta["block_size"], top_k=meta["top_k"], branching=meta["branching"],
              selector=selector, scale=float(meta["D"]) ** -0.5, beam=meta["top_k"])
    out = _kernel(jnp.asarray(q), jnp.asarray(k), config=None, **kw)
    np.testing.assert_array_equal(np.asarray(out)[0], z[f"c{case}_idx_{selector}"],
                                  err_msg=f"golden case {case} {selector}")


# ---------------------------------------------------------------------------------------------
# Pyramid.


@pytest.mark.parametrize("t,hkv,d,block_size,branching,dtype", [
    (1, 2, 64, 64, 2, jnp.float32),
    (65, 1, 128, 64, 2, jnp.float32),
    (1000, 2, 64, 64, 2, jnp.bfloat16),
    (300, 3, 128, 16, 3, jnp.float16),
    pytest.param(333, 1, 8, 8, 4, jnp.float32, marks=pytest.mark.slow),
])
def test_pyramid_matches_reference(t, hkv, d, block_size, branching, dtype):
  k = jax.random.normal(jax.random.PRNGKey(t), (2, t, hkv, d), jnp.float32).astype(dtype)
  got = jax.jit(functools.partial(build_pyramid_pallas, block_size=block_size,
                                  branching=branching, interpret=True))(k)
  want = build_pyramid_reference(k, block_size=block_size, branching=branching)
  assert (got.block_size, got.branching, got.seq_len) == (block_size, branching, t)
  assert len(got.summaries) == len(want.summaries)
  for level, (a, b) in enumerate(zip(got.summaries, want.summaries)):
    assert a.dtype == jnp.float32 and a.shape == b.shape, level
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=PYRAMID_ATOL, rtol=0,
                               err_msg=f"level {level + 1}")
  for a, b in zip(got.counts, want.counts):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_near_tie_proof_detects_a_real_mismatch():
  # The proof must be able to fail: swapping a selected block for a clearly worse one is caught.
  q, k = _inputs(6, 300, 2, 1, 64)
  kw = dict(block_size=16, top_k=4, branching=2, selector="pisa", scale=0.125, beam=4)
  ref = np.asarray(select_blocks_reference(q, k, **kw)).copy()
  t = 299
  row = ref[0, t, 0]
  bad = ref.copy()
  spare = next(x for x in range(19) if x not in row)
  bad[0, t, 0] = np.sort(np.concatenate([row[:1], [spare], row[2:]]))
  if set(bad[0, t, 0]) == set(row):
    pytest.fail("could not build a wrong selection")
  with pytest.raises(AssertionError, match="decision margin"):
    assert_same_or_near_tie(bad, ref, q, k, **kw)
