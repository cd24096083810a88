"""What training at a million tokens of context relies on: each block's rematerialisation, the loss
over chunks of tokens, and RoPE angles exact at positions past float32's integers."""

import contextlib
import dataclasses
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from pisa_jax.models import Decoder, ModelConfig
from pisa_jax.models import config as model_config
from pisa_jax.models.decoder import REMAT_POLICIES, output_logits, rope_angles, rope_at
from pisa_jax.train.loss import token_loss_sums

# Remat and chunking reorder no float32 sum inside a block, and the loss chunks reorder only the
# sums over tokens: both agree with the plain computation to float32 rounding (relative to the
# largest element), far inside the kernels' tolerances.
FLOAT32_ROUNDING = 1e-6

# 1 layer, T = 80: five blocks of 16 of which PISA selects 3, so selection has a choice to make.
MODEL = ModelConfig(
    vocab_size=97, vocab_pad_multiple=32, num_layers=1, d_model=32, mlp_dim=64, num_heads=4,
    num_kv_heads=2, head_dim=16, block_size=16, top_k=3, branching=2, param_dtype="float32",
    compute_dtype="float32", attention="dense",
)
T = 80


def _assert_trees_close(got, want, rel=FLOAT32_ROUNDING):
  for path, g, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got),
                        jax.tree.leaves(want)):
    scale = max(float(jnp.max(jnp.abs(w))), 1e-30)
    err = float(jnp.max(jnp.abs(g - w)))
    assert err <= rel * scale, (jax.tree_util.keystr(path[0]), err, scale)


@functools.cache
def _loss_and_grads(attention: str, implementation: str | None, remat: str):
  cfg = dataclasses.replace(MODEL, attention=attention, attention_implementation=implementation,
                            remat=remat)
  graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jax.random.randint(jax.random.key(1), (2, T), 0, MODEL.vocab_size)

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens[:, :-1])
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0]
    return jnp.mean(nll)

  return jax.jit(jax.value_and_grad(loss))(params)


def test_remat_policies_are_the_configs():
  assert tuple(REMAT_POLICIES) == model_config.REMAT_POLICIES


@pytest.mark.parametrize("remat", model_config.REMAT_POLICIES)
def test_every_block_is_rematerialised_under_the_named_policy(remat):
  cfg = dataclasses.replace(MODEL, num_layers=2, remat=remat)
  graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  jaxpr = jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(jnp.zeros((1, 16), jnp.int32)))(params)
  policies = [e.params["policy"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "remat2"]
  assert policies == ([] if remat == "none" else [REMAT_POLICIES[remat]] * 2)


def _saved_per_token(remat: str, num_layers: int, seq_len: int = 160) -> float:
  """Elements per token that the forward keeps for the backward (PISA past its masked form)."""
  cfg = dataclasses.replace(MODEL, attention="pisa", attention_implementation="xla",
                            remat=remat, num_layers=num_layers)
  graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = jnp.zeros((1, seq_len), jnp.int32)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):  # one line per saved value: "f32[1,160,32] output of ..."
    print_saved_residuals(lambda p: nnx.merge(graphdef, p).hidden_states(tokens).sum(), params)
  shapes = [tuple(int(n) for n in m.group(1).split(",") if n)
            for m in re.finditer(r"^\w+\[([\d,]*)\]", out.getvalue(), re.MULTILINE)]
  assert shapes, out.getvalue()
  return sum(np.prod(shape) for shape in shapes if seq_len in shape) / seq_len


def test_each_policy_keeps_less_and_full_keeps_only_the_block_input_and_indices():
  # Per layer, what each policy adds to the saved activations: strictly less down the list, and
  # under "full" one [B, T, E] per block (its input) and the selected block indices
  # [B, T, HKV, K], whatever else the attention needs inside.
  per_layer = [_saved_per_token(r, 2) - _saved_per_token(r, 1) for r in model_config.REMAT_POLICIES]
  assert all(a > b for a, b in zip(per_layer, per_layer[1:])), per_layer
  assert per_layer[-1] == MODEL.d_model + MODEL.num_kv_heads * MODEL.top_k


