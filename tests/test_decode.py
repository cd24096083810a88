"""Decoding (`pisa_jax.decode`) against the full-sequence reference, both implementations.

The contract: token t decoded after a prefill of the first P tokens (P = 0: an empty cache)
selects the blocks of row t of `select_blocks` on the whole sequence and outputs row t of
`sparse_attention`, whatever the other rows of the batch hold. Each case decodes a ragged batch
(one row from an empty cache) inside one jitted `lax.scan` (the traced path, one compile per
implementation); the growth test runs eager steps, where the cache grows between buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify

import pisa_jax
from pisa_jax import decode as dec
from pisa_jax.decode import DecodeCache, bucket_capacity, decode_step
from pisa_jax.kernels import decode as kernels

from tolerances import OUTPUT_ATOL, OUTPUT_RTOL, PYRAMID_ATOL, SELECTION_NEAR_TIE_RTOL

IMPLS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Case:
  selector: str
  hq: int
  hkv: int
  d: int
  block_size: int
  top_k: int
  prefill: tuple[int, ...]  # each row's prefill length P_b (one of them 0)
  steps: int
  beam: int | None = None
  branching: int = 2
  dtype: str = "float32"

  @property
  def id(self) -> str:
    beam = f"-beam{self.beam}" if self.beam else ""
    return (f"{self.selector}{beam}-HQ{self.hq}-HKV{self.hkv}-D{self.d}-C{self.block_size}"
            f"-K{self.top_k}-g{self.branching}-P{'_'.join(map(str, self.prefill))}"
            f"-T{self.seq_len}-{self.dtype}")

  @property
  def seq_len(self) -> int:
    return max(self.prefill) + self.steps

  @property
  def step_options(self) -> tuple:
    return (("top_k", self.top_k), ("selector", self.selector), ("beam", self.beam))

  @property
  def selection(self) -> dict:
    return dict(block_size=self.block_size, top_k=self.top_k, branching=self.branching,
                selector=self.selector, beam=self.beam)


# T not a multiple of C, GQA groups 1, 2, 3, 4 and 16, beams None and 2 * top_k, every selector,
# g = 3, C below the 16-row dot (padded), float32 and bfloat16; rows of different lengths, one
# decoded from an empty cache. Enough leaves (up to 36) that the walk scores its levels.
CASES = [
    Case("pisa", 4, 2, 16, 16, 4, prefill=(0, 37), steps=113),
    Case("pisa", 3, 1, 16, 8, 4, prefill=(45, 0), steps=250, beam=8, branching=3),
    Case("pisa1", 2, 2, 16, 8, 3, prefill=(0, 50, 9), steps=190),
    Case("pisa2", 16, 1, 32, 8, 5, prefill=(16, 0), steps=230, beam=10),
    Case("bsa", 8, 2, 64, 16, 5, prefill=(0, 64), steps=150, dtype="bfloat16"),
]


def _qkv(seed, batch, seq_len, hq, hkv, d, dtype):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (batch, seq_len, hq, d), jnp.float32)
  k = jax.random.normal(kk, (batch, seq_len, hkv, d), jnp.float32)
  # A few keys scaled up, as in the selection tests, so that scores are rarely near-ties.
  k = k * jnp.where(jax.random.uniform(kk, (batch, seq_len, hkv, 1)) < 0.05, 3.0, 1.0)
  v = jax.random.normal(kv, (batch, seq_len, hkv, d), jnp.float32)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@functools.lru_cache(maxsize=None)
def _reference(case: Case):
  """The case's inputs and the full-sequence reference: indices and outputs `[B, T, ...]`."""
  dtype = jnp.dtype(case.dtype)
  q, k, v = _qkv(0, len(case.prefill), case.seq_len, case.hq, case.hkv, case.d, dtype)
  idx = pisa_jax.select_blocks(q, k, implementation="xla", **case.selection)
  out = pisa_jax.sparse_attention(q, k, v, idx, block_size=case.block_size, implementation="xla")
  return q, k, v, np.asarray(idx), np.asarray(out.astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("steps", "selection", "implementation"))
