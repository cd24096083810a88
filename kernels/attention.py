"""Pallas (Triton) block-sparse attention over selected leaf blocks (Eq. 6), forward and backward.

The twin of `pisa_jax.attention.sparse_attention_reference` (and, with segment_ids, of
`pisa_jax.attention.sparse_attention_packed_reference`). Reads top to bottom: the tile
config, the forward kernel, the dq kernel (which also writes delta = rowsum(o * do)), then the
`custom_vjp` op; the inverted index and the dk/dv kernels live in `attention_backward`.

Layout inside the kernels: q and o are viewed as `[B, T, HKV, G, D]` (a free reshape), so one
program owns one query position and one KV head and loads the G query heads of that KV head at
once: the `[G, D] x [D, C]` score tile feeds the tensor cores with M = G rows (padded to a power of
two >= `min_rows`, padding rows masked). Key/value blocks are loaded as contiguous rows
`k_ref[pl.ds(pl.multiple_of(b * C, C), C), :]` after clamping the index into `[0, t // C]`; the
clamped slots and keys after the query are masked, so -1 padding and future blocks contribute
nothing (the rule of Eq. 6), and a query with no visible key gets zeros.

Backward (Appendix B: the selection is held fixed, gradients flow through the selected entries):
- dq mirrors the forward: per (query, KV head) it re-streams the selected blocks.
- dk/dv use an inverted index (for each key block, the queries that selected it) cut into work
  items whose float32 partials a second kernel sums in a fixed order: no atomics, bit-identical
  run to run (`attention_backward`).

Packed documents: each query's document start is one more per-query input; a selected block is
loaded from start + i C (not aligned to C) and the same `key <= query` compare masks it, because
a key of the block at or before the query lies in the query's document. The unpacked kernels
trace exactly as before (the packed code is behind a static flag).

Memory: O(T * HQ * D) for activations plus O(T * HKV * K) for the indices and the inverted index;
the dk/dv partials are O(T * HKV * D) because an item holds at least K * C entries' worth of keys.
No `[T, T]` or `[T, M]` buffer exists anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax import checkpoint_names, segments
from pisa_jax.kernels._common import LN2, LOG2E, next_pow2
from pisa_jax.kernels._common import call_kernel as _call_kernel
from pisa_jax.kernels._common import dot_precision as _dot_precision
from pisa_jax.kernels.attention_backward import backward_dkv, inverted_index, packed_inverted_index


@dataclasses.dataclass(frozen=True)
class SparseAttentionConfig:
  """Tile sizes and Triton launch parameters of the three kernels.

  Attributes:
    min_rows: the smallest M of a tensor-core dot; the G query heads of a program are padded up to
      max(min_rows, next power of two of G).
    fwd_num_warps, fwd_num_stages: forward kernel launch.
    fwd_step_keys: 0, or keys per step of the forward's online softmax, a power of two >= 16 that
      divides the block size: a selected block is streamed in block_size // fwd_step_keys steps,
      so each pipelining stage holds that many keys and values (less shared memory per program:
      more programs per SM and more bytes in flight for this L2-bound loop). 0: whole blocks.
    dq_num_warps, dq_num_stages: dq kernel launch.
    dkv_rows: rows (query, head) pairs per inner step of the dk/dv kernel, a power of two >= G;
      each step covers dkv_rows // G queries.
    dkv_num_warps, dkv_num_stages: dk/dv kernel launch.
    packed_dkv_num_warps: warps of the packed dk/dv launch for the items that straddle a
      document boundary inside an array block (a power of two): their programs hold 2C keys,
      twice the accumulators of an unpacked one, so twice the warps keep the registers per
      thread the same. Every other packed item runs the unpacked launch.
    items_entries: most queries one dk/dv program handles for one key block; a block selected by
      more queries is split into several programs whose partials are summed in a fixed order.
    reduce_num_warps: launch of the partial-sum kernel.
  """

  min_rows: int = 16
  fwd_num_warps: int = 4
  fwd_num_stages: int = 2
  fwd_step_keys: int = 0
  dq_num_warps: int = 4
  dq_num_stages: int = 2
  dkv_rows: int = 64
  dkv_num_warps: int = 4
  dkv_num_stages: int = 2
  packed_dkv_num_warps: int = 8
  items_entries: int = 512
  reduce_num_warps: int = 4

  def __post_init__(self):
    for name in ("min_rows", "dkv_rows", "packed_dkv_num_warps"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= 1")
    if self.fwd_step_keys and (self.fwd_step_keys < 16
                               or self.fwd_step_keys & (self.fwd_step_keys - 1)):
      raise ValueError(f"fwd_step_keys={self.fwd_step_keys} must be 0 (whole blocks) or a power "
                       "of two >= 16 (the smallest tensor-core dot)")
    if self.items_entries < 1:
      raise ValueError(f"items_entries={self.items_entries} must be >= 1")

  @classmethod
  def default(cls, *, head_dim: int, group: int, top_k: int, block_size: int
              ) -> "SparseAttentionConfig":
    """Heuristic defaults, the fastest settings of sweeps at N = 16K-128K, HQ = 32, HKV = 2.

    Forward and dq: fewest warps that hold the tile without spilling: one at d <= 64 (the
    `[16, C]` tile's row max and sums stay inside one warp, no exchange through shared memory);
    at d = 128 the forward on one warp in steps of 16 keys (on whole blocks one warp spills) and
    dq on two (the forward's shape: same loads, no spills); 2 pipelining stages beat 1. dk/dv:
    64 rows (4 queries of a group of 16) on 4 warps beat 32 or 128 rows and 8 warps; 2 warps
    spill. Packed dk/dv: items within one document block run the unpacked launch; the 2C-key
    launch of the items across a document boundary takes 8 warps, which hold its 64 rows at
    d = 64 without spills (ptxas, sm_90a); float32 operands take half the rows there (shared
    memory).
    """
    dp = next_pow2(max(16, head_dim))
    warps = 1 if dp <= 64 else 2
    step_keys = 16 if dp == 128 and block_size % 16 == 0 and block_size > 16 else 0
    return cls(
        # 16-key steps are what let one warp hold d = 128 without spilling.
        fwd_num_warps=1 if step_keys else warps,
        fwd_num_stages=2,
        fwd_step_keys=step_keys,
        dq_num_warps=warps,
        dq_num_stages=2,
        dkv_rows=max(64, next_pow2(group)),
        dkv_num_warps=4,
        dkv_num_stages=2,
        packed_dkv_num_warps=8,
        # An item of K * C queries keeps the partials O(T * D) per KV head and the longest
        # program no longer than an average block's list.
        items_entries=max(64, top_k * block_size),
    )


def _rows_mask(group: int, rows: int):
  """[rows, 1] mask of the real query heads among the padded rows."""
  return (jnp.arange(rows) < group)[:, None]


def _load_rows(ref, t, group: int, rows: int, other=0.0):
  """Loads the `[rows, ...]` tile of position t from a `[T, G, ...]` ref, rows >= G masked."""
  if rows == group:
    return ref[t]
  if len(ref.shape) == 2:
    return plt.load(ref.at[t, pl.ds(0, rows)], mask=jnp.arange(rows) < group, other=other)
  return plt.load(ref.at[t, pl.ds(0, rows), :], mask=_rows_mask(group, rows), other=other)


def _store_rows(ref, t, value, group: int, rows: int):
  if rows == group:
    ref[t] = value
  elif value.ndim == 1:
    plt.store(ref.at[t, pl.ds(0, rows)], value, mask=jnp.arange(rows) < group)
  else:
    plt.store(ref.at[t, pl.ds(0, rows), :], value, mask=_rows_mask(group, rows))


def _block_slot(idx_ref, t, i, block_size: int, sub=0, step_keys: int | None = None,
                doc_start=None, pos=None):
  """Block start and visibility mask for slot i of query t (keys `sub * step_keys` onwards of
  the block, `step_keys` of them; the whole block by default).

  pos: None, or query t's position in the key sequence (t + the query offset of a sequence
  shard): the causal limit and the current block are then pos's, the index row stays t's.

  Returns the clamped start row (inside a valid, aligned block at or before the query's block)
  and the `[step_keys]` mask of keys j <= t inside a real selected block: -1 padding and blocks
  after the query's own block are invalid; the clamp keeps every load in bounds.

  doc_start: None, or the first position of query t's document (packed rows): the index is then
  the document's block number, the block starts at doc_start + i C (aligned to nothing), and
  validity counts blocks from the document's start. A key j of the block with j <= t lies in
  the query's document, so the one compare still masks everything the query must not see.
  """
  step_keys = step_keys or block_size
  if doc_start is not None:
    cur = lax.div(t - doc_start, block_size)
    blk = idx_ref[t, i]
    valid = (blk >= 0) & (blk <= cur)
    start = doc_start + jnp.clip(blk, 0, cur) * block_size + sub * step_keys
    key_pos = start + jnp.arange(step_keys)
    return start, key_pos <= jnp.where(valid, t, start - 1)
  t_pos = t if pos is None else pos
  cur = t_pos // block_size
  blk = idx_ref[t, i]
  valid = (blk >= 0) & (blk <= cur)
  start = pl.multiple_of(jnp.clip(blk, 0, cur) * block_size + sub * step_keys, step_keys)
  key_pos = start + jnp.arange(step_keys)
  # One compare per key: an invalid slot sees up to start - 1, that is nothing.
  visible = key_pos <= jnp.where(valid, t_pos, start - 1)
  return start, visible


# ----------------------------------------------------------------------------- forward kernel


def _extra_refs(refs, packed: bool, offset: bool):
  """(start_ref, off_ref, outputs...): the optional inputs before the outputs, None if absent."""
  start_ref = refs[0] if packed else None
  off_ref = refs[int(packed)] if offset else None
  return (start_ref, off_ref) + tuple(refs[int(packed) + int(offset):])


def _fwd_kernel(q_ref, k_ref, v_ref, idx_ref, *refs, block_size: int, scale: float, group: int,
                rows: int, top_k: int, step_keys: int, packed: bool, offset: bool = False):
  """One program: query row t, KV head h. q_ref `[T, G, D]`, k_ref/v_ref `[Tk, D]`.

  The loop streams the selected blocks in steps of `step_keys` keys (`block_size // step_keys`
  steps per block) through one online softmax. Packed rows add start_ref `[T]`, each query's
  document start, before the outputs; a sequence shard adds off_ref `[1]`, the position of its
  first query among the keys (query t sits at off + t)."""
  start_ref, off_ref, o_ref, lse_ref = _extra_refs(refs, packed, offset)
  t = pl.program_id(0)
  doc_start = start_ref[t] if packed else None
  pos = t + off_ref[0] if offset else None
  # [R, D]
  b_q = _load_rows(q_ref, t, group, rows)
  precision = _dot_precision(b_q.dtype)
  qk_scale = scale * LOG2E
  d = b_q.shape[-1]
  steps_per_block = block_size // step_keys

  def body(s, carry):
    b_m, b_l, b_acc = carry
    # Slot and step within it; truncating div / rem (s >= 0), no floor-division fix-ups.
    slot, sub = (s, 0) if steps_per_block == 1 else (lax.div(s, steps_per_block),
                                                      lax.rem(s, steps_per_block))
    start, visible = _block_slot(idx_ref, t, slot, block_size, sub, step_keys, doc_start, pos)
    # [S, D]
    b_k = k_ref[pl.ds(start, step_keys), :]
    # Values of hidden keys load as zeros: their weight is 0, but 0 * NaN = NaN.
    b_v = plt.load(v_ref.at[pl.ds(start, step_keys), :], mask=visible[:, None], other=0.0)
    # [R, S]: base-2 logits, Eq. 6 masked to the visible keys.
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_s = jnp.where(visible[None, :], b_s, -jnp.inf)
    m_new = jnp.maximum(b_m, jnp.max(b_s, axis=1))
    # Until a row has seen a visible key its max is -inf; shift by 0 so no inf - inf appears.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(b_m - m_use)
    b_p = jnp.exp2(b_s - m_use[:, None])
    b_l = b_l * alpha + jnp.sum(b_p, axis=1)
    b_acc = b_acc * alpha[:, None] + jnp.dot(
        b_p.astype(b_v.dtype), b_v, precision=precision, preferred_element_type=jnp.float32)
    return m_new, b_l, b_acc

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  b_m, b_l, b_acc = lax.fori_loop(0, top_k * steps_per_block, body, init)
  # A row with no visible key has l = 0 and acc = 0: it gets zeros and lse = -inf.
  has_key = b_l > 0
  b_o = b_acc / jnp.where(has_key, b_l, 1.0)[:, None]
  b_lse = jnp.where(has_key, (b_m + jnp.log2(jnp.where(has_key, b_l, 1.0))) * LN2, -jnp.inf)
  _store_rows(o_ref, t, b_o.astype(o_ref.dtype), group, rows)
  _store_rows(lse_ref, t, b_lse, group, rows)


def _query_grid_specs(t: int, tk: int, g: int, d: int, top_k: int):
  """BlockSpecs of the (query, KV head, batch) grid shared by the forward and dq kernels: each
  program sees one batch entry and one KV head's whole rows of q/o `[T, G, D]`, k/v `[Tk, D]`,
  indices `[T, K]` and lse `[T, G]`, and picks its query row inside the kernel."""
  q_spec = pl.BlockSpec((None, t, None, g, d), lambda i, h, bb: (bb, 0, h, 0, 0))
  kv_spec = pl.BlockSpec((None, tk, None, d), lambda i, h, bb: (bb, 0, h, 0))
  idx_spec = pl.BlockSpec((None, t, None, top_k), lambda i, h, bb: (bb, 0, h, 0))
  lse_spec = pl.BlockSpec((None, t, None, g), lambda i, h, bb: (bb, 0, h, 0))
  return q_spec, kv_spec, idx_spec, lse_spec


def _start_specs(starts, t: int, offset=None):
  """The document-start input of packed rows (`[B, T]`, one batch entry's row per program) and
  the query offset `[1]` of a sequence shard; nothing for unpacked rows at offset 0."""
  specs, args = [], ()
  if starts is not None:
    specs, args = [pl.BlockSpec((None, t), lambda i, h, bb: (bb, 0))], (starts,)
  if offset is not None:
    specs, args = specs + [pl.BlockSpec((1,), lambda i, h, bb: (0,))], args + (offset,)
  return specs, args


def _forward(q5, k, v, block_indices, starts, offset=None, *, block_size, scale, interpret,
             config):
  """q5 `[B, T, HKV, G, D]`, k/v `[B, Tk, HKV, D]` -> (o5 like q5, lse float32 `[B, T, HKV, G]`);
  starts: None, or each query's document start `[B, T]` (packed rows); offset: None, or int32
  `[1]`, the position of q's first row among the keys (a sequence shard)."""
  b, t, hkv, g, d = q5.shape
  tk = k.shape[1]
  top_k = block_indices.shape[-1]
  rows = max(config.min_rows, next_pow2(g))
  step_keys = config.fwd_step_keys or block_size
  if block_size % step_keys:
    raise ValueError(f"fwd_step_keys={config.fwd_step_keys} must divide {block_size=}")
  kernel = functools.partial(_fwd_kernel, block_size=block_size, scale=scale, group=g, rows=rows,
                             top_k=top_k, step_keys=step_keys, packed=starts is not None,
                             offset=offset is not None)
  q_spec, kv_spec, idx_spec, lse_spec = _query_grid_specs(t, tk, g, d, top_k)
  start_specs, start_args = _start_specs(starts, t, offset)
  call = pl.pallas_call(
      kernel,
      grid=(t, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, idx_spec] + start_specs,
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, t, hkv, g), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.fwd_num_warps,
                                         num_stages=config.fwd_num_stages),
      interpret=interpret,
      name=f"pisa_sparse_attention_fwd{_suffix(starts, offset)}",
  )
  return _call_kernel(call, q5, k, v, block_indices, *start_args)


def _suffix(starts, offset) -> str:
  return ("_packed" if starts is not None else "") + ("_offset" if offset is not None else "")


# ----------------------------------------------------------------------------- dq kernel


def _dq_kernel(q_ref, k_ref, v_ref, idx_ref, o_ref, do_ref, lse_ref, *refs, block_size: int,
               scale: float, group: int, rows: int, top_k: int, packed: bool,
               offset: bool = False):
  """One program: query t, KV head h. Writes dq and delta = rowsum(o * do) for the dk/dv kernel.
  Packed rows add start_ref `[T]`, a sequence shard off_ref `[1]`, before the outputs, as in the
  forward."""
  start_ref, off_ref, dq_ref, delta_ref = _extra_refs(refs, packed, offset)
  t = pl.program_id(0)
  doc_start = start_ref[t] if packed else None
  pos = t + off_ref[0] if offset else None
  # [R, D]
  b_q = _load_rows(q_ref, t, group, rows)
  b_do = _load_rows(do_ref, t, group, rows)
  b_o = _load_rows(o_ref, t, group, rows)
  # [R]
  b_delta = jnp.sum(b_o.astype(jnp.float32) * b_do.astype(jnp.float32), axis=1)
  # Rows without a visible key carry lse = -inf; every entry of theirs is masked below.
  b_lse2 = _load_rows(lse_ref, t, group, rows) * LOG2E
  precision = _dot_precision(b_q.dtype)
  qk_scale = scale * LOG2E
  d = b_q.shape[-1]

  def body(i, b_dq):
    start, visible = _block_slot(idx_ref, t, i, block_size, doc_start=doc_start, pos=pos)
    # Hidden keys load as zeros: ds = 0 does not cancel a NaN key in ds @ k (0 * NaN = NaN).
    b_k = plt.load(k_ref.at[pl.ds(start, block_size), :], mask=visible[:, None], other=0.0)
    b_v = v_ref[pl.ds(start, block_size), :]
    # [R, C]
    b_s = jnp.dot(b_q, b_k.T, precision=precision, preferred_element_type=jnp.float32) * qk_scale
    b_p = jnp.where(visible[None, :], jnp.exp2(b_s - b_lse2[:, None]), 0.0)
    b_dp = jnp.dot(b_do, b_v.T, precision=precision, preferred_element_type=jnp.float32)
    # A hidden key's dp is NaN when its value is, and p = 0 does not cancel it (0 * NaN = NaN).
    b_ds = b_p * jnp.where(visible[None, :], b_dp - b_delta[:, None], 0.0)
    return b_dq + jnp.dot(b_ds.astype(b_k.dtype), b_k, precision=precision,
                          preferred_element_type=jnp.float32)

  b_dq = lax.fori_loop(0, top_k, body, jnp.zeros((rows, d), jnp.float32))
  _store_rows(dq_ref, t, (b_dq * scale).astype(dq_ref.dtype), group, rows)
  _store_rows(delta_ref, t, b_delta, group, rows)


def _backward_dq(q5, k, v, block_indices, starts, offset, o5, do5, lse, *, block_size, scale,
                 interpret, config):
  b, t, hkv, g, d = q5.shape
  tk = k.shape[1]
  top_k = block_indices.shape[-1]
  rows = max(config.min_rows, next_pow2(g))
  kernel = functools.partial(_dq_kernel, block_size=block_size, scale=scale, group=g, rows=rows,
                             top_k=top_k, packed=starts is not None, offset=offset is not None)
  q_spec, kv_spec, idx_spec, lse_spec = _query_grid_specs(t, tk, g, d, top_k)
  start_specs, start_args = _start_specs(starts, t, offset)
  call = pl.pallas_call(
      kernel,
      grid=(t, hkv, b),
      in_specs=[q_spec, kv_spec, kv_spec, idx_spec, q_spec, q_spec, lse_spec] + start_specs,
      out_specs=[q_spec, lse_spec],
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((b, t, hkv, g), jnp.float32)],
      compiler_params=plt.CompilerParams(num_warps=config.dq_num_warps,
                                         num_stages=config.dq_num_stages),
      interpret=interpret,
      name=f"pisa_sparse_attention_dq{_suffix(starts, offset)}",
  )
  return _call_kernel(call, q5, k, v, block_indices, o5, do5, lse, *start_args)


