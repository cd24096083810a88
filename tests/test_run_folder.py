"""The run folder of `pisa-train`: a foreign or corpus folder is refused untouched, one writer at a
time (a held folder refused, a stale lock taken over), the record of fields changed on resume,
and argument errors before jax is imported.

None of these compiles anything: each refusal comes before the set-up. The trainer's own cases
(Ctrl-C, SIGTERM, --run-steps, a resume with a changed field, a kill -9 taken over) are in
tests/test_train.py, beside the runs they reuse.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pisa_jax.configs import PRESETS, apply_overrides, get_config, validate
from pisa_jax.train import checkpoint as ckpt_lib
from pisa_jax.train import cli, run_folder
from pisa_jax.train import trainer as trainer_lib
from pisa_jax.train.data import FORMAT as CORPUS_FORMAT

TINY = ["--config", "tiny", "--no-progress"]


@pytest.fixture
def no_set_up(monkeypatch):
  """A run that gets past the folder checks fails at once instead of training."""

  def set_up(*args, **kwargs):
    raise AssertionError("the run got past the run-folder checks")

  monkeypatch.setattr(trainer_lib, "_set_up", set_up)


def _tree(folder) -> dict[str, str]:
  """Every path under `folder` with the sha256 of its bytes (folders: their mode)."""
  out = {}
  for path in sorted(folder.rglob("*")):
    rel = str(path.relative_to(folder))
    out[rel] = (hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file()
                else oct(path.stat().st_mode))
  return out


def _foreign(tmp_path):
  folder = tmp_path / "theirs"
  (folder / "checkpoints" / "7").mkdir(parents=True)
  (folder / "checkpoints" / "7" / "weights.bin").write_bytes(b"\x00\x01" * 100)
  # A config.json that parses as ours, beside checkpoints without our manifest: still not a run.
  (folder / "config.json").write_text(get_config("tiny").to_json())
  (folder / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
  (folder / "notes.txt").write_text("mine\n")
  return folder


def test_a_foreign_folder_is_refused_untouched(tmp_path, capsys, no_set_up):
  folder = _foreign(tmp_path)
  before = _tree(folder)
  assert cli.main([*TINY, "--workdir", str(folder)]) == 1
  err = capsys.readouterr().err
  assert err == (f"pisa-train: error: --workdir {folder} holds checkpoints, config.json, "
                 f"metrics.jsonl, notes.txt but no pisa-run.json: it is not a pisa-train run "
                 f"folder, so nothing in it was touched; give a new or empty folder\n")
  # The library refuses it too, before its set-up.
  with pytest.raises(run_folder.RunFolderError, match="is not a pisa-train run folder"):
    trainer_lib.train(get_config("tiny"), folder, quiet=True)
  assert _tree(folder) == before


def test_a_corpus_folder_is_refused_untouched(tmp_path, capsys, no_set_up):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for split in ("train", "val"):
    (corpus / f"{split}.bin").write_bytes(bytes(200))
  (corpus / "meta.json").write_text(json.dumps({"format": CORPUS_FORMAT, "vocab_size": 64}))
  before = _tree(corpus)
  assert cli.main([*TINY, "--workdir", str(corpus)]) == 1
  assert capsys.readouterr().err == (
      f"pisa-train: error: --workdir {corpus} is a prepared corpus (meta.json of format "
      f"'{CORPUS_FORMAT}'), not a run folder, so nothing in it was touched: train on it with "
      f"--set data.path={corpus} and give a new --workdir\n")
  assert _tree(corpus) == before


def _marked_run(tmp_path):
  """A run folder as a run that logged two steps leaves it."""
  folder = tmp_path / "run"
  folder.mkdir()
  run_folder.mark(folder)
  (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.5}\n')
  return folder


def test_a_folder_from_before_markers_is_recognised(tmp_path):
  # Our config.json and a checkpoint sealed with our manifest: a run folder, though unmarked.
  folder = _foreign(tmp_path)
  (folder / "notes.txt").unlink()
  assert (ckpt_lib.MANIFEST, ckpt_lib.MANIFEST_FORMAT) == run_folder.CHECKPOINT_MANIFEST
  (folder / "checkpoints" / "7" / ckpt_lib.MANIFEST).write_text(
      json.dumps({"format": ckpt_lib.MANIFEST_FORMAT, "files": {}}))
  assert run_folder.inspect_run_folder(folder) == "unmarked run"
  (folder / "config.json").write_text('{"model": {}, "data": {}, "train": {"lr": 1}}')
  with pytest.raises(run_folder.RunFolderError, match="holds checkpoints, config.json"):
    run_folder.inspect_run_folder(folder)
  assert run_folder.inspect_run_folder(tmp_path / "new") == "new"
  (tmp_path / "empty").mkdir()
  assert run_folder.inspect_run_folder(tmp_path / "empty") == "empty"
  assert run_folder.inspect_run_folder(_marked_run(tmp_path)) == "run"


def test_a_held_run_folder_is_refused_before_anything_is_written(tmp_path, capsys, no_set_up):
  folder = _marked_run(tmp_path)
  held = run_folder.lock(folder, ["pisa-train", "--workdir", str(folder)])
  try:
    assert held.notice is None
    started = json.loads((folder / run_folder.LOCK).read_text())["started"]
    before = _tree(folder)
    refusal = (f"{folder} is in use by process {os.getpid()} (started at {started}): wait for "
               f"that run to end (or stop it), or give another --workdir")
    with pytest.MonkeyPatch.context() as patch:  # the CLI refuses it before the trainer starts
      patch.setattr(trainer_lib, "train", lambda *a, **k: pytest.fail("the trainer started"))
      assert cli.main([*TINY, "--workdir", str(folder)]) == 1
    assert capsys.readouterr().err == f"pisa-train: error: {refusal}\n"
    # The trainer takes the lock itself: a library call is refused the same way.
    with pytest.raises(run_folder.RunFolderInUseError) as refused:
      trainer_lib.train(get_config("tiny"), folder, quiet=True)
    assert str(refused.value) == refusal
    assert _tree(folder) == before
  finally:
    held.release()
  assert (folder / run_folder.LOCK).read_text() == ""  # released cleanly: nothing to take over
  again = run_folder.lock(folder, ["pisa-train"])
  assert again.notice is None
  again.release()
  rows = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
  assert rows == [1, 2]


def test_a_stale_lock_is_taken_over_with_a_notice(tmp_path):
  folder = _marked_run(tmp_path)
  gone = subprocess.Popen(["true"])
  gone.wait()
  (folder / run_folder.LOCK).write_text(json.dumps(
      {"pid": gone.pid, "host": os.uname().nodename, "started": "2026-01-02T03:04:05+00:00",
       "command": ["pisa-train"]}))
  held = run_folder.lock(folder, ["pisa-train", "--workdir", str(folder)])
  try:
    assert held.notice == (f"{folder}: took over the lock left by process {gone.pid} (started at "
                           f"2026-01-02T03:04:05+00:00), which ended without releasing it")
    record = json.loads((folder / run_folder.LOCK).read_text())
    assert record["pid"] == os.getpid() and record["command"][-1] == str(folder)
  finally:
    held.release()


def test_a_failed_set_up_removes_the_folders_and_lock_it_created(tmp_path, monkeypatch):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(trainer_lib, "_set_up", interrupted)
  (tmp_path / "empty").mkdir()
  for folder in (tmp_path / "new" / "run", tmp_path / "empty"):
    with pytest.raises(run_folder.InterruptedBeforeStart):
      trainer_lib.train(get_config("tiny"), folder, quiet=True)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
  assert list((tmp_path / "empty").iterdir()) == []


def test_changed_fields_are_listed_old_to_new():
  saved = get_config("tiny").to_dict()
  del saved["train"]["grad_clip"]  # a field the saved config predates counts at its default
  now = validate(apply_overrides(get_config("tiny"), ["train.steps=999", "model.remat=full"]))
  changes = run_folder.config_changes(saved, now)
  assert changes == {"model.remat": ("none", "full"),
                     "train.steps": (get_config("tiny").train.steps, 999)}
  assert run_folder.describe_changes(changes).splitlines()[0] == "  model.remat: 'none' -> 'full'"


def test_sigterm_during_the_set_up_exits_143(tmp_path, monkeypatch, capsys):
  def terminated_while_setting_up(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not stop the set-up")

  monkeypatch.setattr(trainer_lib, "train", terminated_while_setting_up)
  previous = signal.getsignal(signal.SIGTERM)
  assert cli.main([*TINY, "--workdir", str(tmp_path / "run")]) == 143
  assert capsys.readouterr().err == "pisa-train: interrupted\n"
  assert signal.getsignal(signal.SIGTERM) == previous


# Run in a fresh interpreter: the argument errors come before jax is imported. The preset names
# come from pisa_jax.configs, so a bad --config is checked once the configs are imported.
NO_JAX = textwrap.dedent("""
    import json, sys
    from pisa_jax.train import cli

    def status(argv):
      try:
        cli.main(argv)
      except SystemExit as e:
        return [e.code, "jax" in sys.modules]

    out = {"bogus": status(["--bogus"]), "run_steps": status(["--run-steps", "0"])}
    import pisa_jax.configs
    out["configs_import_jax"] = "jax" in sys.modules
    out["preset"] = status(["--config", "nope"])
    print(json.dumps(out))