def _decode_scan(q, k, v, cache, *, steps, selection, implementation):
  """`steps` decode steps of every row, each feeding the token at the row's own length."""
  rows = jnp.arange(q.shape[0])

  def body(cache, _):
    pos = cache.lengths
    take = lambda x: x[rows, pos][:, None]
    out, cache, idx = decode_step(take(q), take(k), take(v), cache, return_indices=True,
                                  implementation=implementation, **dict(selection))
    return cache, (out[:, 0], idx[:, 0])

  return lax.scan(body, cache, None, length=steps)


def _assert_same_selection(got, ref, q, k, positions, case: Case):
  """Indices equal, except rows that a float64 re-walk proves to be near-ties."""
  bad = np.argwhere(np.any(got != ref, axis=-1))
  if not len(bad):
    return
  from pisa_jax.testing import mismatch_margins  # only needed to explain a mismatch
  beam = case.beam or case.top_k
  scale = case.d ** -0.5
  for b in sorted({int(x) for x in bad[:, 0]}):
    margins = mismatch_margins(
        got[b:b + 1], ref[b:b + 1], q[b:b + 1].astype(jnp.float32),
        k[b:b + 1].astype(jnp.float32), positions=positions[b], block_size=case.block_size,
        top_k=case.top_k, branching=case.branching, selector=case.selector, scale=scale,
        beam=beam)
    for _, t, h, margin in margins:
      assert margin < SELECTION_NEAR_TIE_RTOL, (
          f"row b={b} t={t} h={h}: decode {got[b, t - positions[b][0], h]} != reference "
          f"{ref[b, t - positions[b][0], h]} with decision margin {margin:.3g}")


def _pyramid64(keys: np.ndarray, block_size: int, branching: int) -> list[np.ndarray]:
  """float64 pyramid of keys `[T, HKV, D]` (Eq. 2, 10-15), levels `[M_l, HKV, D]` leaves first."""
  levels = [np.stack([keys[i:i + block_size].mean(0) for i in range(0, len(keys), block_size)])]
  while len(levels[-1]) > 1:
    x = levels[-1]
    levels.append(np.stack([x[i:i + branching].mean(0) for i in range(0, len(x), branching)]))
  return levels


def _assert_pyramid_is_build_pyramid(cache: DecodeCache, k):
  """Every row holds k's first lengths[b] keys and their pyramid (`build_pyramid`'s means, to
  float32 rounding, against float64); the levels above the row's own root hold that root."""
  levels = [np.asarray(level) for level in cache.levels()]
  for b, n in enumerate(np.asarray(cache.lengths)):
    if n == 0:
      continue
    np.testing.assert_array_equal(np.asarray(cache.k[b, :n]), np.asarray(k[b, :n]))
    want = _pyramid64(np.asarray(k[b, :n], np.float64), cache.block_size, cache.branching)
    for level, (got, ref) in enumerate(zip(levels, want)):
      np.testing.assert_allclose(got[b, :len(ref)], ref, rtol=0, atol=PYRAMID_ATOL,
                                 err_msg=f"row {b} level {level + 1}")
    for got in levels[len(want):]:
      np.testing.assert_array_equal(got[b, 0], levels[len(want) - 1][b, 0])


# The reference decode of pisa1 and pisa2 is slow-marked: the walk it shares with pisa runs in CI,
# and their kernels run against the full-sequence reference.
@pytest.mark.parametrize("case,implementation", [
    pytest.param(case, impl, id=f"{case.id}-{impl}",
                 marks=pytest.mark.slow if impl == "xla" and case.selector in ("pisa1", "pisa2")
                 else ())
    for case in CASES for impl in IMPLS])
def test_decode_matches_full_sequence(case, implementation):
  q, k, v, ref_idx, ref_out = _reference(case)
  batch = len(case.prefill)
  lengths = jnp.asarray(case.prefill, jnp.int32)
  cache = DecodeCache.create(batch, case.seq_len, case.hkv, case.d, block_size=case.block_size,
                             branching=case.branching, dtype=k.dtype)
  p = max(case.prefill)
  cache = cache.prefill(k[:, :p], v[:, :p], lengths)
  cache, (out, idx) = _decode_scan(q, k, v, cache, steps=case.steps,
                                   selection=case.step_options,
                                   implementation=implementation)
  out = np.asarray(jnp.moveaxis(out, 0, 1).astype(jnp.float32))  # [B, steps, HQ, D]
  idx = np.asarray(jnp.moveaxis(idx, 0, 1))  # [B, steps, HKV, K]
  positions = [np.arange(pb, pb + case.steps) for pb in case.prefill]
  want_idx = np.stack([ref_idx[b, pos] for b, pos in enumerate(positions)])
  want_out = np.stack([ref_out[b, pos] for b, pos in enumerate(positions)])
  assert idx.dtype == np.int32 and idx.shape == want_idx.shape
  _assert_same_selection(idx, want_idx, q, k, positions, case)
  same = np.all(idx == want_idx, axis=(-2, -1))  # outputs are comparable where the blocks agree
  dtype = jnp.dtype(case.dtype).type
  np.testing.assert_allclose(out[same], want_out[same], atol=OUTPUT_ATOL[dtype],
                             rtol=OUTPUT_RTOL[dtype])
  np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths) + case.steps)
  _assert_pyramid_is_build_pyramid(cache, k)


