"""Pallas (Triton) kernels for one decode step (Section 3.3 "Decoding", Eq. 30-31, Appendix B
"Decode cache"): the twins of `pisa_jax.decode.decode_append_reference`,
`decode_select_reference`, `decode_attention_reference` and `decode_step_reference`.

One decode step (`decode_step_pallas`) is three launches:
1. the append and the walk, one program per (batch row, KV head). The append writes the new key
   and value at the row's own length, recomputes the current leaf's mean from its raw keys and
   then each ancestor's mean from its children (Eq. 15): O(C + g log N) rows read, O(log N)
   summaries written, in place (the cache buffers are aliased to the outputs). The walk (Eq.
   30-31), all query heads of the GQA group as the rows of every dot, runs from the first level
   with more than `beam` eligible nodes down to the leaf candidates (Eq. 16-18), each level's
   candidates scored from their children's summaries (Eq. 21 / 33 / 34, summed over the group's
   heads, Eq. 22). It never reads what the append wrote (those nodes are forced).
2. one program per (row, KV head, candidate leaf), so that at small B the leaves' loads spread over
   the GPU: the leaf's score from its raw keys where Select_K needs it and, from the same dot, its
   attention partial (Eq. 6 over its keys j <= t: max, sum, unnormalised output).
3. one program per (row, KV head): Select_K of the leaves, then the log-sum-exp merge of the kept
   leaves' partials (split-K flash-decoding with one block per split).
The flat BSA baseline selects in one kernel, O(N / C) per step, as BSA is, after its own append,
and attends with the split-K attention kernel (program (row, KV head, split) over its share of
the K selected blocks, merged by log-sum-exp in jnp). The append, the selection and the attention
are also ops of their own (`decode_append_pallas`, `decode_select_pallas`,
`decode_attention_pallas`), each the twin of its reference.

  config.py     DecodeConfig and the attention split heuristic
  layout.py     Geometry (static shapes), the row layout, loads and stores, launch
  scoring.py    dots in float32, the reductions of Eq. 21 / 33 / 34, ranking keys
  append.py     the append kernel (new key and value, leaf and ancestor summaries)
  select.py     the walk, leaf-score and Select_K kernels (Select_K by rank),
                decode_select_pallas
  bsa.py        the flat BSA kernel (two passes over the leaf summaries, running top-k)
  attention.py  the split-K attention kernel and the log-sum-exp merge
  step.py       the step's leaf-partial and Select_K + merge launches, decode_step_pallas

Layout: the cache keeps the model's `[B, capacity, HKV, D]` layout, viewed as rows
`[B * capacity * HKV, D]`; the pyramid is one float32 array `[B, S, HKV, D]`, its levels stacked
leaves first along axis 1 (`level_offsets`), viewed as rows too. Every in-kernel value has
power-of-two shapes: heads padded to Gp >= 16 rows, head dim to Dp, block to Cp, candidates to NC.
Out-of-range rows are clamped and masked (interpret mode clamps; the GPU would read garbage).

Scores are float32. 16-bit queries and keys of one dtype meet in a tensor-core dot (exact
products, float32 accumulation); bfloat16 queries meet the float32 summaries as two dots against
the summary's bfloat16 high part (its bits truncated, so exactly representable) and the rounded
remainder (~2^-17 relative error, the prefill kernels' "split" mode); anything else is upcast to
float32 and dotted at IEEE precision.
"""

from pisa_jax.kernels.decode.append import decode_append_pallas
from pisa_jax.kernels.decode.attention import decode_attention_pallas
from pisa_jax.kernels.decode.config import DecodeConfig, default_attend_blocks
from pisa_jax.kernels.decode.layout import level_offsets
from pisa_jax.kernels.decode.select import (SELECTORS, decode_append_select_pallas,
                                            decode_select_pallas)
from pisa_jax.kernels.decode.step import decode_step_pallas

__all__ = ["SELECTORS", "DecodeConfig", "decode_append_pallas", "decode_append_select_pallas",
           "decode_attention_pallas", "decode_select_pallas", "decode_step_pallas",
           "default_attend_blocks", "level_offsets"]
