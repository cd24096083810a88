"""NSA's range kernels (`pisa_jax.kernels.nsa`) and selection kernel
(`pisa_jax.kernels.nsa_select`) compiled for the GPU, cuDNN's sliding window, and the whole layer,
against the jnp reference on float32-upcast inputs.

CI runs the kernels in the Pallas interpreter (tests/test_nsa.py); here they compile through
Triton, and the window also runs on cuDNN. Outputs land in memory poisoned with NaN first (-1 for
the int32 indices), so an element a kernel never writes fails the finiteness (or, for indices,
the structure) check. The selection's indices equal the reference's except in rows proven to be
near-ties in float64 (`pisa_jax.testing.nsa_mismatch_margins`). Skipped without a CUDA GPU:

  python -m pytest -q -m gpu tests/test_gpu_nsa.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax import nsa, segments
from pisa_jax.testing import nsa_mismatch_margins

import tolerances as tol
from test_gpu_attention import poison
from test_nsa import _assert_selection_structure

pytestmark = pytest.mark.gpu


def _inputs(seq_len, hq, hkv, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (2, seq_len, hq, d), jnp.float32).astype(dtype)
  k, v = (jax.random.normal(key, (2, seq_len, hkv, d), jnp.float32).astype(dtype)
          for key in keys[1:3])
  return q, k, v, jax.random.normal(keys[3], q.shape, jnp.float32).astype(dtype)


def _value_and_grads(fn, q, k, v, do):
  @jax.jit
  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out,) + tuple(vjp(do.astype(out.dtype)))
  poison(4 << 30)
  return run(q, k, v, do)


def _check(got, want, dtype, *, summed_keys=False):
  """Outputs and gradients (out, dq, dk, dv) against the float32 reference's.

  summed_keys: dk and dv of keys that many later queries attend (NSA's compressed keys: the
  first is seen by every query of its document). The kernel rounds p and ds to 16 bits before
  its dots, as every flash kernel does; on such a key the rounding errors of thousands of terms
  add up like a random walk, to about u * sqrt(sum of squared terms) (u = 2^-8 in bfloat16),
  whatever the sum itself is. The terms have random signs (do is independent of q and k), so
  that scale is the key's own RMS over the head dim: each key's absolute tolerance is
  GRAD_ATOL times max(1, that RMS), not the sum's magnitude, which may cancel to near zero.
  (A scale over the whole tensor is not enough: keys that few queries see pull it below that
  of the most-seen keys.) The relative RMS error of the whole tensor stays bounded as the
  reference's own 16-bit rounding is (`tolerances.REFERENCE_LOW_PRECISION_REL_RMS`). The
  float32 cases of the same test check the ranges and masks themselves at GRAD_ATOL."""
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g)), f"{name}: an output the kernel never wrote (NaN)"
    atol = tol.GRAD_ATOL[dtype]
    if summed_keys and name in ("dk", "dv"):
      rel_rms = float(np.sqrt(np.mean((g - w) ** 2) / max(np.mean(w ** 2), 1e-30)))
      assert rel_rms <= tol.REFERENCE_LOW_PRECISION_REL_RMS, f"{name}: {rel_rms=}"
      # [B, N, HKV, 1]: each key's RMS over the head dim.
      atol = atol * np.maximum(1.0, np.sqrt(np.mean(w ** 2, axis=-1, keepdims=True)))
    excess = np.abs(g - w) - (atol + tol.GRAD_RTOL[dtype] * np.abs(w))
    if np.any(excess > 0):
      i = np.unravel_index(np.argmax(excess), g.shape)
      atol_i = np.broadcast_to(atol, g.shape)[i]
      raise AssertionError(
          f"{name}: {int(np.sum(excess > 0))} of {g.size} elements differ beyond "
          f"atol + {tol.GRAD_RTOL[dtype]} |want|; worst at {tuple(map(int, i))}: got {g[i]}, "
          f"want {w[i]}, atol {atol_i:.3g}")


def _upcast(fn):
  return lambda *a: fn(*(x.astype(jnp.float32) for x in a))


@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_window_matches_reference(backend, dtype):
  q, k, v, do = _inputs(1000, 32, 4, 64, dtype)
  kw = dict(window=300, scale=0.125)
  got = _value_and_grads(functools.partial(nsa.sliding_window_attention_pallas, segment_ids=None,
                                           interpret=False, backend=backend, **kw), q, k, v, do)
  want = _value_and_grads(_upcast(functools.partial(nsa.sliding_window_attention_reference,
                                                    segment_ids=None, **kw)), q, k, v, do)
  _check(got, want, dtype)


@pytest.mark.parametrize("hq,hkv,d,dtype", [(32, 2, 64, jnp.bfloat16), (32, 8, 128, jnp.bfloat16),
                                            (6, 2, 48, jnp.float32)])
@pytest.mark.parametrize("packed", [False, True])
def test_compressed_attention_matches_reference(hq, hkv, d, dtype, packed):
  seq_len = 1500
  q, k, v, do = _inputs(seq_len, hq, hkv, d, dtype, seed=1)
  segment_ids = None
  if packed:
    segment_ids = jnp.asarray(np.searchsorted([0, 333, 900], np.arange(seq_len), side="right")
                              [None].repeat(2, 0).astype(np.int32))
  sizes = dict(block_length=32, stride=16)
  k_cmp, v_cmp = (nsa.nsa_compress(x, compression="mlp", segment_ids=segment_ids, mlp=mlp, **sizes)
                  for x, mlp in zip((k, v), (nsa.init_compression_mlp(
                      jax.random.key(i), block_length=32, head_dim=d, dtype=dtype)
                      for i in range(2))))
  kw = dict(segment_ids=segment_ids, scale=d ** -0.5, **sizes)
  got = _value_and_grads(lambda *a: nsa.compressed_attention_pallas(*a, interpret=False, **kw)[0],
                         q, k_cmp, v_cmp, do)
  want = _value_and_grads(_upcast(lambda *a: nsa.compressed_attention_reference(*a, **kw)[0]),
                          q, k_cmp, v_cmp, do)
  _check(got, want, dtype, summed_keys=True)


def _layer_indices(q, k, v, implementation, dtype, **kw):
  """The selection `nsa_attention(implementation=...)` makes, from its public pieces: the kernels
  score the compressed keys in the inputs' dtype (they attend with them), the reference in
  float32."""
  sizes = dict(block_length=kw["block_length"], stride=kw["stride"])
  q = q.astype(dtype)
  k_cmp, v_cmp = (nsa.nsa_compress(x.astype(dtype), None, compression="mean",
                                   implementation="xla", **sizes) for x in (k, v))
  _, lse = nsa.compressed_attention(q, k_cmp, v_cmp, implementation=implementation, **sizes)
  return np.asarray(nsa.nsa_select_blocks(
      q, k_cmp, lse, select_block_size=kw["select_block_size"], top_n=kw["top_n"],
      implementation=implementation, **sizes))


def test_layer_on_the_kernels_matches_the_reference():
  """The whole layer in fla's configuration, bf16, "pallas" against "xla" on the same inputs.

  The kernels score bf16 compressed keys and the reference float32 ones, so a few (query, KV
  head) rows select other blocks (the selection kernel alone is held to the reference on the
  same keys by `test_select_kernel_matches_reference`). The two selections must agree on nearly
  every row, and the outputs to the tolerance on every row where they agree."""
  q, k, v, _ = _inputs(4096, 32, 2, 64, jnp.bfloat16, seed=2)
  gates = jax.nn.sigmoid(jax.random.normal(jax.random.key(3), q.shape[:3] + (3,)))
  kw = dict(compression="mean", block_length=64, stride=64, select_block_size=64, top_n=16,
            window=512)
  outs = [jax.jit(lambda q, k, v: nsa.nsa_attention(q, k, v, gates, implementation=impl, **kw))(
      q, k, v) for impl in ("pallas", "xla")]
  got, want = (np.asarray(o, np.float32) for o in outs)
  assert np.all(np.isfinite(got))
  same = np.all(_layer_indices(q, k, v, "pallas", jnp.bfloat16, **kw)
                == _layer_indices(q, k, v, "xla", jnp.float32, **kw), axis=-1)  # [B, T, HKV]
  assert same.mean() > 0.99, f"{int((~same).sum())} of {same.size} rows select other blocks"
  b, t, hq, d = got.shape
  rows = np.repeat(same, hq // same.shape[-1], axis=-1)  # [B, T, HQ]: a query head's KV head
  close = np.isclose(got, want, atol=tol.OUTPUT_ATOL[jnp.bfloat16],
                     rtol=tol.OUTPUT_RTOL[jnp.bfloat16])
  assert np.all(close[rows]), f"{int((~close[rows]).sum())} of {close[rows].size} elements"


# The selection kernel: (T, HQ, HKV, D, l, d, dtype), l' = 64, n = 16. fla's configuration
# (mean compression, l = d = l' = 64) at 16K d64 and 4K d128, the paper's l = 32, d = 16 (the
# learned compression: the Eq. 9 dot and its halo), float32 with group 3 at d48 and a T that is
# no multiple of the tiles; packed rows (the packed launch: documents of 200 .. 5000 tokens, each
# row its own packing) at 16K in both geometries.
SELECT_CASES = [
    (16384, 32, 2, 64, 64, 64, jnp.bfloat16),
    (4096, 32, 2, 128, 64, 64, jnp.bfloat16),
    (4096, 32, 2, 64, 32, 16, jnp.bfloat16),
    (3000, 6, 2, 48, 32, 16, jnp.float32),
    (16384, 32, 2, 64, 64, 64, jnp.bfloat16, "packed"),
    (16384, 32, 2, 64, 32, 16, jnp.bfloat16, "packed"),
]
# At most this fraction of (query, KV head) rows may differ, each a proven near-tie.
MAX_DIFFERING_ROWS = 1e-3


def _select_case_id(case):
  t, hq, hkv, d, length, stride, dtype, *packed = case
  return "-".join([f"T{t}-HQ{hq}-HKV{hkv}-D{d}-l{length}-d{stride}-{jnp.dtype(dtype).name}",
                   *packed])


def _packed_ids(batch, seq_len, low=200, high=5000, seed=7):
  """int32 `[B, T]` segment ids: documents of low .. high tokens (the last cut by the row's
  end), each row its own draw."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    lengths = []
    while sum(lengths) < seq_len:
      lengths.append(int(rng.integers(low, high + 1)))
    rows.append(np.repeat(np.arange(len(lengths)), lengths)[:seq_len])
  return jnp.asarray(np.stack(rows), jnp.int32)


