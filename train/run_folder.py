"""The run folder and the console: what a folder must be to hold a run, its one writer, the record
of fields changed on resume, the metrics file trimmed on resume, and status lines printed above the
progress bar.

A run folder holds what `pisa_jax.train.trainer.train` writes, and anything a user puts beside it:

  pisa-run.json         the marker, written when a run starts in a new or empty folder
  pisa-run.lock         the lock of the folder's one writer (`lock`): empty while no run holds it
  config.json           the config the run started with (a resume never rewrites it)
  config_history.jsonl  one row per resume that changed fields: time, step, command, old and new
  memory.json, metrics.jsonl, checkpoints/, skipped_checkpoints/, tensorboard/

In a multi-process run (`pisa_jax.train.distributed`) the folder has one writer too: process 0
(`jax.process_index()` once `jax.distributed.initialize` has run; before jax, the launch's
process id) checks that it is free, locks, marks and writes it; the other processes only read
and write checkpoints through Orbax, never the lock.

This module imports neither jax nor the configs: the CLI refuses a folder before jax starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import logging
import os
import signal
import socket
from pathlib import Path

from tqdm import tqdm

from pisa_jax.train.data import FORMAT as CORPUS_FORMAT

MARKER = "pisa-run.json"
MARKER_FORMAT = "pisa-jax-run-v1"
LOCK = "pisa-run.lock"
HISTORY = "config_history.jsonl"
# The checkpoint module's manifest, its file name and format (that module imports jax and Orbax).
CHECKPOINT_MANIFEST = ("checksums.json", "pisa-jax-checksums-v1")


class RunFolderError(ValueError):
  """The workdir cannot hold a run."""


class RunFolderInUseError(RunFolderError):
  """Another process holds the run folder's lock."""


def _now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def first_missing(path: Path) -> Path | None:
  """The outermost folder of `path` that does not exist yet (`path` itself, or a parent); None
  when `path` exists."""
  missing, parent = None, path.absolute()
  while not parent.exists():
    missing, parent = parent, parent.parent
  return missing


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


def _shown(names: list[str]) -> str:
  return ", ".join(names[:4]) + (f", ... ({len(names)} entries)" if len(names) > 4 else "")


