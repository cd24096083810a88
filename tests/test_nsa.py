"""NSA (`pisa_jax.nsa`) against float64 oracles: each branch, the selection (and fla's
`parallel_nsa_topk` rule with mean compression at l = d = l' = 64), the whole layer and its
gradients, causality, packed documents and bad sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax import _dispatch, nsa, testing
from pisa_jax.kernels.nsa import RangeAttentionConfig, dkv_splits
from pisa_jax.kernels.nsa_select import NSASelectConfig
import oracles
from tolerances import (GRAD_ATOL, GRAD_RTOL, OUTPUT_ATOL, OUTPUT_RTOL,
                        SELECTION_NEAR_TIE_RTOL)

# The layer's tiny geometry: l = 8, d = 4 (overlapping), l' = 8, n = 4 (one free slot beside the
# three forced ones), w = 6; T = 53 is no multiple of any of them, and queries past position 39
# choose among at least two scored blocks.
SIZES = dict(block_length=8, stride=4, select_block_size=8, top_n=4, window=6)
T, HQ, HKV, D, HIDDEN = 53, 4, 2, 8, 16
SCALE = 1 / np.sqrt(D)


def make_inputs(seq_len=T, hq=HQ, hkv=HKV, batch=2, seed=0, block_length=8):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (batch, seq_len, hq, D))
  k = jax.random.normal(keys[1], (batch, seq_len, hkv, D))
  v = jax.random.normal(keys[2], (batch, seq_len, hkv, D))
  gates = jax.nn.sigmoid(jax.random.normal(keys[3], (batch, seq_len, hq, 3)))
  # Larger positions than the decoder's initial ones, so that the encoding matters here.
  mlps = [nsa.init_compression_mlp(key, block_length=block_length, head_dim=D, hidden=HIDDEN,
                                   position_std=0.5) for key in keys[4:]]
  return q, k, v, gates, *mlps


def np64(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


@pytest.mark.parametrize("compression", ["mlp", "mean"])
def test_compression_matches_oracle(compression):
  _, k, _, _, key_mlp, _ = make_inputs(seq_len=37)
  length, stride = (8, 4) if compression == "mlp" else (8, 8)
  mlp = key_mlp if compression == "mlp" else None
  got = pisa_jax.nsa_compress(k, mlp, compression=compression, block_length=length,
                              stride=stride, implementation="xla")
  for b in range(k.shape[0]):
    want = oracles.nsa_compress(k[b], None if mlp is None else np64(mlp),
                                block_length=length, stride=stride)
    np.testing.assert_allclose(got[b, :len(want)], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[b, len(want):], 0.0)


@pytest.mark.parametrize("hq,hkv", [(3, 3), (6, 2)])
def test_compressed_attention_matches_oracle(hq, hkv):
  q, k, v, _, key_mlp, value_mlp = make_inputs(hq=hq, hkv=hkv)
  k_cmp = nsa.nsa_compress(k, key_mlp, block_length=8, stride=4)
  v_cmp = nsa.nsa_compress(v, value_mlp, block_length=8, stride=4)
  out, lse = nsa.compressed_attention(q, k_cmp, v_cmp, block_length=8, stride=4)
  for b in range(q.shape[0]):
    want_out, want_lse = oracles.nsa_compressed_attention(
        q[b], np64(k_cmp[b]), np64(v_cmp[b]), block_length=8, stride=4, scale=SCALE)
    np.testing.assert_allclose(out[b], want_out, rtol=1e-5, atol=1e-5)
    # Queries before position l - 1 see no block: lse -inf, zero output.
    np.testing.assert_allclose(lse[b], want_lse, rtol=1e-5, atol=1e-5)
  assert np.all(np.isneginf(lse[:, :7])) and np.all(np.isfinite(lse[:, 7:]))


@pytest.mark.parametrize("select_block_size", [8, 16])
def test_selection_matches_oracle(select_block_size):
  # Group 3: any GQA group. Longer T so that l' = 16 leaves scored blocks.
  q, k, _, _, key_mlp, _ = make_inputs(seq_len=97, hq=6, hkv=2, batch=1, seed=1)
  k_cmp = nsa.nsa_compress(k, key_mlp, block_length=8, stride=4)
  _, lse = nsa.compressed_attention(q, k_cmp, k_cmp, block_length=8, stride=4)
  got = nsa.nsa_select_blocks(q, k_cmp, lse, block_length=8, stride=4,
                              select_block_size=select_block_size, top_n=4)
  want = oracles.nsa_select(q[0], np64(k_cmp[0]), block_length=8, stride=4,
                            select_block_size=select_block_size, top_n=4, scale=SCALE)
  np.testing.assert_array_equal(got[0], want)


def test_selection_with_mean_blocks_of_64_is_flas_rule():
  """compression="mean" with l = d = l' = 64 selects what fla's `parallel_nsa_topk` selects
  (its group of 16; the sets, since fla orders its blocks by score)."""
  seq_len, top_n = 64 * 12 + 17, 8
  q, k, _, _, _, _ = make_inputs(seq_len=seq_len, hq=16, hkv=1, batch=1, seed=2)
  # Keys that vary slowly give blocks distinct means, so that the scores spread.
  k = k + 2.0 * jnp.sin(jnp.arange(seq_len) / 90.0)[None, :, None, None]
  sizes = dict(block_length=64, stride=64)
  k_cmp = nsa.nsa_compress(k, compression="mean", **sizes)
  _, lse = nsa.compressed_attention(q, k_cmp, k_cmp, **sizes)
  got = nsa.nsa_select_blocks(q, k_cmp, lse, select_block_size=64, top_n=top_n, **sizes)
  want = oracles.fla_parallel_nsa_topk(q[0], k[0], block_size=64, block_counts=top_n,
                                       scale=1 / np.sqrt(D))
  np.testing.assert_array_equal(got[0], want)
  assert np.any(got[0, :, :, 3:] > 0), "no query chose among scored blocks"


@pytest.mark.parametrize("window", [6, 80])
def test_window_matches_oracle(window):
  q, k, v, *_ = make_inputs(hq=6, hkv=2)
  got = nsa.sliding_window_attention(q, k, v, window=window)
  for b in range(q.shape[0]):
    want = oracles.sliding_window_attention(q[b], k[b], v[b], window=window, scale=SCALE)
    np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)


def _layer(q, k, v, gates, key_mlp, value_mlp, **kw):
  return nsa.nsa_attention(q, k, v, gates, key_mlp=key_mlp, value_mlp=value_mlp,
                           **{"implementation": "xla", **SIZES, **kw})


def _oracle_layer(q, k, v, gates, key_mlp, value_mlp, b):
  return oracles.nsa_attention(
      q[b], k[b], v[b], gates[b], key_mlp, value_mlp, scale=SCALE, **SIZES)


def test_layer_matches_oracle():
  args = make_inputs()
  got = _layer(*args)
  q, k, v, gates, key_mlp, value_mlp = np64(args)
  chosen = 0
  for b in range(q.shape[0]):
    want, idx = _oracle_layer(q, k, v, gates, key_mlp, value_mlp, b)
    np.testing.assert_allclose(got[b], want, rtol=2e-5, atol=2e-5)
    chosen += np.sum(idx[:, :, 3] > 3)
  assert chosen, "no query's selection depended on the scores"


def test_gradients_of_every_parameter_match_finite_differences():
  """jax.grad of the float32 layer against central differences of the float64 oracle, along a
  random direction per argument: q, k, v, the gates and each array of both MLPs."""
  args = make_inputs(seed=3)
  # Row 1's cotangent is zero (rows are independent): the oracle runs row 0 alone. Same shapes as
  # the other tests, whose compiled gradient this reuses.
  cotangent = jax.random.normal(jax.random.key(9), (2, T, HQ, D)).at[1].set(0.0)
  loss = lambda *a: jnp.sum(_layer(*a) * cotangent)
  grads = jax.grad(loss, argnums=tuple(range(6)))(*args)
  base = np64(args)
  ct = np.asarray(cotangent, np.float64)

  def oracle_loss(values):
    return float(np.sum(_oracle_layer(*values, 0)[0] * ct[0]))

  leaves, treedef = jax.tree.flatten(base)
  grad_leaves = jax.tree.leaves(grads)
  rng = np.random.default_rng(0)
  eps = 1e-5
  for i, (x, g) in enumerate(zip(leaves, grad_leaves, strict=True)):
    direction = rng.standard_normal(x.shape)
    moved = []
    for sign in (1, -1):
      values = list(leaves)
      values[i] = x + sign * eps * direction
      moved.append(oracle_loss(jax.tree.unflatten(treedef, values)))
    want = (moved[0] - moved[1]) / (2 * eps)
    got = float(np.sum(np.asarray(g, np.float64) * direction))
    assert abs(got - want) <= 1e-4 * (1 + abs(want)), (i, got, want)


def test_future_tokens_never_change_past_outputs():
  q, k, v, gates, key_mlp, value_mlp = make_inputs()
  cut = 29
  noise = make_inputs(seed=5)[:4]
  later = jnp.arange(T)[None, :, None, None] > cut
  moved = [jnp.where(later, x + 3.0 * n, x) for x, n in zip((q, k, v, gates), noise)]
  before = _layer(q, k, v, gates, key_mlp, value_mlp)
  after = _layer(*moved, key_mlp, value_mlp)
  np.testing.assert_array_equal(before[:, :cut + 1], after[:, :cut + 1])
  assert not np.allclose(before[:, cut + 1:], after[:, cut + 1:])


def test_packed_documents_equal_each_document_alone():
  """Rows of documents of 20 and 33 tokens (33 and 20 in the second): every output row and every
  gradient equals the document's own, run alone from position 0 (on the plain path, each
  document at the start of a row of its own: causal, so what follows it changes none of it)."""
  args = make_inputs()
  first = np.array([20, 33])
  segment_ids = jnp.asarray((np.arange(T)[None, :] >= first[:, None]).astype(np.int32))
  cotangent = jax.random.normal(jax.random.key(4), args[0].shape)
  packed, vjp = jax.vjp(lambda *a: _layer(*a, segment_ids=segment_ids), *args)
  packed_grads = vjp(cotangent)
  # (row, lo, hi) of each document.
  docs = [(0, 0, 20), (0, 20, T), (1, 0, 33), (1, 33, T)]

  def alone(x, pair):  # [2, T, ...]: document i at the start of row i, zeros after it
    return jnp.stack([jnp.pad(x[b, lo:hi], [(0, T - hi + lo)] + [(0, 0)] * (x.ndim - 2))
                      for b, lo, hi in pair])

  mlp_grads = None
  # Two documents at a time: the shapes of the other tests, whose compiled gradient this reuses.
  for pair in (docs[:2], docs[2:]):
    out, vjp = jax.vjp(_layer, *[alone(x, pair) for x in args[:4]], *args[4:])
    grads = vjp(alone(cotangent, pair))
    for r, (b, lo, hi) in enumerate(pair):
      np.testing.assert_allclose(packed[b, lo:hi], out[r, :hi - lo], rtol=1e-5, atol=1e-5)
      for g_packed, g_alone in zip(packed_grads[:4], grads[:4]):
        np.testing.assert_allclose(g_packed[b, lo:hi], g_alone[r, :hi - lo], rtol=1e-4,
                                   atol=1e-5)
    mlp_grads = grads[4:] if mlp_grads is None else jax.tree.map(jnp.add, mlp_grads, grads[4:])
  # The MLPs are shared: their gradient sums every document's.
  for g_packed, g_alone in zip(jax.tree.leaves(packed_grads[4:]), jax.tree.leaves(mlp_grads)):
    np.testing.assert_allclose(g_packed, g_alone, rtol=1e-4, atol=1e-5)


@functools.cache
def _bad_calls():
  q, k, v, gates, key_mlp, value_mlp = make_inputs()
  k_cmp = nsa.nsa_compress(k, key_mlp, block_length=8, stride=4)
  cache = pisa_jax.NSACache.create(2, 16, HKV, D, block_length=8, stride=4, dtype=jnp.float32)
  layer = functools.partial(nsa.nsa_attention, q, k, v, gates, key_mlp=key_mlp,
                            value_mlp=value_mlp, **SIZES)
  return {
      "stride": (lambda: layer(stride=3), ValueError, r"stride=3 must divide block_length=8"),
      "mean": (lambda: layer(compression="mean", key_mlp=None, value_mlp=None), ValueError,
               r"stride=4 must equal block_length=8 for compression='mean'"),
      "select": (lambda: layer(select_block_size=6), ValueError,
                 r"select_block_size=6 must be a multiple of stride=4"),
      "top_n": (lambda: layer(top_n=2), ValueError, r"top_n=2 must be an int >= 3"),
      "window": (lambda: layer(window=0), ValueError, r"window=0 must be an int >= 1"),
      "kind": (lambda: layer(compression="max"), ValueError, r"compression='max' is unknown"),
      "gates": (lambda: nsa.nsa_attention(q, k, v, gates[..., :2], key_mlp=key_mlp,
                                          value_mlp=value_mlp), ValueError, r"gates.shape="),
      "no_mlp": (lambda: layer(key_mlp=None), TypeError, r"key_mlp must be a CompressionMLP"),
      "mean_mlp": (lambda: layer(compression="mean", block_length=4, select_block_size=4),
                   ValueError, r"key_mlp applies to compression='mlp' only"),
      "mlp_shape": (lambda: layer(value_mlp=value_mlp._replace(position=value_mlp.position[1:])),
                    ValueError, r"value_mlp.position.shape=\(7, 8\) must be \(8, 8\)"),
      "k_cmp": (lambda: nsa.compressed_attention(q, k_cmp[:, 1:], k_cmp, block_length=8,
                                                 stride=4), ValueError, r"k_cmp.shape="),
      "lse": (lambda: nsa.nsa_select_blocks(q, k_cmp, jnp.zeros((2, T, 2)), block_length=8,
                                            stride=4, select_block_size=8, top_n=4),
              ValueError, r"lse.shape="),
      "pallas": (lambda: nsa.nsa_compress(k, key_mlp, block_length=8, stride=4,
                                          implementation="pallas"),
                 ValueError, r"implementation='pallas' is not available for nsa_compress"),
      "decode": (lambda: pisa_jax.nsa_decode_step(q[:, :2], k[:, :2], v[:, :2], gates[:, :2],
                                                  cache, key_mlp=key_mlp, value_mlp=value_mlp),
                 ValueError, r"must be one token per row"),
      "decode_pallas": (lambda: pisa_jax.nsa_decode_step(
          q[:, :1], k[:, :1], v[:, :1], gates[:, :1], cache, key_mlp=key_mlp,
          value_mlp=value_mlp, implementation="pallas"),
                        ValueError, r"implementation='pallas' is not available for nsa_decode"),
  }


@pytest.mark.parametrize("case", ["stride", "mean", "select", "top_n", "window", "kind", "gates",
                                  "no_mlp", "mean_mlp", "mlp_shape", "k_cmp", "lse", "pallas",
                                  "decode", "decode_pallas"])
def test_bad_sizes_are_rejected_in_one_line_naming_the_argument(case):
  call, error, match = _bad_calls()[case]
  with pytest.raises(error, match=match) as info:
    call()
  assert "\n" not in str(info.value)


# Decoding: a two-layer NSA decoder's greedy generation against its full forward pass.
DECODER = dict(vocab_size=64, vocab_pad_multiple=64, num_layers=2, d_model=64, mlp_dim=128,
               num_heads=4, num_kv_heads=2, head_dim=16, init_std=0.1, param_dtype="float32",
               compute_dtype="float32", attention="nsa", nsa_block_length=8, nsa_stride=4,
               nsa_select_block_size=8, nsa_top_n=4, nsa_window=6)


@pytest.mark.parametrize("compression", [
    "mlp", pytest.param("mean", marks=pytest.mark.slow)])  # "mean": the same step, its pooling
def test_decode_steps_equal_the_full_forward_rows(compression):
  """Prompts of 27, 3 and 12 tokens and 22 new tokens each: the prefill's logits and those of
  every step (the compressed blocks and the window extended token by token, the cache grown
  from 32 tokens to 64 on the way) equal the forward pass over the whole sequence."""
  from flax import nnx

  from pisa_jax.generation import generate
  from pisa_jax.models.config import ModelConfig
  from pisa_jax.models.decoder import Decoder

  fields = dict(DECODER, nsa_compression=compression)
  if compression == "mean":
    fields.update(nsa_block_length=4, nsa_select_block_size=8)
  model = Decoder(ModelConfig(**fields), rngs=nnx.Rngs(0))
  prompts = [[(7 * i + 3) % 64 for i in range(27)], [5, 9, 1], [(11 * i) % 64 for i in range(12)]]
  steps = 22
  out = generate(model, prompts, max_new_tokens=steps, initial_capacity=32,
                          return_logits=True, steps_per_call=8)
  width = 27 + steps
  tokens = np.zeros((3, width), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, :len(prompt) + steps] = prompt + out.tokens[b].tolist()
  # Row t of one forward pass over each whole sequence is the step that fed token t (causal).
  full = np.asarray(jax.jit(model)(jnp.asarray(tokens)))
  want = np.stack([full[b, len(p) - 1:len(p) - 1 + steps] for b, p in enumerate(prompts)])
  np.testing.assert_allclose(out.logits, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out.tokens, want.argmax(-1))


@pytest.mark.parametrize("compression", ["mlp", "mean"])
def test_decoder_counts_and_shards_its_nsa_parameters(compression):
  from flax import nnx

  from pisa_jax.models.config import ModelConfig
  from pisa_jax.models.decoder import Decoder, count_params
  from pisa_jax.models.sharding import LOGICAL_AXIS_RULES

  fields = dict(DECODER, nsa_compression=compression)
  if compression == "mean":
    fields.update(nsa_block_length=4)
  cfg = ModelConfig(**fields)
  state = nnx.state(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(state)) == count_params(cfg)
  names = set()
  for path, var in nnx.to_flat_state(state):
    names.update(str(p) for p in path)
    axes = var.get_metadata()["logical_axes"]
    assert len(axes) == var.get_value().ndim and all(
        a is None or a in LOGICAL_AXIS_RULES for a in axes), (path, axes)
  assert "wg" in names and (("key_compressor" in names) == (compression == "mlp"))


@pytest.mark.parametrize("override,match", [
    ("model.nsa_stride=5", r"model.nsa_stride=5 must divide model.nsa_block_length=32"),
    ("model.nsa_top_n=2", r"model.nsa_top_n=2 must be an int >= 3"),
    ("model.nsa_compression=mean", r"model.nsa_stride=16 must equal model.nsa_block_length=32"),
    ("train.context_parallel=2", r"model.attention='nsa' does not split the sequence"),
])
def test_config_rejects_bad_nsa_fields_by_name(override, match):
  from pisa_jax.configs import apply_overrides, get_config, validate

  validate(apply_overrides(get_config("tiny"), ["model.attention=nsa"]))
  with pytest.raises(ValueError, match=match) as info:
    validate(apply_overrides(get_config("tiny"), ["model.attention=nsa", override]))
  assert "\n" not in str(info.value)


@pytest.mark.parametrize("packed", [False, True])
def test_pallas_layer_equals_xla(packed):
  """implementation="pallas": the compressed and window branches on the range kernel, the
  selection on its kernel (packed rows on its packed launch), the selected branch on the
  sparse-attention kernel (the interpreter off a GPU): outputs and gradients equal "xla"'s."""
  args = make_inputs()
  segment_ids = (jnp.asarray((np.arange(T)[None, :] >= np.array([[20], [33]])).astype(np.int32))
                 if packed else None)
  cotangent = jax.random.normal(jax.random.key(6), args[0].shape)
  results = []
  for implementation in ("xla", "pallas"):
    out, vjp = jax.vjp(functools.partial(_layer, implementation=implementation,
                                         segment_ids=segment_ids), *args)
    results.append((out, vjp(cotangent)))
  (want, want_grads), (got, got_grads) = results
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(g, w, rtol=5e-5, atol=5e-5)


