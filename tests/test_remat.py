"""Rematerialised blocks never select twice: under every `model.remat` policy the backward pass of
a training step runs no selection kernel, and under the "save_attention" policies no attention
forward kernel; the loss curve is the one of the run that keeps everything.

The kernels are counted in the jaxpr of the trainer's loss and its gradient (`loss_sums`, what
`train_step` differentiates) with the Pallas implementation: each kernel is a `pallas_call`
named after it, and nothing runs (interpret mode only traces here).
"""

from __future__ import annotations

import collections
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
from jax.extend import core as jax_core

from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.models import Decoder, ModelConfig
from pisa_jax.models.config import REMAT_POLICIES
from pisa_jax.train.trainer import build_trainer, loss_sums

# 2 layers at T = 128: eight blocks of 16 of which PISA selects 3 (past 2 K C, so the reference
# takes its gathered form, whose custom_vjp residuals are the tagged ones).
MODEL = ModelConfig(
    vocab_size=64, vocab_pad_multiple=64, num_layers=2, d_model=32, mlp_dim=64, num_heads=4,
    num_kv_heads=2, head_dim=16, block_size=16, top_k=3, branching=2, param_dtype="float32",
    compute_dtype="float32", attention="pisa", attention_implementation="pallas",
)
B, T = 1, 128
SELECTION_KERNELS = ("pisa_pool", "pisa_select")  # the pyramid and the walk
ATTENTION_FORWARD = "pisa_sparse_attention_fwd"
# The policies that keep the attention forward's residuals.
SAVING_ATTENTION = ("none", "dots_save_attention", "full_save_attention")


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for x in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(x, jax_core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax_core.Jaxpr):
        yield x


