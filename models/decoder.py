"""Decoder-only language model in Flax NNX (Appendix C.1, Table 5).

Pre-RMSNorm blocks with GQA attention and a SiLU-gated MLP, no dropout, untied input and output
embeddings padded to a multiple of `vocab_pad_multiple` rows (50,257 -> 50,432), RoPE on the
high-frequency half of each head. Pretrained architectures (`pisa_jax.models.load_pretrained`)
set the config's RoPE fraction and scaling, tied embeddings, projection biases and q/k RMSNorm
(`ModelConfig`); the defaults are the paper's model. The attention is dense
(`jax.nn.dot_product_attention`), block-sparse through `pisa_jax.pisa_attention` (PISA, PISA-1,
PISA-2, BSA), NSA through `pisa_jax.nsa_attention` (its gates and compression MLPs are the
layer's), or HiLS through `pisa_jax.hils_attention` (its landmark-query projection is the
layer's), chosen by the config.
Packed documents: with `segment_ids` `[B, T]` (a document is a run of equal ids) no token attends
across a document boundary, in either kind, and RoPE positions restart at 0 with each document,
so each document's activations are the ones it would have alone.

Parameters are stored in `param_dtype`; matmuls run in the compute dtype (bfloat16 on a GPU), while
RMSNorm, RoPE angles, softmax statistics and the logits are float32. Each parameter carries
`logical_axes` metadata that `pisa_jax.models.sharding.LOGICAL_AXIS_RULES` maps to the mesh.
Under a mesh with a "seq" axis the sequence of every activation is split over it, and attention
gathers the keys and values (`pisa_jax.models.context_parallel`).
Each block can be rematerialised in the backward pass under a named policy (`model.remat`,
`REMAT_POLICIES`), and training reads `hidden_states` to compute the loss without `[B, T, Vp]`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

import pisa_jax
from pisa_jax import _validation, checkpoint_names
from pisa_jax.decode import DecodeCache, bucket_capacity, decode_step
from pisa_jax.decode_cache import append_chunk, last_document
from pisa_jax.hils_decode import HiLSCache, hils_decode_step, hils_prefill_chunk
from pisa_jax.context_parallel import pisa_attention_at
from pisa_jax.models.config import SPARSE_ATTENTION_KINDS, ModelConfig
from pisa_jax.models.context_parallel import sequence_axis, sequence_sharded_attention
from pisa_jax.models.sharding import axes_size, batch_axes_of, constrain_batch
from pisa_jax.nsa import CompressionMLP
from pisa_jax.nsa_decode import NSACache, nsa_decode_step, nsa_prefill_chunk
from pisa_jax.segments import document_bounds

# NSA's and HiLS's decode steps have one implementation, the jnp step (one query a row: gathers
# and small dots, `pisa_jax._ops`), whatever model.attention_implementation picks for the
# prefill's and training's kernels.
_ONE_STEP = "xla"

# Logit given to the padding rows of the output embedding: they never win and carry no mass.
_PAD_LOGIT = -1e9


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
  """bfloat16 on a GPU and float32 elsewhere for "auto", else the named dtype."""
  if cfg.compute_dtype == "auto":
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  return jnp.dtype(cfg.compute_dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(key, shape: tuple[int, ...], std: float):
  """std * N(0, 1) `shape`, float32. Its own jit: a model built eagerly (`Trainer.init_state`)
  compiles each distinct (shape, std) once, and its bits equal the draw inside a jitted build."""
  return std * jax.random.normal(key, shape, jnp.float32)


def _normal(rngs: nnx.Rngs, shape, std: float, dtype, axes: tuple[str, ...]) -> nnx.Param:
  value = _draw(rngs.params(), tuple(shape), float(std))
  return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
  """RMSNorm with a learned scale, computed in float32."""

  def __init__(self, dim: int, eps: float, param_dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))

  def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


# Positions are split into base-2^8 digits; 4 digits cover every non-negative int32 position.
_ROPE_DIGIT_BITS = 8
_ROPE_DIGITS = 4


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """Which dims of a head RoPE rotates and at which frequencies (`ModelConfig`'s RoPE fields).

  Dims [0, R) rotate in rotate-half pairs (j, j + R/2), j < R/2, at frequency inv_freq[j] =
  base^(-2j/D) (the R/2 highest of a full RoPE over the D dims of the head), then scaled; dims
  [R, D) carry no position. R = D/2 is the paper's (Appendix C.1), R = D a full RoPE (Llama, Qwen).
  """

  head_dim: int
  base: float
  rotary_dims: int
  scaling: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_context: int = 8192

  @classmethod
  def of(cls, cfg: ModelConfig) -> "RopeSpec":
    return cls(head_dim=cfg.head_dim, base=float(cfg.rope_base), rotary_dims=cfg.rotary_dims,
               scaling=cfg.rope_scaling, factor=float(cfg.rope_scaling_factor),
               low_freq_factor=float(cfg.rope_low_freq_factor),
               high_freq_factor=float(cfg.rope_high_freq_factor),
               original_context=int(cfg.rope_original_context))

  def inv_freq(self) -> np.ndarray:
    """float64 `[R/2]`: the frequency (radians per position) of each rotated pair."""
    inv = self.base ** (-2.0 * np.arange(self.rotary_dims // 2, dtype=np.float64)
                        / self.head_dim)
    if self.scaling == "linear":
      return inv / self.factor
    if self.scaling == "llama3":
      # Llama 3.1: long wavelengths (low frequencies) are divided by the factor, short ones kept,
      # the band between interpolated in the ratio original_context / wavelength.
      wavelength = 2 * np.pi / inv
      smooth = ((self.original_context / wavelength - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor))
      scaled = (1 - smooth) * inv / self.factor + smooth * inv
      scaled = np.where(wavelength < self.original_context / self.high_freq_factor, inv, scaled)
      return np.where(wavelength > self.original_context / self.low_freq_factor,
                      inv / self.factor, scaled)
    if self.scaling != "none":
      raise ValueError(f"model.rope_scaling={self.scaling!r} is unknown")
    return inv

  def at(self, positions: Int[Array, "*N"]) -> tuple[Array, Array]:
    """cos, sin float32 `[*N, R/2]` at integer `positions` in [0, 2^31) (see `rope_at`)."""
    return _rope_at(positions, self)

  def angles(self, seq_len: int) -> tuple[Array, Array]:
    """cos, sin `[T, R/2]` at positions 0 .. T-1."""
    return _rope_at(jnp.arange(seq_len, dtype=jnp.int32), self)


@functools.cache
def _rope_digit_tables(spec: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
  """cos, sin float32 `[digits, 256, R/2]` of the angle d * 256^i * inv_freq, made in float64."""
  inv_freq = spec.inv_freq()
  radix = 1 << _ROPE_DIGIT_BITS
  place = float(radix) ** np.arange(_ROPE_DIGITS, dtype=np.float64)
  # [digits, 256, R/2]; reduced mod 2 pi in float64 before cos and sin see it.
  angle = np.mod(place[:, None, None] * np.arange(radix, dtype=np.float64)[None, :, None]
                 * inv_freq, 2 * np.pi)
  return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rope_at(positions: Int[Array, "*N"], head_dim: int, base: float) -> tuple[Array, Array]:
  """cos, sin float32 `[*N, D/4]` of RoPE's angles at integer `positions` in [0, 2^31), for the
  paper's RoPE on the high-frequency half of a head (`RopeSpec.at` for any other).

  A float32 angle position * inv_freq rounds the position itself past 2^24 (2^24 + 1 and 2^24
  share one rotation) and, long before that, leaves an absolute error of the angle's own rounding
  (a sixteenth of a radian at 2^20 for the fastest frequency). Instead the position is split into
  base-256 digits p = sum_i d_i 256^i, each digit's rotation is looked up in a float64-made table,
  and the rotations are composed by the angle-sum formula: cos and sin come out within a few float32
  roundings of their float64 values at every position, the positions stay exact integers.
  """
  return _rope_at(positions, RopeSpec(head_dim=head_dim, base=float(base),
                                      rotary_dims=head_dim // 2))


def _rope_at(positions, spec: RopeSpec) -> tuple[Array, Array]:
  cos_table, sin_table = _rope_digit_tables(spec)
  positions = jnp.asarray(positions, jnp.int32)
  mask = (1 << _ROPE_DIGIT_BITS) - 1
  cos = sin = None
  for i in range(_ROPE_DIGITS):
    digit = (positions >> (_ROPE_DIGIT_BITS * i)) & mask
    c, s = jnp.asarray(cos_table[i])[digit], jnp.asarray(sin_table[i])[digit]
    # cos(a + b) and sin(a + b): the digits' rotations compose.
    cos, sin = (c, s) if cos is None else (cos * c - sin * s, sin * c + cos * s)
  return cos, sin


def rope_angles(seq_len: int, head_dim: int, base: float) -> tuple[Array, Array]:
  """cos, sin `[T, D/4]` for RoPE on the high-frequency half of a head (Appendix C.1).

  A full RoPE over D dims has D/2 frequencies base^(-2i/D); we keep the highest D/4 of them
  (i < D/4) and rotate only the first D/2 dims of each head, leaving the other half position-free.
  Positions 0 .. T-1, exact at any T (see `rope_at`).
  """
  return rope_at(jnp.arange(seq_len, dtype=jnp.int32), head_dim, base)


def apply_rope(x: Float[Array, "B T H D"], cos: Array, sin: Array) -> Float[Array, "B T H D"]:
  """Rotates dims [0, R) of each head in rotate-half pairs (j, j + R/2), R = 2 * cos.shape[-1]
  (D/2 with `rope_angles`' tables); float32 arithmetic.

  cos, sin: `[T, R/2]` shared by the batch, or `[B, T, R/2]` (per-row positions: packed
  documents).
  """
  quarter = cos.shape[-1]
  half = 2 * quarter
  xf = x[..., :half].astype(jnp.float32)
  x1, x2 = xf[..., :quarter], xf[..., quarter:]
  if cos.ndim == 2:
    c, s = cos[None, :, None, :], sin[None, :, None, :]
  else:
    c, s = cos[:, :, None, :], sin[:, :, None, :]
  rotated = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
  return jnp.concatenate([rotated.astype(x.dtype), x[..., half:]], axis=-1)


def per_batch_shard(fn):
  """Runs `fn(q, k, v, ...)` on each device's slice of the batch under the ambient mesh: every
  argument's leading axis is the batch.

  The Pallas kernels are custom calls that XLA's SPMD partitioner cannot split: under a plain
  sharded `jit` it would gather the whole batch onto every device and run the kernel replicated.
  cuDNN's attention has a partitioner, but one that fails unless q, k and v share one sharding.
  Attention is independent per example, so a `shard_map` over the batch axes is exact. Without a
  mesh (or on one device) `fn` runs as it is.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = batch_axes_of(mesh)
  if axes is None:
    return fn
  spec = P(axes)
  ways = axes_size(mesh, axes)

  def checked(*arrays):
    if arrays[0].shape[0] % ways:
      raise ValueError(f"batch size {arrays[0].shape[0]} must be divisible by the {ways} devices "
                       f"of mesh axes {axes}: attention runs on each device's slice of the batch")
    # check_vma=False: the kernels' outputs carry no varying-manual-axes annotation.
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec,
                            check_vma=False)
    return sharded(*arrays)

  return checked


def _saveable(name: str, projection: Array) -> Array:
  """A projection's output, batch-sharded and named for the remat policies (`REMAT_POLICIES`)."""
  return checkpoint_name(constrain_batch(projection), name)


class Attention(nnx.Module):
  """GQA self-attention; dense or block-sparse by `cfg.attention`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = jnp.dtype(cfg.param_dtype)
    d, hq, hkv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.wq = _normal(rngs, (d, hq, hd), std, pdt, ("embed", "q_heads", "head_dim"))
    self.wk = _normal(rngs, (d, hkv, hd), std, pdt, ("embed", "kv_heads", "head_dim"))
    self.wv = _normal(rngs, (d, hkv, hd), std, pdt, ("embed", "kv_heads", "head_dim"))
    # Pretrained architectures' extras (none by default); they draw no random numbers, so the
    # other parameters are the same with or without them.
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((hq, hd), pdt), logical_axes=("q_heads", "head_dim"))
      self.bk = nnx.Param(jnp.zeros((hkv, hd), pdt), logical_axes=("kv_heads", "head_dim"))
      self.bv = nnx.Param(jnp.zeros((hkv, hd), pdt), logical_axes=("kv_heads", "head_dim"))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.norm_eps, pdt)
      self.k_norm = RMSNorm(hd, cfg.norm_eps, pdt)
    if cfg.out_bias:
      self.bo = nnx.Param(jnp.zeros((d,), pdt), logical_axes=("norm",))
    # GPT-2's residual-branch scaling of the output projection.
    self.wo = _normal(rngs, (hq, hd, d), out_std, pdt, ("q_heads", "head_dim", "embed"))
    if cfg.attention == "nsa":
      # NSA's gates (Eq. 5), sigmoid(x wg): one per head for each of its three branches.
      self.wg = _normal(rngs, (d, hq, 3), std, pdt, ("embed", "q_heads", None))
      if cfg.nsa_compression == "mlp":
        self.key_compressor = Compressor(cfg, rngs=rngs)
        self.value_compressor = Compressor(cfg, rngs=rngs)
    if cfg.attention == "hils":
      # HiLS's landmark query: the query projection plus a rank-r correction (x A) B.
      rank = cfg.hils_landmark_rank
      self.wl_down = _normal(rngs, (d, rank), std, pdt, ("embed", None))
      self.wl_up = _normal(rngs, (rank, hq, hd), std, pdt, (None, "q_heads", "head_dim"))

  def __call__(self, x: Float[Array, "B T E"], cos: Array, sin: Array,
               segment_ids: Int[Array, "B T"] | None = None) -> Float[Array, "B T E"]:
    """Self-attention of x; with segment_ids `[B, T]`, only within each token's document."""
    cfg, cdt = self.cfg, x.dtype
    q = _saveable("query_proj", jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(cdt)))
    k = _saveable("key_proj", jnp.einsum("bte,ehd->bthd", x, self.wk[...].astype(cdt)))
    v = _saveable("value_proj", jnp.einsum("bte,ehd->bthd", x, self.wv[...].astype(cdt)))
    q, (k, v) = self._finish_q(q), self._finish_kv(k, v)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.attention == "hils":
      out = self._hils(x, q, k, v, cos, sin, segment_ids)
    elif sequence_axis() is not None:
      # Context parallelism: each device attends with its own queries to the gathered keys.
      out = sequence_sharded_attention(cfg, q, k, v, segment_ids)
    elif cfg.attention == "dense":
      # cuDNN's fused kernel takes bf16/fp16 only; the XLA path keeps float32 softmax statistics.
      use_cudnn = jax.default_backend() == "gpu" and cdt in (jnp.bfloat16, jnp.float16)
      attend = functools.partial(
          jax.nn.dot_product_attention, is_causal=True,
          implementation="cudnn" if use_cudnn else "xla",
      )
      # Per device too: cuDNN's SPMD partitioner rejects q, k, v whose propagated shardings differ
      # ("Query, key and value should have same sharding"), which they do under an fsdp mesh
      # (seen on 2 H200s, 2026-11-29).
      if segment_ids is None:
        out = per_batch_shard(attend)(q, k, v)
      else:
        out = per_batch_shard(functools.partial(_attend_within_documents, attend))(
            q, k, v, segment_ids)
    elif cfg.attention in SPARSE_ATTENTION_KINDS:
      attend = functools.partial(
          pisa_jax.pisa_attention, block_size=cfg.block_size, top_k=cfg.top_k,
          branching=cfg.branching, selector=cfg.attention, beam=cfg.beam,
          summary_dtype=cfg.summary_dtype, implementation=cfg.attention_implementation,
      )
      if segment_ids is None:
        out = per_batch_shard(attend)(q, k, v)
      else:
        out = per_batch_shard(lambda q, k, v, ids: attend(q, k, v, segment_ids=ids))(
            q, k, v, segment_ids)
    elif cfg.attention == "nsa":
      out = self._nsa(x, q, k, v, segment_ids)
    else:
      raise ValueError(f"model.attention={cfg.attention!r} is unknown")
    chex.assert_shape(out, q.shape)  # [B, T, HQ, D]
    return self._out_bias(_saveable(
        "out_proj", jnp.einsum("bthd,hde->bte", out.astype(cdt), self.wo[...].astype(cdt))))

  def _finish_q(self, q: Float[Array, "B T HQ D"]) -> Float[Array, "B T HQ D"]:
    """The query projection's bias and RMSNorm (`qkv_bias`, `qk_norm`), applied before RoPE."""
    if self.cfg.qkv_bias:
      q = q + self.bq[...].astype(q.dtype)
    return self.q_norm(q) if self.cfg.qk_norm else q

  def _finish_kv(self, k: Float[Array, "B T HKV D"],
                 v: Float[Array, "B T HKV D"]) -> tuple[Array, Array]:
    """The key and value projections' biases and the key RMSNorm, before RoPE."""
    if self.cfg.qkv_bias:
      k, v = k + self.bk[...].astype(k.dtype), v + self.bv[...].astype(v.dtype)
    return (self.k_norm(k) if self.cfg.qk_norm else k), v

  def _out_bias(self, y: Float[Array, "B T E"]) -> Float[Array, "B T E"]:
    return y + self.bo[...].astype(y.dtype) if self.cfg.out_bias else y

  def _project_out(self, out: Float[Array, "B T HQ D"], cdt) -> Float[Array, "B T E"]:
    """The output projection (and its bias) of the decode paths, in the compute dtype."""
    return self._out_bias(jnp.einsum("bthd,hde->bte", out.astype(cdt), self.wo[...].astype(cdt)))

  def rotated_qk(self, x: Float[Array, "B T E"], cos: Array,
                 sin: Array) -> tuple[Float[Array, "B T HQ D"], Float[Array, "B T HKV D"]]:
    """The queries and keys this layer attends with for its normed input x: projections,
    biases, q / k RMSNorm and RoPE, as `__call__` computes them (for selection diagnostics)."""
    q = self._finish_q(jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(x.dtype)))
    k, _ = self._project_kv(x)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

  def _nsa(self, x: Float[Array, "B T E"], q, k, v, segment_ids) -> Float[Array, "B T HQ D"]:
    """`pisa_jax.nsa_attention` of q, k, v with gates sigmoid(x wg) `[B, T, HQ, 3]`, on each
    device's slice of the batch (the compression MLPs whole on every device)."""
    cfg = self.cfg
    gates, mlps = self._nsa_gates(x), self._nsa_mlps()
    attend = functools.partial(
        pisa_jax.nsa_attention, compression=cfg.nsa_compression,
        block_length=cfg.nsa_block_length, stride=cfg.nsa_stride,
        select_block_size=cfg.nsa_select_block_size, top_n=cfg.nsa_top_n,
        window=cfg.nsa_window, implementation=cfg.attention_implementation)
    batched = (q, k, v, gates) + (() if segment_ids is None else (segment_ids,))

    def run(mlps, q, k, v, gates, segment_ids=None):
      return attend(q, k, v, gates, key_mlp=mlps[0], value_mlp=mlps[1], segment_ids=segment_ids)

    mesh = jax.sharding.get_abstract_mesh()
    axes = batch_axes_of(mesh)
    if axes is None:
      return run(mlps, *batched)
    # As `per_batch_shard`, with the MLPs replicated.
    sharded = jax.shard_map(run, mesh=mesh, in_specs=(P(),) + (P(axes),) * len(batched),
                            out_specs=P(axes), check_vma=False)
    return sharded(mlps, *batched)

  def _nsa_gates(self, x: Float[Array, "B T E"]) -> Float[Array, "B T HQ 3"]:
    """NSA's gates sigmoid(x wg) (Eq. 5), float32."""
    return jax.nn.sigmoid(jnp.einsum("bte,ehc->bthc", x, self.wg[...].astype(x.dtype),
                                     preferred_element_type=jnp.float32))

  def _nsa_mlps(self) -> tuple[CompressionMLP | None, CompressionMLP | None]:
    if self.cfg.nsa_compression != "mlp":
      return None, None
    return self.key_compressor.value(), self.value_compressor.value()
  def _landmark_correction(self, x: Float[Array, "B T E"]) -> Float[Array, "B T HQ D"]:
    """HiLS's landmark query less the query, (x A) B, before RoPE. RoPE is linear: the rotated
    query plus the rotated correction is the rotated landmark projection."""
    cdt = x.dtype
    low = jnp.einsum("bte,er->btr", x, self.wl_down[...].astype(cdt))
    return jnp.einsum("btr,rhd->bthd", low, self.wl_up[...].astype(cdt))

  def _hils(self, x, q, k, v, cos, sin, segment_ids) -> Float[Array, "B T HQ D"]:
    """`pisa_jax.hils_attention` of the layer's q, k, v and landmark queries, per batch shard."""
    cfg = self.cfg
    if sequence_axis() is not None:
      raise ValueError("model.attention='hils' does not split the sequence over devices: set "
                       "train.context_parallel=1")
    attend = functools.partial(
        pisa_jax.hils_attention, chunk_size=cfg.hils_chunk_size, top_k=cfg.hils_top_k,
        window=cfg.hils_window, implementation=cfg.attention_implementation)
    landmark_q = q + apply_rope(self._landmark_correction(x), cos, sin)
    if segment_ids is None:
      return per_batch_shard(attend)(q, k, v, landmark_q)
    return per_batch_shard(lambda q, k, v, lq, ids: attend(q, k, v, lq, segment_ids=ids))(
        q, k, v, landmark_q, segment_ids)


  # Decoding (`pisa_jax.generate`): the projections and RoPE of `__call__`, with a cache.

  def init_cache(self, batch: int, capacity: int, dtype) -> DecodeCache | KVCache | NSACache:
    """An empty cache of this layer for `batch` rows of `capacity` tokens."""
    cfg = self.cfg
    if cfg.attention == "hils":
      return HiLSCache.create(batch, capacity, cfg.num_kv_heads, cfg.num_heads, cfg.head_dim,
                              chunk_size=cfg.hils_chunk_size, dtype=dtype)
    if cfg.attention == "dense":
      return KVCache.create(batch, capacity, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    if cfg.attention == "nsa":
      return NSACache.create(batch, capacity, cfg.num_kv_heads, cfg.head_dim,
                             compression=cfg.nsa_compression, block_length=cfg.nsa_block_length,
                             stride=cfg.nsa_stride, dtype=dtype)
    return DecodeCache.create(batch, capacity, cfg.num_kv_heads, cfg.head_dim,
                              block_size=cfg.block_size, branching=cfg.branching,
                              summary_dtype=cfg.summary_dtype, dtype=dtype)

  def _project_kv(self, x: Float[Array, "B T E"]) -> tuple[Array, Array]:
    cdt = x.dtype
    k = jnp.einsum("bte,ehd->bthd", x, self.wk[...].astype(cdt))
    v = jnp.einsum("bte,ehd->bthd", x, self.wv[...].astype(cdt))
    return self._finish_kv(k, v)

  def prefill(self, x: Float[Array, "B T E"], cos: Array, sin: Array, lengths: Int[Array, "B"],
              cache: DecodeCache | KVCache, segment_ids: Int[Array, "B T"] | None = None,
              ) -> tuple[Float[Array, "B T E"], DecodeCache | KVCache]:
    """`__call__` on right-padded rows, and the cache filled with each row's first lengths[b]
    keys and values (causal attention: the padding after a row never reaches its tokens). With
    packed documents (segment_ids) the cache keeps each row's last document, which the next
    tokens continue."""
    # k and v are projected again beside `__call__` (with few KV heads, a few percent of its
    # matmuls), so that the prefill is the training forward pass itself.
    k, v = self._project_kv(x)
    if self.cfg.attention == "nsa":
      # The cache's compressed tokens are made by the layer's MLPs.
      key_mlp, value_mlp = self._nsa_mlps()
      return (self(x, cos, sin, segment_ids),
              cache.prefill(apply_rope(k, cos, sin), v, lengths, key_mlp=key_mlp,
                            value_mlp=value_mlp, segment_ids=segment_ids))
    if self.cfg.attention == "hils":
      # The cache pools the landmarks of the prompt's complete chunks with the landmark queries.
      q = self._finish_q(jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(x.dtype)))
      landmark_q = apply_rope(q, cos, sin) + apply_rope(self._landmark_correction(x), cos, sin)
      return (self(x, cos, sin, segment_ids),
              cache.prefill(apply_rope(k, cos, sin), v, landmark_q, lengths,
                            segment_ids=segment_ids))
    return (self(x, cos, sin, segment_ids),
            cache.prefill(apply_rope(k, cos, sin), v, lengths, segment_ids=segment_ids))

  def prefill_chunk(self, x: Float[Array, "B S E"], cos: Array, sin: Array,
                    lengths: Int[Array, "B"], offset: Int[Array, ""],
                    cache: DecodeCache | KVCache) -> tuple[Float[Array, "B S E"],
                                                           DecodeCache | KVCache]:
    """A chunk of S tokens at positions offset .. offset + S - 1 (cos, sin `[S, R/2]` there):
    row b's first lengths[b] of them are appended to the cache (rows with lengths[b] > 0 hold
    exactly offset tokens; the cache has room for offset + S), and the chunk's queries attend
    over the cache's keys up to each query (the pyramid of all of them: `pisa_attention_at`;
    dense: every earlier key; HiLS: `hils_prefill_chunk`, the landmarks of the chunks it
    completes appended; NSA: `nsa_prefill_chunk`). Rows with lengths[b] == 0 keep their
    cache."""
    cfg, cdt = self.cfg, x.dtype
    q = self._finish_q(jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(cdt)))
    k, v = self._project_kv(x)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.attention == "hils":
      # The landmarks of the chunks this one completes join the cache's (jnp, as the step).
      landmark_q = q + apply_rope(self._landmark_correction(x), cos, sin)
      out, cache = hils_prefill_chunk(q, k, v, landmark_q, cache, lengths, offset,
                                      top_k=cfg.hils_top_k, window=cfg.hils_window)
      return self._project_out(out, cdt), cache
    if cfg.attention == "nsa":
      # The compressed blocks this chunk completes join the cache's (jnp, as the step).
      key_mlp, value_mlp = self._nsa_mlps()
      out, cache = nsa_prefill_chunk(
          q, k, v, self._nsa_gates(x), cache, lengths, offset, key_mlp=key_mlp,
          value_mlp=value_mlp, select_block_size=cfg.nsa_select_block_size, top_n=cfg.nsa_top_n,
          window=cfg.nsa_window)
      return self._project_out(out, cdt), cache
    # The chunk's padding is never written: past a row's length the cache stays zero.
    k_all, v_all, lengths = append_chunk(cache.k, cache.v, k, v, cache.lengths, lengths, offset)
    if cfg.attention == "dense":
      out = dense_chunk_attention(q, k_all, v_all, offset)
    else:
      out = pisa_attention_at(q, k_all, v_all, offset, block_size=cfg.block_size,
                              top_k=cfg.top_k, branching=cfg.branching, selector=cfg.attention,
                              beam=cfg.beam, summary_dtype=cfg.summary_dtype,
                              implementation=cfg.attention_implementation)
    # The pyramid of every key held, as one prefill would build it.
    return self._project_out(out, cdt), cache.prefill(k_all, v_all, lengths)

  def decode(self, x: Float[Array, "B 1 E"], cos: Array, sin: Array,
             cache: DecodeCache | KVCache) -> tuple[Float[Array, "B 1 E"], DecodeCache | KVCache]:
    """One token per row at its own position (the cache's length), cos and sin `[B, D/4]`."""
    cfg, cdt = self.cfg, x.dtype
    q = self._finish_q(jnp.einsum("bte,ehd->bthd", x, self.wq[...].astype(cdt)))
    k, v = self._project_kv(x)
    # apply_rope takes one angle per time step; here each row has its own.
    rope = jax.vmap(lambda y, c, s: apply_rope(y[None], c[None], s[None])[0])
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    if cfg.attention == "dense":
      out, cache = dense_decode_attention(q, k, v, cache)
    elif cfg.attention == "nsa":
      key_mlp, value_mlp = self._nsa_mlps()
      out, cache = nsa_decode_step(
          q, k, v, self._nsa_gates(x), cache, key_mlp=key_mlp, value_mlp=value_mlp,
          select_block_size=cfg.nsa_select_block_size, top_n=cfg.nsa_top_n,
          window=cfg.nsa_window, implementation=_ONE_STEP)
    elif cfg.attention == "hils":
      landmark_q = q + rope(self._landmark_correction(x), cos, sin)
      out, cache = hils_decode_step(q, k, v, landmark_q, cache, top_k=cfg.hils_top_k,
                                    window=cfg.hils_window, implementation=_ONE_STEP)
    else:
      out, cache = decode_step(q, k, v, cache, top_k=cfg.top_k, selector=cfg.attention,
                               beam=cfg.beam, implementation=cfg.attention_implementation)
    return self._project_out(out, cdt), cache


