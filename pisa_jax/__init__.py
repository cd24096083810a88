"""pisa-jax: PISA pyramid block-sparse attention with log-linear block selection, in JAX.

Public API (shapes follow `jax.nn.dot_product_attention`: q `[B, T, HQ, D]`, k/v `[B, T, HKV, D]`):
  build_pyramid      the mean-summary pyramid of the keys (Eq. 7-15)
  select_blocks      PISA / PISA-1 / PISA-2 / BSA / exact block selection -> int32 [B, T, HKV, K]
  sparse_attention   causal attention over selected blocks (Eq. 6)
  pisa_attention     selection under stop_gradient, then sparse attention
  selection_quality  Recall@K, captured mass and mass ratio against full attention (App. D.2)
Each takes `implementation="xla" | "pallas" | None` (selection_quality has only "xla": "pallas"
raises).

Packed documents: build_pyramid, select_blocks, sparse_attention and pisa_attention take
`segment_ids` `[B, T]` int32 (non-decreasing within a row; a document is a run of equal ids).
Every query then selects and attends as its document would alone from position 0, on the
document's own block grid, with document-relative block indices; build_pyramid returns a
`PackedPyramid` (`pisa_jax.segments` describes the layout and its static capacities). Both the
jnp reference ("xla") and the Pallas kernels ("pallas") take them, forward and backward.

Under `jax.jit` the arrays are traced and the options (sizes, names, scale) must be static: `jax.jit(pisa_jax.pisa_attention, static_argnames=("block_size", "top_k"))`, or bind them
with `functools.partial` first; a traced option raises a TypeError that says so. Block indices
passed in are checked eagerly; under `jit` they are checked when traced inside
`pisa_jax.traced_checks(True)` and run under `jax.experimental.checkify.checkify` (opt-in: a
check adds an effect that takes a jitted function off jax's fast C++ dispatch).

Decoding (Section 3.3 "Decoding", Appendix B "Decode cache"):
  DecodeCache        keys, values and the summary pyramid of a batch of rows of different lengths
  decode_step        one token per row: append, select, attend; `implementation=` as above
  generate           greedy or nucleus generation with any `DecodeModel` (models.Decoder is one)
"""

from pisa_jax._validation import traced_checks
from pisa_jax.attention import pisa_attention, sparse_attention
# Registers the "sparse_attention_packed" op that sparse_attention dispatches segment_ids to.
from pisa_jax import packed_attention  # noqa: F401
from pisa_jax.decode import DecodeCache, bucket_capacity, decode_step
from pisa_jax.generate import DecodeModel, Generation, generate, generate_stream
from pisa_jax.pyramid import Pyramid, build_pyramid
from pisa_jax.quality import SelectionQuality, selection_quality
from pisa_jax.segments import PackedPyramid
from pisa_jax.selection import select_blocks

__version__ = "0.1.0"

__all__ = [
    "DecodeCache",
    "DecodeModel",
    "Generation",
    "PackedPyramid",
    "Pyramid",
    "SelectionQuality",
    "bucket_capacity",
    "build_pyramid",
    "decode_step",
    "generate",
    "generate_stream",
    "pisa_attention",
    "select_blocks",
    "selection_quality",
    "sparse_attention",
    "traced_checks",
]
