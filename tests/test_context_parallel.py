"""Context parallelism: one sequence split over devices (`train.context_parallel`).

The library pieces run in this process: `pisa_attention_at` on each shard of a sequence gives the
rows of the whole call, and the shards' dk and dv add up to the whole gradients. The sharded train
step runs in a subprocess on 2, 4 or 8 fake CPU devices (`--xla_force_host_platform_device_count`)
against one device: logits, loss and gradients equal to float32 rounding, and its checkpoints move
to the unsharded layout and back.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pisa_jax
import test_train
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.context_parallel import dense_attention_at, pisa_attention_at
from pisa_jax.models.sharding import batch_ways, make_mesh

# The reference picks its masked form for T <= 2 K C (64 here) and the gathered one above.
# The kernels ("pallas", interpret mode here: the default fused selection and BSA, the per-query
# attention) take the same offsets, against the same kernels run on the whole sequence.
@pytest.mark.parametrize("seq_len,shards,selector,implementation", [
    (64, 2, "pisa", "xla"), pytest.param(200, 4, "pisa", "xla", marks=pytest.mark.slow),
    (120, 3, "bsa", "xla"),
    (72, 2, "pisa", "pallas"), (60, 3, "bsa", "pallas")],
    ids=["masked-N2", "gathered-N4", "bsa-N3", "pallas-N2", "pallas-bsa-N3"])
def test_shards_equal_the_rows_of_the_whole_sequence(seq_len, shards, selector, implementation):
  b, hq, hkv, d = 2, 4, 2, 16
  keys = jax.random.split(jax.random.key(seq_len), 4)
  q = jax.random.normal(keys[0], (b, seq_len, hq, d))
  k = jax.random.normal(keys[1], (b, seq_len, hkv, d))
  v = jax.random.normal(keys[2], (b, seq_len, hkv, d))
  w = jax.random.normal(keys[3], (b, seq_len, hq, d))
  kw = dict(block_size=8, top_k=4, branching=2, selector=selector, implementation=implementation)

  def loss(attend, q, k, v, w):
    out = attend(q, k, v)
    return jnp.sum(out * w), out

  grads = functools.partial(jax.value_and_grad, argnums=(1, 2, 3), has_aux=True)
  (_, out), (dq, dk, dv) = jax.jit(grads(loss), static_argnums=0)(
      functools.partial(pisa_jax.pisa_attention, **kw), q, k, v, w)
  part = jax.jit(lambda q, k, v, w, offset: grads(loss)(
      lambda q, k, v: pisa_attention_at(q, k, v, offset, **kw), q, k, v, w))
  tl = seq_len // shards
  outs, dqs, dk_sum, dv_sum = [], [], 0.0, 0.0
  for i in range(shards):
    rows = slice(i * tl, (i + 1) * tl)
    (_, o), (g_q, g_k, g_v) = part(q[:, rows], k, v, w[:, rows], i * tl)
    outs.append(o)
    dqs.append(g_q)
    dk_sum, dv_sum = dk_sum + g_k, dv_sum + g_v
  # Selection and the forward rows are the same computation: bit-identical.
  np.testing.assert_array_equal(np.concatenate(outs, axis=1), out)
  np.testing.assert_array_equal(np.concatenate(dqs, axis=1), dq)
  # dk and dv: the shards' shares summed in another order.
  np.testing.assert_allclose(dk_sum, dk, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(dv_sum, dv, rtol=1e-5, atol=2e-6)


def test_dense_attention_at_offsets():
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 48, h, 8)) for i, h in enumerate((4, 2, 2)))
  whole = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  part = dense_attention_at(q[:, 16:32], k, v, 16)
  np.testing.assert_allclose(part, whole[:, 16:32], rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_what_to_change():
  q = jnp.zeros((1, 16, 4, 8))
  k = jnp.zeros((1, 32, 2, 8))
  with pytest.raises(ValueError, match="query_offset=20 must be in \\[0, T - Tq\\] = \\[0, 16\\]"):
    pisa_attention_at(q, k, k, 20, block_size=8, top_k=3, implementation="xla")
  with pytest.raises(ValueError, match="selector='exact' exists only in the reference: pass "
                                       "implementation='xla'"):
    pisa_attention_at(q, k, k, 0, block_size=8, top_k=3, selector="exact",
                      implementation="pallas")
  base = test_train.MICRO
  for extra, match in (
      (["train.context_parallel=3"], "train.context_parallel=3 must divide train.seq_len=64"),
      (["train.context_parallel=0"], "train.context_parallel=0 must be >= 1"),
      (["train.context_parallel=2", "train.loss_chunk=64"],
       "train.loss_chunk=64 must divide train.seq_len / train.context_parallel = 32")):
    with pytest.raises(ValueError, match=match):
      validate(apply_overrides(get_config("tiny"), base + extra))
  # The Pallas kernels take the shard's offset: context parallelism runs on either implementation.
  validate(apply_overrides(get_config("tiny"), base + [
      "train.context_parallel=2", "model.attention_implementation=pallas"]))
  n = jax.local_device_count()
  with pytest.raises(ValueError, match=f"train.context_parallel={n + 1} must be >= 1 and divide "
                                       f"the {n} local devices"):
    make_mesh(-1, n + 1)
  with pytest.raises(ValueError, match="train.context_parallel=2 does not match the mesh"):
    batch_ways(make_mesh(-1, 1), 2)


STEP = textwrap.dedent("""
    import json, re, tempfile
    import numpy as np, jax
    from flax import nnx
    from jax.sharding import Mesh
    from pisa_jax.configs import apply_overrides, get_config, validate
    from pisa_jax.models.sharding import make_mesh
    from pisa_jax.train import checkpoint as ckpt_lib
    from pisa_jax.train.data import make_batches
    from pisa_jax.train.trainer import build_trainer
    jax.config.update("jax_default_matmul_precision", "highest")
    data, fsdp, seq = LAYOUT
    assert jax.device_count() == data * fsdp * seq
    base = MICRO + EXTRA
    cfg_n = validate(apply_overrides(get_config("tiny"), base + [
        f"train.per_device_batch={4 // (data * fsdp)}", f"train.fsdp={fsdp}",
        f"train.context_parallel={seq}"]))
    cfg_1 = validate(apply_overrides(get_config("tiny"), base + ["train.per_device_batch=4"]))
    t_n = build_trainer(cfg_n, make_mesh(fsdp, seq))
    t_1 = build_trainer(cfg_1, Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp")))
    assert t_n.global_batch == t_1.global_batch == 4, (t_n.global_batch, dict(t_n.mesh.shape))
    batches = make_batches(cfg_n, "train", global_batch=4, accum=2)
    s_n, s_1 = t_n.init_state(), t_1.init_state()

    def logits(trainer, params, inputs):
      with jax.set_mesh(trainer.mesh):
        placed = jax.device_put(inputs, trainer.eval_batch_shardings["inputs"])
        out = jax.jit(lambda p, t: nnx.merge(trainer.graphdef, p)(t))(params, placed)
      return out, str(out.sharding.spec)

    out = {"batch_spec": str(t_n.batch_shardings["inputs"].spec)}
    if LOGITS:
      inputs = batches.batch(0)["inputs"][0]
      out_n, out["logits_spec"] = logits(t_n, s_n["params"], inputs)
      out_1, _ = logits(t_1, s_1["params"], inputs)
      out["logits_err"] = float(np.max(np.abs(np.asarray(out_n) - np.asarray(out_1))))
      out["logits_scale"] = float(np.max(np.abs(np.asarray(out_1))))

    def step(trainer, state, i):
      return trainer.train_step(state, trainer.place_batch(batches.batch(i), trainer.batch_shardings))

    def diff(a, b):
      return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                 for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    # Every collective of the sharded step that moves sequence-long data: name, result shape.
    lengths = (cfg_n.train.seq_len, cfg_n.train.seq_len // seq)
    out["long_collectives"] = sorted({
        (op.group(1), dims) for line in t_n.train_step.as_text().splitlines()
        if " = " in line and (op := re.search(r"\\b(all-gather|all-reduce|reduce-scatter|"
                                              r"all-to-all|collective-permute)(-start)?\\(", line))
        for dims in re.findall(r"\\[([0-9,]+)\\]", line.split(" = ", 1)[1].split(op.group(0))[0])
        if set(map(int, dims.split(","))) & set(lengths)})
    n_n, m_n = step(t_n, s_n, 0)
    n_1, m_1 = step(t_1, s_1, 0)
    # Adam's first moment after one step is 0.1 x the clipped gradient: it compares the grads.
    mu_n, mu_1 = n_n["opt_state"][1].mu, n_1["opt_state"][1].mu
    out.update(loss=[float(m_n["loss"]), float(m_1["loss"])],
               grad_norm=[float(m_n["grad_norm"]), float(m_1["grad_norm"])],
               grad_err=diff(mu_n, mu_1), grad_scale=diff(mu_1, jax.tree.map(np.zeros_like, mu_1)))
    # Checkpoints move: each layout's state restores onto the other's shardings, and the next
    # step from the moved states matches the step that never moved.
    tmp = tempfile.mkdtemp()
    moved = {}
    for name, (src, state, cfg, dst, dst_cfg) in {
        "sharded_to_one": (t_n, n_n, cfg_n, t_1, cfg_1),
        "one_to_sharded": (t_1, n_1, cfg_1, t_n, cfg_n)}.items() if MOVE else ():
      writer = ckpt_lib.Checkpointer(f"{tmp}/{name}", use_async=False)
      writer.save(1, state, cfg, force=True)
      writer.close()
      reader = ckpt_lib.Checkpointer(f"{tmp}/{name}", read_only=True)
      moved[name] = reader.restore(1, dst.abstract_state, dst_cfg)
      reader.close()
      out[name + "_restore_err"] = diff(moved[name]["params"], state["params"])
    if MOVE:
      _, m_a = step(t_1, moved["sharded_to_one"], 1)
      _, m_b = step(t_n, moved["one_to_sharded"], 1)
      out["moved_loss"] = [float(m_a["loss"]), float(m_b["loss"])]
    print(json.dumps(out))
""")


def _run(code: str, devices: int) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# (data, fsdp, seq) meshes. The 2-device PISA cases are CI's (their logits are compared through
# the loss only, to stay fast): the reference, and the Pallas kernels at the shards' offsets
# (interpret mode); the rest (fsdp and data beside seq, remat with the chunked loss, dense
# attention, 8 shards of 8 tokens each: shorter than a block) are slow-marked and also compare
# the logits.
@pytest.mark.parametrize("layout,extra", [
    ((1, 1, 2), ["train.seq_len=96", "train.loss_chunk=16"]),
    ((1, 1, 2), ["model.attention_implementation=pallas"]),
    pytest.param((1, 1, 2), ["model.attention=dense"], marks=pytest.mark.slow),
    pytest.param((1, 2, 2), ["model.remat=full", "train.loss_chunk=8"], marks=pytest.mark.slow),
    pytest.param((2, 1, 2), ["model.attention=dense", "model.remat=dots"],
                 marks=pytest.mark.slow),
    pytest.param((1, 1, 8), ["train.loss_chunk=4"], marks=pytest.mark.slow),
    pytest.param((2, 1, 4), ["model.attention=dense"], marks=pytest.mark.slow),
], ids=["seq2-pisa", "seq2-pallas", "seq2-dense", "fsdp2-seq2-remat", "data2-seq2-dense",
        "seq8-pisa", "data2-seq4-dense"])
def test_sharded_sequence_step_equals_single_device_step(layout, extra):
  micro = [m for m in test_train.MICRO if not m.startswith("train.per_device_batch=")]
  fast = layout == (1, 1, 2) and "model.attention=dense" not in extra
  logits = not fast
  # The Pallas case (kernels interpreted on the CPU) skips the checkpoint moves, which test the
  # layouts, not the attention.
  move = "model.attention_implementation=pallas" not in extra
  code = (f"MICRO = {micro!r}\nEXTRA = {extra!r}\nLAYOUT = {layout!r}\nLOGITS = {logits}\n"
          f"MOVE = {move}\n" + STEP)
  r = _run(code, devices=int(np.prod(layout)))
  assert "'seq'" in r["batch_spec"], r
  if logits:
    assert "'seq'" in r["logits_spec"], r
    assert r["logits_err"] <= 1e-5 * r["logits_scale"], r
  np.testing.assert_allclose(*r["loss"], rtol=1e-5)
  np.testing.assert_allclose(*r["grad_norm"], rtol=1e-5)
  assert r["grad_err"] <= 1e-5 * r["grad_scale"], r
  if move:
    assert r["sharded_to_one_restore_err"] == 0 and r["one_to_sharded_restore_err"] == 0, r
    np.testing.assert_allclose(*r["moved_loss"], rtol=1e-5)
  if extra[0] == "train.seq_len=96":
    # 96 tokens, 48 per device (lengths that no parameter has): the only collectives that move
    # sequence-long data are the gathers of k and v [B, T, HKV, D] and, in the backward pass,
    # the reduce-scatters of dk and dv to [B, T / 2, HKV, D]. The loss and every token-wise op
    # stay on the device that holds their tokens.
    assert {tuple(c) for c in r["long_collectives"]} == {
        ("all-gather", "4,96,2,16"), ("reduce-scatter", "4,48,2,16")}, r["long_collectives"]