# The range kernels (`pisa_jax.kernels.nsa`) of the compressed and window branches, in the
# Pallas interpreter, against the jnp reference on fresh inputs. Small tiles (16 rows, 16 keys)
# so that a row's range crosses tiles and a program holds several queries; the compressed cases
# cut each dk / dv key tile's queries into parts (float32 partials), the window cases do not.
SMALL_TILES = RangeAttentionConfig(rows=16, block_keys=16, dkv_min_programs=64, dkv_max_splits=4)
UNSPLIT_TILES = RangeAttentionConfig(rows=16, block_keys=16, dkv_min_programs=1)
KERNEL_CASES = {  # id: (T, HQ, HKV, D, l, d, documents' first positions or None)
    "T45-HQ2-HKV2-D8-l8-d4": (45, 2, 2, 8, 8, 4, None),
    "T61-HQ4-HKV2-D16-l8-d4": (61, 4, 2, 16, 8, 4, None),
    "T50-HQ3-HKV1-D8-l4-d4": (50, 3, 1, 8, 4, 4, None),
    "T37-HQ8-HKV2-D8-l8-d8": (37, 8, 2, 8, 8, 8, None),
    "T39-HQ8-HKV1-D8-l4-d2-packed": (39, 8, 1, 8, 4, 2, (0, 11, 14, 30)),
}