def _attend_within_documents(attend, q, k, v, segment_ids):
  """Dense causal attention under a `[B, 1, T, T]` mask of same-document pairs."""
  mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
  return attend(q, k, v, mask=mask)


class Compressor(nnx.Module):
  """NSA's compression MLP phi (Eq. 7) for keys or values: `pisa_jax.nsa.CompressionMLP`'s
  arrays, hidden width 4 * head_dim, weights normal with std 1 / sqrt(fan-in) (a compressed token
  starts at the scale of a key), biases zero, the intra-block positions at init_std."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    length, hd = cfg.nsa_block_length, cfg.head_dim
    hidden = 4 * hd
    self.position = _normal(rngs, (length, hd), cfg.init_std, pdt, (None, "head_dim"))
    self.w1 = _normal(rngs, (length * hd, hidden), 1 / math.sqrt(length * hd), pdt, (None, None))
    self.b1 = nnx.Param(jnp.zeros((hidden,), pdt), logical_axes=(None,))
    self.w2 = _normal(rngs, (hidden, hd), 1 / math.sqrt(hidden), pdt, (None, "head_dim"))
    self.b2 = nnx.Param(jnp.zeros((hd,), pdt), logical_axes=("head_dim",))

  def value(self) -> CompressionMLP:
    return CompressionMLP(self.position[...], self.w1[...], self.b1[...], self.w2[...],
                          self.b2[...])


class GatedMLP(nnx.Module):
  """down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    self.w_gate = _normal(rngs, (cfg.d_model, cfg.mlp_dim), std, pdt, ("embed", "mlp"))
    self.w_up = _normal(rngs, (cfg.d_model, cfg.mlp_dim), std, pdt, ("embed", "mlp"))
    self.w_down = _normal(rngs, (cfg.mlp_dim, cfg.d_model), out_std, pdt, ("mlp", "embed"))

  def __call__(self, x: Float[Array, "B T E"]) -> Float[Array, "B T E"]:
    cdt = x.dtype
    gate = _saveable("mlp_gate", x @ self.w_gate[...].astype(cdt))
    up = _saveable("mlp_up", x @ self.w_up[...].astype(cdt))
    return _saveable("mlp_down", (jax.nn.silu(gate) * up) @ self.w_down[...].astype(cdt))


