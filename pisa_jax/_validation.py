"""Argument checks shared by the public functions.

Every check raises ValueError (bad value or shape) or TypeError (bad dtype) with a message that
names the argument and the value expected. Shapes are static under `jit`, so all shape checks also
run on tracers; checks of index *values* raise when the indices are concrete. Under `jit` they
are traced only inside `traced_checks(True)`, and then report through `checkify.checkify`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

# The checks that need no array live in `_checks` (importable without jax); they are part of
# this module's interface too.
from pisa_jax._checks import (  # noqa: F401
    HIERARCHICAL_SELECTORS,
    NUM_FORCED,
    SELECTORS,
    _is_int,
    check_beam,
    check_block_size,
    check_branching,
    check_implementation,
    check_scale,
    check_selector,
    check_top_k,
    resolve_beam,
)
from pisa_jax.spec import SelectionSpec

# Whether value checks on traced arrays are part of the traced computation. A `debug_check`
# puts a checkify error effect in the jaxpr even when nothing discharges it, and an effectful
# jitted function leaves jax's C++ dispatch path: every call of a jitted decode step then pays
# milliseconds of Python on the host, more than the step itself. So the checks are opt-in:
#     with pisa_jax.traced_checks(True):
#       err, out = checkify.checkify(jax.jit(f))(*args)
#     err.throw()
# The value is part of jit's cache key: a function traced without the checks is traced again
# inside the context.
_TRACED_CHECKS = jax.make_user_context(False)


def traced_checks(enabled: bool):
  """A context manager: inside `traced_checks(True)`, value checks on traced arrays (block
  indices, segment ids, a decode step past its cache's capacity) are traced as checkify checks,
  reported by `jax.experimental.checkify.checkify`; `traced_checks(False)` turns them off again.
  Off by default (a traced check is an effect, which takes a jitted function off jax's C++
  dispatch)."""
  if not isinstance(enabled, bool):
    raise TypeError(f"traced_checks({enabled=}) takes True or False")
  return _TRACED_CHECKS(enabled)


def debug_check(pred, message: str, *fmt_args) -> None:
  """`checkify.debug_check` inside `traced_checks(True)`; nothing otherwise."""
  if _TRACED_CHECKS.value:
    checkify.debug_check(pred, message, *fmt_args)


def check_float(name: str, x) -> None:
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
    dtype = getattr(x, "dtype", type(x).__name__)
    raise TypeError(f"{name} must be a floating-point array (bfloat16, float16 or float32), got {dtype}")


def check_rank4(name: str, x, layout: str) -> None:
  if x.ndim != 4:
    raise ValueError(f"{name} must have rank 4 with layout {layout}, got shape {tuple(x.shape)}")


def check_qk(q, k) -> tuple[int, int, int, int, int]:
  """Checks q [B, T, HQ, D] against k [B, T, HKV, D]; returns (B, T, HQ, HKV, D)."""
  check_float("q", q)
  check_float("k", k)
  check_rank4("q", q, "[B, T, HQ, D]")
  check_rank4("k", k, "[B, T, HKV, D]")
  b, t, hq, d = q.shape
  bk, tk, hkv, dk = k.shape
  if bk != b:
    raise ValueError(f"k batch {bk} must equal q batch {b} (q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})")
  if tk != t:
    raise ValueError(
        f"k length {tk} must equal q length {t}: only causal self-attention is supported "
        f"(q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})")
  if dk != d:
    raise ValueError(f"k head dim {dk} must equal q head dim {d}")
  if k.dtype != q.dtype:
    raise TypeError(f"q and k must have the same dtype, got q {q.dtype} and k {k.dtype}")
  if t < 1:
    raise ValueError(f"sequence length T={t} must be >= 1")
  if hkv < 1 or hq % hkv != 0:
    raise ValueError(f"query heads HQ={hq} must be a positive multiple of key/value heads HKV={hkv}")
  return b, t, hq, hkv, d


def check_v(v, k) -> None:
  check_float("v", v)
  check_rank4("v", v, "[B, T, HKV, D]")
  if v.shape != k.shape:
    raise ValueError(f"v.shape={tuple(v.shape)} must equal k.shape={tuple(k.shape)}")
  if v.dtype != k.dtype:
    raise TypeError(f"k and v must have the same dtype, got k {k.dtype} and v {v.dtype}")


def check_static(function: str, **options) -> None:
  """Options that fix shapes or code (sizes, names, the scale) must be Python values, never
  tracers: a traced one means `function` went through `jax.jit` with it as an argument."""
  for name, value in options.items():
    if isinstance(value, jax.core.Tracer):
      raise TypeError(
          f"{name} is traced: {function} was called under jax.jit with {name} as an argument, "
          f"but it fixes shapes or compiled code and must be a Python value. Mark it static, "
          f"jax.jit({function}, static_argnames={tuple(options)}), or bind it before jitting, "
          f"functools.partial({function}, {name}=...)")


def resolve_spec(function: str, spec, head_dim: int, **options) -> SelectionSpec:
  """The checked, resolved `SelectionSpec` of a public call from `spec=` and its keyword options
  (None: not given): a traced option raises (`check_static`), one that disagrees with the spec
  raises naming both (`SelectionSpec.merge`)."""
  check_static(function, **options)
  return SelectionSpec.merge(spec, **options).resolved(head_dim)


def resolve_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, jax.core.Tracer):
    raise TypeError("scale must be a Python float (it is a compile-time constant), got a traced value")
  check_scale(scale)
  return float(scale)


def check_block_indices(block_indices, *, batch: int, seq_len: int, num_kv_heads: int,
                        block_size: int) -> None:
  """block_indices: int32 [B, T, HKV, K] with entries in [-1, ceil(T / block_size))."""
  if not hasattr(block_indices, "dtype") or not jnp.issubdtype(block_indices.dtype, jnp.integer):
    dtype = getattr(block_indices, "dtype", type(block_indices).__name__)
    raise TypeError(f"block_indices must be an integer array (int32), got {dtype}")
  expected = (batch, seq_len, num_kv_heads)
  if block_indices.ndim != 4 or tuple(block_indices.shape[:3]) != expected or block_indices.shape[3] < 1:
    raise ValueError(
        f"block_indices.shape={tuple(block_indices.shape)} must be [B, T, HKV, K] = "
        f"[{batch}, {seq_len}, {num_kv_heads}, K] with K >= 1")
  num_blocks = -(-seq_len // block_size)
  if isinstance(block_indices, jax.core.Tracer):
    # Under jit the values are unknown here: inside `traced_checks(True)` these report through
    # `jax.experimental.checkify.checkify`.
    debug_check(
        jnp.all((block_indices >= -1) & (block_indices < num_blocks)),
        f"block_indices must lie in [-1, {num_blocks}) for T={seq_len} and {block_size=}: found "
        "values in [{}, {}]", jnp.min(block_indices), jnp.max(block_indices))
    srt = jnp.sort(block_indices, axis=-1)
    debug_check(
        ~jnp.any((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)),
        "block_indices must not repeat a block index within one [b, t, h] row (-1 may repeat)")
    return
  idx = np.asarray(block_indices)
  if idx.size and (idx.min() < -1 or idx.max() >= num_blocks):
    raise ValueError(
        f"block_indices must lie in [-1, {num_blocks}) for T={seq_len} and {block_size=}: "
        f"found values in [{idx.min()}, {idx.max()}]")
  # The attended set is a set of blocks (Eq. 6 sums over their union): a repeat is a caller's
  # mistake, reported where it can be. Under jit it cannot: `drop_repeated_blocks` applies the rule.
  srt = np.sort(idx, axis=-1)
  if np.any((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)):
    raise ValueError("block_indices must not repeat a block index within one [b, t, h] row (-1 may repeat)")


def drop_repeated_blocks(block_indices):
  """block_indices `[..., K]` as int32, each entry equal to an earlier entry of its row set to -1.

  The rule for unchecked traced indices: the selection is a set of blocks (Eq. 6 attends their
  union), so a repeated block counts once, as out-of-range entries count as -1. A `[..., K, K]`
  compare that XLA fuses into one pass over the indices.
  """
  idx = block_indices.astype(jnp.int32)
  top_k = idx.shape[-1]
  earlier = np.tril(np.ones((top_k, top_k), bool), -1)  # [j, i]: entry i comes before entry j
  repeated = jnp.any((idx[..., :, None] == idx[..., None, :]) & earlier, axis=-1)
  return jnp.where(repeated, -1, idx)


def check_packed_summary_dtype(spec: SelectionSpec) -> None:
  """Packed documents' pyramids (`segment_ids`) are float32 only."""
  if spec.summary_dtype != "float32":
    raise ValueError(f"summary_dtype={spec.summary_dtype!r} is not supported with segment_ids: "
                     "packed documents' pyramids are float32 (summary_dtype='float32')")


def check_segment_ids(segment_ids, *, batch: int, seq_len: int) -> None:
  """segment_ids: None, or int32 [B, T], non-decreasing within each row (a document is a run of
  equal ids). The order is checked eagerly on concrete ids; traced ones (under `jit`) report
  through `jax.experimental.checkify.checkify` inside `traced_checks(True)`."""
  if segment_ids is None:
    return
  dtype = getattr(segment_ids, "dtype", type(segment_ids).__name__)
  if not hasattr(segment_ids, "dtype") or segment_ids.dtype != jnp.int32:
    raise TypeError(f"segment_ids must be an int32 array [B, T], got {dtype}")
  if segment_ids.ndim != 2 or tuple(segment_ids.shape) != (batch, seq_len):
    raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)} must be [B, T] = "
                     f"[{batch}, {seq_len}]")
  message = ("segment_ids must be non-decreasing within each row (a document is a run of equal "
             "ids)")
  if isinstance(segment_ids, jax.core.Tracer):
    debug_check(jnp.all(segment_ids[:, 1:] >= segment_ids[:, :-1]), message + ": a row decreases")
    return
  ids = np.asarray(segment_ids)
  bad = np.argwhere(ids[:, 1:] < ids[:, :-1])
  if bad.size:
    b, t = (int(x) for x in bad[0])
    raise ValueError(f"{message}: row {b} goes from {ids[b, t]} at t={t} to {ids[b, t + 1]} "
                     f"at t={t + 1}")
