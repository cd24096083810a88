"""`SelectionSpec`: one checked value for the selection's options, taken whole (`spec=`) or as
keywords by every public function."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import SelectionSpec


def test_defaults_live_in_the_spec_and_resolve_per_head_dim():
  spec = SelectionSpec()
  assert (spec.block_size, spec.top_k, spec.branching, spec.selector) == (64, 8, 2, "pisa")
  resolved = spec.resolved(64)
  assert resolved.scale == 0.125 and resolved.beam == 8 and resolved.is_resolved
  assert resolved.resolved(128) is resolved  # a resolved spec keeps its scale
  # A flat selector has no beam: resolving leaves it None.
  assert SelectionSpec(selector="bsa", top_k=5).resolved(16).beam is None
  # Equal specs are equal static arguments under jit, whatever number types built them.
  assert hash(SelectionSpec(block_size=np.int64(16), scale=np.float32(0.5))) == hash(
      SelectionSpec(block_size=16, scale=0.5))
  with pytest.raises(dataclasses.FrozenInstanceError):
    spec.top_k = 16


@pytest.mark.parametrize("options,message", [
    (dict(top_k=2), "top_k=2 must be an int >= 3"),
    (dict(block_size=0), "block_size=0 must be an int >= 1"),
    (dict(branching=1), "branching=1 must be an int >= 2"),
    (dict(selector="flat"), "selector='flat' is unknown"),
    (dict(beam=4), "beam=4 must be None or an int >= top_k=8"),
    (dict(selector="bsa", beam=8), "beam=8 applies only to the hierarchical selectors"),
    (dict(scale=0.0), "scale=0.0 must be a finite float > 0"),
    (dict(scale=float("nan")), "scale=nan must be a finite float > 0"),
])
def test_a_bad_option_is_reported_where_the_spec_is_built(options, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    SelectionSpec(**options)
  q = jnp.zeros((1, 32, 2, 16))
  with pytest.raises(ValueError, match=re.escape(message)):
    pisa_jax.select_blocks(q, q, **options)


def test_a_keyword_that_disagrees_with_the_spec_names_both():
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 96, 4, 16))
  k = jax.random.normal(jax.random.PRNGKey(1), (1, 96, 2, 16))
  spec = SelectionSpec(block_size=8, top_k=4, beam=6)
  with pytest.raises(ValueError, match=re.escape(
      "top_k=5 conflicts with spec.top_k=4: pass top_k in the spec or as a keyword, not both")):
    pisa_jax.select_blocks(q, k, spec=spec, top_k=5)
  with pytest.raises(ValueError, match=re.escape("block_size=16 conflicts with spec.block_size=8")):
    pisa_jax.sparse_attention(q, k, k, jnp.zeros((1, 96, 2, 4), jnp.int32), spec=spec,
                              block_size=16)
  with pytest.raises(TypeError, match="spec must be a SelectionSpec, got dict"):
    pisa_jax.select_blocks(q, k, spec=dict(top_k=4))
  # A keyword equal to the spec's field agrees with it; the spec and the keywords select alike.
  by_spec = pisa_jax.select_blocks(q, k, spec=spec, top_k=4)
  by_keywords = pisa_jax.select_blocks(q, k, block_size=8, top_k=4, beam=6)
  np.testing.assert_array_equal(by_spec, by_keywords)
  out = pisa_jax.pisa_attention(q, k, k, spec=spec)
  np.testing.assert_array_equal(out, pisa_jax.sparse_attention(q, k, k, by_spec, spec=spec))
  np.testing.assert_array_equal(out, pisa_jax.pisa_attention(q, k, k, block_size=8, top_k=4,
                                                             beam=6))
  pyramid = pisa_jax.build_pyramid(k, spec=spec)
  assert (pyramid.block_size, pyramid.branching) == (8, 2)


def test_a_spec_is_a_static_argument_under_jit():
  q = jax.random.normal(jax.random.PRNGKey(2), (1, 64, 2, 16))
  select = jax.jit(pisa_jax.select_blocks, static_argnames=("spec",))
  spec = SelectionSpec(block_size=8, top_k=3, selector="pisa2")
  np.testing.assert_array_equal(select(q, q, spec=spec),
                                pisa_jax.select_blocks(q, q, block_size=8, top_k=3,
                                                       selector="pisa2"))


def test_decode_takes_the_cache_geometry_or_a_spec_that_agrees_with_it():
  cache = pisa_jax.DecodeCache.create(1, 32, 1, 16, spec=SelectionSpec(block_size=8),
                                      dtype=jnp.float32)
  assert (cache.block_size, cache.branching) == (8, 2)
  token = jnp.ones((1, 1, 1, 16), jnp.float32)
  with pytest.raises(ValueError, match=re.escape(
      "spec.block_size=16, spec.branching=2 must be the cache's block_size=8, branching=2")):
    pisa_jax.decode_step(token, token, token, cache, spec=SelectionSpec(block_size=16, top_k=3),
                         donate=False)
  out, _ = pisa_jax.decode_step(token, token, token, cache, top_k=3, donate=False)
  same, _ = pisa_jax.decode_step(token, token, token, cache, donate=False,
                                 spec=SelectionSpec(block_size=8, top_k=3))
  np.testing.assert_array_equal(out, same)
