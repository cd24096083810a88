"""Training: overfitting, kill-and-resume, Ctrl-C, non-finite loss, bad configs and checkpoints,
and the sharded step on 4 fake CPU devices against the single-device step.

The reliability cases: a refused run leaves its folder as it was; a corrupt checkpoint falls back
to the previous one in one line; SIGKILL at any point (between checkpoints, while one is written,
committed or sealed) resumes to the uninterrupted run's exact losses; a run that cannot fit or has
no data stops before it compiles or writes anything; every CLI mistake is one line.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.train import checkpoint as ckpt_lib
from pisa_jax.train import cli, run_folder
from pisa_jax.train import memory as memory_lib
from pisa_jax.train import trainer as trainer_lib
from pisa_jax.train.checkpoint import CorruptCheckpointError, IncompatibleCheckpointError
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


@pytest.fixture(scope="module")
def micro_reference(micro_trainer, tmp_path_factory):
  """The uninterrupted micro run: its TrainResult and its metrics.jsonl rows."""
  cfg, trainer = micro_trainer
  workdir = tmp_path_factory.mktemp("reference")
  full = train(cfg, workdir, progress=False, quiet=True, trainer=trainer)
  return full, _metric_rows(workdir)


def _metric_rows(workdir) -> list[dict]:
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  # Timing fields differ between runs; everything else must not.
  return [{k: v for k, v in r.items() if k not in ("time", "tokens_per_s", "mfu")} for r in rows]


def _restore(workdir, step, trainer, cfg) -> dict:
  reader = ckpt_lib.Checkpointer(workdir / "checkpoints", read_only=True)
  try:
    return reader.restore(step, trainer.abstract_state, cfg)
  finally:
    reader.close()


def test_init_state_equals_one_jitted_initialiser(micro_trainer, monkeypatch):
  # init_state draws small models' parameters op by op (each shape compiles once, not each
  # parameter), larger ones in one jitted initialiser: the same bits, tree and placement.
  cfg, trainer = micro_trainer
  assert trainer.draws_eagerly
  got = trainer.init_state()
  monkeypatch.setattr(trainer, "draws_eagerly", False)
  want = trainer.init_state()
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kill_and_resume_gives_identical_losses(tmp_path, micro_trainer, micro_reference):
  cfg, trainer = micro_trainer
  full, full_rows = micro_reference
  assert sorted(full.losses) == list(range(8))
  first = train(cfg, tmp_path / "cut", run_steps=3, progress=False, quiet=True, trainer=trainer)
  assert first.stopped_early and first.end_step == 3
  assert (tmp_path / "cut" / "checkpoints" / "3").is_dir()
  # Without its marker (a run folder from before markers), it still resumes, and is marked.
  (tmp_path / "cut" / run_folder.MARKER).unlink()
  rest = train(cfg, tmp_path / "cut", progress=False, quiet=True, trainer=trainer)
  assert (tmp_path / "cut" / run_folder.MARKER).is_file()
  assert rest.start_step == 3 and rest.end_step == 8
  resumed = {**first.losses, **rest.losses}
  assert resumed == full.losses  # bit-identical: same data from (seed, step), same state
  assert rest.evals[-1] == full.evals[-1]
  chex.assert_trees_all_equal(_restore(tmp_path / "cut", 8, trainer, cfg)["params"],
                              _restore(full.workdir, 8, trainer, cfg)["params"])
  train_rows = [r for r in full_rows if "loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 9))
  assert all({"lr", "grad_norm"} <= set(r) for r in train_rows)
  assert [r["step"] for r in full_rows if "eval_loss" in r] == [4, 8]


# Runs the CLI and SIGKILLs itself at the first checkpoint of this invocation: right after the
# save is issued (Orbax writing in the background), at the rename that commits it, or after the
# commit but before its checksums are written. Matmul precision as conftest sets it in-process,
# so that the losses can equal the in-process reference bit for bit.
KILLED_CLI = textwrap.dedent("""
    import os, signal, sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from pisa_jax.train import checkpoint, cli

    def die(*args, **kwargs):
      os.kill(os.getpid(), signal.SIGKILL)

    where = sys.argv[1]
    if where == "writing":
      save = checkpoint.Checkpointer.save
      checkpoint.Checkpointer.save = lambda *a, **k: (save(*a, **k), die())
    elif where == "committing":
      rename = os.rename
      def commit_or_die(src, dst, *a, **k):
        if "orbax-checkpoint-tmp" in str(src) and os.path.basename(dst).isdigit():
          die()
        return rename(src, dst, *a, **k)
      os.rename = commit_or_die
    elif where == "sealing":
      checkpoint.write_manifest = die
    sys.exit(cli.main(sys.argv[2:]))
