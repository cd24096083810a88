"""Our BSA selector against fla's NSA top-k on the same float32 inputs: the same rule, so the same
blocks, except where two blocks' scores are within rounding of each other.

benchmarks/selection.py times `select_blocks(selector="bsa")` against fla's `parallel_nsa_topk`
after `mean_pooling` as the same computation; this test is what makes that comparison fair. Both
score a complete past block by each head's softmax over the mean-key summaries of the complete
past blocks, summed over the GQA group, and force the first, previous and current blocks. Every
row where the two sets of blocks differ is listed with its margin: the float64 scores of the
blocks only we keep and the blocks only fla keeps, as the relative gap between the lowest of ours
and the highest of fla's. Skipped without a CUDA GPU or without fla (`pip install fla-core
flash-linear-attention`).

Both normalise each head's softmax over the (t + 1) // C blocks complete at t, so at the last
position of a block (t % C == C - 1) the current block is in the normaliser on both sides.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax.testing import bsa_scores64, nsa_mismatch_margins, rel_gap

pytestmark = pytest.mark.gpu

HQ, HKV, D, C, K = 32, 2, 64, 64, 8
# fla's dots take float32 inputs in TF32 (Triton's default, 10 mantissa bits), so its block scores
# carry relative errors far above float32's: on an H200 its choices differed from ours by margins
# up to 3.6e-5 at 4K and 16K away from block ends. Looser than the 1e-4 of
# SELECTION_NEAR_TIE_RTOL that binds our kernels (float32 dots) against the reference.
FLA_NEAR_TIE_RTOL = 1e-3


@pytest.fixture(scope="module")
def fla():
  torch = pytest.importorskip("torch")
  parallel = pytest.importorskip("fla.ops.nsa.parallel")
  pooling = pytest.importorskip("fla.ops.utils.pooling")
  if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device")
  return torch, parallel.parallel_nsa_topk, pooling.mean_pooling


def as_sets(idx: np.ndarray) -> np.ndarray:
  """Each row's valid ids, ascending, -1 padded to K: comparable whatever order a side emits."""
  idx = np.where(idx >= 0, idx, np.iinfo(np.int32).max)
  idx = np.sort(idx, axis=-1)[..., :K]
  return np.where(idx == np.iinfo(np.int32).max, -1, idx).astype(np.int32)


@pytest.mark.parametrize("n", [4096, 16384])
def test_bsa_matches_fla_nsa_topk(fla, n):
  torch, parallel_nsa_topk, mean_pooling = fla
  kq, kk = jax.random.split(jax.random.PRNGKey(3))
  q = jax.random.normal(kq, (1, n, HQ, D), jnp.float32)
  k = jax.random.normal(kk, (1, n, HKV, D), jnp.float32)
  ours = as_sets(np.asarray(pisa_jax.select_blocks(q, k, block_size=C, top_k=K, selector="bsa",
                                                   implementation="pallas")))
  qt, kt = (torch.from_numpy(np.array(x)).cuda() for x in (q, k))
  theirs = parallel_nsa_topk(q=qt, k=mean_pooling(kt, C), lse=None, TK=n, block_counts=K,
                             block_size=C, scale=D ** -0.5)
  theirs = as_sets(theirs.cpu().numpy())
  rows = np.argwhere(np.any(ours != theirs, axis=-1))
  listing, failures, cache = [], [], {}
  for b, t, h in rows:
    b, t, h = int(b), int(t), int(h)
    a, f = set(ours[b, t, h].tolist()) - {-1}, set(theirs[b, t, h].tolist()) - {-1}
    ours_only, fla_only = sorted(a - f), sorted(f - a)
    forced = {0, t // C - 1, t // C}
    scores = bsa_scores64(q, k, b, t, h, block_size=C, scale=D ** -0.5, cache=cache)
    if len(ours_only) != len(fla_only) or forced & set(ours_only + fla_only):
      margin, ok = np.inf, False  # a different count of blocks, or a forced block missing
    else:
      margin = rel_gap(min(scores[c] for c in ours_only), max(scores[c] for c in fla_only))
      ok = margin < FLA_NEAR_TIE_RTOL
    listing.append(f"b={b} t={t} h={h}: ours only {ours_only}, fla only {fla_only}, "
                   f"margin {margin:.3g}")
    if not ok:
      failures.append(listing[-1])
  print(f"N={n}: {len(rows)} of {ours.shape[1] * HKV} rows differ", *listing, sep="\n  ")
  assert not failures, f"{len(failures)} differing rows are not near-ties:\n" + "\n".join(failures)


# ----------------------------------------------------------------------------- fla's NSA
# fla's own NSA (`parallel_nsa`: mean compression, l = d = l' = C) against ours in its
# configuration, float32 inputs. fla takes GQA groups that are powers of two of at least 16.
NSA_TOP_N, NSA_WINDOW = 16, 256


@pytest.fixture(scope="module")
def fla_nsa(fla):
  torch = fla[0]
  parallel = pytest.importorskip("fla.ops.nsa.parallel")
  compression = pytest.importorskip("fla.ops.nsa.compression")
  from benchmarks import _fla
  # fla's window branch on its own kernel: flash-attn, where installed, takes no float32.
  _fla.nsa_window_substitute(force=True)
  return torch, parallel, compression.parallel_nsa_compression, fla[2]


def _nsa_inputs(n: int):
  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(5), 4)
  q = jax.random.normal(kq, (1, n, HQ, D), jnp.float32)
  k = jax.random.normal(kk, (1, n, HKV, D), jnp.float32)
  v = jax.random.normal(kv, (1, n, HKV, D), jnp.float32)
  gates = jax.nn.sigmoid(jax.random.normal(kg, (1, n, HQ, 3), jnp.float32))
  return q, k, v, gates


