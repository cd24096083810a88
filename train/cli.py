"""`pisa-train`: train a preset, overriding any field, resuming from the workdir's checkpoints.

  pisa-train --config tiny --set model.attention=pisa --workdir runs/x
  pisa-train --config small --set data.path=data/corpus --set train.steps=500 --workdir runs/s
  pisa-train --config cpt-1.47b --set train.init_from=runs/pretrain --workdir runs/cpt
  pisa-train --workdir runs/smol --set data.path=data/smol   # a pisa-import run: its own config

Running the same command again resumes from the newest checkpoint that passes its checksums; Ctrl-C
saves one and exits. Without --config, a --workdir that holds a config.json (a run, or a
`pisa-import` of a pretrained model) starts from that config, any other from the tiny preset.
`--print-config` shows the resolved config and exits without compiling anything. A mistake ends
in one line on stderr: exit status 2 for a bad argument or config, 1 for a run that cannot start
or continue, 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pisa_jax.configs import PRESETS, apply_overrides, get_config, validate
from pisa_jax.train import compilation_cache


def _positive(kind):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
      raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value

  parse.__name__ = kind.__name__
  return parse


def _base_config(args):
  """The named preset, else the config.json of --workdir (a run folder), else tiny."""
  if args.config is not None:
    return get_config(args.config)
  if args.workdir and (Path(args.workdir) / "config.json").is_file():
    from pisa_jax.train.restore import read_run_config

    return read_run_config(args.workdir)
  return get_config("tiny")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="pisa-train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=None, choices=sorted(PRESETS),
                      help="the preset to start from; default: --workdir's config.json when it "
                           "has one, else tiny")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
  parser.add_argument("--workdir",
                      help="checkpoints, config.json, memory.json and metrics.jsonl go here")
  parser.add_argument("--run-steps", type=_positive(int), default=None,
                      help="stop (with a checkpoint) after this many steps of this invocation")
  parser.add_argument("--max-seconds", type=_positive(float), default=None,
                      help="stop (with a checkpoint) after this much training wall time")
  parser.add_argument("--allow-attention-change", action="store_true",
                      help="resume even though model.attention (or its block_size, top_k, "
                           "branching or beam) differs from the checkpoint's: the weights trained "
                           "with the old attention continue under the new one")
  parser.add_argument("--print-config", action="store_true")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)

  try:
    config = validate(apply_overrides(_base_config(args), args.overrides))
  except (ValueError, OSError) as e:  # OSError: a --workdir config.json that cannot be read
    parser.error(str(e))
  if args.print_config:
    print(config.to_json())
    return 0
  if not args.workdir:
    parser.error("--workdir is required to train")
  compilation_cache.enable_for(parser)

  try:
    # Imported after validation: a bad config fails before JAX starts or anything compiles.
    from pisa_jax.train import trainer

    result = trainer.train(config, args.workdir, run_steps=args.run_steps,
                           max_seconds=args.max_seconds, progress=not args.no_progress,
                           allow_attention_change=args.allow_attention_change)
  except KeyboardInterrupt as e:
    print(f"pisa-train: {str(e) or 'interrupted'}", file=sys.stderr)
    return 130
  except (ValueError, OSError, trainer.NonFiniteLossError, trainer.InsufficientMemoryError) as e:
    # ValueError covers the config, data, run-folder and checkpoint errors.
    print(f"pisa-train: error: {e}", file=sys.stderr)
    return 1
  if result.already_complete:
    return 0
  final = result.evals[-1] if result.evals else None
  if final:
    print(f"done: step {result.end_step}, eval loss {final['eval_loss']:.4f}, "
          f"eval accuracy {final['eval_accuracy']:.3f}; metrics in {result.workdir}/metrics.jsonl")
  return 0


if __name__ == "__main__":
  sys.exit(main())