# ---------------------------------------------------------------------------------------------
# Eager steps, growth, prefill.


@pytest.mark.parametrize("implementation", IMPLS)
def test_eager_steps_grow_the_cache_between_buckets(implementation):
  case = Case("pisa", 4, 2, 16, 16, 4, prefill=(40, 7), steps=40)
  q, k, v, ref_idx, ref_out = _reference(case)
  cache = DecodeCache.create(2, 16, 2, 16, block_size=16, dtype=jnp.float32)
  # The prefill outgrows 16 tokens: the cache takes 40's bucket.
  cache = cache.prefill(k[:, :40], v[:, :40], jnp.asarray(case.prefill, jnp.int32))
  assert cache.capacity == bucket_capacity(40, 16) == 64
  capacities, outs, idxs = [], [], []
  for step in range(case.steps):
    pos = np.asarray(cache.lengths)
    take = lambda x: x[jnp.arange(2), pos][:, None]
    before = cache
    out, cache, idx = decode_step(take(q), take(k), take(v), cache, top_k=4,
                                  implementation=implementation, return_indices=True)
    if step == 0:
      # Donation: the step consumed the cache it was given (its buffers were updated in place),
      # and using it again says so instead of jax's bare "Array has been deleted".
      assert before.k.is_deleted()
      with pytest.raises(ValueError, match=r"decode_step: cache.k was deleted because this "
                                           r"cache was donated.*donate=False"):
        decode_step(take(q), take(k), take(v), before, top_k=4, implementation=implementation)
      with pytest.raises(ValueError, match=r"DecodeCache.grow: cache.k was deleted .*donated"):
        before.grow(1000)
    capacities.append(cache.capacity)
    outs.append(out[:, 0])
    idxs.append(idx[:, 0])
  # Row 0 passes 64 tokens at its 25th step: one growth, by doubling, and never per token.
  assert capacities == [64] * 24 + [128] * 16
  idx = np.asarray(jnp.stack(idxs, 1))
  out = np.asarray(jnp.stack(outs, 1))
  for b, pb in enumerate(case.prefill):
    pos = np.arange(pb, pb + case.steps)
    np.testing.assert_array_equal(idx[b], ref_idx[b, pos])
    np.testing.assert_allclose(out[b], ref_out[b, pos], atol=1e-4, rtol=1e-4)
  _assert_pyramid_is_build_pyramid(cache, k)


def test_prefill_holds_build_pyramid_of_each_row_and_grow_keeps_it():
  _, k, v = _qkv(1, 3, 75, 2, 2, 16, jnp.float32)
  lengths = jnp.asarray([75, 0, 33], jnp.int32)
  cache = DecodeCache.create(3, 80, 2, 16, block_size=8, branching=2, dtype=jnp.float32)
  cache = cache.prefill(k, v, lengths)
  assert cache.capacity == 80 and cache.level_sizes == (10, 5, 3, 2, 1)
  _assert_pyramid_is_build_pyramid(cache, k)
  # Padding positions are zeroed, and a row of length 0 holds nothing.
  assert not np.any(np.asarray(cache.k[2, 33:])) and not np.any(np.asarray(cache.summaries[1]))
  grown = cache.grow(81)
  assert grown.capacity == bucket_capacity(160, 8) == 256
  assert grown.level_sizes == (32, 16, 8, 4, 2, 1)
  _assert_pyramid_is_build_pyramid(grown, k)
  # Growing equals a prefill of the same tokens at the larger capacity.
  direct = DecodeCache.create(3, 256, 2, 16, block_size=8, dtype=jnp.float32).prefill(k, v, lengths)
  np.testing.assert_array_equal(np.asarray(grown.summaries), np.asarray(direct.summaries))
  np.testing.assert_array_equal(np.asarray(grown.v), np.asarray(direct.v))
  assert cache.grow(80) is cache


