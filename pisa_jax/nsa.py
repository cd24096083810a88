"""Native Sparse Attention (NSA; Yuan et al., 2025, Section 3): three gated branches.

For query t, head h (Eq. 5): o = g_cmp * Attn(q, K_cmp, V_cmp) + g_slc * Attn(q, K_slc, V_slc)
+ g_win * Attn(q, K_win, V_win), with gates g in (0, 1) (a sigmoid of a linear map of the layer's
input, made by the caller) per token, head and branch:
  compression  keys and values compressed block by block (Eq. 7): blocks of l tokens at stride d
               (overlapping when d < l), each mapped to one token by a learned MLP with an
               intra-block position encoding ("mlp"), or by the mean of its tokens, blocks of l = d
               without overlap ("mean": the variant of fla's NSA). Query t attends to the
               compressed blocks whose whole span lies at or before t.
  selection    the compressed attention's probabilities mapped onto blocks of l' tokens (Eq. 9),
               summed over the GQA group's heads (Eq. 10), and the top n blocks kept, the first,
               previous and current ones always (fla's rule; `selection.flat_top_k`): then sparse
               attention over them (`pisa_jax.sparse_attention`), indices under stop_gradient.
  window       causal attention over the last w tokens (t - w < j <= t).
The paper's defaults: l = 32, d = 16, l' = 64, n = 16 (the three forced blocks included), w = 512.

Eq. 9, as implemented: compressed block i covers tokens [i d, i d + l), selection block j tokens
[j l', (j + 1) l'), and d divides l and l'. Each d-token piece of block j is covered by l / d
compressed blocks, and block j collects the probability of every one of them:
  p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n]
(a compressed block counts once per d-token piece it shares with block j, so one that straddles
two selection blocks counts in both). With l = d = l' it is p_slc = p_cmp, fla's
`parallel_nsa_topk`: each head's probabilities normalise over every compressed block complete at
t (the current one too at its last position), summed over the group for each past block.

Packed documents (segment_ids `[B, T]`): every branch is its document's own, as if the document
ran alone from position 0: compressed blocks on the document's grid from its first token,
selection blocks numbered within the document (as `sparse_attention` takes them), the window cut
at the document's start. Compressed slots: unpacked, slot i is block i, N = (T - l) // d + 1 of
them; packed, a row's documents' blocks lie one after another, N = T // d slots (a document of L
tokens has (L - l) // d + 1 <= L / d blocks since d <= l). At least one slot in both; slots with
no complete block hold zeros and are never attended.

The jnp reference computes in float32 whatever the input dtype and rounds once at the end.
Kernels: the compressed attention and the window are one Pallas kernel family
(`pisa_jax.kernels.nsa`: each query attends to one contiguous range of keys, forward with the
lse, backward under custom_vjp), the window on cuDNN's sliding window instead where it takes the
arguments (`cudnn_takes_window`); the selected branch is `sparse_attention`'s kernel.
The selection is a kernel too (`pisa_jax.kernels.nsa_select`: the group's probabilities of a
tile of compressed blocks, Eq. 9 as a fixed count map, a running top-n; no `[T, N]` scores in
memory; packed rows one document of a query tile at a time).
`implementation=` of `nsa_attention`: "xla" runs every branch in the reference, "pallas" the
three attentions and the selection on their kernels, the compression in jnp under XLA; None is
"pallas" on a GPU, "xla" elsewhere. `compressed_attention`, `sliding_window_attention` and
`nsa_select_blocks` take "pallas" too; `nsa_compress` registers only "xla" (None means "xla" on
every platform, and "pallas" raises).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from pisa_jax import _checks, _chunking, _dispatch, _validation, segments
from pisa_jax.attention import _attend
from pisa_jax.kernels import nsa as nsa_kernels
from pisa_jax.kernels import nsa_select as nsa_select_kernels
from pisa_jax.selection import flat_top_k

_HIGHEST = lax.Precision.HIGHEST

COMPRESSIONS = _checks.NSA_COMPRESSIONS
# The order of the gates' last axis (Eq. 5: c in {cmp, slc, win}).
BRANCHES = ("compressed", "selected", "window")


class CompressionMLP(NamedTuple):
  """phi of Eq. 7 for one of keys or values: a block of l tokens `[l, D]`, each plus its
  intra-block position encoding, flattened to `[l D]` -> silu(x w1 + b1) w2 + b2 `[D]`. Shared
  by the KV heads.

  Attributes:
    position: `[l, D]`, added to the block's token at each offset.
    w1: `[l * D, H]`; b1: `[H]`; w2: `[H, D]`; b2: `[D]` (H, the hidden width, is free).
  """

  position: Float[Array, "L D"]
  w1: Float[Array, "LD H"]
  b1: Float[Array, "H"]
  w2: Float[Array, "H D"]
  b2: Float[Array, "D"]


def init_compression_mlp(key, *, block_length: int, head_dim: int, hidden: int | None = None,
                         position_std: float = 0.02, dtype=jnp.float32) -> CompressionMLP:
  """A fresh `CompressionMLP`: weights normal with std 1 / sqrt(fan-in) (the compressed token
  starts at the scale of a key), biases zero, positions normal with `position_std`.
  hidden: H, default 4 * head_dim."""
  hidden = 4 * head_dim if hidden is None else hidden
  k_pos, k1, k2 = jax.random.split(key, 3)
  fan_in = block_length * head_dim
  return CompressionMLP(
      position=(position_std * jax.random.normal(k_pos, (block_length, head_dim))).astype(dtype),
      w1=(jax.random.normal(k1, (fan_in, hidden)) / math.sqrt(fan_in)).astype(dtype),
      b1=jnp.zeros((hidden,), dtype),
      w2=(jax.random.normal(k2, (hidden, head_dim)) / math.sqrt(hidden)).astype(dtype),
      b2=jnp.zeros((head_dim,), dtype),
  )


# ----------------------------------------------------------------------------- argument checks


# Every NSA size rule, once, in the jax-free checks (configs validate with it before jax loads).
check_options = _checks.check_nsa_options


def _check_mlp(mlp, arg: str, *, compression: str, block_length: int, head_dim: int) -> None:
  if compression == "mean":
    if mlp is not None:
      raise ValueError(f"{arg} applies to compression='mlp' only: pass {arg}=None with "
                       "compression='mean'")
    return
  if not isinstance(mlp, CompressionMLP):
    raise TypeError(f"{arg} must be a CompressionMLP for compression='mlp', got "
                    f"{type(mlp).__name__}")
  hidden = mlp.b1.shape[0] if getattr(mlp.b1, "ndim", 0) == 1 else None
  want = {"position": (block_length, head_dim), "w1": (block_length * head_dim, hidden),
          "b1": (hidden,), "w2": (hidden, head_dim), "b2": (head_dim,)}
  for field, shape in want.items():
    x = getattr(mlp, field)
    _validation.check_float(f"{arg}.{field}", x)
    if hidden is None or tuple(x.shape) != shape:
      raise ValueError(f"{arg}.{field}.shape={tuple(x.shape)} must be {shape} (l={block_length}, "
                       f"D={head_dim}, H={hidden} from {arg}.b1)")


def _check_gates(gates, *, batch: int, seq_len: int, num_heads: int) -> None:
  _validation.check_float("gates", gates)
  if tuple(gates.shape) != (batch, seq_len, num_heads, len(BRANCHES)):
    raise ValueError(f"gates.shape={tuple(gates.shape)} must be [B, T, HQ, 3] = "
                     f"[{batch}, {seq_len}, {num_heads}, 3] (compressed, selected, window)")


def _check_compressed(name: str, x, *, batch: int, num_slots: int, num_kv_heads: int,
                      head_dim: int, packed: bool) -> None:
  _validation.check_float(name, x)
  want = (batch, num_slots, num_kv_heads, head_dim)
  if tuple(x.shape) != want:
    layout = "T // d" if packed else "max(1, (T - l) // d + 1)"
    raise ValueError(f"{name}.shape={tuple(x.shape)} must be [B, N, HKV, D] = {list(want)} "
                     f"(N = {layout} compressed slots, as nsa_compress returns)")


def _xla_only(op: str, implementation):
  """The registered function of a piece with no kernel: None means "xla" on every platform."""
  _validation.check_implementation(implementation)
  return _dispatch.lookup(op, "xla" if implementation is None else implementation)


# ----------------------------------------------------------------------------- geometry


def num_compressed_slots(seq_len: int, block_length: int, stride: int, packed: bool) -> int:
  """N, the compressed slots of a row of T tokens (module docstring: at least one)."""
  if packed:
    return max(1, seq_len // stride)
  return max(1, (seq_len - block_length) // stride + 1)


class _Layout(NamedTuple):
  """Where each compressed slot's block lies and which slots each query sees. Leading axis B,
  or 1 without segment_ids (shared by the batch)."""

  slot_start: Int[Array, "B N"]  # the block's first position
  slot_valid: Array  # bool [B, N]: the slot holds a complete block
  first: Int[Array, "B T"]  # the first slot of t's document
  end: Int[Array, "B T"]  # one past the last slot complete at t: t sees [first, end)
  start: Int[Array, "B T"]  # t's document start
  rel: Int[Array, "B T"]  # t's position in its document


def _layout(segment_ids, seq_len: int, *, block_length: int, stride: int) -> _Layout:
  """The compressed-slot layout; one document from position 0 when segment_ids is None."""
  t = jnp.arange(seq_len, dtype=jnp.int32)
  if segment_ids is None:
    start = jnp.zeros((1, seq_len), jnp.int32)
  else:
    start = segments.document_bounds(segment_ids)[0].astype(jnp.int32)
  rel = t - start
  num_slots = num_compressed_slots(seq_len, block_length, stride, segment_ids is not None)
  # Eq. 7: block i of a document covers its tokens [i d, i d + l); it is complete at the
  # position where it ends, rel + 1 = i d + l.
  ended = rel + 1 - block_length
  ends_here = (ended >= 0) & (ended % stride == 0)
  done = jnp.where(ended >= 0, ended // stride + 1, 0)  # blocks of t's document complete at t
  end = jnp.cumsum(ends_here, axis=1, dtype=jnp.int32)
  slot = jnp.where(ends_here, end - 1, num_slots)
  rows = jnp.arange(start.shape[0])[:, None]
  slot_start = jnp.zeros((start.shape[0], num_slots), jnp.int32).at[rows, slot].set(
      t - block_length + 1, mode="drop")
  slot_valid = jnp.arange(num_slots) < end[:, -1:]
  return _Layout(slot_start, slot_valid, end - done, end, start, rel)


# ----------------------------------------------------------------------------- compression


def _compress(x, layout: _Layout, mlp, *, block_length: int, compression: str):
  """Eq. 7 on float32 x `[B, T, H, D]` -> `[B, N, H, D]` float32 (zeros in unused slots)."""
  b, seq_len = x.shape[:2]
  # [B or 1, N, l]: the positions of each slot's block. The gather's transpose (the gradient
  # of x) is a scatter-add of l / d terms per token.
  pos = jnp.minimum(layout.slot_start[..., None] + jnp.arange(block_length), seq_len - 1)
  windows = x[jnp.arange(b)[:, None, None], pos]  # [B, N, l, H, D]
  if compression == "mean":
    out = windows.mean(axis=2)
  else:
    mlp = CompressionMLP(*(p.astype(jnp.float32) for p in mlp))
    blocks = windows + mlp.position[None, None, :, None, :]
    n, h, d = blocks.shape[1], blocks.shape[3], blocks.shape[4]
    flat = jnp.moveaxis(blocks, 3, 2).reshape(b, n, h, block_length * d)
    hidden = jax.nn.silu(jnp.einsum("bnhi,ij->bnhj", flat, mlp.w1, precision=_HIGHEST) + mlp.b1)
    out = jnp.einsum("bnhj,jd->bnhd", hidden, mlp.w2, precision=_HIGHEST) + mlp.b2
  return jnp.where(layout.slot_valid[:, :, None, None], out, 0.0)


@functools.partial(jax.jit, static_argnames=("block_length", "stride", "compression"))
def nsa_compress_reference(x, mlp, segment_ids, *, block_length: int, stride: int,
                           compression: str):
  """jnp reference of `nsa_compress`; arguments are already validated."""
  layout = _layout(segment_ids, x.shape[1], block_length=block_length, stride=stride)
  out = _compress(x.astype(jnp.float32), layout, mlp, block_length=block_length,
                  compression=compression)
  return out.astype(x.dtype)


def nsa_compress(
    x: Float[Array, "B T H D"],
    mlp: CompressionMLP | None = None,
    *,
    compression: str = "mlp",
    block_length: int = 32,
    stride: int = 16,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B N H D"]:
  """Compressed keys or values (Eq. 7): one token per block of l tokens at stride d.

  Args:
    x: keys or values `[B, T, H, D]`.
    mlp: the `CompressionMLP` (phi) for compression="mlp"; None for "mean".
    compression: "mlp" (learned, blocks may overlap) or "mean" (mean pooling, l = d).
    block_length: l. stride: d, dividing l.
    segment_ids: None, or int32 `[B, T]` packed documents: each document's blocks on its own
      grid, in the packed slot layout of the module docstring.
    implementation: "xla" or None (the jnp reference, the only implementation); "pallas" raises.

  Returns:
    `[B, N, H, D]` in x's dtype, N = `num_compressed_slots(T, l, d, packed)`; slots with no
    complete block are zero. Differentiable in x and the MLP.
  """
  _validation.check_static("nsa_compress", compression=compression, block_length=block_length,
                           stride=stride, implementation=implementation)
  _validation.check_float("x", x)
  _validation.check_rank4("x", x, "[B, T, H, D]")
  check_options(compression=compression, block_length=block_length, stride=stride,
                select_block_size=stride)
  _check_mlp(mlp, "mlp", compression=compression, block_length=block_length, head_dim=x.shape[3])
  _validation.check_segment_ids(segment_ids, batch=x.shape[0], seq_len=x.shape[1])
  compress = _xla_only("nsa_compress", implementation)
  return compress(x, mlp, segment_ids, block_length=int(block_length), stride=int(stride),
                  compression=compression)


# ----------------------------------------------------------------------------- compressed attention


def _compressed_logits(q, k_cmp, first, end, *, scale):
  """Per-head logits `[B, Tc, HKV, G, N]` of queries q `[B, Tc, HQ, D]` against the compressed
  keys, and which slots each query sees (`[B or 1, Tc, 1, 1, N]`)."""
  b, tc, hq, d = q.shape
  hkv = k_cmp.shape[2]
  qg = q.reshape(b, tc, hkv, hq // hkv, d)
  logits = scale * jnp.einsum("bthgd,bshd->bthgs", qg, k_cmp, precision=_HIGHEST)
  slot = jnp.arange(k_cmp.shape[1])
  visible = (slot >= first[..., None]) & (slot < end[..., None])
  return logits, visible[:, :, None, None, :]


def _compressed_chunk(positions, q, first, end, k_cmp, v_cmp, *, scale):
  """Attention of a chunk of queries over the compressed blocks they see: out `[B, Tc, HQ, D]`,
  lse `[B, Tc, HKV, G]` (-inf, and a zero output, where none is complete yet)."""
  del positions
  logits, visible = _compressed_logits(q, k_cmp, first, end, scale=scale)
  has_key = (end > first)[:, :, None, None]
  masked = jnp.where(visible, logits, -jnp.inf)
  # The shift is a constant of the softmax (stop_gradient); rows without a key shift by 0 and
  # their masked exps are exactly 0, so no inf or NaN reaches a gradient.
  row_max = lax.stop_gradient(jnp.where(has_key, jnp.max(masked, axis=-1), 0.0))
  p = jnp.exp(masked - row_max[..., None])
  denom = jnp.sum(p, axis=-1)
  safe = jnp.where(has_key, denom, 1.0)
  out = jnp.einsum("bthgs,bshd->bthgd", p, v_cmp, precision=_HIGHEST) / safe[..., None]
  lse = jnp.where(has_key, row_max + jnp.log(safe), -jnp.inf)
  return out.reshape(q.shape), lse


def _compressed_attention(q, k_cmp, v_cmp, layout: _Layout, *, scale):
  """float32 q `[B, T, HQ, D]`, k_cmp / v_cmp `[B, N, HKV, D]` -> out, lse `[B, T, HKV, G]`."""
  b, seq_len, hq, _ = q.shape
  chunk = _chunking.query_chunk_size(seq_len, 3 * b * hq * k_cmp.shape[1])
  fn = functools.partial(_compressed_chunk, scale=scale)
  return _chunking.map_query_chunks(fn, chunk, (q, layout.first, layout.end), (k_cmp, v_cmp))


@functools.partial(jax.jit, static_argnames=("block_length", "stride", "scale"))
def compressed_attention_reference(q, k_cmp, v_cmp, segment_ids, *, block_length: int,
                                   stride: int, scale: float):
  """jnp reference of `compressed_attention`; arguments are already validated."""
  layout = _layout(segment_ids, q.shape[1], block_length=block_length, stride=stride)
  out, lse = _compressed_attention(*(x.astype(jnp.float32) for x in (q, k_cmp, v_cmp)), layout,
                                   scale=scale)
  return out.astype(q.dtype), lse.reshape(q.shape[:3])


def _compressed_ranges(layout: _Layout, segment_ids, batch: int, seq_len: int, *,
                       block_length: int):
  """The compressed attention as ranges (`pisa_jax.kernels.nsa`): query t sees slots
  [first, end) `[B, T]`; slot i is seen from the query where its block completes to its
  document's end, `[B, N]` (a slot without a block by none)."""
  first, end = (jnp.broadcast_to(x, (batch, seq_len)) for x in (layout.first, layout.end))
  slot_start = jnp.broadcast_to(layout.slot_start, (batch, layout.slot_start.shape[1]))
  valid = jnp.broadcast_to(layout.slot_valid, slot_start.shape)
  if segment_ids is None:
    doc_end = jnp.full(slot_start.shape, seq_len, jnp.int32)
  else:
    start, length = segments.document_bounds(segment_ids)
    doc_end = jnp.take_along_axis(start + length, slot_start, axis=1)
  key_first = jnp.where(valid, slot_start + block_length - 1, seq_len)
  return first, end, key_first, jnp.where(valid, doc_end, 0)


