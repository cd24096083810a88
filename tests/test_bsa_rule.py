"""BSA's normalisation set: each query head's softmax runs over every block complete at t.

fla's NSA, whose default policy the paper's BSA follows, normalises over NC = (t + 1) // C blocks:
the current block joins the normaliser when t is its last position (t % C == C - 1), although it
is never a candidate (it is forced). The inputs here make that decisive. Every key of a block
equals the block's mean, and two query heads see, per block, the logits in LOGITS: head 0 peaks on
block 1 and, far higher, on the current block 16; head 1 peaks on block 2. With K = 4 the one free
slot goes to block 1 or block 2. While block 16 is incomplete both heads normalise over blocks
0..15 and head 0's peak wins block 1; at t = 67, block 16's last position, head 0's normaliser
takes block 16 in and its probabilities shrink ~150-fold, so head 1 wins block 2. The rule that
normalises over blocks 0..cur-1 only keeps block 1 there, by a wide margin.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax.kernels.selection import SelectionConfig, select_blocks_pallas

C, TOP_K, D = 4, 4, 16
NUM_BLOCKS = 18
T = 17 * C + 2  # blocks 0..16 whole, block 17 partial (2 keys): never complete
LOGITS = np.zeros((2, NUM_BLOCKS))
LOGITS[0, 1], LOGITS[0, 16], LOGITS[1, 2] = 5.0, 10.0, 2.0
ROWS = range(16 * C, T)  # the rows whose current block is 16 or 17
DECISIVE = 16 * C + C - 1  # t = 67: the last position of block 16


def _inputs():
  """q `[1, T, 2, D]`: head h is the unit vector e_h at every position; k `[1, T, 1, D]`: every key
  of block b is (LOGITS[0, b], LOGITS[1, b], 0, ...), so at scale 1 head h's logit for block b is
  LOGITS[h, b]."""
  q = np.zeros((1, T, 2, D), np.float32)
  q[0, :, 0, 0] = q[0, :, 1, 1] = 1.0
  block_keys = np.zeros((NUM_BLOCKS, D), np.float32)
  block_keys[:, :2] = LOGITS.T
  k = np.repeat(block_keys, C, axis=0)[:T][None, :, None, :]
  return jnp.asarray(q), jnp.asarray(k)


def _select64(t: int, normalised: int):
  """BSA's selection of row t in float64 when each head's softmax runs over the first `normalised`
  blocks: (kept blocks ascending, relative gap between the best and second-best free block)."""
  cur = t // C
  z = LOGITS[:, :normalised]
  p = np.exp(z - z.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  score = p[:, :cur].sum(axis=0)
  free = sorted(range(1, cur - 1), key=lambda b: (-score[b], b))
  kept = sorted({0, cur - 1, cur, *free[:TOP_K - 3]})
  return kept, (score[free[0]] - score[free[1]]) / score[free[0]]


def _complete(t: int) -> int:
  return (t + 1) // C


def _past(t: int) -> int:
  return t // C


def test_the_rows_tell_the_two_rules_apart_decisively():
  # The rule (every block complete at t) against the wrong one (blocks before the current one):
  # they agree on every row but t = 67, where each decides by a wide margin and they differ.
  # Before it block 1 wins; from it on block 16 is in head 0's normaliser and block 2 wins.
  for t in ROWS:
    kept, gap = _select64(t, _complete(t))
    assert gap > 0.5, (t, gap)
    assert kept[1] == (1 if t < DECISIVE else 2), (t, kept)
    if t != DECISIVE:
      assert _complete(t) == _past(t)
  right, right_gap = _select64(DECISIVE, _complete(DECISIVE))
  wrong, wrong_gap = _select64(DECISIVE, _past(DECISIVE))
  assert DECISIVE % C == C - 1
  assert right == [0, 2, 15, 16] and wrong == [0, 1, 15, 16]
  assert right_gap > 0.5 and wrong_gap > 0.5


def _select(implementation: str, config: SelectionConfig | None):
  q, k = _inputs()
  kw = dict(block_size=C, top_k=TOP_K, branching=2, selector="bsa", scale=1.0)
  if config is None:
    return pisa_jax.select_blocks(q, k, implementation=implementation, **kw)
  # The Pallas kernel with a block tile of 16 leaves: block 16 is then the first of the second
  # tile, which only the normaliser's pass reaches (no query's candidates go past block 15).
  return select_blocks_pallas(q, k, beam=TOP_K, interpret=True, config=config, **kw)


@pytest.mark.parametrize("implementation,config", [
    ("xla", None), ("pallas", None), ("pallas", SelectionConfig(bsa_block_tile=16))],
    ids=["xla", "pallas", "pallas-block-tile-16"])
def test_bsa_normalises_over_every_block_complete_at_t(implementation, config):
  out = np.asarray(_select(implementation, config))[0, :, 0]
  for t in ROWS:
    np.testing.assert_array_equal(out[t], _select64(t, _complete(t))[0], err_msg=f"row t={t}")
  # The wrong normalisation set would have kept block 1 at the decisive row.
  assert list(out[DECISIVE]) != _select64(DECISIVE, _past(DECISIVE))[0]
