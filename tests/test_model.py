"""The NNX decoder: shapes, parameter counts of the presets, causality for every attention kind."""

import ast
import dataclasses
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pisa_jax import _validation
from pisa_jax.configs import get_config
from pisa_jax.models import (
    ATTENTION_KINDS,
    LOGICAL_AXIS_RULES,
    SPARSE_ATTENTION_KINDS,
    Decoder,
    ModelConfig,
    count_params,
)
from pisa_jax.models.decoder import apply_rope, rope_angles

# Small enough for interpret-free CPU runs; T=72 is not a multiple of the block size (16).
SMALL = ModelConfig(
    vocab_size=97, vocab_pad_multiple=32, num_layers=2, d_model=32, mlp_dim=64, num_heads=4,
    num_kv_heads=2, head_dim=16, block_size=16, top_k=3, branching=2, param_dtype="float32",
    compute_dtype="float32", attention="dense",
)


def _model(**overrides) -> Decoder:
  return Decoder(dataclasses.replace(SMALL, **overrides), rngs=nnx.Rngs(0))


def test_logits_shape_and_padding_rows():
  model = _model()
  tokens = jax.random.randint(jax.random.key(1), (2, 72), 0, SMALL.vocab_size)
  logits = model(tokens)
  assert logits.shape == (2, 72, 128)  # 97 padded to a multiple of 32
  assert logits.dtype == jnp.float32
  # Padding rows carry no probability: the softmax is over the 97 real tokens.
  probs = jax.nn.softmax(logits, axis=-1)
  assert float(probs[..., 97:].max()) == 0.0
  np.testing.assert_allclose(probs[..., :97].sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name,expected", [
    ("418m", 418e6), ("1.47b", 1.47e9), ("2.67b", 2.67e9), ("small", 105e6),
])
def test_preset_parameter_counts(name, expected):
  cfg = get_config(name).model
  assert cfg.padded_vocab_size == 50_432  # Appendix C.1: 50,257 padded to 50,432 rows
  assert abs(count_params(cfg) - expected) / expected < 0.005


def test_count_params_matches_the_module():
  model = _model()
  state = nnx.state(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(state)) == count_params(SMALL)


def test_every_param_has_a_logical_axis_rule():
  for path, var in nnx.to_flat_state(nnx.state(_model(), nnx.Param)):
    axes = var.get_metadata()["logical_axes"]
    assert len(axes) == var.get_value().ndim, path
    assert all(a in LOGICAL_AXIS_RULES for a in axes), (path, axes)


def test_batch_axes_of_names_the_missing_mesh_axes():
  from jax.sharding import AbstractMesh, AxisType

  from pisa_jax.models.sharding import batch_axes_of

  def mesh(shape, names, *types):
    return AbstractMesh(shape, names, axis_types=types or (AxisType.Auto,) * len(names))

  assert batch_axes_of(AbstractMesh((), ())) is None  # no mesh: nothing to split
  assert batch_axes_of(mesh((1, 1), ("data", "fsdp"))) is None  # one device
  assert batch_axes_of(mesh((2, 2), ("data", "fsdp"))) == LOGICAL_AXIS_RULES["batch"]
  assert batch_axes_of(mesh((1, 4), ("data", "fsdp"))) == LOGICAL_AXIS_RULES["batch"]
  # Inside a shard_map: only the axes still Auto split the batch.
  assert batch_axes_of(mesh((2, 2), ("data", "fsdp"), AxisType.Manual, AxisType.Auto)) == "fsdp"
  assert batch_axes_of(mesh((2, 2), ("dp", "tp"), AxisType.Manual, AxisType.Manual)) is None
  # A user's mesh with its own axis names, or Explicit axes, fails loudly instead of an XLA error
  # deep in the step.
  with pytest.raises(ValueError, match=r"missing \('data', 'fsdp'\)"):
    batch_axes_of(mesh((2, 2), ("dp", "tp")))
  with pytest.raises(ValueError, match=r"\('data', 'fsdp'\) are Explicit"):
    batch_axes_of(AbstractMesh((2, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2))


def test_rope_rotates_only_the_high_frequency_half():
  cos, sin = rope_angles(8, 16, 10_000.0)
  assert cos.shape == (8, 4)
  # Frequencies are the highest quarter of a full 16-dim RoPE spectrum: base^(-2i/16), i < 4.
  np.testing.assert_allclose(jnp.arctan2(sin[1], cos[1]), 10_000.0 ** (-2 * np.arange(4) / 16),
                             rtol=1e-6)
  x = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
  y = apply_rope(x, cos, sin)
  np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
  np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=1e-6)  # position 0: no rotation
  # A rotation: the norm of the rotated half is unchanged.
  np.testing.assert_allclose(jnp.linalg.norm(y[..., :8], axis=-1),
                             jnp.linalg.norm(x[..., :8], axis=-1), rtol=1e-5)


def test_rope_scores_depend_on_relative_position_only():
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  cos, sin = rope_angles(40, 16, 10_000.0)

  def score(tq, tk):
    qr = apply_rope(jnp.broadcast_to(q, (1, 40, 1, 16)), cos, sin)[0, tq, 0]
    kr = apply_rope(jnp.broadcast_to(k, (1, 40, 1, 16)), cos, sin)[0, tk, 0]
    return float(qr @ kr)

  np.testing.assert_allclose(score(10, 3), score(37, 30), rtol=1e-4)


