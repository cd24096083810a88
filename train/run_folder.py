"""The run folder and the console: checks before a run writes anything, the metrics file trimmed
on resume, and status lines printed above the progress bar."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tqdm import tqdm


class RunFolderError(ValueError):
  """The workdir cannot hold a run."""


def check_workdir(workdir: Path) -> None:
  """A workdir that is a file, or that cannot be created, fails here in one line."""
  for path in (workdir, workdir / "checkpoints"):
    if path.exists() and not path.is_dir():
      raise RunFolderError(
          f"{path} is a file, not a folder: --workdir names a run folder (a new one starts a run, "
          f"an existing one resumes it)")
  existing = workdir.absolute()
  while not existing.exists():
    existing = existing.parent
  if not existing.is_dir():
    raise RunFolderError(f"{existing} is a file: cannot create the run folder {workdir}")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise RunFolderError(f"{existing} is not writable: cannot use the run folder {workdir}")


def _truncate_metrics(path: Path, step: int) -> int:
  """Drops metric rows past `step` and lines cut short by a kill; returns how many were dropped.

  A run killed after its last checkpoint logged steps that the resumed run computes again.
  """
  if not path.exists():
    return 0
  kept, dropped = [], 0
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:
      row = None
    if not isinstance(row, dict) or row.get("step", 0) > step:
      dropped += 1
      continue
    kept.append(line + "\n")
  if dropped:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
  return dropped


class _TqdmHandler(logging.Handler):
  """Writes each record as one line above the progress bar."""

  def emit(self, record):
    try:
      tqdm.write(self.format(record))
    except Exception:
      self.handleError(record)


def console_logging() -> None:
  """Sends the `pisa_jax` loggers' INFO lines to the console as plain lines above the progress bar.

  Done once, and not when the application has given the `pisa_jax` logger a handler of its own.
  The lines do not propagate to the root logger: Orbax's absl logging installs a handler there
  that would print them a second time, prefixed.
  """
  package = logging.getLogger("pisa_jax")
  if package.handlers:
    return
  handler = _TqdmHandler()
  handler.setFormatter(logging.Formatter("%(message)s"))
  package.addHandler(handler)
  package.setLevel(logging.INFO)
  package.propagate = False
