"""The figures tables of README.md and WORKSPACE.md are what `benchmarks/report.py` generates
from the committed results."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import report


def test_the_committed_tables_are_the_results():
  assert report.stale() == [], "rerun `python -m benchmarks.report` and commit the tables"


def test_a_changed_result_makes_the_tables_stale(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  path = results / "selection.json"
  record = json.loads(path.read_text())
  record["rows"][0]["ms"] *= 2
  path.write_text(json.dumps(record))
  assert report.stale(results=results) == ["README.md", "WORKSPACE.md"]
  # A figure a row needs and the results lack fails loudly, naming it.
  record["rows"] = [r for r in record["rows"] if r["side"] != "pisa-jax"]
  path.write_text(json.dumps(record))
  with pytest.raises(ValueError, match=r"selection: no row with \{'side': 'pisa-jax'"):
    report.table(["selection"], results)


def test_the_table_names_each_figures_date_device_and_commit():
  line = report.table(["training"]).splitlines()[-1]
  record = json.loads((report.RESULTS / "training.json").read_text())
  assert line.endswith(f"| {record['date'][:10]}, {record['device']}, {record['commit'][:7]} |")
  with pytest.raises(ValueError, match="must hold one <!-- figures:begin -->"):
    report.replace_table("no markers", "| table |", "README.md")


def test_a_result_not_yet_measured_names_its_command_until_it_exists(tmp_path, monkeypatch):
  from test_benchmarks_smoke import FAKE_ROWS, SETTINGS

  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  (results / "hils.json").unlink(missing_ok=True)
  line = report.table(["hils"], results).splitlines()[-1]
  assert line.startswith("| hils |") and "`python -m benchmarks.hils` on a GPU" in line
  record = json.loads((results / "layer.json").read_text())
  record.update(benchmark="hils", settings=SETTINGS["hils"], rows=FAKE_ROWS["hils"])
  (results / "hils.json").write_text(json.dumps(record))
  with pytest.raises(ValueError, match="remove 'hils.json' from NOT_YET_MEASURED"):
    report.table(["hils"], results)
  monkeypatch.setattr(report, "NOT_YET_MEASURED", {})
  line = report.table(["hils"], results).splitlines()[-1]
  assert "16K d128 g16: fwd 3 (pisa 0.667x, nsa 1.33x, cudnn 3x)" in line, line