class Block(nnx.Module):
  """Pre-RMSNorm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pdt = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    self.mlp = GatedMLP(cfg, rngs=rngs)

  def __call__(self, x, cos, sin, segment_ids=None):
    x = x + self.attn(self.attn_norm(x), cos, sin, segment_ids)
    return x + self.mlp(self.mlp_norm(x))


  def prefill(self, x, cos, sin, lengths, cache, segment_ids=None):
    h, cache = self.attn.prefill(self.attn_norm(x), cos, sin, lengths, cache, segment_ids)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache

  def prefill_chunk(self, x, cos, sin, lengths, offset, cache):
    h, cache = self.attn.prefill_chunk(self.attn_norm(x), cos, sin, lengths, offset, cache)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache

  def decode(self, x, cos, sin, cache):
    h, cache = self.attn.decode(self.attn_norm(x), cos, sin, cache)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache


class Decoder(nnx.Module):
  """The language model: tokens `[B, T]` -> float32 logits `[B, T, V_padded]`."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt = jnp.dtype(cfg.param_dtype)
    vp = cfg.padded_vocab_size
    self.embed = _normal(rngs, (vp, cfg.d_model), cfg.init_std, pdt, ("vocab", "embed"))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt)
    if not cfg.tie_embeddings:
      self.lm_head = _normal(rngs, (cfg.d_model, vp), cfg.init_std, pdt, ("embed", "vocab"))

  def __call__(self, tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None,
               positions: Int[Array, "B T"] | None = None) -> Float[Array, "B T Vp"]:
    return output_logits(self.hidden_states(tokens, segment_ids, positions),
                         self.output_embedding(), self.cfg.vocab_size)

  def output_embedding(self) -> Float[Array, "E Vp"]:
    """The output projection: `lm_head`, or the input embedding's transpose when
    `tie_embeddings`."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def hidden_states(self, tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None,
                    positions: Int[Array, "B T"] | None = None) -> Float[Array, "B T E"]:
    """The final-normed activations that the output projection turns into logits.

    Training takes these rather than `__call__`'s logits, to compute the loss over chunks of
    tokens without ever holding `[B, T, Vp]` (`pisa_jax.train.loss`).

    segment_ids: int32 `[B, T]`, packed documents (runs of equal ids, non-decreasing): no token
      attends outside its document. positions: int32 `[B, T]`, RoPE positions; None means each
      token's position in its document with segment_ids, and 0 .. T-1 without.
    """
    cfg = self.cfg
    chex.assert_rank(tokens, 2)  # [B, T]
    cdt = compute_dtype(cfg)
    # Activations stay batch-sharded under an fsdp mesh (see `constrain_batch`).
    x = constrain_batch(jnp.take(self.embed[...], tokens, axis=0).astype(cdt))
    cos, sin = self._rope(tokens.shape, segment_ids, positions)
    forward = block_forward(cfg.remat)
    for block in self.blocks:
      x = constrain_batch(forward(block, x, cos, sin, segment_ids))
    return self.final_norm(x)

  def _rope(self, shape: tuple[int, int], segment_ids, positions) -> tuple[Array, Array]:
    """RoPE's cos, sin: `[T, D/4]` at 0 .. T-1, or `[B, T, D/4]` at per-token positions."""
    cfg = self.cfg
    _validation.check_segment_ids(segment_ids, batch=shape[0], seq_len=shape[1])
    rope = RopeSpec.of(cfg)
    if positions is None and segment_ids is None:
      return rope.angles(shape[1])
    if positions is None:
      start, _ = document_bounds(segment_ids)
      positions = jnp.arange(shape[1], dtype=jnp.int32) - start
    elif (getattr(positions, "dtype", None) != jnp.int32
          or tuple(getattr(positions, "shape", ())) != tuple(shape)):
      raise ValueError(f"positions must be an int32 array [B, T] = {list(shape)}, got "
                       f"{getattr(positions, 'dtype', type(positions).__name__)} "
                       f"{tuple(getattr(positions, 'shape', ()))}")
    return rope.at(positions)

  # Decoding: `pisa_jax.generation.DecodeModel`. The state holds one cache per layer (sparse
  # layers a `DecodeCache`, dense ones a `KVCache`); a row's next position is its length.

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def init_decode_state(self, batch: int, capacity: int) -> tuple[DecodeCache | KVCache, ...]:
    """Empty caches, one per layer, for `batch` rows of `capacity` tokens in the compute dtype."""
    dtype = compute_dtype(self.cfg)
    return tuple(block.attn.init_cache(batch, capacity, dtype) for block in self.blocks)

  def grow_decode_state(self, state: tuple, capacity: int) -> tuple:
    """The same caches with room for at least `capacity` tokens per row (outside `jit`)."""
    return tuple(cache.grow(capacity) for cache in state)

  def prefill(self, tokens: Int[Array, "B T"], lengths: Int[Array, "B"], state: tuple,
              segment_ids: Int[Array, "B T"] | None = None) -> tuple[Float[Array, "B Vp"], tuple]:
    """The forward pass over right-padded prompts (row b: tokens[b, :lengths[b]], lengths >= 1)
    filling the empty `state`; returns the float32 logits of each row's last prompt token.
    With packed prompts (segment_ids `[B, T]`, as in `__call__`) each row's state keeps its last
    document, positions counted from that document's start: decoding continues it."""
    cfg = self.cfg
    chex.assert_rank(tokens, 2)  # [B, T]
    x = jnp.take(self.embed[...], tokens, axis=0).astype(compute_dtype(cfg))
    cos, sin = self._rope(tokens.shape, segment_ids, None)
    if len(state) != len(self.blocks):
      raise ValueError(f"state holds {len(state)} caches: expected one per layer "
                       f"({len(self.blocks)})")
    # One layer's code scanned over the stacked layer parameters: each Pallas kernel is then one
    # call site of the compiled prefill, not one per layer. XLA compiles every call site's
    # Triton module on its own (~1 s each for the selection kernels on the H200), which made a
    # 16-layer prefill take ~80 s to compile. The state is empty (every layer's cache alike), so
    # each layer starts from state[0] rather than from a stacked copy of every layer's zeros.
    # The price: the filled caches exist twice until the prefill returns (the scan's stacked
    # output and the per-layer slices the decode state holds).
    if len({jax.tree.structure(c) for c in state}) != 1 or len(
        {tuple((leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(c)) for c in state}) != 1:
      raise ValueError("state: every layer's empty cache must have one structure, shape and "
                       "dtype")
    graphdef, _ = nnx.split(self.blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in self.blocks])

    def layer(x, block_state):
      return nnx.merge(graphdef, block_state).prefill(x, cos, sin, lengths, state[0],
                                                      segment_ids)

    x, caches = jax.lax.scan(layer, x, stacked)
    last = x[jnp.arange(x.shape[0]), jnp.maximum(lengths - 1, 0)]  # [B, E]
    return self._next_logits(last), tuple(jax.tree.map(lambda a, i=i: a[i], caches)
                                          for i in range(len(self.blocks)))

  def prefill_chunk(self, tokens: Int[Array, "B S"], lengths: Int[Array, "B"], state: tuple,
                    offset: Int[Array, ""]) -> tuple[Float[Array, "B Vp"], tuple]:
    """Chunked prefill (`pisa_jax.generate(..., prefill_chunk=S)`): appends row b's
    tokens[b, :lengths[b]] at positions offset .. offset + lengths[b] - 1 to every layer's cache
    (rows with lengths[b] > 0 hold exactly offset tokens, rows with 0 keep theirs; each cache has
    room for offset + S tokens). The chunk's queries attend over everything before them, so chunk
    after chunk gives the caches and last-token logits of `prefill` over the whole prompts. Every
    attention kind; offset may be traced (one compiled chunk for every chunk). Returns the
    float32 logits of each row's last appended token (stale where lengths[b] == 0)."""
    cfg = self.cfg
    chex.assert_rank(tokens, 2)  # [B, S]
    if len(state) != len(self.blocks):
      raise ValueError(f"state holds {len(state)} caches: expected one per layer "
                       f"({len(self.blocks)})")
    x = jnp.take(self.embed[...], tokens, axis=0).astype(compute_dtype(cfg))
    offset = jnp.asarray(offset, jnp.int32)
    cos, sin = RopeSpec.of(cfg).at(offset + jnp.arange(tokens.shape[1], dtype=jnp.int32))
    # Scanned over the layers as `prefill` is (one call site per kernel), each layer with its
    # own cache: the caches are stacked for the scan and split after it (a copy of them per
    # chunk, against the chunk's compute).
    graphdef, _ = nnx.split(self.blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in self.blocks])
    caches = jax.tree.map(lambda *xs: jnp.stack(xs), *state)

    def layer(x, inputs):
      block_state, cache = inputs
      return nnx.merge(graphdef, block_state).prefill_chunk(x, cos, sin, lengths, offset, cache)

    x, caches = jax.lax.scan(layer, x, (stacked, caches))
    last = x[jnp.arange(x.shape[0]), jnp.maximum(lengths - 1, 0)]  # [B, E]
    return self._next_logits(last), tuple(jax.tree.map(lambda a, i=i: a[i], caches)
                                          for i in range(len(self.blocks)))

  def decode(self, tokens: Int[Array, "B"], state: tuple) -> tuple[Float[Array, "B Vp"], tuple]:
    """Appends one token per row at its length; returns the float32 logits of the next token."""
    cfg = self.cfg
    chex.assert_rank(tokens, 1)  # [B]
    x = jnp.take(self.embed[...], tokens[:, None], axis=0).astype(compute_dtype(cfg))
    cos, sin = RopeSpec.of(cfg).at(state[0].lengths)  # [B, R/2]
    caches = []
    for block, cache in zip(self.blocks, state, strict=True):
      x, cache = block.decode(x, cos, sin, cache)
      caches.append(cache)
    return self._next_logits(x[:, 0]), tuple(caches)

  def _next_logits(self, x: Float[Array, "B E"]) -> Float[Array, "B Vp"]:
    return output_logits(self.final_norm(x)[:, None], self.output_embedding(),
                         self.cfg.vocab_size)[:, 0]


