"""The kernels' GPU-only code paths lower to Triton IR on any machine.

CI has no GPU, so interpret mode never sees what only the compiled path does: the MUFU `lg2.approx`
inline assembly (`_common.log2`), whole-row loads, the launch shapes of every variant. Lowering for
"cuda" runs Pallas' Triton lowering in jaxlib on the CPU once it is told a compute capability
(sm_90, the H200's), the same patch as `benchmarks/triton_resources.py`; a lowering error in a
GPU-only path fails here instead of on the H200.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pisa_jax.kernels import attention as attn
from pisa_jax.kernels import selection as sel


def _names(modules):
  return [re.search(r"module @([A-Za-z0-9_]+)", m).group(1) for m in modules]


def _lower_selection(selector, config, *, dtype=jnp.bfloat16, top_k=8, beam=8, t=4096, d=64):
  q = jax.ShapeDtypeStruct((1, t, 32, d), dtype)
  k = jax.ShapeDtypeStruct((1, t, 2, d), dtype)
  fn = jax.jit(functools.partial(
      sel.select_blocks_pallas, block_size=64, top_k=top_k, branching=2, selector=selector,
      scale=d ** -0.5, beam=beam, interpret=False, config=config))
  fn.trace(q, k).lower(lowering_platforms=("cuda",))


DEFAULT = sel.SelectionConfig.default(seq_len=0, group=16)
TWO_STAGE = dataclasses.replace(DEFAULT, variant="two_stage")


@pytest.mark.parametrize("selector,config,kernels", [
    ("pisa", None, {"pisa_select_fused_rank_pair_lse_unshifted"}),  # the K = 8 default
    ("pisa", TWO_STAGE, {"pisa_select_walk_rank_pair_lse", "pisa_select_sibling_q8",
                         "pisa_select_final_topk_rank"}),
    ("pisa", dataclasses.replace(TWO_STAGE, topk_impl="passes", walk_pair_lse=False),
     {"pisa_select_walk_passes", "pisa_select_final_topk_passes"}),
    ("pisa", dataclasses.replace(DEFAULT, walk_pair_lse=False),
     {"pisa_select_fused_rank_unshifted"}),
    ("pisa", dataclasses.replace(DEFAULT, fused_unshifted_lse=False, topk_impl="passes"),
     {"pisa_select_fused_passes_pair_lse"}),
    ("pisa2", None, {"pisa_select_fused_rank"}),
    ("bsa", None, {"bsa_select"}),
])
def test_selection_kernels_lower_for_sm90(captured, selector, config, kernels):
  _lower_selection(selector, config)
  names = set(_names(captured))
  assert kernels <= names, names
  if selector in ("pisa", "bsa"):
    # The LSE's log2 is the MUFU instruction on the GPU (BSA has no log: its softmax needs none).
    asm = [m for m, n in zip(captured, _names(captured)) if n.startswith("pisa_select")]
    assert selector == "bsa" or any("lg2.approx.ftz.f32" in m for m in asm)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_selection_lowers_for_other_dtypes_and_k32(captured, dtype):
  # float32 (IEEE dots on float32 summaries) and float16 (split summaries), and K = 32, whose 64
  # candidate slots take the two-stage default with the 4-warp folded rank walk.
  _lower_selection("pisa", None, dtype=dtype, top_k=32, beam=32)
  assert {"pisa_select_walk_rank_folded_pair_lse", "pisa_select_sibling_q8",
          "pisa_select_final_topk_rank_folded"} <= set(_names(captured))


@pytest.mark.parametrize("variant", ["fused", "two_stage"])
def test_selection_lowers_for_a_head_dim_not_a_power_of_two(captured, variant):
  # D = 48: every load clamps its columns into the row and masks the padding (D = 64 and 128
  # load whole rows).
  _lower_selection("pisa", dataclasses.replace(DEFAULT, variant=variant), d=48)
  kind = "fused" if variant == "fused" else "walk"
  assert any(n.startswith(f"pisa_select_{kind}") for n in _names(captured))


@pytest.mark.parametrize("group,d", [(16, 64), (3, 128)])
def test_attention_kernels_lower_for_sm90(captured, group, d):
  # Forward, dq (+ delta) and the dk/dv kernels under the custom_vjp, any group, d 64 / 128.
  q = jax.ShapeDtypeStruct((1, 2048, 2 * group, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 2048, 2, d), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((1, 2048, 2, 8), jnp.int32)

  def loss(q, k, v, idx):
    out = attn.sparse_attention_pallas(q, k, v, idx, block_size=64, scale=d ** -0.5,
                                       interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, idx).lower(
      lowering_platforms=("cuda",))
  names = _names(captured)
  for kind in ("fwd", "dq", "dkv"):
    assert any(kind in n for n in names), names
