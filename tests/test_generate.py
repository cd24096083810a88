"""Generation (`pisa_jax.generate`) against the full forward pass, and the `pisa-generate` CLI.

The contract: greedy generation with the cache gives exactly the tokens that a full forward pass
over the whole sequence would choose at every step (the argmax of its last position), and the
logits of the prefill and of every decode step equal that forward pass's to float32 rounding:
for a sparse (both implementations) and a dense model, on a batch of prompts of different
lengths, across a growth of the cache from one capacity bucket to the next.
"""

from __future__ import annotations

import dataclasses
import io
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pisa_jax
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.generation import PAD, DecodeModel, _sample, _steps
from pisa_jax.models.config import ModelConfig
from pisa_jax.models.decoder import Decoder
from pisa_jax.train.tokenizer import gpt2_bpe_path

from tolerances import OUTPUT_ATOL, OUTPUT_RTOL

# Two layers (each with its own cache), GQA groups of 2, leaves of 4 tokens and K = 4 (three
# forced blocks and one scored): from 16 tokens on, selection decides what a query sees.
MODEL = ModelConfig(vocab_size=64, vocab_pad_multiple=64, num_layers=2, d_model=64, mlp_dim=128,
                    num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, top_k=4, branching=2,
                    init_std=0.1, param_dtype="float32", compute_dtype="float32")
# Prompts of 27, 3 and 12 tokens (padded to 32), 30 new tokens each: the cache starts at 32 and
# grows to 64 when the longest row passes 32 tokens.
PROMPTS = [[(7 * i + 3) % 64 for i in range(27)], [5, 9, 1], [(11 * i) % 64 for i in range(12)]]
NEW_TOKENS = 30
INITIAL_CAPACITY = 32
CASES = [("pisa", "xla"), ("pisa", "pallas"), ("dense", "xla")] + [
    pytest.param(selector, "xla", marks=pytest.mark.slow) for selector in ("pisa1", "pisa2", "bsa")]


def _model(attention: str, implementation: str = "xla", **fields) -> Decoder:
  cfg = dataclasses.replace(MODEL, attention=attention, attention_implementation=implementation,
                            **fields)
  # One seed: every variant of a kind holds the same parameters.
  return Decoder(cfg, rngs=nnx.Rngs(0))


@jax.jit
def _forward(model, tokens):
  return model(tokens)


def _full_forward_per_step(model, prompts, generated: np.ndarray) -> np.ndarray:
  """float32 `[B, S, V]`: at step s, the forward pass over each whole sequence (prompt and the s
  tokens generated before) and the logits of its last position."""
  batch, steps = generated.shape
  width = max(map(len, prompts)) + steps
  out = []
  for s in range(steps):
    tokens = np.zeros((batch, width), np.int32)
    for b, prompt in enumerate(prompts):
      tokens[b, :len(prompt) + s] = list(prompt) + generated[b, :s].tolist()
    last = np.array([len(p) + s - 1 for p in prompts])
    out.append(np.asarray(_forward(model, jnp.asarray(tokens)))[np.arange(batch), last])
  return np.stack(out, axis=1)


@pytest.mark.parametrize("attention,implementation", CASES,
                         ids=lambda value: value)
def test_greedy_generation_is_the_full_forward_argmax(attention, implementation):
  model = _model(attention, implementation)
  compiled = _steps._cache_size()
  out = pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS,
                          initial_capacity=INITIAL_CAPACITY, return_logits=True,
                          steps_per_call=4)
  # One compile of the steps per capacity bucket (32, then 64), none per call or token.
  assert _steps._cache_size() - compiled == 2
  assert out.tokens.shape == (3, NEW_TOKENS) and out.lengths.tolist() == [NEW_TOKENS] * 3
  # The reference runs the jnp implementation on the same parameters.
  full = _full_forward_per_step(_model(attention, "xla"), PROMPTS, out.tokens)
  np.testing.assert_allclose(out.logits, full, atol=OUTPUT_ATOL[jnp.float32],
                             rtol=OUTPUT_RTOL[jnp.float32])
  np.testing.assert_array_equal(out.tokens, full.argmax(axis=-1))
  # Greedy choices are decided by more than rounding: no near-tie could have flipped one.
  top2 = np.sort(full, axis=-1)[..., -2:]
  assert (top2[..., 1] - top2[..., 0]).min() > 1e-4
  if attention != "dense":
    # The sparse model does select: the same parameters under dense attention, which sees every
    # key, give other logits (rows of up to 56 tokens: 14 blocks, K = 4).
    dense = _full_forward_per_step(_model("dense"), PROMPTS, out.tokens)
    assert np.abs(full - dense).max() > 1e-2


