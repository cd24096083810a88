"""HiLS (`pisa_jax.hils`): the jnp reference against a float64 loop of its rules
(`oracles.hils`), its gradients against finite differences of that loop, causality, packed
documents against each document alone, and bad arguments."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import hils
import oracles
import tolerances

# (batch, T, HQ, HKV, D, chunk, top_k, window): T not a multiple of C, GQA groups 2, 3 and 1,
# top_k below and above the eligible chunks, window 1 (the current chunk only), T < C.
CASES = [
    (2, 45, 4, 2, 8, 4, 3, 6),
    (1, 37, 3, 1, 8, 5, 2, 1),
    (1, 30, 2, 2, 4, 4, 8, 9),
    (1, 3, 2, 1, 4, 4, 2, 2),
]


def case_id(case):
  b, t, hq, hkv, d, c, k, w = case
  return f"B{b}-T{t}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{k}-W{w}"


def make_inputs(batch, seq_len, hq, hkv, d, seed=0, dtype=jnp.float32):
  kq, kk, kv, kl = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (batch, seq_len, hq, d), dtype)
  k = jax.random.normal(kk, (batch, seq_len, hkv, d), dtype)
  v = jax.random.normal(kv, (batch, seq_len, hkv, d), dtype)
  lq = jax.random.normal(kl, (batch, seq_len, hq, d), dtype)
  return q, k, v, lq


def options(case):
  _, _, _, _, d, c, k, w = case
  return dict(chunk_size=c, top_k=k, window=w), 1 / math.sqrt(d)


def oracle_rows(q, k, v, lq, segment_ids=None, **kw):
  rows = [oracles.hils(q[b], k[b], v[b], lq[b],
                       segment_ids=None if segment_ids is None else segment_ids[b], **kw)
          for b in range(q.shape[0])]
  return (np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]), [r[2] for r in rows])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_float64_oracle(case):
  b, t, hq, hkv, d, _, top_k, _ = case
  opts, scale = options(case)
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=1)
  out = pisa_jax.hils_attention(q, k, v, lq, **opts)
  idx = pisa_jax.hils_select_chunks(q, k, lq, **opts)
  want_out, want_idx, _ = oracle_rows(q, k, v, lq, scale=scale, **opts)
  np.testing.assert_array_equal(np.asarray(idx), want_idx)
  np.testing.assert_allclose(np.asarray(out), want_out, atol=tolerances.GOLDEN_OUTPUT_ATOL,
                             rtol=tolerances.GOLDEN_OUTPUT_ATOL)
  assert out.dtype == q.dtype and out.shape == q.shape


def test_reference_on_given_chunks():
  """The reference attends the chunks it is given (a kernel's test compares both sides on the
  same chunks): its own chunks, in any order, give its output; other chunks change it."""
  b, t, hq, hkv, d, _, top_k, _ = CASES[0]
  opts, scale = options(CASES[0])
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=3)
  run = lambda chunks: hils._run_queries(q, k, v, lq, None, scale=scale, chunks=chunks,
                                         **opts)[0]
  own = pisa_jax.hils_select_chunks(q, k, lq, **opts)  # ascending, the reference's set
  for chunks in (own, own[..., ::-1]):  # the order changes only the summation order
    np.testing.assert_allclose(np.asarray(run(chunks)), np.asarray(run(None)), rtol=1e-6,
                               atol=1e-6)
  fewer = own.at[..., 0].set(-1)
  changed = np.any(np.asarray(run(fewer)) != np.asarray(run(None)), axis=-1)
  dropped = np.asarray(own[..., 0] >= 0)  # [B, T, HKV]: rows that lost a chunk
  assert changed.reshape(b, t, hkv, -1).any(-1)[dropped].all()


def test_landmarks_and_chunk_scores_match_oracle():
  case = CASES[0]
  b, t, hq, hkv, d, c, _, w = case
  opts, scale = options(case)
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=2)
  landmark_k, landmark_bias = pisa_jax.hils_landmarks(k, lq, chunk_size=c)
  group = hq // hkv
  for row in range(b):
    for slot in range(t // c):
      for hh in range(hq):
        lo = slot * c
        want_k, want_b = oracles.hils_landmark(
            np.asarray(k[row, lo:lo + c, hh // group], np.float64),
            np.asarray(lq[row, lo + c - 1, hh], np.float64), scale)
        np.testing.assert_allclose(landmark_k[row, slot, hh], want_k, atol=1e-5)
        np.testing.assert_allclose(landmark_bias[row, slot, hh], want_b, atol=1e-5)
  scores = np.asarray(pisa_jax.hils_chunk_scores(lq, landmark_k, landmark_bias, chunk_size=c,
                                                 window=w))
  _, _, want = oracle_rows(q, k, v, lq, scale=scale, **opts)
  for row in range(b):
    for (pos, hh), s_hat in want[row].items():
      n = len(s_hat)
      np.testing.assert_allclose(scores[row, pos, hh, :n], s_hat, atol=1e-5)
      assert np.all(np.isneginf(scores[row, pos, hh, n:]))


def _directional(f, x, direction, eps=1e-5):
  return (f(x + eps * direction) - f(x - eps * direction)) / (2 * eps)


def test_gradients_match_oracle_finite_differences():
  """d<w, out> along a random direction of q, k, v, landmark_q and of a low-rank landmark
  projection lq = q + (x A) B, from jax.grad of the reference and from central differences of
  the float64 loop. The selection is piecewise constant: the differences do not cross it."""
  case = CASES[0]
  _, _, hq, hkv, d, _, _, _ = case
  t = 29  # 5 chunks precede the last query's window: the top-3 choose
  opts, scale = options(case)
  q, k, v, lq = make_inputs(1, t, hq, hkv, d, seed=3)
  rank, embed = 3, 6
  keys = jax.random.split(jax.random.key(4), 8)
  x = jax.random.normal(keys[0], (1, t, embed))
  a = jax.random.normal(keys[1], (embed, rank)) * 0.5
  bm = jax.random.normal(keys[2], (rank, hq * d)) * 0.5
  w = jax.random.normal(keys[3], q.shape)

  def project(q, a, bm):
    return q + (x @ a @ bm).reshape(q.shape)

  def loss(q, k, v, a, bm):
    return jnp.sum(w * pisa_jax.hils_attention(q, k, v, project(q, a, bm), **opts))

  grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, a, bm)
  args64 = [np.asarray(z, np.float64) for z in (q, k, v, a, bm)]
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)

  def oracle_loss(q, k, v, a, bm):
    lq = q + (x64 @ a @ bm).reshape(q.shape)
    out, _, _ = oracles.hils(q[0], k[0], v[0], lq[0], scale=scale, **opts)
    return float(np.sum(w64[0] * out))

  for i, name in enumerate(("q", "k", "v", "landmark A", "landmark B")):
    direction = np.asarray(jax.random.normal(keys[4 + min(i, 3)], args64[i].shape), np.float64)

    def along(z, i=i):
      return oracle_loss(*[z if j == i else args64[j] for j in range(5)])

    want = _directional(along, args64[i], direction)
    got = float(np.sum(np.asarray(grads[i], np.float64) * direction))
    assert abs(want) > 1e-3, f"{name}: the loss does not depend on it"
    np.testing.assert_allclose(got, want, rtol=2e-4, err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_causal(implementation):
  """Changing anything at positions after t0 leaves every output up to t0 as it was, on the
  reference and on the kernels (interpret mode here) alike."""
  case = CASES[0]
  b, t, hq, hkv, d, _, _, _ = case
  opts, _ = options(case)
  opts = dict(opts, implementation=implementation)
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=5)
  q2, k2, v2, lq2 = make_inputs(b, t, hq, hkv, d, seed=6)
  t0 = 30
  future = (jnp.arange(t) > t0)[None, :, None, None]
  mixed = [jnp.where(future, y, x) for x, y in ((q, q2), (k, k2), (v, v2), (lq, lq2))]
  out = pisa_jax.hils_attention(q, k, v, lq, **opts)
  out_mixed = pisa_jax.hils_attention(*mixed, **opts)
  np.testing.assert_array_equal(np.asarray(out[:, :t0 + 1]), np.asarray(out_mixed[:, :t0 + 1]))
  assert not np.allclose(out[:, t0 + 1:], out_mixed[:, t0 + 1:])


def test_packed_documents_equal_each_document_alone():
  case = CASES[0]
  _, t, hq, hkv, d, _, _, _ = case
  opts, scale = options(case)
  q, k, v, lq = make_inputs(2, t, hq, hkv, d, seed=7)
  lengths = [[17, 3, 25], [45]]
  segment_ids = jnp.asarray(np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths]),
                            jnp.int32)
  out = np.asarray(pisa_jax.hils_attention(q, k, v, lq, segment_ids=segment_ids, **opts))
  idx = np.asarray(pisa_jax.hils_select_chunks(q, k, lq, segment_ids=segment_ids, **opts))
  # Each document alone, as a row of its own from position 0: zeros after it change nothing
  # before them (test_causal), so every document shares one shape and one call.
  pieces = [(row, lo, n) for row, ls in enumerate(lengths)
            for lo, n in zip(np.cumsum([0] + ls[:-1]), ls)]
  alone = [jnp.stack([jnp.zeros_like(x[0]).at[:n].set(x[row, lo:lo + n])
                      for row, lo, n in pieces]) for x in (q, k, v, lq)]
  alone_out = np.asarray(pisa_jax.hils_attention(*alone, **opts))
  alone_idx = np.asarray(pisa_jax.hils_select_chunks(alone[0], alone[1], alone[3], **opts))
  for i, (row, lo, n) in enumerate(pieces):
    np.testing.assert_allclose(out[row, lo:lo + n], alone_out[i, :n], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(idx[row, lo:lo + n], alone_idx[i, :n])
  want_out, want_idx, _ = oracle_rows(q, k, v, lq, np.asarray(segment_ids), scale=scale, **opts)
  np.testing.assert_array_equal(idx, want_idx)
  np.testing.assert_allclose(out, want_out, atol=tolerances.GOLDEN_OUTPUT_ATOL,
                             rtol=tolerances.GOLDEN_OUTPUT_ATOL)
  # Landmark slots: the row's complete chunks in order, document by document.
  landmark_k, _ = pisa_jax.hils_landmarks(k, lq, chunk_size=opts["chunk_size"],
                                          segment_ids=segment_ids)
  c = opts["chunk_size"]
  first_chunk_of_third = 17 + 3  # document 0 has 4 complete chunks, document 1 none
  np.testing.assert_allclose(
      landmark_k[0, 4, 0],
      oracles.hils_landmark(np.asarray(k[0, 20:20 + c, 0], np.float64),
                            np.asarray(lq[0, first_chunk_of_third + c - 1, 0], np.float64),
                            scale)[0], atol=1e-5)
  np.testing.assert_array_equal(landmark_k[0, 4 + 6:], 0)  # 4 + 6 chunks, then empty slots


@pytest.mark.slow
def test_bfloat16_inputs_compute_in_float32():
  case = CASES[0]
  b, t, hq, hkv, d, _, _, _ = case
  opts, _ = options(case)
  inputs = make_inputs(b, t, hq, hkv, d, seed=8, dtype=jnp.bfloat16)
  out = pisa_jax.hils_attention(*inputs, **opts)
  want = pisa_jax.hils_attention(*[x.astype(jnp.float32) for x in inputs], **opts)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(chunk_size=0), ValueError, "chunk_size=0"),
    (dict(top_k=0), ValueError, "top_k=0"),
    (dict(window=0), ValueError, "window=0"),
    (dict(top_k=2.5), ValueError, "top_k=2.5"),
    (dict(implementation="triton"), ValueError, "implementation='triton'"),
    (dict(landmark_q=np.zeros((1, 8, 2, 4), np.float32)), ValueError, "landmark_q.shape"),
    (dict(landmark_q=jnp.zeros((1, 8, 4, 4), jnp.bfloat16)), TypeError, "landmark_q"),
    (dict(segment_ids=jnp.asarray([[1, 1, 0, 0, 0, 0, 0, 0]], jnp.int32)), ValueError,
     "segment_ids"),
])
def test_bad_arguments_raise_one_line(kwargs, error, needle):
  q, k, v, lq = make_inputs(1, 8, 4, 2, 4)
  kwargs = dict(kwargs)
  lq = kwargs.pop("landmark_q", lq)
  with pytest.raises(error) as info:
    pisa_jax.hils_attention(q, k, v, lq, **kwargs)
  message = str(info.value)
  assert needle in message and "\n" not in message, message


def _hils_decoder(**fields):
  """One layer, chunks of 4, a window of 4 and top-2: from 12 tokens on, selection decides."""
  from flax import nnx

  from pisa_jax.models import Decoder, ModelConfig

  cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=64, num_layers=1, d_model=64, mlp_dim=128,
                    num_heads=4, num_kv_heads=2, head_dim=16, attention="hils",
                    hils_chunk_size=4, hils_top_k=2, hils_window=4, hils_landmark_rank=4,
                    init_std=0.1, param_dtype="float32", compute_dtype="float32", **fields)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  if cfg.qkv_bias:  # biases start at zero: give them values, so that leaving one out shows
    for i, block in enumerate(model.blocks):
      for name in ("bq", "bk", "bv"):
        bias = getattr(block.attn, name)
        bias[...] = 0.5 * jax.random.normal(jax.random.key(100 + i), bias.shape, bias.dtype)
  return model


def test_decoder_kind_trains_the_landmark_projection():
  """model.attention="hils": the layer's landmark projection (rank r) is counted, and the loss
  reaches it through the chunk scores."""
  import dataclasses

  from flax import nnx

  from pisa_jax.models import count_params

  model = _hils_decoder()
  cfg = model.cfg
  graphdef, params = nnx.split(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == count_params(cfg)
  assert count_params(cfg) == count_params(dataclasses.replace(cfg, attention="pisa")) + (
      cfg.num_layers * cfg.hils_landmark_rank * (cfg.d_model + cfg.num_heads * cfg.head_dim))
  tokens = jax.random.randint(jax.random.key(9), (1, 41), 0, cfg.vocab_size)

  @jax.jit
  def loss(params):
    logits = nnx.merge(graphdef, params)(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert bool(jnp.isfinite(value))
  blocks = list(grads["blocks"].values())
  assert len(blocks) == cfg.num_layers
  for block in blocks:
    for name in ("wl_down", "wl_up"):
      g = block["attn"][name][...]
      assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0, name


@pytest.mark.parametrize("overrides, needle", [
    (["model.hils_top_k=0"], "model.hils_top_k=0"),
    (["model.hils_window=0"], "model.hils_window=0"),
    (["model.hils_chunk_size=0"], "model.hils_chunk_size=0"),
    (["model.hils_landmark_rank=0"], "model.hils_landmark_rank=0"),
    (["train.context_parallel=2"], "train.context_parallel=1"),
])
def test_config_rejects_bad_hils_fields(overrides, needle):
  from pisa_jax.configs import apply_overrides, get_config, validate

  base = apply_overrides(get_config("tiny"), ["model.attention=hils"])
  validate(base)
  with pytest.raises(ValueError) as info:
    validate(apply_overrides(base, overrides))
  assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_decode_steps_equal_the_forward_rows():
  """Packed right-padded prompts prefilled into a HiLSCache (each row keeps its last document),
  then one token per row per step at its own position, across a growth of the cache: every
  step's output is row p of `hils_attention` over the whole packed sequence, and the cached
  landmarks are `hils_landmarks`' of the document."""
  case = CASES[0]
  b, t, hq, hkv, d, c, top_k, w = case
  opts, _ = options(case)
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=10)
  # Row 0: a document of 7 tokens, then one of 38 that the prompt (16 tokens) starts and the
  # steps continue. Row 1: one document, a prompt of 5 tokens.
  segment_ids = jnp.asarray([[0] * 7 + [1] * 38, [0] * t], jnp.int32)
  full = np.asarray(pisa_jax.hils_attention(q, k, v, lq, segment_ids=segment_ids, **opts))
  prompt_len = jnp.asarray([16, 5], jnp.int32)
  width = 16
  cache = pisa_jax.HiLSCache.create(b, 16, hkv, hq, d, chunk_size=c, dtype=q.dtype)
  prefill = jax.jit(lambda cache, *args: cache.prefill(*args[:4], segment_ids=args[4]))
  cache = prefill(cache, k[:, :width], v[:, :width], lq[:, :width], prompt_len,
                  segment_ids[:, :width])
  np.testing.assert_array_equal(cache.lengths, [9, 5])
  step = jax.jit(functools.partial(pisa_jax.hils_decode_step, top_k=top_k, window=w))
  rows = jnp.arange(b)
  steps = 18  # row 0 reaches 27 tokens: the cache grows from 16 to 32
  for s in range(steps):
    pos = prompt_len + s  # each row's absolute position in the packed sequence
    cache = cache.grow(int(cache.lengths.max()) + 1)
    out, cache = step(*[x[rows, pos][:, None] for x in (q, k, v, lq)], cache)
    np.testing.assert_allclose(out[:, 0], full[rows, pos], atol=1e-5, rtol=1e-5,
                               err_msg=f"step {s}")
  assert cache.capacity == 32 and cache.lengths.tolist() == [9 + steps, 5 + steps]
  # Row 0's cache holds document 1 from its first token: its landmarks are that document's.
  doc = [x[:1, 7:7 + 9 + steps] for x in (k, lq)]
  want_k, want_b = pisa_jax.hils_landmarks(*doc, chunk_size=c)
  np.testing.assert_allclose(cache.landmark_k[0, :want_k.shape[1]], want_k[0], atol=1e-5)
  np.testing.assert_allclose(cache.landmark_bias[0, :want_k.shape[1]], want_b[0], atol=1e-5)


