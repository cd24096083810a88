"""Training: overfitting, kill-and-resume, Ctrl-C, non-finite loss, bad configs and checkpoints,
and the sharded step on 4 fake CPU devices against the single-device step."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.train.checkpoint import IncompatibleCheckpointError
from pisa_jax.train.trainer import NonFiniteLossError, build_trainer, train

# A model that compiles in seconds: 1 layer, 64 tokens, 4 blocks of 16, MQAR with 4 pairs.
MICRO = [
    "model.vocab_size=64", "model.vocab_pad_multiple=64", "model.num_layers=1",
    "model.d_model=32", "model.mlp_dim=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.head_dim=16", "model.block_size=16", "model.top_k=3", "data.mqar_num_pairs=4",
    "train.seq_len=64", "train.per_device_batch=4", "train.grad_accum=2", "train.steps=8",
    "train.warmup_steps=2", "train.decay_steps=2", "train.checkpoint_every=2",
    "train.log_every=1", "train.eval_every=4", "train.eval_batches=1", "train.peak_lr=3e-3",
]


def micro_config(*extra):
  return validate(apply_overrides(get_config("tiny"), MICRO + list(extra)))


@pytest.fixture(scope="module")
def micro_trainer():
  cfg = micro_config()
  return cfg, build_trainer(cfg)


def test_overfits_a_small_batch():
  cfg = micro_config("train.grad_accum=1", "train.lr_schedule=constant", "train.warmup_steps=0",
                     "train.weight_decay=0", "train.decay_steps=0", "train.steps=1000")
  trainer = build_trainer(cfg)
  state = trainer.init_state()
  from pisa_jax.train.data import make_batches

  batch = make_batches(cfg, "train", global_batch=trainer.global_batch, accum=1).batch(0)
  batch = trainer.place_batch(batch, trainer.batch_shardings)
  losses = []
  for _ in range(120):
    state, m = trainer.train_step(state, batch)
    losses.append(float(m["loss"]))
  assert losses[0] > 2.5  # ~ln(32): the answer is one of 32 values
  assert losses[-1] < 0.1 * losses[0], losses[::10]


def test_kill_and_resume_gives_identical_losses(tmp_path, micro_trainer):
  cfg, trainer = micro_trainer
  full = train(cfg, tmp_path / "full", progress=False, quiet=True, trainer=trainer)
  assert sorted(full.losses) == list(range(8))
  first = train(cfg, tmp_path / "cut", run_steps=3, progress=False, quiet=True, trainer=trainer)
  assert first.stopped_early and first.end_step == 3
  assert (tmp_path / "cut" / "checkpoints" / "3").is_dir()
  rest = train(cfg, tmp_path / "cut", progress=False, quiet=True, trainer=trainer)
  assert rest.start_step == 3 and rest.end_step == 8
  resumed = {**first.losses, **rest.losses}
  assert resumed == full.losses  # bit-identical: same data from (seed, step), same state
  assert rest.evals[-1] == full.evals[-1]
  rows = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 9))
  assert all({"lr", "grad_norm", "tokens_per_s", "mfu"} <= set(r) for r in train_rows)
  assert [r["step"] for r in rows if "eval_loss" in r] == [4, 8]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, micro_trainer):
  cfg, trainer = micro_trainer
  good_step = trainer.train_step

  def poisoned_step(state, batch):
    new, m = good_step(state, batch)
    if int(new["step"]) >= 4:  # the update of step 3 blows up
      new = {**new, "params": jax.tree.map(lambda p: p * jnp.nan, new["params"])}
      m = {**m, "param_norm": jnp.float32(jnp.nan)}
    return new, m

  bad = type(trainer)(**{**trainer.__dict__, "train_step": poisoned_step})
  with pytest.raises(NonFiniteLossError, match=r"step 3 .*last good checkpoint is step 2"):
    train(cfg, tmp_path, progress=False, quiet=True, trainer=bad)
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2]


def test_incompatible_checkpoint_is_a_clear_error(tmp_path, micro_trainer):
  cfg, trainer = micro_trainer
  train(cfg, tmp_path, run_steps=2, progress=False, quiet=True, trainer=trainer)
  wider = micro_config("model.mlp_dim=128")
  with pytest.raises(IncompatibleCheckpointError, match=r"model\.mlp_dim: checkpoint 64, now 128"):
    train(wider, tmp_path, progress=False, quiet=True)


@pytest.mark.parametrize("override,field", [
    ("model.nonsense=1", "model.nonsense"),
    ("model.num_kv_heads=3", "model.num_heads"),
    ("model.block_size=512", "model.block_size"),
    ("model.top_k=2", "model.top_k"),
    ("model.beam=4", "model.beam=4 must be None or an int >= model.top_k=8"),
    ("model.branching=1", "model.branching"),
    ("model.block_size=0", "model.block_size"),
    ("model.attention_implementation=triton", "model.attention_implementation"),
    ("model.attention=flash", "model.attention"),
    ("train.steps=ten", "train.steps"),
    ("train.warmup_fraction=0.1", "train.warmup_fraction"),
])
def test_bad_config_fails_naming_the_field(override, field):
  with pytest.raises(ValueError, match=re.escape(field)):
    validate(apply_overrides(get_config("tiny"), [override]))


def test_cli_rejects_a_bad_config_before_compiling(capsys):
  from pisa_jax.train.cli import main

  with pytest.raises(SystemExit) as e:
    main(["--config", "tiny", "--set", "model.top_k=2", "--workdir", "unused"])
  assert e.value.code == 2
  assert "model.top_k=2 must be an int >= 3" in capsys.readouterr().err
  assert main(["--config", "418m", "--print-config"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["model"]["d_model"] == 1024 and printed["train"]["seq_len"] == 4096


def _run_python(code: str, env_extra: dict, timeout: int = 300):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=timeout)


SHARDED_STEP = textwrap.dedent("""
    import json, numpy as np, jax
    from jax.sharding import Mesh
    from pisa_jax.configs import apply_overrides, get_config, validate
    from pisa_jax.train.data import make_batches
    from pisa_jax.train.trainer import build_trainer
    jax.config.update("jax_default_matmul_precision", "highest")
    devs = jax.devices()
    assert len(devs) == 4, devs
    base = MICRO + ["model.attention=pisa"] + EXTRA
    cfg4 = validate(apply_overrides(get_config("tiny"), base + ["train.per_device_batch=2"]))
    cfg1 = validate(apply_overrides(get_config("tiny"), base + ["train.per_device_batch=8"]))
    t4 = build_trainer(cfg4, Mesh(np.array(devs).reshape(2, 2), ("data", "fsdp")))
    t1 = build_trainer(cfg1, Mesh(np.array(devs[:1]).reshape(1, 1), ("data", "fsdp")))
    assert t4.global_batch == t1.global_batch == 8
    batch = make_batches(cfg4, "train", global_batch=8, accum=2).batch(0)
    s4, s1 = t4.init_state(), t1.init_state()
    embed = s4["params"]["embed"]
    assert embed.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp"), embed.sharding
    assert embed.addressable_shards[0].data.shape == (64, 16)
    p0 = jax.tree.map(np.asarray, s1["params"])
    same_init = all(np.array_equal(a, np.asarray(b)) for a, b in
                    zip(jax.tree.leaves(p0), jax.tree.leaves(s4["params"])))
    n4, m4 = t4.train_step(s4, t4.place_batch(batch, t4.batch_shardings))
    n1, m1 = t1.train_step(s1, t1.place_batch(batch, t1.batch_shardings))
    # Adam's first moment after one step is 0.1 x the clipped gradient: it compares the grads.
    mu4 = jax.tree.leaves(n4["opt_state"][1].mu)
    mu1 = jax.tree.leaves(n1["opt_state"][1].mu)
    grad_err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(mu4, mu1))
    grad_scale = max(float(np.max(np.abs(np.asarray(b)))) for b in mu1)
    print(json.dumps({"same_init": same_init, "loss4": float(m4["loss"]), "loss1": float(m1["loss"]),
                      "gn4": float(m4["grad_norm"]), "gn1": float(m1["grad_norm"]),
                      "grad_err": grad_err, "grad_scale": grad_scale}))