def _kernel_inputs(case, seed):
  seq_len, hq, hkv, d, length, stride, firsts = KERNEL_CASES[case]
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (2, seq_len, hq, d))
  k, v = (jax.random.normal(key, (2, seq_len, hkv, d)) for key in keys[1:3])
  segment_ids = None
  if firsts is not None:
    # Row 0 with the documents, row 1 one document (a packed row may hold one).
    ids = np.searchsorted(np.asarray(firsts), np.arange(seq_len), side="right")
    segment_ids = jnp.asarray(np.stack([ids, np.ones(seq_len, int)]).astype(np.int32))
  cotangents = [jax.random.normal(key, shape) for key, shape in
                ((keys[3], q.shape), (keys[4], q.shape[:3]))]
  return q, k, v, segment_ids, length, stride, cotangents


def _value_and_grads(fn, args, cotangents):
  """fn's outputs (out, or (out, lse)) and the gradients of sum(out * ct) + sum(lse * ct) over
  the finite lse, in one jitted vjp."""
  @jax.jit
  def run(args, cotangents):
    outs, vjp = jax.vjp(fn, *args)
    if isinstance(outs, tuple):
      out, lse = outs
      cts = (cotangents[0].astype(out.dtype), jnp.where(jnp.isfinite(lse), cotangents[1], 0.0))
    else:
      cts = cotangents[0].astype(outs.dtype)
    return outs, vjp(cts)
  return run(tuple(args), tuple(cotangents))