def output_logits(x: Float[Array, "B T E"], lm_head: Float[Array, "E Vp"],
                  vocab_size: int) -> Float[Array, "B T Vp"]:
  """float32 logits of the output projection; the padding rows (>= vocab_size) get -1e9."""
  logits = constrain_batch(jnp.einsum(
      "bte,ev->btv", x, lm_head.astype(x.dtype), preferred_element_type=jnp.float32
  ))
  # Padding rows are not tokens: keep the softmax exactly over the real vocabulary.
  real = jnp.arange(lm_head.shape[-1]) < vocab_size
  return jnp.where(real, logits, _PAD_LOGIT)


_ATTENTION_PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")
_MLP_PROJECTIONS = ("mlp_gate", "mlp_up", "mlp_down")
# Sparse attention's block selection has no gradient (its indices are held fixed, Appendix B): the
# backward needs the indices only as an input of the attention backward. Every policy keeps them,
# so a block's pyramid and selection run once a step (`pisa_jax.checkpoint_names` says how jax
# sees these names through the attention's `custom_vjp`).
_SELECTION = (checkpoint_names.BLOCK_INDICES,)
# The attention forward's residuals (its output and log-sum-exp): kept, the backward runs only the
# attention's dq and dk/dv kernels, not its forward.
_ATTENTION_RESIDUALS = (checkpoint_names.ATTENTION_OUT, checkpoint_names.ATTENTION_LSE)
# Dense attention's twin of those residuals: the outputs of cuDNN's fused forward (out and its
# float32 softmax statistics), the primitive under `jax.nn.dot_product_attention(implementation=
# "cudnn")`. A policy that keeps the attention keeps the same for either kind.
_CUDNN_FORWARD = "dot_product_attention_fwd_wrapper"