@functools.partial(jax.jit, static_argnames=("block_length", "stride", "scale", "interpret",
                                             "config"))
def compressed_attention_pallas(q, k_cmp, v_cmp, segment_ids, *, block_length: int, stride: int,
                                scale: float, interpret: bool, config=None):
  """Pallas twin of `compressed_attention_reference` (`pisa_jax.kernels.nsa`: one range of
  compressed slots per query); arguments are already validated. Returns (out in q's dtype,
  lse float32 `[B, T, HQ]`), both differentiable."""
  b, t = q.shape[:2]
  layout = _layout(segment_ids, t, block_length=block_length, stride=stride)
  ranges = _compressed_ranges(layout, segment_ids, b, t, block_length=block_length)
  out, lse = nsa_kernels.range_attention_pallas(q, k_cmp, v_cmp, *ranges, scale=scale,
                                                interpret=interpret, config=config)
  return out.astype(q.dtype), lse


def compressed_attention(
    q: Float[Array, "B T HQ D"],
    k_cmp: Float[Array, "B N HKV D"],
    v_cmp: Float[Array, "B N HKV D"],
    *,
    block_length: int = 32,
    stride: int = 16,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> tuple[Float[Array, "B T HQ D"], Float[Array, "B T HQ"]]:
  """Attention over the compressed blocks, causal at block granularity (Eq. 5's cmp branch).

  Query t attends to the compressed blocks of its document whose whole span [i d, i d + l) lies
  at or before t (i d + l - 1 <= t, document-relative); with none yet its output is zero.

  Args:
    q: queries `[B, T, HQ, D]`.
    k_cmp, v_cmp: compressed keys and values `[B, N, HKV, D]` (`nsa_compress`' layout).
    block_length, stride: l and d that made them. scale: default 1/sqrt(D).
    segment_ids: None, or int32 `[B, T]` packed documents (as given to `nsa_compress`).
    implementation: "xla" (the jnp reference), "pallas" (the kernel of
      `pisa_jax.kernels.nsa`: O(T N D) work, forward and backward, through Triton on a GPU and
      the Pallas interpreter elsewhere) or None ("pallas" on a GPU, else "xla").

  Returns:
    out `[B, T, HQ, D]` in q's dtype; and lse float32 `[B, T, HQ]`, the log of each row's
    softmax denominator (-inf where no block is visible): `nsa_select_blocks` scores blocks with
    exp(logit - lse). Both differentiable in q, k_cmp and v_cmp.
  """
  _validation.check_static("compressed_attention", block_length=block_length, stride=stride,
                           scale=scale, implementation=implementation)
  b, t, _, hkv, d = _check_queries(q, k_cmp, v_cmp, block_length=block_length, stride=stride,
                                   segment_ids=segment_ids)
  _validation.check_implementation(implementation)
  attend = _dispatch.lookup("nsa_compressed_attention", implementation)
  return attend(q, k_cmp, v_cmp, segment_ids, block_length=int(block_length), stride=int(stride),
                scale=_validation.resolve_scale(scale, d))


def _check_queries(q, k_cmp, v_cmp, *, block_length, stride, segment_ids):
  """Checks q against compressed keys (and values, unless None); returns (B, T, HQ, HKV, D)."""
  _validation.check_float("q", q)
  _validation.check_rank4("q", q, "[B, T, HQ, D]")
  _validation.check_rank4("k_cmp", k_cmp, "[B, N, HKV, D]")
  b, t, hq, d = q.shape
  hkv = k_cmp.shape[2]
  if hkv < 1 or hq % hkv:
    raise ValueError(f"query heads HQ={hq} must be a positive multiple of key/value heads "
                     f"HKV={hkv}")
  check_options(block_length=block_length, stride=stride, select_block_size=stride)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  packed = segment_ids is not None
  n = num_compressed_slots(t, block_length, stride, packed)
  for name, x in (("k_cmp", k_cmp), ("v_cmp", v_cmp)):
    if x is not None:
      _check_compressed(name, x, batch=b, num_slots=n, num_kv_heads=hkv, head_dim=d,
                        packed=packed)
  return b, t, hq, hkv, d


# ----------------------------------------------------------------------------- selection


def selection_scores(p_doc, *, block_length: int, stride: int, select_block_size: int,
                     num_blocks: int):
  """Eq. 9: compressed-block probabilities, document-relative `[..., NC]`, -> selection-block
  scores `[..., M]` (M = num_blocks): p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p[(l'/d) j + m - n].

  The d-token piece u is covered by compressed blocks u - l/d + 1 .. u; each piece sums them, and
  each selection block sums its l'/d pieces.
  """
  per_block = block_length // stride
  pieces = num_blocks * (select_block_size // stride)
  # Block i covers pieces i .. i + l/d - 1 < NC + l/d - 1 <= T / d <= pieces (module docstring).
  padded = jnp.pad(p_doc, [(0, 0)] * (p_doc.ndim - 1)
                   + [(per_block - 1, pieces - p_doc.shape[-1])])
  piece = sum(padded[..., per_block - 1 - n:per_block - 1 - n + pieces] for n in range(per_block))
  return piece.reshape(*piece.shape[:-1], num_blocks, select_block_size // stride).sum(-1)


def _select_chunk(positions, q, lse, first, end, rel, k_cmp, *, block_length, stride,
                  select_block_size, top_n, scale, num_doc_blocks, num_blocks):
  """Selection for a chunk of queries: int32 `[B, Tc, HKV, top_n]`, document-relative."""
  del positions
  logits, visible = _compressed_logits(q, k_cmp, first, end, scale=scale)
  # Each head's probability of each compressed block it sees (Eq. 8), summed over the group
  # (Eq. 10: the heads of a group share one selection).
  p = jnp.exp(jnp.where(visible, logits - lse[..., None], -jnp.inf)).sum(axis=3)
  # [B, Tc, HKV, NC]: block i of the query's document is slot first + i.
  slot = first[..., None] + jnp.arange(num_doc_blocks)
  ok = jnp.broadcast_to((slot < end[..., None])[:, :, None, :], (*p.shape[:3], num_doc_blocks))
  slot = jnp.broadcast_to(jnp.minimum(slot, k_cmp.shape[1] - 1)[:, :, None, :], ok.shape)
  p_doc = jnp.where(ok, jnp.take_along_axis(p, slot, axis=-1), 0.0)
  scores = selection_scores(p_doc, block_length=block_length, stride=stride,
                            select_block_size=select_block_size, num_blocks=num_blocks)
  # Blocks 0 .. t // l' are eligible; the first, previous and current forced; the rest by score,
  # ties to the lower index (fla's parallel_nsa_topk; the current block is never scored).
  return flat_top_k(scores, jnp.broadcast_to(rel, p.shape[:2]), block_size=select_block_size,
                    top_k=top_n)


def _select(q, lse, k_cmp, layout: _Layout, *, block_length, stride, select_block_size, top_n,
            scale):
  """float32 q `[B, T, HQ, D]`, lse `[B, T, HKV, G]`, k_cmp `[B, N, HKV, D]` -> int32 indices."""
  b, seq_len, hq, _ = q.shape
  hkv = k_cmp.shape[2]
  num_blocks = -(-seq_len // select_block_size)
  num_doc_blocks = num_compressed_slots(seq_len, block_length, stride, packed=False)
  chunk = _chunking.query_chunk_size(
      seq_len, b * (3 * hq * k_cmp.shape[1] + hkv * (3 * num_doc_blocks + 3 * num_blocks)))
  fn = functools.partial(
      _select_chunk, block_length=block_length, stride=stride,
      select_block_size=select_block_size, top_n=top_n, scale=scale,
      num_doc_blocks=num_doc_blocks, num_blocks=num_blocks)
  return _chunking.map_query_chunks(fn, chunk, (q, lse, layout.first, layout.end, layout.rel),
                                    (k_cmp,))


@functools.partial(jax.jit, static_argnames=("block_length", "stride", "select_block_size",
                                             "top_n", "scale"))
def nsa_select_blocks_reference(q, k_cmp, lse, segment_ids, *, block_length: int, stride: int,
                                select_block_size: int, top_n: int, scale: float):
  """jnp reference of `nsa_select_blocks`; arguments are already validated."""
  b, t, hq, _ = q.shape
  hkv = k_cmp.shape[2]
  layout = _layout(segment_ids, t, block_length=block_length, stride=stride)
  q, k_cmp, lse = (lax.stop_gradient(x.astype(jnp.float32)) for x in (q, k_cmp, lse))
  return _select(q, lse.reshape(b, t, hkv, hq // hkv), k_cmp, layout, block_length=block_length,
                 stride=stride, select_block_size=select_block_size, top_n=top_n, scale=scale)


@functools.partial(jax.jit, static_argnames=("block_length", "stride", "select_block_size",
                                             "top_n", "scale", "interpret", "config"))
def nsa_select_blocks_pallas(q, k_cmp, lse, segment_ids, *, block_length: int, stride: int,
                             select_block_size: int, top_n: int, scale: float, interpret: bool,
                             config=None):
  """Pallas twin of `nsa_select_blocks_reference` (`pisa_jax.kernels.nsa_select`); arguments
  are already validated. Packed rows pass each query's document start, first slot and end of
  the compressed-slot layout to the kernel's packed launch."""
  documents = None
  if segment_ids is not None:
    layout = _layout(segment_ids, q.shape[1], block_length=block_length, stride=stride)
    documents = (layout.start, layout.first, layout.end)
  q, k_cmp, lse = (lax.stop_gradient(x) for x in (q, k_cmp, lse))
  return nsa_select_kernels.nsa_select_blocks_pallas(
      q, k_cmp, lse, block_length=block_length, stride=stride,
      select_block_size=select_block_size, top_n=top_n, scale=scale, interpret=interpret,
      config=config, documents=documents)


def nsa_select_blocks(
    q: Float[Array, "B T HQ D"],
    k_cmp: Float[Array, "B N HKV D"],
    lse: Float[Array, "B T HQ"],
    *,
    block_length: int = 32,
    stride: int = 16,
    select_block_size: int = 64,
    top_n: int = 16,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Int[Array, "B T HKV N"]:
  """NSA's block selection (Eq. 8-11) from the compressed attention's scores.

  Each query head's probability of each compressed block, exp(q k_cmp * scale - lse), is mapped
  onto the selection blocks of l' tokens (Eq. 9, module docstring), summed over the GQA group,
  and the top_n blocks kept: blocks 0 .. t // l' are eligible, the first, previous and current
  are always kept, all are kept while at most top_n are eligible, ties go to the lower index.

  Args:
    q: queries `[B, T, HQ, D]`. k_cmp: compressed keys `[B, N, HKV, D]` (`nsa_compress`).
    lse: float `[B, T, HQ]`, the log-sum-exp that `compressed_attention` returns for the same q,
      k_cmp and scale.
    block_length, stride: l and d of the compression. select_block_size: l', a multiple of d.
    top_n: n, blocks kept (>= 3: the first, previous and current are forced).
    scale: default 1/sqrt(D), as `compressed_attention`'s.
    segment_ids: None, or int32 `[B, T]` packed documents: block numbers within each document.
    implementation: "xla" (the jnp reference: query chunks, O(T N) logits a chunk), "pallas"
      (the kernel of `pisa_jax.kernels.nsa_select`: scores and top-n fused, nothing `[T, N]` in
      memory; packed rows too) or None ("pallas" on a GPU, else "xla").

  Returns:
    int32 `[B, T, HKV, top_n]`, ascending, -1 padded: block indices for `sparse_attention` with
    block_size=l' (and the same segment_ids). No gradient. The kernel sums in another order than
    the reference: the two agree except where two blocks' scores are within float32 rounding.
  """
  _validation.check_static("nsa_select_blocks", block_length=block_length, stride=stride,
                           select_block_size=select_block_size, top_n=top_n, scale=scale,
                           implementation=implementation)
  b, t, hq, _, d = _check_queries(q, k_cmp, None, block_length=block_length, stride=stride,
                                  segment_ids=segment_ids)
  check_options(block_length=block_length, stride=stride, select_block_size=select_block_size,
                top_n=top_n)
  _validation.check_float("lse", lse)
  if tuple(lse.shape) != (b, t, hq):
    raise ValueError(f"lse.shape={tuple(lse.shape)} must be [B, T, HQ] = [{b}, {t}, {hq}] (as "
                     "compressed_attention returns)")
  _validation.check_implementation(implementation)
  if implementation is None:
    implementation = "pallas" if _dispatch.on_gpu() else "xla"
  select = _dispatch.lookup("nsa_select_blocks", implementation)
  return select(q, k_cmp, lse, segment_ids, block_length=int(block_length), stride=int(stride),
                select_block_size=int(select_block_size), top_n=int(top_n),
                scale=_validation.resolve_scale(scale, d))


# ----------------------------------------------------------------------------- sliding window


def _window_chunk(positions, q, start, k, v, *, window, scale, num_keys, seq_len):
  """Window attention of a chunk of queries at positions `[Tc]` (consecutive): the keys they can
  see lie in one slice of `num_keys` keys ending at the chunk's last query."""
  b, tc, hq, d = q.shape
  hkv = k.shape[2]
  key0 = jnp.maximum(positions[0] + tc - num_keys, 0)
  k_win = lax.dynamic_slice_in_dim(k, key0, num_keys, axis=1)
  v_win = lax.dynamic_slice_in_dim(v, key0, num_keys, axis=1)
  key_pos = key0 + jnp.arange(num_keys)
  t = positions[:, None]
  visible = ((key_pos <= t) & (key_pos > t - window) & (key_pos >= start[..., None])
             & (key_pos < seq_len))  # [B or 1, Tc, L]
  qg = q.reshape(b, tc, hkv, hq // hkv, d)
  logits = scale * jnp.einsum("bthgd,bshd->bthgs", qg, k_win, precision=_HIGHEST)
  # Every query sees itself, but the padding rows past T of the last chunk (dropped) may see no
  # key: their weights are zeros, not the NaN of an empty softmax, which the backward pass would
  # carry into dk and dv (0 * NaN).
  visible = visible[:, :, None, None, :]
  has_key = jnp.any(visible, axis=-1, keepdims=True)
  masked = jnp.where(visible, logits, -jnp.inf)
  row_max = lax.stop_gradient(jnp.where(has_key, jnp.max(masked, axis=-1, keepdims=True), 0.0))
  p = jnp.exp(masked - row_max)
  p = p / jnp.where(has_key, jnp.sum(p, axis=-1, keepdims=True), 1.0)
  return jnp.einsum("bthgs,bshd->bthgd", p, v_win, precision=_HIGHEST).reshape(q.shape)


def _window_attention(q, k, v, start, *, window, scale):
  """float32 q `[B, T, HQ, D]`, k / v `[B, T, HKV, D]`, document starts `[B or 1, T]`."""
  b, seq_len, hq, _ = q.shape
  span = 1 << (window - 1).bit_length()  # a power of two >= w
  chunk = min(_chunking.query_chunk_size(seq_len, 3 * b * hq * 2 * span), max(span, 1))
  chunk = seq_len if seq_len <= chunk else chunk
  padded = -(-seq_len // chunk) * chunk
  num_keys = min(chunk + window - 1, padded)
  pad = [(0, 0), (0, padded - seq_len), (0, 0), (0, 0)]
  fn = functools.partial(_window_chunk, window=window, scale=scale, num_keys=num_keys,
                         seq_len=seq_len)
  return _chunking.map_query_chunks(fn, chunk, (q, start), (jnp.pad(k, pad), jnp.pad(v, pad)))


@functools.partial(jax.jit, static_argnames=("window", "scale"))
def sliding_window_attention_reference(q, k, v, segment_ids, *, window: int, scale: float):
  """jnp reference of `sliding_window_attention`; arguments are already validated."""
  layout_start = (jnp.zeros((1, q.shape[1]), jnp.int32) if segment_ids is None
                  else segments.document_bounds(segment_ids)[0].astype(jnp.int32))
  out = _window_attention(*(x.astype(jnp.float32) for x in (q, k, v)), layout_start,
                          window=window, scale=scale)
  return out.astype(q.dtype)


WINDOW_BACKENDS = ("cudnn", "pallas")


def cudnn_takes_window(q, k, v, segment_ids, interpret: bool) -> bool:
  """Whether cuDNN's fused attention can run the window branch: on a GPU (not the
  interpreter), one document per row (`jax.nn.dot_product_attention` takes no segment ids),
  16-bit inputs of one dtype (cuDNN has no float32 kernel), a head dim that is a multiple of 8
  up to 128."""
  dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
  d = q.shape[-1]
  return (not interpret and segment_ids is None and len(dtypes) == 1
          and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
          and d % 8 == 0 and d <= 128)


def _window_ranges(segment_ids, batch: int, seq_len: int, *, window: int):
  """The window as ranges (`pisa_jax.kernels.nsa`): query t sees keys
  [max(document start, t - w + 1), t + 1); key j is seen by queries [j, min(j + w, its
  document's end))."""
  t = jnp.arange(seq_len, dtype=jnp.int32)[None, :]
  if segment_ids is None:
    start, doc_end = jnp.zeros_like(t), jnp.full_like(t, seq_len)
  else:
    start, length = segments.document_bounds(segment_ids)
    doc_end = start + length
  first = jnp.maximum(start, t - window + 1)
  key_end = jnp.minimum(t + window, doc_end)
  return tuple(jnp.broadcast_to(x, (batch, seq_len)).astype(jnp.int32)
               for x in (first, t + 1, t, key_end))


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "backend",
                                             "config"))
def sliding_window_attention_pallas(q, k, v, segment_ids, *, window: int, scale: float,
                                    interpret: bool, backend: str | None = None, config=None):
  """The fast twin of `sliding_window_attention_reference`; arguments are already validated.

  backend: "cudnn", cuDNN's fused attention with its causal sliding window
  (`jax.nn.dot_product_attention(..., local_window_size=(w - 1, 0))`: key j is visible to t
  when t - w < j <= t, the reference's window exactly); "pallas", the range kernel of
  `pisa_jax.kernels.nsa` (any dtype, head dim and segment_ids); None, "cudnn" where
  `cudnn_takes_window` holds, else "pallas". Asking for "cudnn" where it does not hold raises.
  cuDNN is the default where it applies for its forward, 9-13% faster than the range kernel's
  (w 512, d64, 16K-128K, groups 4-16: `benchmarks/results/nsa.json`); forward + backward, the
  two are within 5% of each other either way.
  """
  takes = cudnn_takes_window(q, k, v, segment_ids, interpret)
  if backend is None:
    backend = "cudnn" if takes else "pallas"
  if backend not in WINDOW_BACKENDS:
    raise ValueError(f"{backend=} must be one of {WINDOW_BACKENDS} or None")
  if backend == "cudnn":
    if not takes:
      raise ValueError(f"{backend=} needs a GPU, segment_ids=None, bfloat16 or float16 q, k, v "
                       f"of one dtype and a head dim that is a multiple of 8 up to 128: got "
                       f"{q.dtype}/{k.dtype}/{v.dtype}, D={q.shape[-1]}, "
                       f"segment_ids={'given' if segment_ids is not None else None}")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=(window - 1, 0),
                                        implementation="cudnn")
  b, t = q.shape[:2]
  ranges = _window_ranges(segment_ids, b, t, window=window)
  out, _ = nsa_kernels.range_attention_pallas(q, k, v, *ranges, scale=scale,
                                              interpret=interpret, config=config)
  return out.astype(q.dtype)


def sliding_window_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    *,
    window: int = 512,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """Causal attention over the last `window` tokens: query t sees keys t - w < j <= t of its
  document (fla's `window_size=(w - 1, 0)`).

  Args as in `sparse_attention`; window: w >= 1. implementation: "xla" (the jnp reference:
  query chunks over a slice of chunk + w - 1 keys, O(T w)), "pallas" (cuDNN's sliding window on
  a GPU where it takes the arguments, `cudnn_takes_window`; else the Pallas range kernel of
  `pisa_jax.kernels.nsa`, which takes any; both O(T w), forward and backward) or None ("pallas"
  on a GPU, else "xla").

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k and v.
  """
  _validation.check_static("sliding_window_attention", window=window, scale=scale,
                           implementation=implementation)
  b, t, _, _, d = _validation.check_qk(q, k)
  _validation.check_v(v, k)
  check_options(window=window)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  _validation.check_implementation(implementation)
  attend = _dispatch.lookup("sliding_window_attention", implementation)
  return attend(q, k, v, segment_ids, window=int(window),
                scale=_validation.resolve_scale(scale, d))


# ----------------------------------------------------------------------------- the layer


def _gate(gates, out_cmp, out_slc, out_win, dtype):
  """Eq. 5: the branches' float32 outputs `[B, T, HQ, D]` weighted by their gates."""
  g = gates.astype(jnp.float32)[..., None]  # [B, T, HQ, 3, 1]
  out = (g[:, :, :, 0] * out_cmp.astype(jnp.float32) + g[:, :, :, 1] * out_slc.astype(jnp.float32)
         + g[:, :, :, 2] * out_win.astype(jnp.float32))
  return out.astype(dtype)


def _reference_indices(q_sel, lse, k_cmp_sel, layout, *, block_length, stride,
                       select_block_size, top_n, scale):
  """The selection in the reference from float32 q_sel, lse `[B, T, HKV, G]` and k_cmp_sel, all
  held fixed (Appendix B of PISA, Section 3.3 of NSA)."""
  return lax.stop_gradient(_select(
      *(lax.stop_gradient(x) for x in (q_sel, lse, k_cmp_sel)), layout,
      block_length=block_length, stride=stride, select_block_size=select_block_size,
      top_n=top_n, scale=scale))


_NSA_STATIC = ("compression", "block_length", "stride", "select_block_size", "top_n", "window",
               "scale")


@functools.partial(jax.jit, static_argnames=_NSA_STATIC)
def nsa_attention_reference(q, k, v, gates, key_mlp, value_mlp, segment_ids, *, compression,
                            block_length, stride, select_block_size, top_n, window, scale):
  """`nsa_attention` with every branch in the jnp reference ("xla"), in float32."""
  layout = _layout(segment_ids, q.shape[1], block_length=block_length, stride=stride)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  k_cmp = _compress(k32, layout, key_mlp, block_length=block_length, compression=compression)
  v_cmp = _compress(v32, layout, value_mlp, block_length=block_length, compression=compression)
  out_cmp, lse = _compressed_attention(q32, k_cmp, v_cmp, layout, scale=scale)
  indices = _reference_indices(q32, lse, k_cmp, layout, block_length=block_length, stride=stride,
                               select_block_size=select_block_size, top_n=top_n, scale=scale)
  out_slc = _attend(q, k, v, indices, segment_ids, block_size=select_block_size, scale=scale,
                    implementation="xla")
  out_win = _window_attention(q32, k32, v32, layout.start, window=window, scale=scale)
  return _gate(gates, out_cmp, out_slc, out_win, q.dtype)


@functools.partial(jax.jit, static_argnames=_NSA_STATIC + ("interpret",))
def nsa_attention_pallas(q, k, v, gates, key_mlp, value_mlp, segment_ids, *, compression,
                         block_length, stride, select_block_size, top_n, window, scale,
                         interpret: bool):
  """`nsa_attention` on the kernels: the compressed attention on the range kernel
  (`compressed_attention_pallas`, its lse feeding the selection), the selection on
  `nsa_select_blocks_pallas` (packed rows on its packed launch), the selected branch on the
  sparse-attention kernel, the window on `sliding_window_attention_pallas` (cuDNN where it takes
  the arguments); the compression in the jnp reference."""
  b, t = q.shape[:2]
  layout = _layout(segment_ids, t, block_length=block_length, stride=stride)
  k_cmp, v_cmp = (_compress(x.astype(jnp.float32), layout, mlp, block_length=block_length,
                            compression=compression).astype(q.dtype)
                  for x, mlp in ((k, key_mlp), (v, value_mlp)))
  ranges = _compressed_ranges(layout, segment_ids, b, t, block_length=block_length)
  out_cmp, lse = nsa_kernels.range_attention_pallas(q, k_cmp, v_cmp, *ranges, scale=scale,
                                                    interpret=interpret)
  # The selection scores the blocks with the very compressed keys the kernel's lse summed over.
  sizes = dict(block_length=block_length, stride=stride, select_block_size=select_block_size,
               top_n=top_n, scale=scale)
  indices = nsa_select_blocks_pallas(q, k_cmp, lse, segment_ids, interpret=interpret, **sizes)
  out_slc = _attend(q, k, v, indices, segment_ids, block_size=select_block_size, scale=scale,
                    implementation="pallas")
  out_win = sliding_window_attention_pallas(q, k, v, segment_ids, window=window, scale=scale,
                                            interpret=interpret)
  return _gate(gates, out_cmp, out_slc, out_win, q.dtype)


def nsa_attention(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    gates: Float[Array, "B T HQ 3"],
    *,
    key_mlp: CompressionMLP | None = None,
    value_mlp: CompressionMLP | None = None,
    compression: str = "mlp",
    block_length: int = 32,
    stride: int = 16,
    select_block_size: int = 64,
    top_n: int = 16,
    window: int = 512,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
) -> Float[Array, "B T HQ D"]:
  """Native Sparse Attention (Eq. 5): compressed, selected and sliding-window attention, gated.

  Args:
    q: queries `[B, T, HQ, D]`; k, v: keys and values `[B, T, HKV, D]`, any GQA group HQ / HKV.
    gates: `[B, T, HQ, 3]`, each in (0, 1) (the caller's sigmoid(Linear(x))): the weights of the
      compressed, selected and window branches, per token and head.
    key_mlp, value_mlp: `CompressionMLP`s (phi of Eq. 7) for compression="mlp"; None for "mean".
    compression: "mlp" (blocks of l at stride d, learned) or "mean" (l = d, fla's variant).
    block_length: l (32). stride: d (16), dividing l. select_block_size: l' (64), a multiple of
      d. top_n: n (16), selected blocks, the first, previous and current included.
    window: w (512), the window branch's keys t - w < j <= t.
    scale: logit scale of every branch, default 1/sqrt(D).
    segment_ids: None, or int32 `[B, T]` packed documents: every branch its document's own, each
      row of the output that of its document run alone.
    implementation: "xla" (every branch in the jnp reference, float32), "pallas" (the
      compressed attention on the range kernel, the selection on `nsa_select_blocks`' kernel,
      the selected branch on the sparse-attention kernel, the window on cuDNN's sliding window
      where it takes the arguments, else the range kernel; the compression in jnp under XLA) or
      None ("pallas" on a GPU, else "xla").

  Options fix shapes or compiled code: static under `jax.jit`, as in `sparse_attention`.

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k, v, gates and both MLPs; the selection
    gets no gradient.
  """
  _validation.check_static("nsa_attention", compression=compression, block_length=block_length,
                           stride=stride, select_block_size=select_block_size, top_n=top_n,
                           window=window, scale=scale, implementation=implementation)
  b, t, hq, _, d = _validation.check_qk(q, k)
  _validation.check_v(v, k)
  check_options(compression=compression, block_length=block_length, stride=stride,
                select_block_size=select_block_size, top_n=top_n, window=window)
  _check_gates(gates, batch=b, seq_len=t, num_heads=hq)
  for name, mlp in (("key_mlp", key_mlp), ("value_mlp", value_mlp)):
    _check_mlp(mlp, name, compression=compression, block_length=block_length, head_dim=d)
  _validation.check_segment_ids(segment_ids, batch=b, seq_len=t)
  _validation.check_implementation(implementation)
  attend = _dispatch.lookup("nsa_attention", implementation)
  return attend(q, k, v, gates, key_mlp, value_mlp, segment_ids, compression=compression,
                block_length=int(block_length), stride=int(stride),
                select_block_size=int(select_block_size), top_n=int(top_n), window=int(window),
                scale=_validation.resolve_scale(scale, d))