def _assert_close(got, want, *, grads=False):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.all(np.isfinite(g) | np.isneginf(w)), "an output the kernel never wrote (NaN)"
    np.testing.assert_allclose(g, w, rtol=GRAD_RTOL[jnp.float32] if grads else
                               OUTPUT_RTOL[jnp.float32],
                               atol=GRAD_ATOL[jnp.float32] if grads else OUTPUT_ATOL[jnp.float32])


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow) if c.startswith(("T61", "T37")) else c
    for c in KERNEL_CASES])
def test_compressed_attention_kernel_matches_reference(case):
  """Output, lse and the gradients of q, k_cmp and v_cmp (through both outputs), any group
  (1, 2, 3, 4, 8), T no multiple of the stride or the tiles, packed documents."""
  q, k, v, segment_ids, length, stride, cotangents = _kernel_inputs(case, seed=11)
  sizes = dict(block_length=length, stride=stride)
  k_cmp, v_cmp = (nsa.nsa_compress(x, compression="mean" if length == stride else "mlp",
                                   mlp=None if length == stride else
                                   nsa.init_compression_mlp(jax.random.key(i), head_dim=x.shape[3],
                                                            hidden=8, block_length=length),
                                   segment_ids=segment_ids, **sizes)
                  for i, x in enumerate((k, v)))
  scale = 1 / np.sqrt(q.shape[-1])
  assert dkv_splits(q.shape[0] * k.shape[2], SMALL_TILES) == 4  # one key tile a KV head
  results = [_value_and_grads(functools.partial(fn, segment_ids=segment_ids, **sizes, scale=scale),
                              (q, k_cmp, v_cmp), cotangents)
             for fn in (functools.partial(nsa.compressed_attention_pallas, interpret=True,
                                          config=SMALL_TILES),
                        nsa.compressed_attention_reference)]
  (got, got_grads), (want, want_grads) = results
  assert np.any(np.isneginf(want[1])) and np.any(np.isfinite(want[1]))
  _assert_close(got, want)
  _assert_close(got_grads, want_grads, grads=True)