def _read_json(path: Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _is_unmarked_run(workdir: Path) -> bool:
  """A run folder written before runs were marked: `checkpoints/` holds a step folder (a name of
  digits) sealed with the checkpoint module's manifest, and `config.json` is an object of exactly
  the sections model, data and train that `Config.from_dict` accepts. Only `pisa-train` writes
  that pair."""
  name, fmt = CHECKPOINT_MANIFEST
  checkpoints = workdir / "checkpoints"
  if not checkpoints.is_dir() or not any(
      p.name.isdigit() and isinstance(m := _read_json(p / name), dict) and m.get("format") == fmt
      for p in checkpoints.iterdir()):
    return False
  saved = _read_json(workdir / "config.json")
  if not isinstance(saved, dict) or set(saved) != {"model", "data", "train"}:
    return False
  from pisa_jax.configs.base import Config

  try:
    Config.from_dict(saved)
  except (TypeError, ValueError):
    return False
  return True


def inspect_run_folder(workdir: Path) -> str:
  """What `workdir` is, reading only: "new" (absent), "empty", "run" or "unmarked run".

  "empty" also covers a folder holding only the lock file and a half-written marker (a set-up
  that was killed). "run" is a folder with this module's marker. "unmarked run" is one written
  before runs were marked (see `_is_unmarked_run`); the trainer marks it when it resumes.
  Anything else raises RunFolderError in one line naming what the folder holds, a corpus of
  `pisa-prepare-data` included.
  """
  if not workdir.exists():
    return "new"
  names = sorted(p.name for p in workdir.iterdir())
  if set(names) <= {LOCK, MARKER + ".tmp"}:
    return "empty"
  if MARKER in names:
    marker = _read_json(workdir / MARKER)
    if isinstance(marker, dict) and marker.get("format") == MARKER_FORMAT:
      return "run"
    raise RunFolderError(
        f"--workdir {workdir}: its {MARKER} is not a pisa-train run marker (format "
        f"{MARKER_FORMAT!r}), so nothing in it was touched; give a new or empty folder")
  meta = _read_json(workdir / "meta.json")
  if isinstance(meta, dict) and meta.get("format") == CORPUS_FORMAT:
    raise RunFolderError(
        f"--workdir {workdir} is a prepared corpus (meta.json of format {CORPUS_FORMAT!r}), not a "
        f"run folder, so nothing in it was touched: train on it with --set data.path={workdir} and "
        f"give a new --workdir")
  if _is_unmarked_run(workdir):
    return "unmarked run"
  raise RunFolderError(
      f"--workdir {workdir} holds {_shown(names)} but no {MARKER}: it is not a pisa-train run "
      f"folder, so nothing in it was touched; give a new or empty folder")


def mark(workdir: Path, say=None) -> None:
  """Writes the marker that makes `workdir` a run folder (atomically); `say`, if given, is told."""
  tmp = workdir / (MARKER + ".tmp")
  tmp.write_text(json.dumps({"format": MARKER_FORMAT, "marked": _now()}) + "\n")
  os.replace(tmp, workdir / MARKER)
  if say is not None:
    say(f"marked {workdir} as a run folder ({MARKER}): it holds a run's config.json and sealed "
        f"checkpoints")


@dataclasses.dataclass
class RunLock:
  """The lock of a run folder, held until `release` (or until the process ends, however it ends).

  created: this call made the lock file. notice: a line about a lock left by a process that ended
  without releasing it (killed), which this one took over; None otherwise.
  """

  path: Path
  fd: int
  created: bool
  notice: str | None = None

  def release(self, *, remove: bool = False) -> None:
    """Clears the holder's record (or removes the file: `remove`) and drops the lock."""
    if self.fd < 0:
      return
    try:
      if remove:
        # Removed while still held: a process that opened the old file re-checks it (`lock`).
        self.path.unlink(missing_ok=True)
      else:
        os.ftruncate(self.fd, 0)
    finally:
      os.close(self.fd)
      self.fd = -1


def _holder(fd: int) -> dict | None:
  try:
    record = json.loads(os.pread(fd, 1 << 16, 0).decode())
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) and "pid" in record else None


def _who(record: dict) -> str:
  host = record.get("host")
  where = f" on {host}" if host and host != socket.gethostname() else ""
  return f"process {record['pid']}{where} (started at {record.get('started', '?')})"


