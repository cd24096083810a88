"""`pisa-train`: train a preset, overriding any field, resuming from the workdir's checkpoints.

  pisa-train --config tiny --set model.attention=pisa --workdir runs/x
  pisa-train --config small --set data.path=data/corpus --set train.steps=500 --workdir runs/s
  pisa-train --config cpt-1.47b --set train.init_from=runs/pretrain --workdir runs/cpt

Several processes (one per host, or per GPU under srun) train one run as jax's multi-controller
runtime when launched so: --coordinator HOST:PORT --num-processes N --process-id I, the same from
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, or from SLURM, Open MPI or a
Kubernetes Indexed Job (`pisa_jax.train.distributed` gives the rules); one process with none of
these runs alone. Every process gets the same command; process 0 alone locks and writes the run
folder, which must be on a filesystem every process sees; a process that stops ends the others
within --failure-timeout seconds, and the same command resumes from the last complete checkpoint.

--workdir is a new or empty folder, which becomes a run folder (marked by its pisa-run.json), or a
run folder to resume; any other folder is refused untouched, and one run at a time may use a run
folder. Running the same command again resumes from the newest checkpoint that passes its
checksums; a field set differently than in that checkpoint is listed (old -> new) and recorded in
the folder's config_history.jsonl, while config.json keeps the run's first config. Ctrl-C (or
SIGTERM) finishes the step, saves a checkpoint and exits. Without --config, a --workdir that holds
a config.json (a run, or a `pisa-import` of a pretrained model) starts from that config, any other
from the tiny preset. `--print-config` shows the resolved config and exits without compiling
anything.

Exit status, and the last line printed:
  0    train.steps are complete: "done: step N of N ..."
  3    --run-steps or --max-seconds stopped the run first, after saving a checkpoint:
       "stopped at step S of N (--run-steps); rerun to continue"
  130  Ctrl-C, after saving a checkpoint: "interrupted at step S; rerun the same command to
       resume" (143: the same for SIGTERM; a second signal exits at once, without saving)
  2    a bad argument or config, in one line
  1    a run that cannot start or continue (a folder in use or not a run folder, missing data,
       no usable checkpoint, not enough memory, a non-finite loss, processes started with
       different configs, another process that stopped), in one line
A process that loses process 0 (the coordinator) is ended at once by jax's runtime (SIGABRT).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from pisa_jax.train import distributed

# Exit status of a run that --run-steps or --max-seconds stopped before train.steps.
EXIT_STOPPED = 3


class _PresetNames:
  """The preset names, read from `pisa_jax.configs` only when argparse asks for them: a mistake
  in any other argument is reported before the configs (and jax) are imported."""

  @staticmethod
  def _names() -> list[str]:
    from pisa_jax.configs import PRESETS

    return sorted(PRESETS)

  def __contains__(self, name) -> bool:
    return name in self._names()

  def __iter__(self):
    return iter(self._names())


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


def _index(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"{text} must be >= 0")
  return value


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="pisa-train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=None, choices=_PresetNames(), metavar="PRESET",
                      help="the preset to start from: %(choices)s (default: --workdir's "
                           "config.json when it has one, else tiny)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="SECTION.FIELD=VALUE", help="override a config field (repeatable)")
  parser.add_argument("--workdir",
                      help="the run folder: checkpoints, config.json, config_history.jsonl, "
                           "memory.json and metrics.jsonl go here")
  parser.add_argument("--run-steps", type=_positive(int), default=None,
                      help=f"stop (with a checkpoint, exit status {EXIT_STOPPED}) after this many "
                           f"steps of this invocation")
  parser.add_argument("--max-seconds", type=_positive(float), default=None,
                      help=f"stop (with a checkpoint, exit status {EXIT_STOPPED}) after this much "
                           f"training wall time")
  parser.add_argument("--allow-attention-change", action="store_true",
                      help="resume even though model.attention (or its block_size, top_k, "
                           "branching or beam) differs from the checkpoint's: the weights trained "
                           "with the old attention continue under the new one")
  parser.add_argument("--coordinator", metavar="HOST:PORT",
                      help="multi-process: process 0's address (else JAX_COORDINATOR_ADDRESS or "
                           "the cluster's)")
  parser.add_argument("--num-processes", type=_positive(int), metavar="N",
                      help="multi-process: how many (else JAX_NUM_PROCESSES or the cluster's)")
  parser.add_argument("--process-id", type=_index, metavar="I",
                      help="multi-process: this one, 0..N-1 (else JAX_PROCESS_ID or the "
                           "cluster's)")
  parser.add_argument("--failure-timeout", type=_positive(int), metavar="SECONDS",
                      default=distributed.DEFAULT_FAILURE_TIMEOUT_S,
                      help="multi-process: a process silent this long ends the others "
                           "(default %(default)s)")
  parser.add_argument("--print-config", action="store_true")
  parser.add_argument("--no-progress", action="store_true")
  return parser


def _base_config(args):
  """The named preset, else the config.json of --workdir (a run folder), else tiny."""
  from pisa_jax.configs import get_config

  if args.config is not None:
    return get_config(args.config)
  if args.workdir and (Path(args.workdir) / "config.json").is_file():
    from pisa_jax.train.restore import read_run_config

    return read_run_config(args.workdir)
  return get_config("tiny")


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = _parser()
  args = parser.parse_args(argv)
  try:
    launch = distributed.resolve_launch(args.coordinator, args.num_processes, args.process_id,
                                        failure_timeout=args.failure_timeout)
  except distributed.LaunchError as e:
    parser.error(str(e))
  # Imported once the arguments parse: a mistake in them is reported before jax starts.
  from pisa_jax.configs import apply_overrides, validate
  from pisa_jax.train import run_folder

  if args.config is None and args.workdir and (Path(args.workdir) / "config.json").is_file():
    # The folder's own config is read only once the folder is known to be a run folder.
    try:
      run_folder.inspect_run_folder(Path(args.workdir))
    except (run_folder.RunFolderError, OSError) as e:
      print(f"pisa-train: error: {e}", file=sys.stderr)
      return 1
  try:
    config = validate(apply_overrides(_base_config(args), args.overrides))
  except ValueError as e:
    parser.error(str(e))
  if args.print_config:
    print(config.to_json())
    return 0
  if not args.workdir:
    parser.error("--workdir is required to train")
  workdir = Path(args.workdir)
  try:
    # Checked again by the trainer; here a folder that cannot hold a run is refused before jax.
    run_folder.check_workdir(workdir)
    run_folder.inspect_run_folder(workdir)
    if launch.primary:  # the others never lock it
      run_folder.check_not_in_use(workdir)
  except (run_folder.RunFolderError, OSError) as e:
    print(f"pisa-train: error: {e}", file=sys.stderr)
    return 1
  from pisa_jax.train import compilation_cache

  compilation_cache.enable_for(parser)
  try:
    runtime = distributed.start(launch, prog="pisa-train")
  except RuntimeError as e:
    print(f"pisa-train: error: {e}", file=sys.stderr)
    return 1
  try:
    status = _train(config, workdir, args, argv, runtime)
  except BaseException as e:
    if runtime is None:
      raise
    runtime.fail_unforeseen(e)  # the others end too
  if runtime is not None:
    runtime.done()
  return status


def _train(config, workdir: Path, args, argv: list[str], runtime) -> int:
  """Trains and returns the exit status. A process of a multi-process run that cannot go on
  ends itself and the others through `runtime.fail` (its line, its status)."""

  def failed(line: str, status: int) -> int:
    if runtime is not None:
      runtime.fail(line, status)
    print(line, file=sys.stderr)
    return status

  # SIGTERM during the set-up stops it as Ctrl-C does (the loop catches both signals itself).
  terminated = []

  def on_sigterm(signum, frame):
    terminated.append(signum)
    raise KeyboardInterrupt

  previous = signal.signal(signal.SIGTERM, on_sigterm)
  try:
    from pisa_jax.train import trainer

    result = trainer.train(config, workdir, run_steps=args.run_steps,
                           max_seconds=args.max_seconds, progress=not args.no_progress,
                           allow_attention_change=args.allow_attention_change,
                           command=["pisa-train", *argv])
  except KeyboardInterrupt as e:
    return failed(f"pisa-train: {str(e) or 'interrupted'}",
                  128 + (signal.SIGTERM if terminated else signal.SIGINT))
  except (ValueError, OSError, trainer.NonFiniteLossError, trainer.InsufficientMemoryError) as e:
    # ValueError covers the config, data, run-folder and checkpoint errors, and processes that
    # were started differently.
    return failed(f"pisa-train: error: {e}", 1)
  finally:
    signal.signal(signal.SIGTERM, previous)
  return _report(result, config.train.steps, show=runtime is None or runtime.launch.primary)


def _report(result, steps: int, *, show: bool = True) -> int:
  """Prints the last line, which says how the run ended (unless not `show`: the processes of a
  multi-process run other than 0), and returns the exit status."""
  step = result.end_step

  def say(line: str, stream=sys.stdout) -> None:
    if show:
      print(line, file=stream)

  if result.stop_reason in ("SIGINT", "SIGTERM"):
    what = "interrupted" if result.stop_reason == "SIGINT" else "terminated (SIGTERM)"
    say(f"{what} at step {step}; rerun the same command to resume", sys.stderr)
    return 128 + signal.Signals[result.stop_reason]
  if result.stop_reason is not None:
    flag = "--run-steps" if result.stop_reason == "run_steps" else "--max-seconds"
    say(f"stopped at step {step} of {steps} ({flag}); rerun to continue")
    return EXIT_STOPPED
  if result.already_complete:
    say(f"done: step {step} of {steps}, reached before this run; nothing was trained")
    return 0
  final = result.evals[-1] if result.evals else None
  evals = (f", eval loss {final['eval_loss']:.4f}, eval accuracy {final['eval_accuracy']:.3f}"
           if final else "")
  say(f"done: step {step} of {steps}{evals}; metrics in {result.workdir}/metrics.jsonl")
  return 0


if __name__ == "__main__":
  sys.exit(main())