@pytest.mark.parametrize("fields", [{}, dict(qk_norm=True), dict(qkv_bias=True)],
                         ids=["plain", "qk_norm", "qkv_bias"])
def test_decoder_generation_equals_the_full_forward(fields):
  """`pisa_jax.generate` with a HiLS decoder (prefill, cached landmarks, steps, a cache growth):
  every step's logits are the full forward pass's at that position, float32 rounding apart;
  with the query's bias or RMSNorm (Qwen2, Qwen3) in the cached landmarks' queries too."""
  model = _hils_decoder(**fields)
  prompts = [[(7 * i + 3) % 64 for i in range(27)], [5, 9, 1], [(11 * i) % 64 for i in range(12)]]
  new = 6  # 27 + 6 tokens: the cache grows from 32 to 64
  out = pisa_jax.generate(model, prompts, max_new_tokens=new, initial_capacity=32,
                          return_logits=True, steps_per_call=3)
  forward = jax.jit(lambda tokens: model(tokens))
  width = 27 + new
  for s in range(new):
    tokens = np.zeros((3, width), np.int32)
    for row, prompt in enumerate(prompts):
      tokens[row, :len(prompt) + s] = prompt + out.tokens[row, :s].tolist()
    last = np.array([len(p) + s - 1 for p in prompts])
    want = np.asarray(forward(jnp.asarray(tokens)))[np.arange(3), last]
    np.testing.assert_allclose(out.logits[:, s], want, atol=tolerances.OUTPUT_ATOL[jnp.float32],
                               rtol=tolerances.OUTPUT_RTOL[jnp.float32], err_msg=f"step {s}")
    np.testing.assert_array_equal(out.tokens[:, s], want.argmax(-1))