def test_append_kernel_equals_reference_append():
  # Both implementations of the cache update write the same caches, rows past capacity included
  # (left unchanged), at g = 3 and a block smaller than the 16-row tile.
  _, k, v = _qkv(2, 3, 40, 2, 2, 24, jnp.float32)
  cache = DecodeCache.create(3, 40, 2, 24, block_size=8, branching=3, dtype=jnp.float32)
  cache = cache.prefill(k[:, :39], v[:, :39], jnp.asarray([39, 0, 17], jnp.int32))
  positions = jnp.asarray([39, 0, 40], jnp.int32)  # the last row is past capacity
  new_k, new_v = k[:, 39] * 2.0, v[:, 39] - 1.0
  args = (new_k, new_v, cache.k, cache.v, cache.summaries, positions)
  ref = dec.decode_append_reference(*args, block_size=8, branching=3)
  got = kernels.decode_append_pallas(*args, block_size=8, branching=3, interpret=True)
  for r, g in zip(ref, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=PYRAMID_ATOL)
  np.testing.assert_array_equal(np.asarray(ref[0][2]), np.asarray(cache.k[2]))


def _step_case(seed, hq, branching, selector, top_k, beam):
  """(cache, args, opts) of one step for the step-level kernels: rows of 120, 57 and 0 cached
  tokens (the new token at a leaf's first, a middle and the very first position) and one past
  capacity (dropped)."""
  q, k, v = _qkv(seed, 4, 130, hq, 2, 16, jnp.float32)
  cache = DecodeCache.create(4, 128, 2, 16, block_size=8, branching=branching,
                             dtype=jnp.float32)
  cache = cache.prefill(k[:, :128], v[:, :128], jnp.asarray([120, 57, 0, 128], jnp.int32))
  positions = jnp.asarray([120, 57, 0, 128], jnp.int32)
  args = (q[:, -1], k[:, -1] * 1.5, v[:, -1] - 0.5, cache.k, cache.v, cache.summaries, positions)
  opts = dict(block_size=8, branching=branching, top_k=top_k, beam=beam, selector=selector,
              scale=0.25)
  return cache, args, opts


@pytest.mark.parametrize("selector,hq,branching,top_k,beam", [
    ("pisa", 4, 2, 6, 6), ("pisa1", 6, 2, 5, 8), ("pisa2", 4, 3, 4, 4), ("bsa", 2, 2, 5, 5)])
def test_append_and_select_in_one_launch_equal_the_reference(selector, hq, branching, top_k,
                                                             beam):
  # The step's append run in the walk's program: the same caches and indices as the reference's
  # append then select; the row past capacity is left unchanged and selects no blocks.
  cache, args, opts = _step_case(11, hq, branching, selector, top_k, beam)
  ref = dec.decode_append_select_reference(*args, **opts)
  got = kernels.decode_append_select_pallas(*args, **opts, interpret=True)
  for r, g in zip(ref[:3], got[:3]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=PYRAMID_ATOL)
  np.testing.assert_array_equal(np.asarray(got[3][:3]), np.asarray(ref[3][:3]))
  np.testing.assert_array_equal(np.asarray(got[0][3]), np.asarray(cache.k[3]))


@pytest.mark.parametrize("selector,hq,branching,top_k,beam,attend_blocks", [
    ("pisa", 4, 2, 6, 6, 0), ("pisa", 4, 2, 6, 6, 4), ("pisa1", 6, 2, 5, 8, 2),
    ("pisa2", 4, 3, 4, 4, 0), ("bsa", 2, 2, 5, 5, 0)])
