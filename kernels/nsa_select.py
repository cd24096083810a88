"""Pallas (Triton) NSA block selection: the compressed attention's probabilities mapped onto
selection blocks, fused with their top-n.

The twin of `pisa_jax.nsa.nsa_select_blocks_reference`. For query t and KV head h (the module
docstring of `pisa_jax.nsa` gives the rules; with packed documents every number below is relative
to t's document):
  p_c       sum over the group's heads g of exp(scale q_g . k_cmp[c] - lse_g) over the
            compressed blocks c complete at t, c < end_t (Eq. 8, 10; lse is the compressed
            attention's, an input);
  s_j       Eq. 9: s_j = sum_{m < l'/d} sum_{n < l/d} p_{(l'/d) j + m - n};
  selection blocks 0 .. t // l' eligible, the first, previous and current forced, all kept while
            at most top_n are eligible, else the top_n - 3 best of the others, ties to the lower
            block (`pisa_jax.selection.flat_top_k`).

One program per (run of BT queries, KV head, batch row), as `hils_select`: step i scores BT
queries against a tile of BNc compressed blocks, each head a tensor-core dot `[BT, D] x [D, BNc]`
(the heads a loop, their probabilities summed in float32), maps the tile onto S selection blocks
and merges those into a running top-(top_n - 3) (`_common.running_top_k`). No `[T, N]` score
reaches memory; per query the kernel writes its top_n blocks, ascending. The tiles only visit
selection blocks before some query's previous block (the only ones scored).

Eq. 9 in a tile: with r = l'/d pieces a selection block and a halo of H = l/d - 1 compressed
blocks (a piece sums the blocks covering it, the H before it too), selection blocks
[i S, i S + S) need compressed blocks [i S r - H, i S r - H + BNc), S = (BNc - H) // r: the
tiles of compressed blocks overlap by H + BNc - S r blocks. Relative to the tile, the map is a
fixed count matrix, W[a, s] = #{m < r, e <= H: a = r s + m + e}, made from iota and applied as an
IEEE float32 dot `[BT, BNc] x [BNc, S]`. With l = d = l' (fla's configuration) it is the
identity and no dot runs.

Packed rows (a second launch, `_packed_select_kernel`; the one-document kernel is untouched): each
query brings its document's start, first compressed slot and end (one past the last slot complete
at t). A query tile may straddle documents: the program takes them one at a time (the smallest
start above the last one handled, a masked min, until none is left), and runs the tile loop above
over that document's selection blocks, the compressed block a of a tile read at slot first + a
(the halo rows before the first slot, another document's or the zero rows, and slots >= end
masked per query; other documents' queries get no candidates). The tiles start at the document's
block 0, so Eq. 9's count map is the same; the forced blocks use each query's own cur.

Precision: 16-bit q and k_cmp of one dtype meet in 16-bit dots (exact products, float32
accumulation); any other pair is upcast to float32, IEEE dots. The reference sums in another
order, so a near-tie may flip between the two (the tests accept only proven near-ties).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pisa_jax.kernels._common import (BIG, LOG2E, MIN_DOT, call_kernel, next_pow2, qk_dot,
                                      rank_key, running_top_k)
from pisa_jax.kernels.selection.topk import sorted_kept


@dataclasses.dataclass(frozen=True)
class NSASelectConfig:
  """Tiles and launch of the selection kernel.

  Attributes:
    query_tile: BT, queries per program (the M of every dot), a power of two >= 16.
    block_tile: BNc, compressed blocks per step, a power of two >= 16; raised to the next power
      of two >= H + r where one selection block and its halo need more (`tiling`).
    num_warps, num_stages: the launch.
  """

  query_tile: int = 64
  block_tile: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("query_tile", "block_tile"):
      value = getattr(self, name)
      if value < MIN_DOT or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT} (a tensor-core "
                         "dot)")


class Tiling(NamedTuple):
  """How the compressed blocks are tiled (module docstring)."""

  pieces: int  # r = l' / d, the d-token pieces of a selection block
  halo: int  # H = l / d - 1, the compressed blocks before a piece that cover it
  cmp_tile: int  # BNc, compressed blocks a step
  sel_tile: int  # S = (BNc - H) // r, selection blocks a step
  sel_padded: int  # S as a power of two >= 16 (a dot dimension)

  @property
  def identity(self) -> bool:
    """l = d = l': selection block j is compressed block j."""
    return self.pieces == 1 and self.halo == 0