""")


def test_sigkill_at_any_point_resumes_to_the_same_losses(tmp_path, micro_reference):
  full, full_rows = micro_reference
  workdir = tmp_path / "run"
  # One compilation for all five processes.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
  args = ["--config", "tiny", *[a for s in MICRO for a in ("--set", s)], "--workdir", str(workdir),
          "--no-progress"]

  def run(where):
    return subprocess.Popen([sys.executable, "-c", KILLED_CLI, where, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

  # Killed from outside between two checkpoints: step 3 is logged, checkpoint 2 sealed.
  proc = run("outside")
  metrics, sealed = workdir / "metrics.jsonl", workdir / "checkpoints" / "2" / ckpt_lib.MANIFEST
  deadline = time.time() + 240
  while proc.poll() is None and time.time() < deadline:
    if sealed.exists() and '"step": 3,' in metrics.read_text():
      proc.kill()
      break
    time.sleep(0.02)
  out, _ = proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, out[-3000:]
  for where in ("writing", "committing", "sealing"):
    proc = run(where)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL, (where, out[-3000:])
  proc = run("none")
  out, _ = proc.communicate(timeout=240)
  assert proc.returncode == 0, out[-3000:]
  # The killed run's lock was dropped by the kernel; its record is taken over in one line.
  assert len(re.findall(r"took over the lock left by process \d+ .*, which ended without "
                        r"releasing it", out)) == 1, out
  # The checkpoint committed without its checksums is set aside in one line.
  skipped = [l for l in out.splitlines() if l.startswith("skipped checkpoint")]
  assert len(skipped) == 1 and "stopped before the checkpoint was sealed" in skipped[0], out
  assert _metric_rows(workdir) == full_rows


def _flip_a_byte(step_dir):
  path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


def _truncate(step_dir):
  path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  path.write_bytes(path.read_bytes()[:10])


CORRUPTIONS = {
    "bit_flip": (_flip_a_byte, "does not match its checksum"),
    "truncated": (_truncate, r"is truncated \(10 of \d+ bytes\)"),
    "missing_metadata": (lambda d: (d / "state" / "_METADATA").unlink(), "state/_METADATA is missing"),
    "unsealed": (lambda d: (d / ckpt_lib.MANIFEST).unlink(), "the run stopped before the checkpoint was sealed"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, micro_trainer,
                                                             micro_reference, corruption, capsys):
  cfg, trainer = micro_trainer
  full, full_rows = micro_reference
  workdir = tmp_path / "run"
  train(cfg, workdir, run_steps=6, progress=False, quiet=True, trainer=trainer)
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [4, 6]
  corrupt, reason = CORRUPTIONS[corruption]
  corrupt(workdir / "checkpoints" / "6")
  rest = train(cfg, workdir, progress=False, print_config=False, trainer=trainer)
  out = capsys.readouterr().out
  skipped = [l for l in out.splitlines() if "skipped checkpoint" in l]
  assert len(skipped) == 1, out
  assert re.search(rf"skipped checkpoint {re.escape(str(workdir.absolute()))}/checkpoints/6 "
                   rf"\(.*{reason}.*\): moved it to .*skipped_checkpoints/6$", skipped[0]), skipped
  assert f"resumed from {workdir.absolute()}/checkpoints/4" in out
  assert (workdir / "skipped_checkpoints" / "6").is_dir()  # set aside, not deleted
  assert rest.start_step == 4 and rest.end_step == 8
  assert {s: full.losses[s] for s in rest.losses} == rest.losses
  # The rows a killed run logged past its restored step are dropped, then logged again.
  assert _metric_rows(workdir) == full_rows


def test_no_good_checkpoint_says_how_to_start_over(tmp_path, micro_trainer):
  cfg, trainer = micro_trainer
  workdir = tmp_path / "run"
  train(cfg, workdir, run_steps=4, progress=False, quiet=True, trainer=trainer)
  for step_dir in (workdir / "checkpoints").iterdir():
    _flip_a_byte(step_dir)
  before = sorted(str(p) for p in workdir.rglob("*"))
  with pytest.raises(CorruptCheckpointError,
                     match=r"no checkpoint in .* passes its checksums \(4: .*; 2: .*\): delete "
                           r".*/checkpoints to start over, or use a new --workdir"):
    train(cfg, workdir, progress=False, quiet=True, trainer=trainer)
  assert sorted(str(p) for p in workdir.rglob("*")) == before
  with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
    _restore(workdir, 4, trainer, cfg)


def test_a_refused_resume_leaves_the_run_folder_as_it_was(tmp_path, micro_trainer):
  cfg, trainer = micro_trainer
  train(cfg, tmp_path, run_steps=2, progress=False, quiet=True, trainer=trainer)
  snapshot = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
  with pytest.raises(IncompatibleCheckpointError, match=r"model\.d_model: checkpoint 32, now 64"):
    train(micro_config("model.d_model=64"), tmp_path, progress=False, quiet=True)
  dense = micro_config("model.attention=dense")
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"model\.attention: checkpoint 'pisa', now 'dense'.*--allow-attention-change"):
    train(dense, tmp_path, progress=False, quiet=True)
  with pytest.raises(IncompatibleCheckpointError, match=r"model\.top_k: checkpoint 3, now 4"):
    train(micro_config("model.top_k=4"), tmp_path, progress=False, quiet=True)
  assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == snapshot
  # Asked for explicitly, the change goes ahead.
  result = train(dense, tmp_path, run_steps=1, progress=False, quiet=True,
                 allow_attention_change=True, command=["pisa-train", "--allow-attention-change"])
  assert result.start_step == 2 and result.end_step == 3
  # config.json keeps the run's first config; the change is recorded beside it.
  assert json.loads((tmp_path / "config.json").read_text())["model"]["attention"] == "pisa"
  (row,) = [json.loads(l) for l in (tmp_path / "config_history.jsonl").read_text().splitlines()]
  assert row["step"] == 2 and row["command"] == ["pisa-train", "--allow-attention-change"]
  assert row["changes"] == {"model.attention": {"old": "pisa", "new": "dense"}}


def test_a_run_that_cannot_fit_stops_before_it_starts(tmp_path, micro_trainer, monkeypatch):
  cfg, trainer = micro_trainer
  assert trainer_lib.step_memory(trainer.memory) > 2**20
  monkeypatch.setattr(memory_lib, "device_memory", lambda device: (2**20, "one test device"))
  with pytest.raises(trainer_lib.InsufficientMemoryError,
                     match=r"the compiled train step needs [\d.]+ MiB per device .* but one test "
                           r"device has 1.0 MiB: lower train.per_device_batch=4 .*train.seq_len=64"):
    train(cfg, tmp_path / "run", progress=False, quiet=True, trainer=trainer)
  assert not (tmp_path / "run").exists()


def test_the_memory_report_names_temporaries_peak_and_bytes_per_token(micro_trainer):
  _, trainer = micro_trainer
  line = trainer_lib.check_memory(trainer)
  assert re.match(r"train step memory per device: peak [\d.]+ MiB of .*; temporaries [\d.]+ MiB "
                  r"\([\d.]+ KiB per token of a micro-batch\)", line), line


def test_a_run_that_cannot_fit_names_the_settings_that_keep_less(micro_trainer, monkeypatch):
  _, trainer = micro_trainer
  monkeypatch.setattr(memory_lib, "device_memory", lambda device: (2**20, "one test device"))
  with pytest.raises(trainer_lib.InsufficientMemoryError,
                     match=r"; or keep less for the backward: model.remat=full \(now none\)$"):
    trainer_lib.check_memory(trainer)


def test_memory_json_records_the_compiled_step(micro_reference):
  full, _ = micro_reference
  memory = json.loads((full.workdir / "memory.json").read_text())
  assert memory["temp_size_in_bytes"] > 0 and memory["peak_bytes"] > memory["temp_size_in_bytes"]
  assert memory["temp_bytes_per_token"] == memory["temp_size_in_bytes"] / (4 * 64)
  assert (memory["remat"], memory["loss_chunk"], memory["seq_len"]) == ("none", None, 64)


def test_remat_and_chunked_loss_train_as_the_plain_step(micro_trainer):
  # One step of each from the same state: the same loss, gradients (through Adam's first moment)
  # and eval sums to float32 rounding, with every block rematerialised and the loss in 4 chunks.
  cfg, plain = micro_trainer
  lean_cfg = micro_config("model.remat=full", "train.loss_chunk=16")
  lean = build_trainer(lean_cfg)
  from pisa_jax.train.data import make_batches

  batch = make_batches(cfg, "train", global_batch=plain.global_batch, accum=2).batch(0)
  outs = []
  for trainer in (plain, lean):
    state, metrics = trainer.train_step(trainer.init_state(),
                                        trainer.place_batch(batch, trainer.batch_shardings))
    evals = trainer.eval_step(state["params"], trainer.place_batch(
        {k: v[0] for k, v in batch.items()}, trainer.eval_batch_shardings))
    outs.append((metrics, state["opt_state"][1].mu, evals))
  (m0, mu0, e0), (m1, mu1, e1) = outs
  for k in ("loss", "accuracy", "grad_norm"):
    assert float(m1[k]) == pytest.approx(float(m0[k]), rel=1e-6), k
  for a, b in zip(jax.tree.leaves(mu1), jax.tree.leaves(mu0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))
  for k in e0:
    assert float(e1[k]) == pytest.approx(float(e0[k]), rel=1e-6), k


def test_the_1m_preset_validates_and_prints(capsys):
  from pisa_jax.train.cli import main

  assert main(["--config", "small-1m", "--set", "data.path=data/corpus", "--print-config"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["train"]["seq_len"] == 2**20 and printed["train"]["per_device_batch"] == 1
  assert printed["train"]["loss_chunk"] == 8192 and printed["model"]["remat"] == "full"
  assert printed["model"]["attention"] == "pisa" and printed["model"]["num_layers"] == 16


def test_missing_data_fails_before_compiling_and_writes_nothing(tmp_path, monkeypatch):
  cfg = micro_config("data.source=tokens", f"data.path={tmp_path / 'nowhere'}")
  monkeypatch.setattr(trainer_lib, "build_trainer", lambda *a: pytest.fail("compiled"))
  with pytest.raises(FileNotFoundError, match=r"data.path=.*nowhere.* has no meta.json"):
    train(cfg, tmp_path / "run", progress=False, quiet=True)
  assert not (tmp_path / "run").exists()


def test_ctrl_c_during_set_up_writes_nothing(tmp_path, monkeypatch):
  def interrupted(*args):
    raise KeyboardInterrupt

  monkeypatch.setattr(trainer_lib, "build_trainer", interrupted)
  with pytest.raises(trainer_lib.InterruptedBeforeStart,
                     match="interrupted before training started: nothing was written"):
    train(micro_config(), tmp_path / "run", progress=False, quiet=True)
  assert not (tmp_path / "run").exists()


def test_a_second_ctrl_c_or_sigterm_exits_at_once(monkeypatch, capfd):
  exits = []
  monkeypatch.setattr(os, "_exit", exits.append)
  for signum, status, name in ((signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")):
    stop = run_folder.StopRequest()
    stop._handle(signum, None)
    assert stop.signal == signum and not exits
    stop._handle(signum, None)
    assert exits == [status]
    exits.clear()
    assert f"second {name}: stopped without saving" in capfd.readouterr().err


def test_sigterm_saves_a_checkpoint_and_stops(tmp_path, micro_trainer, capsys):
  cfg, trainer = micro_trainer
  good_step = trainer.train_step

  def terminated_at_step_3(state, batch):
    if int(state["step"]) == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return good_step(state, batch)

  previous = signal.getsignal(signal.SIGTERM)
  result = train(cfg, tmp_path, progress=False, quiet=True,
                 trainer=dataclasses.replace(trainer, train_step=terminated_at_step_3))
  assert signal.getsignal(signal.SIGTERM) == previous
  assert result.stop_reason == "SIGTERM" and result.end_step == 3
  assert (tmp_path / "checkpoints" / "3" / ckpt_lib.MANIFEST).is_file()
  assert cli._report(result, cfg.train.steps) == 143
  assert capsys.readouterr().err.endswith(
      "terminated (SIGTERM) at step 3; rerun the same command to resume\n")


def test_cli_mistakes_are_one_line(tmp_path, micro_trainer, micro_reference, capsys):
  from pisa_jax.train.cli import main

  a_file = tmp_path / "a_file"
  a_file.write_text("")
  sets = [a for s in MICRO for a in ("--set", s)]
  assert main(["--config", "tiny", *sets, "--workdir", str(a_file)]) == 1
  err = capsys.readouterr().err
  assert err == (f"pisa-train: error: {a_file} is a file, not a folder: --workdir names a run "
                 f"folder (a new one starts a run, an existing one resumes it)\n")
  for bad in ("-3", "0", "x"):
    with pytest.raises(SystemExit) as e:
      main(["--config", "tiny", "--workdir", str(tmp_path / "r"), "--run-steps", bad])
    assert e.value.code == 2
    assert "argument --run-steps:" in capsys.readouterr().err
  # A finished run says so, and compiles nothing.
  full, _ = micro_reference
  assert main(["--config", "tiny", *sets, "--workdir", str(full.workdir), "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert (f"the run is complete: checkpoint {full.workdir.absolute()}/checkpoints/8 is step 8 of "
          f"train.steps=8") in out, out


def test_the_demo_removes_its_temporary_runs(tmp_path, monkeypatch):
  from pisa_jax.train import demo

  monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path))

  def fake_train(cfg, workdir, **kw):
    workdir.mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text("{}\n")
    return trainer_lib.TrainResult(start_step=0, end_step=2, losses={0: 4.0, 1: 3.0},
                                   accuracies={}, evals=[{"eval_loss": 3.0, "eval_accuracy": 0.5}],
                                   stopped_early=False, workdir=workdir)

  monkeypatch.setattr(trainer_lib, "train", fake_train)
  short = ["--steps", "2", "--set", "train.warmup_steps=1", "--set", "train.decay_steps=1"]
  assert demo.main(short) == 0
  assert list(tmp_path.iterdir()) == []
  kept = tmp_path / "kept"
  assert demo.main(short + ["--workdir", str(kept)]) == 0
  assert sorted(p.name for p in kept.iterdir()) == ["dense", "pisa"]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, micro_trainer):
  cfg, trainer = micro_trainer
  good_step = trainer.train_step

  def poisoned_step(state, batch):
    new, m = good_step(state, batch)
    if int(new["step"]) >= 4:  # the update of step 3 blows up
      new = {**new, "params": jax.tree.map(lambda p: p * jnp.nan, new["params"])}
      m = {**m, "param_norm": jnp.float32(jnp.nan)}
    return new, m

  bad = dataclasses.replace(trainer, train_step=poisoned_step)
  with pytest.raises(NonFiniteLossError, match=r"step 3 .*last good checkpoint is step 2"):
    train(cfg, tmp_path, progress=False, quiet=True, trainer=bad)
  steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [2]


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
    ("model.remat=dot", "model.remat='dot' must be one of ('none', 'dots_save_attention', "
                        "'dots', 'dots_except_mlp', 'full_save_attention', 'full')"),
    ("train.loss_chunk=-8", "train.loss_chunk=-8 must be None or 0"),
    ("train.loss_chunk=48", "train.loss_chunk=48 must divide train.seq_len=128"),
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


# The Pallas case runs the kernels in interpret mode inside the model's per-batch-shard shard_map;
# the remat-chunked one rematerialises every block and scans the loss over batch-sharded chunks.
# The two variants are slow-marked: the xla case covers the sharding, test_remat_and_chunked_loss_
# train_as_the_plain_step the remat and chunked loss, the kernel tests the interpret-mode kernels.
@pytest.mark.parametrize("extra", [
    [], pytest.param(["model.attention_implementation=pallas"], marks=pytest.mark.slow),
    pytest.param(["model.remat=full", "train.loss_chunk=16"], marks=pytest.mark.slow)],
    ids=["xla", "pallas", "remat-chunked"])
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
  # The rerun loads the first run's compiled steps from this cache.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
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
  assert proc.returncode == 130, out[-3000:]
  saved = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
  assert len(saved) == 1 and saved[0] >= 2
  assert "Ctrl-C: finishing this step" in out
  assert out.splitlines()[-1] == f"interrupted at step {saved[0]}; rerun the same command to resume"
  config_json = (workdir / "config.json").read_text()
  # The rerun resumes with a changed field and stops after one step (--run-steps). The field is
  # one the compiled step does not depend on (train.peak_lr would be a constant in it), so the
  # rerun compiles nothing.
  again = subprocess.run(args + sets + ["--set", "train.log_every=2", "--run-steps", "1"],
                         env=env, capture_output=True, text=True, timeout=240)
  out = again.stdout + again.stderr
  assert again.returncode == cli.EXIT_STOPPED == 3, out[-3000:]
  assert f"resumed from {workdir / 'checkpoints'}/{saved[0]}" in out
  assert "\n  train.log_every: 1 -> 2\n" in out
  assert again.stdout.splitlines()[-1] == (f"stopped at step {saved[0] + 1} of 100000 "
                                           f"(--run-steps); rerun to continue")
  assert (workdir / "config.json").read_text() == config_json
  (row,) = [json.loads(l) for l in (workdir / "config_history.jsonl").read_text().splitlines()]
  assert row["step"] == saved[0] and row["command"][-4:] == ["--set", "train.log_every=2",
                                                             "--run-steps", "1"]
  assert row["changes"] == {"train.log_every": {"old": 1, "new": 2}}


def test_a_trainer_built_for_another_config_is_refused(tmp_path, micro_trainer):
  _, trainer = micro_trainer
  with pytest.raises(ValueError, match="trainer was built for a different config"):
    train(micro_config("train.peak_lr=1e-3"), tmp_path, progress=False, quiet=True, trainer=trainer)


def _tokens_folder(path, n_train, n_val, vocab=64):
  from pisa_jax.train.data import FORMAT

  path.mkdir()
  rng = np.random.default_rng(0)
  rng.integers(0, vocab, n_train).astype(np.uint16).tofile(path / "train.bin")
  rng.integers(0, vocab, n_val).astype(np.uint16).tofile(path / "val.bin")
  (path / "meta.json").write_text(json.dumps({
      "format": FORMAT, "vocab_size": vocab, "train_tokens": n_train, "val_tokens": n_val}))
  return path


def test_a_validation_split_shorter_than_a_window_matters_only_to_evaluation(tmp_path):
  # A 1M-token run on a corpus whose validation split is shorter than one window must train
  # when it evaluates nothing, and say which file is short when it does evaluate.
  data = _tokens_folder(tmp_path / "corpus", n_train=4000, n_val=40)
  common = ["data.source=tokens", f"data.path={data}", "train.steps=4",
            "train.checkpoint_every=100", "train.grad_accum=1"]
  result = train(micro_config(*common, "train.eval_batches=0"), tmp_path / "no_eval",
                 progress=False, quiet=True, print_config=False)
  assert result.end_step == 4 and np.isfinite(list(result.losses.values())).all()
  with pytest.raises(ValueError, match=r"val.bin has 40 tokens, fewer than train.seq_len \+ 1 = 65; "
                     r"set train.eval_batches=0 .* --val-fraction above 0.0161"):
    train(micro_config(*common), tmp_path / "eval", progress=False, quiet=True,
          print_config=False)
