"""RULER needle-in-a-haystack accuracy (Section 4.3, Table 3, Appendix C.2) by greedy generation.

The tasks, their prompts and their scoring are `pisa_jax.train.evaluation.ruler`'s (FAMILIES,
make_samples, score, load_haystack); this runner decodes every sample greedily through
`pisa_jax.generate` with the model's own attention and cache, prompts batched by the padded width
that `generate` compiles for, and aggregates as the paper does: a family averages its tasks
(single-key and multi-key three templates each), and the average is over the four families and
every length, before rounding.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict

import numpy as np

import pisa_jax
from pisa_jax.generation import MIN_BUCKET, generate
from pisa_jax.train.evaluation import common
from pisa_jax.train.tokenizer import EOT_TOKEN, VOCAB_SIZE

RULER_MODULE = "pisa_jax.train.evaluation.ruler"


def load_ruler():
  """The RULER task module, imported when the suite runs (a test may put its own in its place)."""
  try:
    return importlib.import_module(RULER_MODULE)
  except ModuleNotFoundError as e:
    if e.name != RULER_MODULE:
      raise
    raise common.EvalArgumentError(f"--suite: ruler needs the module {RULER_MODULE}, which this "
                                   f"installation lacks") from None


def check_vocabulary(config, encoding=None) -> None:
  """RULER's prompts are text of the run's tokenizer (`encoding`; None: GPT-2's): every id of the
  tokenizer must be a token of the model."""
  n_vocab = VOCAB_SIZE if encoding is None else encoding.n_vocab
  what = "GPT-2 tokens" if encoding is None else "tokens of the run's tokenizer"
  if config.model.vocab_size < n_vocab:
    raise common.EvalArgumentError(
        f"--suite: ruler prompts are {what} (ids up to {n_vocab - 1}) and the model's "
        f"vocabulary holds {config.model.vocab_size} (model.vocab_size)")


def _bucket(num_tokens: int) -> int:
  """The padded prompt width `pisa_jax.generate` compiles its prefill for."""
  return pisa_jax.bucket_capacity(max(num_tokens, MIN_BUCKET), 1)


def greedy(model, prompts: list[list[int]], max_new_tokens: list[int], *, batch_size: int,
           stop: tuple[int, ...], bar=None) -> list[list[int]]:
  """The greedy continuation of every prompt, its stop token removed.

  Prompts of one prefill bucket and budget run together, `batch_size` at a time; the last batch
  of a group is filled up with copies of its first prompt (their outputs dropped), so each
  (bucket, budget) compiles one prefill, whatever the number of samples.
  """
  groups = defaultdict(list)
  for i, (prompt, budget) in enumerate(zip(prompts, max_new_tokens)):
    groups[(_bucket(len(prompt)), budget)].append(i)
  out: list[list[int]] = [[] for _ in prompts]
  for (_, budget), members in sorted(groups.items()):
    for start in range(0, len(members), batch_size):
      rows = members[start:start + batch_size]
      batch = [prompts[i] for i in rows] + [prompts[rows[0]]] * (batch_size - len(rows))
      generation = generate(model, batch, max_new_tokens=budget, stop_tokens=stop)
      for i, seq in zip(rows, generation.sequences()):
        out[i] = [t for t in seq if t not in stop]
      if bar is not None:
        bar.update(len(rows))
  return out


def run_ruler(model, config, *, lengths: list[int], samples: int, seed: int, batch_size: int,
              progress: bool, ruler=None, haystack: str | None = None,
              encoding=None, stop: tuple[int, ...] = (EOT_TOKEN,),
              answer_scores: bool = False) -> tuple[dict, list[dict]]:
  """Every RULER task of `ruler.FAMILIES` at each length, `samples` samples each.

  Returns the `ruler` part of eval.json (scores are fractions in [0, 1]: tasks, families,
  by_length and the paper's average) and one record per sample (task, length, index, prompt
  length, answers, prediction, score, needle depths) for ruler_predictions.jsonl. encoding: the
  run's tokenizer (None: GPT-2's), stop: the tokens that end a generation.

  answer_scores: also score each one-answer sample's answer, as " {value}", teacher-forced after
  its answer prefix (one forward pass a sample; the part's `answer_scores`), which tells a model
  that finds the needle but does not write it (greedy decoding drifts into prose) from one that
  does not find it.
  """
  from pisa_jax.train.tokenizer import gpt2_encoding

  start = time.perf_counter()
  ruler = ruler or load_ruler()
  encoding = encoding or gpt2_encoding()
  if haystack is None:
    haystack = ruler.load_haystack()
  families = {name: tuple(tasks) for name, tasks in ruler.FAMILIES.items()}
  tasks = [(family, task) for family, names in families.items() for task in names]
  records: list[dict] = []
  bar = common.progress_bar(samples * len(tasks) * len(lengths), "ruler", progress)
  for length in lengths:
    bar.set_description(f"ruler {length}")
    drawn = []
    for family, task in tasks:
      try:
        made = ruler.make_samples(task, length=length, num_samples=samples, seed=seed,
                                  tokenizer=encoding, haystack=haystack)
      except ValueError as e:
        raise common.EvalArgumentError(f"--lengths: RULER's {task} at {length} tokens: {e}"
                                       ) from None
      for index, sample in enumerate(made):
        if len(sample.prompt_tokens) + sample.max_new_tokens > length:
          raise ValueError(f"{RULER_MODULE}.make_samples({task!r}, length={length}) gave sample "
                           f"{index} a prompt of {len(sample.prompt_tokens)} tokens and "
                           f"{sample.max_new_tokens} to generate: more than its length")
        drawn.append((family, task, index, sample))
    outputs = greedy(model, [list(s.prompt_tokens) for *_, s in drawn],
                     [s.max_new_tokens for *_, s in drawn], batch_size=batch_size, stop=stop,
                     bar=bar)
    for (family, task, index, sample), tokens in zip(drawn, outputs):
      # A model's table may outgrow its tokenizer (Qwen pads 151,665 tokens to 151,936 rows):
      # an id past the tokenizer's has no text, so it reads as nothing (as a special token).
      prediction = encoding.decode([t for t in tokens if t < encoding.n_vocab])
      records.append({"task": task, "family": family, "length": length, "index": index,
                      "prompt_tokens": len(sample.prompt_tokens), "new_tokens": len(tokens),
                      "answers": list(sample.answers), "prediction": prediction,
                      "score": float(ruler.score(prediction, sample.answers)),
                      # A stand-in task module may not say where its needles are.
                      "depths": list(getattr(sample, "depths", ()))})
    if answer_scores:  # this length's records, in the order drawn
      _score_answers(model, list(zip(records[-len(drawn):], (s for *_, s in drawn))), encoding,
                     length, batch_size)
  bar.close()
  part = aggregate(records, families, lengths)
  if answer_scores:
    part["answer_scores"] = answer_score_rows(records, lengths)
  part.update(samples=samples, seed=seed, predictions="ruler_predictions.jsonl",
              wall_seconds=time.perf_counter() - start)
  return part, records


def _score_answers(model, pairs: list[tuple[dict, object]], encoding, length: int,
                   batch_size: int) -> None:
  """Adds `answer_hit` (every token of the answer is the model's argmax after its answer prefix
  and the answer tokens before it) and `answer_nll` (their mean NLL) to each record of a sample
  with one answer; samples with several (multi-query, multi-value: any order counts) get none."""
  one = [(record, sample) for record, sample in pairs if len(sample.answers) == 1]
  if not one:
    return
  rows = np.full((len(one), length), EOT_TOKEN, np.int32)
  spans = []
  for i, (_, sample) in enumerate(one):
    answer = list(encoding.encode_ordinary(" " + sample.answers[0]))
    tokens = list(sample.prompt_tokens) + answer
    # make_samples leaves max_new_tokens (> any answer) after the prompt within `length`.
    rows[i, :len(tokens)] = tokens
    spans.append((len(sample.prompt_tokens), len(tokens)))
  nll, hit = common.token_scores(model, rows[:, :-1], rows[:, 1:], batch_size=batch_size)
  for (record, _), (a, b), n, h in zip(one, spans, nll, hit):
    # The token at position p is the target of input position p - 1.
    record["answer_hit"] = bool(h[a - 1:b - 1].all())
    record["answer_nll"] = float(n[a - 1:b - 1].mean())


def answer_score_rows(records: list[dict], lengths: list[int]) -> list[dict]:
  """Per (family, length) of the one-answer tasks: the share of samples whose answer the model
  ranks first token by token after the answer prefix, and its mean NLL."""
  out = []
  for length in lengths:
    by_family = defaultdict(list)
    for r in records:
      if r["length"] == length and "answer_hit" in r:
        by_family[r["family"]].append(r)
    for family, rs in by_family.items():
      out.append({"family": family, "length": length, "samples": len(rs),
                  "hit": float(np.mean([r["answer_hit"] for r in rs])),
                  "nll": float(np.mean([r["answer_nll"] for r in rs]))})
  return out


def aggregate(records: list[dict], families: dict[str, tuple[str, ...]],
              lengths: list[int]) -> dict:
  """Mean score per (task, length); per (family, length) the mean of its tasks; per length the
  mean of the families; `average` the mean over families and lengths (Table 3's Avg)."""
  scores = defaultdict(list)
  for r in records:
    scores[(r["task"], r["length"])].append(r["score"])
  task_rows, family_rows, length_rows = [], [], []
  for length in lengths:
    family_scores = []
    for family, names in families.items():
      per_task = []
      for task in names:
        values = scores[(task, length)]
        per_task.append(float(np.mean(values)))
        task_rows.append({"task": task, "family": family, "length": length,
                          "samples": len(values), "score": per_task[-1]})
      family_scores.append(float(np.mean(per_task)))
      family_rows.append({"family": family, "length": length, "score": family_scores[-1]})
    length_rows.append({"length": length, "score": float(np.mean(family_scores))})
  return {"lengths": lengths, "families": family_rows, "tasks": task_rows,
          "by_length": length_rows,
          "average": float(np.mean([r["score"] for r in family_rows]))}
