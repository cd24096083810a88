"""Pallas kernels for block selection (Section 3.3, Algorithm 1, Appendix B): the twin of
`pisa_jax.selection.select_blocks_reference` for "pisa", "pisa1", "pisa2" and "bsa".

  config.py     SelectionConfig and its default heuristic
  layout.py     Geometry (static shapes), the row layout, loads, level table, launch
  scoring.py    dots in float32 and the reductions of Eq. 21 / 33 / 34
  topk.py       in-kernel Select_K (passes and rank) and the Eq. 18 expansion
  walk.py       one query's walk from the first scored level down to level 2
  fused.py      per-query kernel: walk, leaf scores and final Select_K in one program
  two_stage.py  walk kernel, leaf tiles (host sort: a kept level-2 node's g leaves a tile; one
                leaf a tile for packed rows), final top-k kernel
  bsa.py        the flat BSA kernel (two passes, running top-k, no [T, M] in HBM)
  select.py     select_blocks_pallas (and _at, a sequence shard's): geometry, config, dispatch
  packed_walk.py  packed documents (segment_ids), per-query document geometry: the fused walk
                (NC = 16), and the walk + two_stage's leaf tiles and top-k for wider sets
  packed.py     the flat BSA scores of packed documents
"""

from pisa_jax.kernels.selection.config import SelectionConfig, candidate_slots
from pisa_jax.kernels.selection.layout import Geometry, make_geometry
from pisa_jax.kernels.selection.select import (SELECTORS, select_blocks_pallas,
                                               select_blocks_pallas_at)

__all__ = ["SELECTORS", "Geometry", "SelectionConfig", "candidate_slots", "make_geometry",
           "select_blocks_pallas", "select_blocks_pallas_at"]
