"""Pallas kernels for block selection (Section 3.3, Algorithm 1, Appendix B): the twin of
`pisa_jax.selection.select_blocks_reference` for "pisa", "pisa1", "pisa2" and "bsa".

Variants (chosen by `SelectionConfig.variant`):
- "two_stage" (Algorithm 1, the paper's Q1/Q2/Q4):
  1. `_walk_kernel`, one program per (query, KV head): loads the group's query heads once and walks
     the pyramid from the root to level 2 (Eq. 16-18). At each level it gathers the candidates'
     child summaries, scores them per head (Eq. 21/33/34), sums over the group (Eq. 22), applies
     the eligibility and forced-node rules and keeps `beam` nodes with an in-kernel top-k
     (`SelectionConfig.topk_impl`: repeated max / lowest-index argmax, or one rank compare).
     Candidates live in registers; only the level-1 candidates `[B*T*HKV, NC]` go back to HBM.
     `walk_q_tile` > 1 walks several consecutive queries per program.
  2. `_leaf_tile_kernel`: the (query, candidate leaf) pairs that need a score are grouped by leaf
     with a stable argsort outside the kernel and cut into tiles of at most `q_tile` queries; each
     program loads one leaf's raw keys once and scores `q_tile` queries x the group's heads with one
     dot (Eq. 21 with l = 1: the exact raw-key LSE).
  3. `_final_topk_kernel`: forced blocks first, then the top_k best scores, ascending, -1 padded.
- "fused" (the paper's per-query variant, and the shape of a decode kernel): `_fused_kernel` walks
  all levels, the leaves included, in one program per (query, KV head). The default at 16
  candidate slots (K = 8): on the H200 it beat the two-stage variant at every N once the walk
  was lean (`SelectionConfig.default`).
Both walks start at the first level with more than `beam` nodes (`_first_scored_level`): the
levels above keep all their eligible nodes. On the GPU, log2 is the MUFU's `lg2.approx` (`_log2`).
BSA (`_bsa_kernel`) is flat: one program per (tile of queries, KV head) makes two passes over the
leaf summaries, the first for each head's online softmax normaliser, the second for the
group-summed probabilities merged into a running top-k, so no `[T, M]` array ever reaches HBM.

Layout: q `[B, T, HQ, D]` and k `[B, T, HKV, D]` are viewed as rows `[B*T*HQ, D]` / `[B*T*HKV, D]`
(free reshapes, native layout) and gathered with clamped, masked 2-D index arrays. Every value in a
kernel has power-of-two shapes: the group's heads are padded to `Gp`, the candidates to `NC`, the
head dim to `Dp` and the block to `Cp`, with masks. Scores are float32 whatever the input dtype:
16-bit inputs are exact in a 16-bit tensor-core dot with float32 accumulation, and the float32
summaries are split once, outside the kernels, into a 16-bit high and low part (two dots, ~2^-17
relative error; `_summary_rows`); float32 inputs use an IEEE float32 dot.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import next_pow2, triton_deprecation_silenced
from pisa_jax.kernels.pyramid import build_pyramid_pallas, leaf_summaries_pallas
from pisa_jax.geometry import level_sizes

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")
VARIANTS = ("two_stage", "fused")
TOPK_IMPLS = ("passes", "rank")
_BIG = 2**30  # larger than any node id; marks an empty slot in the in-kernel top-k
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# The unshifted log-sum-exp (`SelectionConfig.fused_unshifted_lse`) runs where every exponent
# c * z of the program lies in [-_UNSHIFTED_EXP2, _UNSHIFTED_EXP2]: every term 2^(c z) of a sum
# is then a normal float32 (>= 2^-100: none flushes to zero, where a shift by the maximum would
# flush terms below 2^-126 of it), and a sum of up to 2^27 terms stays below float32's 2^128, so
# the shift is not needed for range; each exponential's relative rounding is the same either
# way. (Trained models' |q| |k| can exceed the bound: their programs take the shifted branch.)
_UNSHIFTED_EXP2 = 100.0
# Triton's tensor-core dots need every dimension >= 16.
_MIN_DOT = 16


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
  """Variant and tile sizes of the selection kernels.

  Attributes:
    variant: "two_stage" (walk kernel, leaf-tile kernel, final top-k) or "fused" (per query, all
      levels in one kernel; the default at 16 candidate slots). Ignored by "bsa".
    q_tile: queries per leaf-tile program of the two-stage variant (a power of two; 1, 2, 4 are
      the paper's Q1/Q2/Q4): one leaf's keys are loaded once for up to q_tile queries x the
      group's heads.
    leaf_window: 0, or queries per window of the leaf-tile grouping: pairs are grouped by
      (window, leaf) instead of leaf, each window's pairs sorted on their own (a batched sort of
      leaf_window * NC keys per row instead of one argsort of all pairs), and the programs of one
      window run together, so its query rows are re-read from L2 rather than HBM (at the price of
      shorter tiles).
    topk_rows: (query, KV head) rows per program of the final top-k kernel. With
      topk_impl="rank" it holds `[topk_rows, NC, NC]` compares: keep topk_rows * NC^2 <= 2048 on
      2 warps (ptxas, sm_90a: 8 rows at NC = 16 take 96 registers; 32 rows, or 8 at NC = 32, spill).
    bsa_q_tile: queries per BSA program.
    bsa_block_tile: leaf summaries per BSA loop step.
    walk_warps: Triton warps of the walk and fused kernels (their values are tiny, `[16, NC]`:
      fewer warps mean cheaper cross-warp reductions in the in-kernel top-k).
    leaf_warps: Triton warps of the leaf-tile and BSA kernels (dots of 64+ rows).
    topk_warps: Triton warps of the final top-k kernel.
    num_stages: Triton software-pipelining stages.
    topk_impl: the in-kernel Select_K of the walk, the fused kernel and the final top-k.
      "passes": `keep` dependent passes of max / lowest-index argmax / mask, then one min pass per
      kept node to compact and order them. "rank": one broadcast compare `[..., N, N]` and one
      row-sum give every candidate its rank in (score descending, node id ascending); kept nodes
      are those ranked below `keep`, and a kept node's slot is its rank (children at
      rank * g + r) or, at the leaves, its rank by node id. Same result, O(1) dependent reductions
      instead of O(keep).
    walk_q_tile: queries of one KV head per walk program (two-stage variant): their walks run in
      one loop over the levels as independent instruction streams, which the scheduler can
      interleave, and the program overhead is shared. 1 is one query per program.
    walk_dense_nodes: 0, or a power of two >= 16: the upper levels with at most this many nodes
      are walked densely (two-stage variant) by `_walk_top_kernel`: one program per tile of
      `walk_dense_q_tile` queries scores every node of such a level with one shared load of the
      level's summaries and dots of walk_dense_q_tile * Gp rows, and masks the scores to each
      query's candidates; the per-query gathered walk then continues below. Same result.
    walk_dense_q_tile: queries per dense-walk program (a power of two).
    walk_dense_warps: Triton warps of the dense-walk kernel.
    walk_online_lse: the gathered walk ("pisa") folds each child's logits into a running
      log-sum-exp instead of keeping all g children's logits (same scores up to rounding, fewer
      registers, so more programs per SM for this latency-bound kernel; untimed, hence off).
    walk_pair_lse: at g = 2 with the "pisa" selector, the walk scores a candidate from its two
      children's logits as max + log(1 + exp(-|z0 - z1|)) (Eq. 21 for a pair: one exponential and
      one logarithm per head instead of two and one, no running-max bookkeeping): 669 -> 587 SASS
      instructions per level of the fused kernel, 94 registers instead of 91 (offline, session
      5); 5.31 -> 5.07 ms at 128K, 11.47 -> 10.85 at 256K (H200, session 6): on by default. Other
      branchings and selectors, and the dense upper levels of `walk_dense_nodes`, use the
      general reduction (`_reduce_children`); the scores agree up to float32 rounding.
    leaf_wide_loads: the leaf-tile kernel loads its query and key rows as whole contiguous rows
      (128-bit loads; D a power of two) instead of element by element with a column clamp: 15%
      fewer instructions, 18 more registers (95 -> 113 at d = 64, one program per SM less).
    fused_compact_leaves: the fused kernel's leaf loop runs only over the candidates that need a
      score (not forced, eligible), numbered in slot order, instead of over all NC slots with the
      others' loads masked off: about 12.5 of 16 iterations at K = 8 away from the start.
    fused_leaf_unroll: 1 or 2 (needs fused_compact_leaves): leaves scored per iteration of that
      loop, as independent instruction chains (more work in flight per warp for this
      latency-bound loop, at the price of registers).
    fused_unshifted_lse: the fused kernel ("pisa" selector) computes Eq. 21 as log2 of a plain
      sum of 2^(c z), without subtracting the maximum first, in every program whose logits are
      bounded: c * max_h |q_h| * max_t |k_t| <= 100 by Cauchy-Schwarz (the summaries are means of
      keys, so the bound covers them too), with max_t |k_t| per (batch, KV head) from one
      reduction over the keys outside the kernel. Such a program takes the unshifted branch of
      one `lax.cond`; any other (large logits, inf or NaN) takes the shifted one. Scores come out
      in base 2 (log2 e times Eq. 21), which orders the candidates the same. Like the other
      fused_* fields, ignored by the two-stage variant. Offline SASS (K = 8, d = 64): 328 -> 285
      instructions per scored leaf (no row maximum, no shift), 587 -> 561 per walk level;
      registers 94 -> 100 offline, 108 -> 126 on the H200 (ncu), still 16 one-warp programs per
      SM there.
  """

  variant: str = "two_stage"
  q_tile: int = 4
  leaf_window: int = 0
  topk_rows: int = 32
  bsa_q_tile: int = 4
  bsa_block_tile: int = 64
  walk_warps: int = 2
  leaf_warps: int = 4
  topk_warps: int = 2
  num_stages: int = 2
  topk_impl: str = "passes"
  walk_q_tile: int = 1
  walk_dense_nodes: int = 0
  walk_dense_q_tile: int = 4
  walk_dense_warps: int = 4
  walk_online_lse: bool = False
  walk_pair_lse: bool = False
  leaf_wide_loads: bool = True
  fused_compact_leaves: bool = True
  fused_leaf_unroll: int = 1
  fused_unshifted_lse: bool = False

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
    if self.topk_impl not in TOPK_IMPLS:
      raise ValueError(f"topk_impl={self.topk_impl!r} must be one of {TOPK_IMPLS}")
    if self.walk_q_tile != 1 and self.variant != "two_stage":
      raise ValueError(f"walk_q_tile={self.walk_q_tile} must be 1 unless variant='two_stage' "
                       f"(the fused kernel walks one query per program), got {self.variant=}")
    if self.walk_dense_nodes and (self.walk_dense_nodes < _MIN_DOT
                                  or self.walk_dense_nodes & (self.walk_dense_nodes - 1)):
      raise ValueError(f"walk_dense_nodes={self.walk_dense_nodes} must be 0 (off) or a power of "
                       f"two >= {_MIN_DOT}")
    if self.walk_dense_nodes and self.variant != "two_stage":
      raise ValueError(f"walk_dense_nodes={self.walk_dense_nodes} must be 0 unless "
                       f"variant='two_stage' (the fused kernel walks from the root), got "
                       f"{self.variant=}")
    for name in ("q_tile", "topk_rows", "bsa_q_tile", "bsa_block_tile", "walk_q_tile",
                 "walk_dense_q_tile"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")
    if self.fused_leaf_unroll not in (1, 2):
      raise ValueError(f"fused_leaf_unroll={self.fused_leaf_unroll} must be 1 or 2")
    if self.fused_leaf_unroll != 1 and not self.fused_compact_leaves:
      raise ValueError(f"fused_leaf_unroll={self.fused_leaf_unroll} needs fused_compact_leaves=True "
                       "(it unrolls the compacted leaf loop)")
    if self.walk_pair_lse and self.walk_online_lse:
      raise ValueError("walk_pair_lse=True and walk_online_lse=True are two ways to reduce the "
                       "children's logits: choose one")
    if self.leaf_window < 0:
      raise ValueError(f"leaf_window={self.leaf_window} must be >= 0 (0: no windows)")
    if self.bsa_block_tile < _MIN_DOT:
      raise ValueError(f"bsa_block_tile={self.bsa_block_tile} must be >= {_MIN_DOT} (dot size)")

  @classmethod
  def default(cls, *, seq_len: int, group: int, candidates: int = _MIN_DOT) -> "SelectionConfig":
    """Heuristic default: at NC = 16 candidate slots (beam * g <= 16, the paper's K = 8) the
    per-query fused variant, else the two-stage variant with Q8 key-tile reuse; BSA tiles of about
    64 query rows (bsa_q_tile * padded group) per program; the in-kernel top-k by the number of
    candidate slots per level, `candidates` = NC = next power of two >= max(beam * g, 16).

    Measured on the H200 (2026-11-29/30, Table 4 setting unless named; ms):
    - Session 7, the fused kernel's unshifted Eq. 21 branch (`fused_unshifted_lse`, hence on at
      NC = 16) against the shifted one in the same run: 4.71 / 9.96 against 4.86 / 10.31 at 128K
      / 256K; two leaves per iteration with it 5.52 / 11.53.
    - Session 6, the rank top-k summed by column, 16K / 128K / 256K: fused 0.572 / 5.31 / 11.47,
      with `walk_pair_lse` 0.559 / 5.07 / 10.85 (hence on; it applies where g = 2 and "pisa").
    - Session 5, after the compacted leaf loop and the walk's shifts, 16K / 128K / 1M: fused
      0.606 / 5.57 / 56.8, two-stage Q4 0.826 / 6.85 / 60.6, Q8 0.866 / 7.15 / 63.0; the fused
      kernel with one pipelining stage 0.807 / 7.62 / 73.9, with three 0.758 / 7.29 (16K /
      128K), with two leaves per iteration 0.692 / 6.29.
    - Session 3, after the leaner walk levels and the rank top-k at NC = 16, whole selection at
      16K / 128K / 1M: fused 0.753 / 6.84 / 64.4, two-stage Q4 0.869 / 7.37 / 64.8, Q8 0.916 /
      7.70 / 67.4 (the fused kernel scores its 16 candidate leaves right after its walk, with the
      queries in registers: no pair sort, no scatter, no second pass over the queries). Wider
      candidate sets (K = 32, beams) keep the two-stage variant: the fused kernel would score
      NC leaves one after another per query, and that is not measured. Measured at GQA group 16
      only: a small group pads its heads to 16 rows in the fused kernel's leaf dots, where the
      two-stage leaf tiles pack several queries' heads into one dot (unmeasured trade-off).
    - Leaf tiles, whole selection at 32K / 128K: Q4 3.96 / 16.9, Q8 3.39 / 14.8, Q16 3.64 / 15.7
      (its 256-row tiles cost registers).
    - Walk warps: one warp took Q4 from 5.80 to 3.99 ms at 32K and from 26.1 to 17.1 ms at 128K
      (4 warps: 9.3 and 43.1 ms): at NC = 16 the values are tiny and the top-k reduction-bound.
    - Top-k, walk kernel alone: NC = 16 (K = 8): passes 7.8 ms, rank 9.5 (128K, session 2);
      after session 3's leaner levels (pre-split summaries, one MUFU log2, no scoring above the
      first level with more than beam nodes) pyramid + walk is 4.38 ms with the passes and 2.94
      with the rank: the passes' 2 * keep dependent reductions per level became the critical
      path. NC = 32 (K = 8, beam 16, 128K): passes 26.4, rank 19.0; NC = 64 (K = 32, d = 128,
      64K): passes 48.7 (2 warps 50.5), rank on 1 warp 109 (its [64, 64] compares spill), rank
      on 4 warps 40.8. The rank final top-k takes 8 rows per program at NC = 16 (96 registers on
      2 warps, no spills) and one row at NC = 32 / 64.
    Wider candidate sets (NC >= 128) keep the passes: the rank compares would not fit.
    """
    del seq_len
    gp = next_pow2(group)
    base = dict(variant="two_stage", q_tile=8, bsa_q_tile=max(1, min(16, 64 // gp)),
                walk_warps=1, topk_impl="rank", topk_rows=8, topk_warps=2, walk_pair_lse=True)
    if candidates == 16:
      base.update(variant="fused", fused_unshifted_lse=True)
    elif candidates == 32:
      base.update(topk_rows=1)
    elif candidates == 64:
      base.update(topk_rows=1, walk_warps=4)
    elif candidates >= 128:
      base.update(topk_impl="passes", topk_rows=32, topk_warps=1)
    return cls(**base)


def _pow2_at_least(n: int, floor: int) -> int:
  return max(floor, next_pow2(n))


def candidate_slots(beam: int, branching: int) -> int:
  """NC, the candidate slots per level below the root: up to beam * branching children, padded
  to a power of two >= 16 (the value `SelectionConfig.default` takes as `candidates`)."""
  return _pow2_at_least(beam * branching, _MIN_DOT)


def _qk(a, b, mode: str):
  """a @ b.T in float32: a `[R, Dp]`, b `[N, Dp]` -> `[R, N]`.

  mode "f32": float32 operands at IEEE precision; "native": both in the same 16-bit dtype (the
  products are exact, the accumulation float32). (Float32 summaries against 16-bit queries:
  `_summary_logits`.)
  """
  dims = (((1,), (1,)), ((), ()))
  if mode == "f32":
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                           precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                           preferred_element_type=jnp.float32)
  if mode != "native":
    raise ValueError(f"{mode=} must be 'f32' or 'native'")
  return lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)


def _summary_logits(a, s_ref, rows, m_row, geo: "_Geometry"):
  """a @ summaries[rows].T in float32, `[R, N]`: a `[R, Dp]`, rows / m_row `[N]`.

  With 16-bit queries (score_mode "split") the summaries ref holds every float32 summary row r as
  two 16-bit rows, its high part at 2r and the rounding of the remainder at 2r + 1, split once
  outside the kernel by `_summary_rows` (the walk loads each summary several times, so splitting
  after every load cost instructions). Otherwise it holds the float32 rows.
  """
  if geo.score_mode == "split":
    # Relative error ~2^-17: the products are exact, the accumulation float32.
    return (_qk(a, _load_rows(s_ref, 2 * rows, m_row, geo), "native")
            + _qk(a, _load_rows(s_ref, 2 * rows + 1, m_row, geo), "native"))
  return _qk(a, _load_rows(s_ref, rows, m_row, geo), geo.score_mode)


def _pair_lse(z0, z1, m1, scale: float, approx_log: bool = False, unshifted: bool = False):
  """Eq. 21 for a candidate with two children, `[Gp, N]` -> `[Gp, N]` per-head scores.

  z0, z1: unscaled dot products with the first and second child; m1 `[N]`: the second child
  exists. LSE(s * z0, s * z1) = s * max + ln(1 + e^(s * (min - max))), in base 2 with
  c = s * log2(e). The first child exists whenever the candidate is valid; for an invalid
  candidate (its loads masked to zero) the score is finite and unused, since every consumer
  masks candidates by validity.
  unshifted: log2(2^(c z0) + 2^(c z1)), Eq. 21 in base 2 (log2 e times the natural score), for
  programs whose exponents are bounded (`SelectionConfig.fused_unshifted_lse`).
  """
  if unshifted:
    return _unshifted_lse([z0, z1], [None, m1], scale, approx_log)
  c = scale * _LOG2E
  z1 = jnp.where(m1[None, :], z1, -jnp.inf)
  hi, lo = jnp.maximum(z0, z1), jnp.minimum(z0, z1)
  # lo = -inf (no second child): exp2(-inf) = 0 and the score is s * z0.
  return hi * scale + _log2(1.0 + jnp.exp2((lo - hi) * c), approx_log) * _LN2


def _unshifted_lse(zs, masks, scale: float, approx_log: bool = False):
  """Eq. 21 in base 2 without the max shift: log2(sum_j 2^(c z_j)) over the children's `[Gp, N]`
  unscaled logits zs, each masked by its `[N]` mask (None: always present). Only for programs
  whose exponents are bounded (`_UNSHIFTED_EXP2`, `SelectionConfig.fused_unshifted_lse`)."""
  c = scale * _LOG2E
  terms = [jnp.exp2(z * c) if m is None else jnp.where(m[None, :], jnp.exp2(z * c), 0.0)
           for z, m in zip(zs, masks)]
  return _log2(functools.reduce(jnp.add, terms), approx_log)


def _log2(x, approx: bool):
  """log2 of non-negative float32 values (0 -> -inf).

  approx: the MUFU's `lg2.approx` (one instruction, absolute error ~2^-22 over the full range
  per the PTX ISA: on the shifted sums of exponentials, >= 1, and on the unshifted ones, in
  [2^-100, 2^107], alike; .ftz flushes only subnormal inputs, which neither gives it) instead of
  libdevice's `log2f`, a 25-instruction
  polynomial that was a sixth of the walk kernel's instructions (SASS of the K = 8 walk). GPU only:
  the interpreter has no inline assembly, so interpret mode (CI) takes `jnp.log2`.
  """
  if not approx:
    return jnp.log2(x)
  [y] = plt.elementwise_inline_asm("lg2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f",
                                   pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape,
                                                                                     x.dtype)])
  return y


def _reduce_children(zs, masks, selector: str, scale: float, approx_log: bool = False,
                     unshifted: bool = False):
  """Per-head score of each candidate from its children's logits (natural units; base 2 with
  `unshifted`).

  zs: list over children of `[Gp, N]` unscaled dot products q . s (the logits are scale * zs);
  masks: list of `[N]` child-exists masks. Eq. 21 ("pisa"): log-sum-exp; Eq. 33 ("pisa1"): mean;
  Eq. 34 ("pisa2"): mean + population variance / 2. unshifted ("pisa"): as in `_pair_lse`, in
  base 2.
  """
  if selector == "pisa" and unshifted:
    return _unshifted_lse(zs, masks, scale, approx_log)
  if selector == "pisa":
    # LSE(scale * z) = scale * m + ln 2 * log2(sum 2^(c * z - c * m)) with c = scale * log2(e)
    # (scale > 0, so the max commutes with it): one fused multiply-add per exponential instead of
    # a multiply by scale, a subtraction and a multiply by log2(e).
    c = scale * _LOG2E
    m = functools.reduce(jnp.maximum, [jnp.where(v[None, :], z, -jnp.inf) for z, v in zip(zs, masks)])
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    mc = m_safe * c
    total = sum(jnp.where(v[None, :], jnp.exp2(z * c - mc), 0.0) for z, v in zip(zs, masks))
    return m_safe * scale + _log2(total, approx_log) * _LN2
  zs = [z * scale for z in zs]
  count = jnp.maximum(sum(v.astype(jnp.float32) for v in masks), 1.0)[None, :]
  mean = sum(jnp.where(v[None, :], z, 0.0) for z, v in zip(zs, masks)) / count
  if selector == "pisa1":
    return mean
  var = sum(jnp.where(v[None, :], jnp.square(z - mean), 0.0) for z, v in zip(zs, masks)) / count
  return mean + 0.5 * var


def _reduce_keys(z, m_key, selector: str, scale: float, approx_log: bool = False,
                unshifted: bool = False):
  """Per-row score over one leaf's raw keys: z `[R, Cp]` unscaled dot products q . k, m_key
  `[Cp]` valid keys or None (every column is a key: the block is a power of two >= 16 and only
  complete past leaves are scored) -> `[R]`. unshifted ("pisa"): as in `_pair_lse`, in base 2:
  no row maximum and no shift."""
  if selector == "pisa" and unshifted:
    e = jnp.exp2(z * (scale * _LOG2E))
    if m_key is not None:
      e = jnp.where(m_key[None, :], e, 0.0)
    return _log2(jnp.sum(e, axis=1), approx_log)
  if selector == "pisa":
    # Eq. 21 at the leaves: the exact raw-key LSE, as in `_reduce_children` (one fused
    # multiply-add per exponential; no per-element mask when every column is a key).
    c = scale * _LOG2E
    if m_key is not None:
      z = jnp.where(m_key[None, :], z, -jnp.inf)
    m = jnp.max(z, axis=1)
    m_safe = m if m_key is None else jnp.where(m == -jnp.inf, 0.0, m)
    total = jnp.sum(jnp.exp2(z * c - (m_safe * c)[:, None]), axis=1)
    return m_safe * scale + _log2(total, approx_log) * _LN2
  z = z * scale
  if m_key is None:
    m_key = jnp.full((z.shape[1],), True)
  count = jnp.maximum(jnp.sum(m_key.astype(jnp.float32)), 1.0)
  mean = jnp.sum(jnp.where(m_key[None, :], z, 0.0), axis=1) / count
  if selector == "pisa1":
    return mean
  var = jnp.sum(jnp.where(m_key[None, :], jnp.square(z - mean[:, None]), 0.0), axis=1) / count
  return mean + 0.5 * var


def _ancestors(cur, leaves_per_node, shift=None):
  """The ancestors (nodes of `leaves_per_node` leaves) of the current leaf and of the previous
  one (-1 when cur = 0). With `shift` = log2(leaves_per_node) (g a power of two) a shift: a
  division by a runtime value is ~20 SASS instructions."""
  prev = jnp.maximum(cur - 1, 0)
  if shift is not None:
    anc_cur, anc_prev = cur >> shift, prev >> shift
  else:
    anc_cur, anc_prev = cur // leaves_per_node, prev // leaves_per_node
  return anc_cur, jnp.where(cur >= 1, anc_prev, -1)


def _forced(cand, cur, leaves_per_node, shift=None):
  """Ancestors (nodes of `leaves_per_node` leaves) of the first, previous and current leaves
  (Appendix B)."""
  anc_cur, anc_prev = _ancestors(cur, leaves_per_node, shift)
  return (cand == 0) | (cand == anc_prev) | (cand == anc_cur)


def _top_mask(cand, valid, forced, score, keep: int):
  """Select_K of Eq. 17 with the forced-node rule: which candidates are kept, `[..., N]` bool.

  If at most `keep` candidates are valid all are kept; otherwise forced ones first, then the highest
  scores, ties to the lower node id. Repeated max / lowest-index argmax (no sort in kernels).
  Reductions run over the last axis, so this works on `[N]` and `[rows, N]`.
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  key = jnp.where(forced | keep_all, jnp.inf, score)

  # A loop, not an unrolled Python loop: Triton compile time grows with the unrolled code.
  def pick_one(_, taken):
    avail = valid & ~taken
    k_avail = jnp.where(avail, key, -jnp.inf)
    best = jnp.max(k_avail, axis=-1, keepdims=True)
    pick = jnp.min(jnp.where(avail & (k_avail == best), cand, _BIG), axis=-1, keepdims=True)
    return taken | (avail & (cand == pick))

  return lax.fori_loop(0, keep, pick_one, jnp.zeros(cand.shape, jnp.bool_))


