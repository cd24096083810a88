"""Pallas sparse attention (interpret mode on CPU) against the jnp reference, forward and gradients.

Interpret mode fills every output buffer with NaN before the kernel runs (Pallas'
`uninitialized_value`), so an element the kernel never writes fails the finiteness checks below.
"""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
from pisa_jax.kernels import attention as attn
import tolerances as tol


def random_indices(seed, b, t, hkv, top_k, block_size):
  """Valid causal indices: distinct, ascending, <= t // C, -1 padding; current block usually in."""
  rng = np.random.default_rng(seed)
  out = np.full((b, t, hkv, top_k), -1, np.int32)
  for bi in range(b):
    for ti in range(t):
      cur = ti // block_size
      for h in range(hkv):
        n = min(top_k, cur + 1) if rng.random() < 0.9 else rng.integers(0, min(top_k, cur + 1) + 1)
        chosen = rng.choice(cur + 1, n, replace=False)
        if n and cur not in chosen and rng.random() < 0.7:
          chosen[0] = cur
        out[bi, ti, h, :n] = np.sort(chosen)
  return jnp.asarray(out)


def make_inputs(seed, b, t, hq, hkv, d, dtype):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, t, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (b, t, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, t, hkv, d), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (b, t, hq, d), jnp.float32).astype(dtype)
  return q, k, v, do


def pallas_fn(block_size, scale, config=None):
  def f(q, k, v, idx):
    return attn.sparse_attention_pallas(q, k, v, idx, block_size=block_size, scale=scale,
                                        interpret=True, config=config)
  return f


def value_and_grads(fn, q, k, v, idx, do):
  out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v)
  return (out,) + tuple(vjp(do))


def reference_value_and_grads(q, k, v, idx, do, block_size, scale):
  f32 = lambda x: x.astype(jnp.float32)

  def ref(q, k, v, idx):
    return pisa_jax.sparse_attention(q, k, v, idx, block_size=block_size, scale=scale,
                                     implementation="xla")

  return value_and_grads(ref, f32(q), f32(k), f32(v), idx, f32(do))


def assert_matches(got, want, dtype):
  for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
    g = np.asarray(g.astype(jnp.float32))
    assert np.all(np.isfinite(g)), f"{name} has non-finite (unwritten or NaN) entries"
    atol = tol.OUTPUT_ATOL[dtype] if name == "o" else tol.GRAD_ATOL[dtype]
    rtol = tol.OUTPUT_RTOL[dtype] if name == "o" else tol.GRAD_RTOL[dtype]
    np.testing.assert_allclose(g, np.asarray(w), atol=atol, rtol=rtol, err_msg=name)


CASES = [
    # T, HQ, HKV, D, C, K, dtype
    (1, 4, 2, 64, 16, 3, jnp.float32),
    (63, 4, 2, 64, 16, 3, jnp.float32),
    (65, 3, 1, 128, 16, 4, jnp.bfloat16),
    (200, 16, 1, 48, 16, 8, jnp.float32),
    (130, 2, 2, 64, 8, 16, jnp.bfloat16),
    (100, 6, 1, 32, 16, 1, jnp.float16),
]


def case_id(case):
  t, hq, hkv, d, c, k, dtype = case
  return f"T{t}-HQ{hq}-HKV{hkv}-D{d}-C{c}-K{k}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference_random_indices(case):
  t, hq, hkv, d, c, top_k, dtype = case
  q, k, v, do = make_inputs(t, 1, t, hq, hkv, d, dtype)
  idx = random_indices(t, 1, t, hkv, top_k, c)
  scale = d ** -0.5
  got = jax.jit(lambda *a: value_and_grads(pallas_fn(c, scale), *a))(q, k, v, idx, do)
  want = reference_value_and_grads(q, k, v, idx, do, c, scale)
  assert got[0].dtype == dtype
  assert_matches(got, want, dtype)


def test_matches_reference_selected_indices():
  """Indices from the real PISA selection, batch 2, a group of 2, T not a multiple of C."""
  t, hq, hkv, d, c, top_k, dtype = 150, 4, 2, 64, 16, 4, jnp.float32
  q, k, v, do = make_inputs(7, 2, t, hq, hkv, d, dtype)
  idx = pisa_jax.select_blocks(q, k, block_size=c, top_k=top_k, implementation="xla")
  scale = 0.3
  got = jax.jit(lambda *a: value_and_grads(pallas_fn(c, scale), *a))(q, k, v, idx, do)
  want = reference_value_and_grads(q, k, v, idx, do, c, scale)
  assert_matches(got, want, dtype)


