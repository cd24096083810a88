"""Batches: packed token files and the MQAR synthetic task, deterministic from (seed, step).

Every batch is a dict of numpy arrays for THIS host:
  inputs  int32   `[A, B_local, T]`   (A = gradient-accumulation micro-batches)
  targets int32   `[A, B_local, T]`   the next token of each input position
  weights float32 `[A, B_local, T]`   1 where the loss counts (all positions for text, answers for MQAR)
and with `data.packing` (token files only) the documents of each window:
  segment_ids int32 `[A, B_local, T]`  the document of each input position, counted from 0
  positions   int32 `[A, B_local, T]`  its position in that document (RoPE restarts per document)
The global batch of step s is drawn from `np.random.default_rng([seed, split, s])` and each host
keeps its rows, so a resumed run (or one on another host count) sees exactly the same batches.

Packing. The token files hold documents each closed by <|endoftext|> (`meta.json`'s "eot", GPT-2's
50256). An EOT belongs to the document it ends: a new document starts at the token after it (a
window's first token starts a document too, usually a piece of one). The model attends only
within documents, and the loss follows: the target of an EOT position, the next document's first
token, gets weight 0, as nothing of that document is visible from the EOT; predicting it would be
the one thing that crosses a boundary. So each document's EOT is a target (the model learns
where documents end) and its first token is not (Megatron's `eod_mask_loss`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FORMAT = "pisa-jax-tokens-v1"
TRAIN, VAL = 0, 1
# The token files' element types (meta.json's "dtype"): uint16 while every id fits (GPT-2's
# 50,257, SmolLM2's 49,152), uint32 for larger vocabularies (Llama 3's 128,256). A folder
# written before the field existed holds uint16.
TOKEN_DTYPES = ("uint16", "uint32")


def token_dtype_for(vocab_size: int) -> str:
  """The narrowest of TOKEN_DTYPES that holds every id below `vocab_size`."""
  if vocab_size <= 1 << 16:
    return "uint16"
  if vocab_size <= 1 << 32:
    return "uint32"
  raise ValueError(f"vocab_size={vocab_size:,} does not fit uint32 token ids (at most 2^32)")


def token_dtype(meta: dict, meta_path) -> np.dtype:
  """The element type of a corpus' token files from its meta.json (`meta`, read from
  `meta_path`); ValueError naming the field for an unknown one."""
  name = meta.get("dtype", "uint16")
  if name not in TOKEN_DTYPES:
    raise ValueError(f"{meta_path}: dtype={name!r} must be one of {TOKEN_DTYPES}")
  return np.dtype(name)


def _host_rows(global_batch: int, process_index: int, process_count: int) -> slice:
  if global_batch % process_count:
    raise ValueError(f"global batch {global_batch} must divide over {process_count} hosts")
  n = global_batch // process_count
  return slice(process_index * n, (process_index + 1) * n)


def document_layout(inputs: np.ndarray, eot: int) -> dict[str, np.ndarray]:
  """Segment ids, positions and loss weights of token windows `[..., T]` whose documents end at
  `eot` (the module docstring gives the rule)."""
  is_eot = inputs == eot
  # The EOTs strictly before each position: an EOT closes its own document.
  segment_ids = np.cumsum(is_eot, axis=-1, dtype=np.int32) - is_eot
  first = np.concatenate([np.ones_like(is_eot[..., :1]), is_eot[..., :-1]], axis=-1)
  index = np.arange(inputs.shape[-1], dtype=np.int32)
  start = np.maximum.accumulate(np.where(first, index, 0), axis=-1)
  return {
      "segment_ids": segment_ids.astype(np.int32),
      "positions": (index - start).astype(np.int32),
      "weights": np.where(is_eot, 0.0, 1.0).astype(np.float32),
  }


class TokenWindows:
  """Random windows of seq_len + 1 tokens from a packed token file written by pisa-prepare-data;
  with `packing`, their documents' segment ids and positions (the module docstring)."""

  def __init__(self, folder: str | Path, split: str, *, seq_len: int, global_batch: int,
               accum: int, seed: int, vocab_size: int, process_index: int = 0,
               process_count: int = 1, packing: bool = False):
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
      raise FileNotFoundError(
          f"data.path={str(folder)!r} has no meta.json: write it with `pisa-prepare-data --out {folder}`"
      )
    try:
      meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
      raise ValueError(f"{meta_path} is corrupt: {e}") from None
    if meta.get("format") != FORMAT:
      raise ValueError(f"{meta_path} format={meta.get('format')!r}, expected {FORMAT!r}")
    if meta["vocab_size"] > vocab_size:
      raise ValueError(
          f"{folder} holds tokens up to {meta['vocab_size'] - 1} but model.vocab_size={vocab_size}"
      )
    dtype = token_dtype(meta, meta_path)
    path = folder / f"{split}.bin"
    expected = meta[f"{split}_tokens"]
    if not path.is_file():
      raise FileNotFoundError(f"{path} is missing (meta.json promises {expected} tokens)")
    size = path.stat().st_size
    if size != dtype.itemsize * expected:
      raise ValueError(f"{path} is corrupt: {size} bytes, meta.json promises {expected} "
                       f"{dtype.name} tokens")
    if expected < seq_len + 1:
      hint = ""
      if split == "val":
        total = expected + int(meta.get("train_tokens", 0))
        need = (seq_len + 1) / max(total, 1)
        hint = (f"; set train.eval_batches=0 to train without evaluating, or prepare it with "
                f"pisa-prepare-data --val-fraction above {need:.3g}" if need < 0.5 else
                "; the corpus is too small for windows this long")
      raise ValueError(
          f"{path} has {expected} tokens, fewer than train.seq_len + 1 = {seq_len + 1}{hint}")
    if packing and not isinstance(meta.get("eot"), int):
      raise ValueError(f"data.packing=true needs the end-of-text token: {meta_path} has no integer "
                       f"\"eot\" (got {meta.get('eot')!r}); write the folder with pisa-prepare-data")
    self.packing = packing
    self.tokens = np.memmap(path, dtype=dtype, mode="r")
    self.meta = meta
    self.split_id = TRAIN if split == "train" else VAL
    self.seq_len, self.global_batch, self.accum, self.seed = seq_len, global_batch, accum, seed
    self.rows = _host_rows(global_batch, process_index, process_count)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.split_id, step])
    # int64 offsets: a file past 2^31 tokens is read where it should be.
    starts = rng.integers(0, len(self.tokens) - self.seq_len, size=(self.accum, self.global_batch),
                          dtype=np.int64)
    starts = starts[:, self.rows]
    # Contiguous slices of seq_len + 1 tokens: inputs are the first T, targets the last T.
    windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.ravel()])
    windows = windows.reshape(*starts.shape, self.seq_len + 1).astype(np.int32)
    batch = {
        "inputs": windows[..., :-1],
        "targets": windows[..., 1:],
        "weights": np.ones(windows[..., 1:].shape, np.float32),
    }
    if self.packing:
      batch.update(document_layout(batch["inputs"], self.meta["eot"]))
    return batch


