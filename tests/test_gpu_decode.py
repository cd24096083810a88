"""The decode step compiled for the GPU against the jnp reference step at the benchmark's widths.

CI runs the decode kernels in the Pallas interpreter, where launch widths do not exist; here
they compile through Triton with their default launch parameters, at K = 32 (64 candidate slots:
the walk's launch on 8 warps) and K = 8 (16 slots, 4 warps), d = 128 and 64, bf16, with a float32
and a bfloat16 pyramid (`summary_dtype`), on rows of different lengths, the first token of a
row included. Indices must equal the reference's (the random keys of these cases leave no
near-ties at float32 rounding; a mismatch is reported with its row); outputs agree to bf16
rounding. Skipped without a CUDA GPU.

  python -m pytest -q -m gpu tests/test_gpu_decode.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import decode as dec

pytestmark = pytest.mark.gpu

HQ, HKV, C = 32, 2, 64


@pytest.mark.parametrize("d,top_k,batch,summary_dtype", [
    (128, 32, 3, jnp.float32), (64, 8, 3, jnp.float32), (128, 32, 16, jnp.float32),
    (128, 32, 16, jnp.bfloat16), (64, 8, 3, jnp.bfloat16)])
def test_step_kernels_equal_the_reference_step(d, top_k, batch, summary_dtype):
  capacity = 1 << 15
  keys = jax.random.split(jax.random.key(d + top_k + batch), 4)
  k = jax.random.normal(keys[0], (batch, capacity, HKV, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (batch, capacity, HKV, d), jnp.bfloat16)
  q = jax.random.normal(keys[2], (batch, HQ, d), jnp.bfloat16)
  # Rows at a leaf's first key, mid-leaf, position 0, past 64 leaves, and the cache's last slot.
  lengths = np.asarray([capacity - 1, 5 * C + 17, 0, 64 * C, 1000, 3 * C][:batch]
                       + [int(x) for x in np.linspace(C, capacity - 1, max(batch - 6, 0))],
                       np.int32)
  cache = pisa_jax.DecodeCache.create(batch, capacity, HKV, d, block_size=C,
                                      summary_dtype=summary_dtype)
  cache = cache.prefill(k, v, jnp.asarray(lengths))
  positions = jnp.asarray(lengths)
  args = (q, k[:, 0] * 0.5, v[:, 0], cache.k, cache.v, cache.summaries, positions)
  opts = dict(block_size=C, branching=2, top_k=top_k, beam=top_k, selector="pisa",
              scale=d ** -0.5, summary_dtype=cache.summary_dtype)
  got = jax.jit(lambda *a: pisa_jax._dispatch.lookup("decode_step", "pallas")(*a, **opts))(*args)
  ref = jax.jit(lambda *a: dec.decode_step_reference(*a, **opts))(*args)
  got_idx, ref_idx = np.asarray(got[3]), np.asarray(ref[3])
  bad = np.argwhere(np.any(got_idx != ref_idx, axis=-1))
  assert not len(bad), f"rows (b, kv head) {bad.tolist()} select other blocks"
  np.testing.assert_allclose(np.asarray(got[4], np.float32), np.asarray(ref[4], np.float32),
                             atol=2e-2, rtol=2e-2)
  np.testing.assert_array_equal(np.asarray(got[5]), lengths + 1)
  # The updated pyramid: float32 means to float32 rounding; bfloat16 ones are float32 means
  # rounded once, so a sum in another order may round to the neighbouring bfloat16 value.
  tol = dict(atol=1e-5, rtol=0) if summary_dtype == jnp.float32 else dict(atol=1e-5, rtol=2 ** -7)
  assert got[2].dtype == ref[2].dtype == summary_dtype
  np.testing.assert_allclose(np.asarray(got[2], np.float32), np.asarray(ref[2], np.float32), **tol)


@pytest.mark.parametrize("attention", ["pisa", "dense", "nsa", "hils"])
def test_chunked_prefill_on_the_kernels_gives_the_one_pass_first_token(attention):
  # A 4-layer float32 decoder (C64, K8) on the GPU's kernels (the offset selection and attention
  # of `pisa_attention_at`), rows of 7,000 and 3,000 tokens read in chunks of 2,048 (32 blocks,
  # four times K; the last two chunks' row 1 reads nothing): the first token and logits of one
  # pass. The prompts pad to 8,192: dense's float32 one pass holds [2, 2, 8192, 8, 8192] scores.
  # NSA and HiLS (their defaults: l 32, d 16, l' 64, n 16, w 512; C 64, K 32, w 512): the one
  # pass on their kernels, the chunks and the steps on the jnp of their decode steps.
  import dataclasses

  from flax import nnx

  from pisa_jax.configs import get_config
  from pisa_jax.models.decoder import Decoder

  config = dataclasses.replace(get_config("small").model, num_layers=4, attention=attention,
                               compute_dtype="float32", attention_implementation="pallas")
  model = Decoder(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (7000, 3000)]
  kw = dict(max_new_tokens=4, return_logits=True)
  one = pisa_jax.generate(model, prompts, **kw)
  chunked = pisa_jax.generate(model, prompts, prefill_chunk=2048, **kw)
  np.testing.assert_array_equal(chunked.tokens, one.tokens)
  np.testing.assert_allclose(chunked.logits, one.logits, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("d", [64, 128])
def test_dense_decode_on_cudnn_equals_the_float32_step(d):
  # A bf16 cache takes cuDNN's fused attention over each row's first length + 1 keys; the same
  # cache in float32 takes the jnp step: rows at position 0, mid-cache, the last slot, and one
  # with no room left (NaN, its token dropped).
  from pisa_jax.models.decoder import KVCache, dense_decode_attention

  capacity, batch = 1 << 14, 4
  keys = jax.random.split(jax.random.key(d), 5)
  k = jax.random.normal(keys[0], (batch, capacity, HKV, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (batch, capacity, HKV, d), jnp.bfloat16)
  q = jax.random.normal(keys[2], (batch, 1, HQ, d), jnp.bfloat16)
  k1 = jax.random.normal(keys[3], (batch, 1, HKV, d), jnp.bfloat16)
  v1 = jax.random.normal(keys[4], (batch, 1, HKV, d), jnp.bfloat16)
  lengths = jnp.asarray([0, 5000, capacity - 1, capacity], jnp.int32)
  step = jax.jit(dense_decode_attention)
  got, cache = step(q, k1, v1, KVCache(k=k, v=v, lengths=lengths))
  want, _ = step(q.astype(jnp.float32), k1.astype(jnp.float32), v1.astype(jnp.float32),
                 KVCache(k=k.astype(jnp.float32), v=v.astype(jnp.float32), lengths=lengths))
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isnan(got[3]).all() and np.isnan(want[3]).all()
  np.testing.assert_allclose(got[:3], want[:3], atol=2e-2, rtol=2e-2)
  np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths) + 1)
  np.testing.assert_array_equal(np.asarray(cache.k[2, capacity - 1]), np.asarray(k1[2, 0]))
