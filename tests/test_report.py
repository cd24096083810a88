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


def test_the_nsa_row_gives_fla_ratios_and_refusals(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  (results / "nsa.json").unlink(missing_ok=True)
  with pytest.raises(FileNotFoundError, match="NSA layer"):  # measured once: a loss is an error
    report.table(["NSA layer"], results)
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


def test_the_bfloat16_pyramid_rows_appear_once_measured(tmp_path):
  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  (results / "summary_dtype.json").unlink(missing_ok=True)
  # Not yet measured (it needs a trained run's q/k): the row says so, not an error.
  assert "| bfloat16 pyramid | | not yet measured: " in report.table(["bfloat16 pyramid"], results)
  base = dict(qk="real", source="small layer 6 step 400", seq_len=32768, top_k=8)
  rows = [dict(base, summary_dtype="float32", recall=0.83, captured_mass=0.61),
          dict(base, summary_dtype="bfloat16", recall=0.829, captured_mass=0.6,
               identical_rows=0.975, recall_delta_points=-0.1)]
  record = json.loads((results / "decode.json").read_text())
  (results / "summary_dtype.json").write_text(json.dumps(dict(
      record, benchmark="summary_dtype", settings=dict(block_size=64), rows=rows)))
  line = report.table(["bfloat16 pyramid"], results).splitlines()[-1]
  assert ("| bfloat16 pyramid | pisa, C64, q/k: small layer 6 step 400 | float32 / bfloat16 "
          "pyramid: real 32K K8: identical rows 97.5%, Recall@K 83.0 / 82.9 (-0.10 points), "
          "captured mass 61.0 / 60.0 |") in line
  # The decode row adds the bfloat16 side where the result has one.
  dense = next(r for r in record["rows"] if r.get("side") == "dense" and r.get("n") == 1048576
               and r["batch"] == 1 and r["d"] == 128)
  record["rows"].append(dict(dense, side="pisa-jax bf16", loop_ms=dense["loop_ms"] / 10))
  (results / "decode.json").write_text(json.dumps(record))
  assert "bfloat16 pyramid, in a jitted loop: d128 K32 B=1 1M" in report.table(["decode"], results)
  assert "(10.0x dense)" in report.table(["decode"], results)
def test_the_hils_row_gives_each_peer_over_hils(tmp_path):
  from test_benchmarks_smoke import FAKE_ROWS, SETTINGS

  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  record = json.loads((results / "layer.json").read_text())
  record.update(benchmark="hils", settings=SETTINGS["hils"], rows=FAKE_ROWS["hils"])
  (results / "hils.json").write_text(json.dumps(record))
  line = report.table(["HiLS layer"], results).splitlines()[-1]
  assert "16K d128 g16: fwd 3 (pisa 0.667x, nsa 1.33x, cudnn 3x)" in line, line


def test_the_generation_row_pairs_pisa_with_dense(tmp_path):
  from test_benchmarks_smoke import FAKE_ROWS, SETTINGS

  results = tmp_path / "results"
  shutil.copytree(report.RESULTS, results)
  (results / "generation.json").unlink(missing_ok=True)
  line = report.table(["generation"], results).splitlines()[-1]
  assert "`python -m benchmarks.generation --list` on a GPU" in line
  record = json.loads((results / "decode.json").read_text())
  record.update(benchmark="generation", settings=SETTINGS["generation"],
                rows=FAKE_ROWS["generation"])
  (results / "generation.json").write_text(json.dumps(record))
  line = report.table(["generation"], results).splitlines()[-1]
  assert ("`small` tokens/s: B=1 32K 800 (2.67x dense) · B=8 32K 6,400 (2.67x dense) · "
          "B=1 128K 800 (2.67x dense); first token warm at 1M: pisa 4 s, dense 4 s, cache 256 "
          "MiB a row; 1M in 64K chunks: first token 18.0 s cold, 4 s warm (dense one pass "
          "18.0 s cold)") in line, line
