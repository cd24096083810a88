"""Pallas (Triton) kernels for one decode step (Section 3.3 "Decoding", Eq. 30-31, Appendix B
"Decode cache"): the twins of `pisa_jax.decode.decode_append_reference`,
`decode_select_reference` and `decode_attention_reference`.

One decode step is three launches and one small XLA fusion:
1. `_append_kernel`, one program per (batch row, KV head): writes the new key and value at the
   row's own length, recomputes the current leaf's mean from its raw keys and then each ancestor's
   mean from its children (Eq. 15): O(C + g log N) rows read, O(log N) summaries written, in place
   (the cache buffers are aliased to the outputs).
2. `_select_kernel`, one program per (batch row, KV head), all query heads of the GQA group as the
   rows of its dots: the fused single-stage selection of Eq. 30-31. It walks the pyramid from the
   first level with more than `beam` eligible nodes down to the leaves (Eq. 16-18), scores each
   level's candidates from their children's summaries (Eq. 21 / 33 / 34, summed over the group's
   heads, Eq. 22) and the leaf candidates from their raw keys, keeping the queries in registers
   throughout. `_bsa_kernel` is the flat BSA baseline (O(N / C) per step, as BSA is).
3. `_attend_kernel`, split-K flash-decoding: program (row, KV head, split) runs an online softmax
   over its share of the K selected blocks and writes (o, m, l); `_merge_splits` (jnp) combines
   the splits by log-sum-exp. With one block per split, B = 1 still launches HKV * K programs.

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

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
# Imported for its side effect: it registers a config flag that the first `pallas_call` would
# otherwise register lazily, changing jit's tracing context once and recompiling whatever jitted
# function (a decode step) ran before it.
from jax.experimental.pallas import fuser as _fuser  # noqa: F401
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.geometry import level_sizes
from pisa_jax.kernels._common import next_pow2, triton_deprecation_silenced

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_BIG = 2**30  # larger than any node id: an empty slot
# Select_K's ranking keys, as the reference's `_keep`: a NaN score ranks as the largest float32
# (after the forced nodes' +inf, before every number), every other score is clamped below it.
_NAN_RANK = float(np.finfo(np.float32).max)
_SCORE_LIMIT = float(np.nextafter(np.float32(_NAN_RANK), np.float32(0)))
# Triton's tensor-core dots need every dimension >= 16.
_MIN_DOT = 16


def level_offsets(capacity: int, block_size: int, branching: int) -> tuple[int, ...]:
  """First index along axis 1 of the stacked summaries `[B, S, HKV, D]` of each level (leaves
  first); S = offsets[-1] + 1 (the root)."""
  offsets, acc = [], 0
  for m in level_sizes(capacity, block_size, branching):
    offsets.append(acc)
    acc += m
  return tuple(offsets)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Launch parameters of the decode kernels.

  Attributes:
    select_warps: warps of the selection program (its values are `[16, NC]` and `[16, Cp]`; the
      candidates' all-pairs rank compare is `[NC, NC]`).
    bsa_block_tile: leaf summaries per step of the BSA kernel's loops (a power of two >= 16).
    bsa_warps: warps of the BSA program (its dots are `[16, D] x [D, bsa_block_tile]`).
    attend_blocks: selected blocks per attention program (a power of two); 0 picks
      `default_attend_blocks`.
    attend_warps: warps of an attention program.
    append_warps: warps of an append program.
    num_stages: Triton software-pipelining stages (the leaf and attention loops).
  """

  select_warps: int = 1
  bsa_block_tile: int = 64
  bsa_warps: int = 4
  attend_blocks: int = 0
  attend_warps: int = 2
  append_warps: int = 1
  num_stages: int = 2

  def __post_init__(self):
    for name in ("bsa_block_tile", "attend_blocks"):
      value = getattr(self, name)
      if value and value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")
    if self.bsa_block_tile < _MIN_DOT:
      raise ValueError(f"bsa_block_tile={self.bsa_block_tile} must be >= {_MIN_DOT} (dot size)")

  @classmethod
  def default(cls, *, candidates: int, head_dim: int) -> "DecodeConfig":
    """Heuristic: one warp while the candidate set is 16 slots, more for the wider rank compares
    of K = 32 or beams (the prefill walk's measured choice: 4 warps at NC = 64); two warps per
    attention program at d >= 128."""
    warps = 1 if candidates <= 16 else 2 if candidates <= 32 else 4
    return cls(select_warps=warps, attend_warps=2 if head_dim >= 128 else 1)