def test_split_work_items_and_bitwise_repeat():
  """Blocks selected by more queries than `items_entries` are split into several dk/dv programs;
  the partial sums still match the reference, and two runs are bit-identical."""
  t, hq, hkv, d, c, top_k = 96, 2, 1, 16, 8, 5
  q, k, v, do = make_inputs(3, 1, t, hq, hkv, d, jnp.float32)
  idx = random_indices(3, 1, t, hkv, top_k, c)
  config = attn.SparseAttentionConfig(items_entries=5, dkv_rows=16)
  fn = jax.jit(lambda *a: value_and_grads(pallas_fn(c, 0.25, config), *a))
  first = fn(q, k, v, idx, do)
  second = fn(q, k, v, idx, do)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert_matches(first, reference_value_and_grads(q, k, v, idx, do, c, 0.25), jnp.float32)


@pytest.mark.parametrize("t,hq,hkv,c,step,dtype", [(150, 4, 2, 64, 16, jnp.float32),
                                                   (70, 3, 1, 32, 16, jnp.bfloat16),
                                                   (100, 16, 2, 48, 16, jnp.float32)])
def test_forward_in_sub_block_steps(t, hq, hkv, c, step, dtype):
  """`fwd_step_keys`: each selected block streamed in C / step steps of one online softmax
  (C = 48: three steps) gives the reference's output and gradients, including rows with -1
  padding and blocks with keys after the query, at GQA groups 2, 3 and 8."""
  d, top_k = 32, 3
  q, k, v, do = make_inputs(11, 1, t, hq, hkv, d, dtype)
  idx = random_indices(11, 1, t, hkv, top_k, c)
  config = attn.SparseAttentionConfig(fwd_step_keys=step)
  got = jax.jit(lambda *a: value_and_grads(pallas_fn(c, 0.2, config), *a))(q, k, v, idx, do)
  assert_matches(got, reference_value_and_grads(q, k, v, idx, do, c, 0.2), dtype)