@pytest.fixture(scope="module")
def dense_greedy() -> pisa_jax.Generation:
  """The dense case's greedy generation (its compiled prefill and steps are shared)."""
  return pisa_jax.generate(_model("dense"), PROMPTS, max_new_tokens=NEW_TOKENS,
                           initial_capacity=INITIAL_CAPACITY)


def test_stop_tokens_end_their_rows_and_the_others_go_on(dense_greedy):
  model, free = _model("dense"), dense_greedy
  stop = int(free.tokens[1, 4])
  out = pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS,
                          initial_capacity=INITIAL_CAPACITY, stop_tokens=(stop,))
  assert out.tokens.shape[1] <= NEW_TOKENS
  for b in range(3):
    hits = np.flatnonzero(free.tokens[b] == stop)
    end = int(hits[0]) + 1 if hits.size else NEW_TOKENS
    assert out.lengths[b] == end and bool(out.stopped[b]) == bool(hits.size)
    np.testing.assert_array_equal(out.tokens[b, :end], free.tokens[b, :end])
    assert (out.tokens[b, end:] == PAD).all()
    assert out.sequences()[b] == free.tokens[b, :end].tolist()
  # Every row stops at its first token: one step, nothing after.
  first = tuple(sorted({int(t) for t in free.tokens[:, 0]}))
  out = pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS,
                          initial_capacity=INITIAL_CAPACITY, stop_tokens=first)
  assert out.tokens.shape == (3, 1) and out.stopped.all()
  np.testing.assert_array_equal(out.tokens[:, 0], free.tokens[:, 0])


@pytest.mark.parametrize("attention", ["dense", "pisa"])
def test_any_steps_per_call_generates_the_same_tokens_and_logits(attention, dense_greedy):
  # Calls of 1, 3 and 16 steps (a loop on the device that ends when every row has stopped): the
  # same tokens, logits and stops, whether the stop falls inside a call or at its end.
  model = _model(attention)
  free = dense_greedy if attention == "dense" else pisa_jax.generate(
      model, PROMPTS, max_new_tokens=NEW_TOKENS, initial_capacity=INITIAL_CAPACITY)
  stop = (int(free.tokens[1, 4]),)
  runs = [pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=stop,
                            initial_capacity=INITIAL_CAPACITY, return_logits=True,
                            steps_per_call=n) for n in (1, 3, 16)]
  for run in runs[1:]:
    np.testing.assert_array_equal(run.tokens, runs[0].tokens)
    np.testing.assert_array_equal(run.stopped, runs[0].stopped)
    live = runs[0].tokens != PAD
    np.testing.assert_allclose(run.logits[live], runs[0].logits[live], rtol=1e-6, atol=1e-6)
  assert runs[0].lengths[1] == 5 and runs[0].stopped[1]
  # Every row stops inside the first call: the stream ends there.
  first = tuple(sorted({int(t) for t in free.tokens[:, 1]} | {int(t) for t in free.tokens[:, 0]}))
  out = pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=first,
                          initial_capacity=INITIAL_CAPACITY, steps_per_call=16)
  assert out.tokens.shape[1] <= 2 and out.stopped.all()


def test_an_array_of_prompts_with_lengths_generates_as_the_list(dense_greedy):
  model, free = _model("dense"), dense_greedy
  padded = np.full((3, 29), 63, np.int32)
  for b, prompt in enumerate(PROMPTS):
    padded[b, :len(prompt)] = prompt
  out = pisa_jax.generate(model, padded, prompt_lengths=[27, 3, 12], max_new_tokens=NEW_TOKENS,
                          initial_capacity=INITIAL_CAPACITY)
  np.testing.assert_array_equal(out.tokens, free.tokens)