def default_attend_blocks(batch: int, num_kv_heads: int, top_k: int, *,
                          target_programs: int = 512) -> int:
  """Selected blocks per attention program: split the B * HKV * K blocks over about
  `target_programs` programs (a few per SM of an H100/H200), one block each when that is few."""
  per = -(-batch * num_kv_heads * top_k // target_programs)
  return min(next_pow2(max(1, per)), next_pow2(top_k))


@dataclasses.dataclass(frozen=True)
class _Geometry:
  batch: int
  capacity: int
  hq: int
  hkv: int
  d: int
  block_size: int
  branching: int
  top_k: int
  beam: int
  selector: str
  scale: float
  key_mode: str  # raw keys: "native" (16-bit dot) or "f32"
  score_mode: str  # float32 summaries: "split" (bfloat16 queries) or "f32"

  @property
  def group(self) -> int:
    return self.hq // self.hkv

  @property
  def gp(self) -> int:
    return max(_MIN_DOT, next_pow2(self.group))

  @property
  def dp(self) -> int:
    return max(_MIN_DOT, next_pow2(self.d))

  @property
  def cp(self) -> int:
    return max(_MIN_DOT, next_pow2(self.block_size))

  @property
  def nc(self) -> int:
    """Candidate slots per level: up to beam * g children (and every leaf of a short row)."""
    return max(_MIN_DOT, next_pow2(self.beam * self.branching))

  @property
  def kp(self) -> int:
    return next_pow2(self.top_k)

  @property
  def sizes(self) -> tuple[int, ...]:
    return level_sizes(self.capacity, self.block_size, self.branching)

  @property
  def offsets(self) -> tuple[int, ...]:
    return level_offsets(self.capacity, self.block_size, self.branching)

  @property
  def num_nodes(self) -> int:
    return self.offsets[-1] + 1


def _geometry(q, k_cache, *, block_size, branching, top_k, beam, selector, scale) -> _Geometry:
  b, hq, d = q.shape
  _, capacity, hkv, _ = k_cache.shape
  native = q.dtype == k_cache.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
  return _Geometry(
      batch=b, capacity=capacity, hq=hq, hkv=hkv, d=d, block_size=block_size, branching=branching,
      top_k=top_k, beam=beam, selector=selector, scale=float(scale),
      key_mode="native" if native else "f32",
      score_mode="split" if native and q.dtype == jnp.bfloat16 else "f32")


# ----------------------------------------------------------------------------- shared helpers


def _call(kernel, out_shape, grid, *, warps: int, stages: int, interpret: bool, name: str,
          aliases=None):
  with triton_deprecation_silenced():
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases or {},
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret, name=name)


def _load_rows(ref, rows, m_row, d: int, dp: int):
  """Rows `[N]` of a `[*, D]` ref as `[N, Dp]`; masked rows and padded columns read as zero."""
  o_col = jnp.arange(dp)
  if d == dp:
    return plt.load(ref.at[rows[:, None], o_col[None, :]], mask=m_row[:, None], other=0.0)
  return plt.load(ref.at[rows[:, None], jnp.minimum(o_col, d - 1)[None, :]],
                  mask=m_row[:, None] & (o_col < d)[None, :], other=0.0)


def _load_row(ref, row, m_row, d: int, dp: int):
  """Row `row` (a scalar) of a `[*, D]` ref as `[Dp]`, zero where masked or padded."""
  return plt.load(ref.at[row, pl.ds(0, dp)], mask=(jnp.arange(dp) < d) & m_row, other=0.0)


def _store_row(ref, row, value, m_row, d: int, dp: int):
  """Stores `[Dp]` into row `row` of a `[*, D]` ref where m_row (the padded columns never). A
  scalar row and a slice, not clamped index arrays: in interpret mode a masked store writes
  every lane's address (the masked ones their old value), so clamped duplicates would race."""
  plt.store(ref.at[row, pl.ds(0, dp)], value, mask=(jnp.arange(dp) < d) & m_row)


def _scalar(ref, i, n: int = 2):
  """ref[i] of a 1-D ref, loaded as an n-vector (a value's shape is a power of two)."""
  return jnp.max(plt.load(ref.at[jnp.full((n,), i, jnp.int32)]))


def _pick(vec, i):
  """vec[i] for a value (no dynamic indexing of values in Triton kernels)."""
  return jnp.sum(jnp.where(jnp.arange(vec.shape[0]) == i, vec, 0))


def _dot_t(a, b, mode: str):
  """a @ b.T in float32: "f32" at IEEE precision, "native" in the operands' 16-bit dtype."""
  dims = (((1,), (1,)), ((), ()))
  if mode == "f32":
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                           precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
                           preferred_element_type=jnp.float32)
  return lax.dot_general(a, b.astype(a.dtype), dims, preferred_element_type=jnp.float32)