@pytest.mark.parametrize("case,window", [("T45-HQ2-HKV2-D8-l8-d4", 5),
                                         pytest.param("T61-HQ4-HKV2-D16-l8-d4", 40,
                                                      marks=pytest.mark.slow),
                                         ("T50-HQ3-HKV1-D8-l4-d4", 17),
                                         ("T39-HQ8-HKV1-D8-l4-d2-packed", 9)])
def test_window_kernel_matches_reference(case, window):
  q, k, v, segment_ids, _, _, cotangents = _kernel_inputs(case, seed=12)
  kw = dict(window=window, scale=1 / np.sqrt(q.shape[-1]), segment_ids=segment_ids)
  (got, got_grads), (want, want_grads) = [
      _value_and_grads(functools.partial(fn, **kw), (q, k, v), cotangents)
      for fn in (functools.partial(nsa.sliding_window_attention_pallas, interpret=True,
                                   backend="pallas", config=UNSPLIT_TILES),
                 nsa.sliding_window_attention_reference)]
  _assert_close(got, want)
  _assert_close(got_grads, want_grads, grads=True)


def test_range_kernels_on_packed_documents_equal_each_document_alone():
  """Both branches' kernels over a packed row: each document's outputs and gradients are those
  of the document alone at the start of a row of its own (compressed on its own grid; causal,
  so the zeros after it change none of it)."""
  q, k, v, segment_ids, length, stride, cotangents = _kernel_inputs(
      "T39-HQ8-HKV1-D8-l4-d2-packed", seed=13)
  seq_len = q.shape[1]
  sizes = dict(block_length=length, stride=stride)
  mlps = [nsa.init_compression_mlp(jax.random.key(i), head_dim=8, hidden=8, block_length=length)
          for i in range(2)]
  kernel = dict(interpret=True, config=SMALL_TILES)

  def both(q, k, v, segment_ids):
    k_cmp, v_cmp = (nsa.nsa_compress(x, mlp, segment_ids=segment_ids, **sizes)
                    for x, mlp in ((k, mlps[0]), (v, mlps[1])))
    out_cmp, lse = nsa.compressed_attention_pallas(q, k_cmp, v_cmp, segment_ids, scale=0.4,
                                                   **sizes, **kernel)
    out_win = nsa.sliding_window_attention_pallas(q, k, v, segment_ids, window=6, scale=0.4,
                                                  backend="pallas", **kernel)
    return out_cmp + 2.0 * out_win, lse

  packed, packed_grads = _value_and_grads(lambda *a: both(*a, segment_ids[:1]),
                                          (q[:1], k[:1], v[:1]), [c[:1] for c in cotangents])
  bounds = np.flatnonzero(np.diff(np.asarray(segment_ids[0]))) + 1
  docs = list(zip([0, *bounds], [*bounds, seq_len]))
  assert len(docs) == 4

  def alone(x):  # [4, T, ...]: document i at the start of row i, zeros after it
    return jnp.stack([jnp.pad(x[0, lo:hi], [(0, seq_len - hi + lo)] + [(0, 0)] * (x.ndim - 2))
                      for lo, hi in docs])

  single, single_grads = _value_and_grads(lambda *a: both(*a, None),
                                          tuple(map(alone, (q, k, v))), list(map(alone, cotangents)))
  for r, (lo, hi) in enumerate(docs):
    _assert_close(jax.tree.map(lambda x: x[0, lo:hi], (packed, packed_grads)),
                  jax.tree.map(lambda x: x[r, :hi - lo], (single, single_grads)), grads=True)


