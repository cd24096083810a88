"""The kernels at 1M-4M tokens, where element offsets pass 2^31: what runs on the CPU.

Queries `[1, 2M, 32, 64]` hold 2^32 elements, and `[1, 1M, 32, 128]` too. Pallas' Triton lowering
addresses an array with 64-bit offsets once it exceeds 2^32 bytes (each index, an int32 row, is
widened before it is multiplied by its stride), so what must stay below 2^31 is every int32 value
the kernels and their host-side set-up compute themselves: rows, pair ids, table entries. Here:

- the host-built tables and the two-stage selection's row ranges at values past 2^31;
- the two-stage selection split over row ranges gives the indices of one launch (interpret mode);
- every selection variant, the attention forward and backward and the decode kernels lower for
  sm_90 at T = 2M and 4M (jit(...).lower on ShapeDtypeStructs: nothing is allocated);
- the Triton IR: no 64-bit integer anywhere at 256K (the sizes whose speed is measured), and at
  2M 64-bit offsets for the queries only, outside the selection kernels' loops.

tests/test_gpu_long_context.py runs the kernels at these sizes on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax.geometry import level_sizes
from pisa_jax.kernels import attention as attn
from pisa_jax.kernels import decode as dec
from pisa_jax.kernels import selection as sel
from pisa_jax.kernels._common import INT32_MAX, int32_table
from pisa_jax.kernels.selection import layout, two_stage

M1, M2, M4 = 1 << 20, 1 << 21, 1 << 22
HQ, HKV, C, G = 32, 2, 64, 2


# ---------------------------------------------------------------------------------------------
# Host-side tables and row ranges.


def test_int32_table_takes_int32_max_and_names_an_entry_past_it():
  table = int32_table([[0, INT32_MAX], [-INT32_MAX - 1, 1]], "t")
  assert table.dtype == jnp.int32 and int(table[0, 1]) == INT32_MAX
  with pytest.raises(ValueError, match=r"the level table holds 2147483648, past int32"):
    int32_table([[1, 2**31]], "the level table")


@pytest.mark.parametrize("t,block_size,branching", [
    (M2, 64, 2), (M4, 64, 2), (M4, 16, 2), (M4 + 777, 16, 3), (M1, 64, 2)])
def test_level_table_at_long_sequences(t, block_size, branching):
  # 2M tokens at C = 64 have 16 levels, padded to 32 columns: padding with g^(l-1) would have put
  # 2^31 there. At C = 16, 4M tokens have 19 levels.
  q = jax.ShapeDtypeStruct((1, t, HQ, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, t, HKV, 64), jnp.bfloat16)
  geo = layout.make_geometry(q, k, block_size=block_size, top_k=8, branching=branching,
                             selector="pisa", scale=0.125, beam=8)
  table = np.asarray(layout.level_table(geo), np.int64)
  sizes = level_sizes(t, block_size, branching)
  n, lp = len(sizes), table.shape[1]
  assert lp == 1 << n.bit_length() and table.dtype == np.int64 and table.shape[0] == 3
  np.testing.assert_array_equal(table[0, :n], sizes)
  np.testing.assert_array_equal(table[0, n:], 1)
  np.testing.assert_array_equal(table[1], np.concatenate([[0], np.cumsum(table[0] * HKV)[:-1]]))
  np.testing.assert_array_equal(table[2, :n], [branching ** i for i in range(n)])
  np.testing.assert_array_equal(table[2, n:], 1)
  if (t, block_size) == (M2, 64):
    assert n == 16 and lp == 32 and branching ** (lp - 1) > INT32_MAX


@pytest.mark.parametrize("batch,t,hkv,slots", [
    (1, M4, 8, 64),  # 2^31 pairs: two ranges
    (1, M4, 8, 128),  # 2^32 pairs: four
    (3, M2 + 5, 8, 128),  # ragged
    (1, M4, 2, 64),  # 2^29 pairs: one range, the rows as they are
])
def test_two_stage_row_ranges_keep_pair_ids_inside_int32(batch, t, hkv, slots):
  rows = batch * t * hkv
  chunks = two_stage.row_chunks(rows, slots)
  starts, stops = np.asarray(chunks).T
  assert starts[0] == 0 and stops[-1] == rows and (starts[1:] == stops[:-1]).all()
  assert len(chunks) == -(-rows * slots // two_stage.MAX_PAIRS)
  # Inside a range: pair ids (row - start) * NC + slot < pairs, a tile's last sorted position
  # start + q_tile - 1, the trash slot = pairs, and the tile count all fit int32.
  pairs = (stops - starts) * slots
  assert (pairs <= two_stage.MAX_PAIRS).all()
  assert pairs.max() + 64 < INT32_MAX
  assert int(pairs.max()) // 8 + batch * hkv * (t // 64 + 1) < INT32_MAX
  if rows * slots <= two_stage.MAX_PAIRS:
    assert chunks == [(0, rows)]


def test_two_stage_in_row_ranges_equals_one_launch(monkeypatch):
  # Ranges of 150 rows over B * T * HKV = 384: one ends inside batch entry 0, one spans the
  # boundary of the batch entries, the last is short.
  b, t, hq, hkv, d = 2, 96, 4, 2, 16
  kq, kk = jax.random.split(jax.random.PRNGKey(0))
  q = jax.random.normal(kq, (b, t, hq, d), jnp.float32)
  k = jax.random.normal(kk, (b, t, hkv, d), jnp.float32)
  config = dataclasses.replace(sel.SelectionConfig(), variant="two_stage")
  run = functools.partial(sel.select_blocks_pallas, q, k, block_size=8, top_k=4, branching=2,
                          selector="pisa", scale=0.25, beam=8, interpret=True, config=config)
  one = np.asarray(run())
  slots = sel.candidate_slots(8, 2)
  monkeypatch.setattr(two_stage, "MAX_PAIRS", 150 * slots)
  assert two_stage.row_chunks(b * t * hkv, slots) == [(0, 150), (150, 300), (300, 384)]
  np.testing.assert_array_equal(np.asarray(run()), one)


# ---------------------------------------------------------------------------------------------
# Lowering for sm_90 at 2M-4M tokens.


def _by_name(modules) -> dict[str, list[str]]:
  out: dict[str, list[str]] = {}
  for m in modules:
    out.setdefault(re.search(r"module @([A-Za-z0-9_]+)", m).group(1), []).append(m)
  return out


def _loop_bodies(ir: str) -> list[str]:
  """The text inside every scf.for / scf.while region of a module (nested ones included)."""
  bodies, lines = [], ir.splitlines()
  for i, line in enumerate(lines):
    if re.search(r"\bscf\.(for|while)\b", line):
      depth, body = 0, []
      for inner in lines[i:]:
        depth += inner.count("{") - inner.count("}")
        body.append(inner)
        if depth <= 0:
          break
      bodies.append("\n".join(body[1:]))
  return bodies


def _lower_selection(t, selector, top_k, beam, *, d=64, hkv=HKV, dtype=jnp.bfloat16,
                     config=None):
  q = jax.ShapeDtypeStruct((1, t, HQ, d), dtype)
  k = jax.ShapeDtypeStruct((1, t, hkv, d), dtype)
  fn = functools.partial(sel.select_blocks_pallas, block_size=C, top_k=top_k, branching=G,
                         selector=selector, scale=d ** -0.5, beam=beam, interpret=False,
                         config=config)
  jax.jit(fn).trace(q, k).lower(lowering_platforms=("cuda",))


def _lower_attention(t, d, top_k, hkv=HKV):
  q = jax.ShapeDtypeStruct((1, t, HQ, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, hkv, d), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((1, t, hkv, top_k), jnp.int32)

  def loss(q, k, v, idx):
    out = attn.sparse_attention_pallas(q, k, v, idx, block_size=C, scale=d ** -0.5,
                                       interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, idx).lower(
      lowering_platforms=("cuda",))


SELECTION_CASES = [
    # (selector, K, beam, d, the selection kernels it launches)
    ("pisa", 8, 8, 64, {"pisa_select_fused_rank_pair_lse_unshifted"}),
    ("pisa", 8, 8, 128, {"pisa_select_fused_rank_pair_lse_unshifted"}),
    ("pisa", 8, 16, 64, {"pisa_select_walk_rank_folded_pair_lse", "pisa_select_sibling_q8",
                         "pisa_select_final_topk_rank_folded"}),
    ("pisa", 32, 32, 128, {"pisa_select_walk_rank_folded_pair_lse", "pisa_select_sibling_q8",
                           "pisa_select_final_topk_rank_folded"}),
    ("pisa1", 8, 8, 64, {"pisa_select_fused_rank"}),
    ("pisa2", 8, 8, 64, {"pisa_select_fused_rank"}),
    ("bsa", 8, 8, 64, {"bsa_select"}),
]


@pytest.mark.parametrize("t", [M2, M4], ids=["T2M", "T4M"])
@pytest.mark.parametrize("selector,top_k,beam,d,kernels", SELECTION_CASES,
                         ids=lambda x: str(x) if not isinstance(x, set) else "")
def test_selection_lowers_at_millions_of_tokens(captured, t, selector, top_k, beam, d, kernels):
  _lower_selection(t, selector, top_k, beam, d=d)
  names = _by_name(captured)
  assert kernels <= set(names), set(names)
  for name in kernels:
    (ir,) = names[name]
    # The queries (2^32 elements and more) are addressed with 64-bit offsets...
    if not name.startswith("pisa_select_final_topk"):
      assert re.search(r"tt\.addptr .*tensor<[0-9x]+xi64>", ir), name
    # ...loaded once per program: the loops over levels, leaves and block tiles read keys and
    # summaries (below 2^32 bytes here) with 32-bit offsets, as at 128K.
    assert not any("i64" in body for body in _loop_bodies(ir)), name


def test_two_stage_lowers_past_two_to_the_31_pairs(captured):
  # 4M tokens, 8 KV heads, K = 32 (64 slots): 2^31 (query, candidate) pairs, two row ranges.
  _lower_selection(M4, "pisa", 32, 32, hkv=8)
  names = _by_name(captured)
  assert len(names["pisa_select_sibling_q8"]) == 2
  assert len(names["pisa_select_final_topk_rank_folded"]) == 2
  assert len(names["pisa_select_walk_rank_folded_pair_lse"]) == 1


@pytest.mark.parametrize("t,d,top_k", [(M1, 128, 8), (M2, 64, 8), (M2, 128, 32), (M4, 128, 8)],
                         ids=["T1M-D128-K8", "T2M-D64-K8", "T2M-D128-K32", "T4M-D128-K8"])
def test_attention_forward_and_backward_lower_at_millions_of_tokens(captured, t, d, top_k):
  _lower_attention(t, d, top_k)
  names = _by_name(captured)
  for kind in ("fwd", "dq", "dkv"):
    (ir,) = names[f"pisa_sparse_attention_{kind}"]
    # q, o, do and dq `[1, T, 32, D]` pass 2^32 bytes: 64-bit offsets.
    assert re.search(r"tt\.addptr .*tensor<[0-9x]+xi64>", ir), kind
  assert "pisa_sparse_attention_dkv_reduce" in names


@pytest.mark.parametrize("capacity,batch,selector", [
    (M2, 1, "pisa"), (M4, 1, "pisa"), (M4, 1, "bsa"), (M2, 8, "pisa")])
def test_decode_kernels_lower_at_millions_of_tokens(captured, capacity, batch, selector):
  # Batch 8 at 2M: a cache of 2^32 elements per K and V (8 GiB).
  d, top_k = 128, 8
  nodes = sum(level_sizes(capacity, C, G))
  q = jax.ShapeDtypeStruct((batch, HQ, d), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((batch, capacity, HKV, d), jnp.bfloat16)
  summaries = jax.ShapeDtypeStruct((batch, nodes, HKV, d), jnp.float32)
  pos = jax.ShapeDtypeStruct((batch,), jnp.int32)
  new = jax.ShapeDtypeStruct((batch, HKV, d), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((batch, HKV, top_k), jnp.int32)
  cuda = dict(lowering_platforms=("cuda",))
  jax.jit(functools.partial(dec.decode_append_pallas, block_size=C, branching=G,
                            interpret=False)).trace(new, new, cache, cache, summaries, pos).lower(
                                **cuda)
  jax.jit(functools.partial(dec.decode_select_pallas, block_size=C, branching=G, top_k=top_k,
                            beam=top_k, selector=selector, scale=d ** -0.5, interpret=False)
          ).trace(q, cache, summaries, pos).lower(**cuda)
  jax.jit(functools.partial(dec.decode_attention_pallas, block_size=C, scale=d ** -0.5,
                            interpret=False)).trace(q, cache, cache, idx, pos).lower(**cuda)
  jax.jit(functools.partial(dec.decode_append_select_pallas, block_size=C, branching=G,
                            top_k=top_k, beam=top_k, selector=selector, scale=d ** -0.5,
                            interpret=False)
          ).trace(q, new, new, cache, cache, summaries, pos).lower(**cuda)
  names = _by_name(captured)
  select = {f"pisa_decode_select_{selector}{part}"
            for part in ([""] if selector == "bsa" else ["_walk", "_leaves", "_final"])}
  fused = set() if selector == "bsa" else {f"pisa_decode_select_{selector}_append_walk"}
  assert {"pisa_decode_append", "pisa_decode_attention", *select, *fused} <= set(names), set(names)
  if batch * capacity * HKV * d * 2 > 2**32:
    assert re.search(r"tt\.addptr .*tensor<[0-9x]+xi64>", names["pisa_decode_attention"][0])


def test_no_64_bit_integer_in_any_kernel_at_256k(captured):
  # The sizes whose speed the benchmarks measure: no array reaches 2^32 bytes, so every offset
  # and index is 32-bit.
  t = 1 << 18
  for selector, top_k, beam, d, _ in SELECTION_CASES:
    _lower_selection(t, selector, top_k, beam, d=d)
  _lower_attention(t, 128, 32)
  names = _by_name(captured)
  assert {"pisa_select_fused_rank_pair_lse_unshifted", "pisa_select_sibling_q8", "bsa_select",
          "pisa_sparse_attention_fwd", "pisa_sparse_attention_dkv"} <= set(names)
  for name, irs in names.items():
    assert not any(re.search(r"\bi64\b", ir) for ir in irs), name