def _summary_logits(qg, s_ref, rows, m_row, geo: _Geometry):
  """qg @ summaries[rows].T, `[Gp, N]` float32. In "split" mode the float32 summary is the sum of
  its high half (bits truncated to bfloat16's, so exact) and the bfloat16 rounding of the rest."""
  s = _load_rows(s_ref, rows, m_row, geo.d, geo.dp)
  if geo.score_mode != "split":
    return _dot_t(qg, s, "f32")
  bits = lax.bitcast_convert_type(s, jnp.uint32) & jnp.uint32(0xFFFF0000)
  hi = lax.bitcast_convert_type(bits, jnp.float32)
  return (_dot_t(qg, hi.astype(jnp.bfloat16), "native")
          + _dot_t(qg, (s - hi).astype(jnp.bfloat16), "native"))


def _load_group_queries(q_ref, i_b, i_h, geo: _Geometry):
  """The group's query heads `[Gp, Dp]` (padded heads and columns zero), and the head mask."""
  o_head = jnp.arange(geo.gp)
  m_head = o_head < geo.group
  rows = i_b * geo.hq + i_h * geo.group + jnp.minimum(o_head, geo.group - 1)
  qg = _load_rows(q_ref, rows, m_head, geo.d, geo.dp)
  return (qg if geo.key_mode == "native" else qg.astype(jnp.float32)), m_head


def _reduce_children(zs, masks, selector: str, scale: float):
  """Per-head score of each candidate from its children's unscaled logits `[Gp, N]` (one per
  child, each masked by `[N]`): Eq. 21 (log-sum-exp, in base 2 then back), 33 or 34."""
  if selector == "pisa":
    c = scale * _LOG2E
    m = functools.reduce(jnp.maximum,
                         [jnp.where(v[None, :], z, -jnp.inf) for z, v in zip(zs, masks)])
    m = jnp.where(m == -jnp.inf, 0.0, m)
    total = sum(jnp.where(v[None, :], jnp.exp2((z - m) * c), 0.0) for z, v in zip(zs, masks))
    return m * scale + jnp.log2(total) * _LN2
  zs = [z * scale for z in zs]
  count = jnp.maximum(sum(v.astype(jnp.float32) for v in masks), 1.0)[None, :]
  mean = sum(jnp.where(v[None, :], z, 0.0) for z, v in zip(zs, masks)) / count
  if selector == "pisa1":
    return mean
  var = sum(jnp.where(v[None, :], jnp.square(z - mean), 0.0) for z, v in zip(zs, masks)) / count
  return mean + 0.5 * var


def _reduce_keys(z, m_key, selector: str, scale: float):
  """Per-head score over one leaf's raw keys: z `[Gp, Cp]` unscaled logits, m_key `[Cp]`."""
  if selector == "pisa":
    c = scale * _LOG2E
    z = jnp.where(m_key[None, :], z, -jnp.inf)
    m = jnp.max(z, axis=1)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    total = jnp.sum(jnp.exp2((z - m[:, None]) * c), axis=1)
    return m * scale + jnp.log2(total) * _LN2
  z = z * scale
  count = jnp.maximum(jnp.sum(m_key.astype(jnp.float32)), 1.0)
  mean = jnp.sum(jnp.where(m_key[None, :], z, 0.0), axis=1) / count
  if selector == "pisa1":
    return mean
  var = jnp.sum(jnp.where(m_key[None, :], jnp.square(z - mean[:, None]), 0.0), axis=1) / count
  return mean + 0.5 * var


def _rank_key(score):
  """A score as a ranking key: NaN above every number (a NaN query or key keeps its block, so
  attention shows the NaN), numbers clamped inside the float range."""
  return jnp.where(jnp.isnan(score), _NAN_RANK, jnp.clip(score, -_SCORE_LIMIT, _SCORE_LIMIT))


def _rank(cand, valid, key):
  """Each candidate's rank in (key descending, id ascending) among the valid ones, `[N]`: one
  all-pairs compare instead of a sort (ids are distinct, so the order is strict)."""
  k_i, k_j = key[None, :], key[:, None]
  c_i, c_j = cand[None, :], cand[:, None]
  before = valid[:, None] & ((k_j > k_i) | ((k_j == k_i) & (c_j < c_i)))
  return jnp.sum(before.astype(jnp.int32), axis=0)


def _select_k(cand, valid, forced, score, keep: int):
  """Select_K of Eq. 17 with Appendix B's forced nodes: (kept mask, rank). If at most `keep`
  candidates are valid all are kept; otherwise forced ones first, then the highest scores, ties
  to the lower node id (the reference's `_keep`)."""
  keep_all = jnp.sum(valid.astype(jnp.int32)) <= keep
  key = jnp.where(forced | keep_all, jnp.inf, _rank_key(score))
  rank = _rank(cand, valid, key)
  return valid & (rank < keep), rank