def test_whole_step_kernels_equal_the_reference_step(selector, hq, branching, top_k, beam,
                                                     attend_blocks):
  # The step's launches (Select_K of the leaves inside the attention's programs, which also
  # write the indices and the lengths; the merge kernel) against the reference step; the row
  # past capacity gets -1 indices, a NaN output and lengths + 1. One block per attention
  # program, and 4 or 2, so that a program's last slots select nothing.
  cache, args, opts = _step_case(13, hq, branching, selector, top_k, beam)
  ref = dec.decode_step_reference(*args, **opts)
  got = kernels.decode_step_pallas(*args, **opts, interpret=True,
                                   config=kernels.DecodeConfig(attend_blocks=attend_blocks))
  for r, g in zip(ref[:3], got[:3]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=PYRAMID_ATOL)
  np.testing.assert_array_equal(np.asarray(got[0][3]), np.asarray(cache.k[3]))
  np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(ref[3]))
  assert (np.asarray(got[3][3]) == -1).all() and (np.asarray(got[3][:3, :, 0]) == 0).all()
  out, want = np.asarray(got[4]), np.asarray(ref[4])
  np.testing.assert_allclose(out[:3], want[:3], atol=1e-5, rtol=1e-5)
  assert np.isnan(out[3]).all() and np.isnan(want[3]).all()
  assert got[5].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got[5]), [121, 58, 1, 129])
  np.testing.assert_array_equal(np.asarray(ref[5]), [121, 58, 1, 129])


@pytest.mark.parametrize("selector,hq,branching,top_k,beam", [
    ("pisa", 4, 2, 6, 6), ("pisa1", 6, 2, 5, 8), ("pisa2", 4, 3, 4, 4), ("pisa", 2, 2, 6, 6)])
def test_select_kernel_equals_the_reference_on_rows_of_any_length(selector, hq, branching,
                                                                   top_k, beam):
  # The three launches (walk, leaf scores, Select_K) on rows of 130, 77 and 1 cached tokens (the
  # last needs no score): beams, branching 3, groups of 1 to 3 heads.
  q, k, _ = _qkv(7, 3, 130, hq, 2, 16, jnp.float32)
  cache = DecodeCache.create(3, 130, 2, 16, block_size=8, branching=branching,
                             dtype=jnp.float32)
  cache = cache.prefill(k, k, jnp.asarray([130, 77, 1], jnp.int32))
  select = dict(block_size=8, branching=branching, top_k=top_k, beam=beam, selector=selector,
                scale=0.25)
  args = (q[:, -1], cache.k, cache.summaries, jnp.asarray([129, 76, 0], jnp.int32))
  got = kernels.decode_select_pallas(*args, **select, interpret=True)
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(dec.decode_select_reference(*args, **select)))


@pytest.mark.parametrize("implementation", IMPLS)
def test_jitted_step_past_capacity_poisons_the_row_and_checkify_reports_it(implementation):
  _, k, v = _qkv(3, 2, 16, 2, 1, 16, jnp.float32)
  q = jnp.ones((2, 1, 2, 16), jnp.float32)
  cache = DecodeCache.create(2, 16, 1, 16, block_size=16, dtype=jnp.float32)
  cache = cache.prefill(k, v, jnp.asarray([16, 3], jnp.int32))
  jitted = jax.jit(functools.partial(decode_step, top_k=3, implementation=implementation,
                                     return_indices=True))
  # Unchecked by default: no effect in the step, so a generation loop keeps jit's fast dispatch.
  assert not jitted.trace(q, k[:, :1], v[:, :1], cache).jaxpr.effects
  with pisa_jax.traced_checks(True):
    err, (out, new, idx) = checkify.checkify(jitted)(q, k[:, :1], v[:, :1], cache)
  with pytest.raises(checkify.JaxRuntimeError,
                     match=r"a row of length 16 has no room for another token in "
                           r"cache.capacity=16"):
    err.throw()
  # Unchecked, the full row's token did not fit: NaN and no blocks, its cache untouched; the
  # other row decodes normally.
  assert np.isnan(np.asarray(out[0])).all() and (np.asarray(idx[0]) == -1).all()
  assert np.isfinite(np.asarray(out[1])).all() and (np.asarray(idx[1, 0, 0, :1]) == 0).all()
  np.testing.assert_array_equal(np.asarray(new.k[0]), np.asarray(cache.k[0]))
  np.testing.assert_array_equal(np.asarray(new.summaries[0]), np.asarray(cache.summaries[0]))
  np.testing.assert_array_equal(np.asarray(new.lengths), [17, 4])
  with pytest.raises(ValueError, match=r"rows \[0\] have lengths past cache.capacity=16"):
    new.grow(64)


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError / TypeError naming the argument and what it expected.