@pytest.mark.parametrize("case", SELECT_CASES, ids=_select_case_id)
def test_select_kernel_matches_reference(case):
  t, hq, hkv, d, length, stride, dtype, *packed = case
  q, k, _, _ = _inputs(t, hq, hkv, d, dtype, seed=4)
  ids = _packed_ids(q.shape[0], t) if packed else None
  sizes = dict(block_length=length, stride=stride)
  mean = length == stride
  mlp = None if mean else nsa.init_compression_mlp(jax.random.key(5), block_length=length,
                                                     head_dim=d, dtype=dtype)
  k_cmp = nsa.nsa_compress(k, mlp, compression="mean" if mean else "mlp", segment_ids=ids,
                           **sizes)
  _, lse = nsa.compressed_attention_pallas(q, k_cmp, k_cmp, ids, scale=d ** -0.5,
                                           interpret=False, **sizes)
  kw = dict(sizes, select_block_size=64, top_n=16, scale=d ** -0.5)
  select = jax.jit(functools.partial(nsa.nsa_select_blocks_pallas, interpret=False, **kw))
  jax.block_until_ready(select(q, k_cmp, lse, ids))  # compiled before the memory is poisoned
  poison(4 << 30)
  got = np.asarray(select(q, k_cmp, lse, ids))
  want = np.asarray(nsa.nsa_select_blocks_reference(q.astype(jnp.float32),
                                                    k_cmp.astype(jnp.float32), lse, ids, **kw))
  rel = None
  if packed:
    rel = np.arange(t)[None, :] - np.asarray(segments.document_bounds(ids)[0])
  _assert_selection_structure(got, 64, 16, rel)
  differ = np.any(got != want, axis=-1)
  assert differ.mean() <= MAX_DIFFERING_ROWS, f"{int(differ.sum())} of {differ.size} rows differ"
  margins = nsa_mismatch_margins(got, want, q, k_cmp, segment_ids=ids, **kw)
  unproven = [m for m in margins if not m[3] < tol.SELECTION_NEAR_TIE_RTOL]
  assert not unproven, (f"{len(unproven)} of {len(margins)} differing rows are not near-ties "
                        f"(b, t, h, margin): {unproven[:10]}")