def _expand(cand, kept, rank, branching: int, width: int):
  """Eq. 18: the kept node of rank p fills slots p * g .. p * g + g - 1 with its children."""
  slot = jnp.arange(width)
  hit = kept[None, :] & (rank[None, :] == (slot // branching)[:, None])
  return jnp.max(jnp.where(hit, cand[None, :] * branching + (slot % branching)[:, None], -1),
                 axis=1)


def _sorted_ids(cand, kept, width: int):
  """The kept ids ascending, -1 padded, `[width]`: a kept id's slot is its rank by id."""
  pos = jnp.sum((kept[:, None] & (cand[:, None] < cand[None, :])).astype(jnp.int32), axis=0)
  slot = jnp.arange(width)
  hit = kept[None, :] & (pos[None, :] == slot[:, None])
  return jnp.max(jnp.where(hit, cand[None, :], -1), axis=1)


# ----------------------------------------------------------------------------- append


def _append_kernel(pos_ref, kn_ref, vn_ref, k_ref, v_ref, s_ref, ko_ref, vo_ref, so_ref, *,
                   capacity: int, hkv: int, d: int, block_size: int, branching: int,
                   offsets: tuple[int, ...]):
  """One (batch row, KV head): append the token at position pos = the row's length, then update
  its leaf (the mean of the block's raw keys) and every ancestor (the mean of its existing
  children, Eq. 15), leaves first. k_ref / v_ref / s_ref are aliased to ko_ref / vo_ref / so_ref:
  only rows below pos and complete siblings are read, never a row this program writes."""
  dp = max(_MIN_DOT, next_pow2(d))
  cp = max(_MIN_DOT, next_pow2(block_size))
  num_nodes = offsets[-1] + 1
  i_bh = pl.program_id(0)
  i_b, i_h = i_bh // hkv, i_bh % hkv
  pos_raw = _scalar(pos_ref, i_b)
  # A token past capacity is dropped: every store is masked off (the caller poisons the row).
  live = pos_raw < capacity
  pos = jnp.minimum(pos_raw, capacity - 1)
  k_new = _load_row(kn_ref, i_bh, True, d, dp)  # [Dp]
  v_new = _load_row(vn_ref, i_bh, True, d, dp)
  row = (i_b * capacity + pos) * hkv + i_h
  _store_row(ko_ref, row, k_new, live, d, dp)
  _store_row(vo_ref, row, v_new, live, d, dp)
  # The current leaf: the mean of its keys up to pos, the new one taken from the input.
  leaf = pos // block_size
  o_key = jnp.arange(cp)
  key_pos = leaf * block_size + o_key
  m_old = (o_key < block_size) & (key_pos < pos)
  rows = (i_b * capacity + jnp.minimum(key_pos, capacity - 1)) * hkv + i_h
  keys = _load_rows(k_ref, rows, m_old, d, dp).astype(jnp.float32)
  keys = jnp.where((key_pos == pos)[:, None], k_new.astype(jnp.float32)[None, :], keys)
  new = jnp.sum(keys, axis=0) / (pos - leaf * block_size + 1).astype(jnp.float32)
  node = leaf
  _store_row(so_ref, (i_b * num_nodes + offsets[0] + node) * hkv + i_h, new, live, d, dp)
  for level in range(1, len(offsets)):
    # Eq. 15 for the parent: its children before `node` are complete and unchanged, `node`
    # holds the new mean, and the ones after it do not exist yet. Summed in child order.
    parent = node // branching
    slot = node - parent * branching
    acc = jnp.zeros((dp,), jnp.float32)
    for j in range(branching):
      child = jnp.minimum(parent * branching + j, node)
      x = _load_row(s_ref, (i_b * num_nodes + offsets[level - 1] + child) * hkv + i_h, j < slot,
                    d, dp)
      acc = acc + jnp.where(j == slot, new, x)
    new = acc / (slot + 1).astype(jnp.float32)
    node = parent
    _store_row(so_ref, (i_b * num_nodes + offsets[level] + node) * hkv + i_h, new, live, d, dp)


def decode_append_pallas(
    k_new: Float[Array, "B HKV D"],
    v_new: Float[Array, "B HKV D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    branching: int,
    interpret: bool,
    config: DecodeConfig | None = None,
):
  """Kernel twin of `decode_append_reference`: the caches with the token appended at `positions`
  and the leaf / ancestor summaries updated, in place when the caller donates them.

  Returns:
    (k_cache, v_cache, summaries), same shapes and dtypes.
  """
  config = config or DecodeConfig()
  b, capacity, hkv, d = k_cache.shape
  offsets = level_offsets(capacity, block_size, branching)
  kernel = functools.partial(_append_kernel, capacity=capacity, hkv=hkv, d=d,
                             block_size=block_size, branching=branching, offsets=offsets)
  shapes = [jax.ShapeDtypeStruct((x.size // d, d), x.dtype) for x in (k_cache, v_cache, summaries)]
  call = _call(kernel, shapes, (b * hkv,), warps=config.append_warps, stages=1,
               interpret=interpret, name="pisa_decode_append", aliases={3: 0, 4: 1, 5: 2})
  k_rows, v_rows, s_rows = call(
      positions.astype(jnp.int32), k_new.astype(k_cache.dtype).reshape(-1, d),
      v_new.astype(v_cache.dtype).reshape(-1, d), k_cache.reshape(-1, d), v_cache.reshape(-1, d),
      summaries.reshape(-1, d))
  return (k_rows.reshape(k_cache.shape), v_rows.reshape(v_cache.shape),
          s_rows.reshape(summaries.shape))


# ----------------------------------------------------------------------------- selection


def _select_kernel(pos_ref, q_ref, k_ref, s_ref, tab_ref, out_ref, *, geo: _Geometry):
  """The fused decode selection (Eq. 30-31) for one (batch row, KV head): walk, leaf scores,
  final Select_K. Writes the row's leaf ids ascending, -1 padded, `[KP]`."""
  g, nc, c = geo.branching, geo.nc, geo.block_size
  num_levels = len(geo.sizes)
  num_nodes = geo.num_nodes
  i_bh = pl.program_id(0)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  t = jnp.clip(_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  cur = t // c
  qg, m_head = _load_group_queries(q_ref, i_b, i_h, geo)
  slot = jnp.arange(nc)
  lp = tab_ref.shape[1]
  o_lvl = jnp.arange(lp)
  offs = plt.load(tab_ref.at[jnp.zeros((lp,), jnp.int32), o_lvl])
  pows = plt.load(tab_ref.at[jnp.ones((lp,), jnp.int32), o_lvl])  # g^(l-1) at index l - 1
  # The walk starts at the highest level with more than `beam` eligible nodes (0 .. cur // g^(l-1)):
  # every level above keeps all of its eligible nodes without a score (Eq. 17's "keep all"), and
  # the start level's eligible nodes, at most g * beam of them, are all candidates. Level 1 when
  # even level 2 has at most beam: the candidates are then the leaves 0 .. cur.
  level_no = o_lvl + 1
  deep = (level_no >= 2) & (level_no <= num_levels) & (cur // pows >= geo.beam)
  start = 1 + jnp.sum(deep.astype(jnp.int32))
  pw0 = _pick(pows, start - 1)
  cand0 = jnp.where(slot <= cur // pw0, slot, -1)

  def walk_level(i, carry):
    cand, pw = carry  # pw = g^(level - 1): leaves per node at this level
    level = start - i
    pw_child = pw // g
    off_child = _pick(offs, level - 2)
    anc, anc_child = cur // pw, cur // pw_child
    anc_prev = jnp.where(cur >= 1, (cur - 1) // pw, -1)
    # Eligible: the node's first key is at or before t. Forced: an ancestor of the first,
    # previous or current leaf (Appendix B); its score is never used.
    valid = (cand >= 0) & (cand <= anc)
    forced = valid & ((cand == 0) | (cand == anc_prev) | (cand == anc))
    zs, masks = [], []
    for j in range(g):
      child = jnp.where(valid, cand, 0) * g + j
      m_child = valid & (child <= anc_child)
      rows = (i_b * num_nodes + off_child + jnp.minimum(child, anc_child)) * geo.hkv + i_h
      zs.append(_summary_logits(qg, s_ref, rows, m_child, geo))
      masks.append(m_child)
    per_head = _reduce_children(zs, masks, geo.selector, geo.scale)
    # Eq. 22: the group's heads share one selection, scored by their sum.
    score = jnp.sum(jnp.where(m_head[:, None], per_head, 0.0), axis=0)
    kept, rank = _select_k(cand, valid, forced, score, geo.beam)
    return _expand(cand, kept, rank, g, nc), pw_child

  cand, _ = lax.fori_loop(0, start - 1, walk_level, (cand0, pw0))
  # The leaves: scored from their raw keys (Eq. 21 with l = 1) where Select_K needs a score.
  valid = (cand >= 0) & (cand <= cur)
  forced = valid & ((cand == 0) | (cand == cur - 1) | (cand == cur))
  need = valid & ~forced & (jnp.sum(valid.astype(jnp.int32)) > geo.top_k)
  # The needed slots numbered 0 .. n_need - 1 in slot order, so the loop runs only over them.
  order = jnp.sum((need[:, None] & (slot[:, None] < slot[None, :])).astype(jnp.int32), axis=0)
  n_need = jnp.sum(need.astype(jnp.int32))
  o_key = jnp.arange(geo.cp)
  m_key = o_key < c

  def score_leaf(n, scores):
    hit = need & (order == n)
    leaf = jnp.sum(jnp.where(hit, cand, 0))
    # A scored leaf is complete and before the current one: all of its keys exist.
    key_pos = jnp.minimum(leaf * c + o_key, geo.capacity - 1)
    keys = _load_rows(k_ref, (i_b * geo.capacity + key_pos) * geo.hkv + i_h, m_key, geo.d,
                      geo.dp)
    per_head = _reduce_keys(_dot_t(qg, keys, geo.key_mode), m_key, geo.selector, geo.scale)
    return jnp.where(hit, jnp.sum(jnp.where(m_head, per_head, 0.0)), scores)

  scores = lax.fori_loop(0, n_need, score_leaf, jnp.zeros((nc,), jnp.float32))
  kept, _ = _select_k(cand, valid, forced, jnp.where(need, scores, 0.0), geo.top_k)
  out = _sorted_ids(cand, kept, geo.kp)
  out_ref[pl.ds(i_bh, 1), :] = out[None, :]


def _bsa_kernel(pos_ref, q_ref, s_ref, out_ref, *, geo: _Geometry, block_tile: int):
  """Flat BSA for one (batch row, KV head), O(N / C): each head's softmax over the mean-key
  summaries of the complete blocks (those whose last key is at or before t), summed over the
  group (Eq. 4, 22); forced first, previous and current blocks, then the top_k - 3 best of the
  others, merged tile by tile into a running set by rank (score descending, id ascending)."""
  c = geo.block_size
  num_nodes = geo.num_nodes
  num_leaves = geo.sizes[0]
  i_bh = pl.program_id(0)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  t = jnp.clip(_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  cur = t // c
  complete = (t + 1) // c
  qg, m_head = _load_group_queries(q_ref, i_b, i_h, geo)
  o_blk = jnp.arange(block_tile)
  c2 = geo.scale * _LOG2E

  def logits(i):
    blk = i * block_tile + o_blk
    rows = (i_b * num_nodes + jnp.minimum(blk, num_leaves - 1)) * geo.hkv + i_h
    z2 = c2 * _summary_logits(qg, s_ref, rows, blk < complete, geo)  # [Gp, BT], base 2
    return blk, jnp.where((blk < complete)[None, :], z2, -jnp.inf)

  def normaliser(i, carry):
    m, l = carry
    _, z2 = logits(i)
    m_new = jnp.maximum(m, jnp.max(z2, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    l = l * jnp.exp2(jnp.where(m == -jnp.inf, -jnp.inf, m - m_safe)) + jnp.sum(
        jnp.exp2(z2 - m_safe[:, None]), axis=1)
    return m_new, l

  m, l = lax.fori_loop(0, pl.cdiv(complete, block_tile), normaliser,
                       (jnp.full((geo.gp,), -jnp.inf, jnp.float32),
                        jnp.zeros((geo.gp,), jnp.float32)))
  m = jnp.where(m == -jnp.inf, 0.0, m)
  inv_l = jnp.where(m_head & (l > 0), 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
  n_best = geo.top_k - 3
  bp = next_pow2(max(n_best, 1))
  o_best = jnp.arange(bp)

  def merge(i, carry):
    best_v, best_i = carry
    blk, z2 = logits(i)
    # [BT]: the group-summed probability of every block; candidates are blocks 1 .. cur - 2.
    ps = _rank_key(jnp.sum(jnp.exp2(z2 - m[:, None]) * inv_l[:, None], axis=0))
    m_tile = (blk >= 1) & (blk <= cur - 2)
    m_best = best_i < _BIG
    # Ranks in the union of the running set and the tile, by (score desc, id asc).
    before_tt = m_tile[:, None] & ((ps[:, None] > ps[None, :])
                                   | ((ps[:, None] == ps[None, :]) & (blk[:, None] < blk[None, :])))
    before_bt = m_best[:, None] & ((best_v[:, None] > ps[None, :])
                                   | ((best_v[:, None] == ps[None, :])
                                      & (best_i[:, None] < blk[None, :])))
    before_tb = m_tile[:, None] & ((ps[:, None] > best_v[None, :])
                                   | ((ps[:, None] == best_v[None, :])
                                      & (blk[:, None] < best_i[None, :])))
    before_bb = m_best[:, None] & ((best_v[:, None] > best_v[None, :])
                                   | ((best_v[:, None] == best_v[None, :])
                                      & (best_i[:, None] < best_i[None, :])))
    r_tile = (jnp.sum(before_tt.astype(jnp.int32), axis=0)
              + jnp.sum(before_bt.astype(jnp.int32), axis=0))
    r_best = (jnp.sum(before_tb.astype(jnp.int32), axis=0)
              + jnp.sum(before_bb.astype(jnp.int32), axis=0))
    hit_t = m_tile[None, :] & (r_tile[None, :] == o_best[:, None])  # [BP, BT]
    hit_b = m_best[None, :] & (r_best[None, :] == o_best[:, None])  # [BP, BP]
    new_v = jnp.maximum(jnp.max(jnp.where(hit_t, ps[None, :], -jnp.inf), axis=1),
                        jnp.max(jnp.where(hit_b, best_v[None, :], -jnp.inf), axis=1))
    new_i = jnp.minimum(jnp.min(jnp.where(hit_t, blk[None, :], _BIG), axis=1),
                        jnp.min(jnp.where(hit_b, best_i[None, :], _BIG), axis=1))
    live = o_best < n_best
    return jnp.where(live, new_v, -jnp.inf), jnp.where(live, new_i, _BIG)

  best_v = jnp.full((bp,), -jnp.inf, jnp.float32)
  best_i = jnp.full((bp,), _BIG, jnp.int32)
  if n_best > 0:
    best_v, best_i = lax.fori_loop(0, pl.cdiv(jnp.maximum(cur - 1, 0), block_tile), merge,
                                   (best_v, best_i))
  # Output ascending: 0, the best (ids in 1 .. cur - 2) by id, cur - 1, cur; or, when at most
  # top_k blocks are eligible, every block 0 .. cur.
  kp = geo.kp
  o_out = jnp.arange(kp)
  m_best = best_i < _BIG
  pos = jnp.sum((m_best[:, None] & (best_i[:, None] < best_i[None, :])).astype(jnp.int32), axis=0)
  placed = jnp.max(jnp.where(m_best[None, :] & (pos[None, :] + 1 == o_out[:, None]),
                             best_i[None, :], -1), axis=1)
  chosen = jnp.where(o_out == 0, 0, placed)
  chosen = jnp.where(o_out == n_best + 1, cur - 1, chosen)
  chosen = jnp.where(o_out == n_best + 2, cur, chosen)
  chosen = jnp.where(cur + 1 <= geo.top_k, jnp.where(o_out <= cur, o_out, -1), chosen)
  out_ref[pl.ds(i_bh, 1), :] = chosen[None, :]


def decode_select_pallas(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    summaries: Float[Array, "B S HKV D"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    branching: int,
    top_k: int,
    beam: int,
    selector: str,
    scale: float,
    interpret: bool,
    config: DecodeConfig | None = None,
) -> Int[Array, "B HKV K"]:
  """Kernel twin of `decode_select_reference`: the leaf blocks of the token at `positions`
  (already appended), int32 `[B, HKV, top_k]`, ascending, -1 padded."""
  if selector not in SELECTORS:
    raise ValueError(f"{selector=} has no decode kernel: expected one of {SELECTORS}")
  b, hq, d = q.shape
  hkv = k_cache.shape[2]
  geo = _geometry(q, k_cache, block_size=block_size, branching=branching, top_k=top_k,
                  beam=beam if selector != "bsa" else top_k, selector=selector, scale=scale)
  config = config or DecodeConfig.default(candidates=geo.nc, head_dim=d)
  out_shape = jax.ShapeDtypeStruct((b * hkv, geo.kp), jnp.int32)
  rows = (q.reshape(-1, d), k_cache.reshape(-1, d), summaries.reshape(-1, d))
  positions = positions.astype(jnp.int32)
  if selector == "bsa":
    call = _call(functools.partial(_bsa_kernel, geo=geo, block_tile=config.bsa_block_tile),
                 out_shape, (b * hkv,), warps=config.bsa_warps, stages=config.num_stages,
                 interpret=interpret, name="pisa_decode_select_bsa")
    out = call(positions, rows[0], rows[2])
  else:
    sizes = geo.sizes
    lp = next_pow2(len(sizes) + 1)
    table = jnp.asarray([list(geo.offsets) + [0] * (lp - len(sizes)),
                         [branching ** i if i < len(sizes) else 1 for i in range(lp)]],
                        jnp.int32)
    call = _call(functools.partial(_select_kernel, geo=geo), out_shape, (b * hkv,),
                 warps=config.select_warps, stages=config.num_stages, interpret=interpret,
                 name=f"pisa_decode_select_{selector}")
    out = call(positions, *rows, table)
  return out[:, :top_k].reshape(b, hkv, top_k)


# ----------------------------------------------------------------------------- attention


def _attend_kernel(pos_ref, q_ref, k_ref, v_ref, idx_ref, o_ref, m_ref, l_ref, *,
                   geo: _Geometry, blocks: int, splits: int):
  """Program (batch row x KV head, split): the online softmax (Eq. 6) of the group's heads over
  selected slots split * blocks .. split * blocks + blocks - 1; writes the unnormalised output
  `[Gp, Dp]`, the running max m and sum l `[Gp]` (base 2) for `_merge_splits`."""
  c, top_k = geo.block_size, geo.top_k
  i_bh, i_s = pl.program_id(0), pl.program_id(1)
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  t = jnp.clip(_scalar(pos_ref, i_b), 0, geo.capacity - 1)
  cur = t // c
  qg, _ = _load_group_queries(q_ref, i_b, i_h, geo)
  o_key = jnp.arange(geo.cp)
  qk_scale = geo.scale * _LOG2E

  def body(j, carry):
    m, l, acc = carry
    slot = i_s * blocks + j
    blk = _scalar(idx_ref, i_bh * top_k + jnp.minimum(slot, top_k - 1))
    # -1 padding, blocks after the current one and slots past top_k select nothing.
    ok = (slot < top_k) & (blk >= 0) & (blk <= cur)
    key_pos = jnp.clip(blk, 0, cur) * c + o_key
    visible = ok & (o_key < c) & (key_pos <= t)
    rows = (i_b * geo.capacity + jnp.minimum(key_pos, geo.capacity - 1)) * geo.hkv + i_h
    keys = _load_rows(k_ref, rows, visible, geo.d, geo.dp)
    vals = _load_rows(v_ref, rows, visible, geo.d, geo.dp)
    s = jnp.where(visible[None, :], _dot_t(qg, keys, geo.key_mode) * qk_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_use[:, None])
    alpha = jnp.exp2(m - m_use)
    if geo.key_mode == "native":
      pv = jnp.dot(p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    else:
      pv = jnp.dot(p, vals.astype(jnp.float32), precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

  init = (jnp.full((geo.gp,), -jnp.inf, jnp.float32), jnp.zeros((geo.gp,), jnp.float32),
          jnp.zeros((geo.gp, geo.dp), jnp.float32))
  m, l, acc = lax.fori_loop(0, blocks, body, init)
  row = i_bh * splits + i_s
  o_ref[row] = acc
  m_ref[row] = m
  l_ref[row] = l


def _merge_splits(o, m, l):
  """Log-sum-exp merge of the splits: o `[R, S, Gp, Dp]`, m, l `[R, S, Gp]` (base 2) ->
  `[R, Gp, Dp]`. A row that saw no key gets zeros."""
  m_all = jnp.max(m, axis=1, keepdims=True)
  m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.where(m == -jnp.inf, 0.0, jnp.exp2(m - m_all))
  total = jnp.sum(w * l, axis=1)
  out = jnp.sum(w[..., None] * o, axis=1)
  return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def decode_attention_pallas(
    q: Float[Array, "B HQ D"],
    k_cache: Float[Array, "B N HKV D"],
    v_cache: Float[Array, "B N HKV D"],
    block_indices: Int[Array, "B HKV K"],
    positions: Int[Array, "B"],
    *,
    block_size: int,
    scale: float,
    interpret: bool,
    config: DecodeConfig | None = None,
) -> Float[Array, "B HQ D"]:
  """Kernel twin of `decode_attention_reference`: Eq. 6 for the token at `positions` over the
  keys j <= t of its selected blocks, split-K over programs. Returns `[B, HQ, D]` in q's dtype."""
  b, hq, d = q.shape
  hkv, top_k = k_cache.shape[2], block_indices.shape[-1]
  # The walk's fields (branching, beam, selector) are unused by the attention kernel.
  geo = _geometry(q, k_cache, block_size=block_size, branching=2, top_k=top_k, beam=top_k,
                  selector="pisa", scale=scale)
  config = config or DecodeConfig.default(candidates=geo.nc, head_dim=d)
  blocks = min(config.attend_blocks or default_attend_blocks(b, hkv, top_k), next_pow2(top_k))
  splits = -(-top_k // blocks)
  rows = b * hkv * splits
  call = _call(functools.partial(_attend_kernel, geo=geo, blocks=blocks, splits=splits),
               [jax.ShapeDtypeStruct((rows, geo.gp, geo.dp), jnp.float32),
                jax.ShapeDtypeStruct((rows, geo.gp), jnp.float32),
                jax.ShapeDtypeStruct((rows, geo.gp), jnp.float32)],
               (b * hkv, splits), warps=config.attend_warps, stages=config.num_stages,
               interpret=interpret, name="pisa_decode_attention")
  o, m, l = call(positions.astype(jnp.int32), q.reshape(-1, d), k_cache.reshape(-1, d),
                 v_cache.reshape(-1, d), block_indices.astype(jnp.int32).reshape(-1))
  out = _merge_splits(o.reshape(b * hkv, splits, geo.gp, geo.dp),
                      m.reshape(b * hkv, splits, geo.gp), l.reshape(b * hkv, splits, geo.gp))
  return out[:, :geo.group, :d].reshape(b, hq, d).astype(q.dtype)
