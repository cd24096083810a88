"""The bfloat16 pyramid (`summary_dtype="bfloat16"`): each mean computed in float32 from its stored
children (a leaf from its raw keys) and rounded once; kernels and reference store the same values,
select the same blocks (but proven near-ties), and decoding token by token selects what the
prefill selection selects. The float32 default is the rest of the suite's (and `kernel_ir.py`'s)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pisa_jax
from pisa_jax import DecodeCache, SelectionSpec, decode_step
from pisa_jax.kernels.pyramid import build_pyramid_pallas
from pisa_jax.pyramid import build_pyramid_reference
from pisa_jax.testing import mismatch_margins
from tolerances import SELECTION_NEAR_TIE_RTOL

BF16 = "bfloat16"


def _normal(seed, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("branching", [2, 3])
def test_pyramid_kernel_stores_the_reference_values_each_mean_rounded_once(branching):
  # T = 1000: a partial last leaf and partial parents; D = 48 is not a power of two.
  k = _normal(0, (2, 1000, 2, 48))
  ref = build_pyramid_reference(k, block_size=16, branching=branching, summary_dtype=BF16)
  got = build_pyramid_pallas(k, block_size=16, branching=branching, interpret=True,
                             summary_dtype=BF16)
  children = np.asarray(k, np.float64)
  group, counts = 16, 1000
  for level, (r, g) in enumerate(zip(ref.summaries, got.summaries)):
    assert r.dtype == g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(g, np.float32))
    # Independently: the float64 mean of the stored children, rounded to bfloat16, except where
    # it lies within float32 rounding of a bfloat16 tie (none at this seed).
    m = r.shape[1]
    pad = m * group - counts
    x = np.pad(children, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(2, m, group, 2, 48)
    n = np.clip(counts - np.arange(m) * group, 1, group)[None, :, None, None]
    want = (x.sum(axis=2) / n).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(r, np.float32), want.astype(np.float32),
                                  err_msg=f"level {level + 1}")
    children, group, counts = np.asarray(r, np.float64), branching, m


@pytest.mark.parametrize("selector,top_k", [("pisa", 5), ("pisa2", 12), ("bsa", 6)])
def test_selection_kernels_select_the_references_blocks(selector, top_k):
  # top_k 5: the fused walk (10 candidate slots); 12: the two-stage pipeline (24 slots).
  q, k = _normal(1, (1, 700, 4, 32)), _normal(2, (1, 700, 2, 32))
  opts = dict(block_size=16, top_k=top_k, selector=selector, summary_dtype=BF16)
  ref = pisa_jax.select_blocks(q, k, implementation="xla", **opts)
  got = pisa_jax.select_blocks(q, k, implementation="pallas", **opts)
  spec = SelectionSpec(**opts).resolved(32)
  margins = mismatch_margins(got, ref, q, k, block_size=16, top_k=top_k, branching=2,
                             selector=selector, scale=spec.scale, beam=spec.kept_per_level,
                             summary_dtype=BF16)
  assert all(m < SELECTION_NEAR_TIE_RTOL for *_, m in margins), margins
  # The option changes what is scored: some rows differ from the float32 pyramid's.
  f32 = pisa_jax.select_blocks(q, k, implementation="xla", **{**opts, "summary_dtype": None})
  assert np.any(np.asarray(f32) != np.asarray(ref))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_decoding_selects_the_prefill_selections_blocks_row_by_row(implementation):
  b, t, prompt, hq, hkv, d, c, top_k = 2, 260, 190, 4, 2, 32, 16, 5
  q, k, v = _normal(3, (b, t, hq, d)), _normal(4, (b, t, hkv, d)), _normal(5, (b, t, hkv, d))
  full = pisa_jax.select_blocks(q, k, block_size=c, top_k=top_k, summary_dtype=BF16,
                                implementation="xla")
  full_out = pisa_jax.sparse_attention(q, k, v, full, block_size=c, implementation="xla")
  cache = DecodeCache.create(b, 256, hkv, d, block_size=c, summary_dtype=jnp.bfloat16)
  assert cache.summaries.dtype == jnp.bfloat16 and cache.summary_dtype == BF16
  cache = cache.prefill(k[:, :prompt], v[:, :prompt])
  step = jax.jit(lambda q, k, v, cache: decode_step(q, k, v, cache, top_k=top_k,
                                                     return_indices=True,
                                                     implementation=implementation),
                 donate_argnums=3)
  idx, outs = [], []
  for pos in range(prompt, t):
    if pos + 1 > cache.capacity:
      cache = cache.grow(pos + 1)
    out, cache, i = step(q[:, pos:pos + 1], k[:, pos:pos + 1], v[:, pos:pos + 1], cache)
    idx.append(i)
    outs.append(out)
  idx, outs = np.asarray(jnp.concatenate(idx, 1)), jnp.concatenate(outs, 1)
  np.testing.assert_array_equal(idx, np.asarray(full[:, prompt:]))
  np.testing.assert_allclose(np.asarray(outs, np.float32),
                             np.asarray(full_out[:, prompt:], np.float32), atol=2e-2, rtol=2e-2)
  # The cache's pyramid is the prefill's, node for node, after the appends.
  pyramid = pisa_jax.build_pyramid(k, block_size=c, summary_dtype=BF16, implementation="xla")
  for want, got in zip(pyramid.summaries, cache.levels()):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[:, :want.shape[1]], np.float32),
                                  np.asarray(want, np.float32))


def test_kernel_step_writes_the_reference_steps_summaries():
  b, hq, hkv, d, c = 3, 4, 2, 32, 16
  k, v = _normal(6, (b, 150, hkv, d)), _normal(7, (b, 150, hkv, d))
  cache = DecodeCache.create(b, 256, hkv, d, block_size=c, summary_dtype=BF16).prefill(
      k, v, jnp.asarray([150, 63, 64]))
  q, kn, vn = _normal(8, (b, hq, d)), _normal(9, (b, hkv, d)), _normal(10, (b, hkv, d))
  args = (q, kn, vn, cache.k, cache.v, cache.summaries, cache.lengths)
  spec = SelectionSpec(block_size=c, top_k=4, summary_dtype=BF16)
  from pisa_jax import _dispatch

  ref = _dispatch.lookup("decode_step", "xla")(*args, spec=spec)
  got = _dispatch.lookup("decode_step", "pallas")(*args, spec=spec)
  assert got[2].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(ref[2], np.float32))
  np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(ref[3]))


def test_the_bfloat16_pyramid_takes_half_the_memory():
  f32 = DecodeCache.create(2, 4096, 2, 64)
  bf16 = DecodeCache.create(2, 4096, 2, 64, summary_dtype=jnp.bfloat16)
  assert f32.summaries.dtype == jnp.float32 and f32.summary_dtype == "float32"
  assert bf16.summaries.nbytes * 2 == f32.summaries.nbytes
  assert bf16.grow(8192).summaries.dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", ["float16", jnp.float16, "bf16", 16])
def test_a_bad_summary_dtype_is_named_in_one_line(bad):
  message = re.escape(f"summary_dtype={bad!r} must be one of ('float32', 'bfloat16')")
  q = jnp.zeros((1, 32, 2, 16))
  for call in (lambda: SelectionSpec(summary_dtype=bad),
               lambda: pisa_jax.select_blocks(q, q, summary_dtype=bad),
               lambda: pisa_jax.pisa_attention(q, q, q, summary_dtype=bad),
               lambda: pisa_jax.build_pyramid(q, summary_dtype=bad),
               lambda: DecodeCache.create(1, 64, 2, 16, summary_dtype=bad)):
    with pytest.raises(ValueError, match=message) as error:
      call()
    assert "\n" not in str(error.value)


def test_disagreements_and_packed_documents_are_refused_by_name():
  q = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=re.escape(
      "summary_dtype='bfloat16' conflicts with spec.summary_dtype='float32'")):
    pisa_jax.select_blocks(q, q, spec=SelectionSpec(), summary_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=re.escape(
      "summary_dtype='bfloat16' is not supported with segment_ids")):
    pisa_jax.select_blocks(q, q, summary_dtype=BF16, segment_ids=jnp.zeros((1, 32), jnp.int32))
  cache = DecodeCache.create(1, 64, 2, 16, block_size=16, summary_dtype=BF16)
  token = jnp.zeros((1, 1, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=re.escape(
      "spec.summary_dtype='float32' must be the cache's summary_dtype='bfloat16'")):
    decode_step(token, token, token, cache, spec=SelectionSpec(block_size=16, top_k=3))


def test_the_model_config_field_reaches_the_cache_and_is_checked():
  import dataclasses

  from flax import nnx

  from pisa_jax.configs import get_config, validate
  from pisa_jax.models.decoder import Attention

  config = get_config("tiny")
  config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 summary_dtype=BF16))
  validate(config)
  layer = Attention(config.model, rngs=nnx.Rngs(0))
  cache = layer.init_cache(1, 128, jnp.bfloat16)
  assert cache.summaries.dtype == jnp.bfloat16
  bad = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                              summary_dtype="float16"))
  with pytest.raises(ValueError, match=re.escape(
      "model.summary_dtype='float16' must be one of ('float32', 'bfloat16')")):
    validate(bad)
  # Every kind's field is checked; only the pyramid's kinds take bfloat16.
  for attention, dtype, message in (("dense", "float16", "must be one of"),
                                    ("dense", BF16, "model.attention='dense' has none"),
                                    ("nsa", BF16, "model.attention='nsa' has none")):
    bad = dataclasses.replace(config, model=dataclasses.replace(
        config.model, attention=attention, summary_dtype=dtype))
    with pytest.raises(ValueError, match=re.escape(message)):
      validate(bad)


@pytest.mark.slow  # ~12 s, mostly compilation; the field's path to the cache is tested above
def test_a_model_with_a_bfloat16_pyramid_generates_its_full_forward_argmax():
  # The decoder passes model.summary_dtype to its prefill selection and to its decode caches:
  # the generated logits are those of the full forward pass with the same pyramid.
  from flax import nnx

  from pisa_jax.models import Decoder, ModelConfig
  from tolerances import OUTPUT_ATOL, OUTPUT_RTOL

  cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=64, num_layers=1, d_model=64, mlp_dim=128,
                    num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, top_k=4,
                    init_std=0.1, param_dtype="float32", compute_dtype="float32",
                    attention_implementation="xla", summary_dtype=BF16)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  prompts = [[(7 * i + 3) % 64 for i in range(21)], [(11 * i) % 64 for i in range(9)]]
  out = pisa_jax.generate(model, prompts, max_new_tokens=4, return_logits=True)
  forward = jax.jit(lambda m, tokens: m(tokens))
  for s in range(4):
    tokens = np.zeros((2, 32), np.int32)
    for b, prompt in enumerate(prompts):
      tokens[b, :len(prompt) + s] = prompt + out.tokens[b, :s].tolist()
    logits = np.asarray(forward(model, jnp.asarray(tokens)))
    last = logits[np.arange(2), [len(p) + s - 1 for p in prompts]]
    np.testing.assert_allclose(out.logits[:, s], last, atol=OUTPUT_ATOL[jnp.float32],
                               rtol=OUTPUT_RTOL[jnp.float32])
