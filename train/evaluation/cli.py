"""`pisa-eval`: the evaluation suite of a `pisa-train` run, any attention kind, dense included.

  pisa-eval --workdir runs/s --suite ppl,ruler,mqar,induction,selection,mixture
  pisa-eval --workdir runs/s --suite ppl --lengths 1024,2048,4096 --samples 32 --out eval/s
  pisa-eval --compare runs/dense runs/pisa runs/bsa --out eval
  pisa-eval --npz attention.npz --out eval/arrays --block-size 64 --top-k 8

Suites (the newest checkpoint of --workdir that passes its checksums; held-out data only):
  ppl        loss and perplexity on --samples windows of the validation split of the run's
             data.path (or --data; an MQAR run: its task's validation examples) at each length,
             and the loss by log-spaced position bucket
  ruler      RULER needle-in-a-haystack (Section 4.3): every task of single_key, multi_key,
             multi_query and multi_value, greedy decoding; Table 3's layout (needs a model whose
             vocabulary covers GPT-2's)
  mqar       multi-query associative recall accuracy against key-value pairs and length
  induction  a random sequence of the held-out data's common tokens, repeated once: the loss
             on its second copy against its first, and the share of copied tokens (Olsson et
             al.'s induction test)
  mixture    a run trained with the retrieval mixture (data.retrieval_fraction): held-out needle
             documents of its own templates and families (the val split of data.retrieval_path),
             answers scored by teacher forcing: does it retrieve at all, whatever RULER says
  selection  the block-selection diagnostic of Section 4.4 (Table 7, Figure 2): Recall@K,
             captured mass and mass ratio of bsa, pisa1, pisa2, pisa (with beams) and exact on
             the model's own post-RoPE q and k; with --npz on any model's arrays instead
             (q [L, B, T, HQ, D], k [L, B, T, HKV, D], post-RoPE, floats)

--lengths (increasing) default to the paper's 1K-16K that fit the model's context: the context
it trained at (train.seq_len); --context raises that limit to measure extrapolation. Writes
eval.json (scores, wall time per part, commit, jax, device, date, checkpoint step, config),
eval.md (the tables) and one PNG per part to RUN/eval (or --out), after every part; parts run
earlier on the same checkpoint are kept. --compare reads the eval.json of runs (a run folder,
its eval folder or the file) and writes one table across them to stdout and --out/compare.md.

pisa-eval runs in one process on one device (the model is restored whole to it): launched as
several processes (the JAX_* variables, srun or mpirun with more than one task; the rules of
`pisa_jax.train.distributed`), it refuses before importing jax rather than run every process on
the same files.

A mistake ends in one line on stderr: exit status 2 for a bad argument or input (one that names
it), 1 for a checkpoint, tokenizer or haystack that cannot be read. Ctrl-C ends it with status
130 and a line naming the parts kept in eval.json (each is saved whole as it finishes) and the
--suite that finishes the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pisa_jax._command_line import ArgumentParser, deferred_interrupt
from pisa_jax.train import compilation_cache, distributed, restore
from pisa_jax.train.evaluation import arguments
from pisa_jax.train.evaluation.arguments import EvalArgumentError

PROG = "pisa-eval"
SUITES = ("ppl", "ruler", "mqar", "induction", "selection", "mixture")
DEFAULT_SAMPLES = 16
DEFAULT_BATCH = 4
# --npz without --block-size / --top-k: the paper's C and K (Table 7).
NPZ_BLOCK_SIZE, NPZ_TOP_K = 64, 8
DEFAULT_BEAM_FACTORS = (1.0, 2.0)
# The suites that read each suite-specific option: given without any of them, it is a mistake.
OPTION_SUITES = {"data": ("ppl", "selection"), "mqar_pairs": ("mqar",),
                 "top_k": ("selection",), "block_size": ("selection",),
                 "beam_factors": ("selection",), "ruler_answers": ("ruler",)}


def _ints(text: str, *, increasing: bool = False) -> list[int]:
  values = []
  for item in text.split(","):
    try:
      value = int(item)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{item!r} is not an int") from None
    if value < 1:
      raise argparse.ArgumentTypeError(f"{value} must be > 0")
    values.append(value)
  if increasing and any(b <= a for a, b in zip(values, values[1:])):
    raise argparse.ArgumentTypeError(f"{text} must be increasing (sorted, no repeats)")
  return values


def _lengths(text: str) -> list[int]:
  return _ints(text, increasing=True)


def _floats(text: str) -> list[float]:
  try:
    return [float(x) for x in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _suites(text: str) -> list[str]:
  names = [s.strip() for s in text.split(",")]
  for name in names:
    if name not in SUITES:
      raise argparse.ArgumentTypeError(f"unknown suite {name!r}: known {', '.join(SUITES)}")
  if len(set(names)) < len(names):
    raise argparse.ArgumentTypeError(f"{text}: a suite is listed twice")
  return [s for s in SUITES if s in names]


def _int(text: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None


def _positive(text: str) -> int:
  value = _int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be > 0")
  return value


def build_parser() -> argparse.ArgumentParser:
  parser = ArgumentParser(prog=PROG, description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--workdir", type=Path, help="the run folder of pisa-train")
  what.add_argument("--compare", nargs="+", type=Path, metavar="RUN",
                    help="runs (or eval folders, or eval.json files) to put in one table")
  what.add_argument("--npz", type=Path, help="selection on q and k arrays instead of a run")
  parser.add_argument("--suite", type=_suites, help=f"comma-separated: {','.join(SUITES)}")
  parser.add_argument("--lengths", type=_lengths, help="window lengths in tokens, increasing")
  parser.add_argument("--samples", type=_positive, default=None,
                      help=f"windows (ppl, induction, selection), examples per cell (mqar), "
                           f"samples per task and length (ruler); default {DEFAULT_SAMPLES}")
  parser.add_argument("--seed", type=_int, default=None,
                      help="RULER samples, MQAR and induction examples (and an MQAR run's "
                           "held-out ones); default 0")
  parser.add_argument("--out", type=Path, help="default: RUN/eval (--compare: the current folder)")
  parser.add_argument("--context", type=_positive, default=None,
                      help="longest length allowed; default: the run's train.seq_len")
  parser.add_argument("--data", default=None,
                      help="held-out text for ppl and selection: a pisa-prepare-data folder "
                           "(default: the run's data.path)")
  parser.add_argument("--batch-size", type=_positive, default=None,
                      help=f"windows or prompts per forward pass; default {DEFAULT_BATCH}")
  parser.add_argument("--mqar-pairs", type=_lengths, default=None,
                      help="key-value pairs per MQAR example; default: powers of two from 4 "
                           "that fit the longest length (and the run's own)")
  parser.add_argument("--top-k", type=_lengths, default=None,
                      help="selection: K values; default: the run's model.top_k "
                           f"(--npz: {NPZ_TOP_K})")
  parser.add_argument("--block-size", type=_positive, default=None,
                      help=f"selection: C; default: the run's model.block_size (--npz: "
                           f"{NPZ_BLOCK_SIZE})")
  parser.add_argument("--beam-factors", type=_floats, default=None,
                      help="selection: pisa beams as multiples of K; default "
                           f"{','.join(f'{f:g}' for f in DEFAULT_BEAM_FACTORS)}")
  parser.add_argument("--ruler-answers", action="store_const", const=True, default=None,
                      help="ruler: also score each one-answer sample's answer teacher-forced "
                           "after its answer prefix (a forward pass a sample): finds the needle "
                           "but does not write it, or does not find it")
  parser.add_argument("--no-progress", action="store_true", help="no progress bars")
  return parser


def _only_with(parser, args, mode: str, allowed: set[str]) -> None:
  """An option that the mode does not read is a mistake, not something to ignore."""
  fields = ("suite", "lengths", "samples", "seed", "context", "data", "batch_size",
            "mqar_pairs", "top_k", "block_size", "beam_factors", "ruler_answers")
  for field in fields:
    if field not in allowed and getattr(args, field) is not None:
      parser.error(f"--{field.replace('_', '-')}: does not apply to {mode}")


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    launch = distributed.launch_from_environment()
  except distributed.LaunchError as e:
    parser.error(str(e))
  if launch.multi_process:
    parser.error(f"launched as {launch.describe()}: {PROG} evaluates in one process on one "
                 f"device; run it once (srun --ntasks=1, or without the JAX_* variables)")
  if args.compare:
    _only_with(parser, args, "--compare", set())
  elif args.npz:
    _only_with(parser, args, "--npz", {"suite", "lengths", "top_k", "block_size",
                                       "beam_factors"})
    if args.suite is not None and args.suite != ["selection"]:
      parser.error(f"--suite: {','.join(args.suite)}: --npz holds attention inputs only; its "
                   f"suite is selection")
    if args.out is None:
      parser.error("--out: required with --npz (there is no run folder to write into)")
  elif args.suite is None:
    parser.error(f"--suite: required with --workdir; known {', '.join(SUITES)}")
  else:
    for field, readers in OPTION_SUITES.items():
      if getattr(args, field) is not None and not set(readers) & set(args.suite):
        parser.error(f"--{field.replace('_', '-')}: applies to the {' and '.join(readers)} "
                     f"suite{'s' if len(readers) > 1 else ''} only")
  if args.beam_factors is None:
    args.beam_factors = list(DEFAULT_BEAM_FACTORS)
  if args.seed is None:
    args.seed = 0
  try:
    arrays = _check_before_jax(args)
  except EvalArgumentError as e:
    parser.error(str(e))
  if not args.compare:  # --compare reads result files and compiles nothing
    compilation_cache.enable_for(parser)
  # Imported once the arguments are known good: a mistake costs no JAX start-up.
  from pisa_jax.train.evaluation import common, report

  try:
    if args.compare:
      return _compare(args, report)
    return _evaluate(args, arrays, common, report)
  except KeyboardInterrupt:
    print(f"\n{PROG}: interrupted before any part ran: nothing was written; rerun the same "
          f"command", file=sys.stderr)
    return 130
  except EvalArgumentError as e:
    parser.error(str(e))
  except (ValueError, OSError) as e:
    # Corrupt or incompatible checkpoints, a missing tokenizer or haystack file.
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1


def _check_before_jax(args):
  """What can be checked without a model: --workdir is a run folder, the arrays of --npz, the
  selection flags given. Returns --npz's (q, k) (else None); raises EvalArgumentError."""
  if args.workdir is not None:
    try:
      restore.read_run_config(args.workdir)
    except restore.NoCheckpointError as e:
      raise EvalArgumentError(f"--{e}") from None
  if args.top_k is not None or args.block_size is not None:
    arguments.check_selection_options(block_size=args.block_size, top_ks=args.top_k or [],
                                       beam_factors=args.beam_factors, lengths=args.lengths)
  if args.npz is None:
    return None
  q, k = arguments.load_npz(args.npz)
  if args.lengths and args.lengths[-1] > q.shape[2]:
    raise EvalArgumentError(f"--lengths: {args.lengths[-1]} exceeds the arrays' T = "
                            f"{q.shape[2]} (--npz; each length is a prefix)")
  return q, k