def tiling(*, block_length: int, stride: int, select_block_size: int,
           block_tile: int) -> Tiling:
  """The tiles of `NSASelectConfig.block_tile` for l, d, l' (module docstring)."""
  r, halo = select_block_size // stride, block_length // stride - 1
  bnc = max(block_tile, next_pow2(halo + r))
  s = (bnc - halo) // r
  return Tiling(r, halo, bnc, s, max(MIN_DOT, next_pow2(s)))


def _count_map(tiles: Tiling, o_a, o_s):
  """W^T `[SP, BNc]` float32: how often selection block s of a tile counts compressed block a of
  it (Eq. 9): the pairs m < r, e <= H with a - r s = m + e."""
  r, halo, _, s, _ = tiles
  x = o_a[None, :] - r * o_s[:, None]
  count = jnp.minimum(r - 1, x) - jnp.maximum(0, x - halo) + 1
  return jnp.where((o_s[:, None] < s) & (count > 0), count, 0).astype(jnp.float32)


def _kept_blocks(best_i, cur, o_col, top_n: int, kp: int):
  """The kept blocks `[BT, KP]` ascending, -1 past them, from the running top-(top_n - 3) ids
  best_i and each query's current block cur `[BT, 1]`."""
  n_best = top_n - 3
  # Every eligible block while at most top_n are (blocks 0 .. cur), else the forced 0, cur - 1,
  # cur (then cur >= top_n: all three distinct, and cur - 2 >= n_best candidates filled the
  # running set); then ascending.
  o_slot = o_col[None, :]
  chosen = jnp.where((o_slot < n_best) & (best_i >= 0), best_i, BIG)
  chosen = jnp.where(o_slot == n_best, 0, chosen)
  chosen = jnp.where(o_slot == n_best + 1, cur - 1, chosen)
  chosen = jnp.where(o_slot == n_best + 2, cur, chosen)
  chosen = jnp.where(cur + 1 <= top_n, jnp.where(o_slot <= cur, o_slot, BIG), chosen)
  return sorted_kept(chosen, chosen < BIG, kp)


def _merge_tile(q_ref, lse_ref, b_k, visible, rows, i, carry, *, t0, bt: int, group: int,
                c2: float, inputs_16bit: bool, tiles: Tiling, w_t, cur, o_s, o_col, n_best: int):
  """Step i of both kernels: the group's probabilities of a tile's compressed blocks b_k
  `[BNc, Dp]` where `visible` `[BT, BNc]` (Eq. 8, 10), mapped onto the tile's selection blocks
  i S .. i S + S - 1 (Eq. 9) and merged into the running top-(top_n - 3) `carry`. rows: None, or
  bool `[BT]`, the queries this step scores (packed: the document's); the others keep theirs."""
  def head(g, p):
    b_q = q_ref[pl.ds(t0, bt), g, :]
    lse2 = lse_ref[pl.ds(t0, bt), g] * LOG2E
    # Eq. 8 in base 2: exp(scale z - lse) = 2^(c2 z - lse log2 e).
    z = qk_dot(b_q, b_k, inputs_16bit)
    return p + jnp.where(visible, jnp.exp2(z * c2 - lse2[:, None]), 0.0)

  # Eq. 10: the group's heads share one selection, their probabilities summed.
  p = lax.fori_loop(0, group, head, jnp.zeros((bt, tiles.cmp_tile), jnp.float32))
  # Eq. 9 (packed: the tiles start at document-relative block 0, so the map is the same).
  scores = p if tiles.identity else qk_dot(p, w_t, False)  # [BT, SP]
  blk = i * tiles.sel_tile + o_s
  lead = None if rows is None else rows[:, None]
  cand = blk[None, :] >= 1
  cand = cand if lead is None else lead & cand
  cand = cand & (blk[None, :] < cur - 1) & (o_s < tiles.sel_tile)[None, :]
  # Ranked by `rank_key`: a NaN score above every number, as the reference's Select_K.
  b_r = jnp.where(cand, rank_key(scores), -jnp.inf)
  return running_top_k(*carry, b_r, blk, o_col, n_best)