def _cudnn_forward_outputs(prim, *_, **__) -> bool:
  return prim.name == _CUDNN_FORWARD


def _keep(*names: str, attention: bool = False):
  """A policy saving the named values, and cuDNN's forward outputs when `attention`."""
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  if attention:
    policy = jax.checkpoint_policies.save_from_both_policies(policy, _cudnn_forward_outputs)
  return policy


# What a block's forward pass keeps for the backward (`model.remat`); the rest is recomputed there,
# from the block's input `[B, T, E]`, which every policy but "none" keeps. What each keeps beyond
# it, in bytes a layer per token with bf16 compute (E model width, M MLP width, HQ / HKV heads
# of D dims, K selected blocks; in brackets cpt-418m's E 1024, M 2816, HQ 32, HKV 2, D 64, K 32),
# built of the indices 4 HKV K (int32 `[B, T, HKV, K]`, PISA only: 256) and the attention residuals
# 2 HQ D + 4 HQ (out `[B, T, HQ, D]` and float32 lse `[B, T, HQ]`: 4,224). Dense attention under
# a "save_attention" policy keeps cuDNN's out and statistics: the same 2 HQ D + 4 HQ.
REMAT_POLICIES = {
    # Every intermediate the backward reads: no recomputation, the most memory.
    "none": None,
    # "dots" and the attention residuals: of the block's forward only the norms, RoPE and SiLU
    # run again. 2 (HQ D + 2 HKV D + 2 E + 2 M) + indices + residuals [24,448].
    "dots_save_attention": _keep(*_ATTENTION_PROJECTIONS, *_MLP_PROJECTIONS, *_SELECTION,
                                 *_ATTENTION_RESIDUALS, attention=True),
    # The seven projections' outputs (q, k, v, attention out, MLP gate, up and down) and the
    # indices: the matmuls and the selection do not run again; the norms, RoPE, SiLU and the
    # attention forward do. 2 (HQ D + 2 HKV D + 2 E + 2 M) + indices [20,224].
    "dots": _keep(*_ATTENTION_PROJECTIONS, *_MLP_PROJECTIONS, *_SELECTION),
    # The four attention projections and the indices: the MLP (its [B, T, mlp_dim] gate and up
    # are the block's largest activations) and the attention forward are recomputed as well.
    # 2 (HQ D + 2 HKV D + E) + indices [6,912].
    "dots_except_mlp": _keep(*_ATTENTION_PROJECTIONS, *_SELECTION),
    # The block's input, the indices and the attention residuals: the projections, RoPE and the
    # MLP run again, the selection and the attention forward do not. Indices + residuals [4,480].
    "full_save_attention": _keep(*_SELECTION, *_ATTENTION_RESIDUALS, attention=True),
    # The block's input and the indices: the whole block but the selection runs again. Indices
    # [256].
    "full": _keep(*_SELECTION),
}