def _sorted_kept(cand, taken, width: int):
  """The kept node ids ascending, -1 padded: `[..., N]` -> `[..., width]`."""
  out = jnp.full(cand.shape[:-1] + (width,), -1, jnp.int32)
  slot = lax.broadcasted_iota(jnp.int32, out.shape, out.ndim - 1)

  def next_smallest(r, carry):
    out, prev = carry
    nxt = jnp.min(jnp.where(taken & (cand > prev), cand, _BIG), axis=-1, keepdims=True)
    out = jnp.where((slot == r) & (nxt < _BIG), nxt, out)
    return out, jnp.where(nxt < _BIG, nxt, prev)

  prev = jnp.full(cand.shape[:-1] + (1,), -1, jnp.int32)
  return lax.fori_loop(0, width, next_smallest, (out, prev))[0]


def _keep_and_expand(cand, valid, forced, score, keep: int, branching: int, width: int):
  """Select_K of Eq. 17 (as `_top_mask`) fused with the Eq. 18 expansion: `[N]` -> `[width]`.

  The node picked by pass p fills slots p * g .. p * g + g - 1 with its children as it is picked,
  so no separate compaction loop runs (one max and one min reduction per kept node). The slot
  order (by rank) does not matter: the next level's Select_K is order-free and the leaves are
  sorted at the end.
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  key = jnp.where(forced | keep_all, jnp.inf, score)
  slot = jnp.arange(width)
  o_parent, o_child = slot // branching, slot % branching

  def pick_one(p, carry):
    taken, out = carry
    avail = valid & ~taken
    k_avail = jnp.where(avail, key, -jnp.inf)
    best = jnp.max(k_avail, axis=-1, keepdims=True)
    pick = jnp.min(jnp.where(avail & (k_avail == best), cand, _BIG), axis=-1, keepdims=True)
    out = jnp.where((o_parent == p) & (pick < _BIG), pick * branching + o_child, out)
    return taken | (avail & (cand == pick)), out

  init = (jnp.zeros(cand.shape, jnp.bool_), jnp.full((width,), -1, jnp.int32))
  return lax.fori_loop(0, min(keep, width // branching), pick_one, init)[1]


def _pair_axes(by_column: bool):
  """How an all-pairs compare over the last axis `[..., N]` lays out candidate i (whose count is
  wanted) and candidate j (counted): (expand as i, expand as j, the axis to sum j over). By row,
  i is the row of the `[..., N, N]` compare; by column, i is the column."""
  rows, cols = (lambda x: x[..., :, None]), (lambda x: x[..., None, :])
  return (cols, rows, -2) if by_column else (rows, cols, -1)


def _rank_keep(cand, valid, forced, score, keep: int, by_column: bool = False):
  """Select_K of Eq. 17 with the forced-node rule, by rank: `[..., N]` -> (kept, rank).

  The same set as `_top_mask`: the order is score descending (forced nodes, and every node when at
  most `keep` are valid, count as +inf) with ties to the lower node id, a strict total order on the
  valid candidates (their ids are distinct). rank_i = #{valid j before i in that order}, from one
  broadcast compare `[..., N, N]` and one sum, so the valid ranks are 0..n_valid-1 and the kept
  nodes are those ranked below `keep`.

  by_column: candidate i is the compare's column and the sum runs down the rows (axis -2), so the
  rank comes out in the layout of a row vector `[..., None, :]`, the one `_expand_rank` broadcasts
  it in; summed along the rows instead, Triton converts it between the two layouts. Same ranks.
  Offline (session 5, K = 8, d = 64): the fused kernel's walk level 896 -> 669 SASS
  instructions, its registers 126 -> 91 (16 -> 20 programs per SM); the beam-16 walk 168 -> 134
  registers, the K = 32 walk 152 -> 144.
  """
  keep_all = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) <= keep
  key = jnp.where(forced | keep_all, jnp.inf, score)
  as_i, as_j, over_j = _pair_axes(by_column)
  k_i, k_j, c_i, c_j = as_i(key), as_j(key), as_i(cand), as_j(cand)
  before = as_j(valid) & ((k_j > k_i) | ((k_j == k_i) & (c_j < c_i)))
  rank = jnp.sum(before.astype(jnp.int32), axis=over_j)
  return valid & (rank < keep), rank


def _sorted_kept_rank(cand, taken, width: int, by_column: bool = False):
  """`_sorted_kept` in one pass: a kept node's output slot is its rank by node id among the kept
  (ids are distinct), read back with a one-hot max. `[..., N]` -> `[..., width]`, -1 padded.
  by_column: as in `_rank_keep`, the position comes out in the layout it is read back in."""
  as_i, as_j, over_j = _pair_axes(by_column)
  before = as_j(taken) & (as_j(cand) < as_i(cand))
  pos = jnp.sum(before.astype(jnp.int32), axis=over_j)
  slot = lax.broadcasted_iota(jnp.int32, cand.shape[:-1] + (width, 1), cand.ndim - 1)
  hit = taken[..., None, :] & (pos[..., None, :] == slot)
  return jnp.max(jnp.where(hit, cand[..., None, :], -1), axis=-1)


def _expand_rank(cand, taken, rank, branching: int, width: int):
  """Eq. 18 by rank: kept node of rank p fills slots p * g .. p * g + g - 1 with its children, so
  no compaction loop runs. `[N]` -> `[width]` candidate ids (-1 empty)."""
  slot = jnp.arange(width)
  o_parent, o_child = slot // branching, slot % branching
  hit = taken[None, :] & (rank[None, :] == o_parent[:, None])
  return jnp.max(jnp.where(hit, cand[None, :] * branching + o_child[:, None], -1), axis=1)


def _select_and_expand(cand, valid, forced, score, geo: "_Geometry", topk_impl: str):
  """One level's Select_K (keep = beam) and Eq. 18 expansion to `[NC]` child candidates."""
  if topk_impl == "rank":
    taken, rank = _rank_keep(cand, valid, forced, score, geo.beam, by_column=True)
    return _expand_rank(cand, taken, rank, geo.branching, geo.nc)
  return _keep_and_expand(cand, valid, forced, score, geo.beam, geo.branching, geo.nc)


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """Static shapes shared by the kernels."""

  batch: int
  seq_len: int
  hq: int
  hkv: int
  d: int
  block_size: int
  top_k: int
  beam: int
  branching: int
  selector: str
  scale: float
  sizes: tuple[int, ...]
  score_mode: str  # dot mode for summaries: "f32" or "split"
  key_mode: str  # dot mode for raw keys: "f32" or "native"
  approx_log: bool = False  # `_log2` by the MUFU (compiled for the GPU; not in the interpreter)

  @property
  def group(self) -> int:
    return self.hq // self.hkv

  @property
  def gp(self) -> int:
    return _pow2_at_least(self.group, _MIN_DOT)

  @property
  def dp(self) -> int:
    return _pow2_at_least(self.d, _MIN_DOT)

  @property
  def cp(self) -> int:
    return _pow2_at_least(self.block_size, _MIN_DOT)

  @property
  def nc(self) -> int:
    """Candidate slots per level below the root: up to beam * branching children."""
    return candidate_slots(self.beam, self.branching)

  @property
  def kp(self) -> int:
    return next_pow2(self.top_k)

  @property
  def num_blocks(self) -> int:
    return self.sizes[0]