def _small_cache(**kw):
  return DecodeCache.create(2, 32, 2, 16, block_size=16, dtype=jnp.float32, **kw)


def _token(hq=4, dtype=jnp.float32, tokens=1, hkv=2, d=16, batch=2):
  return (jnp.zeros((batch, tokens, hq, d), dtype), jnp.zeros((batch, 1, hkv, d), dtype),
          jnp.zeros((batch, 1, hkv, d), dtype))


def test_token_past_capacity_without_growth_is_an_error():
  full = lambda **kw: _small_cache(**kw).prefill(jnp.zeros((2, 32, 2, 16)),
                                                 jnp.zeros((2, 32, 2, 16)))
  with pytest.raises(ValueError, match=r"cache.capacity=32 and grow=False"):
    decode_step(*_token(), full(), grow=False)
  with pytest.raises(ValueError, match=r"growable=False"):
    decode_step(*_token(), full(growable=False))
  with pytest.raises(ValueError, match=r"growable=False"):
    _small_cache(growable=False).prefill(jnp.zeros((2, 33, 2, 16)), jnp.zeros((2, 33, 2, 16)))


@pytest.mark.parametrize("args,error,pattern", [
    (_token(tokens=2), ValueError,
     re.escape("q.shape=(2, 2, 4, 16) must be [B, 1, HQ, D]: decode_step takes one token per row")),
    (_token(hq=3), ValueError, r"HQ a multiple of the cache's num_kv_heads=2"),
    ((_token()[0], jnp.zeros((2, 1, 1, 16)), _token()[2]), ValueError,
     re.escape("k.shape=(2, 1, 1, 16) must be [B, 1, HKV, D] = [2, 1, 2, 16]")),
    ((_token()[0], _token()[1], jnp.zeros((2, 1, 2, 8))), ValueError, r"v.shape=\(2, 1, 2, 8\)"),
    ((_token()[0], _token(dtype=jnp.bfloat16)[1], _token()[2]), TypeError,
     r"k.dtype=bfloat16 must equal the cache dtype float32"),
    ((_token()[0], _token()[1], jnp.zeros((2, 1, 2, 16), jnp.int32)), TypeError, r"v must be a"),
    ((_token(dtype=jnp.bfloat16)[0], _token()[1], _token()[2]), TypeError,
     r"q.dtype=bfloat16 must equal the cache dtype float32"),
])
def test_bad_step_inputs_name_the_argument(args, error, pattern):
  with pytest.raises(error, match=pattern):
    decode_step(*args, _small_cache())


@pytest.mark.parametrize("kw,pattern", [
    (dict(selector="exact"), r"selector='exact' does not decode: expected one of \('pisa'"),
    (dict(selector="nope"), r"selector='nope' is unknown"),
    (dict(top_k=2), r"top_k=2 must be an int >= 3"),
    (dict(selector="bsa", beam=16), r"beam=16 applies only to the hierarchical selectors"),
    (dict(implementation="cuda"), r"implementation='cuda' is unknown"),
])
def test_bad_step_options_name_the_argument(kw, pattern):
  with pytest.raises(ValueError, match=pattern):
    decode_step(*_token(), _small_cache(), **kw)


def test_traced_option_is_a_type_error_naming_it():
  step = jax.jit(decode_step)
  with pytest.raises(TypeError, match=r"top_k is traced: decode_step was called under jax.jit"):
    step(*_token(), _small_cache(), top_k=jnp.int32(8))


def test_bad_cache_arguments_name_the_argument():
  with pytest.raises(ValueError, match=r"capacity=0 must be an int >= 1"):
    DecodeCache.create(1, 0, 2, 16)
  with pytest.raises(TypeError, match=r"must be a floating-point dtype"):
    DecodeCache.create(1, 16, 2, 16, dtype=jnp.int32)
  cache = _small_cache()
  with pytest.raises(TypeError, match=r"k.dtype=bfloat16 must equal the cache dtype float32"):
    cache.prefill(jnp.zeros((2, 4, 2, 16), jnp.bfloat16), jnp.zeros((2, 4, 2, 16), jnp.bfloat16))
  with pytest.raises(ValueError, match=re.escape("k.shape=(2, 4, 3, 16) must be [B, T, HKV, D]")):
    cache.prefill(jnp.zeros((2, 4, 3, 16)), jnp.zeros((2, 4, 3, 16)))
  with pytest.raises(ValueError, match=re.escape("v.shape=(2, 5, 2, 16) must be [B, T, HKV, D] "
                                                 "= [2, 4, 2, 16]")):
    cache.prefill(jnp.zeros((2, 4, 2, 16)), jnp.zeros((2, 5, 2, 16)))
  with pytest.raises(ValueError, match=r"lengths=\[5, 1\] must lie in \[0, T=4\]"):
    cache.prefill(jnp.zeros((2, 4, 2, 16)), jnp.zeros((2, 4, 2, 16)), jnp.asarray([5, 1]))
  with pytest.raises(TypeError, match=r"cache must be a DecodeCache"):
    decode_step(*_token(), {"k": 0})