def test_cudnn_window_is_the_references_window():
  """`local_window_size=(w - 1, 0)` with is_causal, the window cuDNN's path is given, masks as
  the reference (t - w < j <= t): checked on jax's XLA implementation of the same call."""
  q, k, v, *_ = _kernel_inputs("T61-HQ4-HKV2-D16-l8-d4", seed=14)
  for window in (1, 16):
    got = jax.nn.dot_product_attention(q, k, v, scale=0.25, is_causal=True,
                                       local_window_size=(window - 1, 0), implementation="xla")
    want = nsa.sliding_window_attention_reference(q, k, v, None, window=window, scale=0.25)
    _assert_close(got, want)


def test_cudnn_window_where_it_cannot_run_is_refused_in_one_line():
  q, k, v, *_ = make_inputs()
  with pytest.raises(ValueError, match=r"backend='cudnn' needs a GPU, segment_ids=None") as info:
    nsa.sliding_window_attention_pallas(q, k, v, None, window=6, scale=0.3, interpret=True,
                                        backend="cudnn")
  assert "\n" not in str(info.value)


# The selection kernel (`pisa_jax.kernels.nsa_select`) in the Pallas interpreter against the jnp
# reference. Small tiles (16 queries, 16 compressed blocks) so that programs hold several
# queries and rows cross tiles, except the fla-geometry case (the default tiles). Interpret mode
# fills outputs with garbage before the kernel runs, so an unwritten element fails the checks.
SELECT_TILES = NSASelectConfig(query_tile=16, block_tile=16)
SELECT_CASES = {  # id: (B, T, HQ, HKV, D, l, d, l', n, config)
    # l = d = l': a tile of 16 compressed blocks is 16 selection blocks; group 1.
    "T150-G1-D16-l4d4s4-n5": (2, 150, 2, 2, 16, 4, 4, 4, 5, SELECT_TILES),
    # Overlapping blocks (halo 1), r = 2: 7 selection blocks a tile.
    "T133-G2-D16-l8d4s8-n4": (1, 133, 4, 2, 16, 8, 4, 8, 4, SELECT_TILES),
    # The paper's ratios l = 2d, l' = 4d at small sizes: 3 selection blocks a tile.
    "T201-G4-D16-l8d4s16-n4": (1, 201, 4, 1, 16, 8, 4, 16, 4, SELECT_TILES),
    # The paper's l = 32, d = 16, l' = 64 at d64.
    "T420-G2-D64-l32d16s64-n5": (1, 420, 4, 2, 64, 32, 16, 64, 5, SELECT_TILES),
    # fla's configuration, l = d = l' = 64, group 16, the default tiles.
    "T330-G16-D64-l64d64s64-n4": (1, 330, 16, 1, 64, 64, 64, 64, 4, None),
    # T < top_n l': every eligible block is kept, none scored.
    "T45-G4-D16-l8d8s8-n6": (1, 45, 8, 2, 16, 8, 8, 8, 6, SELECT_TILES),
}


