"""`select_blocks_pallas`: the kernel twin of `select_blocks_reference`. Builds the geometry, picks
the config and runs the fused, two-stage or BSA kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pisa_jax.kernels.pyramid import build_pyramid_pallas
from pisa_jax.kernels.selection.bsa import select_bsa
from pisa_jax.kernels.selection.config import SelectionConfig
from pisa_jax.kernels.selection.fused import select_fused
from pisa_jax.kernels.selection.layout import make_geometry
from pisa_jax.kernels.selection.two_stage import select_two_stage
from pisa_jax.spec import SelectionSpec, takes_spec

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")


@takes_spec
def select_blocks_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    *,
    spec: SelectionSpec,
    interpret: bool,
    config: SelectionConfig | None = None,
    query_offset: Int[Array, ""] | int = 0,
) -> Int[Array, "B T HKV K"]:
  """Kernel twin of `select_blocks_reference` (arguments already validated).

  Args:
    q: queries `[B, T, HQ, D]`; k: keys `[B, T, HKV, D]` (any float dtype; scores in float32).
    spec: the selection (`SelectionSpec`; or its fields as keywords), selector "pisa", "pisa1",
      "pisa2" or "bsa".
    interpret: run the Pallas interpreter instead of compiling through Triton.
    config: variant and tiles; None picks `SelectionConfig.default`.
    query_offset: q holds the queries at positions query_offset .. query_offset + Tq - 1 of k's
      T >= Tq (a sequence shard; `select_blocks_reference_offset`): an int, or an int32 scalar
      that may be traced. The Python int 0 runs the kernels without an offset input.

  Returns:
    int32 `[B, T, HKV, top_k]`: leaf ids ascending, -1 padded.
  """
  if spec.selector not in SELECTORS:
    raise ValueError(f"selector={spec.selector!r} has no Pallas kernel: expected one of "
                     f"{SELECTORS}")
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  if isinstance(query_offset, int) and not isinstance(query_offset, bool) and query_offset == 0:
    offset = None
  else:
    offset = lax.stop_gradient(jnp.asarray(query_offset, jnp.int32).reshape(1))
  geo = make_geometry(q, k, spec=spec, interpret=interpret, has_offset=offset is not None)
  config = config or SelectionConfig.default(seq_len=t, group=hq // hkv,
                                             candidates=geo.num_slots)
  if spec.selector == "bsa":
    out = select_bsa(q, k, geo, interpret=interpret, config=config, offset=offset)
  else:
    pyramid = build_pyramid_pallas(k, block_size=spec.block_size, branching=spec.branching,
                                   interpret=interpret, summary_dtype=spec.summary_dtype)
    select = select_fused if config.variant == "fused" else select_two_stage
    out = select(q, k, pyramid.summaries, geo, interpret=interpret, config=config, offset=offset)
  return out[:, :spec.top_k].reshape(b, t, hkv, spec.top_k)


@takes_spec
def select_blocks_pallas_at(q: Float[Array, "B Tq HQ D"], k: Float[Array, "B T HKV D"],
                            query_offset: Int[Array, ""] | int, *, spec: SelectionSpec,
                            interpret: bool) -> Int[Array, "B Tq HKV K"]:
  """Kernel twin of `select_blocks_reference_offset` (its signature): `select_blocks_pallas`
  for the queries at positions query_offset .. query_offset + Tq - 1 of k's T."""
  return select_blocks_pallas(q, k, spec=spec, interpret=interpret, query_offset=query_offset)
