"""`SelectionConfig`: variant, tiles and launch settings of the selection kernels, with the default
heuristic that adapts them to the GQA group and the number of candidate slots."""

from __future__ import annotations

import dataclasses

from pisa_jax.kernels._common import MIN_DOT, candidate_slots, next_pow2

VARIANTS = ("fused", "two_stage")
TOPK_IMPLS = ("rank", "rank_folded", "passes")


@dataclasses.dataclass(frozen=True)
class SelectionConfig:
  """Variant and tile sizes of the selection kernels.

  The field defaults are the fastest measured settings (H200) at the paper's setting: K = 8, beam
  8, g = 2 (NC = 16 candidate slots), GQA group 16. `default` adapts them to other groups and to
  wider candidate sets.

  Attributes:
    variant: "fused" (one program per (query, KV head) walks every level, the leaves included) or
      "two_stage" (walk kernel, leaf-tile kernel, final top-k kernel). Fused is faster at NC = 16
      (no second pass over the queries); wider candidate sets keep two-stage, where the fused
      kernel would score NC leaves one after another per query. Ignored by "bsa".
    q_tile: queries per leaf-tile program of the two-stage variant (a power of two; the paper's
      Q1/Q2/Q4): one leaf's keys are loaded once for up to q_tile queries x the group's heads.
      Q8 is the fastest measured (Q16 runs out of registers).
    topk_rows: (query, KV head) rows per program of the final top-k kernel. With the rank top-k a
      program holds `[topk_rows, NC, NC]` compares: 8 rows at NC = 16 take 96 registers on 2 warps
      (sm_90a); 32 rows, or 8 at NC = 32, spill.
    bsa_q_tile: queries per BSA program.
    bsa_block_tile: leaf summaries per BSA loop step (>= 16: a dot dimension).
    walk_warps: Triton warps of the walk and fused kernels. Their values are tiny (`[16, NC]`), so
      fewer warps mean cheaper cross-warp reductions (one warp is the fastest measured).
    leaf_warps: Triton warps of the leaf-tile and BSA kernels (dots of 64+ rows).
    topk_warps: Triton warps of the final top-k kernel.
    num_stages: Triton software-pipelining stages (1 and 3 were slower for the fused kernel).
    topk_impl: the in-kernel Select_K. "rank": one broadcast compare `[..., N, N]` and one sum give
      every candidate its rank, O(1) dependent reductions; faster up to NC = 64. "passes": `keep`
      dependent max / lowest-index argmax passes; for NC >= 128, where the rank's compares do not
      fit in registers. "rank_folded": the rank with validity folded into the ranking key and, at
      g = 2, the expansion from NC / 2 parent slots (`topk.rank_keep_folded`, `expand_pairs`):
      the same kept nodes in ~16% fewer instructions a walk level at NC = 64 (sm_90a SASS
      compiled offline); the default at NC = 32 and 64, while the K = 8 kernels keep "rank".
    walk_pair_lse: at g = 2 with the "pisa" selector the walk scores a candidate from its two
      children's logits as max + log(1 + exp(-|z0 - z1|)) (Eq. 21 for a pair): one exponential and
      one logarithm per head. Other branchings and selectors use the general reduction.
    fused_unshifted_lse: the fused kernel ("pisa") computes Eq. 21 as log2 of a plain sum of
      2^(c z), without the max shift, in every program whose logits are bounded
      (`scoring.unshifted_ok`); the others take the shifted branch of one `lax.cond`. Scores come
      out in base 2, which orders candidates the same; no running maximum.
  """

  variant: str = "fused"
  q_tile: int = 8
  topk_rows: int = 8
  bsa_q_tile: int = 4
  bsa_block_tile: int = 64
  walk_warps: int = 1
  leaf_warps: int = 4
  topk_warps: int = 2
  num_stages: int = 2
  topk_impl: str = "rank"
  walk_pair_lse: bool = True
  fused_unshifted_lse: bool = True

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
    if self.topk_impl not in TOPK_IMPLS:
      raise ValueError(f"topk_impl={self.topk_impl!r} must be one of {TOPK_IMPLS}")
    for name in ("q_tile", "topk_rows", "bsa_q_tile", "bsa_block_tile"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")
    if self.bsa_block_tile < MIN_DOT:
      raise ValueError(f"bsa_block_tile={self.bsa_block_tile} must be >= {MIN_DOT} (dot size)")

  @classmethod
  def default(cls, *, seq_len: int, group: int, candidates: int = MIN_DOT) -> SelectionConfig:
    """The field defaults at NC = `candidates` = 16 (`candidate_slots`); wider candidate sets take
    the two-stage variant, with the folded rank top-k on one warp at NC = 32, on 4 warps at
    NC = 64 (one warp spills) and the passes from NC = 128. BSA programs hold about 64 query rows
    (bsa_q_tile x the padded group). No measured setting depended on seq_len."""
    del seq_len
    changes = dict(bsa_q_tile=max(1, min(16, 64 // next_pow2(group))))
    if candidates != MIN_DOT:
      changes.update(variant="two_stage")
    if candidates == 32:
      changes.update(topk_rows=1, topk_impl="rank_folded")
    elif candidates == 64:
      changes.update(topk_rows=1, walk_warps=4, topk_impl="rank_folded")
    elif candidates >= 128:
      changes.update(topk_impl="passes", topk_rows=32, topk_warps=1)
    return cls(**changes)
