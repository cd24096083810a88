"""Helpers every kernel family shares."""

from __future__ import annotations

import contextlib
import warnings


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (Pallas Triton values need power-of-two shapes)."""
  return 1 << max(0, int(n) - 1).bit_length()


@contextlib.contextmanager
def triton_deprecation_silenced():
  """JAX 0.11 deprecates the Pallas Triton backend in favour of Mosaic GPU. It still works, and
  every kernel stays behind the `implementation=` switch, so that one warning is silenced where a
  kernel is called."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*deprecated.*Mosaic GPU.*")
    yield