# ---------------------------------------------------------------------------------------------
# The kernels lower to Triton IR for the H200 (sm_90) on any machine.


@pytest.mark.parametrize("selector,hq,d,top_k,beam,dtype", [
    ("pisa", 32, 128, 32, 32, jnp.bfloat16),  # the benchmark's d = 128, K = 32 (64 slots)
    ("pisa", 32, 64, 8, 8, jnp.bfloat16),  # d = 64, K = 8 (16 slots)
    ("pisa2", 6, 48, 8, 64, jnp.float16),  # beam 64: 128 slots; D not a power of two
    ("pisa1", 4, 64, 8, 8, jnp.float32),
    ("bsa", 32, 128, 32, 32, jnp.bfloat16),
])
def test_decode_kernels_lower_for_sm90(captured, monkeypatch, selector, hq, d, top_k, beam,
                                       dtype):
  b, capacity, hkv = 16, 1 << 20, 2
  q = jax.ShapeDtypeStruct((b, 1, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((b, 1, hkv, d), dtype)
  cache = jax.eval_shape(lambda: DecodeCache.create(b, capacity, hkv, d, dtype=dtype))

  def step(q, k, v, cache):
    spec = pisa_jax.SelectionSpec(block_size=64, top_k=top_k, selector=selector,
                                  beam=beam if selector != "bsa" else None, scale=d ** -0.5)
    return dec._step(q, k, v, cache, None, spec=spec.resolved(d), implementation="pallas")

  # The registry's kernels compile (interpret=False), as they would on the GPU.
  monkeypatch.setattr(pisa_jax._dispatch, "interpret_mode", lambda: False)
  jax.jit(step, donate_argnums=3).trace(q, kv, kv, cache).lower(lowering_platforms=("cuda",))
  names = {re.search(r"module @([A-Za-z0-9_]+)", m).group(1) for m in captured}
  # BSA: append, its one selection kernel, attention; the walk selectors: the append in the
  # walk's launch, the leaf scores, Select_K in the attention's launch; then the merge.
  step_kernels = ({"pisa_decode_append", "pisa_decode_select_bsa", "pisa_decode_attention"}
                  if selector == "bsa" else
                  {f"pisa_decode_select_{selector}_append_walk",
                   f"pisa_decode_select_{selector}_leaves", f"pisa_decode_{selector}_select_attend"})
  assert step_kernels | {"pisa_decode_merge"} == names, names


def test_select_kernels_lower_for_sm90_at_1m_tokens(captured):
  # The selection's three launches at K = 32 (64 candidate slots) over a 1M-token cache.
  b, capacity, hkv, d = 16, 1 << 20, 2, 128
  q = jax.ShapeDtypeStruct((b, 32, d), jnp.bfloat16)
  cache = jax.eval_shape(lambda: DecodeCache.create(b, capacity, hkv, d, dtype=jnp.bfloat16))
  positions = jax.ShapeDtypeStruct((b,), jnp.int32)
  select = functools.partial(
      kernels.decode_select_pallas, block_size=64, branching=2, top_k=32, beam=32,
      selector="pisa", scale=d ** -0.5, interpret=False,
      config=kernels.DecodeConfig(select_warps=4))
  jax.jit(select).trace(q, cache.k, cache.summaries, positions).lower(
      lowering_platforms=("cuda",))
  names = {re.search(r"module @([A-Za-z0-9_]+)", m).group(1) for m in captured}
  assert {"pisa_decode_select_pisa" + m for m in ("_walk", "_leaves", "_final")} <= names, names
