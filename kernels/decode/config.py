"""Launch parameters of the decode kernels and the attention kernel's split heuristic."""

from __future__ import annotations

import dataclasses

from pisa_jax.kernels._common import MIN_DOT, next_pow2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Launch parameters of the decode kernels.

  Attributes:
    select_warps: warps of a leaf-score and a Select_K program (a leaf program's dot is
      `[16, Cp]`, Select_K's all-pairs rank compare `[NC, NC]`).
    walk_warps: warps of the walk's launch (its values are `[16, NC]`, its candidates' rank
      compare `[NC, NC]` at every level; the append shares the launch); 0 takes select_warps.
    bsa_block_tile: leaf summaries per step of the BSA kernel's loops (a power of two >= 16).
    bsa_warps: warps of the BSA program (its dots are `[16, D] x [D, bsa_block_tile]`).
    attend_blocks: selected blocks per attention program (a power of two); 0 picks
      `default_attend_blocks`.
    attend_warps: warps of an attention program.
    append_warps: warps of an append program.
    num_stages: Triton software-pipelining stages (the leaf and attention loops).
  """

  select_warps: int = 1
  walk_warps: int = 0
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
    if self.bsa_block_tile < MIN_DOT:
      raise ValueError(f"bsa_block_tile={self.bsa_block_tile} must be >= {MIN_DOT} (dot size)")

  @classmethod
  def default(cls, *, head_dim: int, candidate_slots: int = 0) -> "DecodeConfig":
    """Heuristic, the fastest settings of sweeps inside a jitted decode loop (32/2 heads, d128
    K32 and d64 K8, 32K-1M cached tokens, B = 1 and 16): 4 warps for the selection's programs,
    the walk's launch on 8 warps from 64 candidate slots (on 4 below), two warps per attention
    program at d >= 128 (one below)."""
    return cls(select_warps=4, walk_warps=8 if candidate_slots >= 64 else 4,
               attend_warps=2 if head_dim >= 128 else 1)


def default_attend_blocks(batch: int, num_kv_heads: int, top_k: int, *,
                          target_programs: int = 512) -> int:
  """Selected blocks per attention program: split the B * HKV * K blocks over about
  `target_programs` programs (a few per SM of an H100/H200), one block each when that is few."""
  per = -(-batch * num_kv_heads * top_k // target_programs)
  return min(next_pow2(max(1, per)), next_pow2(top_k))
