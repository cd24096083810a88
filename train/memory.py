"""The compiled train step's memory against the device's, and the peak rates for MFU.

`check_memory` runs before the first step: a step that cannot fit stops with what it needs, what
the device has and which settings lower it, instead of failing inside the loop.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
  from pisa_jax.train.trainer import Trainer

# Dense bf16 peak FLOP/s per device, for MFU; looked up by substring of `device.device_kind`.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "B200": 2250e12}

def _memory_summary(compiled) -> dict:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
  return {f: int(getattr(analysis, f)) for f in fields if hasattr(analysis, f)}


def peak_flops(device) -> float | None:
  for name, flops in PEAK_FLOPS.items():
    if name in device.device_kind:
      return flops
  return None


def _fmt_bytes(n: float) -> str:
  if n >= 2**30:
    return f"{n / 2**30:.2f} GiB"
  return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def step_memory(memory: dict) -> int | None:
  """Bytes one device holds while the train step runs, from XLA's memory analysis.

  Arguments + outputs + temporaries, with the outputs that reuse the donated arguments' buffers
  (the updated state) counted once.
  """
  if not memory:
    return None
  return (memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
          - memory.get("alias_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0))


def _host_available_bytes() -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def device_memory(device) -> tuple[int, str] | None:
  """(bytes one device can hold, what that figure is), or None where the backend does not say."""
  try:
    stats = device.memory_stats() or {}
  except Exception:  # some backends raise instead of returning None
    stats = {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"one {device.device_kind}"
  if device.platform == "cpu":
    available = _host_available_bytes()
    if available:
      n = len(jax.local_devices())
      # The host's CPU devices share its memory.
      return available // n, "the host's available memory" + (f" / {n} devices" if n > 1 else "")
  return None


class InsufficientMemoryError(RuntimeError):
  """The compiled train step needs more memory than a device has."""


def check_memory(trainer: Trainer) -> str:
  """Raises InsufficientMemoryError when the step cannot fit; else returns the memory report line."""
  cfg, t, mem = trainer.config, trainer.config.train, trainer.memory
  need = step_memory(mem)
  if need is None:
    return "train step memory: XLA gives no memory analysis on this backend"
  have = device_memory(trainer.mesh.devices.flat[0])
  temp, args = mem.get("temp_size_in_bytes", 0), mem.get("argument_size_in_bytes", 0)
  if have is not None and need > have[0]:
    # What keeps less for the backward at the same batch and length, where not set already.
    keep_less = []
    if cfg.model.remat != "full":
      keep_less.append(f"model.remat=full (now {cfg.model.remat})")
    chunk = math.gcd(t.seq_len, 8192)
    if not t.loss_chunk and 256 <= chunk < t.seq_len:
      keep_less.append(f"train.loss_chunk={chunk} (now {t.loss_chunk})")
    raise InsufficientMemoryError(
        f"the compiled train step needs {_fmt_bytes(need)} per device (temporaries "
        f"{_fmt_bytes(temp)}, state and batch {_fmt_bytes(args)}) but {have[1]} has "
        f"{_fmt_bytes(have[0])}: lower train.per_device_batch={t.per_device_batch} (raise "
        f"train.grad_accum={t.grad_accum} to keep the tokens per step), train.seq_len={t.seq_len}, "
        f"or the model size (model.num_layers={cfg.model.num_layers}, "
        f"model.d_model={cfg.model.d_model}, model.mlp_dim={cfg.model.mlp_dim})"
        + (f"; or keep less for the backward: {', '.join(keep_less)}" if keep_less else "")
    )
  per_token = temp / _tokens_per_device(t)
  return (f"train step memory per device: peak {_fmt_bytes(need)}"
          f"{f' of {_fmt_bytes(have[0])} ({have[1]})' if have else ''}; temporaries "
          f"{_fmt_bytes(temp)} ({_fmt_bytes(per_token)} per token of a micro-batch); state and "
          f"batch {_fmt_bytes(args)}")


def memory_record(trainer: Trainer) -> dict:
  """The compiled train step's memory per device as `memory.json` records it, in bytes.

  XLA's analysis fields (`*_size_in_bytes`), `peak_bytes` (`step_memory`), the temporaries per
  token of a micro-batch, the device's capacity where the backend gives it, and the settings that
  decide the temporaries at long context (remat policy, loss chunk, tokens).
  """
  cfg, t, mem = trainer.config, trainer.config.train, trainer.memory
  have = device_memory(trainer.mesh.devices.flat[0])
  temp = mem.get("temp_size_in_bytes")
  return {**mem, "peak_bytes": step_memory(mem),
          "temp_bytes_per_token": None if temp is None else temp / _tokens_per_device(t),
          "device_bytes": have[0] if have else None, "device": have[1] if have else None,
          "remat": cfg.model.remat, "loss_chunk": t.loss_chunk, "seq_len": t.seq_len,
          "per_device_batch": t.per_device_batch, "context_parallel": t.context_parallel}


def _tokens_per_device(t) -> int:
  """A micro-batch's tokens on one device: a sequence is split over train.context_parallel."""
  return t.per_device_batch * t.seq_len // t.context_parallel
