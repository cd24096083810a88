"""What produced a result: the commit, the jax and jaxlib versions, the device and the date.

Benchmarks and `pisa-eval` record these in every JSON they write.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import jax
import jaxlib


def git_commit() -> str:
  """HEAD of the checkout holding this file, "-dirty" when tracked files differ from it;
  $PISA_COMMIT when set (a copy of the tree whose .git is not its own)."""
  if os.environ.get("PISA_COMMIT"):
    return os.environ["PISA_COMMIT"]
  repo = Path(__file__).resolve().parent

  def git(*args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30)

  try:
    head = git("rev-parse", "HEAD")
    if head.returncode:
      return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return "unknown (git not available)"
  return head.stdout.strip() + ("-dirty" if dirty else "")


def environment() -> dict:
  """Commit, jax / jaxlib versions, device kind and count, and the UTC date of this run."""
  devices = jax.devices()
  return {"commit": git_commit(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "device": f"{len(devices)} x {devices[0].device_kind}",
          "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