# ----------------------------------------------------------------------------- Pallas kernels
# Interpret mode on the CPU fills every output with NaN before the kernel runs (Pallas'
# `uninitialized_value`), so an element a kernel never writes fails the comparisons below.

# (batch, T, HQ, HKV, D, chunk, top_k, window, documents): T not a multiple of C, head dims
# padded (8, 20), GQA groups 3, 2 and 1, window 1, top_k above a document's eligible chunks.
KERNEL_CASES = [
    (1, 29, 3, 1, 8, 4, 3, 6, None),
    (2, 30, 4, 2, 20, 4, 2, 1, None),
    (1, 38, 2, 1, 16, 4, 3, 5, (21, 3, 14)),
]


def kernel_case_id(case):
  *shape, docs = case
  return case_id(shape) + ("" if docs is None else "-docs" + "_".join(map(str, docs)))


def _segment_ids(batch, docs):
  if docs is None:
    return None
  return jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].repeat(batch, 0), jnp.int32)


@pytest.mark.parametrize("case, dtype", [(KERNEL_CASES[0], jnp.float32),
                                         (KERNEL_CASES[1], jnp.bfloat16),
                                         (KERNEL_CASES[2], jnp.float32)],
                         ids=lambda x: kernel_case_id(x) if isinstance(x, tuple) else None)
