"""The decoder's config type: `ModelConfig`, and the attention kinds it accepts.

It sits beside the model it describes; `pisa_jax.configs` groups it with the data and training
sections into a run's `Config` and validates the whole.
"""

from __future__ import annotations

import dataclasses
import math

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
# RoPE frequency scaling (`ModelConfig.rope_scaling`): none, every frequency divided by the factor
# ("linear"), or Llama 3.1's band-wise rule ("llama3").
ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only LM (Appendix C.1): pre-RMSNorm, SiLU-gated MLP, RoPE, GQA, untied embeddings.

  The fields after `norm_eps` describe the pretrained architectures that
  `pisa_jax.models.load_pretrained` imports (Llama, SmolLM2, Qwen2, Qwen3); their defaults are the
  paper's model.
  """

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
  # RoPE rotates the first R = rope_fraction * head_dim dims of each head in rotate-half pairs
  # (j, j + R/2) at the R/2 highest frequencies of a full RoPE over the head, base^(-2j/D):
  # 0.5 is the paper's high-frequency half (Appendix C.1), 1.0 a full RoPE (Llama, Qwen).
  rope_fraction: float = 0.5
  # HoPE's cut (the public HiLS code's in-range RoPE): of the pairs rope_fraction rotates, only
  # those whose period 2 pi base^(2j/D) (before rope_scaling) is at most rope_max_period tokens,
  # and always the first; 0: no cut. rope_fraction=1.0 with rope_max_period=4096 is HiLS's public
  # setting (a training length of 8,192 over its period multiplier 2): 23 of 32 pairs at D = 64
  # and base 10,000, the same rotated set as rope_fraction=0.71875.
  rope_max_period: float = 0.0
  # One of ROPE_SCALINGS. "linear" divides every frequency by rope_scaling_factor; "llama3"
  # divides the frequencies whose wavelength exceeds rope_original_context / rope_low_freq_factor
  # by it, keeps those shorter than rope_original_context / rope_high_freq_factor, and
  # interpolates between (Llama 3.1's rule).
  rope_scaling: str = "none"
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_context: int = 8192
  # The output projection is the input embedding's transpose (no lm_head parameter).
  tie_embeddings: bool = False
  # Biases of the q, k and v projections (Qwen2) and of the output projection.
  qkv_bias: bool = False
  out_bias: bool = False
  # RMSNorm over head_dim of every query and key head before RoPE, one scale per layer (Qwen3).
  qk_norm: bool = False
  init_std: float = 0.02
  attention: str = "pisa"
  block_size: int = 64
  top_k: int = 8
  branching: int = 2
  beam: int | None = None
  # The dtype the PISA pyramid's summaries are stored in, prefill selection and decode cache
  # alike: "float32" or "bfloat16" (half the pyramid's memory and the decode walk's loads; each
  # mean computed in float32 and rounded once). Not with packed documents (data.packing).
  summary_dtype: str = "float32"
  # The kernels of the forward and backward passes and of the prefill: "xla", "pallas", or None
  # (pallas on a GPU). NSA's and HiLS's decode steps have the jnp step only, under any value.
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

  @property
  def rotary_dims(self) -> int:
    """R: the leading dims of each head that RoPE rotates (`rope_fraction * head_dim`, less the
    pairs whose period exceeds `rope_max_period`)."""
    pairs = int(round(self.rope_fraction * self.head_dim)) // 2
    if self.rope_max_period > 0:
      # Pair j turns at base^(-2j/D) radians a token: kept while 2 pi / that <= the cut.
      pairs = max(1, sum(1 for j in range(pairs) if
                         2 * math.pi * self.rope_base ** (2 * j / self.head_dim)
                         <= self.rope_max_period))
    return 2 * pairs


def check_architecture(m: ModelConfig) -> None:
  """Raises ValueError naming the field for an impossible RoPE or architecture field (jax-free).

  The checks of the fields that pretrained architectures set (RoPE's fraction and scaling); the
  rest of the model section is checked by `pisa_jax.configs.validate`.
  """
  r = m.rope_fraction * m.head_dim
  if not 0 < m.rope_fraction <= 1 or abs(r - round(r)) > 1e-9 or round(r) % 2:
    raise ValueError(f"model.rope_fraction={m.rope_fraction} must be in (0, 1] and make "
                     f"rope_fraction * head_dim (head_dim={m.head_dim}) an even number of dims: "
                     f"RoPE rotates pairs")
  if not m.rope_max_period >= 0:
    raise ValueError(f"model.rope_max_period={m.rope_max_period} must be >= 0 (0: no cut)")
  if m.rope_scaling not in ROPE_SCALINGS:
    raise ValueError(f"model.rope_scaling={m.rope_scaling!r} must be one of {ROPE_SCALINGS}")
  if m.rope_scaling != "none" and not m.rope_scaling_factor >= 1:
    raise ValueError(f"model.rope_scaling_factor={m.rope_scaling_factor} must be >= 1 with "
                     f"model.rope_scaling={m.rope_scaling!r}")
  if m.rope_scaling == "llama3":
    if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
      raise ValueError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be > 0 and < "
                       f"model.rope_high_freq_factor={m.rope_high_freq_factor} (llama3 scaling)")
    if m.rope_original_context < 1:
      raise ValueError(f"model.rope_original_context={m.rope_original_context} must be >= 1")
