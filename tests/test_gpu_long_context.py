"""Selection at 2M tokens and attention at 1M tokens x 32 heads x d = 128 on the GPU, where element
offsets pass 2^31 (queries of 2^32 elements, 8 GiB in bf16).

Each kernel runs on every position; the checks sample rows, many of them past the 2^31-element
mark (query t with (t * 32 + head) * D >= 2^31: t >= 2^20 at d = 64, t >= 2^19 at d = 128), and
the last one.

- Selection (Table 4 setting: 32 query / 2 KV heads, d = 64, C = 64, g = 2, bf16) for every
  selector and each kernel form: fused K = 8 (pisa, pisa1, pisa2), two-stage beam 16 and K = 32,
  flat BSA. Sampled rows equal the jnp reference's at those positions on the float32-upcast inputs
  except rows proven near-ties in float64 (`pisa_jax.testing.mismatch_margins`).
- Attention forward and backward with a cotangent that is zero except at sampled query rows: the
  output there, and dq, dk and dv everywhere, then follow from those rows alone, so a float64
  loop over them checks every gradient element (all others must be exactly zero; outputs land in
  NaN-poisoned memory, so an unwritten element fails too).

Skipped without a CUDA GPU. Sized for a few minutes on an H200 (an 8 GiB query array per test,
~4K sampled selection rows, ~250 attention rows), most of it compiling. The whole GPU suite:

  python -m pytest -q -m gpu tests/test_gpu_*.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import _chunking
from pisa_jax.kernels import selection as sel
from pisa_jax.kernels.selection import two_stage
from pisa_jax.selection import _bsa_chunk, select_blocks_reference_at
from pisa_jax.testing import mismatch_margins, random_block_indices

import tolerances as tol

pytestmark = pytest.mark.gpu

HQ, HKV, C, G = 32, 2, 64, 2
SEL_T, SEL_D = 1 << 21, 64
ATT_T, ATT_D, ATT_K = 1 << 20, 128, 8
MAX_MISMATCHED_ROWS = 50  # of the ~4K sampled rows; float32 rounding flips a handful at most


def sampled_positions(n: int, d: int, *, seed: int, ends: int, count: int) -> np.ndarray:
  """The first and last `ends` positions and `count` random ones, half of those past the
  2^31-element mark of `[1, n, 32, d]` queries; ascending, unique."""
  rng = np.random.default_rng(seed)
  mark = min(2**31 // (HQ * d), n - 1)
  late = rng.integers(mark, n, count // 2)
  anywhere = rng.integers(0, n, count - count // 2)
  return np.unique(np.concatenate([np.arange(ends), np.arange(n - ends, n), anywhere, late]))


def poison(nbytes: int) -> None:
  """Fills `nbytes` of free device memory with all-ones bits (NaN in f32, bf16) and frees it, so
  the next outputs land there (tests/test_gpu_attention.py checks the allocator does that)."""
  jax.block_until_ready(jnp.full((nbytes // 4,), 0xFFFFFFFF, jnp.uint32))


# ---------------------------------------------------------------------------------------------
# Selection at 2M tokens.


@pytest.fixture(scope="module")
def selection_inputs():
  kq, kk = jax.random.split(jax.random.PRNGKey(21))
  q = jax.random.normal(kq, (1, SEL_T, HQ, SEL_D), jnp.bfloat16)
  k = jax.random.normal(kk, (1, SEL_T, HKV, SEL_D), jnp.bfloat16)
  pos = sampled_positions(SEL_T, SEL_D, seed=0, ends=1024, count=2048)
  return q, k, pos


def bsa_reference_at(q_at, k, positions, *, top_k: int, scale: float):
  """The reference's BSA rows at `positions`: its per-chunk function over the float32 leaf means
  (the reference has no positions form for "bsa"; its rows depend only on q_t and the leaves)."""
  leaves = pisa_jax.build_pyramid(k, block_size=C, branching=G, implementation="xla").summaries[0]
  fn = functools.partial(_bsa_chunk, spec=pisa_jax.SelectionSpec(
      block_size=C, top_k=top_k, selector="bsa", scale=scale))
  return _chunking.map_query_chunks(fn, 64, (q_at, None, None), (leaves,), positions=positions)


@functools.partial(jax.jit, static_argnames=("selector", "top_k", "beam"))
def kernel_rows(q, k, positions, *, selector, top_k, beam):
  """The Pallas selection over all positions, returned at `positions` only."""
  out = pisa_jax.select_blocks(q, k, block_size=C, top_k=top_k, branching=G, selector=selector,
                               beam=beam, implementation="pallas")
  return out[:, positions]


@pytest.mark.parametrize("selector,top_k,beam", [
    ("pisa", 8, 8),  # fused, the default
    ("pisa", 8, 16),  # two-stage, 32 candidate slots
    ("pisa", 32, 32),  # two-stage, 64 slots
    ("pisa1", 8, 8),
    ("pisa2", 8, 8),
    ("bsa", 8, None),
], ids=lambda x: str(x))
def test_selection_at_two_million_tokens_sampled(selection_inputs, selector, top_k, beam):
  q, k, pos = selection_inputs
  scale = SEL_D ** -0.5
  p = jnp.asarray(pos, jnp.int32)
  out = np.asarray(kernel_rows(q, k, p, selector=selector, top_k=top_k, beam=beam))
  q_at, k32 = q[:, p].astype(jnp.float32), k.astype(jnp.float32)
  if selector == "bsa":
    ref = bsa_reference_at(q_at, k32, p, top_k=top_k, scale=scale)
  else:
    ref = select_blocks_reference_at(q_at, k32, p, block_size=C, top_k=top_k, branching=G,
                                     selector=selector, scale=scale, beam=beam)
  ref = np.asarray(ref)
  cur = (pos // C)[None, :, None]
  valid = out >= 0
  assert (valid.sum(-1) == np.minimum(top_k, cur + 1)).all(), "wrong count of valid blocks"
  assert (np.where(valid, out, -1).max(-1) <= cur).all(), "a block after the query's own"
  bad = int(np.any(out != ref, axis=-1).sum())
  assert bad <= MAX_MISMATCHED_ROWS, f"{bad} sampled rows differ from the reference"
  rows = mismatch_margins(out, ref, q, k, positions=pos, block_size=C, top_k=top_k, branching=G,
                          selector=selector, scale=scale, beam=beam or top_k)
  unproven = [r for r in rows if not r[3] < tol.SELECTION_NEAR_TIE_RTOL]
  assert not unproven, f"{len(unproven)} of {len(rows)} differing rows are not near-ties: " \
                       f"{unproven[:10]}"


def test_two_stage_in_row_ranges_equals_one_launch_compiled(monkeypatch):
  # Past 2^30 (query, candidate) pairs (4M tokens at 8 KV heads, K = 32) the two-stage selection
  # scores row ranges in separate launches; here three ranges at 32K tokens, compiled.
  n, top_k = 1 << 15, 32
  kq, kk = jax.random.split(jax.random.PRNGKey(22))
  q = jax.random.normal(kq, (1, n, HQ, SEL_D), jnp.bfloat16)
  k = jax.random.normal(kk, (1, n, HKV, SEL_D), jnp.bfloat16)
  run = functools.partial(sel.select_blocks_pallas, block_size=C, top_k=top_k, branching=G,
                          selector="pisa", scale=SEL_D ** -0.5, beam=top_k, interpret=False)
  one = np.asarray(jax.jit(run)(q, k))
  slots = sel.candidate_slots(top_k, G)
  monkeypatch.setattr(two_stage, "MAX_PAIRS", 25_000 * slots)
  assert len(two_stage.row_chunks(n * HKV, slots)) == 3
  np.testing.assert_array_equal(np.asarray(jax.jit(run)(q, k)), one)


# ---------------------------------------------------------------------------------------------
# Attention at 1M tokens x 32 heads x d = 128.


@functools.partial(jax.jit, static_argnames=("implementation",))
def value_and_grads(q, k, v, idx, do, *, implementation):
  fn = functools.partial(pisa_jax.sparse_attention, block_size=C, implementation=implementation)
  out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
  return (out,) + tuple(vjp(do))


def attention_rows64(q_rows, k, v, idx_rows, do_rows, positions, *, scale: float):
  """float64 forward and backward of the sampled query rows alone (every other row's cotangent is
  zero, so they add nothing to any gradient).

  q_rows, do_rows `[P, HQ, D]`; idx_rows `[P, HKV, K]`; k, v `[T, HKV, D]` (numpy). Returns o and
  dq `[P, HQ, D]`, the key positions the rows reach `[U]`, and dk, dv there `[U, HKV, D]`.
  """
  group = HQ // HKV
  o, dq = np.zeros(q_rows.shape), np.zeros(q_rows.shape)
  reached, heads, dk_parts, dv_parts = [], [], [], []
  for r, t in enumerate(positions):
    for h in range(HKV):
      blocks = [b for b in idx_rows[r, h] if 0 <= b <= t // C]
      if not blocks:
        continue
      keys = np.concatenate([np.arange(b * C, min(b * C + C, t + 1)) for b in blocks])
      kk, vv = k[keys, h].astype(np.float64), v[keys, h].astype(np.float64)  # [N, D]
      qq = q_rows[r, h * group:(h + 1) * group].astype(np.float64)  # [G, D]
      dd = do_rows[r, h * group:(h + 1) * group].astype(np.float64)
      s = scale * qq @ kk.T  # [G, N]
      p = np.exp(s - s.max(axis=1, keepdims=True))
      p /= p.sum(axis=1, keepdims=True)
      dp = dd @ vv.T
      ds = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
      o[r, h * group:(h + 1) * group] = p @ vv
      dq[r, h * group:(h + 1) * group] = scale * ds @ kk
      reached.append(keys)
      heads.append(np.full(len(keys), h))
      dk_parts.append(scale * ds.T @ qq)  # [N, D]
      dv_parts.append(p.T @ dd)
  reached, heads = np.concatenate(reached), np.concatenate(heads)
  keys, where = np.unique(reached, return_inverse=True)
  dk, dv = np.zeros((len(keys), HKV, ATT_D)), np.zeros((len(keys), HKV, ATT_D))
  np.add.at(dk, (where, heads), np.concatenate(dk_parts))
  np.add.at(dv, (where, heads), np.concatenate(dv_parts))
  return o, dq, keys, dk, dv


def assert_close(got, want, name, atol, rtol):
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol,
                             err_msg=name)


def test_attention_forward_and_backward_at_one_million_tokens_d128():
  keys = jax.random.split(jax.random.PRNGKey(20), 4)
  q = jax.random.normal(keys[0], (1, ATT_T, HQ, ATT_D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (1, ATT_T, HKV, ATT_D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (1, ATT_T, HKV, ATT_D), jnp.bfloat16)
  idx = jnp.asarray(random_block_indices(20, ATT_T, HKV, ATT_K, C, thin_rows=0.05))
  pos = sampled_positions(ATT_T, ATT_D, seed=1, ends=32, count=192)
  p = jnp.asarray(pos, jnp.int32)
  # The cotangent: random at the sampled rows, zero elsewhere.
  do_rows = jax.random.normal(keys[3], (1, len(pos), HQ, ATT_D), jnp.bfloat16)
  do = jnp.zeros_like(q).at[:, p].set(do_rows)
  run = functools.partial(value_and_grads, implementation="pallas")
  jax.block_until_ready(run(q, k, v, idx, do))  # compiled before the memory is poisoned
  poison(4 * q.size * q.dtype.itemsize + (1 << 30))
  o, dq, dk, dv = run(q, k, v, idx, do)

  for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert bool(jnp.isfinite(x).all()), f"{name}: non-finite entries (unwritten?)"
  o64, dq64, reached, dk64, dv64 = attention_rows64(
      np.asarray(q[0, p]), np.asarray(k[0]), np.asarray(v[0]), np.asarray(idx[0, p]),
      np.asarray(do_rows[0]), pos, scale=ATT_D ** -0.5)
  bf16 = jnp.bfloat16
  assert_close(o[0, p], o64, "o", tol.OUTPUT_ATOL[bf16], tol.OUTPUT_RTOL[bf16])
  assert_close(dq[0, p], dq64, "dq", tol.GRAD_ATOL[bf16], tol.GRAD_RTOL[bf16])
  kp = jnp.asarray(reached, jnp.int32)
  assert_close(dk[0, kp], dk64, "dk", tol.GRAD_ATOL[bf16], tol.GRAD_RTOL[bf16])
  assert_close(dv[0, kp], dv64, "dv", tol.GRAD_ATOL[bf16], tol.GRAD_RTOL[bf16])
  # Every other row of dq, and every key the sampled rows do not reach, is exactly zero.
  for name, x, rows in (("dq", dq, p), ("dk", dk, kp), ("dv", dv, kp)):
    nonzero = jnp.any(x[0] != 0, axis=(1, 2)).at[rows].set(False)
    assert not bool(jnp.any(nonzero)), f"{name}: nonzero rows {jnp.nonzero(nonzero)[0][:8]}"
