"""The decoder's config type: `ModelConfig`, and the attention kinds it accepts.

It sits beside the model it describes; `pisa_jax.configs` groups it with the data and training
sections into a run's `Config` and validates the whole.
"""

from __future__ import annotations

import dataclasses

ATTENTION_KINDS = ("dense", "pisa", "pisa1", "pisa2", "bsa", "nsa", "hils")
# The sparse kinds are `pisa_jax.pisa_attention` selectors (not "exact": the O(T^2) oracle);
# "nsa" is `pisa_jax.nsa_attention`, sized by the nsa_* fields; "hils" is
# `pisa_jax.hils_attention`, sized by the hils_* fields.
SPARSE_ATTENTION_KINDS = ("pisa", "pisa1", "pisa2", "bsa")
PARAM_DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
# What each decoder block keeps for the backward pass, most memory first (`decoder.REMAT_POLICIES`
# says what each saves and recomputes, and its memory a layer). Every policy keeps the selected
# block indices; the "save_attention" ones the attention's output and log-sum-exp too.
REMAT_POLICIES = ("none", "dots_save_attention", "dots", "dots_except_mlp",
                  "full_save_attention", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only LM (Appendix C.1): pre-RMSNorm, SiLU-gated MLP, RoPE, GQA, untied embeddings."""

  vocab_size: int = 50_257
  # Embedding and output rows are padded up to a multiple of this (50,257 -> 50,432, as the paper).
  vocab_pad_multiple: int = 256
  num_layers: int = 24
  d_model: int = 1024
  mlp_dim: int = 2816
  num_heads: int = 32
  num_kv_heads: int = 2
  head_dim: int = 64
  rope_base: float = 10_000.0
  norm_eps: float = 1e-5
  init_std: float = 0.02
  attention: str = "pisa"
  block_size: int = 64
  top_k: int = 8
  branching: int = 2
  beam: int | None = None
  attention_implementation: str | None = None
  param_dtype: str = "float32"
  # "auto": bfloat16 on a GPU, float32 elsewhere (CPU matmuls in bf16 are slow and emulated).
  compute_dtype: str = "auto"
  # Rematerialisation of each block in the backward pass: one of REMAT_POLICIES. Every policy
  # keeps the selected block indices (4 HKV K bytes a token and layer): no block selects twice.
  # "dots_save_attention" / "full_save_attention" also keep the attention output and log-sum-exp
  # (2 HQ D + 4 HQ bytes), so the backward does not run the attention forward again either.
  # `decoder.REMAT_POLICIES` lists what each keeps and recomputes, with its bytes.
  remat: str = "none"
  # attention="nsa" (`pisa_jax.nsa_attention`; block_size, top_k, branching and beam are PISA's):
  # compression "mlp" or "mean" (then nsa_stride = nsa_block_length), compressed blocks of l =
  # nsa_block_length tokens at stride d = nsa_stride, n = nsa_top_n selected blocks of l' =
  # nsa_select_block_size tokens, a window of w = nsa_window tokens. NSA's defaults; the
  # paper's comparison (Appendix C) selects C = 64, K = 8.
  nsa_compression: str = "mlp"
  nsa_block_length: int = 32
  nsa_stride: int = 16
  nsa_select_block_size: int = 64
  nsa_top_n: int = 16
  nsa_window: int = 512
  # attention="hils" (`pisa_jax.hils_attention`; block_size, top_k, branching and beam are
  # PISA's): chunks of hils_chunk_size tokens, hils_top_k of them per query beside a window of
  # hils_window keys, landmark queries from a rank-hils_landmark_rank correction of the query
  # projection. The public implementation's defaults (chunk 64, top-k 32, window 512, rank 64).
  hils_chunk_size: int = 64
  hils_top_k: int = 32
  hils_window: int = 512
  hils_landmark_rank: int = 64

  @property
  def padded_vocab_size(self) -> int:
    m = self.vocab_pad_multiple
    return -(-self.vocab_size // m) * m