# ----------------------------------------------------------------------------- custom_vjp op


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _sparse_attention_core(q5, k, v, block_indices, starts, offset, block_size, scale, interpret,
                           config):
  o5, _ = _forward(q5, k, v, block_indices, starts, offset, block_size=block_size, scale=scale,
                   interpret=interpret, config=config)
  return o5


# The forward rule's kernel runs inside a jit, and its outputs are tagged: a remat policy that
# saves both leaves the jit unused in a checkpointed backward, which then drops it (jax keeps
# every bare pallas_call; `pisa_jax.checkpoint_names`).
_forward_jit = jax.jit(_forward, static_argnames=("block_size", "scale", "interpret", "config"))


def _core_fwd(q5, k, v, block_indices, starts, offset, block_size, scale, interpret, config):
  o5, lse = _forward_jit(q5, k, v, block_indices, starts, offset, block_size=block_size,
                         scale=scale, interpret=interpret, config=config)
  o5 = checkpoint_name(o5, checkpoint_names.ATTENTION_OUT)
  lse = checkpoint_name(lse, checkpoint_names.ATTENTION_LSE)
  return o5, (q5, k, v, block_indices, starts, offset, o5, lse)


def _core_bwd(block_size, scale, interpret, config, residuals, do5):
  q5, k, v, block_indices, starts, offset, o5, lse = residuals
  dq5, delta = _backward_dq(q5, k, v, block_indices, starts, offset, o5, do5.astype(q5.dtype),
                            lse, block_size=block_size, scale=scale, interpret=interpret,
                            config=config)
  # dk, dv over all Tk keys: a sequence shard's share of them (zero for keys after its queries).
  dk, dv = backward_dkv(q5, k, v, block_indices, starts, do5.astype(q5.dtype), lse, delta,
                        block_size=block_size, scale=scale, interpret=interpret, config=config,
                        offset=offset)
  # Integer indices, document starts and the offset get no cotangent.
  return dq5, dk, dv, None, None, None


