"""Every op's implementations, registered in one place.

`_dispatch.lookup` imports this module before its first lookup, so which implementations exist
never depends on which modules a program happened to import, nor in what order. An op's "xla"
implementation is its jnp reference, its "pallas" one the kernel twin with the reference's
signature (`_dispatch.with_interpret` picks the interpreter off the GPU). A new backend or a new
op is one more `register` call here.
"""

from __future__ import annotations

from pisa_jax import (attention, decode, hils, hils_decode, nsa, nsa_decode, pyramid, quality,
                      selection)
from pisa_jax._dispatch import register, with_interpret
from pisa_jax.kernels import attention as attention_kernels
from pisa_jax.kernels import decode as decode_kernels
from pisa_jax.kernels import packed_pyramid as packed_pyramid_kernels
from pisa_jax.kernels import pyramid as pyramid_kernels
from pisa_jax.kernels import selection as selection_kernels

# The pyramid (Eq. 7-15), of one document or of packed ones.
register("build_pyramid", xla=pyramid.build_pyramid_reference,
         pallas=with_interpret(pyramid_kernels.build_pyramid_pallas))
register("build_pyramid_packed", xla=pyramid.build_packed_pyramid_reference,
         pallas=with_interpret(packed_pyramid_kernels.build_packed_pyramid_pallas))

# Block selection: the whole sequence, packed documents, a sequence shard at an offset.
register("select_blocks", xla=selection.select_blocks_reference,
         pallas=with_interpret(selection_kernels.select_blocks_pallas))
register("select_blocks_packed", xla=selection.select_blocks_packed_reference,
         pallas=with_interpret(selection.select_blocks_packed_pallas))
register("select_blocks_offset", xla=selection.select_blocks_reference_offset,
         pallas=with_interpret(selection_kernels.select_blocks_pallas_at))

# Sparse attention (Eq. 6), as selection.
register("sparse_attention", xla=attention.sparse_attention_reference,
         pallas=with_interpret(attention_kernels.sparse_attention_pallas))
register("sparse_attention_packed", xla=attention.sparse_attention_packed_reference,
         pallas=with_interpret(attention_kernels.sparse_attention_packed_pallas))
register("sparse_attention_offset", xla=attention.sparse_attention_reference_at,
         pallas=with_interpret(attention_kernels.sparse_attention_pallas_at))

# Decoding: the cache update, the selection, the attention, the step's append and selection,
# and the whole step (`pisa_jax.decode`).
register("decode_append", xla=decode.decode_append_reference,
         pallas=with_interpret(decode_kernels.decode_append_pallas))
register("decode_select", xla=decode.decode_select_reference,
         pallas=with_interpret(decode_kernels.decode_select_pallas))
register("decode_append_select", xla=decode.decode_append_select_reference,
         pallas=with_interpret(decode_kernels.decode_append_select_pallas))
register("decode_step", xla=decode.decode_step_reference,
         pallas=with_interpret(decode_kernels.decode_step_pallas))
register("decode_attention", xla=decode.decode_attention_reference,
         pallas=with_interpret(decode_kernels.decode_attention_pallas))

# Selection quality against full attention (reference only).
register("selection_quality", xla=quality.selection_quality_reference)

# NSA: the compressed attention and the window on the range kernel (the window on cuDNN where
# it takes the arguments), the selection of unpacked rows on its kernel, the selected branch on
# `sparse_attention`'s; compression and the decode step in the reference only.
register("nsa_compress", xla=nsa.nsa_compress_reference)
register("nsa_compressed_attention", xla=nsa.compressed_attention_reference,
         pallas=with_interpret(nsa.compressed_attention_pallas))
register("nsa_select_blocks", xla=nsa.nsa_select_blocks_reference,
         pallas=with_interpret(nsa.nsa_select_blocks_pallas))
register("sliding_window_attention", xla=nsa.sliding_window_attention_reference,
         pallas=with_interpret(nsa.sliding_window_attention_pallas))
register("nsa_attention", xla=nsa.nsa_attention_reference,
         pallas=with_interpret(nsa.nsa_attention_pallas))
register("nsa_decode_step", xla=nsa_decode.nsa_decode_step_reference)

# HiLS: landmarks, chunk scores and selection, the two-level softmax, its decode step (reference).
register("hils_landmarks", xla=hils.hils_landmarks_reference)
register("hils_chunk_scores", xla=hils.hils_chunk_scores_reference)
register("hils_select_chunks", xla=hils.hils_select_chunks_reference,
         pallas=with_interpret(hils.hils_select_chunks_pallas))
register("hils_attention", xla=hils.hils_attention_reference,
         pallas=with_interpret(hils.hils_attention_pallas))
register("hils_decode_step", xla=hils_decode.hils_decode_step_reference)
