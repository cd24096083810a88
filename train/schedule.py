"""Learning-rate schedules: the paper's warm-up / plateau / square-root decay, and the CPT cosine.

Step s counts from 0; the learning rate of step s is the one its update uses.
- wsd_sqrt (Table 5): linear warm-up over W steps to the peak, plateau, then over the last D steps
  lr = peak * (1 - (1 - r) * sqrt(p)), p from 1/D to 1, ending exactly at r * peak (r = 0.1).
- cosine (CPT): linear warm-up over W steps, then r*peak + (1-r)*peak*(1 + cos(pi*p))/2 down to
  r * peak at the last step (3e-5 -> 3e-6).
- constant: linear warm-up, then the peak.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from pisa_jax.configs.base import TrainConfig, warmup_steps


def make_schedule(t: TrainConfig) -> Callable:
  """lr(step) for `t.lr_schedule`, traceable under jit (step is an int32 scalar)."""
  peak, r, total = t.peak_lr, t.final_lr_ratio, t.steps
  warm = warmup_steps(t)

  def warmup(s):
    # (s + 1) / W: the first update already moves; step W - 1 reaches the peak.
    return peak * jnp.minimum(1.0, (s + 1.0) / max(warm, 1))

  if t.lr_schedule == "constant":
    return lambda step: warmup(jnp.asarray(step, jnp.float32))

  if t.lr_schedule == "wsd_sqrt":
    decay_start = total - t.decay_steps

    def schedule(step):
      s = jnp.asarray(step, jnp.float32)
      p = jnp.clip((s - decay_start + 1.0) / max(t.decay_steps, 1), 0.0, 1.0)
      decayed = peak * (1.0 - (1.0 - r) * jnp.sqrt(p))
      return jnp.where(s < warm, warmup(s), jnp.where(s < decay_start, peak, decayed))

    return schedule

  if t.lr_schedule == "cosine":
    span = max(total - warm, 1)

    def schedule(step):
      s = jnp.asarray(step, jnp.float32)
      p = jnp.clip((s - warm + 1.0) / span, 0.0, 1.0)
      cosine = r * peak + (1.0 - r) * peak * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
      return jnp.where(s < warm, warmup(s), cosine)

    return schedule

  raise ValueError(f"train.lr_schedule={t.lr_schedule!r} is unknown")
