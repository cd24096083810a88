"""What every part of `pisa-eval` shares: argument errors, the model's context, held-out windows,
per-token scores from one forward pass, position buckets and the record of what produced a result.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pisa_jax.models.decoder import output_logits
# The error every part raises for a bad argument (defined where the checks without jax live).
from pisa_jax.train.evaluation.arguments import EvalArgumentError

# The paper's evaluation lengths (Table 3, Appendix C.2).
PAPER_LENGTHS = (1024, 2048, 4096, 8192, 16384)
# float32 logits per chunk of the output projection: [batch, chunk, Vp] stays near 256 MiB.
_LOGIT_ELEMENTS = 1 << 26


def model_context(config, context: int | None) -> tuple[int, str]:
  """The longest window the model is evaluated at, and where that limit comes from.

  RoPE has no table of positions (angles are exact to 2^31, `models.decoder.rope_at`) and
  `ModelConfig` has no maximum: the limit is the context the run trained at, train.seq_len,
  unless --context raises it (length extrapolation is then what is measured).
  """
  if context is not None:
    return context, "--context"
  return config.train.seq_len, "train.seq_len of the run; --context raises it"


def default_lengths(context: int) -> list[int]:
  """The paper's lengths that fit `context`, or `context` itself when none does."""
  return [n for n in PAPER_LENGTHS if n <= context] or [context]


def check_lengths(lengths: list[int], context: int, where: str) -> None:
  for n in lengths:
    if n > context:
      raise EvalArgumentError(f"--lengths: {n} exceeds the model's context of {context} ({where})")


def position_buckets(length: int, first: int = 16) -> list[tuple[int, int]]:
  """Log-spaced [start, end) position ranges covering [0, length): [0, 16), [16, 32), [32, 64),
  ... the last ending at `length`. Equal widths in log position: the question is whether the loss
  keeps falling as the model sees more context, which a linear split hides in its first bucket."""
  edges = [0]
  edge = first
  while edge < length:
    edges.append(edge)
    edge *= 2
  edges.append(length)
  return list(zip(edges[:-1], edges[1:]))


# ----------------------------------------------------------------------------- held-out windows


def val_split(config, data: str | None):
  """The validation split of the run's text (data.path), or of the pisa-prepare-data folder
  `data`: (its `TokenWindows`, the folder)."""
  from pisa_jax.train.data import TokenWindows

  folder = data if data is not None else config.data.path
  return TokenWindows(folder, "val", seq_len=1, global_batch=1, accum=1, seed=0,
                      vocab_size=config.model.vocab_size, packing=config.data.packing), folder


def held_out(config, *, length: int, samples: int, seed: int, data: str | None) -> dict:
  """`samples` validation windows of `length` tokens: inputs, targets int32 `[N, T]`, weights
  float32 `[N, T]` (1 where the loss counts), and `source`, what the windows are (for the record
  and for reproducing them).

  Text (the run's data.path, or `data`): windows starting at evenly spaced offsets of the
  validation split, deterministic and spread over all of it (overlapping only where the split
  holds fewer than samples x (length + 1) tokens). A run trained with `data.packing` is scored
  as it trained: the windows add segment_ids and positions `[N, T]` from the end-of-text tokens
  and the target after each one weighs 0 (`train.data.document_layout`). MQAR runs without
  `data`: the examples of the run's task at this length from
  `np.random.default_rng([seed, 1, length])` (1: the validation split's id in `train.data`).
  """
  from pisa_jax.train.data import VAL, document_layout, mqar_examples

  d, m = config.data, config.model
  if d.source == "mqar" and data is None:
    sequence = [seed, VAL, length]
    ex = mqar_examples(np.random.default_rng(sequence), samples, seq_len=length,
                       vocab_size=m.vocab_size, num_pairs=d.mqar_num_pairs,
                       power_a=d.mqar_power_a, random_filler=d.mqar_random_filler)
    source = {"source": "mqar", "split": "val", "num_pairs": d.mqar_num_pairs,
              "power_a": d.mqar_power_a, "random_filler": d.mqar_random_filler,
              "seed_sequence": sequence}
    return {**ex, "source": source}
  windows, folder = val_split(config, data)
  tokens = windows.tokens
  last = len(tokens) - length - 1
  starts = np.linspace(0, max(last, 0), samples).round().astype(np.int64)
  rows = np.stack([tokens[s:s + length + 1] for s in starts]).astype(np.int32)
  source = {"source": "tokens", "path": str(folder), "split": "val",
            "split_tokens": int(len(tokens)), "starts": starts.tolist(), "packing": d.packing}
  out = {"inputs": rows[:, :-1], "targets": rows[:, 1:],
         "weights": np.ones(rows[:, 1:].shape, np.float32), "source": source}
  if d.packing:
    out.update(document_layout(out["inputs"], windows.meta["eot"]))
  return out


