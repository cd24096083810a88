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

SELECTORS = ("pisa", "pisa1", "pisa2", "bsa")


def select_blocks_pallas(
    q: Float[Array, "B T HQ D"],
    k: Float[Array, "B T HKV D"],
    *,
    block_size: int,
    top_k: int,
    branching: int,
    selector: str,
    scale: float,
    beam: int,
    interpret: bool,
    config: SelectionConfig | None = None,
    query_offset: Int[Array, ""] | int = 0,
) -> Int[Array, "B T HKV K"]:
  """Kernel twin of `select_blocks_reference` (arguments already validated).

  Args:
    q: queries `[B, T, HQ, D]`; k: keys `[B, T, HKV, D]` (any float dtype; scores in float32).
    block_size: C. top_k: K (>= 3). branching: g. selector: "pisa", "pisa1", "pisa2" or "bsa".
    scale: logit scale. beam: nodes kept per level above the leaves (>= top_k; unused by "bsa").
    interpret: run the Pallas interpreter instead of compiling through Triton.
    config: variant and tiles; None picks `SelectionConfig.default`.
    query_offset: q holds the queries at positions query_offset .. query_offset + Tq - 1 of k's
      T >= Tq (a sequence shard; `select_blocks_reference_offset`): an int, or an int32 scalar
      that may be traced. The Python int 0 runs the kernels without an offset input.

  Returns:
    int32 `[B, T, HKV, top_k]`: leaf ids ascending, -1 padded.
  """
  if selector not in SELECTORS:
    raise ValueError(f"{selector=} has no Pallas kernel: expected one of {SELECTORS}")
  if selector != "bsa" and beam < top_k:
    raise ValueError(f"{beam=} must be >= {top_k=}")
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  if isinstance(query_offset, int) and not isinstance(query_offset, bool) and query_offset == 0:
    offset = None
  else:
    offset = lax.stop_gradient(jnp.asarray(query_offset, jnp.int32).reshape(1))
  geo = make_geometry(q, k, block_size=block_size, top_k=top_k, branching=branching,
                      selector=selector, scale=scale, beam=beam if selector != "bsa" else top_k,
                      interpret=interpret, has_offset=offset is not None)
  config = config or SelectionConfig.default(seq_len=t, group=hq // hkv,
                                             candidates=geo.num_slots)
  if selector == "bsa":
    out = select_bsa(q, k, geo, interpret=interpret, config=config, offset=offset)
  else:
    pyramid = build_pyramid_pallas(k, block_size=block_size, branching=branching,
                                   interpret=interpret)
    select = select_fused if config.variant == "fused" else select_two_stage
    out = select(q, k, pyramid.summaries, geo, interpret=interpret, config=config, offset=offset)
  return out[:, :top_k].reshape(b, t, hkv, top_k)


def select_blocks_pallas_at(q: Float[Array, "B Tq HQ D"], k: Float[Array, "B T HKV D"],
                            query_offset: Int[Array, ""] | int, *, block_size: int, top_k: int,
                            branching: int, selector: str, scale: float, beam: int,
                            interpret: bool) -> Int[Array, "B Tq HKV K"]:
  """Kernel twin of `select_blocks_reference_offset` (its signature): `select_blocks_pallas`
  for the queries at positions query_offset .. query_offset + Tq - 1 of k's T."""
  return select_blocks_pallas(q, k, block_size=block_size, top_k=top_k, branching=branching,
                              selector=selector, scale=scale, beam=beam, interpret=interpret,
                              query_offset=query_offset)