def test_sampling_is_deterministic_from_its_seed_and_a_tiny_top_p_is_greedy(dense_greedy):
  model = _model("dense")
  # Temperature and top_p are traced: these four runs share one compiled prefill and step.
  kw = dict(max_new_tokens=NEW_TOKENS, initial_capacity=64, temperature=1.5)
  a = pisa_jax.generate(model, PROMPTS, seed=3, **kw)
  b = pisa_jax.generate(model, PROMPTS, seed=3, **kw)
  c = pisa_jax.generate(model, PROMPTS, seed=4, **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert (a.tokens != c.tokens).any() and (a.tokens != dense_greedy.tokens).any()
  # Only the most likely token is in the nucleus: sampling picks it whatever the seed.
  nucleus = pisa_jax.generate(model, PROMPTS, seed=5, top_p=1e-6, **kw)
  np.testing.assert_array_equal(nucleus.tokens, dense_greedy.tokens)


def test_nucleus_sampling_draws_from_the_renormalised_head_of_the_distribution():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  draws = 20_000
  logits = jnp.tile(jnp.log(jnp.asarray(probs, jnp.float32)), (draws, 1))
  keys = jax.random.split(jax.random.key(0), draws)  # one key a row, as generate's rows
  for top_p, kept in ((0.7, 2), (0.85, 3), (1.0, 4)):
    tokens = np.asarray(_sample(logits, keys, 0, jnp.float32(1.0), jnp.float32(top_p),
                                greedy=False))
    freq = np.bincount(tokens, minlength=4) / draws
    want = np.where(np.arange(4) < kept, probs, 0.0)
    want /= want.sum()
    # Five standard deviations of a binomial frequency: a wrong nucleus is off by >= 0.05.
    np.testing.assert_allclose(freq, want, atol=5 * np.sqrt(0.25 / draws))
  # Temperature 0.5 squares the probabilities before renormalising.
  tokens = np.asarray(_sample(logits, keys, 0, jnp.float32(0.5), jnp.float32(1.0),
                              greedy=False))
  want = probs ** 2 / (probs ** 2).sum()
  np.testing.assert_allclose(np.bincount(tokens, minlength=4) / draws, want,
                             atol=5 * np.sqrt(0.25 / draws))


# Each kind's decoder at the sizes of its own tests: NSA's blocks of 8 at stride 4, a window of
# 6; HiLS's chunks of 4, top-2 and a window of 4. From ~16 tokens on, selection decides.
KINDS = {
    "pisa": dict(attention="pisa"),
    "dense": dict(attention="dense"),
    "nsa": dict(attention="nsa", nsa_block_length=8, nsa_stride=4, nsa_select_block_size=8,
                nsa_top_n=4, nsa_window=6),
    "hils": dict(attention="hils", hils_chunk_size=4, hils_top_k=2, hils_window=4,
                 hils_landmark_rank=4),
    "pisa-bf16-pyramid": dict(attention="pisa", summary_dtype="bfloat16"),
}


# NSA and HiLS: their generation equals the full forward pass row by row (test_nsa.py,
# test_hils.py); here ~13 s each.
@pytest.mark.parametrize("kind", ["pisa", "dense"] + [
    pytest.param(kind, marks=pytest.mark.slow) for kind in ("nsa", "hils")])
def test_each_row_of_a_ragged_batch_is_the_row_generated_alone(kind):
  # Rows of 27, 3 and 12 tokens padded to 32 in the batch, to 32 and 16 alone: neither the
  # padding nor the other rows reach a row's tokens.
  fields = dict(KINDS[kind])
  model = _model(fields.pop("attention"), **fields)
  kw = dict(max_new_tokens=8, initial_capacity=64, return_logits=True, steps_per_call=8)
  batch = pisa_jax.generate(model, PROMPTS, **kw)
  for b, prompt in enumerate(PROMPTS):
    alone = pisa_jax.generate(model, [prompt], **kw)
    np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0], err_msg=f"row {b}")
    np.testing.assert_allclose(batch.logits[b], alone.logits[0], atol=OUTPUT_ATOL[jnp.float32],
                               rtol=OUTPUT_RTOL[jnp.float32], err_msg=f"row {b}")