def mqar_examples(rng: np.random.Generator, n: int, *, seq_len: int, vocab_size: int,
                  num_pairs: int, power_a: float = 0.01,
                  random_filler: bool = True) -> dict[str, np.ndarray]:
  """Multi-query associative recall, Zoology's `multiquery_ar` definition, vectorised.

  Each sequence opens with `num_pairs` key-value pairs (keys distinct from [1, V/2), values distinct
  from [V/2, V)); each key is queried once later, at position 2P + 2*gap with gaps drawn without
  replacement from p(i) ~ a * i^(a-1); the answer (the key's value) is the target at the query
  position and the only place the loss counts. Other positions hold random tokens from [0, V)
  (Zoology's `random_non_queries=True`), or 0 with `random_filler=False`.

  Returns inputs, targets int32 `[n, T]` and weights float32 `[n, T]`.
  """
  context = 2 * num_pairs
  space = (seq_len - context) // 2
  half = vocab_size // 2
  # Distinct keys / values: the first P of a random permutation of each range.
  keys = 1 + np.argsort(rng.random((n, half - 1)), axis=1)[:, :num_pairs]
  values = half + np.argsort(rng.random((n, vocab_size - half)), axis=1)[:, :num_pairs]
  # Sampling without replacement with p ~ a * i^(a-1) equals taking the top P of log p + Gumbel.
  log_p = (power_a - 1.0) * np.log(np.arange(1, space + 1))
  gaps = np.argsort(-(log_p + rng.gumbel(size=(n, space))), axis=1)[:, :num_pairs]
  example = rng.integers(0, vocab_size, size=(n, seq_len + 1))
  if not random_filler:
    example[:] = 0
  example[:, 0:context:2] = keys
  example[:, 1:context:2] = values
  rows = np.arange(n)[:, None]
  query_pos = context + 2 * gaps
  example[rows, query_pos] = keys
  weights = np.zeros((n, seq_len), np.float32)
  targets = example[:, 1:].copy()
  # The target at a query position is the queried key's value (Zoology labels position q + 1).
  targets[rows, query_pos] = values
  weights[rows, query_pos] = 1.0
  return {
      "inputs": example[:, :-1].astype(np.int32),
      "targets": targets.astype(np.int32),
      "weights": weights,
  }


