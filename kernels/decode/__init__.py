"""Pallas (Triton) kernels for one decode step (Section 3.3 "Decoding", Eq. 30-31, Appendix B
"Decode cache"): the twins of `pisa_jax.decode.decode_append_reference`,
`decode_select_reference`, `decode_attention_reference` and `decode_step_reference`.

One decode step (`decode_step_pallas`) is four launches:
1. append and walk, two programs per (batch row, KV head) side by side. The append writes the
   new key and value at the row's own length, recomputes the current leaf's mean from its raw
   keys and then each ancestor's mean from its children (Eq. 15): O(C + g log N) rows read,
   O(log N) summaries written, in place (the cache buffers are aliased to the outputs). The
   walk (Eq. 30-31), all query heads of the GQA group as the rows of every dot, runs from the
   first level with more than `beam` eligible nodes down to the leaf candidates (Eq. 16-18),
   each level's candidates scored from their children's summaries (Eq. 21 / 33 / 34, summed
   over the group's heads, Eq. 22); it never needs what the append writes (those nodes are all
   forced).
2. the leaf scores from raw keys, one program per (row, KV head, candidate), so that at small B
   the up to NC - 3 leaves' key loads spread over the GPU.
3. Select_K and attention, split-K flash-decoding: program (row, KV head, split) keeps top_k
   leaves by Select_K (every split of a row ranks the same candidates) and runs an online
   softmax over its share of them, writing (o, m, l); split 0 also writes the indices and the
   row's new length. With one block per split, B = 1 still launches HKV * K programs.
4. the log-sum-exp merge of the splits, one program per query head.
`decode_select_pallas` runs the walk, the leaf scores and Select_K as three launches of their
own, `decode_attention_pallas` the attention and the merge. The flat BSA baseline selects in one
kernel, O(N / C) per step, as BSA is, after its own append.

  config.py     DecodeConfig and the attention split heuristic
  layout.py     Geometry (static shapes), the row layout, loads and stores, launch
  scoring.py    summary dots in float32, the reductions of Eq. 21 / 33 / 34 (shared math:
                `pisa_jax.kernels._common`)
  append.py     the append kernel (new key and value, leaf and ancestor summaries)
  select.py     the walk (the append in its launch), leaf-score and Select_K kernels (Select_K
                by rank), decode_select_pallas, decode_append_select_pallas
  bsa.py        the flat BSA kernel (two passes over the leaf summaries, running top-k)
  attention.py  the split-K attention kernel (its softmax loop shared) and the merge kernel
  step.py       the whole step: Select_K inside the attention's launch

Layout: the cache keeps the model's `[B, capacity, HKV, D]` layout, viewed as rows
`[B * capacity * HKV, D]`; the pyramid is one float32 array `[B, S, HKV, D]`, its levels stacked
leaves first along axis 1 (`pisa_jax.geometry.level_offsets`), viewed as rows too. Every
in-kernel value has power-of-two shapes: heads padded to Gp >= 16 rows, head dim to Dp, block to
Cp, candidates to NC.
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
from pisa_jax.kernels.decode.select import (SELECTORS, decode_append_select_pallas,
                                            decode_select_pallas)
from pisa_jax.kernels.decode.step import decode_step_pallas

__all__ = ["SELECTORS", "DecodeConfig", "decode_append_pallas", "decode_append_select_pallas",
           "decode_attention_pallas", "decode_select_pallas", "decode_step_pallas",
           "default_attend_blocks"]
