"""What `pisa-eval` checks before it imports jax: the argument error, the arrays of --npz and the
selection options. A mistake in any of them is reported at once.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from pisa_jax import _checks

NPZ_LAYOUT = "q [L, B, T, HQ, D] and k [L, B, T, HKV, D]"
# The first bytes of a zip archive (what np.savez writes) and of a single .npy array.
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_NPY_MAGIC = b"\x93NUMPY"


class EvalArgumentError(ValueError):
  """A bad argument or input; the message starts with its name (`--lengths: ...`)."""


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
  """q `[L, B, T, HQ, D]` and k `[L, B, T, HKV, D]` of an .npz, checked; errors name the array."""
  path = Path(path)
  expected = f"expected an .npz archive (np.savez) of {NPZ_LAYOUT}"
  try:
    with open(path, "rb") as f:
      head = f.read(len(_NPY_MAGIC))
  except IsADirectoryError:
    raise EvalArgumentError(f"--npz: {path} is a folder; {expected}") from None
  except FileNotFoundError:
    raise EvalArgumentError(f"--npz: {path} does not exist; {expected}") from None
  except OSError as e:
    raise EvalArgumentError(f"--npz: {path} is not readable ({e.strerror}); {expected}") from None
  if head.startswith(_NPY_MAGIC):
    raise EvalArgumentError(f"--npz: {path} holds one array (.npy, np.save); {expected}")
  if not head.startswith(_ZIP_MAGIC):
    raise EvalArgumentError(f"--npz: {path} is not an .npz file (it is not a zip archive); "
                            f"{expected}")
  try:
    archive = np.load(path, allow_pickle=False)
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    reason = (str(e).splitlines() or [type(e).__name__])[0]
    raise EvalArgumentError(f"--npz: {path} is a damaged .npz file ({reason}); {expected}"
                            ) from None
  with archive:
    for name in ("q", "k"):
      if name not in archive.files:
        raise EvalArgumentError(f"--npz: {path} has no array {name!r} (it holds "
                                f"{sorted(archive.files)}); expected {NPZ_LAYOUT}")
    try:
      q, k = archive["q"], archive["k"]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
      reason = (str(e).splitlines() or [type(e).__name__])[0]
      raise EvalArgumentError(f"--npz: {path} is a damaged .npz file ({reason}); {expected}"
                              ) from None
  for name, a, heads in (("q", q, "HQ"), ("k", k, "HKV")):
    if a.ndim != 5:
      raise EvalArgumentError(f"--npz: {name} has shape {a.shape}, rank {a.ndim}; expected "
                              f"rank 5 [L, B, T, {heads}, D]")
    if not np.issubdtype(a.dtype, np.floating):
      raise EvalArgumentError(f"--npz: {name} has dtype {a.dtype}; expected float16, float32 or "
                              f"float64")
    if 0 in a.shape:
      raise EvalArgumentError(f"--npz: {name} has shape {a.shape}: every axis needs >= 1")
  if q.shape[:3] != k.shape[:3] or q.shape[4] != k.shape[4]:
    raise EvalArgumentError(f"--npz: k has shape {k.shape} and q {q.shape}: k must share q's L, "
                            f"B, T and D ({NPZ_LAYOUT})")
  if q.shape[3] % k.shape[3]:
    raise EvalArgumentError(f"--npz: q has {q.shape[3]} heads, not a multiple of k's "
                            f"{k.shape[3]} (HQ must be a multiple of HKV)")
  return q, k


def check_selection_options(*, block_size: int | None, top_ks: list[int],
                            beam_factors: list[float], lengths: list[int] | None) -> None:
  """The selection options, by the library's own rules, named as the command line names them
  (None: not known yet)."""
  try:
    if block_size is not None:
      _checks.check_block_size(block_size, name="--block-size")
    for top_k in top_ks:
      _checks.check_top_k(top_k, name="--top-k")
  except ValueError as e:
    raise EvalArgumentError(str(e)) from None
  for f in beam_factors:
    if not f >= 1:
      raise EvalArgumentError(f"--beam-factors: {f} must be >= 1 (beam = factor x K, at least K)")
  if block_size is not None and lengths and block_size > lengths[0]:
    raise EvalArgumentError(f"--block-size: {block_size} exceeds the shortest of --lengths "
                            f"({lengths[0]})")