@pytest.mark.parametrize("kind", ["nsa", "hils"])
def test_kinds_trained_on_kernels_generate_as_on_the_reference(kind):
  # model.attention_implementation="pallas" (a run trained on the kernels): the prompt is read
  # on the kernels (interpret mode here), the steps on the decode step's one implementation.
  fields = dict(KINDS[kind])
  attention = fields.pop("attention")
  kw = dict(max_new_tokens=4, initial_capacity=64, return_logits=True, steps_per_call=4)
  kernels = pisa_jax.generate(_model(attention, "pallas", **fields), PROMPTS, **kw)
  reference = pisa_jax.generate(_model(attention, "xla", **fields), PROMPTS, **kw)
  np.testing.assert_array_equal(kernels.tokens, reference.tokens)
  np.testing.assert_allclose(kernels.logits, reference.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("attention,fields", [("dense", {}), ("pisa", {}),
                                              ("pisa", dict(summary_dtype="bfloat16"))],
                         ids=["dense", "pisa", "pisa-bf16-pyramid"])
def test_a_sampled_row_is_the_row_sampled_alone_with_its_key(attention, fields):
  model = _model(attention, **fields)
  kw = dict(max_new_tokens=NEW_TOKENS, initial_capacity=64, temperature=1.5, top_p=0.9)
  keys = jax.random.split(jax.random.key(8), 3)
  batch = pisa_jax.generate(model, PROMPTS, key=keys, **kw)
  for b, prompt in enumerate(PROMPTS):
    alone = pisa_jax.generate(model, [prompt], key=keys[b:b + 1], **kw)
    np.testing.assert_array_equal(batch.tokens[b], alone.tokens[0], err_msg=f"row {b}")
  # One key: row b draws from fold_in(key, b); a raw uint32 key is the same key.
  key = jax.random.key(7)
  one = pisa_jax.generate(model, PROMPTS, key=key, **kw)
  folded = jnp.stack([jax.random.fold_in(key, b) for b in range(3)])
  np.testing.assert_array_equal(one.tokens,
                                pisa_jax.generate(model, PROMPTS, key=folded, **kw).tokens)
  raw = pisa_jax.generate(model, PROMPTS, key=jax.random.key_data(key), **kw)
  np.testing.assert_array_equal(one.tokens, raw.tokens)
  assert (one.tokens != batch.tokens).any()  # the key is what decides


def _padded(prompts) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, :len(prompt)] = prompt
  return tokens, np.array([len(p) for p in prompts], np.int32)


@pytest.mark.parametrize("attention", ["pisa", "dense", "hils", "nsa"])
def test_chunked_prefill_gives_the_first_token_and_cache_of_one_pass(attention):
  # Prompts of 1,200, 700 and 5 tokens in 3 chunks of 512 (row 1 ends in the second, row 2 in
  # the first, reading nothing after): 300 leaf blocks of 4, selection over a 9-level pyramid
  # (HiLS: 300 chunks of 4, each chunk's landmark pooled in the prefill chunk it ends in; NSA:
  # compressed blocks of 8 every 4 tokens, those that straddle two chunks included).
  from pisa_jax import generation

  fields = dict(KINDS[attention])
  model = _model(fields.pop("attention"), **fields)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 64, n).tolist() for n in (1200, 700, 5)]
  tokens, lengths = _padded(prompts)
  leaves, treedef = jax.tree.flatten(model)
  scalars = (jax.random.split(jax.random.key(0), 3), jnp.float32(1), jnp.float32(1),
             jnp.full((8,), PAD, jnp.int32))
  capacity = 2048
  width = generation._bucket(1200)
  padded = np.zeros((3, width), np.int32)
  padded[:, :tokens.shape[1]] = tokens
  token, _, state, logits = generation._prefill(treedef, leaves, jnp.asarray(padded),
                                                jnp.asarray(lengths), None, *scalars,
                                                capacity=capacity, greedy=True)
  chunked_token, _, chunked_state, chunked_logits = generation._chunked_prefill(
      model, treedef, leaves, np.pad(tokens, ((0, 0), (0, 3 * 512 - 1200))), lengths, scalars,
      chunk=512, capacity=capacity, greedy=True)
  np.testing.assert_allclose(chunked_logits, logits, atol=OUTPUT_ATOL[jnp.float32],
                             rtol=OUTPUT_RTOL[jnp.float32])
  np.testing.assert_array_equal(chunked_token, token)
  top2 = np.sort(np.asarray(logits), axis=-1)[:, -2:]
  assert (top2[:, 1] - top2[:, 0]).min() > 1e-4  # no near-tie
  # Every layer's cache: keys, values, the pyramid (sparse) and the lengths.
  for layer, (one, chunked) in enumerate(zip(state, chunked_state, strict=True)):
    assert jax.tree.structure(one) == jax.tree.structure(chunked)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(chunked), strict=True):
      np.testing.assert_allclose(b, a, atol=OUTPUT_ATOL[jnp.float32],
                                 rtol=OUTPUT_RTOL[jnp.float32], err_msg=f"layer {layer}")
    np.testing.assert_array_equal(chunked.lengths, lengths)