def test_layer_gradients_with_learned_compression_match_the_reference():
  """The paper's layer (learned compression, l = 32, d = 16, l' = 64), float32, forward and
  backward on the kernels against the reference: the output and the gradients of q, k, v, the
  gates and both compression MLPs, as RMS errors relative to each array's RMS (a near-tie
  selected otherwise moves a few rows, not the whole)."""
  q, k, v, do = _inputs(2048, 8, 2, 64, jnp.float32, seed=4)
  keys = jax.random.split(jax.random.key(5), 3)
  gates = jax.nn.sigmoid(jax.random.normal(keys[0], q.shape[:3] + (3,)))
  mlps = [nsa.init_compression_mlp(key, block_length=32, head_dim=64, position_std=0.5)
          for key in keys[1:]]
  kw = dict(compression="mlp", block_length=32, stride=16, select_block_size=64, top_n=8,
            window=256)

  def run(implementation):
    def layer(q, k, v, gates, key_mlp, value_mlp):
      return nsa.nsa_attention(q, k, v, gates, key_mlp=key_mlp, value_mlp=value_mlp,
                               implementation=implementation, **kw)

    @jax.jit
    def go(*args):
      out, vjp = jax.vjp(layer, *args)
      return out, vjp(do)
    poison(4 << 30)
    return go(q, k, v, gates, *mlps)

  (got, got_grads), (want, want_grads) = run("pallas"), run("xla")
  names = ["out", "dq", "dk", "dv", "dgates"] + [f"d{side}_mlp.{field}" for side in ("key", "value")
                                                  for field in nsa.CompressionMLP._fields]
  for name, g, w in zip(names, [got, *jax.tree.leaves(got_grads)],
                        [want, *jax.tree.leaves(want_grads)], strict=True):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.all(np.isfinite(g)), f"{name}: not finite"
    # dkey_mlp.b2 is ~0 (one shift of every compressed key leaves each softmax as it is): an
    # absolute floor for what cancels.
    rms, err = float(np.sqrt(np.mean(w ** 2))), float(np.sqrt(np.mean((g - w) ** 2)))
    assert err <= 1e-3 * rms + tol.GRAD_ATOL[jnp.float32], f"{name}: {err=}, {rms=}"
