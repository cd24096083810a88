"""pisa-jax: PISA pyramid block-sparse attention with log-linear block selection, in JAX.

Public API (shapes follow `jax.nn.dot_product_attention`: q `[B, T, HQ, D]`, k/v `[B, T, HKV, D]`):
  build_pyramid      the mean-summary pyramid of the keys (Eq. 7-15)
  select_blocks      PISA / PISA-1 / PISA-2 / BSA / exact block selection -> int32 [B, T, HKV, K]
  sparse_attention   causal attention over selected blocks (Eq. 6)
  pisa_attention     selection under stop_gradient, then sparse attention
  selection_quality  Recall@K, captured mass and mass ratio against full attention (App. D.2)
  SelectionSpec      the selection's options (block size, top-k, branching, selector, scale,
                     beam) as one frozen value: every function above takes `spec=` or the keywords
  nsa_attention      Native Sparse Attention (Yuan et al., 2025): compressed, selected and
                     sliding-window branches, gated; its pieces nsa_compress,
                     compressed_attention, nsa_select_blocks, sliding_window_attention
                     (`pisa_jax.nsa`)
Each takes `implementation="xla" | "pallas" | None`; selection_quality, nsa_compress and NSA's
decode step have only "xla" ("pallas" raises, None means "xla"), compressed_attention,
nsa_select_blocks and sliding_window_attention have Pallas kernels as nsa_attention does.

HiLS (learned-landmark chunk routing with a two-level softmax, `pisa_jax.hils`), with
`segment_ids`; hils_attention and hils_select_chunks on Pallas kernels too, the others and the
decode step the jnp reference only ("pallas" raises, None means "xla"):
  hils_attention     a sliding window plus the top-k chunks before it, weighted by their scores
  hils_landmarks     each complete chunk's landmark key and entropy bias
  hils_chunk_scores  every query's score of every chunk before its window
  hils_select_chunks the chunks hils_attention attends to -> int32 [B, T, HKV, K]
  HiLSCache, hils_decode_step   its decode cache (keys, values, cached landmarks) and one step

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
check adds an effect that takes a jitted function off jax's fast C++ dispatch). Unchecked,
sparse_attention treats an out-of-range entry like -1, and an entry that repeats an earlier one
of its row like -1 too (each block counts once), in both implementations.

Decoding (Section 3.3 "Decoding", Appendix B "Decode cache"):
  DecodeCache        keys, values and the summary pyramid of a batch of rows of different lengths
  decode_step        one token per row: append, select, attend; `implementation=` as above
  generate           greedy or nucleus generation with any `DecodeModel` (models.Decoder is one)
  NSACache, nsa_decode_step   NSA's cache (keys, values, compressed tokens) and one step
"""

import importlib

# Names are imported on first use (PEP 562), so `import pisa_jax.configs` or a command line's
# argument parser does not pay for jax: a tool checks its arguments before importing the library.
_EXPORTS = {
    "CompressionMLP": "pisa_jax.nsa",
    "DecodeCache": "pisa_jax.decode",
    "DecodeModel": "pisa_jax.generation",
    "Generation": "pisa_jax.generation",
    "NSACache": "pisa_jax.nsa_decode",
    "HiLSCache": "pisa_jax.hils_decode",
    "PackedPyramid": "pisa_jax.segments",
    "Pyramid": "pisa_jax.pyramid",
    "SelectionQuality": "pisa_jax.quality",
    "SelectionSpec": "pisa_jax.spec",
    "bucket_capacity": "pisa_jax.decode",
    "build_pyramid": "pisa_jax.pyramid",
    "compressed_attention": "pisa_jax.nsa",
    "decode_step": "pisa_jax.decode",
    "generate": "pisa_jax.generation",
    "generate_stream": "pisa_jax.generation",
    "init_compression_mlp": "pisa_jax.nsa",
    "nsa_attention": "pisa_jax.nsa",
    "nsa_compress": "pisa_jax.nsa",
    "nsa_decode_step": "pisa_jax.nsa_decode",
    "nsa_select_blocks": "pisa_jax.nsa",
    "hils_attention": "pisa_jax.hils",
    "hils_chunk_scores": "pisa_jax.hils",
    "hils_decode_step": "pisa_jax.hils_decode",
    "hils_landmarks": "pisa_jax.hils",
    "hils_select_chunks": "pisa_jax.hils",
    "pisa_attention": "pisa_jax.attention",
    "select_blocks": "pisa_jax.selection",
    "selection_quality": "pisa_jax.quality",
    "sliding_window_attention": "pisa_jax.nsa",
    "sparse_attention": "pisa_jax.attention",
    "traced_checks": "pisa_jax._validation",
}

__version__ = "0.1.0"

__all__ = [
    "CompressionMLP",
    "DecodeCache",
    "DecodeModel",
    "Generation",
    "NSACache",
    "HiLSCache",
    "PackedPyramid",
    "Pyramid",
    "SelectionQuality",
    "SelectionSpec",
    "bucket_capacity",
    "build_pyramid",
    "compressed_attention",
    "decode_step",
    "generate",
    "generate_stream",
    "init_compression_mlp",
    "nsa_attention",
    "nsa_compress",
    "nsa_decode_step",
    "nsa_select_blocks",
    "hils_attention",
    "hils_chunk_scores",
    "hils_decode_step",
    "hils_landmarks",
    "hils_select_chunks",
    "pisa_attention",
    "select_blocks",
    "selection_quality",
    "sliding_window_attention",
    "sparse_attention",
    "traced_checks",
]


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'pisa_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))

