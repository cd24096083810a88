"""Copying a repeated random sequence: the induction test (Olsson et al., 2022).

A window of `length` tokens is h = length // 2 + 1 tokens drawn uniformly from the vocabulary
(end-of-text left out), then the same h tokens again, cut to length + 1 tokens. Nothing in the
first copy can be predicted (about ln V nats a token for a model that learnt the language, more
for one that did not). A token of the second copy is predicted by attending to the token after
the earlier occurrence of the current token, h positions back: the mechanism of induction heads,
and the one RULER's needles need once the key is found. A model that scores nothing here cannot
retrieve; one that does and still fails RULER does not match the key. For a sparse kind each
query of the second copy must select the block that holds its earlier occurrence, so this is also
a test of selection that needs no data.

Per length: first_loss, the mean NLL of the first copy's targets after its first token;
second_loss, that of the second copy's after its first token (each the repeat of a token seen
h positions earlier); score = first_loss - second_loss (nats); copy_accuracy, the share of the
second copy's targets that are the argmax.
"""

from __future__ import annotations

import time

import numpy as np

from pisa_jax.train.data import VAL
from pisa_jax.train.evaluation import common
from pisa_jax.train.tokenizer import EOT_TOKEN


def seed_sequence(seed: int, length: int) -> list[int]:
  """The random stream of one length: `np.random.default_rng(seed_sequence(...))`."""
  return [seed, VAL, length, 2]


MIN_LENGTH = 4


def check_lengths(lengths: list[int]) -> None:
  """One line naming --lengths when a length is too short for two copies with a scored token."""
  short = [n for n in lengths if n < MIN_LENGTH]
  if short:
    raise common.EvalArgumentError(
        f"--lengths: {short[0]} is too short for the induction suite: a window needs >= "
        f"{MIN_LENGTH} tokens (a scored token in each copy)")


def repeated_windows(rng: np.random.Generator, samples: int, length: int,
                     vocab_size: int) -> dict[str, np.ndarray]:
  """`samples` windows `[N, length]` of inputs and targets, and the boolean masks of the first
  and second copy's scored targets."""
  if length < MIN_LENGTH:
    raise ValueError(f"{length=} must be >= {MIN_LENGTH}: each copy needs a scored token")
  half = length // 2 + 1
  vocabulary = np.setdiff1d(np.arange(vocab_size), [EOT_TOKEN])
  first = rng.choice(vocabulary, size=(samples, half))
  tokens = np.concatenate([first, first], axis=1)[:, :length + 1].astype(np.int32)
  target_position = np.arange(1, length + 1)  # targets[:, t] is tokens[:, t + 1]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "first": np.broadcast_to(target_position < half, (samples, length)),
          "second": np.broadcast_to(target_position > half, (samples, length))}


def run_induction(model, config, *, lengths: list[int], samples: int, seed: int,
                  batch_size: int, progress: bool) -> dict:
  """The `induction` part of eval.json: a row per length (module docstring)."""
  start = time.perf_counter()
  rows = []
  bar = common.progress_bar(samples * len(lengths), "induction", progress)
  for length in lengths:
    bar.set_description(f"induction {length}")
    windows = repeated_windows(np.random.default_rng(seed_sequence(seed, length)), samples,
                               length, config.model.vocab_size)
    nll, hit = common.token_scores(model, windows["inputs"], windows["targets"],
                                   batch_size=batch_size, bar=bar)
    first, second = windows["first"], windows["second"]
    first_loss = float(nll[first].mean(dtype=np.float64))
    second_loss = float(nll[second].mean(dtype=np.float64))
    rows.append({"length": length, "windows": samples, "tokens": int(second.sum()),
                 "first_loss": first_loss, "second_loss": second_loss,
                 "score": first_loss - second_loss,
                 "copy_accuracy": float(hit[second].mean(dtype=np.float64)),
                 "seed_sequence": seed_sequence(seed, length)})
  bar.close()
  return {"samples": samples, "rows": rows, "wall_seconds": time.perf_counter() - start}