def _flock_or_refuse(fd: int, workdir: Path) -> None:
  """Locks `fd` exclusively, or raises RunFolderInUseError naming the process that holds it."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
      raise
    record = _holder(fd)
    who = _who(record) if record else "another process"
    raise RunFolderInUseError(
        f"{workdir} is in use by {who}: wait for that run to end (or stop it), or give "
        f"another --workdir") from None


def check_not_in_use(workdir: Path) -> None:
  """Raises RunFolderInUseError when a process holds `workdir`'s lock; writes nothing (the lock is
  taken and dropped at once), so a command can refuse a held folder before its slow imports."""
  try:
    fd = os.open(workdir / LOCK, os.O_RDONLY)
  except FileNotFoundError:
    return
  try:
    _flock_or_refuse(fd, workdir)
  finally:
    os.close(fd)


def lock(workdir: Path, command: list[str]) -> RunLock:
  """Takes the exclusive lock of `workdir` (creating the folder), or raises RunFolderInUseError.

  An `flock` on `workdir/pisa-run.lock`: the kernel drops it when its process ends, kill -9
  included, so a lock is never left held by a process that is gone. The holder writes its pid,
  host, start time and command into the file and clears them on release; a file still naming a
  holder when its lock is free was left by a process that ended without releasing it, and is taken
  over with a `notice`. Nothing is written when the lock is refused.
  """
  path = workdir / LOCK
  while True:
    workdir.mkdir(parents=True, exist_ok=True)
    try:
      fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
      try:
        fd, created = os.open(path, os.O_RDWR), False
      except FileNotFoundError:  # removed in between by a set-up that failed
        continue
    try:
      _flock_or_refuse(fd, workdir)
    except BaseException:
      os.close(fd)
      raise
    try:
      same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
      same = False
    if not same:  # the file was removed while this process waited to lock it
      os.close(fd)
      continue
    left = _holder(fd)
    notice = None if left is None else (
        f"{workdir}: took over the lock left by {_who(left)}, which ended without releasing it")
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
              "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return RunLock(path=path, fd=fd, created=created, notice=notice)


def config_changes(saved: dict, config) -> dict[str, tuple]:
  """The fields of `config` (a Config) that differ from `saved` (a checkpoint's config dict), as
  {"section.field": (old, new)} in the config's order.

  `saved` is read through `type(config).from_dict` where it can be, so a field added since it was
  written counts at its default, not as a change.
  """
  try:
    saved = type(config).from_dict(saved).to_dict()
  except (TypeError, ValueError):
    pass
  old, new = (json.loads(json.dumps(d)) for d in (saved, config.to_dict()))
  flat_old = {f"{s}.{k}": v for s, fields in old.items() if isinstance(fields, dict)
              for k, v in fields.items()}
  flat_new = {f"{s}.{k}": v for s, fields in new.items() for k, v in fields.items()}
  names = list(flat_new) + [k for k in flat_old if k not in flat_new]
  return {k: (flat_old.get(k), flat_new.get(k)) for k in names
          if flat_old.get(k) != flat_new.get(k)}


def describe_changes(changes: dict[str, tuple]) -> str:
  """One line per changed field: `  train.peak_lr: 0.003 -> 0.001`."""
  return "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def append_history(workdir: Path, *, step: int, changes: dict[str, tuple],
                   command: list[str]) -> None:
  """Appends one row to `config_history.jsonl`: when, at which step, by which command, what."""
  row = {"time": _now(), "step": step, "command": command,
         "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()}}
  with open(workdir / HISTORY, "a") as f:
    f.write(json.dumps(row) + "\n")


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


class InterruptedBeforeStart(KeyboardInterrupt):
  """Ctrl-C while the run was being set up: nothing was written to the run folder."""


# The signals that stop a run with a checkpoint, and their names in the console.
STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


class StopRequest:
  """The first Ctrl-C (SIGINT) or SIGTERM asks the loop to checkpoint and stop; a second one of
  either exits at once, with status 128 + its number.

  `signal` is the first signal received (a `signal.Signals`), None until one arrives.
  """

  def __init__(self):
    self.signal: signal.Signals | None = None
    self._previous = {}

  @property
  def requested(self) -> bool:
    return self.signal is not None

  def __enter__(self):
    for signum in STOP_SIGNALS:
      try:
        self._previous[signum] = signal.signal(signum, self._handle)
      except ValueError:  # not the main thread: the signals stay with whoever owns them
        break
    return self

  def _handle(self, signum, frame):
    name = STOP_SIGNALS[signum]
    if self.requested:
      # Exits without unwinding: an exception here would carry Orbax's and XLA's running threads
      # into interpreter shutdown, which aborts. An unfinished save is only a temporary folder.
      os.write(2, f"\nsecond {name}: stopped without saving; run the same command again to resume "
                  f"from the last complete checkpoint\n".encode())
      os._exit(128 + signum)
    self.signal = signal.Signals(signum)
    tqdm.write(f"{name}: finishing this step, saving a checkpoint and exiting (again to abort)")

  def __exit__(self, *exc):
    for signum, previous in self._previous.items():
      if previous is not None:  # None: a handler that was not set from Python
        signal.signal(signum, previous)
