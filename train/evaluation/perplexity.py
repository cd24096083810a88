"""Held-out loss and perplexity at each evaluation length, and the loss by position.

A model that uses long context predicts later tokens of a window better than early ones: the loss
by log-spaced position bucket (`common.position_buckets`) shows how far into the window it keeps
falling, and at lengths past the training context whether it stays down or breaks.
"""

from __future__ import annotations

import time

import numpy as np

from pisa_jax.train.evaluation import common


def run_perplexity(model, config, *, lengths: list[int], samples: int, seed: int,
                   data: str | None, batch_size: int, progress: bool) -> dict:
  """Per-token loss (nats) and perplexity on `samples` held-out windows of each length.

  Returns the `ppl` part of eval.json:
    rows: one per length: windows, tokens (counted targets: all of them for text, the answers
      for MQAR), loss = the mean NLL over counted tokens, ppl = exp(loss), buckets: [{start,
      end, tokens, loss}] by target position (loss None where nothing counts), and the source of
      the windows (`common.held_out`).
  """
  start = time.perf_counter()
  rows = []
  bar = common.progress_bar(samples * len(lengths), "ppl", progress)
  for length in lengths:
    bar.set_description(f"ppl {length}")
    windows = common.held_out(config, length=length, samples=samples, seed=seed, data=data)
    nll, _ = common.token_scores(model, windows["inputs"], windows["targets"],
                                 batch_size=batch_size, bar=bar,
                                 segment_ids=windows.get("segment_ids"),
                                 positions=windows.get("positions"))
    weights = windows["weights"]
    # float64 sums: a length x windows can be millions of token losses.
    total, count = float((nll * weights).sum(dtype=np.float64)), float(weights.sum())
    buckets = []
    for lo, hi in common.position_buckets(length):
      w = weights[:, lo:hi]
      buckets.append({"start": lo, "end": hi, "tokens": int(w.sum()),
                      "loss": common.mean_or_none(float((nll[:, lo:hi] * w).sum(dtype=np.float64)),
                                                  float(w.sum()))})
    loss = common.mean_or_none(total, count)
    rows.append({"length": length, "windows": samples, "tokens": int(count), "loss": loss,
                 "ppl": None if loss is None else float(np.exp(loss)), "buckets": buckets,
                 "data": windows["source"]})
  bar.close()
  return {"samples": samples, "rows": rows, "wall_seconds": time.perf_counter() - start}
