"""Packed documents on the decode path: `DecodeCache.prefill(..., segment_ids=...)` and
`decode_step(..., new_document=...)`.

The contract: a packed prompt leaves each row's last document in the cache, exactly as a prefill
of that document alone; decoding a packed sequence token by token, starting a new document at
each boundary, selects the blocks and outputs the rows of `select_blocks` / `sparse_attention`
with the same `segment_ids` (each document's own block numbers, nothing across a boundary).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pisa_jax
from pisa_jax.decode import DecodeCache, decode_step

from tolerances import OUTPUT_ATOL, OUTPUT_RTOL, PYRAMID_ATOL

IMPLS = ("xla", "pallas")
BLOCK, HQ, HKV, D, TOP_K = 8, 4, 2, 16, 3


def _ids(doc_lengths) -> np.ndarray:
  """int32 segment ids of documents of these lengths, in order."""
  return np.repeat(np.arange(len(doc_lengths)), doc_lengths).astype(np.int32)


def _qkv(seed, batch, seq_len):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (batch, seq_len, HQ, D), jnp.float32)
  k = jax.random.normal(kk, (batch, seq_len, HKV, D), jnp.float32)
  # Some keys scaled up so that block scores are rarely near-ties.
  k = k * jnp.where(jax.random.uniform(kk, (batch, seq_len, HKV, 1)) < 0.05, 3.0, 1.0)
  v = jax.random.normal(kv, (batch, seq_len, HKV, D), jnp.float32)
  return q, k, v


def test_packed_prefill_is_the_last_document_alone():
  # Row 0: the last document starts mid-block and fills the row; row 1: its valid prefix ends
  # inside its second document (later ids are padding); row 2: a last document of one token;
  # row 3: empty.
  t = 70
  ids = np.stack([_ids([13, 2, 55]), _ids([20, 30, 20]), _ids([69, 1]), _ids([70])])
  lengths = np.array([70, 45, 70, 0], np.int32)
  _, k, v = _qkv(1, 4, t)
  cache = DecodeCache.create(4, 96, HKV, D, block_size=BLOCK, dtype=jnp.float32)
  got = cache.prefill(k, v, jnp.asarray(lengths), segment_ids=jnp.asarray(ids))
  for b, start in enumerate([15, 20, 69, 0]):
    n = int(lengths[b]) - start
    alone = DecodeCache.create(1, 96, HKV, D, block_size=BLOCK, dtype=jnp.float32).prefill(
        k[b:b + 1, start:start + n], v[b:b + 1, start:start + n])
    assert int(got.lengths[b]) == n
    np.testing.assert_array_equal(got.k[b, :n], alone.k[0, :n])
    np.testing.assert_array_equal(got.v[b, :n], alone.v[0, :n])
    for level, ref in zip(got.levels(), alone.levels()):
      np.testing.assert_allclose(level[b], ref[0], atol=PYRAMID_ATOL, rtol=0)


@functools.partial(jax.jit, static_argnames=("implementation",))
def _decode_packed(q, k, v, new_document, cache, *, implementation):
  """Steps through tokens P .. T-1 of every row, `new_document[:, t]` starting a document."""
  rows = jnp.arange(q.shape[0])
  start = q.shape[1] - new_document.shape[1]

  def body(cache, t):
    take = lambda x: x[rows, start + t][:, None]
    out, cache, idx = decode_step(take(q), take(k), take(v), cache, new_document=new_document[:, t],
                                  top_k=TOP_K, return_indices=True, implementation=implementation)
    return cache, (out[:, 0], idx[:, 0])

  _, (out, idx) = lax.scan(body, cache, jnp.arange(new_document.shape[1]))
  return jnp.swapaxes(out, 0, 1), jnp.swapaxes(idx, 0, 1)


@pytest.mark.parametrize("implementation", IMPLS)
def test_packed_decode_matches_the_packed_reference(implementation):
  # Documents of 1 token, shorter than a block, starting and ending mid-block, and long enough
  # (up to 9 leaves) that the walk scores its levels; the prefill cuts row 0 inside a document
  # and row 1 exactly at a boundary.
  ids = np.stack([_ids([1, 5, 40, 1, 70, 3, 30]), _ids([37, 11, 1, 1, 60, 40])])
  t, prefill = ids.shape[1], 48
  q, k, v = _qkv(2, 2, t)
  seg = jnp.asarray(ids)
  ref_idx = pisa_jax.select_blocks(q, k, block_size=BLOCK, top_k=TOP_K, segment_ids=seg,
                                   implementation="xla")
  ref_out = pisa_jax.sparse_attention(q, k, v, ref_idx, block_size=BLOCK, segment_ids=seg,
                                      implementation="xla")
  cache = DecodeCache.create(2, 16, HKV, D, block_size=BLOCK, dtype=jnp.float32)
  cache = cache.prefill(k[:, :prefill], v[:, :prefill], segment_ids=seg[:, :prefill])
  cache = cache.grow(t)  # the scan runs under jit: room for every token first
  starts = np.concatenate([np.ones((2, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  out, idx = _decode_packed(q, k, v, jnp.asarray(starts[:, prefill:]), cache,
                            implementation=implementation)
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx[:, prefill:]))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out[:, prefill:]),
                             atol=OUTPUT_ATOL[jnp.float32], rtol=OUTPUT_RTOL[jnp.float32])


def test_new_document_restarts_a_row_eagerly():
  # Outside jit: a reset row needs room for one token only, and the other row keeps going.
  q, k, v = _qkv(3, 2, 9)
  cache = DecodeCache.create(2, 8, HKV, D, block_size=BLOCK, dtype=jnp.float32, growable=False)
  cache = cache.prefill(k[:, :8], v[:, :8], jnp.array([8, 3], jnp.int32))
  step = lambda x: x[:, 8:9]
  out, cache = decode_step(step(q), step(k), step(v), cache, new_document=jnp.array([True, False]),
                           top_k=TOP_K, implementation="xla")
  np.testing.assert_array_equal(np.asarray(cache.lengths), [1, 4])
  # Row 0's token alone sees only itself: its output is its own value, every head.
  np.testing.assert_allclose(np.asarray(out[0, 0]),
                             np.repeat(np.asarray(v[0, 8]), HQ // HKV, axis=0), atol=1e-6)


def test_packed_decode_bad_input():
  _, k, v = _qkv(4, 2, 16)
  cache = DecodeCache.create(2, 16, HKV, D, block_size=BLOCK, dtype=jnp.float32)
  with pytest.raises(ValueError, match="segment_ids must be non-decreasing"):
    cache.prefill(k, v, segment_ids=jnp.asarray(np.stack([_ids([8, 8]), _ids([8, 8])[::-1]])))
  with pytest.raises(ValueError, match=r"segment_ids.shape=\(2, 15\)"):
    cache.prefill(k, v, segment_ids=jnp.zeros((2, 15), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids must be an int32"):
    cache.prefill(k, v, segment_ids=jnp.zeros((2, 16), jnp.float32))
  q1 = jnp.zeros((2, 1, HQ, D), jnp.float32)
  kv1 = jnp.zeros((2, 1, HKV, D), jnp.float32)
  for bad in (jnp.array([1, 0]), jnp.array([True]), [True, False]):
    with pytest.raises(ValueError, match="new_document must be a bool array"):
      decode_step(q1, kv1, kv1, cache, new_document=bad)


# ----------------------------------------------------------------------------- generation


@pytest.mark.parametrize("attention", ["pisa", "dense"])
def test_generation_continues_the_last_document(attention):
  """A packed prompt generates what its last document alone generates: same tokens, same
  logits (positions restart at the document, nothing of the earlier ones is seen)."""
  from flax import nnx

  from pisa_jax.models.config import ModelConfig
  from pisa_jax.models.decoder import Decoder

  cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=64, num_layers=2, d_model=64, mlp_dim=128,
                    num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, top_k=4,
                    init_std=0.1, param_dtype="float32", compute_dtype="float32",
                    attention=attention, attention_implementation="xla")
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  # Row 0: documents of 9, 1 and 14 tokens; row 1: 5 and 6 tokens, then padding.
  tokens = rng.integers(0, 64, size=(2, 24))
  ids = np.stack([_ids([9, 1, 14]), _ids([5, 6, 13])])
  lengths = np.array([24, 11])
  packed = pisa_jax.generate(model, tokens, prompt_lengths=lengths, prompt_segment_ids=ids,
                             max_new_tokens=12, return_logits=True)
  alone = pisa_jax.generate(model, [tokens[0, 10:24], tokens[1, 5:11]], max_new_tokens=12,
                            return_logits=True)
  np.testing.assert_array_equal(packed.tokens, alone.tokens)
  np.testing.assert_allclose(packed.logits, alone.logits, atol=1e-4, rtol=1e-4)
  with pytest.raises(ValueError, match="prompt_segment_ids must be non-decreasing"):
    pisa_jax.generate(model, tokens, prompt_segment_ids=ids[:, ::-1], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"prompt_segment_ids must be ints \[B, T\]"):
    pisa_jax.generate(model, tokens, prompt_segment_ids=ids[:, :5], max_new_tokens=2)