def test_select_kernel_matches_reference(case, dtype):
  """The fused chunk-score + top-k kernel picks exactly the reference's chunks."""
  b, t, hq, hkv, d, c, top_k, w, docs = case
  opts = dict(chunk_size=c, top_k=top_k, window=w)
  q, k, _, lq = make_inputs(b, t, hq, hkv, d, seed=11, dtype=dtype)
  ids = _segment_ids(b, docs)
  got = pisa_jax.hils_select_chunks(q, k, lq, segment_ids=ids, implementation="pallas", **opts)
  want = pisa_jax.hils_select_chunks(q, k, lq, segment_ids=ids, implementation="xla", **opts)
  # Selection decides: some query has more eligible chunks than top_k, some fewer.
  assert int(jnp.min(jnp.sum(want >= 0, -1))) < top_k == int(jnp.max(jnp.sum(want >= 0, -1)))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _value_and_grads(implementation, q, k, v, lq, ct, ids, opts):
  def loss(q, k, v, lq):
    out = pisa_jax.hils_attention(q, k, v, lq, segment_ids=ids, implementation=implementation,
                                  **opts)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, lq)
  return (out,) + grads


GRAD_NAMES = ("out", "dq", "dk", "dv", "dlandmark_q")


def _assert_close(got, want, where=""):
  for name, g, r in zip(GRAD_NAMES, got, want):
    assert bool(jnp.all(jnp.isfinite(g))), name + where
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=tolerances.GRAD_ATOL[jnp.float32],
                               rtol=tolerances.GRAD_RTOL[jnp.float32], err_msg=name + where)