""")


# The Pallas case runs the kernels in interpret mode inside the model's per-batch-shard shard_map.
@pytest.mark.parametrize("extra", [[], ["model.attention_implementation=pallas"]], ids=["xla", "pallas"])
def test_sharded_step_on_4_devices_equals_single_device_step(extra):
  code = f"MICRO = {MICRO!r}\nEXTRA = {extra!r}\n" + SHARDED_STEP
  out = _run_python(code, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert r["same_init"]
  np.testing.assert_allclose(r["loss4"], r["loss1"], rtol=1e-5)
  np.testing.assert_allclose(r["gn4"], r["gn1"], rtol=1e-5)
  assert r["grad_err"] <= 1e-5 * r["grad_scale"], r


def test_ctrl_c_saves_a_checkpoint_and_the_run_resumes(tmp_path):
  workdir = tmp_path / "run"
  args = [sys.executable, "-m", "pisa_jax.train.cli", "--config", "tiny", "--workdir", str(workdir),
          "--no-progress"]
  sets = [a for s in MICRO + ["train.steps=100000", "train.checkpoint_every=100000",
                              "train.eval_every=100000", "train.decay_steps=10"]
          for a in ("--set", s)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.Popen(args + sets, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and metrics.read_text().count("\n") >= 2:
      break
    time.sleep(0.5)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out[-3000:]
  assert "Ctrl-C" in out and "stopped at step" in out
  saved = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and saved[0] >= 2
  again = subprocess.run(args + sets + ["--run-steps", "1"], env=env, capture_output=True,
                         text=True, timeout=240)
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"resumed from {workdir / 'checkpoints'}/{saved[0]}" in again.stdout + again.stderr


def test_a_trainer_built_for_another_config_is_refused(tmp_path, micro_trainer):
  _, trainer = micro_trainer
  with pytest.raises(ValueError, match="trainer was built for a different config"):
    train(micro_config("train.peak_lr=1e-3"), tmp_path, progress=False, quiet=True, trainer=trainer)
