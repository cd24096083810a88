"""Copying a repeated random sequence: the induction test (Olsson et al., 2022).

A window of `length` tokens is h = length // 2 + 1 tokens drawn uniformly from the model's
common tokens, then the same h tokens again, cut to length + 1 tokens. The common tokens are the
4,096 most frequent ones (end-of-text left out) of the run's held-out data: the first 1M tokens
of the validation text, or examples of the run's MQAR task (`held_out_tokens`). A model trained
on tens of millions of tokens has never seen most of a 50K vocabulary and gives those ids ~13
nats, so ids drawn from all of it would measure the data's coverage rather than the copying.
Nothing in the first copy can be predicted (about ln 4096 = 8.3 nats a token for a model that
learnt the language). A token of the second copy is predicted by attending to the token after
the earlier occurrence of the current token, h positions back: the mechanism of induction heads,
and the one RULER's needles need once the key is found. A model that scores nothing here cannot
retrieve; one that does and still fails RULER does not match the key. For a sparse kind each
query of the second copy must select the block that holds its earlier occurrence, so this is also
a test of selection on sequences of no document.

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


# The common tokens: the most frequent ones of the first COUNTED_TOKENS held-out text tokens.
COMMON_TOKENS = 4096
COUNTED_TOKENS = 1 << 20


def held_out_tokens(config, *, lengths: list[int], seed: int,
                    data: str | None) -> tuple[np.ndarray, dict]:
  """The held-out tokens the common tokens are counted in, and their source: the first
  COUNTED_TOKENS of the validation split of the run's text (or of `data`), or, for an MQAR run
  without `data`, 16 validation examples of its task at the longest length."""
  if config.data.source == "mqar" and data is None:
    windows = common.held_out(config, length=max(lengths), samples=16, seed=seed, data=None)
    return windows["targets"].ravel(), windows["source"]
  split, folder = common.val_split(config, data)
  tokens = np.asarray(split.tokens[:COUNTED_TOKENS])
  return tokens, {"source": "tokens", "path": str(folder), "split": "val", "first": len(tokens)}


def common_tokens(config, *, lengths: list[int], seed: int,
                  data: str | None) -> tuple[np.ndarray, dict]:
  """The ids a window is drawn from, int `[<= COMMON_TOKENS]` ascending (the most frequent of
  the run's held-out data, ties to the lower id; end-of-text and ids the model cannot emit left
  out), and where they come from (for the record)."""
  tokens, source = held_out_tokens(config, lengths=lengths, seed=seed, data=data)
  counts = np.bincount(tokens, minlength=config.model.vocab_size)[:config.model.vocab_size]
  counts[EOT_TOKEN:EOT_TOKEN + 1] = 0  # a vocabulary below GPT-2's has no end-of-text id
  # A stable sort of -counts keeps the lower id first among equal counts.
  order = np.argsort(-counts, kind="stable")[:COMMON_TOKENS]
  ids = np.sort(order[counts[order] > 0])
  if len(ids) < 2:
    raise common.EvalArgumentError(
        f"--data: the held-out data holds {len(ids)} distinct token(s); the induction suite "
        f"draws its sequences from the data's common tokens and needs >= 2")
  return ids, {"tokens": int(len(ids)), "counted": int(len(tokens)), "data": source}


def repeated_windows(rng: np.random.Generator, samples: int, length: int,
                     vocabulary: np.ndarray) -> dict[str, np.ndarray]:
  """`samples` windows `[N, length]` of inputs and targets drawn from the ids `vocabulary`, and
  the boolean masks of the first and second copy's scored targets."""
  if length < MIN_LENGTH:
    raise ValueError(f"{length=} must be >= {MIN_LENGTH}: each copy needs a scored token")
  half = length // 2 + 1
  first = rng.choice(np.asarray(vocabulary), size=(samples, half))
  tokens = np.concatenate([first, first], axis=1)[:, :length + 1].astype(np.int32)
  target_position = np.arange(1, length + 1)  # targets[:, t] is tokens[:, t + 1]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
          "first": np.broadcast_to(target_position < half, (samples, length)),
          "second": np.broadcast_to(target_position > half, (samples, length))}


def run_induction(model, config, *, lengths: list[int], samples: int, seed: int,
                  data: str | None, batch_size: int, progress: bool) -> dict:
  """The `induction` part of eval.json: a row per length (module docstring), and the common
  tokens' record (`vocabulary`). `data`: a pisa-prepare-data folder in place of the run's."""
  start = time.perf_counter()
  vocabulary, vocabulary_record = common_tokens(config, lengths=lengths, seed=seed, data=data)
  rows = []
  bar = common.progress_bar(samples * len(lengths), "induction", progress)
  for length in lengths:
    bar.set_description(f"induction {length}")
    windows = repeated_windows(np.random.default_rng(seed_sequence(seed, length)), samples,
                               length, vocabulary)
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
  return {"samples": samples, "vocabulary": vocabulary_record, "rows": rows,
          "wall_seconds": time.perf_counter() - start}