def block_forward(remat: str):
  """`forward(block, x, cos, sin[, segment_ids])`: one block's forward under the named remat
  policy."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f"model.remat={remat!r} must be one of {tuple(REMAT_POLICIES)}")

  def forward(block: Block, x, cos, sin, segment_ids=None):
    return block(x, cos, sin, segment_ids)

  if remat == "none":
    return forward
  return nnx.remat(forward, policy=REMAT_POLICIES[remat])


def count_params(cfg: ModelConfig) -> int:
  """Number of parameters, padded embedding rows included (418M / 1.47B / 2.67B for Table 5)."""
  e, m, hd = cfg.d_model, cfg.mlp_dim, cfg.head_dim
  attn = e * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  if cfg.attention == "hils":  # the landmark query's rank-r correction
    attn += cfg.hils_landmark_rank * (e + cfg.num_heads * hd)
  extras = (hd * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.qkv_bias + 2 * hd * cfg.qk_norm
            + e * cfg.out_bias)
  per_layer = attn + 3 * e * m + 2 * e + extras
  if cfg.attention == "nsa":
    # The gates, and two compression MLPs (positions, w1, b1, w2, b2; hidden 4 * head_dim).
    per_layer += 3 * e * cfg.num_heads
    if cfg.nsa_compression == "mlp":
      length, hidden = cfg.nsa_block_length, 4 * hd
      per_layer += 2 * (length * hd + length * hd * hidden + hidden + hidden * hd + hd)
  embeddings = (1 if cfg.tie_embeddings else 2) * cfg.padded_vocab_size * e
  return cfg.num_layers * per_layer + embeddings + e


def sparse_attended_keys(seq_len: int, top_k: int, block_size: int) -> float:
  """The mean number of keys a query attends over positions 0 .. T-1 under top-k block-sparse
  attention (Eq. 6): t + 1 while its causal past has at most K blocks, else K - 1 complete blocks
  and the current block up to t, (K - 1) C + (t mod C) + 1."""
  t, c = seq_len, block_size
  dense = min(t, top_k * c)  # queries t < K C attend all t + 1 keys
  total = dense * (dense + 1) // 2
  rest = t - dense  # the others start at a block boundary: t mod C runs 0 .. C-1 again and again
  cycles, tail = divmod(rest, c)
  total += rest * ((top_k - 1) * c + 1) + cycles * c * (c - 1) // 2 + tail * (tail - 1) // 2
  return total / t


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), for MFU.

  Matmuls: 6 x (parameters - input embedding). Attention: QK^T and PV cost 2 * 2 * HQ * D per
  attended key in the forward pass; dense causal attends (T+1)/2 keys on average, the sparse kinds
  `sparse_attended_keys` (their K blocks, the current one up to t), HiLS its window and top_k
  chunks. Block selection and HiLS's chunk scores are not counted.
  """
  # The input embedding is a lookup; a tied one is also the output projection's matmul.
  matmul_params = count_params(cfg) - (0 if cfg.tie_embeddings
                                       else cfg.padded_vocab_size * cfg.d_model)
  attended = (seq_len + 1) / 2
  if cfg.attention in SPARSE_ATTENTION_KINDS:
    attended = sparse_attended_keys(seq_len, cfg.top_k, cfg.block_size)
  elif cfg.attention == "nsa":
    # Its three branches: the compressed blocks complete at t, the selected blocks' keys and the
    # window's (each at most the causal (T+1)/2 on average).
    compressed = max(0, (seq_len - cfg.nsa_block_length) // cfg.nsa_stride + 1) / 2
    attended = (compressed + min(attended, cfg.nsa_top_n * cfg.nsa_select_block_size)
                + min(attended, cfg.nsa_window))
  elif cfg.attention == "hils":  # the window (widened to a chunk boundary) and top_k chunks
    attended = min(attended, cfg.hils_window + (cfg.hils_top_k + 1) * cfg.hils_chunk_size)
  attention = cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * attended
  return 6 * matmul_params + 3 * attention


# ----------------------------------------------------------------------------- dense decoding


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of a batch of rows with per-row lengths: dense attention's decode cache.

  Row b holds tokens 0 .. lengths[b] - 1; positions at or past its length are zero or stale and
  never attended. `create`, `prefill` and `grow` behave as `pisa_jax.decode.DecodeCache`'s.
  """

  k: Float[Array, "B N HKV D"]
  v: Float[Array, "B N HKV D"]
  lengths: Int[Array, "B"]

  @classmethod
  def create(cls, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
             dtype) -> "KVCache":
    shape = (batch, capacity, num_kv_heads, head_dim)
    return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
               lengths=jnp.zeros((batch,), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def prefill(self, k: Float[Array, "B T HKV D"], v: Float[Array, "B T HKV D"],
              lengths: Int[Array, "B"], *,
              segment_ids: Int[Array, "B T"] | None = None) -> "KVCache":
    """A cache holding each row's first lengths[b] of these keys and values; with segment_ids,
    only each row's last document among them, moved to position 0."""
    if segment_ids is not None:
      k, v, lengths = last_document(k, v, lengths.astype(jnp.int32), segment_ids)
    t = k.shape[1]
    if t > self.capacity:
      raise ValueError(f"k.shape[1]={t} tokens exceed the cache capacity {self.capacity}")
    keep = (jnp.arange(t)[None, :] < lengths[:, None])[:, :, None, None]
    pad = ((0, 0), (0, self.capacity - t), (0, 0), (0, 0))

    def fill(x):
      return jnp.pad(jnp.where(keep, x, jnp.zeros((), x.dtype)).astype(self.k.dtype), pad)

    return KVCache(k=fill(k), v=fill(v), lengths=lengths.astype(jnp.int32))

  def grow(self, min_capacity: int) -> "KVCache":
    """Room for at least `min_capacity` tokens: at least double, a power of two (self if it
    already has that many), so a jitted step sees O(log N) shapes."""
    if min_capacity <= self.capacity:
      return self
    capacity = bucket_capacity(max(int(min_capacity), 2 * self.capacity), 1)
    pad = ((0, 0), (0, capacity - self.capacity), (0, 0), (0, 0))
    return KVCache(k=jnp.pad(self.k, pad), v=jnp.pad(self.v, pad), lengths=self.lengths)


def dense_decode_attention(q: Float[Array, "B 1 HQ D"], k: Float[Array, "B 1 HKV D"],
                           v: Float[Array, "B 1 HKV D"],
                           cache: KVCache) -> tuple[Float[Array, "B 1 HQ D"], KVCache]:
  """Appends each row's key and value at its length, then attends causally over the row's
  keys 0 .. length (its own included): softmax statistics in float32. A row with no room left
  (only possible under `jit`) drops its token and outputs NaN. On a GPU with a 16-bit cache, as
  the prefill: cuDNN's fused attention over each row's first length + 1 keys; else float32 jnp
  (a whole-cache float32 copy a step, several times cuDNN's time at 128K)."""
  b, n, hkv, d = cache.k.shape
  hq = q.shape[2]
  positions = cache.lengths
  rows = jnp.arange(b)
  write = jnp.where(positions < n, positions, n)  # out of bounds: dropped
  k_cache = cache.k.at[rows, write].set(k[:, 0].astype(cache.k.dtype), mode="drop")
  v_cache = cache.v.at[rows, write].set(v[:, 0].astype(cache.v.dtype), mode="drop")
  full = positions >= n
  if jax.default_backend() == "gpu" and k_cache.dtype in (jnp.bfloat16, jnp.float16):
    out = jax.nn.dot_product_attention(
        q.astype(k_cache.dtype), k_cache, v_cache,
        key_value_seq_lengths=jnp.minimum(positions + 1, n).astype(jnp.int32),
        implementation="cudnn")
    out = jnp.where(full[:, None, None, None], jnp.nan, out)
    return out.astype(q.dtype), KVCache(k=k_cache, v=v_cache, lengths=positions + 1)
  # Query head h reads KV head h // (HQ / HKV), as jax.nn.dot_product_attention does.
  qg = q[:, 0].astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
  logits = jnp.einsum("bhgd,bnhd->bhgn", qg, k_cache.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
  visible = (jnp.arange(n)[None, :] <= positions[:, None])[:, None, None, :]
  p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
  out = jnp.einsum("bhgn,bnhd->bhgd", p, v_cache.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST).reshape(b, 1, hq, d)
  out = jnp.where(full[:, None, None, None], jnp.nan, out)
  return out.astype(q.dtype), KVCache(k=k_cache, v=v_cache, lengths=positions + 1)


def dense_chunk_attention(q: Float[Array, "B S HQ D"], k: Float[Array, "B N HKV D"],
                          v: Float[Array, "B N HKV D"], offset: Int[Array, ""], *,
                          key_tile: int = 512) -> Float[Array, "B S HQ D"]:
  """Causal dense attention of S queries at positions offset .. offset + S - 1 over the keys
  0 .. N - 1 (key j visible to the query at p when j <= p): an online softmax over tiles of
  `key_tile` keys, float32 statistics, only the tiles up to offset + S read (offset may be
  traced). No [S, N] mask or logits exist at once: [S, key_tile] a tile."""
  b, s, hq, d = q.shape
  n, hkv = k.shape[1], k.shape[2]
  tile = min(key_tile, n)
  pad = (0, 0), (0, -n % tile), (0, 0), (0, 0)
  k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  # Query head h reads KV head h // (HQ / HKV), as jax.nn.dot_product_attention does.
  qg = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d) / math.sqrt(d)
  positions = offset + jnp.arange(s, dtype=jnp.int32)

  def body(i, carry):
    m, denom, acc = carry  # [B, HKV, G, S], [B, HKV, G, S], [B, HKV, G, S, D]
    kt, vt = (jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1).astype(jnp.float32)
              for x in (k, v))
    logits = jnp.einsum("bshgd,bnhd->bhgsn", qg, kt, precision=jax.lax.Precision.HIGHEST)
    visible = i * tile + jnp.arange(tile)[None, :] <= positions[:, None]  # [S, tile]
    logits = jnp.where(visible, logits, -jnp.inf)
    # Tile 0 holds key 0, visible to every query: m is finite from then on.
    m_new = jnp.maximum(m, logits.max(axis=-1))
    p = jnp.exp(logits - m_new[..., None])
    correction = jnp.exp(m - m_new)
    acc = acc * correction[..., None] + jnp.einsum("bhgsn,bnhd->bhgsd", p, vt,
                                                   precision=jax.lax.Precision.HIGHEST)
    return m_new, denom * correction + p.sum(axis=-1), acc

  shape = (b, hkv, hq // hkv, s)
  init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
          jnp.zeros(shape + (d,), jnp.float32))
  tiles = jnp.minimum((offset + s + tile - 1) // tile, k.shape[1] // tile)
  _, denom, acc = jax.lax.fori_loop(0, tiles, body, init)
  out = acc / denom[..., None]  # [B, HKV, G, S, D]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, s, hq, d).astype(q.dtype)
