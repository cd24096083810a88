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
from pisa_jax.testing import bsa_scores64, rel_gap

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