class MQARBatches:
  """MQAR batches generated on the fly: `[A, B_local, T]` per step, deterministic from (seed, step)."""

  def __init__(self, *, vocab_size: int, seq_len: int, num_pairs: int, power_a: float,
               global_batch: int, accum: int, seed: int, split: str = "train",
               process_index: int = 0, process_count: int = 1, random_filler: bool = True):
    self.kw = dict(seq_len=seq_len, vocab_size=vocab_size, num_pairs=num_pairs, power_a=power_a,
                   random_filler=random_filler)
    self.global_batch, self.accum, self.seed = global_batch, accum, seed
    self.split_id = TRAIN if split == "train" else VAL
    self.rows = _host_rows(global_batch, process_index, process_count)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.split_id, step])
    ex = mqar_examples(rng, self.accum * self.global_batch, **self.kw)
    return {
        k: v.reshape(self.accum, self.global_batch, -1)[:, self.rows] for k, v in ex.items()
    }


def check_tokenizer(meta: dict, folder, workdir) -> str | None:
  """A run reads only a corpus of its own tokenizer: a run with a tokenizer.json (`pisa-import`)
  one that `pisa-prepare-data --tokenizer RUN` wrote (its SHA-256 in meta.json), any other run
  one of GPT-2's BPE (no SHA-256 recorded). Returns the run's digest (None: GPT-2's BPE)."""
  from pisa_jax.train.tokenizer import tokenizer_digest

  digest, recorded = tokenizer_digest(workdir), meta.get("tokenizer_sha256")
  if digest == recorded:
    return digest
  source = meta.get("tokenizer", "gpt2")
  if digest is None:
    raise ValueError(f"data.path={str(folder)!r} was tokenized by {source} and this run reads "
                     f"GPT-2's BPE ({workdir} has no tokenizer.json)")
  # A corpus prepared before digests were recorded may be of the same tokenizer: it says so.
  unknown = "" if recorded else " (its meta.json records no vocabulary digest)"
  raise ValueError(f"data.path={str(folder)!r} was tokenized by {source}, not by this run's "
                   f"{workdir}/tokenizer.json{unknown}: prepare it with `pisa-prepare-data "
                   f"--tokenizer {workdir} --out DIR`")


def make_batches(config, split: str, *, global_batch: int, accum: int, process_index: int = 0,
                 process_count: int = 1, workdir=None):
  """The train or val batch source named by `config.data` (`TokenWindows` or `MQARBatches`;
  training windows with `data.retrieval_fraction` > 0: `pisa_jax.train.retrieval.RetrievalMixture`).
  workdir: the run folder whose tokenizer the corpus must be of (`check_tokenizer`); None skips
  the check (benchmarks on GPT-2 corpora)."""
  d, t, m = config.data, config.train, config.model
  if d.source == "mqar":
    return MQARBatches(
        vocab_size=m.vocab_size, seq_len=t.seq_len, num_pairs=d.mqar_num_pairs,
        power_a=d.mqar_power_a, random_filler=d.mqar_random_filler, global_batch=global_batch,
        accum=accum, seed=t.seed, split=split,
        process_index=process_index, process_count=process_count,
    )
  windows = TokenWindows(
      d.path, split, seq_len=t.seq_len, global_batch=global_batch, accum=accum, seed=t.seed,
      vocab_size=m.vocab_size, process_index=process_index, process_count=process_count,
      packing=d.packing,
  )
  digest = None if workdir is None else check_tokenizer(windows.meta, d.path, workdir)
  if split != "train" or not d.retrieval_fraction:
    return windows
  if digest is not None:
    raise ValueError(f"data.retrieval_fraction={d.retrieval_fraction}: the needle mixture is "
                     f"written in GPT-2's BPE and this run reads its own {workdir}/tokenizer.json; "
                     f"set data.retrieval_fraction=0")
  # Training batches mix in needle documents; held-out batches stay text.
  from pisa_jax.train.retrieval import RetrievalMixture

  return RetrievalMixture(windows, d.retrieval_path, fraction=d.retrieval_fraction,
                          min_length=d.retrieval_min_length,
                          max_length=d.retrieval_max_length,
                          answer_weight=d.retrieval_answer_weight,
                          templates=d.retrieval_templates,
                          text_share=d.retrieval_text_share)