def test_inverted_index_lists_every_valid_entry_once():
  t, hkv, top_k, c, items = 70, 2, 4, 8, 3
  idx = np.array(random_indices(5, 1, t, hkv, top_k, c))
  idx[0, 9, 0, 1] = 5  # a future block: invalid for query 9 (current block 1), must be dropped
  num_blocks = -(-t // c)
  entry_query, item_block, item_start, item_end, item_offsets = jax.tree.map(
      np.asarray, attn.inverted_index(jnp.asarray(idx), num_blocks=num_blocks, block_size=c,
                                      items_entries=items))
  for h in range(hkv):
    for n in range(num_blocks):
      want = [ti for ti in range(t) if n in idx[0, ti, h] and n <= ti // c]
      got = []
      for i in range(item_offsets[0, h, n], item_offsets[0, h, n + 1]):
        assert item_block[0, h, i] == n
        assert 0 < item_end[0, h, i] - item_start[0, h, i] <= items
        got += list(entry_query[0, h, item_start[0, h, i]:item_end[0, h, i]])
      assert got == want, (h, n)


def test_row_without_visible_key_gives_zeros():
  t, hq, hkv, d, c, top_k = 40, 4, 2, 32, 8, 3
  q, k, v, do = make_inputs(11, 1, t, hq, hkv, d, jnp.float32)
  idx = np.array(random_indices(11, 1, t, hkv, top_k, c))
  idx[0, 5:9, 0, :] = -1  # no block at all
  idx[0, 30, 1, :] = [-1, -1, -1]
  fn = jax.jit(lambda *a: value_and_grads(pallas_fn(c, d ** -0.5), *a))
  got = fn(q, k, v, jnp.asarray(idx), do)
  out = np.asarray(got[0])
  np.testing.assert_array_equal(out[0, 5:9, 0:2], 0.0)
  np.testing.assert_array_equal(out[0, 30, 2:4], 0.0)
  assert np.all(np.asarray(got[1])[0, 5:9, 0:2] == 0.0)
  assert_matches(got, reference_value_and_grads(q, k, v, jnp.asarray(idx), do, c, d ** -0.5),
                 jnp.float32)


def test_interpret_mode_poisons_outputs_with_nan():
  """The finiteness checks above rely on interpret mode starting outputs as NaN."""
  from jax._src.pallas import primitives as pallas_primitives

  assert np.isnan(np.asarray(pallas_primitives.uninitialized_value((), jnp.bfloat16)))
  assert np.isnan(np.asarray(pallas_primitives.uninitialized_value((), jnp.float32)))


def test_vmap_and_public_dispatch():
  t, hq, hkv, d, c, top_k = 33, 2, 1, 16, 8, 3
  qs, ks, vs, dos = zip(*(make_inputs(s, 1, t, hq, hkv, d, jnp.float32) for s in range(3)))
  q, k, v, do = (jnp.stack(x) for x in (qs, ks, vs, dos))
  idx = jnp.stack([random_indices(s, 1, t, hkv, top_k, c) for s in range(3)])

  def loss(q, k, v, idx):
    out = pisa_jax.sparse_attention(q, k, v, idx, block_size=c, implementation="pallas")
    return out

  batched = jax.jit(jax.vmap(lambda *a: value_and_grads(loss, *a)))(q, k, v, idx, do)
  for i in range(3):
    want = reference_value_and_grads(q[i], k[i], v[i], idx[i], do[i], c, d ** -0.5)
    assert_matches([x[i] for x in batched], want, jnp.float32)


def test_config_validation():
  with pytest.raises(ValueError, match="dkv_rows"):
    attn.SparseAttentionConfig(dkv_rows=48)
  with pytest.raises(ValueError, match="items_entries"):
    attn.SparseAttentionConfig(items_entries=0)
  for bad in (8, 24):
    with pytest.raises(ValueError, match="fwd_step_keys"):
      attn.SparseAttentionConfig(fwd_step_keys=bad)
  q = jnp.zeros((1, 8, 2, 16))
  k = jnp.zeros((1, 8, 1, 16))
  idx = jnp.zeros((1, 8, 1, 1), jnp.int32)
  with pytest.raises(ValueError, match="fwd_step_keys=32 must divide block_size=16"):
    attn.sparse_attention_pallas(q, k, k, idx, block_size=16, scale=1.0, interpret=True,
                                 config=attn.SparseAttentionConfig(fwd_step_keys=32))


_SHARDED_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.config.update("jax_default_matmul_precision", "highest")
    from pisa_jax.kernels import attention as attn
    assert jax.device_count() == 4, jax.devices()
    b, t, hq, hkv, d, c, top_k = 4, 24, 2, 1, 16, 8, 3
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, d))
    do = jax.random.normal(keys[3], (b, t, hq, d))
    cur = jnp.arange(t)[None, :, None, None] // c
    idx = jnp.broadcast_to(jnp.maximum(cur - jnp.arange(top_k)[::-1], -1), (b, t, hkv, top_k))
    idx = idx.astype(jnp.int32)
    def fg(q, k, v, idx, do):
      f = lambda q, k, v: attn.sparse_attention_pallas(q, k, v, idx, block_size=c, scale=0.25,
                                                       interpret=True)
      out, vjp = jax.vjp(f, q, k, v)
      return (out,) + vjp(do)
    plain = jax.jit(fg)(q, k, v, idx, do)
    # Automatic SPMD: a jit over batch-sharded inputs.
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    shard = NamedSharding(mesh, P("data"))
    args = [jax.device_put(x, shard) for x in (q, k, v, idx, do)]
    sharded = jax.jit(fg, out_shardings=shard)(*args)
    # shard_map over the batch axis: each device runs the kernels on its own rows (the way a model
    # under an explicit mesh calls them; check_vma=False: the pallas out_shapes carry no vma).
    mapped = jax.jit(jax.shard_map(fg, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                  check_vma=False))(*args)
    for a, m, p in zip(sharded, mapped, plain):
      assert a.sharding.is_equivalent_to(shard, a.ndim)
      np.testing.assert_allclose(np.asarray(a), np.asarray(p), atol=1e-5, rtol=1e-5)
      np.testing.assert_allclose(np.asarray(m), np.asarray(p), atol=1e-5, rtol=1e-5)
    print("SHARDED_OK")
""")


def test_sharded_jit_over_batch_mesh():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=600)
  assert "SHARDED_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