def _select_inputs(case, dtype, seed=21):
  b, t, hq, hkv, d, length, stride, select, top_n, config = SELECT_CASES[case]
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, hq, d)).astype(dtype)
  k = jax.random.normal(keys[1], (b, t, hkv, d)).astype(dtype)
  mean = length == stride
  mlp = None if mean else nsa.init_compression_mlp(keys[2], block_length=length, head_dim=d,
                                                     hidden=8, dtype=dtype)
  sizes = dict(block_length=length, stride=stride)
  k_cmp = nsa.nsa_compress(k, mlp, compression="mean" if mean else "mlp", **sizes)
  _, lse = nsa.compressed_attention(q, k_cmp, k_cmp, **sizes)
  kw = dict(sizes, select_block_size=select, top_n=top_n, scale=1 / np.sqrt(d))
  return q, k_cmp, lse, kw, config


def _assert_selection_structure(idx, select_block_size, top_n, rel=None):
  """min(top_n, cur + 1) blocks ascending then -1, the first, previous and current among them;
  cur = rel // l', rel `[B, T]` each query's position in its document (default t)."""
  idx = np.asarray(idx)
  rel = np.arange(idx.shape[1])[None, :] if rel is None else np.asarray(rel)
  cur = (rel // select_block_size)[:, :, None]
  valid = idx >= 0
  assert (valid.sum(-1) == np.minimum(top_n, cur + 1)).all(), "wrong count of valid blocks"
  assert (valid[..., :-1] >= valid[..., 1:]).all(), "-1 before a valid block"
  assert (np.where(valid, idx, -1).max(-1) == cur).all(), "the current block is missing"
  shifted = np.where(valid[..., 1:], idx[..., 1:], np.iinfo(np.int32).max)
  assert (shifted > idx[..., :-1]).all(), "blocks not strictly ascending"
  assert (idx[..., 0] == 0).all(), "the first block is missing"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(SELECT_CASES))
def test_select_kernel_matches_reference(case, dtype):
  """The kernel keeps the reference's blocks; a row may differ only where float64 proves the
  decision a near-tie (`testing.nsa_mismatch_margins`)."""
  q, k_cmp, lse, kw, config = _select_inputs(case, dtype)
  got = nsa.nsa_select_blocks_pallas(q, k_cmp, lse, None, interpret=True, config=config, **kw)
  want = nsa.nsa_select_blocks_reference(q, k_cmp, lse, None, **kw)
  assert got.dtype == jnp.int32 and got.shape == want.shape
  _assert_selection_structure(got, kw["select_block_size"], kw["top_n"])
  margins = testing.nsa_mismatch_margins(got, want, q, k_cmp, **kw)
  assert all(m < SELECTION_NEAR_TIE_RTOL for *_, m in margins), margins
  # Scores decide some rows (at least two candidates for one slot), except where T < top_n l'.
  decides = (q.shape[1] - 1) // kw["select_block_size"] - 2 > kw["top_n"] - 3
  assert decides == (not case.startswith("T45")), case


def test_float64_proof_scores_select_as_the_oracle():
  """The near-tie proof's float64 scores (`testing.nsa_scores64`) keep the oracle's blocks."""
  q, k_cmp, lse, kw, _ = _select_inputs("T201-G4-D16-l8d4s16-n4", jnp.float32)
  sizes = {x: kw[x] for x in ("block_length", "stride", "select_block_size", "scale")}
  want = oracles.nsa_select(q[0], np64(k_cmp[0]), top_n=kw["top_n"], **sizes)
  lp, top_n = kw["select_block_size"], kw["top_n"]
  for t in range(3 * lp, q.shape[1], 7):
    cur = t // lp
    score = testing.nsa_scores64(q, k_cmp, 0, t, 0, **sizes)
    rest = sorted((-score[j], j) for j in range(1, cur - 1))
    np.testing.assert_array_equal(sorted([0, cur - 1, cur] + [j for _, j in rest[:top_n - 3]]),
                                  want[t, 0], err_msg=f"{t=}")


def test_select_pallas_takes_packed_documents(monkeypatch):
  """"pallas" selects packed rows on the kernel, and None picks it on a GPU for them too."""
  q, k_cmp, lse, ids, kw = _packed_inputs("G1-l64d64s64-f32")
  got = nsa.nsa_select_blocks(q, k_cmp, lse, segment_ids=ids, implementation="pallas", **kw)
  np.testing.assert_array_equal(got, nsa.nsa_select_blocks_pallas(
      q, k_cmp, lse, ids, interpret=True, **kw))
  # Which implementation None looks up on a GPU (Triton does not run here: nothing is called).
  picked = []
  monkeypatch.setattr(_dispatch, "lookup",
                      lambda op, impl: picked.append((op, impl)) or (lambda *a, **k: None))
  monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
  nsa.nsa_select_blocks(q, k_cmp, lse, segment_ids=ids, **kw)
  assert picked == [("nsa_select_blocks", "pallas")], picked