""")


def test_argument_errors_come_before_jax_is_imported():
  proc = subprocess.run([sys.executable, "-c", NO_JAX], capture_output=True, text=True,
                        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert out["bogus"] == [2, False] and out["run_steps"] == [2, False], out
  errors = [line for line in proc.stderr.splitlines() if "error:" in line]
  names = ", ".join(repr(name) for name in sorted(PRESETS))
  assert errors == ["pisa-train: error: unrecognized arguments: --bogus",
                    "pisa-train: error: argument --run-steps: 0 must be > 0",
                    f"pisa-train: error: argument --config: invalid choice: 'nope' (choose from "
                    f"{names})"], proc.stderr
  assert out["preset"][0] == 2
  assert not out["configs_import_jax"], "pisa_jax.configs imports jax"
  assert not out["preset"][1], "the CLI imported jax before it checked --config"


@pytest.mark.parametrize("reason,status,stream,line", [
    (None, 0, "out", "done: step 8 of 8, eval loss 1.2346, eval accuracy 0.500; metrics in "
                     "runs/x/metrics.jsonl"),
    ("run_steps", 3, "out", "stopped at step 8 of 8 (--run-steps); rerun to continue"),
    ("max_seconds", 3, "out", "stopped at step 8 of 8 (--max-seconds); rerun to continue"),
    ("SIGINT", 130, "err", "interrupted at step 8; rerun the same command to resume"),
    ("SIGTERM", 143, "err", "terminated (SIGTERM) at step 8; rerun the same command to resume"),
])
def test_the_last_line_and_exit_status_say_how_the_run_ended(reason, status, stream, line,
                                                             capsys):
  result = trainer_lib.TrainResult(
      start_step=0, end_step=8, losses={}, accuracies={},
      evals=[{"step": 8, "eval_loss": 1.23456, "eval_accuracy": 0.5}],
      stopped_early=reason is not None, workdir="runs/x", stop_reason=reason)
  assert cli._report(result, 8) == status
  assert getattr(capsys.readouterr(), stream) == line + "\n"
