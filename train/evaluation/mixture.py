"""Held-out needle documents of the training mixture's own families: does the model retrieve in
the templates it was trained on?

RULER (`needles.run_ruler`) asks in templates, keys and values that training never shows
(`pisa_jax.train.retrieval`), so a model at 0% there may still retrieve in its own templates, or
not at all: this suite tells the two apart. Its documents are `NeedleMaker`'s, of every family
(`retrieval.FAMILIES`), over the val split of the run's `data.retrieval_path` (text the mixture
never trains on), one document a row at exactly each length.

Scoring is teacher-forced: an answer counts as retrieved when the model's argmax is the target at
every one of its tokens, which is exactly when greedy decoding from the question writes it. One
forward pass a document, no generation. Rows also give the answer tokens' mean NLL (nats).
"""

from __future__ import annotations

import time

import numpy as np

from pisa_jax.train.data import TokenWindows
from pisa_jax.train.evaluation import common
from pisa_jax.train.retrieval import FAMILIES, NeedleMaker
from pisa_jax.train.tokenizer import EOT_TOKEN


def haystack(config) -> np.ndarray:
  """The val tokens of the run's `data.retrieval_path`."""
  path = config.data.retrieval_path
  if not path:
    raise common.EvalArgumentError(
        "--suite: mixture needs data.retrieval_path, the haystack folder of the run's retrieval "
        "mixture (a run trained without one has no templates of its own to test)")
  try:
    return TokenWindows(path, "val", seq_len=1, global_batch=1, accum=1, seed=0,
                        vocab_size=EOT_TOKEN + 1, packing=True).tokens
  except (FileNotFoundError, ValueError) as e:
    raise common.EvalArgumentError(f"--suite: mixture: data.retrieval_path={path!r}: "
                                   f"{' '.join(str(e).splitlines())}") from None


def documents(maker: NeedleMaker, *, length: int, family: str, samples: int, seed: int):
  """`samples` needle documents of `family`, `length` tokens each, from their own random stream
  (a cell does not change when the grid around it does)."""
  rng = np.random.default_rng([seed, length, FAMILIES.index(family)])
  return [maker.make(rng, length, family) for _ in range(samples)]


def run_mixture(model, config, *, lengths: list[int], samples: int, seed: int, batch_size: int,
                progress: bool, context: int | None = None, encoding=None) -> dict:
  """Retrieval accuracy on held-out needle documents of the training families.

  Args:
    lengths: document lengths in tokens, each at most `context` (default: the run's
      train.seq_len). samples: documents per family and length. seed: their random streams.

  Returns:
    rows: one per (length, family): samples, accuracy (the share of documents whose whole answer
      is the argmax at every token), answer_nll (mean over answer tokens); families: the same
      averaged over lengths; records: one per document (family, length, depths of its needles,
      retrieved).
  """
  context = config.train.seq_len if context is None else context
  for length in lengths:
    if length > context:
      raise common.EvalArgumentError(
          f"--lengths: {length} exceeds the context {context} (default: the run's "
          f"train.seq_len; a mixture document is one row)")
  start = time.perf_counter()
  maker = NeedleMaker(haystack(config), encoding, templates=config.data.retrieval_templates)
  bar = common.progress_bar(samples * len(lengths) * len(FAMILIES), "mixture", progress)
  rows, records = [], []
  for length in lengths:
    for family in FAMILIES:
      bar.set_description(f"mixture {length} {family}")
      docs = documents(maker, length=length, family=family, samples=samples, seed=seed)
      tokens = np.stack([d.tokens for d in docs]).astype(np.int32)
      nll, hit = common.token_scores(model, tokens[:, :-1], tokens[:, 1:],
                                     batch_size=batch_size, bar=bar)
      retrieved, answer_nll = [], []
      for doc, n, h in zip(docs, nll, hit):
        # The answer token at document position p is the target of input position p - 1.
        span = slice(doc.answer[0] - 1, doc.answer[1] - 1)
        retrieved.append(bool(h[span].all()))
        answer_nll.append(float(n[span].mean()))
        records.append({"family": family, "length": length, "depths": list(doc.depths),
                        "retrieved": retrieved[-1]})
      # Documents too short for the family's needles are made as a smaller family
      # (NeedleMaker.make); they count here, and the row says how many there were.
      rows.append({"length": length, "family": family, "samples": samples,
                   "accuracy": float(np.mean(retrieved)),
                   "answer_nll": float(np.mean(answer_nll)),
                   "fallbacks": sum(d.family != family for d in docs)})
  bar.close()
  families = [{"family": f, "accuracy": float(np.mean([r["accuracy"] for r in rows
                                                       if r["family"] == f]))}
              for f in FAMILIES]
  return {"samples": samples, "lengths": list(lengths), "rows": rows, "families": families,
          "average": float(np.mean([r["accuracy"] for r in rows])), "records": records,
          "key_formats": list(maker.key_formats), "wall_seconds": time.perf_counter() - start}
