"""Helpers every kernel family shares."""

from __future__ import annotations

import contextlib
import warnings

import jax.numpy as jnp
from jax import lax
import numpy as np

INT32_MAX = 2**31 - 1


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (Pallas Triton values need power-of-two shapes)."""
  return 1 << max(0, int(n) - 1).bit_length()


def int32_table(rows, name: str):
  """A small table built on the host from Python ints (level sizes, offsets, powers) as an int32
  jnp array; raises ValueError naming it where an entry does not fit int32, instead of numpy's
  OverflowError or a silent wrap."""
  table = np.asarray(rows, np.int64)
  if table.size and (table.max() > INT32_MAX or table.min() < -INT32_MAX - 1):
    raise ValueError(f"{name} holds {int(table.max())}, past int32 (max {INT32_MAX})")
  return jnp.asarray(table.astype(np.int32))


@contextlib.contextmanager
def triton_deprecation_silenced():
  """JAX 0.11 deprecates the Pallas Triton backend in favour of Mosaic GPU. It still works, and
  every kernel stays behind the `implementation=` switch, so that one warning is silenced where a
  kernel is called."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
    warnings.filterwarnings("ignore", message=".*deprecated.*Mosaic GPU.*")
    yield


def call_kernel(fn, *args):
  """Calls a Pallas kernel with the Triton deprecation warning silenced."""
  with triton_deprecation_silenced():
    return fn(*args)


def dot_precision(dtype):
  """float32 inputs get IEEE float32 dots (not TF32), so the f32 path meets the 1e-4 tolerance."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None