@pytest.mark.parametrize("attention", ["pisa", "dense", "hils", "nsa", "pisa-bf16-pyramid"])
def test_generation_with_chunks_of_any_size_equals_one_pass(attention):
  # Chunks of 7 (leaf blocks or HiLS chunks of 4 cut anywhere) and one chunk covering every
  # prompt; the PISA pyramid in float32 and in bfloat16.
  fields = dict(KINDS[attention])
  model = _model(fields.pop("attention"), **fields)
  kw = dict(max_new_tokens=12, initial_capacity=64, return_logits=True)
  one = pisa_jax.generate(model, PROMPTS, **kw)
  for chunk in (7, 64):
    out = pisa_jax.generate(model, PROMPTS, prefill_chunk=chunk, **kw)
    np.testing.assert_array_equal(out.tokens, one.tokens, err_msg=f"chunk {chunk}")
    np.testing.assert_allclose(out.logits, one.logits, atol=OUTPUT_ATOL[jnp.float32],
                               rtol=OUTPUT_RTOL[jnp.float32], err_msg=f"chunk {chunk}")


def test_a_chunk_wider_than_every_prompt_is_cut_to_one_pass_width(monkeypatch):
  """prefill_chunk=4096 for prompts of up to 27 tokens: one chunk of one pass's width (32), not
  4,096 padded tokens and a cache of 4,096."""
  from pisa_jax import generation

  seen = []
  chunk_call, empty_state = generation._prefill_chunk, generation._empty_state

  def spy_chunk(model_def, model_leaves, tokens, *rest):
    seen.append(("chunk", tokens.shape[1]))
    return chunk_call(model_def, model_leaves, tokens, *rest)

  def spy_state(model_def, model_leaves, *, batch, capacity):
    seen.append(("capacity", capacity))
    return empty_state(model_def, model_leaves, batch=batch, capacity=capacity)

  monkeypatch.setattr(generation, "_prefill_chunk", spy_chunk)
  monkeypatch.setattr(generation, "_empty_state", spy_state)
  model = _model("dense")
  out = pisa_jax.generate(model, PROMPTS, max_new_tokens=4, prefill_chunk=4096)
  assert seen == [("capacity", 32), ("chunk", 32)]
  one = pisa_jax.generate(model, PROMPTS, max_new_tokens=4)
  np.testing.assert_array_equal(out.tokens, one.tokens)


def test_stop_tokens_may_be_any_iterable(dense_greedy):
  model, free = _model("dense"), dense_greedy
  stop = int(free.tokens[1, 4])
  want = pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS,
                           initial_capacity=INITIAL_CAPACITY, stop_tokens=(stop,))
  for given in ({stop}, iter([stop]), (t for t in [stop]), {stop: None}.keys()):
    out = pisa_jax.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS,
                            initial_capacity=INITIAL_CAPACITY, stop_tokens=given)
    np.testing.assert_array_equal(out.tokens, want.tokens)
    np.testing.assert_array_equal(out.stopped, want.stopped)
  assert want.stopped.any()


def test_ids_past_the_vocabulary_are_never_drawn_nor_returned():
  """vocab_size=50 in a table padded to 64 rows: at any temperature every token is below 50,
  and the logits are the 50 ids'."""
  model = _model("dense", vocab_size=50)
  out = pisa_jax.generate(model, [[1, 2, 3], [4]], max_new_tokens=40, temperature=1e9,
                          seed=0, return_logits=True)
  assert out.tokens.max() < 50 and out.tokens.min() >= 0
  assert out.logits.shape == (2, 40, 50)
  # Nearly uniform at this temperature: ids from the whole range are drawn.
  assert len(np.unique(out.tokens)) > 25


def test_chunked_prefill_is_refused_where_the_model_has_none():
  model = _model("dense")
  with pytest.raises(TypeError, match="prefill_chunk needs a model with a prefill_chunk method"):
    pisa_jax.generate(_NoChunks(model), PROMPTS, max_new_tokens=2, prefill_chunk=8)


class _NoChunks(nnx.Module):
  """A decoder's DecodeModel methods without prefill_chunk."""

  def __init__(self, model):
    self.model = model
    self.vocab_size = model.vocab_size

  def init_decode_state(self, batch, capacity):
    return self.model.init_decode_state(batch, capacity)

  def grow_decode_state(self, state, capacity):
    return self.model.grow_decode_state(state, capacity)

  def prefill(self, tokens, lengths, state):
    return self.model.prefill(tokens, lengths, state)

  def decode(self, tokens, state):
    return self.model.decode(tokens, state)


