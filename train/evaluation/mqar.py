"""Multi-query associative recall (Zoology) accuracy against the number of key-value pairs and the
sequence length.

Accuracy is Zoology's: the share of answer positions (each queried key, `train.data.mqar_examples`
weight 1) where the model's argmax is the key's value. The examples follow the run's MQAR settings
(`data.mqar_power_a`, `data.mqar_random_filler`; Zoology's defaults for a text run) with their own
random stream per (pairs, length) cell, so a cell does not change when the grid around it does.
"""

from __future__ import annotations

import time

import numpy as np

from pisa_jax.train.data import VAL, mqar_examples
from pisa_jax.train.evaluation import common

DEFAULT_PAIRS = (4, 8, 16, 32, 64, 128, 256)


def default_pairs(config, lengths: list[int]) -> list[int]:
  """Powers of two from 4, with the run's own data.mqar_num_pairs for an MQAR run, that fit the
  longest length (4 x pairs tokens) and the vocabulary (distinct keys from [1, V/2))."""
  pairs = set(DEFAULT_PAIRS)
  if config.data.source == "mqar":
    pairs.add(config.data.mqar_num_pairs)
  return sorted(p for p in pairs if 4 * p <= lengths[-1] and fits_vocab(p, config))


def fits_vocab(pairs: int, config) -> bool:
  return pairs < config.model.vocab_size // 2


def check_pairs(pairs: list[int], config, lengths: list[int]) -> None:
  if not pairs:
    raise common.EvalArgumentError(
        f"--mqar-pairs: no number of pairs fits --lengths (the longest, {lengths[-1]}, holds "
        f"{lengths[-1] // 4} pairs: 4 tokens each) and the vocabulary of "
        f"{config.model.vocab_size}: give --mqar-pairs")
  for p in pairs:
    if not fits_vocab(p, config):
      half = config.model.vocab_size // 2
      raise common.EvalArgumentError(
          f"--mqar-pairs: {p} pairs need {p} distinct keys in [1, V/2) = [1, {half}): "
          f"model.vocab_size={config.model.vocab_size} holds {half - 1}")


def seed_sequence(seed: int, pairs: int, length: int) -> list[int]:
  """The random stream of one cell: `np.random.default_rng(seed_sequence(...))`."""
  return [seed, VAL, pairs, length]


def run_mqar(model, config, *, lengths: list[int], pairs: list[int], samples: int, seed: int,
             batch_size: int, progress: bool) -> dict:
  """Accuracy of each (pairs, length) cell over `samples` examples.

  A cell whose length cannot hold its pairs (fewer than 4 x pairs tokens) is listed under
  `skipped` with that reason: a grid over pairs and lengths has such corners.
  """
  start = time.perf_counter()
  d = config.data
  power_a = d.mqar_power_a
  filler = d.mqar_random_filler
  rows, skipped = [], []
  cells = [(p, n) for n in lengths for p in pairs]
  bar = common.progress_bar(samples * len(cells), "mqar", progress)
  for p, n in cells:
    if 4 * p > n:
      skipped.append({"pairs": p, "length": n, "reason": f"{p} pairs need >= {4 * p} tokens"})
      bar.update(samples)
      continue
    bar.set_description(f"mqar {p} pairs {n}")
    sequence = seed_sequence(seed, p, n)
    ex = mqar_examples(np.random.default_rng(sequence), samples, seq_len=n,
                       vocab_size=config.model.vocab_size, num_pairs=p, power_a=power_a,
                       random_filler=filler)
    _, hit = common.token_scores(model, ex["inputs"], ex["targets"], batch_size=batch_size,
                                 bar=bar)
    answers = ex["weights"] > 0
    correct = int((hit & answers).sum())
    rows.append({"pairs": p, "length": n, "answers": int(answers.sum()), "correct": correct,
                 "accuracy": correct / int(answers.sum()), "seed_sequence": sequence})
  bar.close()
  return {"samples": samples, "power_a": power_a, "random_filler": filler,
          "trained_pairs": d.mqar_num_pairs if d.source == "mqar" else None,
          "rows": rows, "skipped": skipped, "wall_seconds": time.perf_counter() - start}