def _query_tile_program(geo: _Geometry, q_tile: int):
  """(batch, KV head, tile index) of this program in a grid over (batch, KV head, tile of q_tile
  consecutive queries), the layout of the walk, dense-walk and BSA kernels."""
  n_tiles = pl.cdiv(geo.seq_len, q_tile)
  i_p = pl.program_id(0)
  i_bh, i_tile = i_p // n_tiles, i_p % n_tiles
  return i_bh // geo.hkv, i_bh % geo.hkv, i_tile


def _load_group_queries(q_ref, geo: _Geometry, i_b, t, i_h, rows: int):
  """The group's query heads of query t: `[rows, Dp]` (padded heads and columns read as zero)."""
  o_head = jnp.arange(rows)
  q_rows = (i_b * geo.seq_len + t) * geo.hq + i_h * geo.group + jnp.minimum(o_head, geo.group - 1)
  return _load_rows(q_ref, q_rows, o_head < geo.group, geo)


def _load_rows(ref, rows, m_row, geo: _Geometry, wide: bool = True):
  """Rows `[N]` of a `[*, D]` ref as `[N, Dp]`, masked rows and padded columns zero.

  wide: when D is already a power of two, load rows without a column clamp or mask (vector loads;
  more registers for the leaf tiles: `SelectionConfig.leaf_wide_loads`)."""
  o_col = jnp.arange(geo.dp)
  if wide and geo.d == geo.dp:
    # No column clamp or column mask: Triton then sees each row as dp contiguous, aligned
    # elements and issues 128-bit loads (with the clamp it issued one scalar load, address and
    # predicate per element: a third of the walk's instructions).
    return plt.load(ref.at[rows[:, None], o_col[None, :]], mask=m_row[:, None], other=0.0)
  return plt.load(ref.at[rows[:, None], jnp.minimum(o_col, geo.d - 1)[None, :]],
                  mask=m_row[:, None] & (o_col < geo.d)[None, :], other=0.0)