def restore_model(workdir: Path):
  """`pisa_jax.train.restore.restore_model`, its missing-run error as a bad --workdir."""
  try:
    return restore.restore_model(workdir)
  except restore.NoCheckpointError as e:
    raise EvalArgumentError(f"--{e}") from None


def _evaluate(args, arrays, common, report) -> int:
  from pisa_jax.train.evaluation import induction, mixture, mqar, needles, perplexity, selection

  progress = not args.no_progress
  if args.npz:
    q, k = arrays
    lengths = args.lengths or [q.shape[2]]
    opts = dict(block_size=args.block_size or NPZ_BLOCK_SIZE, top_ks=args.top_k or [NPZ_TOP_K],
                beam_factors=args.beam_factors)
    arguments.check_selection_options(lengths=lengths, **opts)
    result = _new_result(common, None, None)
    run = {"selection": lambda: selection.run_on_arrays(q, k, path=str(args.npz),
                                                        lengths=lengths, progress=progress,
                                                        **opts)}
    return _run_parts(run, result, args.out, report)

  config, model, step = restore_model(args.workdir)
  context, where = common.model_context(config, args.context)
  lengths = args.lengths or common.default_lengths(context)
  common.check_lengths(lengths, context, where)
  samples = args.samples or DEFAULT_SAMPLES
  batch = args.batch_size or DEFAULT_BATCH
  # Everything is checked before the first part runs: a mistake costs no evaluation.
  for name in ("ppl", "selection"):
    if name in args.suite:
      common.check_data(config, lengths=lengths, data=args.data, what=name)
  if "ruler" in args.suite:
    from pisa_jax.train.tokenizer import run_encoding

    encoding, stop = run_encoding(args.workdir)
    needles.check_vocabulary(config, encoding)
    needles.load_ruler()
  if "mixture" in args.suite:
    mixture.haystack(config)
  if "induction" in args.suite:
    induction.check_lengths(lengths)
    # Its common tokens come from the held-out data (`induction.common_tokens`).
    common.check_data(config, lengths=lengths, data=args.data, what="induction")
  if "mqar" in args.suite:
    pairs = args.mqar_pairs or mqar.default_pairs(config, lengths)
    mqar.check_pairs(pairs, config, lengths)
  if "selection" in args.suite:
    opts = dict(block_size=args.block_size or config.model.block_size,
                top_ks=args.top_k or [config.model.top_k], beam_factors=args.beam_factors)
    arguments.check_selection_options(lengths=lengths, **opts)

  out = args.out or args.workdir / "eval"
  result = _new_result(common, {"workdir": str(args.workdir), "step": step}, config.to_dict())
  result["context"] = {"tokens": context, "from": where}
  kw = dict(lengths=lengths, samples=samples, seed=args.seed, progress=progress)

  def ruler_part():
    part, records = needles.run_ruler(model, config, batch_size=batch, encoding=encoding,
                                      stop=stop, answer_scores=bool(args.ruler_answers), **kw)
    out.mkdir(parents=True, exist_ok=True)
    with deferred_interrupt():
      _write_whole(out / part["predictions"], "".join(json.dumps(r) + "\n" for r in records))
    return part

  run = {
      "ppl": lambda: perplexity.run_perplexity(model, config, data=args.data,
                                               batch_size=batch, **kw),
      "ruler": ruler_part,
      "mqar": lambda: mqar.run_mqar(model, config, pairs=pairs, batch_size=batch, **kw),
      "induction": lambda: induction.run_induction(model, config, data=args.data,
                                                   batch_size=batch, **kw),
      "selection": lambda: selection.run_on_checkpoint(model, config, data=args.data, **opts,
                                                       **kw),
      "mixture": lambda: mixture.run_mixture(model, config, batch_size=batch, context=context,
                                             **kw),
  }
  print(f"{PROG}: step {step} of {args.workdir} ({config.model.attention} attention), lengths "
        f"{','.join(map(str, lengths))}, {samples} samples; writing to {out}", flush=True)
  return _run_parts({name: run[name] for name in args.suite}, result, out, report)


