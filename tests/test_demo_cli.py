"""`pisa-demo` names itself, and Ctrl-C ends it with status 130 and a line saying what was kept
(the trainer is replaced: these tests train nothing)."""

from __future__ import annotations

import pytest

from pisa_jax.train import demo
from pisa_jax.train import trainer as trainer_lib


def test_help_names_the_command(capsys):
  with pytest.raises(SystemExit) as e:
    demo.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith("usage: pisa-demo ") and "python -m" not in out.splitlines()[0]


def _stopped_at(step: int):
  """A trainer whose run stops early at `step`, as its first Ctrl-C makes it."""

  def train(cfg, workdir, **kw):
    workdir.mkdir(parents=True)
    return trainer_lib.TrainResult(start_step=0, end_step=step, losses={0: 4.0}, accuracies={},
                                   evals=[], stopped_early=True, workdir=workdir)

  return train


@pytest.mark.parametrize("keep", [True, False], ids=["workdir", "temporary"])
def test_ctrl_c_exits_130_saying_what_was_kept(tmp_path, monkeypatch, capsys, keep):
  monkeypatch.setattr(demo.tempfile, "tempdir", str(tmp_path))
  monkeypatch.setattr(trainer_lib, "train", _stopped_at(3))
  runs = tmp_path / "runs"
  assert demo.main(["--workdir", str(runs)] if keep else []) == 130
  err = capsys.readouterr().err
  if keep:
    assert err == (f"pisa-demo: interrupted during the pisa run: the runs so far are in {runs}; "
                   f"rerun the same command to resume\n")
    assert [p.name for p in runs.iterdir()] == ["pisa"]
  else:
    assert err == ("pisa-demo: interrupted during the pisa run: nothing was kept (the runs were "
                   "in a temporary folder); pass --workdir DIR to keep them and resume\n")
    assert list(tmp_path.iterdir()) == []
