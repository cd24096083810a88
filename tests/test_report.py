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


def test_a_benchmark_awaiting_its_first_run_gets_its_row_once_it_has_a_result(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  (results / "nsa.json").unlink(missing_ok=True)
  assert "| NSA layer | | not yet measured: " in report.table(["NSA layer"], results)
  record = json.loads((results / "layer.json").read_text())
  record.update(benchmark="nsa", settings=dict(block_length=64, top_n=16, window=512,
                                               dtype="bfloat16"))
  record["rows"] = [dict(case="16K d64 g16", side="nsa", phase="fwd+bwd", ms=3.0),
                    dict(case="16K d64 g16", side="fla nsa", phase="fwd+bwd", ms=6.0, x_ours=2.0),
                    dict(case="16K d64 g4", side="nsa", phase="fwd+bwd", ms=4.0),
                    dict(case="16K d64 g4", side="fla nsa", phase="fwd+bwd", refused=True,
                         error="AssertionError")]
  (results / "nsa.json").write_text(json.dumps(record))
  line = report.table(["NSA layer"], results).splitlines()[-1]
  assert "16K d64 g16 3 (fla nsa 2x); 16K d64 g4 4 (fla nsa refused)" in line
