"""The benchmarks on the CPU: every script imports, parses its arguments, writes the shared result
layout and draws its plot, so a renamed API fails here rather than on a GPU. The selection and
attention benchmarks run end to end on the jnp reference; multi_gpu runs on 2 fake CPU devices."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pisa_jax.testing import random_block_indices

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("selection", "attention", "layer", "training", "multi_gpu", "decode",
           "context_parallel", "packed", "ceilings", "paper_settings", "nsa", "summary_dtype",
           "hils", "generation")

# One small fake result per script, rows as the script writes them.
FAKE_ROWS = {
    "generation": [
        dict(case=f"small-{a}-B{b}-{n // 1024}K" + (f"-chunk{c // 1024}K" if c else ""),
             preset="small", attention=a, batch=b, length=n, prefill_chunk=c,
             date="2026-12-05T00:00:00Z", commit="abc", first_token_cold_s=10.0 + n / 2**17,
             prefill_warm_s=n / 2**18, tokens_per_s=t * b, ms_per_token=1e3 / t,
             cache_mib_per_row=n / 2**12, peak_gib=20.0, first_tokens=[5] * b)
        for a, t in (("pisa", 800.0), ("dense", 300.0))
        for b, n, c in ((1, 32768, None), (8, 32768, None), (1, 131072, None),
                        (1, 1 << 20, None), (1, 1 << 20, 65536))
        if not (a == "dense" and c)],
    "selection": [
        dict(n=n, side=side, selector=sel, beam=8 if sel == "pisa" else None, ms=ms, memory_mb=1.0)
        for n, scale in ((4096, 1), (8192, 2))
        for side, sel, ms in (("pisa-jax", "pisa", 0.13 * scale), ("pisa-jax", "bsa", 0.06 * scale),
                              ("fla", "bsa", 0.17 * scale))],
    "attention": [
        dict(case="16K d64 K8 g16", n=16384, hq=32, hkv=2, d=64, top_k=8, side=side, phase=phase,
             ms=ms)
        for side, phase, ms in (("pisa-jax", "fwd", 0.4), ("pisa-jax", "fwd+bwd", 1.5),
                                ("fla", "fwd", 0.6), ("fla", "fwd+bwd", 3.1),
                                ("cudnn dense", "fwd", 2.5), ("cudnn dense", "fwd+bwd", 9.0))],
    "layer": [
        dict(case="16K d64 K8 g16", n=16384, hq=32, hkv=2, d=64, top_k=8, side="pisa layer",
             phase="fwd+bwd", ms=2.1, speedup_vs_dense=4.3),
        dict(case="16K d64 K8 g16", n=16384, hq=32, hkv=2, d=64, top_k=8, side="cudnn dense",
             phase="fwd+bwd", ms=9.0)],
    "nsa": [
        dict(case="16K d64 g16", n=16384, hq=32, hkv=2, d=64, group=16, side=side, phase=phase,
             ms=ms, **({"x_ours": round(ms / ours, 3)} if side != "nsa" else {}))
        for phase, ours in (("fwd", 1.0), ("fwd+bwd", 3.0))
        for side, ms in (("nsa", ours), ("fla nsa", 1.5 * ours), ("pisa layer", 0.6 * ours),
                         ("cudnn dense", 5 * ours), ("window cudnn", 0.2 * ours))]
        + [dict(case="16K d64 g4", n=16384, hq=32, hkv=8, d=64, group=4, side="fla nsa",
                phase=phase, refused=True, error="AssertionError: Group size must be a multiple "
                "of 16 in NSA") for phase in ("fwd", "fwd+bwd")],
    "hils": [
        dict(case="16K d128 g16", n=16384, hq=32, hkv=2, d=128, side=side, phase=phase, ms=ms,
             x_hils=x)
        for phase in ("fwd", "fwd+bwd")
        for side, ms, x in (("hils layer", 3.0, 1.0), ("pisa layer", 2.0, 0.667),
                            ("nsa layer", 4.0, 1.33), ("cudnn dense", 9.0, 3.0))],
    "training": [
        dict(attention=a, seq_len=4096, global_batch=8, tokens_per_step=32768, steps=20,
             tokens_per_s=t, mfu=0.2, compiled_step_gib={"temp": 20.0}, final_loss=5.0,
             loss_curve=[[5, 9.0], [10, 7.0]], **extra)
        for a, t, extra in (("dense", 3e5, {}), ("pisa", 2.5e5, {"speedup_vs_dense": 0.83}))],
    "multi_gpu": [
        dict(layout=name, data=d, fsdp=f, devices=d * f, tokens_per_s=t, tokens_per_s_per_device=t / (d * f),
             compiled_step_memory_gib_per_device={"temp": 10.0},
             device_busy_ms_per_step={"compute": 60.0, "communication": 2.0, "memcpy": 0.0},
             losses={"1": 10.9, "2": 10.5}, scaling_efficiency=1.0, max_loss_diff_vs_1x1=0.0)
        for name, d, f, t in (("1x1", 1, 1, 2.9e5), ("2x1", 2, 1, 5.3e5))]
        + [dict(restore="2x1->1x1", ok=True, start_step=3, losses={"3": 10.1})],
    "decode": [
        dict(part="step", case=f"{n // 1024}K B1 d128 K32", n=n, batch=1, hq=32, hkv=2, d=128,
             top_k=32, side=side, ms=ms, loop_ms=ms / 2, tokens_per_s=1e3 / ms, x_ours=x)
        for n, scale in ((32768, 1), (1048576, 32))
        for side, ms, x in (("pisa-jax", 0.1, 1.0), ("pisa-jax bf16", 0.08, 1.0),
                            ("dense", 0.05 * scale, 0.5 * scale))]
        + [dict(part="generation", preset="small", attention=a, batch=1, prompt=32768,
                new_tokens=256, first_token_s=2.0, tokens_per_s=t, ms_per_step=1e3 / t)
           for a, t in (("pisa", 300.0), ("dense", 120.0))],
    "context_parallel": [
        dict(run=f"{d}x{n}", devices=d, seq_len=n, context_parallel=d, tokens_per_s=t,
             tokens_per_s_per_device=t / d, compiled_step_memory_gib_per_device={"temp": 40.0},
             allocator_peak_gib_per_device_since_start=[50.0] * d,
             device_busy_ms_per_step={"compute": 900.0, "communication": 30.0, "memcpy": 0.0},
             **extra)
        for d, n, t, extra in ((1, 2**20, 1e5, {}),
                               (2, 2**21, 1.9e5, {"weak_scaling_efficiency": 0.95}),
                               (2, 2**20, 1.8e5, {"strong_scaling_speedup": 1.8}))]
        + [dict(shard=i, shards=2, seq_len=2**21, query_offset=i * 2**20, ms=5.0, vs_fastest=1.0)
           for i in range(2)],
    "packed": [
        dict(case="128K d64 K8", d=64, top_k=8, side=side, stage=stage, layout=layout, ms=ms,
             **({"x_unpacked": 1.05} if layout == "packed" else {}))
        for side in ("pisa-jax", "fla")
        for stage in ("selection", "attention fwd", "attention fwd+bwd")
        for layout, ms in (("unpacked", 2.0), ("packed", 2.1))]
        + [dict(case="128K d64 K8", d=64, top_k=8, side="pisa-jax", stage="fwd+bwd kernels",
                layout=layout, kernels={"pisa_sparse_attention_dq": dq, "loop_fusion": 0.5})
           for layout, dq in (("unpacked", 1.0), ("packed", 1.5))],
    "ceilings": [
        dict(part="walk floor", variant=v, warps=8, rows=128, d=128, kb_per_level=kb,
             us_at={"1": 10.0, "17": 10.0 + 16 * us}, us_per_level=us)
        for v, kb, us in (("f32 dots", 64.0, 1.2), ("bf16 dot", 32.0, 0.2))]
        + [dict(part="tile ceiling", kind=kind, d=128, blocks=blocks, side=side, config=side,
                phase="fwd", ms=1.0, tflops=t)
           for kind, blocks in (("long", 256), ("tile", 32), ("tile", 64))
           for side, t in (("cudnn", 560.0), ("mosaic", 450.0))],
    "summary_dtype": [
        dict(qk="real", source="small layer 6 step 400", seq_len=n, hq=32, hkv=2, d=64, top_k=8,
             block_size=64, summary_dtype=dtype, recall=0.83, captured_mass=0.6, mass_ratio=0.9,
             rows_scored=1000, **extra)
        for n in (32768, 131072)
        for dtype, extra in (("float32", {}),
                             ("bfloat16", dict(identical_rows=0.97, recall_delta_points=-0.1)))],
    "paper_settings": [
        dict(setting=f"{preset}@{n}", preset=preset, attention=a, seq_len=n, top_k=k, batch=b,
             remat=remat, loss_chunk=chunk, compile_s=40.0, compiled_temp_gib=20.0,
             compiled_peak_gib=30.0, tokens_per_step=b * n, step_s=b * n / t, tokens_per_s=t,
             model_flops_per_token=3e9, mfu=0.3, timed_steps=3, last_loss=10.9)
        for preset, n, k, b, remat, chunk, pisa, dense in (
            ("418m", 4096, 8, 8, "none", 0, 1.3e5, 1.15e5),
            ("cpt-418m", 65536, 32, 1, "full_save_attention", 8192, 3.6e4, 1.4e4))
        for a, t in (("pisa", pisa), ("dense", dense))]
        + [dict(goal="PISA / dense tokens/s, 418m@4096", setting="418m@4096", value=1.13,
                target=1.1, met=True),
           dict(goal="PISA / dense tokens/s, cpt-418m@65536", setting="cpt-418m@65536",
                value=2.57, target=4.0, met=False)],
}
SETTINGS = {
    "generation": dict(presets=["small"], new_tokens=256, steps_per_call=16),
    "selection": dict(hq=32, hkv=2, d=64, block_size=64, top_k=8, branching=2, dtype="bfloat16"),
    "attention": dict(indices="random"),
    "layer": {},
    "hils": dict(dtype="bfloat16", hils=dict(chunk_size=64, top_k=32, window=512),
                 pisa=dict(block_size=64, top_k=32, branching=2)),
    "training": dict(preset="small", seconds=60.0),
    "multi_gpu": dict(preset="small", attention="pisa", global_batch=8, seq_len=4096),
    "decode": dict(block_size=64, dtype="bfloat16", selector="pisa"),
    "context_parallel": dict(preset="small-1m", runs="1:1048576,2:2097152,2:1048576"),
    "packed": dict(total=131072, min_doc=2048, max_doc=16384, hq=32, hkv=2, block_size=64,
                   documents=[16384] * 8),
    "ceilings": dict(parts=["walk", "tile"], nodes=32768, d=128, candidates=64, levels=[1, 17]),
    "paper_settings": dict(attention=["pisa", "dense"], steps=3, warmup=1),
    "nsa": dict(compression="mean", block_length=64, top_n=16, window=512, dtype="bfloat16"),
    "summary_dtype": dict(selector="pisa", block_size=64, top_k=[8]),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_parses(name, capsys):
  module = importlib.import_module(f"benchmarks.{name}")
  assert module.NAME == name
  for attr in ("main", "plot", "table", "measure", "settings"):
    assert callable(getattr(module, attr)), attr
  with pytest.raises(SystemExit) as exit_:
    module.main(["--help"])
  assert exit_.value.code == 0
  assert f"benchmarks.{name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", SCRIPTS)
def test_record_and_replot(name, tmp_path):
  from benchmarks import _record
  rec = _record.Recorder(name, SETTINGS[name], tmp_path / "run")
  for row in FAKE_ROWS[name]:
    rec.add(**row)
  rec.note("a note")
  saved = _record.load(tmp_path / "run" / f"{name}.json")
  assert list(saved) == list(_record.KEYS)
  assert saved["benchmark"] == name and saved["rows"] == json.loads(json.dumps(FAKE_ROWS[name]))
  assert saved["device"] == f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  assert saved["date"].endswith("Z") and saved["jax"] == jax.__version__
  assert saved["commit"]
  module = importlib.import_module(f"benchmarks.{name}")
  module.main(["--replot", str(tmp_path / "run" / f"{name}.json"), "--out", str(tmp_path / "plot")])
  assert (tmp_path / "plot" / f"{name}.png").stat().st_size > 0
  assert module.table(saved).count("\n") >= 2


def test_kernel_totals_fold_numbered_kernels_per_call():
  from benchmarks.timing import kernel_totals
  events = [("loop_fusion_12", 2e6), ("loop_fusion.3", 1e6), ("pisa_dkv", 4e6), ("sort_1", 1e6)]
  assert kernel_totals(events, calls=2, top=2) == {"pisa_dkv": 2.0, "loop_fusion": 1.5,
                                                   "other": 0.5}
  assert kernel_totals([], calls=3) == {}


def test_packed_table_splits_fwd_bwd_by_kernel():
  from benchmarks import packed
  text = packed.table({"rows": FAKE_ROWS["packed"]})
  assert "| 128K d64 K8 | pisa_sparse_attention_dq | 1 | 1.5 | 0.5 |" in text
  assert text.index("pisa_sparse_attention_dq") < text.index("| loop_fusion |")


def test_replot_refuses_another_benchmarks_result(tmp_path):
  from benchmarks import _record, layer
  _record.Recorder("attention", {}, tmp_path).add(**FAKE_ROWS["attention"][0])
  with pytest.raises(SystemExit, match="attention"):
    layer.main(["--replot", str(tmp_path / "attention.json"), "--out", str(tmp_path)])


def test_selection_runs_on_the_reference(tmp_path):
  from benchmarks import selection
  record = selection.main(["--sizes", "256", "--beams", "8,16", "--budget-sizes", "1024",
                           "--budget-cases", "64:16", "--implementation", "xla", "--no-fla",
                           "--out", str(tmp_path)])
  rows = {(r["n"], r["top_k"], r["selector"], r["beam"]): r for r in record["rows"]}
  assert set(rows) == {(n, 8, "pisa", 8) for n in (256, 1024)} | {(256, 8, "pisa", 16)} | {
      (n, 8, "bsa", None) for n in (256, 1024)} | {(1024, 16, "pisa", 16), (1024, 16, "bsa", None)}
  assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
  assert rows[256, 8, "pisa", 8]["x_pisa"] == 1.0
  # The wide budget's cost over K = 8 at the same N and d.
  wide, narrow = rows[1024, 16, "pisa", 16], rows[1024, 8, "pisa", 8]
  assert wide["x_k8"] == round(wide["ms"] / narrow["ms"], 3)
  assert "x_k8" not in rows[1024, 16, "bsa", None]  # not over PISA's K = 8 time
  assert record["notes"] == ["fla left out (--no-fla)"]
  assert (tmp_path / "selection.png").exists()
  assert json.loads((tmp_path / "selection.json").read_text())["rows"] == record["rows"]


# Slow: a whole benchmark on the reference; the library parts it drives are tested directly.
@pytest.mark.slow
def test_packed_runs_on_the_reference(tmp_path):
  from benchmarks import packed
  record = packed.main(["--total", "256", "--min-doc", "16", "--max-doc", "96", "--case", "32:3",
                        "--hq", "4", "--implementation", "xla", "--no-fla", "--out",
                        str(tmp_path)])
  assert sum(record["settings"]["documents"]) == 256
  rows = {(r["stage"], r["layout"]): r for r in record["rows"]}
  assert set(rows) == {(stage, layout) for stage in packed.STAGES
                       for layout in ("unpacked", "packed")}
  assert all(r["ms"] > 0 and "error" not in r for r in rows.values())
  assert all(rows[stage, "packed"]["x_unpacked"] > 0 for stage in packed.STAGES)
  assert "packed / unpacked: worst" in packed.table(record)
  assert (tmp_path / "packed.png").exists()


def test_attention_runs_on_the_reference(tmp_path):
  from benchmarks import attention
  record = attention.main(["--case", "130:4:2:32:3", "--implementation", "xla", "--no-fla",
                           "--out", str(tmp_path)])
  assert {(r["side"], r["phase"]) for r in record["rows"]} == {("pisa-jax", "fwd"),
                                                               ("pisa-jax", "fwd+bwd")}
  assert all(r["ms"] > 0 and "error" not in r for r in record["rows"])


@pytest.mark.slow
def test_nsa_runs_on_the_reference(tmp_path):
  from benchmarks import nsa
  record = nsa.main(["--case", "256:4:1:16", "--window", "32", "--implementation", "xla",
                     "--no-fla", "--out", str(tmp_path)])
  assert {(r["side"], r["phase"]) for r in record["rows"]} == {
      (side, phase) for side in ("nsa", "pisa layer") for phase in ("fwd", "fwd+bwd")}
  assert all(r["ms"] > 0 and "error" not in r for r in record["rows"])


def test_decode_steps_run_on_the_reference(tmp_path):
  # Both sides thread a donated cache through their step.
  from benchmarks import decode
  # The bfloat16 pyramid only (the float32 side is the same code under its own name): one
  # PISA side per --summary-dtype, each compared with dense.
  record = decode.main(["--lengths", "128", "--batches", "1", "--heads", "4:2:16:4",
                        "--summary-dtype", "bfloat16", "--implementation", "xla",
                        "--no-generation", "--out", str(tmp_path)])
  steps = {r["side"]: r for r in record["rows"] if r["part"] == "step"}
  assert set(steps) == {"pisa-jax bf16", "dense"}, steps
  ours = steps["pisa-jax bf16"]
  assert ours["ms"] > 0 and steps["dense"]["ms"] > 0 and ours["summary_dtype"] == "bfloat16"
  assert ours["loop_ms"] > 0 and steps["dense"]["loop_x_ours"] > 0, steps
  assert all(ours[f"loop_ms_{s}"] > 0 for s in decode.STAGES), steps
  assert steps["dense"]["implementation"] in ("cudnn", "xla")
  assert "bf16 pyramid" in decode.table(record)
  assert (tmp_path / "decode.png").exists()


def test_summary_dtype_runs_on_the_reference(tmp_path):
  # A dump_qk file and random q/k: both pyramids select, the bf16 row compares the indices.
  from benchmarks import summary_dtype
  rng = np.random.default_rng(0)
  npz = tmp_path / "qk.npz"
  np.savez(npz, q=rng.standard_normal((1, 256, 4, 16)).astype(np.float16),
           k=rng.standard_normal((1, 256, 2, 16)).astype(np.float16), layer=1, step=7,
           workdir="runs/tiny", split="val", device="cpu")
  record = summary_dtype.main(["--qk-npz", str(npz), "--random", "192", "--random-heads", "4:2:16",
                               "--top-k", "4", "--block-size", "16", "--implementation", "xla",
                               "--out", str(tmp_path)])
  rows = record["rows"]
  assert [(r["qk"], r["summary_dtype"]) for r in rows] == [
      ("real", "float32"), ("real", "bfloat16"), ("random", "float32"), ("random", "bfloat16")]
  assert rows[0]["source"] == "tiny layer 1 step 7"
  for r in rows:
    assert 0 < r["recall"] <= 1 and 0 < r["captured_mass"] <= 1 and r["rows_scored"] > 0, r
  assert 0.5 < rows[1]["identical_rows"] <= 1 and "recall_delta_points" in rows[1]
  assert (tmp_path / "summary_dtype.png").exists()


def test_decode_step_kernels_count_a_profile_per_step(monkeypatch):
  # The per-step kernel count and device time divide the profile of `calls` threaded steps (a
  # fake profile here: a CPU has no GPU stream), and the state is threaded through every call.
  from benchmarks import decode
  seen = []

  def profile(run):
    run()
    return [("fusion", 1_000_000), ("pisa_decode_attention", 3_000_000)] * 4

  monkeypatch.setattr(decode.timing, "gpu_kernel_events", profile)
  got = decode.step_kernels(lambda s: seen.append(s) or s + 1, 0, calls=4)
  assert got == {"kernels_per_step": 2.0, "device_ms": 4.0,
                 "kernel_us": {"pisa_decode_attention": 3000.0, "fusion": 1000.0}}, got
  assert seen == [0, 1, 2, 3, 4]
  monkeypatch.setattr(decode.timing, "gpu_kernel_events", lambda run: run() or [])
  assert decode.step_kernels(lambda s: s, 0, calls=2) == {}


@pytest.mark.slow
def test_decode_select_sweeps_time_the_kernel_at_each_setting(tmp_path):
  from benchmarks import decode
  with pytest.raises(SystemExit, match="--select-warps"):
    decode.main(["--select-warps", "1,4", "--implementation", "xla", "--out", str(tmp_path)])
  record = decode.main(["--lengths", "128", "--batches", "1", "--heads", "4:2:16:4",
                        "--implementation", "pallas", "--select-warps", "1,2",
                        "--no-generation", "--out", str(tmp_path)])
  ours = next(r for r in record["rows"] if r["part"] == "step" and r["side"] == "pisa-jax")
  assert ours["loop_ms_select_w1"] > 0 and ours["loop_ms_select_w2"] > 0, ours
  table = decode.table(record)
  assert "w1 " in table and "w2 " in table


def test_generation_cases_names_and_calls(monkeypatch):
  from benchmarks import generation

  # The parent leaves the GPU's memory to its workers, which get the user's own setting back.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  monkeypatch.setattr(generation, "_USER_PREALLOCATE", None)
  assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in generation._worker_env(None)
  monkeypatch.setattr(generation, "_USER_PREALLOCATE", "true")
  assert generation._worker_env(None)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"

  cases = generation.grid()
  names = [c.name for c in cases]
  assert len(set(names)) == len(names)
  assert all(generation.Case.parse(c.name) == c for c in cases)
  assert "small-pisa-B1-1M-chunk64K" in names and "418m-dense-B8-128K" in names
  # B = 32 at 128K: a chunked prefill's stacked caches take about twice the cache in scratch.
  assert "418m-dense-B32-128K-chunk32K" not in names and "418m-dense-B32-32K" in names
  # ... and are rows that say so.
  assert {c.name for c in generation.left_out()} == {
      f"{p}-{a}-B32-128K" for p in ("small", "418m") for a in ("pisa", "dense")}
  assert "small-dense-B1-1M-chunk64K" not in names  # dense chunks at 1M: minutes of jnp
  # Ragged rows: the longest fills L with its new tokens, the shortest about half of it.
  assert generation.Case("small", "pisa", 8, 32768).prompt_lengths(256) == [
      32512 - 2048 * b for b in range(8)]
  calls = generation.plan(cases, 450, 256, cached=False)
  assert sorted(c.name for call in calls for c in call) == sorted(names)
  for call in calls:
    assert len(call) == 1 or sum(generation.estimate_s(c) for c in call) <= 450


@pytest.mark.slow  # ~15 s: two fresh processes of the tiny preset
def test_generation_runs_cases_in_fresh_processes(tmp_path):
  from benchmarks import generation

  record = generation.main(["--presets", "tiny", "--lengths", "256", "--batches", "2,16384",
                            "--no-long", "--new-tokens", "8", "--implementation", "xla",
                            "--out", str(tmp_path)])
  rows = {r["case"]: r for r in record["rows"]}
  # B = 16384 at 256: past MAX_BATCH_TOKENS, a row that says it was not run.
  for name in ("tiny-pisa-B16384-256", "tiny-dense-B16384-256"):
    assert rows.pop(name)["error"] == generation.LEFT_OUT
  assert set(rows) == {"tiny-pisa-B2-256", "tiny-dense-B2-256"}, rows
  for row in rows.values():
    assert "error" not in row, row
    assert row["tokens_per_s"] > 0 and row["prefill_warm_s"] < row["first_token_cold_s"]
    assert row["prompt_tokens"] == 248 + 184 and len(row["first_tokens"]) == 2
  assert all(row["device"] == record["device"] for row in rows.values())
  # A second run of one case keeps the other's row; a row of another device is dropped.
  result = tmp_path / "generation.json"
  stored = json.loads(result.read_text())
  stored["rows"].append({**stored["rows"][0], "case": "tiny-pisa-B4-256", "device": "elsewhere"})
  result.write_text(json.dumps(stored))
  again = generation.main(["--presets", "tiny", "--lengths", "256", "--batches", "2",
                           "--no-long", "--new-tokens", "8", "--implementation", "xla",
                           "--cases", "tiny-dense-*", "--in-process", "--out", str(tmp_path)])
  assert {r["case"] for r in again["rows"]} == set(rows) | {"tiny-pisa-B16384-256",
                                                             "tiny-dense-B16384-256"}
  assert any("measured on another device" in n for n in again["notes"])


@pytest.mark.slow  # ~80 s of CPU; generation itself is tested in test_generate.py
def test_decode_generation_runs_on_the_reference(tmp_path):
  # The generation part alone: the tiny preset's decoder with each attention, two prompts.
  from benchmarks import decode
  record = decode.main(["--no-steps", "--implementation", "xla", "--gen-preset", "tiny",
                        "--gen-prompt", "16,24", "--gen-tokens", "3", "--out", str(tmp_path)])
  assert all(r["part"] == "generation" for r in record["rows"]), record["rows"]
  gen = {(r["prompt"], r["attention"]): r for r in record["rows"]}
  assert set(gen) == {(p, a) for p in (16, 24) for a in ("pisa", "dense")}, gen
  assert all(r["tokens_per_s"] > 0 for r in gen.values()), gen


# Slow: a whole benchmark on the reference; the library parts it drives are tested directly.
@pytest.mark.slow
def test_training_keeps_runs_that_evaluation_restores(tmp_path):
  # --keep-runs leaves each run's checkpoint for `pisa-eval --workdir`.
  from benchmarks import training
  from pisa_jax.train.restore import restore_model
  record = training.main(["--preset", "tiny", "--attention", "pisa", "--seq-lens", "128",
                          "--tokens-per-step", "512", "--seconds", "2", "--data", "/none",
                          "--set", "model.num_layers=1", "--keep-runs", str(tmp_path / "runs"),
                          "--out", str(tmp_path)])
  (row,) = record["rows"]
  assert row["workdir"] == str(tmp_path / "runs" / "pisa-128"), row
  config, _, step = restore_model(row["workdir"])
  assert config.model.attention == "pisa" and step == row["steps"]
  with pytest.raises(SystemExit, match="must be empty or new"):
    training.main(["--preset", "tiny", "--keep-runs", str(tmp_path / "runs"),
                   "--out", str(tmp_path / "again")])


def test_timing_returns_a_median_per_call():
  from benchmarks.timing import time_jax
  x = jnp.ones((64, 64))
  ms = time_jax(jax.jit(lambda x: x @ x), x, reps=3, batch_s=0.01)
  assert isinstance(ms, float) and 0 < ms < 1000


def test_random_block_indices_are_valid():
  idx = random_block_indices(1, 700, 3, 5, 16, batch=2, thin_rows=0.3)
  cur = np.arange(700) // 16
  assert idx.shape == (2, 700, 3, 5) and idx.dtype == np.int32
  assert (idx.max(-1) <= cur[None, :, None]).all()
  valid = idx >= 0
  assert (valid[..., :-1] >= valid[..., 1:]).all()  # -1 only after the valid ids
  assert (np.where(valid[..., 1:], idx[..., 1:], 10**6) > idx[..., :-1]).all()  # ascending
  full = random_block_indices(1, 700, 3, 5, 16)
  assert ((full >= 0).sum(-1) == np.minimum(5, cur + 1)[None, :, None]).all()
  assert (full.max(-1) == cur[None, :, None]).all()  # the current block is always in
  assert (~valid).all(-1).any() and (valid.sum(-1) < (full >= 0).sum(-1)).any()


# Slow: a whole benchmark on the reference; the library parts it drives are tested directly.
@pytest.mark.slow
def test_multi_gpu_dry_run_on_fake_devices(tmp_path):
  # Every layout trains on the same global batch and data order, the curves agree with 1 device,
  # and the checkpoint moves between 2 devices and 1 in both directions with the same losses.
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.multi_gpu", "--preset", "tiny", "--seq-len", "128",
       "--steps", "3", "--profile-steps", "1", "--global-batch", "4", "--layouts",
       "1x1,2x1,1x2,4x1", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "runs")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads((tmp_path / "out" / "multi_gpu.json").read_text())
  assert res["device"] == "2 x cpu" and any("4x1" in n for n in res["notes"])
  layouts = {r["layout"]: r for r in res["rows"] if "layout" in r}
  assert set(layouts) == {"1x1", "2x1", "1x2"}
  for name, r in layouts.items():
    assert len(r["losses"]) == 3 and r["tokens_per_s"] > 0, name
    assert len(r["allocator_peak_gib_per_device_since_start"]) == r["devices"]
    assert "temp" in r["compiled_step_memory_gib_per_device"], r
    assert set(r["device_busy_ms_per_step"]) == {"compute", "communication", "memcpy"}
    assert r["max_loss_diff_vs_1x1"] < 1e-4, (name, r["max_loss_diff_vs_1x1"])
  port = {r["restore"]: r for r in res["rows"] if "restore" in r}
  # The widest layouts are 2x1 and 1x2: the fsdp one is moved, so the restore reshards.
  assert set(port) == {"1x2->1x1", "1x1->1x2"}
  assert all(p["ok"] and p["start_step"] == 4 for p in port.values()), port
  a, b = (port[k]["losses"] for k in ("1x2->1x1", "1x1->1x2"))
  assert a.keys() == b.keys() and all(abs(a[s] - b[s]) < 1e-4 for s in a)
  assert (tmp_path / "out" / "multi_gpu.png").exists()


# Slow: a whole benchmark on the reference; the library parts it drives are tested directly.
@pytest.mark.slow
def test_context_parallel_dry_run_on_one_device(tmp_path):
  # One device: the 1-device run, the 2-device runs noted as skipped, and the balance proxy (two
  # shards' attention on the one device). The 2-device runs: test_context_parallel's fake devices.
  from benchmarks import context_parallel
  record = context_parallel.main(["--dry-run", "--runs", "1:64,2:128", "--out", str(tmp_path)])
  runs = [r for r in record["rows"] if "run" in r]
  assert [r["run"] for r in runs] == ["1x64"] and runs[0]["tokens_per_s"] > 0, runs
  assert "temp" in runs[0]["compiled_step_memory_gib_per_device"]
  assert any("2x128" in n for n in record["notes"]), record["notes"]
  shards = [r for r in record["rows"] if "shard" in r]
  assert [(r["shard"], r["query_offset"]) for r in shards] == [(0, 0), (1, 32)], shards
  assert (tmp_path / "context_parallel.png").exists()


def _long_context_rows():
  runs = [dict(attention=a, seq_len=n, remat="full", loss_chunk=8192, compile_s=60.0,
               compiled_temp_gib=temp, compiled_peak_gib=temp + 2, step_s=n / tok_s,
               tokens_per_s=tok_s, mfu=0.3, allocator_peak_gib=temp + 3, timed_steps=8,
               last_loss=7.0)
          for a, n, tok_s, temp in (("pisa", 65536, 3.0e5, 4.0), ("dense", 65536, 0.8e5, 4.5),
                                    ("pisa", 1048576, 2.0e5, 60.0))]
  runs[-1]["loss_curve"] = [[5, 9.5], [10, 8.0], [15, 7.2]]
  runs.append(dict(attention="dense", seq_len=1048576, skipped="dense at 524288 tokens: one "
                   "step took 70 s, over the 60 s limit"))
  return runs


def test_long_context_goals_replot_and_table(tmp_path, capsys):
  from benchmarks import _record, long_context
  rows = _long_context_rows()
  goals = {g["goal"]: g for g in long_context.goals(rows, 1048576, 65536)}
  assert [g["met"] for g in goals.values()] == [True, True, True]
  assert [g["value"] for g in goals.values()] == [63.0, 0.667, 3.75]
  rec = _record.Recorder(long_context.NAME, {"preset": "small-1m"}, tmp_path / "run")
  for row in rows + list(goals.values()):
    rec.add(**row)
  path = tmp_path / "run" / "long_context_training.json"
  assert list(_record.load(path)) == list(_record.KEYS)
  record = long_context.main(["--replot", str(path), "--out", str(tmp_path / "plot")])
  assert (tmp_path / "plot" / "long_context_training.png").stat().st_size > 0
  table = long_context.table(record)
  assert "PISA / dense tokens/s at 65536 | 3.75 | 3 | yes" in table and "over the 60 s" in table
  with pytest.raises(SystemExit) as exit_:
    long_context.main(["--help"])
  assert exit_.value.code == 0 and "benchmarks.long_context" in capsys.readouterr().out


def test_long_context_dry_run(tmp_path):
  # One dense run of the tiny model that also trains the 2-step curve: the whole script, quickly.
  from benchmarks import long_context
  record = long_context.main(["--dry-run", "--seq-lens", "64", "--attention", "dense",
                              "--curve-attention", "dense", "--curve-steps", "2",
                              "--out", str(tmp_path)])
  (run,) = [r for r in record["rows"] if "goal" not in r]
  assert run["tokens_per_s"] > 0 and run["compiled_temp_gib"] > 0 and "error" not in run, run
  assert (run["remat"], run["loss_chunk"], run["seq_len"]) == ("full", 32, 64)
  assert [s for s, _ in run["loss_curve"]] == [1, 2]
  assert len([r for r in record["rows"] if "goal" in r]) == 3
  assert json.loads((tmp_path / "long_context_training.json").read_text())["rows"] == record["rows"]
  assert (tmp_path / "long_context_training.png").exists()


# Slow: a whole benchmark on the reference; the library parts it drives are tested directly.
@pytest.mark.slow
def test_attention_real_indices_from_a_dumped_layer(tmp_path):
  # benchmarks.dump_qk's q/k of a (here untrained) tiny decoder, then --indices real on them:
  # the q/k are the layer's own (equal to what its attention computes), and the benchmark
  # selects on their first N tokens with the case's K and repeats their KV heads over its HKV.
  from flax import nnx

  from benchmarks import attention, dump_qk
  from pisa_jax.configs.presets import get_config
  from pisa_jax.models.decoder import Decoder, apply_rope, rope_angles

  cfg = get_config("tiny").model
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.arange(160, dtype=jnp.int32)[None] % cfg.vocab_size
  q, k = dump_qk.layer_qk(model, tokens, 1)
  x = model.blocks[0](jnp.take(model.embed[...], tokens, axis=0).astype(q.dtype),
                      *rope_angles(160, cfg.head_dim, cfg.rope_base))
  h = model.blocks[1].attn_norm(x)
  want = apply_rope(jnp.einsum("bte,ehd->bthd", h, model.blocks[1].attn.wk[...].astype(q.dtype)),
                    *rope_angles(160, cfg.head_dim, cfg.rope_base))
  np.testing.assert_allclose(np.asarray(k), np.asarray(want), atol=1e-5)
  path = tmp_path / "qk.npz"
  np.savez(path, q=np.asarray(q, np.float16), k=np.asarray(k, np.float16), layer=1, step=0)
  record = attention.main(["--case", "130:4:2:32:3", "--indices", "real", "--qk-npz", str(path),
                           "--implementation", "xla", "--no-fla", "--out", str(tmp_path)])
  assert {(r["side"], r["phase"]) for r in record["rows"]} == {("pisa-jax", "fwd"),
                                                               ("pisa-jax", "fwd+bwd")}
  assert record["settings"]["qk_npz"] == str(path)
  assert record["benchmark"] == "attention_real" and (tmp_path / "attention_real.json").exists()
  assert any("real indices" in n for n in record["notes"])
  with pytest.raises(SystemExit, match="fewer than"):
    attention.main(["--case", "256:4:2:32:3", "--indices", "real", "--qk-npz", str(path),
                    "--implementation", "xla", "--no-fla", "--out", str(tmp_path)])


def test_attention_result_is_named_by_its_indices(tmp_path):
  # Random, PISA and real indices answer different questions: one result each, so a run of one
  # never overwrites another's; --replot keeps the name its JSON holds.
  import argparse

  from benchmarks import _record, attention
  names = {kind: attention.result_name(argparse.Namespace(replot=None, indices=kind))
           for kind in ("random", "pisa", "real")}
  assert names == {"random": "attention", "pisa": "attention_pisa", "real": "attention_real"}
  rec = _record.Recorder("attention_pisa", {}, tmp_path)
  rec.save()
  assert attention.result_name(argparse.Namespace(replot=str(rec.path), indices="random")) == (
      "attention_pisa")
  other = _record.Recorder("layer", {}, tmp_path)
  other.save()
  with pytest.raises(SystemExit, match="not an attention one"):
    attention.result_name(argparse.Namespace(replot=str(other.path), indices="random"))


def test_long_context_curve_only_needs_resume_and_workdir(tmp_path, capsys):
  from benchmarks import long_context
  with pytest.raises(SystemExit):
    long_context.main(["--curve-only", "--curve-workdir", str(tmp_path / "c"), "--out",
                       str(tmp_path)])
  assert "--curve-only needs --resume" in capsys.readouterr().err


def test_ceilings_walk_floor_runs_in_interpret_mode(tmp_path):
  # The walk part's chain kernel in Pallas interpret mode; the tile part is noted as GPU-only.
  from benchmarks import ceilings
  record = ceilings.main(["--nodes", "64", "--d", "32", "--candidates", "16", "--levels", "1,2",
                          "--out", str(tmp_path)])
  walk = [r for r in record["rows"] if r["part"] == "walk floor"]
  assert [(r["variant"], r["warps"]) for r in walk] == [
      (v, w) for v, warps in ceilings.WALK_VARIANTS for w in warps]
  assert all(r["us_at"]["1"] > 0 and r["us_at"]["2"] > 0 for r in walk)
  assert record["notes"] == ["tile ceiling: cuDNN and Mosaic GPU need a GPU; part skipped"]
  for bad in (["--levels", "3,2"], ["--d", "48"], ["--candidates", "12"], ["--parts", "x"]):
    with pytest.raises(SystemExit):
      ceilings.main(bad + ["--out", str(tmp_path)])


def test_ceilings_chain_follows_the_loaded_values():
  # Each level's next nodes come from the signs of the previous level's scores: a reference walk
  # of the same rule in numpy gives the kernel's last nodes.
  from benchmarks import ceilings
  nodes, d, width, levels = 32, 16, 8, 3
  s = jax.random.normal(jax.random.key(3), (nodes * ceilings.HKV, d), jnp.float32)
  q = jax.random.normal(jax.random.key(4), (ceilings.GROUP, d), jnp.bfloat16)
  start = jnp.array([5], jnp.int32)
  out = ceilings.chain(start, s, q, levels=levels, variant="f32 sum", warps=4, width=width,
                       interpret=True)
  s_np = np.asarray(s)
  for head in range(ceilings.HKV):
    node = (5 + np.arange(width) * 7) % nodes
    for i in range(levels):
      value = s_np[node * ceilings.HKV + head].sum(axis=1)
      node = (node * 2 + (value > 0) + i) % nodes
    np.testing.assert_array_equal(np.asarray(out[head]), node)


@pytest.mark.parametrize("preset", ["cpt-418m", "cpt-1.47b"])
def test_long_context_and_training_configs_take_the_cpt_presets(preset):
  # The continued-pretraining presets give their warm-up as a fraction of the steps; the
  # benchmarks set it in steps, which must replace the fraction, not add to it.
  import argparse

  from benchmarks import long_context, training
  spec = dict(preset=preset, attention="pisa", seq_len=16384, steps=8, warmup=2, curve_steps=0,
              data=[], set=[])
  config = long_context.config_for(spec)
  assert (config.train.warmup_steps, config.train.warmup_fraction) == (1, 0.0)
  assert (config.model.top_k, config.train.seq_len) == (32, 16384)
  args = argparse.Namespace(preset=preset, tokens_per_step=32768, data_overrides=[], set=[])
  config = training.config_for(args, "dense", 16384, "full_save_attention")
  assert (config.train.warmup_steps, config.train.warmup_fraction) == (50, 0.0)
  assert (config.model.remat, config.train.per_device_batch) == ("full_save_attention", 2)


# Kernel names as a profile of two training steps reports them.
_STEP_EVENTS = [("pisa_pool_g64", 1e6), ("pisa_select_two_stage_leaves", 2e6),
                ("pisa_sparse_attention_fwd", 3e6), ("pisa_sparse_attention_dq", 4e6),
                ("pisa_sparse_attention_dkv", 2e6), ("loop_fusion_3", 5e5),
                ("loop_fusion_7", 5e5), ("cudnn_sdpa_fprop_sm90", 1e6)] * 2


def test_training_kernels_summarise_a_step_by_kernel_and_group(tmp_path):
  from benchmarks import _record, training
  got = training.summarise_kernels(_STEP_EVENTS, steps=2)
  assert (got["launches_per_step"], got["device_ms"]) == (8.0, 14.0), got
  assert got["groups_ms"] == {"selection": 3.0, "attention fwd": 3.0, "attention bwd": 6.0,
                              "cudnn attention": 1.0, "other": 1.0}, got
  fusion = next(k for k in got["kernels"] if k["name"] == "loop_fusion")
  assert (fusion["launches_per_step"], fusion["ms_per_step"]) == (2.0, 1.0)
  assert got["kernels"][0]["name"] == "pisa_sparse_attention_dq"  # largest first
  assert training.summarise_kernels([], steps=2) == {}
  # The kernels result replots as its own kind; a training result keeps the training plot.
  rec = _record.Recorder(training.KERNELS_NAME, {"preset": "cpt-418m"}, tmp_path / "run")
  for kept in (True, False):
    rec.add(attention="pisa", seq_len=16384, remat="full", indices_kept=kept, **got)
  record = training.main(["--replot", str(rec.path), "--out", str(tmp_path / "plot")])
  assert (tmp_path / "plot" / "training_kernels.png").stat().st_size > 0
  table = training.table(record)
  assert "| pisa 16384, full | 8 | 14 | 3 | 3 | 6 | 1 | 1 |" in table, table
  assert "pisa 16384, full, no indices" in table and "pisa_select_two_stage_leaves" in table
  with pytest.raises(SystemExit):
    training.main(["--without-indices", "--out", str(tmp_path)])


def test_paper_settings_goals_and_table():
  from benchmarks import paper_settings
  rows = FAKE_ROWS["paper_settings"][:4]
  goal = paper_settings.goal_row(paper_settings.Setting("418m", 4096, 8, 8, "none", 0), rows)
  assert (goal["value"], goal["target"], goal["met"]) == (1.13, 1.1, True), goal
  missing = paper_settings.goal_row(
      paper_settings.Setting("cpt-418m", 16384, 32, 2, "none", 0), rows)
  assert (missing["value"], missing["met"]) == (None, None)
  table = paper_settings.table({"rows": FAKE_ROWS["paper_settings"]})
  assert "| cpt-418m@65536 | pisa | 32 | 1 | full_save_attention | 8192 | 3.6e+04 |" in table
  assert "| PISA / dense tokens/s, cpt-418m@65536 | 2.57 | 4 | NO |" in table
  # The paper's settings: each at its K, preset and context, every one with a goal.
  assert [(s.key, s.top_k) for s in paper_settings.SETTINGS] == [
      ("418m@4096", 8), ("cpt-418m@16384", 32), ("cpt-418m@65536", 32), ("cpt-1.47b@16384", 32)]
  assert all(s.seq_len in paper_settings.GOALS for s in paper_settings.SETTINGS)


def test_paper_settings_append_keeps_the_other_settings(tmp_path, monkeypatch):
  """Settings measured in separate calls gather in one result with --append; without it a call
  writes only its own."""
  from benchmarks import paper_settings

  def fake(args, setting, attention):
    return dict(case=f"{setting.key}:{attention}", setting=setting.key, preset=setting.preset,
                attention=attention, seq_len=setting.seq_len, remat=setting.remat,
                loss_chunk=setting.loss_chunk, tokens_per_s=200.0 if attention == "pisa" else 100.0)

  monkeypatch.setattr(paper_settings, "run_one", fake)
  out = ["--out", str(tmp_path), "--data", str(tmp_path / "no-data")]
  paper_settings.main(["--only", "418m@4096"] + out)
  record = paper_settings.main(["--only", "cpt-418m@16384", "--append"] + out)
  assert {r["case"] for r in record["rows"]} == {
      f"{key}:{name}" for key in ("418m@4096", "cpt-418m@16384") for name in ("pisa", "dense",
                                                                              "goal")}
  assert any("rows kept from the result of" in n for n in record["notes"])
  # One side again: the other side's row stays, and the goal is worked out from both.
  record = paper_settings.main(["--only", "cpt-418m@16384", "--attention", "pisa", "--append"]
                               + out)
  cpt = [r for r in record["rows"] if r["setting"] == "cpt-418m@16384"]
  assert sorted(r["case"] for r in cpt) == [f"cpt-418m@16384:{n}" for n in ("dense", "goal",
                                                                           "pisa")]
  assert next(r for r in cpt if "goal" in r)["value"] == 2.0
  record = paper_settings.main(["--only", "cpt-418m@16384"] + out)
  assert {r["setting"] for r in record["rows"]} == {"cpt-418m@16384"}


@pytest.mark.slow  # ~25 s of CPU: two toy trainings
def test_paper_settings_toy_runs_both_sides_in_one_process(tmp_path):
  from benchmarks import paper_settings
  record = paper_settings.main(["--toy", "--out", str(tmp_path)])
  runs = {r["attention"]: r for r in record["rows"] if "goal" not in r}
  assert set(runs) == {"pisa", "dense"}, record["rows"]
  for r in runs.values():
    assert r["tokens_per_s"] > 0 and "error" not in r, r
    assert (r["remat"], r["loss_chunk"], r["seq_len"]) == ("full_save_attention", 64, 128), r
    assert r["model_flops_per_token"] > 0
  # The same count on both sides: PISA's attends fewer keys, so fewer model FLOPs a token.
  assert runs["pisa"]["model_flops_per_token"] < runs["dense"]["model_flops_per_token"]
  assert any(n.startswith("MFU = ") for n in record["notes"])
  assert (tmp_path / "paper_settings.json").exists() and (tmp_path / "paper_settings.png").exists()
  with pytest.raises(SystemExit, match="--only"):
    paper_settings.main(["--toy", "--only", "418m@4096", "--out", str(tmp_path)])