@pytest.mark.parametrize("attention,implementation,remat", [
    ("dense", None, "dots"), ("dense", None, "dots_except_mlp"), ("dense", None, "full"),
    # The reference under the partial policies is slow-marked: dense covers the policies,
    # pallas the sparse custom VJP under them.
    pytest.param("pisa", "xla", "dots", marks=pytest.mark.slow),
    pytest.param("pisa", "xla", "dots_except_mlp", marks=pytest.mark.slow), ("pisa", "xla", "full"),
    ("pisa", "pallas", "dots"), ("pisa", "pallas", "full"),
    ("pisa", "pallas", "full_save_attention"),
    pytest.param("pisa", "pallas", "dots_save_attention", marks=pytest.mark.slow),
])
def test_remat_gradients_equal_the_plain_gradients(attention, implementation, remat):
  # The backward recomputes the block (for PISA with the saved indices, and under the
  # "save_attention" policies with the attention's saved residuals) and must give the gradients
  # of the run that kept everything.
  loss, grads = _loss_and_grads(attention, implementation, remat)
  want_loss, want_grads = _loss_and_grads(attention, implementation, "none")
  assert float(loss) == pytest.approx(float(want_loss), rel=FLOAT32_ROUNDING)
  _assert_trees_close(grads, want_grads)


def test_an_unknown_remat_policy_names_the_field():
  with pytest.raises(ValueError,
                     match=r"model.remat='dot' must be one of \('none', 'dots_save_attention'"):
    Decoder(dataclasses.replace(MODEL, remat="dot"), rngs=nnx.Rngs(0))(jnp.zeros((1, 8), jnp.int32))


def _loss_inputs(b=2, t=96, e=24, vocab=70, vp=96, dtype=jnp.float32):
  kx, kw, kt, kwt = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (b, t, e), dtype)
  lm_head = jax.random.normal(kw, (e, vp), jnp.float32)
  # The padding rows would win every argmax and hold most of the mass if they were not masked.
  lm_head = lm_head.at[:, vocab:].set(50.0)
  targets = jax.random.randint(kt, (b, t), 0, vocab)
  weights = (jax.random.uniform(kwt, (b, t)) < 0.7).astype(jnp.float32)
  return x, lm_head, targets, weights, vocab


@pytest.mark.parametrize("chunk", [8, 32, 48])
def test_chunked_loss_equals_unchunked_loss_and_gradients(chunk):
  x, lm_head, targets, weights, vocab = _loss_inputs()

  def sums(x, lm_head, chunk):
    return token_loss_sums(x, lm_head, targets, weights, vocab_size=vocab, chunk=chunk)

  def nll(x, lm_head, chunk):
    return sums(x, lm_head, chunk)[0]

  got = jax.jit(sums, static_argnums=2)(x, lm_head, chunk)
  want = jax.jit(sums, static_argnums=2)(x, lm_head, None)
  np.testing.assert_allclose(got, want, rtol=FLOAT32_ROUNDING)
  grad = jax.jit(jax.grad(nll, argnums=(0, 1)), static_argnums=2)
  _assert_trees_close(grad(x, lm_head, chunk), grad(x, lm_head, 0))

  # Against float64 numpy over the real vocabulary only: the padding rows carry no mass.
  logits = np.einsum("bte,ev->btv", np.float64(x), np.float64(lm_head))[..., :vocab]
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  t = np.asarray(targets)
  w = np.asarray(weights, np.float64)
  target_logit = np.take_along_axis(logits, t[..., None], -1)[..., 0]
  hits = (logits.argmax(-1) == t)
  np.testing.assert_allclose(got[0], ((logz - target_logit) * w).sum(), rtol=1e-5)
  assert float(got[1]) == w.sum() and float(got[2]) == (hits * w).sum()