def _new_result(common, checkpoint, config) -> dict:
  from pisa_jax.train import provenance

  return {"evaluation": PROG, **provenance.environment(), "checkpoint": checkpoint,
          "config": config, "parts": {}}


def _run_parts(run: dict, result: dict, out: Path, report) -> int:
  """Runs each part, saving eval.json, eval.md and the plots after each; keeps the parts of an
  earlier eval.json in `out` made from the same checkpoint."""
  out.mkdir(parents=True, exist_ok=True)
  earlier = _read_json(out / "eval.json")
  if earlier and result["checkpoint"] and earlier.get("checkpoint") == result["checkpoint"]:
    kept = {k: v for k, v in earlier.get("parts", {}).items() if k not in run}
    if kept:
      print(f"kept {', '.join(kept)} from the earlier {out / 'eval.json'} (same checkpoint)")
    result["parts"].update(kept)
  done: list[str] = []
  try:
    for name, part_fn in run.items():
      part = part_fn()
      part.update(commit=result["commit"], date=result["date"])
      result["parts"][name] = part
      result["parts"] = {k: result["parts"][k] for k in report.PARTS if k in result["parts"]}
      with deferred_interrupt():  # a part is in eval.json whole, or not at all
        paths = _save(result, out, report)
        done.append(name)
      label = Path(result["checkpoint"]["workdir"]).name if result["checkpoint"] else "arrays"
      body = report.part_markdown(name, part, label)
      print(f"\n## {name} ({part['wall_seconds']:.1f} s)\n\n{body}\n", flush=True)
  except KeyboardInterrupt:
    print(f"\n{_interrupted_line(list(run), done, out)}", file=sys.stderr)
    return 130
  print(f"wrote {', '.join(str(p) for p in paths)}")
  return 0