def _count_kernels(jaxpr, counts: collections.Counter) -> collections.Counter:
  """pallas_call names (and cuDNN's attention primitives) in a jaxpr and every jaxpr nested in
  it (jit, remat, shard_map, custom rules)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      counts[eqn.params["name"]] += 1
    elif eqn.primitive.name.startswith("dot_product_attention"):
      counts[eqn.primitive.name] += 1
    for sub in _sub_jaxprs(eqn):
      _count_kernels(sub, counts)
  return counts


def _model(remat: str, implementation: str = "pallas", **changes):
  cfg = dataclasses.replace(MODEL, remat=remat, attention_implementation=implementation,
                            **changes)
  return nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def _tokens():
  return jax.random.randint(jax.random.key(1), (B, T), 0, MODEL.vocab_size)


@functools.cache
def _forward_and_backward_kernels(remat: str, **changes
                                  ) -> tuple[collections.Counter, collections.Counter]:
  """Kernels of the forward pass (the loss alone) and of the backward pass (what the loss and its
  gradient run beyond the forward)."""
  graphdef, params = _model(remat, **changes)
  tokens = _tokens()

  def loss(p):
    nll, _ = loss_sums(graphdef, p, tokens, tokens, jnp.ones((B, T)), chunk=32)
    return nll

  forward = _count_kernels(jax.make_jaxpr(loss)(params).jaxpr, collections.Counter())
  both = _count_kernels(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr,
                        collections.Counter())
  return forward, both - forward


@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_the_backward_never_selects(remat):
  forward, backward = _forward_and_backward_kernels(remat)
  selection = {n: c for n, c in forward.items() if n.startswith(SELECTION_KERNELS)}
  assert selection and all(c == MODEL.num_layers for c in selection.values()), forward
  assert not {n for n in backward if n.startswith(SELECTION_KERNELS)}, backward
  # The counts see the backward: its dq kernel, and the forward kernel wherever it runs again.
  assert backward["pisa_sparse_attention_dq"] == MODEL.num_layers, backward
  assert forward[ATTENTION_FORWARD] == MODEL.num_layers, forward
  rerun = 0 if remat in SAVING_ATTENTION else MODEL.num_layers
  assert backward[ATTENTION_FORWARD] == rerun, (remat, backward)


@pytest.mark.gpu
@pytest.mark.parametrize("remat", REMAT_POLICIES)
def test_dense_keeps_cudnns_forward_under_the_same_policies(remat):
  # The dense twin: cuDNN's fused forward runs again in the backward exactly where PISA's would.
  forward, backward = _forward_and_backward_kernels(
      remat, implementation=None, attention="dense", compute_dtype="bfloat16")
  name = "dot_product_attention_fwd_wrapper"
  assert forward[name] == MODEL.num_layers, forward
  assert backward["dot_product_attention_bwd_wrapper"] == MODEL.num_layers, backward
  assert backward[name] == (0 if remat in SAVING_ATTENTION else MODEL.num_layers), backward


def _saved(remat: str, implementation: str) -> list[tuple[tuple[int, ...], str]]:
  """(shape, dtype) of what the forward keeps per layer for the backward: the values with the
  sequence axis that a 2-layer model keeps beyond a 1-layer one."""
  def saved(num_layers):
    graphdef, params = _model(remat, implementation, num_layers=num_layers)
    tokens = _tokens()
    text = io.StringIO()
    with contextlib.redirect_stdout(text):  # one line per value: "i32[1,96,2,3] named ..."
      print_saved_residuals(lambda p: nnx.merge(graphdef, p).hidden_states(tokens).sum(), params)
    values = [(tuple(int(n) for n in m.group(2).split(",") if n), m.group(1))
              for m in re.finditer(r"^(\w+)\[([\d,]*)\]", text.getvalue(), re.MULTILINE)]
    assert values, text.getvalue()
    return collections.Counter(v for v in values if T in v[0])

  return sorted((saved(2) - saved(1)).elements())


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_policies_save_the_indices_and_the_attention_residuals(implementation):
  # What the policies document, to the shape: "full" keeps the block input and the indices,
  # "full_save_attention" adds the attention output and its log-sum-exp, both implementations.
  h, g, k, d, e = MODEL.num_kv_heads, MODEL.num_heads // MODEL.num_kv_heads, MODEL.top_k, \
      MODEL.head_dim, MODEL.d_model
  block_input, indices = ((B, T, e), "f32"), ((B, T, h, k), "i32")
  # The kernel's output is viewed [B, T, HKV, G, D], the reference's [B, T, HQ, D]: equal bytes.
  out = ((B, T, h, g, d) if implementation == "pallas" else (B, T, h * g, d), "f32")
  lse = ((B, T, h, g), "f32")
  assert _saved("full", implementation) == sorted([block_input, indices])
  assert _saved("full_save_attention", implementation) == sorted([block_input, indices, out, lse])


# Training: a few AdamW steps through the trainer, the Pallas kernels in interpret mode (1 layer,
# T = 64: four blocks of 16, three selected).
MICRO = [
    "model.vocab_size=64", "model.vocab_pad_multiple=64", "model.num_layers=1",
    "model.d_model=32", "model.mlp_dim=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=16", "model.block_size=16", "model.top_k=3", "model.compute_dtype=float32",
    "model.attention_implementation=pallas", "data.mqar_num_pairs=4", "train.seq_len=64",
    "train.per_device_batch=1", "train.grad_accum=1", "train.steps=4", "train.warmup_steps=1",
    "train.decay_steps=1", "train.peak_lr=3e-3", "train.loss_chunk=32",
]
STEPS = 3


@functools.cache
def _loss_curve(remat: str) -> list[float]:
  """The losses of STEPS training steps, then the last step's gradient and parameter norms."""
  from pisa_jax.train.data import make_batches
  cfg = validate(apply_overrides(get_config("tiny"), MICRO + [f"model.remat={remat}"]))
  trainer = build_trainer(cfg)
  state = trainer.init_state()
  batches = make_batches(cfg, "train", global_batch=trainer.global_batch, accum=1)
  losses = []
  for step in range(STEPS):
    state, metrics = trainer.train_step(
        state, trainer.place_batch(batches.batch(step), trainer.batch_shardings))
    losses.append(float(metrics["loss"]))
  return losses + [float(metrics["grad_norm"]), float(metrics["param_norm"])]


@pytest.mark.parametrize("remat", [
    "full_save_attention",
    # A second compiled trainer; the gradients under every policy are pinned per step by
    # test_train_long_context's remat cases.
    pytest.param("dots_save_attention", marks=pytest.mark.slow)])
def test_the_loss_curve_is_the_one_that_keeps_everything(remat):
  # The same steps under "none" (nothing recomputed) and under a policy that keeps the indices
  # and the attention residuals: the losses, the last gradient norm and parameter norm agree to
  # float32 rounding (remat reorders no sum; XLA may fuse the recomputed elementwise ops apart).
  got, want = _loss_curve(remat), _loss_curve("none")
  np.testing.assert_allclose(got, want, rtol=2e-6)
  assert len(set(got[:STEPS])) == STEPS, got  # the model trains: the curve moves
