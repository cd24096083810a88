"""The README's main job: `pisa-demo` (`./run.sh demo` runs `python -m pisa_jax.train.demo`).

Trains the `tiny` preset twice on the CPU, on multi-query associative recall (MQAR, generated on the
fly, nothing to download): once with PISA block-sparse attention and once with dense attention, on
identical batches. Each query must retrieve the value stored next to its key up to 120 tokens
earlier; PISA attends to top_k * block_size = 64 of the 128 keys, of which 24 are forced (the
first, previous and current blocks), so it has to select the block holding the key itself. It
ends with the loss curve's start and end and the recall accuracy of both beside chance.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pisa_jax._command_line import ArgumentParser
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.train import compilation_cache


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="pisa-demo", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=None, help="training steps per model")
  parser.add_argument("--attention", nargs="+", default=["pisa", "dense"],
                      help="attention kinds to compare (pisa, pisa1, pisa2, bsa, dense)")
  parser.add_argument("--workdir", type=Path, default=None,
                      help="keep the runs here (default: a temporary folder, removed at the end)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="SECTION.FIELD=VALUE", help="override a field of the tiny preset")
  args = parser.parse_args(argv)

  base = get_config("tiny")
  overrides = list(args.overrides)
  if args.steps is not None:
    overrides.append(f"train.steps={args.steps}")
  configs = {}
  try:
    for kind in args.attention:
      configs[kind] = validate(apply_overrides(base, overrides + [f"model.attention={kind}"]))
  except ValueError as e:
    parser.error(str(e))
  compilation_cache.enable_for(parser)

  from pisa_jax.models.decoder import count_params
  from pisa_jax.train import trainer

  # Without --workdir the runs go to a temporary folder that is removed at the end.
  root = args.workdir or Path(tempfile.mkdtemp(prefix="pisa-demo-"))
  any_cfg = next(iter(configs.values()))
  m, d, t = any_cfg.model, any_cfg.data, any_cfg.train
  print(f"MQAR: {t.seq_len} tokens per sequence, {d.mqar_num_pairs} key-value pairs at the start, "
        f"each key queried once later; vocabulary {m.vocab_size}.\n"
        f"Model: {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} query / {m.num_kv_heads} "
        f"KV heads ({count_params(m) / 1e6:.2f}M parameters); {t.steps} steps of "
        f"{t.per_device_batch} sequences. Sparse attention: blocks of {m.block_size}, top_k "
        f"{m.top_k} ({m.top_k * m.block_size} of {t.seq_len} keys per query).\n"
        + (f"Runs in {root}\n" if args.workdir else ""), flush=True)

  rows, kind = [], next(iter(configs))
  try:
    for kind, cfg in configs.items():
      print(f"--- {kind} attention ---", flush=True)
      t0 = time.perf_counter()
      result = trainer.train(cfg, root / kind, progress=True, print_config=False)
      elapsed = time.perf_counter() - t0
      if result.already_complete:
        print(f"{root / kind} already holds this finished run: pass a new --workdir to train "
              f"again", flush=True)
        return 1
      if result.stopped_early:  # the trainer's first Ctrl-C: a checkpoint, then it returns
        raise KeyboardInterrupt
      losses = [result.losses[s] for s in sorted(result.losses)]
      k = min(10, len(losses))
      rows.append({
          "kind": kind, "first": sum(losses[:k]) / k, "last": sum(losses[-k:]) / k,
          "eval_loss": result.evals[-1]["eval_loss"], "recall": result.evals[-1]["eval_accuracy"],
          "seconds": elapsed,
      })
  except KeyboardInterrupt:
    kept = (f"the runs so far are in {root}; rerun the same command to resume" if args.workdir
            else "nothing was kept (the runs were in a temporary folder); pass --workdir DIR "
                 "to keep them and resume")
    print(f"{parser.prog}: interrupted during the {kind} run: {kept}", file=sys.stderr)
    return 130
  finally:
    if args.workdir is None:
      shutil.rmtree(root, ignore_errors=True)

  chance = 1.0 / (m.vocab_size - m.vocab_size // 2)
  header = ("attention", "train loss (first -> last 10 steps)", "held-out loss", "recall", "time")
  table = [header]
  for r in rows:
    label = r["kind"] if r["kind"] == "dense" else f"{r['kind']} (C={m.block_size}, K={m.top_k})"
    trend = "down" if r["last"] < r["first"] else "NOT down"
    table.append((label, f"{r['first']:.3f} -> {r['last']:.3f} ({trend})", f"{r['eval_loss']:.3f}",
                  f"{100 * r['recall']:.1f}%", f"{r['seconds']:.0f}s"))
  table.append(("chance (1 / #values)", "", f"{math.log(1 / chance):.3f}", f"{100 * chance:.1f}%", ""))
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  print("\nResult: recall = share of held-out MQAR queries whose value is the top prediction")
  for row in table:
    print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
