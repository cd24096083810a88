"""`pisa-lm-eval`: lm-eval's own command line with the model "pisa-jax" registered.

  pisa-lm-eval --model pisa-jax --model_args workdir=runs/small --tasks mytask \\
      --include_path DIR --batch_size 16

Every argument has lm-eval's (0.4.13) meaning, subcommands included (`pisa-lm-eval ls tasks`);
`pisa_jax.train.evaluation.lm_eval_adapter` says what the "pisa-jax" model does and which
model_args it takes. lm-eval's parser reads the command line first, and with --model pisa-jax the
run folder and the implementation of --model_args are checked too, all before jax is imported:
a mistake is one line on stderr with exit status 2. Then the adapter is imported (which
registers the model) and lm-eval runs.
"""

from __future__ import annotations

import sys

from pisa_jax import _checks
from pisa_jax.train import compilation_cache, restore

PROG = "pisa-lm-eval"
MODEL = "pisa-jax"


def _one_line_errors(parser) -> None:
  """lm-eval's parsers report a mistake as usage and a message: here as one line."""

  def error(message: str):
    parser.exit(2, f"{PROG}: error: {' '.join(message.split())}\n")

  parser.error = error


def _check_model_args(args) -> None:
  """The "pisa-jax" model's arguments that need no jax: the run folder and the implementation.
  Raises ValueError naming the argument."""
  if getattr(args, "model", None) != MODEL or getattr(args, "config", None):
    return  # another model, or arguments that lm-eval merges from a --config file later
  model_args = args.model_args if isinstance(args.model_args, dict) else {}
  _checks.check_implementation(model_args.get("implementation"),
                               name="--model_args implementation")
  workdir = model_args.get("workdir")
  if workdir in (None, ""):
    raise ValueError(f"--model_args: --model {MODEL} needs workdir=RUN, a pisa-train run folder")
  try:
    restore.read_run_config(str(workdir))
  except restore.NoCheckpointError as e:
    raise ValueError(f"--model_args {e}") from None


def main(argv: list[str] | None = None) -> None:
  """lm-eval's command line with "pisa-jax" registered; argv (default: sys.argv[1:]) is exactly
  lm_eval's."""
  from lm_eval._cli import HarnessCLI

  # lm-eval's parser reads sys.argv itself (it inserts `run` when no subcommand is given).
  sys.argv = [PROG, *(sys.argv[1:] if argv is None else argv)]
  cli = HarnessCLI()
  parsers = [cli._parser, *cli._subparsers.choices.values()]
  cli._parser.prog = PROG
  for name, parser in cli._subparsers.choices.items():
    parser.prog = f"{PROG} {name}"
  for parser in parsers:
    _one_line_errors(parser)
  args = cli.parse_args()
  try:
    _check_model_args(args)
    compilation_cache.enable(prog=PROG)
  except ValueError as e:
    cli._parser.error(str(e))
  from lm_eval.utils import setup_logging

  import pisa_jax.train.evaluation.lm_eval_adapter  # noqa: F401  (registers "pisa-jax")

  setup_logging()
  cli.execute(args)
