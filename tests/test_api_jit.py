"""The public functions behave the same eagerly and under `jax.jit`: options static, arrays traced,
block indices checked under `checkify`, unchecked invalid indices handled as documented, mixed
dtypes rejected."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pisa_jax
from pisa_jax import testing

T, HQ, HKV, D, C, K = 96, 4, 2, 16, 16, 4


def make_qkv(dtype=jnp.float32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (1, T, HQ, D), dtype), jax.random.normal(kk, (1, T, HKV, D), dtype),
          jax.random.normal(kv, (1, T, HKV, D), dtype))


def indices(q, k):
  return pisa_jax.select_blocks(q, k, block_size=C, top_k=K, implementation="xla")


# Each public function: (function, its arrays from (q, k, v, idx), options beyond the defaults).
CALLS = {
    "build_pyramid": (pisa_jax.build_pyramid, lambda q, k, v, i: (k,),
                      dict(block_size=C, branching=3)),
    "select_blocks": (pisa_jax.select_blocks, lambda q, k, v, i: (q, k),
                      dict(block_size=C, top_k=K, selector="pisa2")),
    "sparse_attention": (pisa_jax.sparse_attention, lambda q, k, v, i: (q, k, v, i),
                         dict(block_size=C, scale=0.3)),
    "pisa_attention": (pisa_jax.pisa_attention, lambda q, k, v, i: (q, k, v),
                       dict(block_size=C, top_k=K, beam=6)),
    "selection_quality": (pisa_jax.selection_quality, lambda q, k, v, i: (q, k, i),
                          dict(block_size=C)),
}


def assert_same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", CALLS)
def test_jit_equals_eager(name):
  fn, arrays, options = CALLS[name]
  q, k, v = make_qkv()
  # Arrays traced, default options (block_size 64).
  args = arrays(q, k, v, pisa_jax.select_blocks(q, k, implementation="xla"))
  assert_same(jax.jit(fn)(*args), fn(*args))
  # Options as static arguments, or bound before jitting.
  args = arrays(q, k, v, indices(q, k))
  eager = fn(*args, **options)
  assert_same(jax.jit(fn, static_argnames=tuple(options))(*args, **options), eager)
  assert_same(jax.jit(functools.partial(fn, **options))(*args), eager)


@pytest.mark.parametrize("name", CALLS)
def test_a_traced_option_says_how_to_make_it_static(name):
  # jit traces every argument it is not told is static; an option that fixes shapes cannot be
  # recovered from a tracer, so the error names it and both fixes.
  fn, arrays, options = CALLS[name]
  q, k, v = make_qkv()
  args = arrays(q, k, v, indices(q, k))
  option = next(o for o, value in options.items() if not isinstance(value, str))
  with pytest.raises(TypeError, match=rf"{option} is traced: {name} was called under jax.jit.*"
                                      rf"static_argnames=.*functools.partial"):
    jax.jit(fn)(*args, **{option: options[option]})


def invalid_indices(idx):
  """An out-of-range entry and a repeated one, in two different rows."""
  out_of_range = idx.at[0, 70, 1, 1].set(T // C + 3)
  repeated = idx.at[0, 80, 0, 1].set(idx[0, 80, 0, 2])
  return out_of_range, repeated


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_checkify_reports_invalid_indices_under_jit(implementation):
  q, k, v = make_qkv()
  out_of_range, repeated = invalid_indices(indices(q, k))
  attend = jax.jit(functools.partial(pisa_jax.sparse_attention, block_size=C,
                                     implementation=implementation))
  quality = jax.jit(functools.partial(pisa_jax.selection_quality, block_size=C))
  for fn, args in ((attend, (q, k, v)), (quality, (q, k))):
    # Outside the context nothing is traced: no effect, so jit keeps its fast dispatch.
    assert not fn.trace(*args, out_of_range).jaxpr.effects
    err, _ = checkify.checkify(fn)(*args, out_of_range)
    assert err.get() is None
    with pisa_jax.traced_checks(True):
      err, _ = checkify.checkify(fn)(*args, out_of_range)
      assert ("block_indices must lie in [-1, 6) for T=96 and block_size=16: found values in "
              "[-1, 9]") in err.get()
      err, _ = checkify.checkify(fn)(*args, repeated)
      assert "must not repeat a block index" in err.get()
      err, _ = checkify.checkify(fn)(*args, indices(q, k))
      assert err.get() is None
  # Gradients too: the checks sit before the attention, outside its custom_vjp.
  grad = jax.jit(jax.grad(lambda q, idx: attend(q, k, v, idx).sum()))
  with pisa_jax.traced_checks(True):
    err, _ = checkify.checkify(grad)(q, out_of_range)
  assert "must lie in" in err.get()
  # Eagerly the same indices raise at once.
  with pytest.raises(ValueError, match="must lie in"):
    pisa_jax.sparse_attention(q, k, v, out_of_range, block_size=C, implementation=implementation)


def test_unchecked_out_of_range_indices_do_what_the_docstrings_say():
  q, k, v = make_qkv(seed=1)
  idx = indices(q, k)
  out_of_range, _ = invalid_indices(idx)
  ignored = out_of_range.at[0, 70, 1, 1].set(-1)
  attend = {(impl, masked): jax.jit(functools.partial(
      _attend, implementation=impl, masked=masked)) for impl, masked in
      (("xla", True), ("xla", False), ("pallas", None))}
  # An out-of-range entry is ignored like -1, by every implementation and formulation.
  want = attend["xla", False](q, k, v, ignored)
  for fn in attend.values():
    np.testing.assert_allclose(fn(q, k, v, out_of_range), want, atol=1e-5)
  # selection_quality ignores out-of-range entries too (it used to read a NaN mass).
  quality = jax.jit(functools.partial(pisa_jax.selection_quality, block_size=C))
  assert_same(quality(q, k, out_of_range), pisa_jax.selection_quality(q, k, ignored, block_size=C))


def messy_indices(idx, seed):
  """idx `[B, T, HKV, K]` (no repeats) behind K more entries per row: copies of the row's own
  entries (its blocks again, repeats among them), -1, and out-of-range values, repeated too. The
  row still names exactly idx's blocks, so under the rule it attends what idx does."""
  rng = np.random.default_rng(seed)
  extra = np.take_along_axis(idx, rng.integers(0, idx.shape[-1], idx.shape), axis=-1)
  noise = rng.choice(np.array([-1, -7, T // C + 3]), idx.shape)
  extra = np.where(rng.random(idx.shape) < 0.25, noise, extra)
  messy = np.concatenate([extra, idx], axis=-1)
  # The premise of the test: most rows repeat a block.
  srt = np.sort(messy, axis=-1)
  assert np.mean(np.any((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0), axis=-1)) > 0.5
  return messy


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_unchecked_repeated_blocks_count_once(implementation, packed):
  # Under jit, an entry equal to an earlier one of its row is ignored like -1: the output and the
  # gradients equal those of the same rows without the repeats (and without the -1 and
  # out-of-range entries mixed among them).
  q, k, v = make_qkv(seed=3)
  seg = jnp.asarray(np.repeat([0, 1, 2], [37, 16, 43])[None].astype(np.int32)) if packed else None
  idx = testing.random_block_indices(3, T, HKV, K, C)
  messy = messy_indices(idx, seed=4)
  # The same blocks, no repeats: -1 where messy has its extra entries (one shape, one compile).
  clean = np.concatenate([np.full_like(idx, -1), idx], axis=-1)
  w = jax.random.normal(jax.random.key(5), q.shape)

  @jax.jit
  def loss_and_grads(q, k, v, idx):
    def loss(q, k, v):
      out = pisa_jax.sparse_attention(q, k, v, idx, block_size=C, segment_ids=seg,
                                      implementation=implementation)
      return jnp.sum(out * w), out
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, want), want_grads = loss_and_grads(q, k, v, clean)
  (_, got), got_grads = loss_and_grads(q, k, v, messy)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  for name, g, h in zip("qkv", got_grads, want_grads):
    np.testing.assert_allclose(g, h, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
  # Eagerly the same indices still raise.
  with pytest.raises(ValueError, match="must lie in"):
    pisa_jax.sparse_attention(q, k, v, messy, block_size=C, segment_ids=seg,
                              implementation=implementation)


def _attend(q, k, v, idx, *, implementation, masked):
  if implementation == "pallas":
    return pisa_jax.sparse_attention(q, k, v, idx, block_size=C, implementation="pallas")
  from pisa_jax.attention import sparse_attention_reference
  return sparse_attention_reference(q, k, v, idx, block_size=C, scale=D ** -0.5, masked=masked)


def test_selection_quality_takes_implementation():
  q, k, _ = make_qkv(seed=2)
  idx = indices(q, k)
  assert_same(pisa_jax.selection_quality(q, k, idx, block_size=C, implementation="xla"),
              pisa_jax.selection_quality(q, k, idx, block_size=C))
  with pytest.raises(ValueError, match="'pallas' is not available for selection_quality"):
    pisa_jax.selection_quality(q, k, idx, block_size=C, implementation="pallas")
  with pytest.raises(ValueError, match="implementation='cuda' is unknown"):
    pisa_jax.selection_quality(q, k, idx, block_size=C, implementation="cuda")


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_mixed_dtypes_are_rejected(name, which):
  fn, arrays, _ = CALLS[name]
  q, k, v = make_qkv()
  idx = indices(q, k)
  mixed = dict(q=q, k=k, v=v)
  mixed[which] = mixed[which].astype(jnp.bfloat16)
  args = arrays(mixed["q"], mixed["k"], mixed["v"], idx)
  if not any(a is mixed[which] for a in args):
    pytest.skip(f"{name} does not take {which}")
  if len([a for a in args if a.dtype != jnp.int32]) < 2:
    pytest.skip(f"{name} takes a single float array")
  pair = "q and k" if which != "v" else "k and v"
  with pytest.raises(TypeError, match=f"{pair} must have the same dtype"):
    fn(*args)


def test_traced_checks_takes_a_bool():
  with pytest.raises(TypeError, match=r"traced_checks\(enabled=1\) takes True or False"):
    pisa_jax.traced_checks(1)
  with pisa_jax.traced_checks(True), pisa_jax.traced_checks(False):
    pass