@pytest.mark.parametrize("n", [4096])
def test_nsa_matches_fla_parallel_nsa(fla_nsa, n):
  """Selection: fla's `parallel_nsa_topk` on the log-sum-exp of its compressed attention against
  our `nsa_select_blocks` on ours, the same blocks but at near-ties (fla's TF32 dots). Output:
  `nsa_attention` against `parallel_nsa` with the same gates, on the rows whose selections
  agree, within TF32's rounding."""
  torch, parallel, parallel_nsa_compression, mean_pooling = fla_nsa
  q, k, v, gates = _nsa_inputs(n)
  scale = D ** -0.5
  opts = dict(block_length=C, stride=C)
  k_cmp, v_cmp = (pisa_jax.nsa_compress(x, compression="mean", **opts) for x in (k, v))
  _, lse = pisa_jax.compressed_attention(q, k_cmp, v_cmp, implementation="pallas", **opts)
  ours = np.asarray(pisa_jax.nsa_select_blocks(q, k_cmp, lse, select_block_size=C,
                                               top_n=NSA_TOP_N, implementation="pallas", **opts))
  qt, kt, vt = (torch.from_numpy(np.array(x)).cuda() for x in (q, k, v))
  gt = [torch.from_numpy(np.array(gates[..., i])).cuda() for i in range(3)]
  kct, vct = mean_pooling(kt, C), mean_pooling(vt, C)
  _, lse_t = parallel_nsa_compression(q=qt, k=kct, v=vct, TK=n, block_size=C, scale=scale)
  theirs = parallel.parallel_nsa_topk(q=qt, k=kct, lse=lse_t, TK=n, block_counts=NSA_TOP_N,
                                      block_size=C, scale=scale).cpu().numpy()

  def sets(idx):
    idx = np.where(idx >= 0, idx, np.iinfo(np.int32).max)
    idx = np.sort(idx, axis=-1)[..., :NSA_TOP_N]
    return np.where(idx == np.iinfo(np.int32).max, -1, idx).astype(np.int32)

  ours, theirs = sets(ours), sets(theirs)
  margins = nsa_mismatch_margins(ours, theirs, q, k_cmp, select_block_size=C, top_n=NSA_TOP_N,
                                 scale=scale, **opts)
  far = [m for m in margins if not m[3] < FLA_NEAR_TIE_RTOL]
  print(f"N={n}: {len(margins)} of {n * HKV} rows select other blocks, {len(far)} beyond ties")
  assert not far, far[:10]

  got = np.asarray(pisa_jax.nsa_attention(q, k, v, gates, compression="mean",
                                          select_block_size=C, top_n=NSA_TOP_N,
                                          window=NSA_WINDOW, implementation="pallas", **opts))
  with torch.no_grad():
    want = parallel.parallel_nsa(qt, kt, vt, *gt, block_counts=NSA_TOP_N, block_size=C,
                                 window_size=NSA_WINDOW, scale=scale).float().cpu().numpy()
  same = np.ones(got.shape[:2], bool)  # [B, T]: positions where every KV head agrees
  for b, t, _, _ in margins:
    same[b, t] = False
  assert same.mean() > 0.9, same.mean()
  np.testing.assert_allclose(got[same], want[same], atol=2e-2, rtol=2e-2)
