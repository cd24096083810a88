"""Launch parameters of the decode kernels and the attention kernel's split heuristic."""

from __future__ import annotations

import dataclasses

from pisa_jax.kernels._common import next_pow2

# Triton's tensor-core dots need every dimension >= 16.
MIN_DOT = 16


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Launch parameters of the decode kernels.

  Attributes:
    select_warps: warps of the selection program (its values are `[16, NC]` and `[16, Cp]`; the
      candidates' all-pairs rank compare is `[NC, NC]`).
    select_leaves_per_step: candidate leaves whose raw keys one iteration of the selection's
      leaf loop loads (before any of their dots): up to NC - 3 leaves are scored one after the
      other by a single program per (row, KV head), so at small B the loop's latency is the step.
    select_split_leaves: 0, one fused selection program per (row, KV head); L > 0 (a power of
      two), the same selection in three launches: the walk per (row, KV head), then NC / L
      programs per (row, KV head) scoring L candidate leaves each from their raw keys, then
      Select_K per (row, KV head). The split spreads the leaves' key loads over many SMs at
      small B, for two more launches and a round trip of the candidates through memory. The
      walk selectors only: BSA has its own kernel (`bsa_*`).
    bsa_block_tile: leaf summaries per step of the BSA kernel's loops (a power of two >= 16).
    bsa_warps: warps of the BSA program (its dots are `[16, D] x [D, bsa_block_tile]`).
    attend_blocks: selected blocks per attention program (a power of two); 0 picks
      `default_attend_blocks`.
    attend_warps: warps of an attention program.
    append_warps: warps of an append program.
    num_stages: Triton software-pipelining stages (the leaf and attention loops).
  """

  select_warps: int = 1
  select_leaves_per_step: int = 1
  select_split_leaves: int = 0
  bsa_block_tile: int = 64
  bsa_warps: int = 4
  attend_blocks: int = 0
  attend_warps: int = 2
  append_warps: int = 1
  num_stages: int = 2

  def __post_init__(self):
    for name in ("bsa_block_tile", "attend_blocks"):
      value = getattr(self, name)
      if value and value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")
    if self.select_split_leaves < 0 or self.select_split_leaves & (self.select_split_leaves - 1):
      raise ValueError(f"select_split_leaves={self.select_split_leaves} must be 0 (fused) or a "
                       "power of two")
    if self.select_leaves_per_step < 1:
      raise ValueError(f"select_leaves_per_step={self.select_leaves_per_step} must be >= 1")
    if self.bsa_block_tile < MIN_DOT:
      raise ValueError(f"bsa_block_tile={self.bsa_block_tile} must be >= {MIN_DOT} (dot size)")

  @classmethod
  def default(cls, *, candidates: int, head_dim: int) -> "DecodeConfig":
    """Heuristic, from a sweep of the selection stage inside a jitted decode loop on the H200
    (2026-12-02; 32/2 heads, in-loop ms): 4 warps at every candidate width (d64 K8, NC = 16, 32K
    B=1: 1 / 2 / 4 / 8 warps 0.035 / 0.031 / 0.029 / 0.034; d128 K32, NC = 64, 1M B=1: 0.225 /
    0.145 / 0.116 / 0.126); 4 leaves per step of the leaf loop where more than 13 leaves can
    need a score (K32 1M B=1 / B=16: 1 / 2 / 4 leaves 0.116 / 0.109 / 0.103 and 0.140 / 0.124 /
    0.114), one at NC = 16 (0.035 / 0.035 / 0.037); two warps per attention program at
    d >= 128."""
    return cls(select_warps=4, select_leaves_per_step=4 if candidates > 16 else 1,
               attend_warps=2 if head_dim >= 128 else 1)


def default_attend_blocks(batch: int, num_kv_heads: int, top_k: int, *,
                          target_programs: int = 512) -> int:
  """Selected blocks per attention program: split the B * HKV * K blocks over about
  `target_programs` programs (a few per SM of an H100/H200), one block each when that is few."""
  per = -(-batch * num_kv_heads * top_k // target_programs)
  return min(next_pow2(max(1, per)), next_pow2(top_k))