@pytest.mark.parametrize("head_dim,base,kept", [(64, 1e4, 23), (128, 1e4, 46), (64, 8e4, 19)])
def test_a_hope_cut_scores_as_the_public_hils_rope(head_dim, base, kept):
  """rope_fraction=1.0, rope_max_period=4096 (HiLS's public in-range RoPE: L = 8192, m = 2): the
  q.k scores at any two positions equal those of a full rotate-half RoPE over the head whose
  frequencies below 2 pi / 4096 are zeroed (the first always kept), once the dims are laid out
  as ours: kept pairs (j, j + D/2) -> (j, j + R/2), the rest after R."""
  from pisa_jax.models.config import ModelConfig
  from pisa_jax.models.decoder import RopeSpec

  cfg = ModelConfig(head_dim=head_dim, rope_base=base, rope_fraction=1.0, rope_max_period=4096)
  half = head_dim // 2
  inv = base ** (-2.0 * np.arange(half) / head_dim)
  keep = inv >= 2 * np.pi / 4096
  keep[0] = True
  assert keep.sum() == kept and cfg.rotary_dims == 2 * kept

  def public(x, pos):  # [D] at one position, float64
    angle = pos * np.where(keep, inv, 0.0)
    cos, sin = np.cos(np.concatenate([angle, angle])), np.sin(np.concatenate([angle, angle]))
    return x * cos + np.concatenate([-x[half:], x[:half]]) * sin

  rest = [i for j in range(kept, half) for i in (j, j + half)]
  ours_from_public = np.array(list(range(kept)) + [j + half for j in range(kept)] + rest)
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, head_dim))
  positions = jnp.asarray([0, 1, 777, 4095, 9000], jnp.int32)
  cos, sin = RopeSpec.of(cfg).at(positions)
  rotate = lambda x: np.asarray(apply_rope(
      jnp.broadcast_to(jnp.asarray(x[ours_from_public], jnp.float32), (1, 5, 1, head_dim)),
      cos, sin)[0, :, 0], np.float64)
  ours_q, ours_k = rotate(q), rotate(k)
  for a, m in enumerate(positions.tolist()):
    for b, n in enumerate(positions.tolist()):
      np.testing.assert_allclose(ours_q[a] @ ours_k[b], public(q, m) @ public(k, n),
                                 rtol=1e-4, atol=1e-4, err_msg=f"positions {m}, {n}")


@pytest.mark.parametrize("attention", ATTENTION_KINDS)
def test_causality(attention):
  """Changing a future token leaves every earlier logit unchanged, for every attention kind."""
  model = _model(attention=attention)
  fn = jax.jit(lambda t: model(t))
  tokens = jax.random.randint(jax.random.key(2), (2, 72), 0, SMALL.vocab_size)
  changed = tokens.at[:, 50].set((tokens[:, 50] + 1) % SMALL.vocab_size)
  a, b = fn(tokens), fn(changed)
  np.testing.assert_allclose(a[:, :50], b[:, :50], atol=1e-6, rtol=0)
  assert float(jnp.abs(a[:, 50:] - b[:, 50:]).max()) > 1e-4  # the change is visible afterwards


class SparseEqualsDenseTest(chex.TestCase):
  """top_k covering all blocks makes PISA exact attention (a wiring check of the layer).

  Eagerly the library checks the selected indices' values; under jit they are tracers: both paths.
  """

  @chex.variants(with_jit=True, without_jit=True)
  def test_sparse_equals_dense_when_every_block_is_selected(self):
    tokens = jax.random.randint(jax.random.key(3), (1, 64), 0, SMALL.vocab_size)

    def logits(attention, **overrides):
      graphdef, params = nnx.split(_model(attention=attention, **overrides), nnx.Param)
      return self.variant(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)

    sparse = logits("pisa", top_k=4)  # 64 / 16 = 4 blocks
    chex.assert_shape(sparse, (1, 64, 128))
    chex.assert_trees_all_close(sparse, logits("dense"), atol=2e-4, rtol=1e-4)


def test_bfloat16_params_and_compute():
  model = _model(param_dtype="bfloat16", compute_dtype="bfloat16", attention="pisa")
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(x.dtype == jnp.bfloat16 for x in leaves)
  logits = model(jnp.zeros((1, 32), jnp.int32))
  assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits[..., :97]).all())


def test_sparse_kinds_are_library_selectors():
  assert set(SPARSE_ATTENTION_KINDS) <= set(_validation.SELECTORS)
  assert set(ATTENTION_KINDS) == {"dense", "nsa", "hils", *SPARSE_ATTENTION_KINDS}


def test_models_import_neither_configs_nor_train():
  # Data flows one way: configs -> train -> models -> pisa_jax API -> kernels.
  root = Path(__file__).resolve().parents[1] / "models"
  for path in root.glob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      for name in names:
        assert not name.startswith(("pisa_jax.configs", "pisa_jax.train")), (path.name, name)


def test_a_token_array_of_the_wrong_rank_is_a_clear_error():
  with pytest.raises(AssertionError, match="rank"):
    _model()(jnp.zeros((72,), jnp.int32))


def test_sparse_attended_keys_count_each_querys_blocks():
  """MFU's attention term for the sparse kinds: the mean over positions of the keys a query
  attends (its K - 1 other blocks and the current block up to t), against a direct count."""
  from pisa_jax.models.decoder import sparse_attended_keys

  for seq_len, top_k, block_size in [(4096, 8, 64), (16384, 32, 64), (100, 3, 16), (5, 8, 64),
                                      (1000, 4, 7), (64, 1, 64)]:
    t = np.arange(seq_len)
    keys = np.minimum(t + 1, (top_k - 1) * block_size + t % block_size + 1)
    assert sparse_attended_keys(seq_len, top_k, block_size) == pytest.approx(keys.mean())
