"""The float64 BSA oracles against the rule: each head's softmax normalises over every block
complete at t, (t + 1) // C of them, so the current block joins the normaliser at its last
position (t % C == C - 1) while only the blocks before it are scored.

`oracles.select_flat` (the exhaustive loop the reference is tested against) and
`pisa_jax.testing.bsa_scores64` (the near-tie proofs of the kernel tests) are checked on rows where
that rule and the one normalising over the blocks before the current one choose differently, so a
regression to the latter fails here.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import oracles
import pisa_jax
from pisa_jax.testing import bsa_scores64, decision_margin


def _past_only(q, k, *, block_size, top_k, scale):
  """BSA with each head's softmax over the blocks before the current one: the rule this is not.
  Only the rows at a block's last position, where the two rules can differ: {(t, h): kept}."""
  seq_len, hq, _ = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  leaves = oracles.pyramid(k, block_size, 2)[0]
  out = {}
  for t in range(block_size - 1, seq_len, block_size):
    cur = t // block_size
    if cur + 1 <= top_k:
      continue
    for h in range(hkv):
      u = np.zeros(cur)
      for hh in range(h * group, (h + 1) * group):
        z = scale * leaves[:cur, h] @ q[t, hh]
        p = np.exp(z - z.max())
        u += p / p.sum()
      rest = sorted((-u[i], i) for i in range(1, cur - 1))
      out[t, h] = sorted([0, cur - 1, cur] + [i for _, i in rest[:top_k - 3]])
  return out


# A query head that peaks on the current block: at t = 67, the last position of block 16, that
# block enters head 0's normaliser and shrinks its probabilities ~150-fold, so head 1's favourite
# (block 2) beats head 0's (block 1) for the one free slot of K = 4.
C_PEAK, K_PEAK, T_PEAK, DECISIVE = 4, 4, 70, 67


def _peaked_inputs():
  """q `[T, 2, 16]`: head h is the unit vector e_h; k `[T, 1, 16]`: every key of block b is
  (logit of head 0, logit of head 1, 0, ...), so at scale 1 head h's logit for block b is that."""
  logits = np.zeros((2, 18))
  logits[0, 1], logits[0, 16], logits[1, 2] = 5.0, 10.0, 2.0
  q = np.zeros((T_PEAK, 2, 16))
  q[:, 0, 0] = q[:, 1, 1] = 1.0
  keys = np.zeros((18, 16))
  keys[:, :2] = logits.T
  return q, np.repeat(keys, C_PEAK, axis=0)[:T_PEAK, None, :]


def test_select_flat_takes_the_current_block_into_the_normaliser_at_its_last_position():
  q, k = _peaked_inputs()
  kw = dict(block_size=C_PEAK, top_k=K_PEAK, scale=1.0)
  got = oracles.select_flat(q, k, selector="bsa", **kw)[:, 0]
  assert DECISIVE % C_PEAK == C_PEAK - 1
  np.testing.assert_array_equal(got[DECISIVE - 1], [0, 1, 15, 16])
  np.testing.assert_array_equal(got[DECISIVE], [0, 2, 15, 16])
  np.testing.assert_array_equal(got[DECISIVE + 1], [0, 2, 16, 17])
  assert _past_only(q, k, **kw)[DECISIVE, 0] == [0, 1, 15, 16]


def test_bsa_scores64_takes_the_current_block_into_the_normaliser_at_its_last_position():
  q, k = _peaked_inputs()
  qb, kb = q[None], k[None]
  before = bsa_scores64(qb, kb, 0, DECISIVE - 1, 0, block_size=C_PEAK, scale=1.0)
  at = bsa_scores64(qb, kb, 0, DECISIVE, 0, block_size=C_PEAK, scale=1.0)
  assert before.shape == at.shape == (16,)
  assert before[1] > 2 * before[2]  # head 0's peak on block 1 decides before block 16 completes
  assert at[2] > 2 * at[1]  # and no longer once head 0 normalises over block 16 too
  # A decision made by a wide margin either way: no near-tie proof can excuse a wrong choice.
  margin = decision_margin(qb, kb, 0, DECISIVE, 0, block_size=C_PEAK, top_k=K_PEAK, branching=2,
                           selector="bsa", scale=1.0, beam=K_PEAK)
  assert margin > 0.5


# Random inputs where the two rules differ on a few block-end rows (checked below, so the case
# keeps its power if the draw changes). GQA group of 2, T not a multiple of C.
SEED, T_RAND, HQ, HKV, D, C, K, SCALE = 1, 127, 4, 2, 16, 4, 5, 1.0


@pytest.fixture(scope="module")
def random_case():
  rng = np.random.default_rng(SEED)
  q = rng.standard_normal((T_RAND, HQ, D)).astype(np.float32)
  k = rng.standard_normal((T_RAND, HKV, D)).astype(np.float32)
  want = oracles.select_flat(q, k, block_size=C, top_k=K, scale=SCALE, selector="bsa")
  return q, k, want


def test_random_rows_at_block_ends_tell_the_rules_apart(random_case):
  q, k, want = random_case
  other = _past_only(q.astype(np.float64), k.astype(np.float64), block_size=C, top_k=K,
                     scale=SCALE)
  differ = [(t, h) for (t, h), kept in other.items() if list(want[t, h]) != kept]
  assert differ, "the draw no longer separates the two rules; pick another SEED"
  qb, kb = q[None], k[None]
  for t, h in differ:
    assert decision_margin(qb, kb, 0, t, h, block_size=C, top_k=K, branching=2, selector="bsa",
                           scale=SCALE, beam=K) > 1e-3, (t, h)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_select_blocks_matches_the_oracle_on_random_rows(random_case, implementation):
  q, k, want = random_case
  got = pisa_jax.select_blocks(jnp.asarray(q)[None], jnp.asarray(k)[None], block_size=C, top_k=K,
                               selector="bsa", scale=SCALE, implementation=implementation)
  np.testing.assert_array_equal(np.asarray(got)[0], want)