_sparse_attention_core.defvjp(_core_fwd, _core_bwd)


def _attend(q, k, v, block_indices, starts, offset=None, *, block_size, scale, interpret, config):
  """Pads, reshapes and runs the op; starts: None, or the document starts `[B, T]`; offset:
  None, or int32 `[1]` (q holds the queries at offset .. offset + T - 1 of k's Tk >= T)."""
  b, t, hq, d = q.shape
  tq, t = t, k.shape[1]
  hkv = k.shape[2]
  g = hq // hkv
  top_k = block_indices.shape[-1]
  if config is None:
    config = SparseAttentionConfig.default(head_dim=d, group=g, top_k=top_k,
                                           block_size=block_size)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  # Head dims that are not a power of two >= 16 are zero-padded: zero columns change no dot
  # product and give zero output columns, which are sliced off (autodiff handles pad and slice).
  dp = max(16, next_pow2(d))
  # Keys are padded to whole blocks so every block load is in bounds; padded keys sit after every
  # query and are masked by causality. A packed document's block starts anywhere at or before
  # its query, so its loads reach up to C - 1 keys past the last query: one more block.
  tk = (-(-t // block_size) + (starts is not None)) * block_size
  if dp != d:
    pad = ((0, 0), (0, 0), (0, 0), (0, dp - d))
    q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
  if tk != t:
    pad = ((0, 0), (0, tk - t), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  block_indices = lax.stop_gradient(block_indices.astype(jnp.int32))
  q5 = q.reshape(b, tq, hkv, g, dp)
  o5 = _sparse_attention_core(q5, k, v, block_indices, starts, offset, int(block_size),
                              float(scale), bool(interpret), config)
  return o5.reshape(b, tq, hq, dp)[..., :d]


def sparse_attention_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: SparseAttentionConfig | None = None,
) -> Float[Array, "B T HQ D"]:
  """Pallas twin of `sparse_attention_reference` (Eq. 6); arguments already validated.

  Args:
    q: queries `[B, T, HQ, D]` (bf16, f16 or f32; accumulation is float32).
    k: keys `[B, T, HKV, D]`.
    v: values `[B, T, HKV, D]`.
    block_indices: int32 `[B, T, HKV, K]`, leaf indices with -1 padding; held fixed (no gradient).
    block_size: C, keys per leaf block.
    scale: logit scale.
    interpret: run the kernels in the Pallas interpreter (CPU / CI) instead of through Triton.
    config: tiles and launch parameters; None picks `SparseAttentionConfig.default`.

  Returns:
    `[B, T, HQ, D]` in q's dtype, differentiable in q, k and v under `jax.custom_vjp`.
  """
  return _attend(q, k, v, block_indices, None, block_size=block_size, scale=scale,
                 interpret=interpret, config=config)


def sparse_attention_packed_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B T HKV K"],
    segment_ids: Int[Array, "B T"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: SparseAttentionConfig | None = None,
) -> Float[Array, "B T HQ D"]:
  """Pallas twin of `sparse_attention_packed_reference`: Eq. 6 over packed documents.

  block_indices are document-relative (block i of a document starting at s covers its keys
  s + i C .. s + i C + C - 1); segment_ids `[B, T]` non-decreasing per row. The same kernels as
  `sparse_attention_pallas` with each query's document start as a per-query scalar: the forward
  and dq load a selected block from there (no alignment), the dk / dv index holds one entry per
  (query, block) and its program covers the two key-array blocks the block may touch
  (`packed_inverted_index`). Every row of the output and the gradients is its document's own,
  as if run alone; deterministic.
  """
  starts, _ = segments.document_bounds(segment_ids)
  return _attend(q, k, v, block_indices, lax.stop_gradient(starts), block_size=block_size,
                 scale=scale, interpret=interpret, config=config)


def sparse_attention_pallas_at(
    q: Float[Array, "B Tq HQ D"],
    k: Float[Array, "B T HKV D"],
    v: Float[Array, "B T HKV D"],
    block_indices: Int[Array, "B Tq HKV K"],
    query_offset: Int[Array, ""] | int,
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: SparseAttentionConfig | None = None,
) -> Float[Array, "B Tq HQ D"]:
  """Pallas twin of `sparse_attention_reference_at`: Eq. 6 for the queries at positions
  query_offset .. query_offset + Tq - 1 of a sequence whose T keys and values are all given (a
  sequence shard under context parallelism); arguments already validated.

  query_offset: an int, or an int32 scalar that may be traced (`lax.axis_index(axis) * Tq`);
  key j is visible to row i when j <= query_offset + i. The Python int 0 runs the kernels of
  `sparse_attention_pallas` unchanged. dk, dv `[B, T, HKV, D]` are these queries' share.
  """
  if isinstance(query_offset, int) and not isinstance(query_offset, bool) and query_offset == 0:
    offset = None
  else:
    offset = lax.stop_gradient(jnp.asarray(query_offset, jnp.int32).reshape(1))
  return _attend(q, k, v, block_indices, None, offset, block_size=block_size, scale=scale,
                 interpret=interpret, config=config)