def check_data(config, *, lengths: list[int], data: str | None, what: str) -> None:
  """Raises EvalArgumentError naming --data or --lengths when `held_out` could not run."""
  from pisa_jax.train.data import FORMAT, token_dtype

  d = config.data
  if d.source == "mqar" and data is None:
    need = 4 * d.mqar_num_pairs
    if lengths[0] < need:
      raise EvalArgumentError(
          f"--lengths: {lengths[0]} is too short for {what} on the run's MQAR task: "
          f"{d.mqar_num_pairs} pairs (data.mqar_num_pairs) need >= {need} tokens")
    return
  folder = data if data is not None else d.path
  name = "--data" if data is not None else "--data (default: the run's data.path)"
  if not folder:
    raise EvalArgumentError(f"{name}: the run names no data folder; give --data DIR written by "
                            f"pisa-prepare-data")
  meta_path = Path(folder) / "meta.json"
  try:
    meta = json.loads(meta_path.read_text())
  except (OSError, ValueError) as e:
    raise EvalArgumentError(f"{name}: {folder} is not a folder written by pisa-prepare-data "
                            f"({meta_path}: {e.__class__.__name__})") from None
  if meta.get("format") != FORMAT:
    raise EvalArgumentError(f"{name}: {meta_path} has format={meta.get('format')!r}, expected "
                            f"{FORMAT!r}")
  if meta.get("vocab_size", 0) > config.model.vocab_size:
    raise EvalArgumentError(
        f"{name}: {folder} holds tokens up to {meta['vocab_size'] - 1}, beyond the model's "
        f"vocabulary of {config.model.vocab_size} (model.vocab_size)")
  try:
    itemsize = token_dtype(meta, meta_path).itemsize
  except ValueError as e:
    raise EvalArgumentError(f"{name}: {e}") from None
  split = Path(folder) / "val.bin"
  available = split.stat().st_size // itemsize if split.is_file() else 0
  if available < lengths[-1] + 1:
    raise EvalArgumentError(
        f"--lengths: {lengths[-1]} needs {lengths[-1] + 1:,} tokens of held-out text; "
        f"{split} holds {available:,}")


# ----------------------------------------------------------------------------- per-token scores


def _chunk_scores(x, targets, lm_head, vocab_size: int):
  """NLL float32 and argmax hits `[B, c]` of the tokens after `x` `[B, c, E]`."""
  logits = output_logits(x, lm_head, vocab_size)
  nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[..., None],
                                                                 axis=-1)[..., 0]
  return nll, jnp.argmax(logits, axis=-1) == targets


@functools.partial(jax.jit, static_argnames=("chunk",))
def _token_scores(model, inputs, targets, segment_ids, positions, *, chunk: int):
  x = model.hidden_states(inputs, segment_ids, positions)  # [B, T, E]
  b, t, e = x.shape
  if chunk >= t:
    return _chunk_scores(x, targets, model.output_embedding(), model.cfg.vocab_size)
  pad = -t % chunk
  x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  lm_head = model.output_embedding()
  # One chunk's [B, chunk, Vp] float32 logits at a time: the whole [B, T, Vp] never exists.
  one = lambda xs: _chunk_scores(*xs, lm_head, model.cfg.vocab_size)
  split = lambda a: jnp.moveaxis(a.reshape(b, n, chunk, *a.shape[2:]), 1, 0)
  nll, hit = jax.lax.map(one, (split(x), split(targets)))
  merge = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n * chunk)[:, :t]
  return merge(nll), merge(hit)


def token_scores(model, inputs: np.ndarray, targets: np.ndarray, *, batch_size: int,
                 bar=None, segment_ids: np.ndarray | None = None,
                 positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Next-token NLL float32 `[N, T]` and whether the argmax is the target, bool `[N, T]`, from
  the model's forward pass (its own attention) over `inputs` `[N, T]`, `batch_size` rows at a time.
  segment_ids, positions: None, or int32 `[N, T]` packed documents (`Decoder.hidden_states`).

  The last batch is filled up with copies of row 0 (results dropped), so every batch has one
  shape and compiles once.
  """
  n, t = inputs.shape
  batch_size = min(batch_size, n)
  vp = model.cfg.padded_vocab_size
  chunk = 1 << max(0, int(math.log2(max(1, _LOGIT_ELEMENTS // (batch_size * vp)))))
  chunk = min(chunk, 1 << (t - 1).bit_length())
  nll, hit = [], []
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    rows = np.where(rows < n, rows, 0)
    a, b = _token_scores(model, inputs[rows], targets[rows],
                         None if segment_ids is None else segment_ids[rows],
                         None if positions is None else positions[rows], chunk=chunk)
    keep = min(batch_size, n - start)
    nll.append(np.asarray(a)[:keep])
    hit.append(np.asarray(b)[:keep])
    if bar is not None:
      bar.update(keep)
  return np.concatenate(nll), np.concatenate(hit)


def progress_bar(total: int, desc: str, enabled: bool):
  from tqdm import tqdm

  return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def mean_or_none(total: float, count: float) -> float | None:
  """total / count, or None (JSON null) where nothing was counted."""
  return float(total / count) if count else None
