"""`pisa-train`: train a preset, overriding any field, resuming from the workdir's checkpoints.

  pisa-train --config tiny --set model.attention=pisa --workdir runs/x
  pisa-train --config small --set data.path=data/corpus --set train.steps=500 --workdir runs/s
  pisa-train --config cpt-1.47b --set train.init_from=runs/pretrain --workdir runs/cpt

Running the same command again resumes from the latest complete checkpoint; Ctrl-C saves one and
exits. `--print-config` shows the resolved config and exits without compiling anything.
"""

from __future__ import annotations

import argparse
import sys

from pisa_jax.configs import PRESETS, apply_overrides, get_config, validate


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="pisa-train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="tiny", choices=sorted(PRESETS))
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
  parser.add_argument("--workdir", help="checkpoints, config.json and metrics.jsonl go here")
  parser.add_argument("--run-steps", type=int, default=None,
                      help="stop (with a checkpoint) after this many steps of this invocation")
  parser.add_argument("--max-seconds", type=float, default=None,
                      help="stop (with a checkpoint) after this much training wall time")
  parser.add_argument("--print-config", action="store_true")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)

  try:
    config = validate(apply_overrides(get_config(args.config), args.overrides))
  except ValueError as e:
    parser.error(str(e))
  if args.print_config:
    print(config.to_json())
    return 0
  if not args.workdir:
    parser.error("--workdir is required to train")

  # Imported after validation: a bad config fails before JAX starts or anything compiles.
  from pisa_jax.train.checkpoint import IncompatibleCheckpointError
  from pisa_jax.train.trainer import NonFiniteLossError, train

  try:
    result = train(config, args.workdir, run_steps=args.run_steps, max_seconds=args.max_seconds,
                   progress=not args.no_progress)
  except (NonFiniteLossError, IncompatibleCheckpointError, FileNotFoundError, ValueError) as e:
    print(f"pisa-train: error: {e}", file=sys.stderr)
    return 1
  final = result.evals[-1] if result.evals else None
  if final:
    print(f"done: step {result.end_step}, eval loss {final['eval_loss']:.4f}, "
          f"eval accuracy {final['eval_accuracy']:.3f}; metrics in {result.workdir}/metrics.jsonl")
  return 0


if __name__ == "__main__":
  sys.exit(main())