def test_attention_kernels_match_reference_with_gradients():
  """Forward and the gradients of q, k, v and the landmark queries (the landmark projection's
  gradient: through the chunk scores into both the landmark keys and the queries' scores)."""
  b, t, hq, hkv, d, c, top_k, w, _ = KERNEL_CASES[0]
  opts = dict(chunk_size=c, top_k=top_k, window=w)
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=12)
  ct = jax.random.normal(jax.random.key(13), q.shape)
  got = _value_and_grads("pallas", q, k, v, lq, ct, None, opts)
  _assert_close(got, _value_and_grads("xla", q, k, v, lq, ct, None, opts))
  # The chunk scores carry gradient: without them dlandmark_q would be zero.
  assert float(jnp.max(jnp.abs(got[4]))) > 1e-2


def test_attention_kernels_packed_equal_each_document_alone():
  """Packed rows through the kernels (their packed launches): every document's output and
  gradients are the reference's of that document alone."""
  b, t, hq, hkv, d, c, top_k, w, docs = KERNEL_CASES[2]
  opts = dict(chunk_size=c, top_k=top_k, window=w)
  q, k, v, lq = make_inputs(b, t, hq, hkv, d, seed=15)
  ct = jax.random.normal(jax.random.key(16), q.shape)
  packed = _value_and_grads("pallas", q, k, v, lq, ct, _segment_ids(b, docs), opts)
  lo = 0
  for n in docs:
    part = lambda x: x[:, lo:lo + n]
    alone = _value_and_grads("xla", *map(part, (q, k, v, lq, ct)), None, opts)
    _assert_close([part(x) for x in packed], alone, f" of the document at {lo}")
    lo += n


def test_attention_kernels_bfloat16_and_group_two():
  b, t, hq, hkv, d, c, top_k, w, _ = KERNEL_CASES[1]
  opts = dict(chunk_size=c, top_k=top_k, window=w)
  inputs = make_inputs(b, t, hq, hkv, d, seed=14, dtype=jnp.bfloat16)
  got = pisa_jax.hils_attention(*inputs, implementation="pallas", **opts)
  want = pisa_jax.hils_attention(*inputs, implementation="xla", **opts)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=tolerances.OUTPUT_ATOL[jnp.bfloat16],
                             rtol=tolerances.OUTPUT_RTOL[jnp.bfloat16])