def _level_offsets(geo: _Geometry, sizes=None) -> list[int]:
  """First row of each level (`sizes`, default the pyramid's) in the stacked summaries."""
  offsets, acc = [], 0
  for m in (geo.sizes if sizes is None else sizes):
    offsets.append(acc)
    acc += geo.batch * m * geo.hkv
  return offsets


def _level_table(geo: _Geometry):
  """int32 `[3, LP]`: per level l (index l - 1) its node count, its first row in the stacked
  summaries `[sum_l B*M_l*HKV, D]` of levels 1..L-1, and its leaves per node g^(l-1)."""
  lp = next_pow2(len(geo.sizes) + 1)
  sizes = list(geo.sizes) + [1] * (lp - len(geo.sizes))
  offsets = _level_offsets(geo, sizes)
  pows = [geo.branching ** i for i in range(lp)]
  return jnp.asarray([sizes, offsets, pows], jnp.int32)


def _load_table(tab_ref, geo: _Geometry):
  lp = tab_ref.shape[1]
  o = jnp.arange(lp)
  return tuple(plt.load(tab_ref.at[jnp.full((lp,), r, jnp.int32), o]) for r in range(3))


def _pick(vec, idx):
  """vec[idx] for a value (no dynamic indexing of values in Triton kernels)."""
  return jnp.sum(jnp.where(jnp.arange(vec.shape[0]) == idx, vec, 0))


def _first_scored_level(geo: _Geometry) -> int:
  """The highest level (>= 2) with more than `beam` nodes, or 1 when even level 2 has at most beam.

  Every level above it has at most beam nodes, so Select_K keeps each of its eligible nodes without
  looking at a score (Eq. 17's "keep all" case), and an ineligible node's children are ineligible
  too. The walk can therefore start at this level with all of its nodes as candidates (there are
  at most g * beam <= NC of them) and skip scoring the levels above: 3 of the 10 walked levels at
  128K with K = 8, 3 of 8 at 32K.
  """
  for level in range(len(geo.sizes) - 1, 1, -1):
    if geo.sizes[level - 1] > geo.beam:
      return level
  return 1


def _walk_to_leaves(qgs, m_head, i_b, ts, i_h, s_ref, tab_ref, geo: _Geometry, topk_impl: str,
                    init=None, first_level: int | None = None, online_lse: bool = False,
                    pair_lse: bool = False, unshifted: bool = False):
  """Stage 1 (Algorithm 1, lines 5-14): root -> level 2 for queries of one KV head.

  qgs: the queries' group heads, each `[Gp, Dp]`; ts: their positions (scalars). The levels are a
  loop (sizes and offsets read from `tab_ref`), so the kernel's code does not grow with the number
  of levels; the queries' walks share that loop as independent instruction streams. With `init`
  (each query's candidates `[NC]` at level `first_level`, from `_walk_top_kernel`) the walk starts
  there instead of at the root's children. Returns the level-1 candidates of each query, `[NC]`
  (leaf ids, -1 where empty or not eligible). unshifted: Eq. 21 without the max shift, in base
  2 (`SelectionConfig.fused_unshifted_lse`; not with online_lse).
  """
  sizes, g, nc = geo.sizes, geo.branching, geo.nc
  num_levels = len(sizes)
  slot = jnp.arange(nc)
  if num_levels == 1:
    return tuple(jnp.where(slot == 0, 0, -1) for _ in ts)
  tab_size, tab_off, tab_pow = _load_table(tab_ref, geo)
  g_pow2 = g & (g - 1) == 0

  def one_query_level(qg, t, cand, leaves_per_node, shift, n_child, off_child):
    # A node is eligible (its first key at or before t) iff it is at or before the current leaf's
    # ancestor, which also keeps it below the level's node count (ceil sizes).
    cur = t // geo.block_size
    anc_cur, _ = _ancestors(cur, leaves_per_node, shift)
    valid = (cand >= 0) & (cand <= anc_cur)
    forced = valid & _forced(cand, cur, leaves_per_node, shift)
    def child_logits(j):
      """[Gp, NC] logits of every head against child j of every candidate, and its mask."""
      child = jnp.where(valid, cand, 0) * g + j
      m_child = valid & (child < n_child)
      rows = off_child + (i_b * n_child + jnp.minimum(child, n_child - 1)) * geo.hkv + i_h
      return _summary_logits(qg, s_ref, rows, m_child, geo), m_child

    if online_lse and geo.selector == "pisa":
      # Eq. 21 as an online log-sum-exp over the children: one child's logits live at a time
      # (fewer registers: 122 -> 106 at K = 8 on 1 warp, 218 -> 176 for the rank walk at NC = 32).
      m = jnp.full((geo.gp, nc), -jnp.inf, jnp.float32)
      acc = jnp.zeros((geo.gp, nc), jnp.float32)
      for j in range(g):
        z, m_child = child_logits(j)
        z = jnp.where(m_child[None, :], z * (geo.scale * _LOG2E), -jnp.inf)
        m_new = jnp.maximum(m, z)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        acc = acc * jnp.exp2(m - m_safe) + jnp.exp2(z - m_safe)
        m = m_new
      per_head = (jnp.where(m == -jnp.inf, 0.0, m) + _log2(acc, geo.approx_log)) * _LN2
    elif pair_lse:  # callers pass it only where `_uses_pair_lse` (g = 2, "pisa")
      (z0, _), (z1, m1) = child_logits(0), child_logits(1)
      per_head = _pair_lse(z0, z1, m1, geo.scale, geo.approx_log, unshifted)
    else:
      zs, masks = zip(*(child_logits(j) for j in range(g)))
      per_head = _reduce_children(list(zs), list(masks), geo.selector, geo.scale, geo.approx_log,
                                  unshifted)
    # Eq. 22: the group's heads share one selection, scored by their sum.
    score = jnp.sum(jnp.where(m_head[:, None], per_head, 0.0), axis=0)
    return _select_and_expand(cand, valid, forced, score, geo, topk_impl)

  def one_level(i, cands):
    level = num_levels - 1 - i  # L-1 down to 2
    off_child = _pick(tab_off, level - 2)
    if g_pow2:
      # Scalar arithmetic instead of table picks (each a masked reduction over the table):
      # M_l = ceil(M_1 / g^(l-1)), nested ceilings being one ceiling.
      log2g = g.bit_length() - 1
      leaves_per_node, shift = None, (level - 1) * log2g
      s_child = (level - 2) * log2g
      n_child = (sizes[0] + (1 << s_child) - 1) >> s_child
    else:
      leaves_per_node, shift = _pick(tab_pow, level - 1), None
      n_child = _pick(tab_size, level - 2)
    return tuple(one_query_level(qg, t, cand, leaves_per_node, shift, n_child, off_child)
                 for qg, t, cand in zip(qgs, ts, cands))

  if init is None:
    # Every node of the first scored level is a candidate (the levels above keep all their
    # eligible nodes); the per-level eligibility mask drops the ones after t.
    first_level = _first_scored_level(geo)
    init = tuple(jnp.where(slot < sizes[first_level - 1], slot, -1) for _ in ts)
  start = num_levels - 1 - first_level
  cands = tuple(init)
  if start < num_levels - 2:
    cands = lax.fori_loop(start, num_levels - 2, one_level, cands)
  return tuple(jnp.where((cand >= 0) & (cand < sizes[0]) & (cand * geo.block_size <= t), cand, -1)
               for t, cand in zip(ts, cands))


def _dense_stop_level(geo: _Geometry, dense_nodes: int) -> int:
  """The lowest level >= 2 such that it and every level above it below the root has at most
  `dense_nodes` nodes; L (the root's level: nothing dense) when level L-1 already has more."""
  num_levels = len(geo.sizes)
  stop = num_levels
  for level in range(num_levels - 1, 1, -1):
    if geo.sizes[level - 1] > dense_nodes:
      break
    stop = level
  return stop