# Packed rows: documents of every size a tile of 16 queries can meet. Row 0: three documents
# in the first tile beside the start of a fourth (shorter than one compressed block, than the
# tile), then documents longer than top_n l' (their compressed slots after earlier documents'),
# shorter than one selection block, and a last one cut by the row's end; row 1 another packing
# (a document of one token, one of exactly a tile).
PACKED_LENGTHS = ([5, 3, 7, 100, 300, 20, 50, 155], [70, 1, 16, 33, 300, 220])
PACKED_CASES = {  # id: (HQ, HKV, l, d, l', dtype), n = 4, D = 16
    "G1-l64d64s64-f32": (2, 2, 64, 64, 64, jnp.float32),
    "G4-l64d64s64-bf16": (4, 1, 64, 64, 64, jnp.bfloat16),
    "G4-l32d16s64-f32": (4, 1, 32, 16, 64, jnp.float32),
    "G1-l32d16s64-bf16": (2, 2, 32, 16, 64, jnp.bfloat16),
    # l = d = l' = 4: a long document's selection blocks span several tiles of 16.
    "G4-l4d4s4-f32": (4, 1, 4, 4, 4, jnp.float32),
}


def _packed_inputs(case, seed=23):
  """q, k_cmp (packed layout), lse, segment_ids `[2, 640]` and the kernel's keywords."""
  hq, hkv, length, stride, select, dtype = PACKED_CASES[case]
  ids = jnp.asarray(np.stack([np.repeat(np.arange(len(row)), row) for row in PACKED_LENGTHS]),
                    jnp.int32)
  b, t = ids.shape
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, hq, 16)).astype(dtype)
  k = jax.random.normal(keys[1], (b, t, hkv, 16)).astype(dtype)
  mean = length == stride
  mlp = None if mean else nsa.init_compression_mlp(keys[2], block_length=length, head_dim=16,
                                                     hidden=8, dtype=dtype)
  sizes = dict(block_length=length, stride=stride)
  k_cmp = nsa.nsa_compress(k, mlp, compression="mean" if mean else "mlp", segment_ids=ids,
                           **sizes)
  _, lse = nsa.compressed_attention(q, k_cmp, k_cmp, segment_ids=ids, **sizes)
  kw = dict(sizes, select_block_size=select, top_n=4, scale=0.25)
  return q, k_cmp, lse, ids, kw


def _document_positions(ids):
  """Each position's offset in its document, `[B, T]`."""
  start = np.asarray(pisa_jax.segments.document_bounds(ids)[0])
  return np.arange(ids.shape[1])[None, :] - start


@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_select_kernel_on_packed_documents_matches_reference(case):
  """Packed rows: the kernel keeps the reference's document-relative blocks, a row differing
  only where float64 proves the decision a near-tie within the query's document."""
  q, k_cmp, lse, ids, kw = _packed_inputs(case)
  got = nsa.nsa_select_blocks_pallas(q, k_cmp, lse, ids, interpret=True, config=SELECT_TILES,
                                     **kw)
  want = nsa.nsa_select_blocks_reference(q, k_cmp, lse, ids, **kw)
  assert got.dtype == jnp.int32 and got.shape == want.shape
  rel, select = _document_positions(ids), kw["select_block_size"]
  _assert_selection_structure(got, select, 4, rel)
  margins = testing.nsa_mismatch_margins(got, want, q, k_cmp, segment_ids=ids, **kw)
  assert all(m < SELECTION_NEAR_TIE_RTOL for *_, m in margins), margins
  # Scores decide rows of both rows' long documents (cur - 2 > n - 3 = 1).
  assert (rel[0] >= 4 * select).any() and (rel[1] >= 4 * select).any()


def test_select_kernel_on_packed_documents_equals_each_document_alone():
  """The packed launch selects, for each document, exactly what the one-document launch selects
  on that document's queries, compressed keys and lse alone (each document a row of one batch,
  zeros after it: later positions never change earlier rows)."""
  q, k_cmp, lse, ids, kw = _packed_inputs("G4-l32d16s64-f32")
  got = np.asarray(nsa.nsa_select_blocks_pallas(q, k_cmp, lse, ids, interpret=True,
                                                config=SELECT_TILES, **kw))
  length, stride = kw["block_length"], kw["stride"]
  t = max(max(row) for row in PACKED_LENGTHS)
  slots = nsa.num_compressed_slots(t, length, stride, packed=False)
  docs, alone_inputs = [], ([], [], [])
  for b, lengths in enumerate(PACKED_LENGTHS):
    start = first = 0
    for n in lengths:
      blocks = max(0, (n - length) // stride + 1)  # the document's own slots
      pieces = (q[b, start:start + n], k_cmp[b, first:first + blocks], lse[b, start:start + n])
      for inputs, x, size in zip(alone_inputs, pieces, (t, slots, t)):
        inputs.append(jnp.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1)))
      docs.append((b, start, n))
      start, first = start + n, first + blocks
  alone = np.asarray(nsa.nsa_select_blocks_pallas(*(jnp.stack(x) for x in alone_inputs), None,
                                                  interpret=True, config=SELECT_TILES, **kw))
  for row, (b, start, n) in enumerate(docs):
    np.testing.assert_array_equal(got[b, start:start + n], alone[row, :n],
                                  err_msg=f"row {b}, document at {start} of {n} tokens")