def _largest_value(jaxpr) -> int:
  """Elements of the largest value that `jaxpr` or any jaxpr inside it computes."""
  sizes = [0]
  for eqn in jaxpr.eqns:
    sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
    for param in eqn.params.values():
      for inner in param if isinstance(param, tuple) else (param,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          sizes.append(_largest_value(inner))
  return max(sizes)


def test_chunked_loss_never_builds_the_full_logits():
  # No value of the loss or its gradient is [B, T, Vp]: the largest is one chunk's logits.
  x, lm_head, targets, weights, vocab = _loss_inputs(t=128, vocab=200, vp=256)

  def nll(x, lm_head):
    return token_loss_sums(x, lm_head, targets, weights, vocab_size=vocab, chunk=16)[0]

  jaxpr = jax.make_jaxpr(jax.value_and_grad(nll, argnums=(0, 1)))(x, lm_head).jaxpr
  b, vp = x.shape[0], lm_head.shape[1]
  assert _largest_value(jaxpr) == b * 16 * vp  # the whole logits would be 8 times as many


def test_output_logits_mask_the_padding_rows():
  x, lm_head, _, _, vocab = _loss_inputs()
  logits = output_logits(x, lm_head, vocab)
  assert bool((logits[..., vocab:] == -1e9).all()) and bool((logits[..., :vocab] > -1e8).all())


def test_a_chunk_that_does_not_divide_the_sequence_names_the_field():
  x, lm_head, targets, weights, vocab = _loss_inputs()
  with pytest.raises(ValueError, match=r"train.loss_chunk=40 must divide the sequence length 96"):
    token_loss_sums(x, lm_head, targets, weights, vocab_size=vocab, chunk=40)


def _rope_float64(positions, head_dim=64, base=10_000.0):
  inv_freq = base ** (-2.0 * np.arange(head_dim // 4, dtype=np.float64) / head_dim)
  angle = np.asarray(positions, np.float64)[:, None] * inv_freq
  return np.cos(angle), np.sin(angle), angle


@pytest.mark.parametrize("around", [0, 2**21 + 1, 2**24, 2**25, 2**31 - 70])
def test_rope_is_exact_at_large_positions(around):
  positions = around + np.arange(-3, 64) if around else np.arange(67)
  positions = positions[(positions >= 0) & (positions < 2**31)]
  cos, sin = rope_at(jnp.asarray(positions, jnp.int32), 64, 10_000.0)
  want_cos, want_sin, angle = _rope_float64(positions)
  # float32 rounding of cos and sin themselves, not of the angle (2^-24 * |angle|, up to 128 rad
  # at 2^31) nor of the position (2^24 + 1 would be 2^24): a few ulps of a number <= 1. The float64
  # reference is itself off by ~2^-53 * |angle|, 2e-7 at 2^31.
  err = max(np.abs(np.asarray(cos) - want_cos).max(), np.abs(np.asarray(sin) - want_sin).max())
  assert err < 1e-6 + 2**-52 * np.abs(angle).max(), err


def test_rope_separates_neighbouring_positions_past_2_24():
  # float32(2^24 + 1) == 2^24: a position-as-float angle gives them one rotation.
  cos, sin = rope_at(jnp.asarray([2**24, 2**24 + 1], jnp.int32), 64, 10_000.0)
  step = np.arctan2(sin[1, 0] * cos[0, 0] - cos[1, 0] * sin[0, 0],
                    cos[1, 0] * cos[0, 0] + sin[1, 0] * sin[0, 0])
  assert abs(float(step) - 1.0) < 1e-6  # the fastest frequency turns 1 rad per position


def test_rope_angles_are_rope_at_the_first_positions():
  cos, sin = rope_angles(300, 32, 80_000.0)
  cos_at, sin_at = rope_at(jnp.arange(300), 32, 80_000.0)
  np.testing.assert_array_equal(cos, cos_at)
  np.testing.assert_array_equal(sin, sin_at)
  want_cos, want_sin, _ = _rope_float64(np.arange(300), 32, 80_000.0)
  np.testing.assert_allclose(cos, want_cos, atol=3e-7)
  np.testing.assert_allclose(sin, want_sin, atol=3e-7)