def _program_merge(q_ref, lse_ref, idx_ref, *, t0, cur, group: int, top_n: int, scale: float,
                   inputs_16bit: bool, tiles: Tiling, bt: int):
  """What both kernels' programs share: `_merge_tile` bound to this program's queries, and the
  iotas and sizes around it: (merge, o_a `[BNC]`, o_col `[KP]`, n_best, KP)."""
  n_best = top_n - 3
  kp = idx_ref.shape[-1]
  o_col = jnp.arange(kp)
  o_a = jnp.arange(tiles.cmp_tile)
  o_s = jnp.arange(tiles.sel_padded)
  w_t = None if tiles.identity else _count_map(tiles, o_a, o_s)
  merge = functools.partial(_merge_tile, q_ref, lse_ref, t0=t0, bt=bt, group=group,
                            c2=scale * LOG2E, inputs_16bit=inputs_16bit, tiles=tiles, w_t=w_t,
                            cur=cur, o_s=o_s, o_col=o_col, n_best=n_best)
  return merge, o_a, o_col, n_best, kp


def _select_kernel(q_ref, k_ref, lse_ref, idx_ref, *, group: int, top_n: int, scale: float,
                   inputs_16bit: bool, block_length: int, stride: int, select_block_size: int,
                   tiles: Tiling, query_tile: int, seq_len: int):
  """One program: queries t0 .. t0 + BT - 1 of one (batch row, KV head). q_ref `[Tp, G, Dp]`,
  k_ref `[NP, Dp]` (compressed block c at row c + H: H zero rows in front), lse_ref `[Tp, G]`
  (natural log). Writes idx_ref `[Tp, KP]`: the kept selection blocks ascending, -1 past them."""
  r, halo, bnc, s, _ = tiles
  bt = query_tile
  t0 = pl.program_id(0) * bt
  o_t = t0 + jnp.arange(bt)
  # Eq. 7 from position 0: block c covers [c d, c d + l) and is complete at t when
  # c d + l - 1 <= t, so t sees blocks 0 .. end - 1.
  end = jnp.where(o_t + 1 >= block_length, (o_t + 1 - block_length) // stride + 1, 0)
  cur = (o_t // select_block_size)[:, None]
  t_last = jnp.minimum(t0 + bt - 1, seq_len - 1)
  # Scored blocks are 1 .. cur - 2 (0, cur - 1 and cur are forced): tiles up to the last
  # query's cur - 2.
  n_steps = pl.cdiv(jnp.maximum(t_last // select_block_size - 1, 0), s)
  merge, o_a, o_col, n_best, kp = _program_merge(q_ref, lse_ref, idx_ref, t0=t0, cur=cur,
                                                 group=group, top_n=top_n, scale=scale,
                                                 inputs_16bit=inputs_16bit, tiles=tiles, bt=bt)

  def step(i, carry):
    row0 = i * (s * r)  # the tile's first row of k_ref: compressed block row0 - H
    if tiles.identity:
      row0 = pl.multiple_of(row0, bnc)
    b_k = k_ref[pl.ds(row0, bnc), :]
    blk_c = row0 - halo + o_a
    visible = (blk_c[None, :] >= 0) & (blk_c[None, :] < end[:, None])
    return merge(b_k, visible, None, i, carry)

  best_v = jnp.full((bt, kp), -jnp.inf, jnp.float32)
  best_i = jnp.full((bt, kp), -1, jnp.int32)
  if n_best > 0:
    best_v, best_i = lax.fori_loop(0, n_steps, step, (best_v, best_i))
  idx_ref[pl.ds(t0, bt), :] = _kept_blocks(best_i, cur, o_col, top_n, kp)


def _packed_select_kernel(q_ref, k_ref, lse_ref, start_ref, first_ref, end_ref, idx_ref, *,
                          group: int, top_n: int, scale: float, inputs_16bit: bool,
                          select_block_size: int, tiles: Tiling, query_tile: int, seq_len: int):
  """`_select_kernel` for packed rows (module docstring): start_ref, first_ref, end_ref `[Tp]`
  int32, each query's document start, its document's first compressed slot and one past the
  last slot complete at it; k_ref's slot c at row c + H. The tile's documents one at a time."""
  r, halo, bnc, s, _ = tiles
  bt = query_tile
  t0 = pl.program_id(0) * bt
  o_t = t0 + jnp.arange(bt)
  start = start_ref[pl.ds(t0, bt)]
  first = first_ref[pl.ds(t0, bt)]
  end = end_ref[pl.ds(t0, bt)]
  rel = o_t - start
  cur = (rel // select_block_size)[:, None]
  real = o_t < seq_len
  merge, o_a, o_col, n_best, kp = _program_merge(q_ref, lse_ref, idx_ref, t0=t0, cur=cur,
                                                 group=group, top_n=top_n, scale=scale,
                                                 inputs_16bit=inputs_16bit, tiles=tiles, bt=bt)

  def document(carry):
    doc, best_v, best_i = carry
    mine = start == doc  # the queries of the document starting at position doc
    first_doc = jnp.min(jnp.where(mine, first, BIG))
    # Scored blocks are 1 .. cur - 2 of the document: tiles up to its last real query's.
    rel_last = jnp.max(jnp.where(mine & real, rel, 0))
    n_steps = pl.cdiv(jnp.maximum(rel_last // select_block_size - 1, 0), s)

    def step(i, carry):
      # Document-relative compressed blocks i S r - H + a, slots first_doc + those: rows
      # first_doc + i S r + a of k_ref. Blocks before the document's first (the halo of tile 0,
      # the previous document's slots) and slots not complete at t are masked.
      row0 = first_doc + i * (s * r)
      b_k = k_ref[pl.ds(row0, bnc), :]
      blk_c = i * (s * r) - halo + o_a
      visible = (mine[:, None] & (blk_c[None, :] >= 0)
                 & (first_doc + blk_c[None, :] < end[:, None]))
      # Other documents' queries get -inf: their running sets are left as they are.
      return merge(b_k, visible, mine, i, carry)

    best_v, best_i = lax.fori_loop(0, n_steps, step, (best_v, best_i))
    # The next document of the tile: the smallest start above this one (BIG: none left).
    return jnp.min(jnp.where(start > doc, start, BIG)), best_v, best_i

  best_v = jnp.full((bt, kp), -jnp.inf, jnp.float32)
  best_i = jnp.full((bt, kp), -1, jnp.int32)
  if n_best > 0:
    _, best_v, best_i = lax.while_loop(lambda carry: carry[0] < BIG, document,
                                       (jnp.min(start), best_v, best_i))
  idx_ref[pl.ds(t0, bt), :] = _kept_blocks(best_i, cur, o_col, top_n, kp)


def nsa_select_blocks_pallas(
    q: Float[Array, "B T HQ D"],
    k_cmp: Float[Array, "B N HKV D"],
    lse: Float[Array, "B T HQ"],
    *,
    block_length: int,
    stride: int,
    select_block_size: int,
    top_n: int,
    scale: float,
    interpret: bool,
    config: NSASelectConfig | None = None,
    documents: tuple[Int[Array, "B T"], Int[Array, "B T"], Int[Array, "B T"]] | None = None,
) -> Int[Array, "B T HKV K"]:
  """The top_n selection blocks of each query and KV head, document-relative.

  Args:
    q `[B, T, HQ, D]`; k_cmp `[B, N, HKV, D]` in `nsa_compress`' layout (unpacked: N =
      max(1, (T - l) // d + 1), slot c block c; packed: N = T // d, each document's blocks
      consecutive); lse `[B, T, HQ]`, the compressed attention's (natural log, -inf where no
      block is complete).
    block_length, stride, select_block_size, top_n, scale: l, d, l', n and the logit scale.
    interpret: the Pallas interpreter instead of Triton.
    documents: None (rows of one document), or packed rows' int32 `[B, T]` (start, first, end):
      each query's document start, its document's first compressed slot, one past the last
      slot complete at it (`pisa_jax.nsa`'s layout).

  Returns:
    int32 `[B, T, HKV, top_n]`, ascending, -1 padded.
  """
  config = config or NSASelectConfig()
  b, t, hq, d = q.shape
  n, hkv = k_cmp.shape[1], k_cmp.shape[2]
  g = hq // hkv
  tiles = tiling(block_length=block_length, stride=stride, select_block_size=select_block_size,
                 block_tile=config.block_tile)
  r, halo, bnc, s, _ = tiles
  bt = config.query_tile
  kp = next_pow2(top_n)
  dp = max(MIN_DOT, next_pow2(d))
  tp = -(-t // bt) * bt
  # Rows the tiles read: H zero rows in front, the last tile's BNc rows (module docstring).
  num_tiles = -(-(-(-t // select_block_size)) // s)
  # Packed, a document's tiles start at its first slot (<= N).
  np_ = max((num_tiles - 1) * s * r + bnc + (n if documents is not None else 0), halo + n)
  inputs_16bit = q.dtype == k_cmp.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
  if not inputs_16bit:
    q, k_cmp = q.astype(jnp.float32), k_cmp.astype(jnp.float32)
  q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, dp - d)))
  k_cmp = jnp.pad(k_cmp, ((0, 0), (halo, np_ - halo - n), (0, 0), (0, dp - d)))
  # Padding queries' rows are sliced off; a zero lse keeps them finite.
  lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, tp - t), (0, 0)))
  in_specs = [pl.BlockSpec((None, tp, None, g, dp), lambda i, h, bb: (bb, 0, h, 0, 0)),
              pl.BlockSpec((None, np_, None, dp), lambda i, h, bb: (bb, 0, h, 0)),
              pl.BlockSpec((None, tp, None, g), lambda i, h, bb: (bb, 0, h, 0))]
  operands = [q.reshape(b, tp, hkv, g, dp), k_cmp, lse.reshape(b, tp, hkv, g)]
  if documents is None:
    kernel = functools.partial(
        _select_kernel, group=g, top_n=top_n, scale=scale, inputs_16bit=inputs_16bit,
        block_length=block_length, stride=stride, select_block_size=select_block_size,
        tiles=tiles, query_tile=bt, seq_len=t)
    name = "nsa_select_blocks"
  else:
    kernel = functools.partial(
        _packed_select_kernel, group=g, top_n=top_n, scale=scale, inputs_16bit=inputs_16bit,
        select_block_size=select_block_size, tiles=tiles, query_tile=bt, seq_len=t)
    name = "nsa_select_blocks_packed"
    # Padding queries join the row's last document (one more document would cost a pass).
    in_specs += [pl.BlockSpec((None, tp), lambda i, h, bb: (bb, 0))] * 3
    operands += [jnp.pad(jnp.broadcast_to(x, (b, t)).astype(jnp.int32), ((0, 0), (0, tp - t)),
                         mode="edge") for x in documents]
  idx = call_kernel(pl.pallas_call(
      kernel,
      grid=(tp // bt, hkv, b),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, tp, None, kp), lambda i, h, bb: (bb, 0, h, 0)),
      out_shape=jax.ShapeDtypeStruct((b, tp, hkv, kp), jnp.int32),
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name=name,
  ), *operands)
  return idx[:, :t, :, :top_n]
