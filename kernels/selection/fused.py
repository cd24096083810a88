"""The fused selection kernel (the paper's per-query variant, and the shape of a decode kernel):
one program per (query, KV head) walks every level, scores its candidate leaves on their raw keys
and runs the final Select_K, with the group's queries in registers throughout. The default at
NC = 16 candidate slots (K = 8): no pair sort, no scatter, no second pass over the queries."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pisa_jax.kernels._common import qk_dot, reduce_keys
from pisa_jax.kernels.selection import scoring, topk
from pisa_jax.kernels.selection.config import SelectionConfig
from pisa_jax.kernels.selection.layout import (Geometry, launch, leaf_key_rows, level_table,
                                               load_group_queries, load_rows, offset_input,
                                               query_position, stacked_summaries)
from pisa_jax.kernels.selection.walk import uses_pair_lse, walk_to_leaves


def leaf_score(qg, m_head, leaf, i_b, i_h, k_ref, geo: Geometry, unshifted: bool = False):
  """Group-summed raw-key score of one complete past leaf for one query (Eq. 21/33/34 with l = 1,
  then Eq. 22): qg `[Gp, Dp]` -> scalar."""
  rows, m_load, m_key = leaf_key_rows(leaf, i_b, i_h, geo)
  b_k = load_rows(k_ref, rows, m_load, geo)
  per_head = reduce_keys(qk_dot(qg, b_k, geo.inputs_16bit), m_key, geo.selector, geo.scale,
                         geo.approx_log, unshifted)
  return jnp.sum(jnp.where(m_head, per_head, 0.0))


def score_needed_leaves(cand, t, geo: Geometry, leaf_scorer):
  """Group-summed scores `[NC]` of the leaf candidates `[NC]` of the query at position t that
  need one (`topk.leaf_needs_score`; 0 elsewhere). leaf_scorer() gives the function leaf -> its
  score; it is called once, after the needed slots are numbered.

  The leaf loop runs once per candidate that needs a score (iteration c scores the c-th such
  slot), not once per slot: forced leaves (first, previous, current) and the current block's
  later sibling are never scored, about 3.5 of the 16 slots at K = 8 away from the sequence
  start, and each iteration is a `[16, 64] x [64, 64]` dot and 1,024 exponentials.
  """
  need, _, _ = topk.leaf_needs_score(cand, t, geo)
  slot = jnp.arange(geo.num_slots)
  # order[i]: how many needed slots come before slot i, so the needed slots are numbered
  # 0 .. n_need - 1 in slot order; one [NC, NC] compare, once per query.
  order = jnp.sum((need[None, :] & (slot[None, :] < slot[:, None])).astype(jnp.int32), axis=1)
  n_need = jnp.sum(need.astype(jnp.int32))
  leaf_score = leaf_scorer()

  def score_leaf(c, scores):
    hit = need & (order == c)
    leaf = jnp.sum(jnp.where(hit, cand, 0))
    return jnp.where(hit, leaf_score(leaf), scores)

  return lax.fori_loop(0, n_need, score_leaf, jnp.zeros((geo.num_slots,), jnp.float32))


def key_norm_bounds(k):
  """max_t |k_t|^2 per (batch, KV head), `[B*HKV]` float32: the keys' half of each program's
  logit bound (`bounded_select`)."""
  return jnp.max(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1), axis=1).reshape(-1)


def bounded_select(select, qg, m_head, kn2_ref, i_bh, geo: Geometry):
  """select(unshifted=...) under one `lax.cond` on the program's logit bound: the unshifted
  Eq. 21 where `scoring.unshifted_ok` allows it, the shifted one elsewhere. kn2_ref `[B*HKV]`
  holds max_t |k_t|^2 per (batch, KV head), loaded as a 2-vector (a value's shape is a power of
  two; one element would do) and reduced to a scalar."""
  kn2 = jnp.max(plt.load(kn2_ref.at[jnp.full((2,), i_bh, jnp.int32)]))
  return lax.cond(scoring.unshifted_ok(qg, m_head, kn2, geo.scale),
                  functools.partial(select, unshifted=True),
                  functools.partial(select, unshifted=False))


def fused_select(qg, m_head, i_b, t, i_h, k_ref, s_ref, tab_ref, geo: Geometry, topk_impl: str,
                 pair_lse: bool, unshifted: bool = False):
  """The selection of one (query, KV head): walk, leaf scores, final Select_K, `[1, KP]` sorted
  leaf ids."""
  cand = walk_to_leaves(qg, m_head, i_b, t, i_h, s_ref, tab_ref, geo, topk_impl,
                        pair_lse=pair_lse, unshifted=unshifted)

  def leaf_scorer():
    # Every numbered leaf is a complete past leaf: its key loads need no mask.
    return lambda leaf: leaf_score(qg, m_head, leaf, i_b, i_h, k_ref, geo, unshifted)

  scores = score_needed_leaves(cand, t, geo, leaf_scorer)
  return topk.final_select(cand[None, :], scores[None, :], t, geo, topk_impl, by_column=True)


def fused_kernel(q_ref, k_ref, s_ref, tab_ref, *refs, geo: Geometry, topk_impl: str,
                 pair_lse: bool = False, unshifted: bool = False):
  """All levels, the leaves included, for one (query, KV head); writes its `[1, KP]` leaf ids.

  refs: (out_ref,), or with `unshifted` (kn2_ref, out_ref): kn2_ref `[B*HKV]` holds
  max_t |k_t|^2 per (batch, KV head), from which the program bounds its logits and takes the
  unshifted branch (`SelectionConfig.fused_unshifted_lse`) where they are small enough. With
  `geo.has_offset`, off_ref `[1]` comes before out_ref: query row i_q is at position off + i_q,
  which every rule of the walk reads (eligibility, the forced blocks, causality).
  """
  kn2_ref = refs[0] if unshifted else None
  off_ref = refs[int(unshifted)] if geo.has_offset else None
  out_ref = refs[-1]
  i_p = pl.program_id(0)
  i_bh, i_q = i_p // geo.num_queries, i_p % geo.num_queries
  i_b, i_h = i_bh // geo.hkv, i_bh % geo.hkv
  m_head = jnp.arange(geo.group_padded) < geo.group
  qg = load_group_queries(q_ref, geo, i_b, i_q, i_h, geo.group_padded)
  t = query_position(i_q, off_ref)
  select = functools.partial(fused_select, qg, m_head, i_b, t, i_h, k_ref, s_ref, tab_ref, geo,
                             topk_impl, pair_lse)
  out = bounded_select(select, qg, m_head, kn2_ref, i_bh, geo) if unshifted else select()
  row = (i_b * geo.num_queries + i_q) * geo.hkv + i_h
  out_ref[pl.ds(row, 1), :] = out


def select_fused(q, k, summaries, geo: Geometry, *, interpret: bool, config: SelectionConfig,
                 offset=None):
  """The fused variant over the pyramid `summaries`: int32 `[B*Tq*HKV, KP]`; offset: None, or
  int32 `[1]` (`geo.has_offset`)."""
  b, t, hq, d = q.shape
  rows = b * t * geo.hkv
  pair_lse = uses_pair_lse(config, geo)
  unshifted = config.fused_unshifted_lse and geo.selector == "pisa"
  kn2 = (key_norm_bounds(k),) if unshifted else ()
  name = (f"pisa_select_fused_{config.topk_impl}" + ("_pair_lse" if pair_lse else "")
          + ("_unshifted" if unshifted else ""))
  return launch(functools.partial(fused_kernel, geo=geo, topk_impl=config.topk_impl,
                                  pair_lse=pair_lse, unshifted=unshifted),
                jax.ShapeDtypeStruct((rows, geo.top_k_padded), jnp.int32), rows, config,
                config.walk_warps, interpret, name, q.reshape(-1, d), k.reshape(-1, d),
                stacked_summaries(summaries, geo, q.dtype), level_table(geo), *kn2,
                *offset_input(offset))
