"""How much does a bfloat16 pyramid change what PISA selects? The float32 pyramid against the
bfloat16 one (`summary_dtype="bfloat16"`: each mean computed in float32 and rounded once, the
queries scored against it in one bf16 dot) on the same queries and keys.

For each q/k file and top_k, both pyramids select (`pisa_jax.select_blocks`, selector pisa, C =
--block-size), and each selection is scored against full attention (`selection_quality`: Recall@K,
Eq. 35; captured mass, Eq. 57; mass ratio, Eq. 36; O(T^2) in float32, chunked). Rows: one per
(file, K, summary dtype); the bfloat16 row adds identical_rows, the share of (query, KV head)
rows whose indices equal the float32 pyramid's (among the rows that choose: more than K blocks
up to the query), and recall_delta_points, its Recall@K minus the
float32 one in percentage points (goal: within 0.5). The decode step's speed with either pyramid
is `benchmarks.decode --summary-dtype float32,bfloat16`.

The q/k come from `benchmarks.dump_qk` (post-RoPE queries and keys of one layer of a trained run,
or of an imported one: `pisa-import MODEL.gguf --out runs/smollm2` makes a run folder of
SmolLM2); --random gives random normal q/k instead, labelled "random" in every row (a fallback:
random keys have no structure for the pyramid to find).

  python -m benchmarks.dump_qk --workdir runs/small --seq-len 32768 --out /tmp/qk32k.npz
  python -m benchmarks.dump_qk --workdir runs/small --seq-len 131072 --out /tmp/qk128k.npz
  python -m benchmarks.summary_dtype --qk-npz /tmp/qk32k.npz --qk-npz /tmp/qk128k.npz
  python -m benchmarks.summary_dtype --random 32768,131072          # no trained run at hand
  python -m benchmarks.summary_dtype --random 1024 --top-k 8 --block-size 16 --out /tmp/s  # CPU
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from benchmarks import _record

NAME = "summary_dtype"
DTYPES = ("float32", "bfloat16")


def inputs(args):
  """(label, source, q, k) for every --qk-npz file and --random length: q `[1, T, HQ, D]`, k
  `[1, T, HKV, D]`, bfloat16 (the models' compute dtype)."""
  for path in args.qk_npz:
    data = np.load(path)
    q, k = (jnp.asarray(data[name], jnp.bfloat16) for name in ("q", "k"))
    source = f"{Path(str(data['workdir'])).name} layer {int(data['layer'])} step {int(data['step'])}"
    yield "real", source, q, k
  for t in args.random:
    keys = jax.random.split(jax.random.key(0), 2)
    hq, hkv, d = args.random_heads
    yield ("random", f"random normal {hq}/{hkv} heads d{d}",
           jax.random.normal(keys[0], (1, t, hq, d), jnp.bfloat16),
           jax.random.normal(keys[1], (1, t, hkv, d), jnp.bfloat16))


def measure(args, rec: _record.Recorder) -> None:
  if jax.default_backend() != "gpu":
    rec.note(f"backend {jax.default_backend()}: a smoke run, not a measurement")
  if not args.qk_npz:
    rec.note("no --qk-npz: random q/k only (a fallback, not a trained model's)")
  for label, source, q, k in inputs(args):
    t, hq, d = q.shape[1], q.shape[2], q.shape[3]
    hkv = k.shape[2]
    for top_k in args.top_k:
      base = dict(qk=label, source=source, seq_len=t, hq=hq, hkv=hkv, d=d, top_k=top_k,
                  block_size=args.block_size)
      indices, recall = {}, {}
      for dtype in DTYPES:
        spec = pisa_jax.SelectionSpec(block_size=args.block_size, top_k=top_k,
                                      summary_dtype=dtype)
        idx = pisa_jax.select_blocks(q, k, spec=spec, implementation=args.implementation)
        quality = pisa_jax.selection_quality(q, k, idx, spec=spec)
        indices[dtype], recall[dtype] = idx, float(quality.recall)
        row = dict(base, summary_dtype=dtype, recall=round(recall[dtype], 5),
                   captured_mass=round(float(quality.captured_mass), 5),
                   mass_ratio=round(float(quality.mass_ratio), 5),
                   rows_scored=int(quality.num_rows))
        if dtype != DTYPES[0]:
          same = jnp.all(indices[dtype] == indices[DTYPES[0]], axis=-1)  # [B, T, HKV]
          # Only rows that choose: a query with at most K blocks up to it keeps them all.
          scored = jnp.broadcast_to(
              (jnp.arange(t) // args.block_size + 1 > top_k)[None, :, None], same.shape)
          chosen = int(jnp.sum(scored))  # None where no row chooses (T <= K C)
          row.update(identical_rows=round(float(jnp.sum(same & scored)) / chosen, 5)
                     if chosen else None,
                     recall_delta_points=round(100 * (recall[dtype] - recall[DTYPES[0]]), 3))
        rec.add(**row)
      print(table(rec.record), flush=True)


def table(record: dict) -> str:
  rows = record["rows"]
  by = {(r["qk"], r["source"], r["seq_len"], r["top_k"], r["summary_dtype"]): r for r in rows}
  body = []
  for key in dict.fromkeys((r["qk"], r["source"], r["seq_len"], r["top_k"]) for r in rows):
    f32, bf16 = by.get((*key, "float32"), {}), by.get((*key, "bfloat16"), {})
    body.append([key[0], key[1], key[2], key[3], bf16.get("identical_rows"), f32.get("recall"),
                 bf16.get("recall"), bf16.get("recall_delta_points"), f32.get("captured_mass"),
                 bf16.get("captured_mass"), f32.get("mass_ratio"), bf16.get("mass_ratio")])
  return _record.markdown(
      ["q/k", "source", "T", "K", "identical rows", "Recall@K f32", "Recall@K bf16",
       "bf16 - f32 points", "captured mass f32", "captured mass bf16", "mass ratio f32",
       "mass ratio bf16"], body)


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  rows = [r for r in record["rows"] if r["summary_dtype"] == "bfloat16"]
  labels = [f"{r['qk']} {r['seq_len'] // 1024}K K{r['top_k']}" for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  x = np.arange(len(rows))
  axes[0].bar(x, [np.nan if r["identical_rows"] is None else 100 * r["identical_rows"]
                  for r in rows])
  axes[0].set_ylabel("% of (query, KV head) rows: indices identical")
  axes[1].bar(x, [r["recall_delta_points"] for r in rows])
  axes[1].axhline(-0.5, color="gray", linestyle=":", label="goal: within 0.5 points")
  axes[1].axhline(0.5, color="gray", linestyle=":")
  axes[1].set_ylabel("Recall@K, bf16 pyramid minus f32 (points)")
  axes[1].legend(fontsize=7)
  for ax in axes:
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
  fig.suptitle(f"bfloat16 against float32 pyramid, selector pisa, {record['device']}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(selector="pisa", block_size=args.block_size, top_k=list(args.top_k),
              qk_npz=[str(p) for p in args.qk_npz], random=list(args.random),
              random_heads=list(args.random_heads), implementation=args.implementation,
              dtype="bfloat16")


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--qk-npz", type=Path, action="append", default=[],
                 help="q/k of benchmarks.dump_qk, repeatable (one per length)")
  p.add_argument("--random", type=_record.parse_ints, default=(),
                 help="also random q/k of these lengths, comma-separated")
  p.add_argument("--random-heads", type=lambda s: tuple(_record.parse_ints(s.replace(":", ","))),
                 default=(32, 2, 128), help="HQ:HKV:D of --random (default 32:2:128)")
  p.add_argument("--top-k", type=_record.parse_ints, default=(8, 32))
  p.add_argument("--block-size", type=int, default=64)
  p.add_argument("--implementation", default=None, choices=(None, "pallas", "xla"))
  args = p.parse_args(argv)
  if not args.replot and not args.qk_npz and not args.random:
    raise SystemExit("give --qk-npz FILE (benchmarks.dump_qk) or --random LENGTHS")
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
