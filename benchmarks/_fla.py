"""fla (flash-linear-attention's `fla.ops.nsa`) as a peer: its NSA top-k and selected attention.

fla-core is a pure-Python package on PyPI (`pip install fla-core flash-linear-attention`; on a
machine without registry access, install their wheel files, see benchmarks/run_all.sh). It needs
torch with CUDA and triton. When it cannot be imported, the benchmarks skip its columns and say
why in the result's notes.
"""

from __future__ import annotations

import numpy as np


def missing() -> str | None:
  """None when fla's NSA kernels and a CUDA device are usable, else the reason they are not."""
  try:
    import torch
    from fla.ops.nsa.parallel import ParallelNSAFunction, parallel_nsa_topk  # noqa: F401
  except Exception as e:  # ImportError, or a broken torch / triton install
    return f"fla not importable ({type(e).__name__}: {str(e)[:200]}): its columns are skipped"
  if not torch.cuda.is_available():
    return "fla needs a CUDA device, torch sees none: its columns are skipped"
  return None


def versions() -> dict[str, str | None]:
  """The installed versions of the peer's packages (None where one is missing), for a result's
  settings: fla's kernels change between releases."""
  from importlib import metadata

  out = {}
  for package in ("fla-core", "flash-linear-attention", "torch", "triton", "flash-attn"):
    try:
      out[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
      out[package] = None
  return out


def nsa_window_substitute(*, force: bool = False) -> str | None:
  """fla's `parallel_nsa` runs its window branch on flash-attn's `flash_attn_func`; where
  flash-attn is not installed (or with `force`: flash-attn takes only 16-bit inputs), hand that
  branch to fla's own `parallel_attn`, whose `window_size` w is the same window (keys
  i - w < j <= i, flash-attn's `window_size=(w - 1, 0)`) on fla's Triton kernel, which skips
  blocks outside it. Returns a note saying so, None when flash-attn is there and nothing was
  changed."""
  from fla.ops.attn.parallel import parallel_attn
  from fla.ops.nsa import parallel as nsa_parallel
  note = ("flash-attn is not installed: fla's NSA window branch runs on fla's own parallel_attn "
          "(window_size w, the same keys), everything else is fla's parallel_nsa")
  if getattr(nsa_parallel.flash_attn_func, "substitute", False):  # installed by an earlier call
    return note
  if nsa_parallel.flash_attn_func is not None and not force:
    return None

  def window_attention(q, k, v, causal, window_size):
    if not causal or window_size[1] != 0:
      raise ValueError(f"{causal=}, {window_size=}: only the causal window (w - 1, 0) is mapped")
    return parallel_attn(q, k, v, window_size=window_size[0] + 1)

  window_attention.substitute = True
  nsa_parallel.flash_attn_func = window_attention
  return note


def to_torch(x, dtype=None):
  """A jax or numpy array as a CUDA tensor (through host memory), in `dtype` if given."""
  import jax.numpy as jnp
  import torch
  if jnp.issubdtype(x.dtype, jnp.floating):  # bf16 has no numpy twin torch reads: via float32
    t = torch.from_numpy(np.array(x, np.float32)).cuda()
    return t.to(dtype or torch.bfloat16)
  return torch.from_numpy(np.array(x)).cuda()


def bsa_select(q, k, *, block_size: int, top_k: int, scale: float, cu_seqlens=None):
  """fla's BSA selection: mean-pooled key blocks, then `parallel_nsa_topk`; int32 [B, T, HKV, K'].

  K' is top_k rounded up to a power of two; unused slots hold -1. cu_seqlens: None, or the
  int64 document boundaries `[D + 1]` of packed rows (B = 1; fla's varlen mode)."""
  from fla.ops.nsa.parallel import parallel_nsa_topk
  from fla.ops.utils.pooling import mean_pooling
  if cu_seqlens is None:
    kc = mean_pooling(k, block_size)
    return parallel_nsa_topk(q=q, k=kc, lse=None, TK=k.shape[1], block_counts=top_k,
                             block_size=block_size, scale=scale)
  kc = mean_pooling(k, block_size, cu_seqlens=cu_seqlens)
  return parallel_nsa_topk(q=q, k=kc, lse=None, TK=k.shape[1], block_counts=top_k,
                           block_size=block_size, scale=scale, cu_seqlens=cu_seqlens)


def sparse_attention(q, k, v, block_indices, *, block_size: int, scale: float, cu_seqlens=None):
  """fla's selected-block attention (`ParallelNSAFunction`), differentiable in q, k and v;
  cu_seqlens as in `bsa_select` (block indices are then each document's own block numbers)."""
  from fla.ops.nsa.parallel import ParallelNSAFunction
  return ParallelNSAFunction.apply(q, k, v, block_indices, block_indices.shape[-1], block_size,
                                   scale, cu_seqlens)