@pytest.mark.parametrize("prompts,kw,pattern", [
    ([], {}, "prompt_tokens is empty"),
    (np.zeros((0, 4), np.int32), {}, "prompt_tokens is empty"),
    ([[1, 2], []], {}, r"prompt_tokens\[1\] is empty"),
    ([1, 2, 3], {}, "list of token sequences"),
    ([[1, 64]], {}, r"prompt_tokens\[0\]\[1\]=64 is not a token id"),
    ([[1, -1]], {}, r"prompt_tokens\[0\]\[1\]=-1"),
    ([[1.5]], {}, r"prompt_tokens\[0\] must be a sequence of ints"),
    (np.ones((2, 4), np.int32), {"prompt_lengths": [4, 5]}, "prompt_lengths"),
    (np.ones((2, 4), np.int32), {"prompt_lengths": [4, 0]}, r"prompt_tokens\[1\] is empty"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens=0"),
    ([[1]], {"max_new_tokens": 2.0}, "max_new_tokens=2.0"),
    ([[1]], {"temperature": -0.5}, "temperature=-0.5"),
    ([[1]], {"temperature": float("nan")}, "temperature=nan"),
    ([[1]], {"top_p": 0.0}, "top_p=0.0"),
    ([[1]], {"top_p": 1.5}, "top_p=1.5"),
    ([[1]], {"stop_tokens": 3}, "stop_tokens=3"),
    ([[1]], {"stop_tokens": (64,)}, "stop_tokens"),
    ([[1]], {"seed": 1.0}, "seed=1.0"),
    ([[1]], {"seed": 1, "key": jax.random.key(1)}, "give key= or seed=, not both"),
    ([[1], [2]], {"key": jax.random.split(jax.random.key(1), 3)}, r"key must be .* \[B\] = \[2\]"),
    ([[1]], {"key": 7}, "key must be one jax.random.key"),
    ([[1]], {"prefill_chunk": 0}, "prefill_chunk=0 must be an int >= 1"),
    (np.ones((1, 4), np.int32), {"prefill_chunk": 2, "prompt_segment_ids": np.zeros((1, 4), int)},
     "prefill_chunk .* does not take prompt_segment_ids"),
    ([[1]], {"initial_capacity": 0}, "initial_capacity=0"),
    ([[1]], {"steps_per_call": 0}, "steps_per_call=0 must be an int >= 1"),
])
def test_bad_arguments_name_themselves(prompts, kw, pattern):
  kw = {"max_new_tokens": 4, **kw}
  with pytest.raises(ValueError, match=pattern):
    pisa_jax.generate(_model("dense"), prompts, **kw)


def test_a_model_without_the_protocol_is_a_type_error():
  with pytest.raises(TypeError, match="DecodeModel: object has no vocab_size, init_decode_state"):
    pisa_jax.generate(object(), [[1]], max_new_tokens=1)
  assert isinstance(_model("dense"), DecodeModel)


# ----------------------------------------------------------------------------- the CLI

# A one-layer model trained for two steps: enough for a checkpoint that restores. Dense, as its
# training step compiles in a fraction of a sparse one's; generation is the same code for both.
TINY_RUN = [
    "model.attention=dense",
    "model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "model.num_heads=4",
    "model.num_kv_heads=2", "model.head_dim=16", "model.block_size=4", "model.top_k=4",
    "data.mqar_num_pairs=4", "train.seq_len=32", "train.per_device_batch=2", "train.grad_accum=1",
    "train.steps=2", "train.warmup_steps=1", "train.decay_steps=1", "train.checkpoint_every=2",
    "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  from pisa_jax.train.trainer import train

  workdir = tmp_path_factory.mktemp("run")
  config = validate(apply_overrides(get_config("tiny"), TINY_RUN))
  train(config, workdir, progress=False, quiet=True)
  return workdir


class _Stdout(io.StringIO):
  """stdout that records what had been written at each flush."""

  def __init__(self):
    super().__init__()
    self.flushed: list[str] = []

  def flush(self):
    self.flushed.append(self.getvalue())


# The CLI reads text through the GPT-2 BPE file (CI installs it with `pip install --no-deps
# openai-whisper==20250625`); without it these tests skip).
needs_bpe = pytest.mark.skipif(
    gpt2_bpe_path() is None,
    reason="gpt2.tiktoken absent: pip install --no-deps openai-whisper==20250625",
)


@needs_bpe
def test_the_cli_streams_the_greedy_continuation(tiny_run, monkeypatch):
  from pisa_jax.train import generate as cli
  from pisa_jax.train.tokenizer import gpt2_encoding

  # "1+1=" is GPT-2 tokens [16, 10, 16, 28], all inside the tiny model's 64-token vocabulary.
  prompt = "1+1="
  stdout = _Stdout()
  monkeypatch.setattr(sys, "stdout", stdout)
  assert cli.main(["--workdir", str(tiny_run), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
  _, model, _ = cli.restore_model(tiny_run)
  want = pisa_jax.generate(model, [gpt2_encoding().encode_ordinary(prompt)], max_new_tokens=6)
  text = gpt2_encoding().decode(want.sequences()[0])
  assert stdout.getvalue() == text + "\n"
  # Streamed: a flush after every token, each showing the text so far.
  assert len(stdout.flushed) >= 6
  assert all(text.startswith(flushed.rstrip("\n")) for flushed in stdout.flushed)


@needs_bpe
def test_the_cli_generates_a_file_of_prompts_as_one_ragged_batch(tiny_run, tmp_path, capsys):
  import json

  from pisa_jax.train import generate as cli
  from pisa_jax.train.tokenizer import gpt2_encoding

  # GPT-2 tokens inside the tiny model's 64-token vocabulary: "1+1=" [16, 10, 16, 28], "2+"
  # [17, 10]; "=" (28) stops a row.
  file = tmp_path / "prompts.jsonl"
  file.write_text('"1+1="\n{"prompt": "2+"}\n')
  argv = ["--workdir", str(tiny_run), "--prompt-file", str(file), "--max-new-tokens", "8",
          "--prefill-chunk", "2", "--stop", "=", "--temperature", "1", "--seed", "3"]
  assert cli.main(argv) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  _, model, _ = cli.restore_model(tiny_run)
  encoding = gpt2_encoding()
  rows = [encoding.encode_ordinary(p) for p in ("1+1=", "2+")]
  want = pisa_jax.generate(model, rows, max_new_tokens=8, stop_tokens=(28,), temperature=1.0,
                           seed=3, prefill_chunk=2)
  assert [line["prompt"] for line in lines] == ["1+1=", "2+"]
  for line, tokens, stopped in zip(lines, want.sequences(), want.stopped):
    text = encoding.decode(tokens[:-1] if stopped else tokens)
    assert line == {"prompt": line["prompt"], "completion": text, "new_tokens": len(tokens),
                    "stopped": bool(stopped)}


@needs_bpe
def test_cli_mistakes_are_one_line_naming_the_argument(tiny_run, tmp_path, capsys):
  from pisa_jax.train import generate as cli

  def fails(argv, pattern, status=2):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    assert e.value.code == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pisa-generate: error: "), err
    assert re.search(pattern, err), err

  run = ["--workdir", str(tiny_run)]
  fails(["--workdir", str(tmp_path), "--prompt", "1+1="], "--workdir: .* no checkpoint")
  fails(run + ["--prompt", ""], "--prompt: empty")
  fails(run + ["--prompt", "1+" * 20], r"--prompt: 40 tokens exceed the model's context of 32")
  fails(run + ["--prompt", "1+1=", "--max-new-tokens", "40"],
        r"--max-new-tokens=40: .* exceed the model's context of 32")
  fails(run + ["--prompt", "hello"], r"--prompt: token 'hello' \(id \d+\) is outside")
  fails(run + ["--prompt", "1", "--temperature", "-1"], "argument --temperature")
  fails(run + ["--prompt", "1", "--top-p", "0"], "argument --top-p")
  fails(run + ["--prompt", "1", "--max-new-tokens", "0"], "argument --max-new-tokens")
  fails(run + ["--prompt", "1", "--steps-per-call", "0"], "argument --steps-per-call")
  fails(run + ["--prompt", "1", "--stop", "1+1"], r"--stop='1\+1' must be one token .* 3 tokens")
  fails(run + ["--prompt", "1", "--stop", ""], "--stop: empty")
  long = tmp_path / "long.txt"
  long.write_text("1+1=\n" + "1+" * 20 + "\n")
  fails(run + ["--prompt-file", str(long)],
        r"--prompt-file: prompt 2: 40 tokens exceed the model's context of 32")
  fails(["--prompt", "1"], "--workdir")
  fails(run + ["--prompt", "1", "--summary-dtype", "bfloat16"],
        r"--summary-dtype: summary_dtype='bfloat16': the run's model.attention='dense' has no "
        r"PISA pyramid")
  fails(run + ["--prompt", "1", "--summary-dtype", "float16"], "argument --summary-dtype")


def test_a_pisa_run_restores_with_a_bfloat16_pyramid(tmp_path):
  """restore_model(summary_dtype=...): the run's parameters, the pyramid's dtype chosen for
  inference; its generation reads the pyramid in that dtype."""
  from pisa_jax.train import restore
  from pisa_jax.train.trainer import train

  config = validate(apply_overrides(get_config("tiny"), TINY_RUN + ["model.attention=pisa"]))
  train(config, tmp_path, progress=False, quiet=True)
  _, f32, _ = restore.restore_model(tmp_path)
  cfg, bf16, _ = restore.restore_model(tmp_path, summary_dtype="bfloat16")
  assert f32.cfg.summary_dtype == "float32" and cfg.model.summary_dtype == "bfloat16"
  assert bf16.cfg.summary_dtype == "bfloat16"
  for a, b in zip(jax.tree.leaves(nnx.state(f32, nnx.Param)),
                  jax.tree.leaves(nnx.state(bf16, nnx.Param)), strict=True):
    np.testing.assert_array_equal(a, b)
  state = bf16.init_decode_state(1, 64)
  assert {x.summaries.dtype for x in state} == {jnp.dtype(jnp.bfloat16)}
  out = pisa_jax.generate(bf16, [[1, 2, 3, 4, 5]], max_new_tokens=3)
  assert out.tokens.shape == (1, 3)


@needs_bpe
def test_corrupt_checkpoints_are_reported_without_advice_to_delete(tiny_run, tmp_path, capsys):
  import shutil

  from pisa_jax.train import generate as cli

  run = tmp_path / "run"
  shutil.copytree(tiny_run, run)
  for step_dir in (run / "checkpoints").iterdir():
    if step_dir.name.isdigit():
      path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                 key=lambda p: p.stat().st_size)
      data = bytearray(path.read_bytes())
      data[len(data) // 2] ^= 0x01
      path.write_bytes(bytes(data))
  before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
  assert cli.main(["--workdir", str(run), "--prompt", "1+1="]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("pisa-generate: error: no checkpoint in "), err
  assert re.search(r"passes its checksums \(2: \S+ does not match its checksum\); nothing was "
                   r"read or changed\. If pisa-train is still writing this run, wait for its "
                   r"next checkpoint; otherwise .* copy the run's checkpoints again", err), err
  assert "delete" not in err and "start over" not in err
  assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_the_prefill_lowers_each_kernel_once_whatever_the_depth(captured, monkeypatch):
  # The layers are scanned: a deeper model adds no Pallas call site to the compiled prefill
  # (XLA compiles each call site's Triton module on its own, ~1 s apiece on the H200).
  import importlib
  generate_module = importlib.import_module("pisa_jax.generation")
  monkeypatch.setattr(pisa_jax._dispatch, "interpret_mode", lambda: False)
  counts = []
  for layers in (1, 3):
    cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=64, num_layers=layers, d_model=64,
                      mlp_dim=128, num_heads=4, num_kv_heads=2, head_dim=16, attention="pisa",
                      block_size=16, top_k=4, param_dtype="float32",
                      attention_implementation="pallas")
    leaves, treedef = jax.tree.flatten(Decoder(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    scalars = (jax.random.split(jax.random.key(0), 1), jnp.float32(1), jnp.float32(1),
               jnp.full((8,), -1, jnp.int32))
    lowered = generate_module._prefill.trace(
        treedef, leaves, tokens, lengths, None, *scalars, capacity=512, greedy=True,
    ).lower(lowering_platforms=("cuda",))
    counts.append(lowered.as_text().count("__gpu$xla.gpu.triton"))
  assert counts[0] == counts[1] >= 3, counts


@pytest.mark.parametrize("attention,implementation", [("pisa", "xla"), ("pisa", "pallas"),
                                                      ("dense", "xla")])
def test_the_jitted_step_has_no_effects(attention, implementation):
  # An effect (a traced check) takes a jitted function off jax's C++ dispatch: each generated
  # token then paid milliseconds of Python (3x slower generation on the H200).
  model = _model(attention, implementation)
  leaves, treedef = jax.tree.flatten(model)
  state = jax.eval_shape(lambda: model.init_decode_state(2, 32))
  token = jax.ShapeDtypeStruct((2,), jnp.int32)
  done = jax.ShapeDtypeStruct((2,), jnp.bool_)
  scalars = (jax.random.split(jax.random.key(0), 2), jnp.float32(1), jnp.float32(1),
             jnp.full((8,), -1, jnp.int32))
  opts = dict(greedy=True, chunk=4, with_logits=False)
  traced = _steps.trace(treedef, leaves, token, done, state, jnp.int32(1), jnp.int32(4),
                        *scalars, **opts)
  assert not traced.jaxpr.effects, traced.jaxpr.effects
  with pisa_jax.traced_checks(True):
    if attention == "pisa":  # the capacity check is traced, and is an effect
      assert _steps.trace(treedef, leaves, token, done, state, jnp.int32(1), jnp.int32(4),
                          *scalars, **opts).jaxpr.effects