def _interrupted_line(parts: list[str], done: list[str], out: Path) -> str:
  """What an interrupted evaluation kept, and the command line that finishes it."""
  left = [name for name in parts if name not in done]
  kept = (f"{out / 'eval.json'} keeps {', '.join(done)} of this run" if done else
          f"nothing of this run was written to {out}")
  return (f"{PROG}: interrupted during {left[0]}: {kept}; rerun with --suite {','.join(left)} "
          f"to finish (parts already in eval.json from the same checkpoint are kept)")


def _write_whole(path: Path, text: str) -> None:
  """Writes `path` through a temporary file renamed over it: it is never half-written."""
  partial = path.with_name(f".{path.name}.partial")
  try:
    partial.write_text(text)
    os.replace(partial, path)
  finally:
    partial.unlink(missing_ok=True)


def _save(result: dict, out: Path, report) -> list[Path]:
  _write_whole(out / "eval.md", report.markdown(result))
  plots = report.write_plots(result, out)
  # Last: eval.json names the parts that are complete.
  _write_whole(out / "eval.json", json.dumps(result, indent=1) + "\n")
  return [out / "eval.json", out / "eval.md"] + plots


def _read_json(path: Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _compare(args, report) -> int:
  labelled = []
  for given in args.compare:
    candidates = [given] if given.suffix == ".json" else [given / "eval" / "eval.json",
                                                          given / "eval.json"]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
      raise EvalArgumentError(f"--compare: {given} has no eval.json (looked for "
                              f"{' and '.join(map(str, candidates))}); run pisa-eval on it first")
    result = _read_json(path)
    if not isinstance(result, dict) or result.get("evaluation") != PROG:
      raise EvalArgumentError(f"--compare: {path} is not an eval.json written by {PROG}")
    # A run's name; for arrays (no checkpoint) the folder the result is in.
    workdir = (result.get("checkpoint") or {}).get("workdir")
    label = Path(workdir).name if workdir else path.parent.resolve().name
    labelled.append([label, result, str(given)])
  names = [label for label, _, _ in labelled]
  for entry in labelled:
    if names.count(entry[0]) > 1:
      entry[0] = entry[2]
  text = report.compare([(label, result) for label, result, _ in labelled])
  out = args.out or Path(".")
  out.mkdir(parents=True, exist_ok=True)
  (out / "compare.md").write_text(text)
  print(text)
  print(f"wrote {out / 'compare.md'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