def _walk_top_kernel(q_ref, s_ref, cand_ref, *, geo: _Geometry, q_tile: int, stop_level: int):
  """Stage 1, upper levels densely: levels L-1 .. stop_level for q_tile queries of one KV head.

  At a level of n <= walk_dense_nodes nodes every node is scored (Eq. 21/33/34 from its children's
  summaries, loaded once for the tile) against all q_tile * Gp query rows with one dot per child,
  summed per query over the group (Eq. 22), then masked to the query's candidates (the children of
  its kept nodes one level up, Eq. 18) and reduced by the same Select_K as the gathered walk
  (Eq. 17, forced nodes and eligibility included). Levels are unrolled: their sizes are static and
  there are at most log2(walk_dense_nodes) + 1 of them. Writes each query's candidates at level
  stop_level - 1, `[NC]` (leaf ids with the leaves' eligibility applied when stop_level == 2).
  """
  g, nc = geo.branching, geo.nc
  # Head rows per query: the group padded to a power of two, and rows_n >= 16 for the dots.
  gp = max(next_pow2(geo.group), _MIN_DOT // q_tile)
  i_b, i_h, i_tile = _query_tile_program(geo, q_tile)
  rows_n = q_tile * gp
  o_r = jnp.arange(rows_n)
  e_r, j_r = o_r // gp, o_r % gp
  o_e = jnp.arange(q_tile)
  t_e = i_tile * q_tile + o_e
  t_ec = jnp.minimum(t_e, geo.seq_len - 1)  # queries past T walk as T - 1 and are not stored
  t_r = jnp.minimum(i_tile * q_tile + e_r, geo.seq_len - 1)
  m_head_r = j_r < geo.group
  q_rows = ((i_b * geo.seq_len + t_r) * geo.hq + i_h * geo.group
            + jnp.minimum(j_r, geo.group - 1))
  b_q = _load_rows(q_ref, q_rows, m_head_r, geo)  # [R, Dp]
  cur_e = (t_ec // geo.block_size)[:, None]  # [QT, 1]
  offsets = _level_offsets(geo)
  kept, kept_ids = None, None
  # The levels above the first scored one keep all their eligible nodes: start below them.
  for level in range(_first_scored_level(geo), stop_level - 1, -1):
    n, n_child = geo.sizes[level - 1], geo.sizes[level - 2]
    npad = _pow2_at_least(n, _MIN_DOT)
    leaves_per_node = g ** (level - 1)
    ids = jnp.arange(npad)
    zs, masks = [], []
    for j in range(g):
      child = ids * g + j
      m_child = (ids < n) & (child < n_child)
      rows = offsets[level - 2] + (i_b * n_child + jnp.minimum(child, n_child - 1)) * geo.hkv + i_h
      # [R, npad]: every query row of the tile against child j of every node of the level.
      zs.append(_summary_logits(b_q, s_ref, rows, m_child, geo))
      masks.append(m_child)
    per_head = jnp.where(m_head_r[:, None], _reduce_children(zs, masks, geo.selector, geo.scale,
                                                                  geo.approx_log),
                         0.0)
    # Eq. 22 per query: [QT, npad] (one masked row-sum per query of the tile).
    score = jnp.zeros((q_tile, npad), jnp.float32)
    for e in range(q_tile):
      row = jnp.sum(jnp.where((e_r == e)[:, None], per_head, 0.0), axis=0)
      score = jnp.where((o_e == e)[:, None], row[None, :], score)
    if kept is None:
      # The first scored level: every node is a candidate.
      cand_m = jnp.broadcast_to((ids < n)[None, :], (q_tile, npad))
    elif g & (g - 1) == 0:
      # Node i is a candidate iff its parent i // g was kept one level up: repeat each parent's
      # flag g times (a broadcast and a reshape), then keep the first npad columns (npad <=
      # g * parent width, both powers of two), with no [QT, npad, parent width] compare.
      width = kept.shape[1]
      rep = jnp.broadcast_to(kept.astype(jnp.int32)[:, :, None], (q_tile, width, g))
      rep = rep.reshape(q_tile, width * g)
      while rep.shape[1] > npad:
        rep = jnp.split(rep, 2, axis=1)[0]
      cand_m = rep > 0
    else:
      parent_hit = (ids[None, :, None] // g == kept_ids[None, None, :]) & kept[:, None, :]
      cand_m = jnp.max(parent_hit.astype(jnp.int32), axis=2) > 0
    valid = cand_m & (ids < n)[None, :] & (ids[None, :] * (leaves_per_node * geo.block_size)
                                           <= t_ec[:, None])
    cand_ids = jnp.broadcast_to(ids[None, :], (q_tile, npad))
    forced = valid & _forced(cand_ids, cur_e, leaves_per_node)
    kept, kept_ids = _top_mask(cand_ids, valid, forced, score, geo.beam), ids
  # Children of the kept nodes at stop_level, as each query's candidate list: the kept ids in
  # ascending order (at most beam <= NC / g of them), kept node p filling slots p*g .. p*g+g-1.
  width = next_pow2(nc // g)  # >= beam; a power of two for Triton even when g is not
  kept_sorted = _sorted_kept(jnp.broadcast_to(kept_ids[None, :], kept.shape), kept, width)
  slot = jnp.arange(nc)
  o_w = jnp.arange(width)
  parent = jnp.max(jnp.where(slot[None, :, None] // g == o_w[None, None, :],
                             kept_sorted[:, None, :], -1), axis=2)  # [QT, NC]
  cand = jnp.where(parent >= 0, parent * g + slot[None, :] % g, -1)
  if stop_level == 2:
    cand = jnp.where((cand < geo.sizes[0]) & (cand * geo.block_size <= t_ec[:, None]), cand, -1)
  else:
    cand = jnp.where(cand < geo.sizes[stop_level - 2], cand, -1)
  out_rows = jnp.where(t_e < geo.seq_len, (i_b * geo.seq_len + t_ec) * geo.hkv + i_h,
                       geo.batch * geo.seq_len * geo.hkv)
  plt.store(cand_ref.at[out_rows[:, None], slot[None, :]], cand)


def _leaf_needs_score(cand, t, geo: _Geometry):
  """Which level-1 candidates are ranked by score: eligible, not forced, and more eligible
  candidates than top_k. `cand` `[..., NC]`, t broadcastable to it."""
  valid = cand >= 0
  cur = t // geo.block_size
  forced = _forced(cand, cur, 1)
  many = jnp.sum(valid.astype(jnp.int32), axis=-1, keepdims=True) > geo.top_k
  return valid & ~forced & many, valid, forced


def _walk_kernel(q_ref, s_ref, tab_ref, *refs, geo: _Geometry, topk_impl: str, q_tile: int,
                 first_level: int | None = None, online_lse: bool = False,
                 pair_lse: bool = False):
  """Stage 1: one program per (tile of q_tile consecutive queries, KV head); writes each query's
  leaf candidates `[NC]`. refs: (cand_ref,), or (init_ref, cand_ref) to start from the
  candidates `[B*T*HKV, NC]` at level `first_level` that `_walk_top_kernel` wrote."""
  init_ref, cand_ref = refs if first_level is not None else (None, refs[0])
  i_b, i_h, i_tile = _query_tile_program(geo, q_tile)
  m_head = jnp.arange(geo.gp) < geo.group
  # The last tile's queries past T walk as T - 1 (valid addresses) and are not stored.
  t_raw = [i_tile * q_tile + e for e in range(q_tile)]
  ts = [jnp.minimum(t, geo.seq_len - 1) for t in t_raw]
  qgs = [_load_group_queries(q_ref, geo, i_b, t, i_h, geo.gp) for t in ts]
  init = None
  if init_ref is not None:
    slot = jnp.arange(geo.nc)
    init = [plt.load(init_ref.at[jnp.full((geo.nc,), (i_b * geo.seq_len + t) * geo.hkv + i_h,
                                          jnp.int32), slot]) for t in ts]
  cands = _walk_to_leaves(qgs, m_head, i_b, ts, i_h, s_ref, tab_ref, geo, topk_impl, init=init,
                          first_level=first_level, online_lse=online_lse, pair_lse=pair_lse)
  for t, t_clamped, cand in zip(t_raw, ts, cands):
    row = (i_b * geo.seq_len + t_clamped) * geo.hkv + i_h
    if q_tile == 1:
      cand_ref[row, :] = cand
    else:
      @pl.when(t < geo.seq_len)
      def _():
        cand_ref[row, :] = cand


def _leaf_key_rows(leaf, i_b, i_h, geo: _Geometry):
  """Leaf `leaf`'s raw keys in the `[B*T*HKV, D]` view: (rows `[Cp]`, load mask `[Cp]`, the key
  mask `_reduce_keys` needs or None).

  Only complete past leaves are scored (`_leaf_needs_score`: eligible, not the current or previous
  block), and the callers mask off the other slots' loads and drop their scores. So for whole
  power-of-two tiles every key of a scored leaf exists: the rows are left unclamped (affine in the
  key index), the load mask is constant along it and the scores need no key mask, and Triton
  computes one base address instead of a clamp, an address and a predicate per element.
  """
  o_key = jnp.arange(geo.cp)
  pos = leaf * geo.block_size + o_key
  if geo.cp == geo.block_size:
    return (i_b * geo.seq_len + pos) * geo.hkv + i_h, jnp.full((geo.cp,), True), None
  m_key = (o_key < geo.block_size) & (pos < geo.seq_len)
  return (i_b * geo.seq_len + jnp.minimum(pos, geo.seq_len - 1)) * geo.hkv + i_h, m_key, m_key


def _leaf_scores_one(qg, m_head, leaf, valid, i_b, i_h, k_ref, geo: _Geometry,
                     unshifted: bool = False):
  """Group-summed raw-key score of one leaf for one query: qg `[Gp, Dp]` -> scalar."""
  rows, m_load, m_key = _leaf_key_rows(leaf, i_b, i_h, geo)
  b_k = _load_rows(k_ref, rows, m_load & valid, geo)
  per_head = _reduce_keys(_qk(qg, b_k, geo.key_mode), m_key, geo.selector, geo.scale,
                          geo.approx_log, unshifted)
  return jnp.sum(jnp.where(m_head, per_head, 0.0))


def _final_select(cand, score, t, geo: _Geometry, topk_impl: str, by_column: bool = False):
  """Leaf Select_K (Eq. 17 at l = 1) and ascending order: `[..., NC]` -> `[..., KP]`.

  by_column (rank top-k): the layout choice of `_rank_keep`; the fused kernel's one-query select
  is 88 SASS instructions shorter with it, the final top-k kernel's `[rows, NC]` select takes 4-6
  more registers (offline, session 5), so each caller picks.
  """
  need, valid, forced = _leaf_needs_score(cand, t, geo)
  score = jnp.where(need, score, 0.0)
  if topk_impl == "rank":
    taken, _ = _rank_keep(cand, valid, forced, score, geo.top_k, by_column=by_column)
    return _sorted_kept_rank(cand, taken, geo.kp, by_column=by_column)
  taken = _top_mask(cand, valid, forced, score, geo.top_k)
  return _sorted_kept(cand, taken, geo.kp)


def _fused_kernel(q_ref, k_ref, s_ref, tab_ref, *refs, geo: _Geometry, topk_impl: str,
                  compact_leaves: bool, leaf_unroll: int = 1, pair_lse: bool = False,
                  unshifted: bool = False):
  """Per-query variant: all levels, the leaves included, for one (query, KV head).

  refs: (out_ref,), or with `unshifted` (kn2_ref, out_ref): kn2_ref `[B*HKV]` holds
  max_t |k_t|^2 per (batch, KV head), from which the program bounds its logits and takes the
  unshifted branch (`SelectionConfig.fused_unshifted_lse`) where they are small enough.

  compact_leaves: the leaf loop runs once per candidate that needs a score (iteration c scores
  the c-th such slot), not once per slot: forced leaves (first, previous, current) and the
  current block's later sibling are never scored, about 3.5 of the 16 slots at K = 8 away from
  the sequence start, and each iteration is a `[16, 64] x [64, 64]` dot and 1,024 exponentials.
  leaf_unroll (with compact_leaves): leaves scored per iteration, as independent chains the
  scheduler can interleave (the loop is latency-bound at one warp per program); the last
  iteration's surplus leaves are masked.
  """
  kn2_ref, out_ref = refs if unshifted else (None, refs[0])
  i_p = pl.program_id(0)
  i_bh, t = i_p // geo.seq_len, i_p % geo.seq_len
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  m_head = jnp.arange(geo.gp) < geo.group
  qg = _load_group_queries(q_ref, geo, i_b, t, i_h, geo.gp)
  select = functools.partial(_fused_select, qg, m_head, i_b, t, i_h, k_ref, s_ref, tab_ref, geo,
                             topk_impl, compact_leaves, leaf_unroll, pair_lse)
  if unshifted:
    # This (batch, KV head)'s max_t |k_t|^2, loaded as a 2-vector (a value's shape is a power of
    # two; one element would do) and reduced to a scalar.
    kn2 = jnp.max(plt.load(kn2_ref.at[jnp.full((2,), i_bh, jnp.int32)]))
    out = lax.cond(_unshifted_ok(qg, m_head, kn2, geo.scale),
                   functools.partial(select, unshifted=True),
                   functools.partial(select, unshifted=False))
  else:
    out = select()
  row = (i_b * geo.seq_len + t) * geo.hkv + i_h
  out_ref[pl.ds(row, 1), :] = out


def _unshifted_ok(qg, m_head, kn2, scale: float):
  """Whether every exponent c * z of a program lies within +-_UNSHIFTED_EXP2: qg `[Gp, Dp]` its
  query heads (m_head `[Gp]` the real ones), kn2 the largest squared key norm of its (batch, KV
  head). Cauchy-Schwarz: |c q_h . k| <= c |q_h| |k| for every key and every summary (a mean of
  keys). NaN or inf inputs fail the compare."""
  q32 = qg.astype(jnp.float32)
  qn2 = jnp.max(jnp.where(m_head, jnp.sum(q32 * q32, axis=1), 0.0))
  return qn2 * kn2 <= (_UNSHIFTED_EXP2 / (abs(scale) * _LOG2E)) ** 2


def _fused_select(qg, m_head, i_b, t, i_h, k_ref, s_ref, tab_ref, geo: _Geometry, topk_impl: str,
                  compact_leaves: bool, leaf_unroll: int, pair_lse: bool, unshifted: bool = False):
  """The fused kernel's selection for one (query, KV head): walk, leaf scores, final Select_K,
  `[1, KP]` sorted leaf ids."""
  (cand,) = _walk_to_leaves([qg], m_head, i_b, [t], i_h, s_ref, tab_ref, geo, topk_impl,
                            pair_lse=pair_lse, unshifted=unshifted)
  need, _, _ = _leaf_needs_score(cand, t, geo)
  slot = jnp.arange(geo.nc)

  if compact_leaves:
    # order[i]: how many needed slots come before slot i, so the needed slots are numbered
    # 0 .. n_need - 1 in slot order; one [NC, NC] compare, once per query.
    order = jnp.sum((need[None, :] & (slot[None, :] < slot[:, None])).astype(jnp.int32), axis=1)
    n_need = jnp.sum(need.astype(jnp.int32))

    def score_leaf(c, scores):
      new = scores
      for u in range(leaf_unroll):
        hit = need & (order == c * leaf_unroll + u)
        leaf = jnp.sum(jnp.where(hit, cand, 0))
        # Every numbered leaf is a complete past leaf: its key loads need no mask, except the
        # surplus of the last unrolled iteration.
        live = True if leaf_unroll == 1 else c * leaf_unroll + u < n_need
        s = _leaf_scores_one(qg, m_head, leaf, live, i_b, i_h, k_ref, geo, unshifted)
        new = jnp.where(hit, s, new)
      return new

    trips = n_need if leaf_unroll == 1 else (n_need + leaf_unroll - 1) // leaf_unroll
    scores = lax.fori_loop(0, trips, score_leaf, jnp.zeros((geo.nc,), jnp.float32))
  else:
    def score_leaf(c, scores):
      leaf = jnp.sum(jnp.where(slot == c, cand, 0))
      needed = jnp.sum(jnp.where(slot == c, need.astype(jnp.int32), 0)) > 0
      s = _leaf_scores_one(qg, m_head, jnp.maximum(leaf, 0), needed, i_b, i_h, k_ref, geo,
                           unshifted)
      return jnp.where(slot == c, s, scores)

    scores = lax.fori_loop(0, geo.nc, score_leaf, jnp.zeros((geo.nc,), jnp.float32))
  return _final_select(cand[None, :], scores[None, :], t, geo, topk_impl, by_column=True)


def _leaf_tile_kernel(q_ref, k_ref, start_ref, bucket_ref, pair_ref, score_ref, *, geo: _Geometry,
                      q_tile: int, num_pairs: int, num_buckets: int, num_windows: int,
                      trash: int, wide_loads: bool):
  """Stage 2 (Algorithm 1, lines 16-22): one leaf's keys against up to q_tile queries.

  start_ref `[NG]`: first sorted position of each tile (num_pairs when the tile is unused);
  bucket_ref `[num_pairs]`: sorted (batch, KV head, window, leaf) buckets; pair_ref `[num_pairs]`:
  the pair id (row * NC + slot) at each sorted position. Writes score_ref[pair] (score_ref[trash]
  when masked).
  """
  gp = max(next_pow2(geo.group), _MIN_DOT // q_tile)
  rows_n = q_tile * gp
  i_g = pl.program_id(0)
  o_r = jnp.arange(rows_n)
  o_e = jnp.arange(q_tile)
  start = jnp.max(plt.load(start_ref.at[jnp.full((q_tile,), i_g, jnp.int32)]))
  # Tiles are numbered densely from 0, so the unused ones (start == num_pairs) are the grid's
  # tail: the grid's static size bounds the tiles of every possible grouping. They exit here.
  @pl.when(start < num_pairs)
  def _():
    # Entry e of the tile is sorted position start + e; it belongs to the tile if it exists and has
    # the tile's bucket (a bucket's last tile may be short).
    pos_e = start + o_e
    bucket0 = jnp.max(plt.load(bucket_ref.at[jnp.full((q_tile,), start)]))
    bucket_e = plt.load(bucket_ref.at[jnp.minimum(pos_e, num_pairs - 1)])
    m_e = (pos_e < num_pairs) & (bucket_e == bucket0)
    pair_e = plt.load(pair_ref.at[jnp.minimum(pos_e, num_pairs - 1)])
    bucket = bucket0  # a used tile's first entry is a live pair: bucket0 < num_buckets
    m_blocks = geo.num_blocks
    leaf = bucket % m_blocks
    i_bh = bucket // m_blocks // num_windows
    i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
    # [Q*Gp] query rows: entry r // gp, head r % gp.
    e_r = o_r // gp
    j_r = o_r % gp
    pos_r = start + e_r
    m_r = (pos_r < num_pairs) & (j_r < geo.group)
    pair_r = plt.load(pair_ref.at[jnp.minimum(pos_r, num_pairs - 1)])
    bucket_r = plt.load(bucket_ref.at[jnp.minimum(pos_r, num_pairs - 1)])
    m_r = m_r & (bucket_r == bucket0)
    qk_row = pair_r // geo.nc  # (b * T + t) * HKV + h
    q_rows = (qk_row // geo.hkv) * geo.hq + i_h * geo.group + jnp.minimum(j_r, geo.group - 1)
    b_q = _load_rows(q_ref, q_rows, m_r, geo, wide_loads)
    k_rows, m_load, m_key = _leaf_key_rows(leaf, i_b, i_h, geo)
    b_k = _load_rows(k_ref, k_rows, m_load, geo, wide_loads)
    # [Q*Gp, Cp]: every (query, head) of the tile against the leaf's raw keys, one dot.
    per_row = jnp.where(m_r, _reduce_keys(_qk(b_q, b_k, geo.key_mode), m_key, geo.selector,
                                          geo.scale, geo.approx_log), 0.0)
    # Eq. 22: sum each entry's heads, [Q].
    score_e = jnp.sum(jnp.where(e_r[None, :] == o_e[:, None], per_row[None, :], 0.0), axis=1)
    plt.store(score_ref.at[jnp.where(m_e, pair_e, trash)], score_e)


def _final_topk_kernel(cand_ref, score_ref, out_ref, *, geo: _Geometry, rows: int, num_rows: int,
                       topk_impl: str):
  """Stage 2 final Select_K for `rows` (query, KV head) rows: `[rows, NC]` -> `[rows, KP]`."""
  i_p = pl.program_id(0)
  o_row = i_p * rows + jnp.arange(rows)
  m_row = o_row < num_rows
  c_row = jnp.minimum(o_row, num_rows - 1)
  o_slot = jnp.arange(geo.nc)
  cand = plt.load(cand_ref.at[c_row[:, None], o_slot[None, :]])
  cand = jnp.where(m_row[:, None], cand, -1)
  score = plt.load(score_ref.at[(c_row[:, None] * geo.nc + o_slot[None, :])])
  t = ((c_row // geo.hkv) % geo.seq_len)[:, None]
  out = _final_select(cand, score, t, geo, topk_impl)
  trash = num_rows
  plt.store(out_ref.at[jnp.where(m_row, o_row, trash)[:, None], jnp.arange(geo.kp)[None, :]], out)


def _bsa_kernel(q_ref, s_ref, out_ref, *, geo: _Geometry, q_tile: int, block_tile: int):
  """Flat BSA for q_tile queries of one KV head, without materialising `[T, M]` scores.

  Pass 1: per (query, head) online max / sum of exp over the complete past blocks (the softmax
  normaliser). Pass 2: the normalised probabilities summed over the group's heads, merged block
  tile by block tile into a running top-(top_k - 3) of the non-forced past blocks.
  """
  gp = max(next_pow2(geo.group), _MIN_DOT // q_tile)
  rows_n = q_tile * gp
  i_b, i_h, i_tile = _query_tile_program(geo, q_tile)
  t0 = i_tile * q_tile
  o_r = jnp.arange(rows_n)
  e_r, j_r = o_r // gp, o_r % gp
  t_r = t0 + e_r
  m_r = (t_r < geo.seq_len) & (j_r < geo.group)
  q_rows = ((i_b * geo.seq_len + jnp.minimum(t_r, geo.seq_len - 1)) * geo.hq + i_h * geo.group
            + jnp.minimum(j_r, geo.group - 1))
  b_q = _load_rows(q_ref, q_rows, m_r, geo)
  cur_r = (t_r // geo.block_size)[:, None]
  o_e = jnp.arange(q_tile)
  t_e = t0 + o_e
  cur_e = (jnp.minimum(t_e, geo.seq_len - 1) // geo.block_size)[:, None]
  num_blocks = geo.num_blocks
  last_cur = jnp.minimum(t0 + q_tile - 1, geo.seq_len - 1) // geo.block_size
  n_steps = pl.cdiv(last_cur, block_tile)
  o_blk = jnp.arange(block_tile)
  scale2 = geo.scale * _LOG2E

  def logits(i):
    blk = i * block_tile + o_blk
    rows = (i_b * num_blocks + jnp.minimum(blk, num_blocks - 1)) * geo.hkv + i_h
    # [Q*Gp, BT] base-2 logits; Eq. 4 over complete past blocks only.
    z2 = scale2 * _summary_logits(b_q, s_ref, rows, blk < num_blocks, geo)
    past = blk[None, :] < cur_r
    return blk, jnp.where(past, z2, -jnp.inf)

  def normaliser(i, carry):
    m, l = carry
    _, z2 = logits(i)
    m_new = jnp.maximum(m, jnp.max(z2, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    l = l * jnp.exp2(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe)) + jnp.sum(
        jnp.exp2(z2 - m_safe), axis=1, keepdims=True)
    return m_new, l

  m0 = jnp.full((rows_n, 1), -jnp.inf, jnp.float32)
  m, l = lax.fori_loop(0, n_steps, normaliser, (m0, jnp.zeros((rows_n, 1), jnp.float32)))
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  inv_l = jnp.where(m_r[:, None] & (l > 0), 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
  n_best = geo.top_k - 3
  bp = next_pow2(max(n_best, 1))
  o_best = jnp.arange(bp)[None, :]

  def merge(i, carry):
    best_v, best_i = carry
    blk, z2 = logits(i)
    p = jnp.exp2(z2 - m_safe) * inv_l
    # [Q, BT] group-summed probabilities (Eq. 22 for BSA).
    ps = jnp.sum(jnp.where((e_r[None, :] == o_e[:, None])[:, :, None], p[None, :, :], 0.0), axis=1)
    blk2 = jnp.broadcast_to(blk[None, :], ps.shape)
    # Candidates: complete past blocks that are not forced (0 and cur - 1 are kept anyway).
    m_cand = (blk2 < cur_e) & (blk2 != 0) & (blk2 != cur_e - 1)
    cv = jnp.where(m_cand, ps, -jnp.inf)

    # Insert while some row has a candidate strictly better than its worst kept entry: the best
    # candidate (lowest block on ties) replaces the worst entry (highest block on ties; earlier
    # tiles hold lower blocks, so an equal newcomer never displaces it). Later tiles rarely beat
    # the running top-(K-3), so this loop usually runs zero or one time.
    def improvable(c):
      best_v, _, cv = c
      gain = (jnp.max(cv, axis=1) > jnp.min(best_v, axis=1)).astype(jnp.int32)
      return jnp.max(gain) > 0

    def insert(c):
      best_v, best_i, cv = c
      m2 = jnp.max(cv, axis=1, keepdims=True)
      i2 = jnp.min(jnp.where(cv == m2, blk2, _BIG), axis=1, keepdims=True)
      wv = jnp.min(best_v, axis=1, keepdims=True)
      wi = jnp.max(jnp.where(best_v == wv, best_i, -1), axis=1, keepdims=True)
      # Empty slots share the index _BIG: replace exactly one slot.
      ws = jnp.max(jnp.where((best_v == wv) & (best_i == wi), o_best, -1), axis=1, keepdims=True)
      do = m2 > wv
      hit = do & (o_best == ws)
      best_v = jnp.where(hit, m2, best_v)
      best_i = jnp.where(hit, i2, best_i)
      cv = jnp.where(do, jnp.where(blk2 == i2, -jnp.inf, cv), -jnp.inf)
      return best_v, best_i, cv

    best_v, best_i, _ = lax.while_loop(improvable, insert, (best_v, best_i, cv))
    return best_v, best_i

  # Slots past top_k - 3 hold +inf so they are never the worst entry, and no block.
  best_v = jnp.where(o_best < n_best, -jnp.inf, jnp.inf) + jnp.zeros((q_tile, bp), jnp.float32)
  best_i = jnp.full((q_tile, bp), _BIG, jnp.int32)
  if n_best > 0:
    best_v, best_i = lax.fori_loop(0, n_steps, merge, (best_v, best_i))
  # Kept set: every eligible block when at most top_k are (blocks 0..cur), else the forced
  # 0, cur - 1, cur plus the running best; then ascending.
  kp = geo.kp
  o_slot = jnp.arange(kp)[None, :]
  keep_all = cur_e + 1 <= geo.top_k
  # [Q, KP]: slot s < bp holds best_i[:, s] (a one-hot reduction: no concatenation in kernels).
  best_w = jnp.sum(jnp.where(o_slot[:, :, None] == o_best[:, None, :], best_i[:, None, :], 0),
                   axis=2)
  best_w = jnp.where((o_slot < n_best) & (best_w < _BIG), best_w, _BIG)
  chosen = jnp.where(o_slot == n_best, 0, best_w)
  chosen = jnp.where(o_slot == n_best + 1, cur_e - 1, chosen)
  chosen = jnp.where(o_slot == n_best + 2, cur_e, chosen)
  chosen = jnp.where(keep_all, jnp.where(o_slot <= cur_e, o_slot, _BIG), chosen)
  out = _sorted_kept(chosen, chosen < _BIG, kp)
  m_e = t_e < geo.seq_len
  trash = geo.batch * geo.seq_len * geo.hkv
  out_rows = jnp.where(m_e, (i_b * geo.seq_len + t_e) * geo.hkv + i_h, trash)
  plt.store(out_ref.at[out_rows[:, None], jnp.arange(kp)[None, :]], out)


def _call(kernel, out_shape, grid: int, config: SelectionConfig, warps: int, interpret: bool,
          name: str, *args):
  with triton_deprecation_silenced():
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(grid,),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=config.num_stages),
        interpret=interpret, name=name)(*args)


def _geometry(q, k, *, block_size, top_k, branching, selector, scale, beam,
              interpret: bool = True) -> _Geometry:
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  # 16-bit inputs of one dtype score on tensor cores (exact products, float32 accumulation);
  # anything else is upcast to float32.
  wide = q.dtype == k.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
  return _Geometry(
      batch=b, seq_len=t, hq=hq, hkv=hkv, d=d, block_size=block_size, top_k=top_k, beam=beam,
      branching=branching, selector=selector, scale=float(scale),
      sizes=level_sizes(t, block_size, branching),
      score_mode="split" if wide else "f32", key_mode="native" if wide else "f32",
      approx_log=not interpret)


def _summary_rows(rows: Float[Array, "R D"], geo: _Geometry, dtype) -> Array:
  """The summaries ref of `_summary_logits`: float32 rows as they are, or, for 16-bit queries
  (score_mode "split"), each row r as its 16-bit high part (row 2r) and the 16-bit rounding of the
  remainder (row 2r + 1), `[2R, D]` in `dtype`."""
  if geo.score_mode != "split":
    return rows
  # The high part by reduce_precision, not a round trip through the 16-bit dtype: XLA on the GPU
  # (xla_allow_excess_precision, on by default) may fold convert(convert(x, bf16), f32) into x,
  # which made every low part zero (the H200's bf16 check at 128K caught it: 4,792 rows off).
  finfo = jnp.finfo(dtype)
  hi = lax.reduce_precision(rows, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant)
  lo = (rows - hi).astype(dtype)
  return jnp.stack([hi.astype(dtype), lo], axis=1).reshape(-1, rows.shape[-1])


def _stacked(summaries, geo: _Geometry, dtype):
  """Levels 1..L-1 as one row array `[sum_l B*M_l*HKV, D]` (the root is never read), in the
  layout of `_summary_rows`."""
  d = summaries[0].shape[-1]
  used = summaries[:-1] or summaries[:1]
  return _summary_rows(jnp.concatenate([s.reshape(-1, d) for s in used], axis=0), geo, dtype)


def _uses_pair_lse(config: SelectionConfig, geo: _Geometry) -> bool:
  """`walk_pair_lse` applies to Eq. 21 with two children; other walks reduce as usual."""
  return config.walk_pair_lse and geo.branching == 2 and geo.selector == "pisa"


def leaf_candidates_pallas(q, k, summaries, geo: _Geometry, *, interpret: bool,
                           config: SelectionConfig) -> Int[Array, "R NC"]:
  """Stage 1 alone: level-1 candidates `[B*T*HKV, NC]` (exposed for the benchmark's breakdown).

  With `config.walk_dense_nodes`, `_walk_top_kernel` walks the upper levels densely and the
  gathered walk continues from its candidates (or is skipped when the dense part reached level 2).
  """
  b, t, hq, d = q.shape
  rows = b * t * geo.hkv
  pair_lse = _uses_pair_lse(config, geo)
  stacked, table = _stacked(summaries, geo, q.dtype), _level_table(geo)
  stop = _dense_stop_level(geo, config.walk_dense_nodes) if config.walk_dense_nodes else 0
  init, first_level = (), None
  # Dense levels run only where some level at or below the first scored one is dense.
  if 2 <= stop <= _first_scored_level(geo):
    qt = config.walk_dense_q_tile
    top = _call(
        functools.partial(_walk_top_kernel, geo=geo, q_tile=qt, stop_level=stop),
        jax.ShapeDtypeStruct((rows + 1, geo.nc), jnp.int32), b * geo.hkv * -(-t // qt), config,
        config.walk_dense_warps, interpret, f"pisa_select_walk_dense_q{qt}", q.reshape(-1, d),
        stacked)[:rows]
    if stop == 2:
      return top
    init, first_level = (top,), stop - 1
  q_tile = config.walk_q_tile
  grid = b * geo.hkv * -(-t // q_tile)
  name = "pisa_select_walk" + ("_rank" if config.topk_impl == "rank" else "") + (
      f"_q{q_tile}" if q_tile > 1 else "") + (f"_from{first_level}" if first_level else "") + (
          "_olse" if config.walk_online_lse else "") + ("_plse" if pair_lse else "")
  return _call(functools.partial(_walk_kernel, geo=geo, topk_impl=config.topk_impl, q_tile=q_tile,
                                 first_level=first_level, online_lse=config.walk_online_lse,
                                 pair_lse=pair_lse),
               jax.ShapeDtypeStruct((rows, geo.nc), jnp.int32), grid, config, config.walk_warps,
               interpret, name, q.reshape(-1, d), stacked, table, *init)


def leaf_scores_pallas(q, k, cand, geo: _Geometry, *, interpret: bool, config: SelectionConfig):
  """Stage 2 key-tile scoring: float32 scores `[B*T*HKV * NC + 1]` of the pairs that need one
  (the last element is the trash slot of masked stores; unscored pairs are left unwritten)."""
  b, t, hq, d = q.shape
  rows = cand.shape[0]
  num_pairs = rows * geo.nc
  t_row = ((jnp.arange(rows) // geo.hkv) % t)[:, None]
  need, _, _ = _leaf_needs_score(cand, t_row, geo)
  # Buckets are (batch, KV head, query window, leaf). Without a window (leaf_window=0) one window
  # holds all T queries and one global stable argsort groups the pairs; with windows each window's
  # pairs are sorted on their own (a batched sort of W*NC keys per row instead of one sort of all
  # P pairs), and the programs of one window run together, so its query rows stay in L2.
  window = config.leaf_window or t
  num_windows = -(-t // window)
  num_buckets = b * geo.hkv * num_windows * geo.num_blocks
  q_tile = config.q_tile
  if config.leaf_window:
    # [B, HKV, T_pad, NC] -> one row of W*NC pairs per (batch, KV head, window); pad queries
    # (t >= T) get the trash bucket, which sorts last inside its row.
    t_pad = num_windows * window
    cand4 = cand.reshape(b, t, geo.hkv, geo.nc).transpose(0, 2, 1, 3)
    need4 = need.reshape(b, t, geo.hkv, geo.nc).transpose(0, 2, 1, 3)
    pad = ((0, 0), (0, 0), (0, t_pad - t), (0, 0))
    cand4, need4 = jnp.pad(cand4, pad), jnp.pad(need4, pad)
    t4 = jnp.arange(t_pad, dtype=jnp.int32)[None, None, :, None]
    bh4 = (jnp.arange(b, dtype=jnp.int32)[:, None] * geo.hkv
           + jnp.arange(geo.hkv, dtype=jnp.int32)[None, :])[:, :, None, None]
    bucket4 = jnp.where(need4, (bh4 * num_windows + t4 // window) * geo.num_blocks
                        + jnp.maximum(cand4, 0), num_buckets)
    pair4 = ((jnp.arange(b, dtype=jnp.int32)[:, None, None, None] * t
              + jnp.minimum(t4, t - 1)) * geo.hkv
             + jnp.arange(geo.hkv, dtype=jnp.int32)[None, :, None, None]) * geo.nc + jnp.arange(
                 geo.nc, dtype=jnp.int32)
    seg = window * geo.nc
    num_segments = b * geo.hkv * num_windows
    sorted_bucket, order = lax.sort(
        (bucket4.reshape(num_segments, seg), pair4.reshape(num_segments, seg)), dimension=1,
        num_keys=1, is_stable=True)
    sorted_bucket, order = sorted_bucket.reshape(-1), order.reshape(-1)
    num_sorted = num_segments * seg
    counts = jnp.zeros((num_buckets + 1,), jnp.int32).at[bucket4.reshape(-1)].add(1)[:num_buckets]
    # A bucket's first position: its window's row start + the counts of the lower leaves there.
    per_window = counts.reshape(num_segments, geo.num_blocks)
    first = ((jnp.cumsum(per_window, axis=1) - per_window)
             + (jnp.arange(num_segments, dtype=jnp.int32) * seg)[:, None]).reshape(-1)
  else:
    bh = (jnp.arange(rows) // (t * geo.hkv)) * geo.hkv + jnp.arange(rows) % geo.hkv
    bucket = jnp.where(need, bh[:, None] * geo.num_blocks + jnp.maximum(cand, 0), num_buckets)
    bucket = bucket.reshape(-1)
    # Group the pairs by leaf, stably (by query inside a leaf). The per-bucket counts and offsets
    # are small ([B*HKV*M]), so no scan runs over the P pairs.
    order = jnp.argsort(bucket, stable=True).astype(jnp.int32)
    sorted_bucket = bucket[order]
    num_sorted = num_pairs
    counts = jnp.zeros((num_buckets + 1,), jnp.int32).at[bucket].add(1)[:num_buckets]
    first = jnp.cumsum(counts) - counts  # first sorted position of each bucket
  pos = jnp.arange(num_sorted, dtype=jnp.int32)
  tiles = -(-counts // q_tile)
  first_tile = jnp.cumsum(tiles) - tiles  # tiles before each bucket
  live = sorted_bucket < num_buckets
  safe_bucket = jnp.minimum(sorted_bucket, num_buckets - 1)
  rank = pos - first[safe_bucket]
  tile_head = (rank % q_tile == 0) & live
  tile_id = first_tile[safe_bucket] + rank // q_tile
  # Static bound on the number of tiles: each bucket adds at most one partial tile.
  num_tiles = -(-num_pairs // q_tile) + min(num_pairs, num_buckets)
  starts = jnp.full((num_tiles,), num_sorted, jnp.int32).at[
      jnp.where(tile_head, tile_id, num_tiles)].set(pos, mode="drop")
  scores = _call(
      functools.partial(_leaf_tile_kernel, geo=geo, q_tile=q_tile, num_pairs=num_sorted,
                        num_buckets=num_buckets, num_windows=num_windows, trash=num_pairs,
                        wide_loads=config.leaf_wide_loads),
      jax.ShapeDtypeStruct((num_pairs + 1,), jnp.float32), num_tiles, config, config.leaf_warps,
      interpret,
      f"pisa_select_leaf_q{q_tile}", q.reshape(-1, d), k.reshape(-1, d), starts, sorted_bucket,
      order)
  return scores


def final_topk_pallas(cand, scores, geo: _Geometry, *, interpret: bool, config: SelectionConfig):
  rows = cand.shape[0]
  tile = config.topk_rows
  out = _call(functools.partial(_final_topk_kernel, geo=geo, rows=tile, num_rows=rows,
                                topk_impl=config.topk_impl),
              jax.ShapeDtypeStruct((rows + 1, geo.kp), jnp.int32), -(-rows // tile), config,
              config.topk_warps, interpret,
              "pisa_select_topk" + ("_rank" if config.topk_impl == "rank" else ""), cand, scores)
  return out[:rows]


def _select_pisa(q, k, geo: _Geometry, *, interpret: bool, config: SelectionConfig):
  b, t, hq, d = q.shape
  pyramid = build_pyramid_pallas(k, block_size=geo.block_size, branching=geo.branching,
                                 interpret=interpret)
  rows = b * t * geo.hkv
  if config.variant == "fused":
    pair_lse = _uses_pair_lse(config, geo)
    unshifted = config.fused_unshifted_lse and geo.selector == "pisa"
    # max_t |k_t|^2 per (batch, KV head), the keys' half of each program's logit bound.
    kn2 = (jnp.max(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1), axis=1).reshape(-1),
           ) if unshifted else ()
    out = _call(functools.partial(_fused_kernel, geo=geo, topk_impl=config.topk_impl,
                                  compact_leaves=config.fused_compact_leaves,
                                  leaf_unroll=config.fused_leaf_unroll, pair_lse=pair_lse,
                                  unshifted=unshifted),
                jax.ShapeDtypeStruct((rows, geo.kp), jnp.int32), rows, config, config.walk_warps,
                interpret, "pisa_select_fused" + ("_rank" if config.topk_impl == "rank" else "")
                + ("_plse" if pair_lse else "") + ("_ulse" if unshifted else ""),
                q.reshape(-1, d), k.reshape(-1, d),
                _stacked(pyramid.summaries, geo, q.dtype), _level_table(geo), *kn2)
  else:
    cand = leaf_candidates_pallas(q, k, pyramid.summaries, geo, interpret=interpret, config=config)
    scores = leaf_scores_pallas(q, k, cand, geo, interpret=interpret, config=config)
    out = final_topk_pallas(cand, scores, geo, interpret=interpret, config=config)
  return out


def _select_bsa(q, k, geo: _Geometry, *, interpret: bool, config: SelectionConfig):
  b, t, hq, d = q.shape
  leaves = leaf_summaries_pallas(k, block_size=geo.block_size, interpret=interpret)
  q_tile = config.bsa_q_tile
  n_tiles = -(-t // q_tile)
  rows = b * t * geo.hkv
  out = _call(functools.partial(_bsa_kernel, geo=geo, q_tile=q_tile,
                                block_tile=config.bsa_block_tile),
              jax.ShapeDtypeStruct((rows + 1, geo.kp), jnp.int32), b * geo.hkv * n_tiles, config,
              config.leaf_warps, interpret, "bsa_select", q.reshape(-1, d),
              _summary_rows(leaves.reshape(-1, d), geo, q.dtype))
  return out[:rows]


def select_blocks_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    *,
    block_size: int,
    top_k: int,
    branching: int,
    selector: str,
    scale: float,
    beam: int,
    interpret: bool,
    config: SelectionConfig | None = None,
) -> Int[Array, "B T HKV K"]:
  """Kernel twin of `select_blocks_reference` (arguments already validated).

  Args:
    q: queries `[B, T, HQ, D]`; k: keys `[B, T, HKV, D]` (any float dtype; scores in float32).
    block_size: C. top_k: K (>= 3). branching: g. selector: "pisa", "pisa1", "pisa2" or "bsa".
    scale: logit scale. beam: nodes kept per level above the leaves (>= top_k; unused by "bsa").
    interpret: run the Pallas interpreter instead of compiling through Triton.
    config: variant and tiles; None picks `SelectionConfig.default`.

  Returns:
    int32 `[B, T, HKV, top_k]`: leaf ids ascending, -1 padded.
  """
  if selector not in SELECTORS:
    raise ValueError(f"{selector=} has no Pallas kernel: expected one of {SELECTORS}")
  if selector != "bsa" and beam < top_k:
    raise ValueError(f"{beam=} must be >= {top_k=}")
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  geo = _geometry(q, k, block_size=block_size, top_k=top_k, branching=branching,
                  selector=selector, scale=scale, beam=beam if selector != "bsa" else top_k,
                  interpret=interpret)
  config = config or SelectionConfig.default(seq_len=t, group=hq // hkv, candidates=geo.nc)
  if selector == "bsa":
    out = _select_bsa(q, k, geo, interpret=interpret, config=config)
  else:
    out = _select_pisa(q, k, geo, interpret=interpret, config=config)
  return out[:, :top_k].reshape(b, t, hkv, top_k)
