"""RULER needle-in-a-haystack tasks (Hsieh et al., 2024), generated offline and deterministically.

  samples = make_samples("niah_multikey_1", length=4096, num_samples=100, seed=0)
  accuracy = sum(score(generate(s.prompt_tokens, s.max_new_tokens), s.answers)
                 for s in samples) / len(samples)

The paper (Section 4.3, Appendix C.2) reports four families of RULER's retrieval tasks at 1K-16K
tokens: single-key and multi-key average three task variants each, multi-query and multi-value
are one task each (`FAMILIES`). Each task is RULER's definition (as lm-eval's port states it):

  task              haystack  key    value  keys values queries
  niah_single_1     noise     words  numbers   1    1     1
  niah_single_2     essay     words  numbers   1    1     1
  niah_single_3     essay     words  uuids     1    1     1
  niah_multikey_1   essay     words  numbers   4    1     1    three distractor needles
  niah_multikey_2   needle    words  numbers   1    1     1    the haystack is distractor needles
  niah_multikey_3   needle    uuids  uuids     1    1     1
  niah_multivalue   essay     words  numbers   1    4     1    all four values of the key
  niah_multiquery   essay     words  numbers   4    1     4    the values of all four keys

A needle reads "One of the special magic numbers for <key> is: <value>."; the prompt is RULER's
template (instruction, context, question) followed by a space and its answer prefix, in the
singular when one value is asked for. Essay needles go between sentences at depths drawn from
RULER's 40 evenly spaced depths; noise and needle haystacks are lines, and needles are inserted
before lines drawn uniformly. The haystack grows (essay words, noise lines or distractor needles)
until the prompt plus the 128 tokens to generate is as close to `length` as whole units allow.

Randomness: every sample draws from its own `random.Random`, seeded by a SHA-256 of
(task, seed, sample index); nothing uses global random state or Python's salted `hash`, so the
same arguments give the same samples in every process, and sample i does not depend on how many
samples follow it. As in RULER, where one seed serves every length, sample i of a seed carries the
same keys, values and essay depths at every length: only the haystack around them grows.

Where this differs from RULER's scripts (whose samples come from one global stream), it does so
without changing what a task asks: keys within a sample are distinct, distractor keys never equal
a planted key, no empty piece of text is joined in (RULER leaves a double space when a needle
lands at depth 0), and the haystack size is searched unit by unit rather than in steps of 500
words or 25 lines, so prompts come within one unit of `length`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import uuid
from collections.abc import Iterable
from typing import Callable

import numpy as np

from pisa_jax.train.evaluation.haystack import (
    haystack_words, load_haystack, split_sentences, word_lists)

__all__ = ["FAMILIES", "TASKS", "TOKENS_TO_GENERATE", "RulerSample", "load_haystack",
           "make_samples", "score"]

TOKENS_TO_GENERATE = 128
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {type_v} afterwards.\n{context}\nWhat are all "
            "the special magic {type_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = "The special magic {type_v} for {query} mentioned in the provided text are"
# RULER's wording when a single value is asked for ("Some ... are" -> "A ... is", "numbers" ->
# "number").
TEMPLATE_ONE = ("A special magic {type_v} is hidden within the following text. Make sure to "
                "memorize it. I will quiz you about the {type_v} afterwards.\n{context}\nWhat is "
                "the special magic {type_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX_ONE = "The special magic {type_v} for {query} mentioned in the provided text is"
# RULER's needle depths in percent: 40 evenly spaced from 0 to 100, rounded half to even.
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True)))


@dataclasses.dataclass(frozen=True)
class Task:
  """One RULER needle-in-a-haystack task: what the haystack is, what keys and values look like."""
  haystack: str            # "essay" | "noise" | "needle"
  key_type: str            # "words" | "numbers" | "uuids"
  value_type: str          # "numbers" | "uuids"
  num_keys: int = 1        # keys planted; the ones not queried are distractors
  num_values: int = 1      # values per key, each its own needle
  num_queries: int = 1     # keys asked for

  @property
  def num_needles(self) -> int:
    return self.num_keys * self.num_values


TASKS: dict[str, Task] = {
    "niah_single_1": Task("noise", "words", "numbers"),
    "niah_single_2": Task("essay", "words", "numbers"),
    "niah_single_3": Task("essay", "words", "uuids"),
    "niah_multikey_1": Task("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": Task("needle", "words", "numbers"),
    "niah_multikey_3": Task("needle", "uuids", "uuids"),
    "niah_multivalue": Task("essay", "words", "numbers", num_values=4),
    "niah_multiquery": Task("essay", "words", "numbers", num_keys=4, num_queries=4),
}

FAMILIES: dict[str, tuple[str, ...]] = {
    "single_key": ("niah_single_1", "niah_single_2", "niah_single_3"),
    "multi_key": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
    "multi_query": ("niah_multiquery",),
    "multi_value": ("niah_multivalue",),
}


@dataclasses.dataclass(frozen=True)
class RulerSample:
  """One generated sample; `len(prompt_tokens) + max_new_tokens <= length`."""
  task: str
  length: int               # the target total length in tokens (prompt + answer budget)
  prompt: str               # template with context and question, then " " + answer prefix
  prompt_tokens: list[int]  # the tokenizer's encoding of `prompt`
  answers: tuple[str, ...]  # every needle value the output must contain
  max_new_tokens: int       # RULER's tokens_to_generate
  # Where each needle sits, in the order the haystack holds them: the share of the haystack
  # (essay sentences, or lines) before it, in [0, 1].
  depths: tuple[float, ...] = ()


def score(prediction: str, answers: Iterable[str] | str) -> float:
  """RULER's string_match_all for one sample: the share of `answers` found in `prediction`,
  ignoring case. A single string counts as one answer."""
  if not isinstance(prediction, str):
    raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
  answers = (answers,) if isinstance(answers, str) else tuple(answers)
  if not answers:
    raise ValueError("answers is empty: expected at least one answer string")
  text = prediction.lower()
  return sum(1.0 for a in answers if str(a).lower() in text) / len(answers)


def make_samples(task: str, *, length: int, num_samples: int, seed: int = 0, tokenizer=None,
                 haystack: str | None = None) -> list[RulerSample]:
  """`num_samples` samples of RULER task `task` at `length` tokens (prompt + answer budget).

  tokenizer: any object with `encode(str) -> list[int]` (and `decode`); default the GPT-2 BPE of
    `pisa_jax.train.tokenizer.gpt2_encoding()`.
  haystack: the essay text for essay tasks; default `load_haystack()` (the tasks with noise or
    needle haystacks never read it).
  Raises ValueError naming `task` (with the known tasks), `length` (with the minimum the task
  needs), `num_samples` or `haystack`.
  """
  if task not in TASKS:
    raise ValueError(f"task={task!r} is not a RULER needle-in-a-haystack task; expected one of: "
                     f"{', '.join(TASKS)}")
  for name, value in (("length", length), ("num_samples", num_samples), ("seed", seed)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      raise TypeError(f"{name}={value!r}: expected an integer")
  if num_samples < 1:
    raise ValueError(f"num_samples={num_samples}: expected at least 1")
  if length < 1:
    raise ValueError(f"length={length}: expected a positive number of tokens")
  if tokenizer is None:
    from pisa_jax.train.tokenizer import gpt2_encoding
    tokenizer = gpt2_encoding()
  if not callable(getattr(tokenizer, "encode", None)):
    raise TypeError(f"tokenizer={tokenizer!r}: expected an object with encode(str) -> list[int]")
  spec = TASKS[task]
  words: tuple[str, ...] = ()
  if spec.haystack == "essay":
    if haystack is None:
      haystack = load_haystack()
    if not isinstance(haystack, str):
      raise TypeError(f"haystack must be the essay text (a str), got {type(haystack).__name__}")
    words = haystack_words(haystack)
    if not words:
      raise ValueError("haystack is empty: expected the essay text (see load_haystack)")

  length, num_samples = int(length), int(num_samples)
  drawn = [_draw_needles(spec, _rng("sample", task, seed, index)) for index in range(num_samples)]
  builds = [_builder(spec, needles, words, tokenizer, placement=("place", task, seed, index))
            for index, needles in enumerate(drawn)]
  n_min = _min_units(spec)
  minimum = max(len(build(n_min)[1]) for build in builds) + TOKENS_TO_GENERATE
  if minimum > length:
    raise ValueError(f"length={length} is too small for {task}: its template, needles and "
                     f"max_new_tokens={TOKENS_TO_GENERATE} need at least {minimum} tokens "
                     f"(the largest of these {num_samples} samples with the smallest haystack)")
  samples = []
  hint = None
  for index, (needles, build) in enumerate(zip(drawn, builds)):
    prompt, tokens, hint = _fit(build, n_min, length, hint)
    samples.append(RulerSample(task=task, length=length, prompt=prompt, prompt_tokens=tokens,
                               answers=needles.answers, max_new_tokens=TOKENS_TO_GENERATE,
                               depths=_depths(spec, needles, ("place", task, seed, index), hint)))
  return samples


def _depths(spec: Task, needles: _Needles, placement: tuple, n: int) -> tuple[float, ...]:
  """Each needle's depth in a haystack of n units, as `_builder` placed it."""
  if spec.haystack == "essay":
    # `_essay_context` puts the needles, in order, at the sorted depths.
    return tuple(d / 100 for d in sorted(needles.depths))
  spots = _rng(*placement, n).sample(range(n), len(needles.needles))
  return tuple(spot / n for spot in spots)


def _rng(*parts) -> random.Random:
  """A generator seeded by the SHA-256 of `parts`: the same in every process and Python build."""
  digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
  return random.Random(int.from_bytes(digest, "big"))


def _draw(kind: str, rng: random.Random) -> str:
  if kind == "numbers":  # seven digits
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))
  if kind == "words":    # adjective-noun
    adjectives, nouns = word_lists()
    return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
  if kind == "uuids":
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))
  raise ValueError(f"needle type {kind!r}: expected 'numbers', 'words' or 'uuids'")


@dataclasses.dataclass(frozen=True)
class _Needles:
  needles: tuple[str, ...]   # in the order they go into the haystack
  depths: tuple[int, ...]    # essay depths in percent, one per needle
  keys: tuple[str, ...]      # every planted key
  question: str              # the queried keys as the template says them
  answers: tuple[str, ...]   # values of the queried keys, in question order
  distractor_seed: int


def _draw_needles(spec: Task, rng: random.Random) -> _Needles:
  keys: list[str] = []
  values: list[list[str]] = []
  needles = []
  for _ in range(spec.num_keys):
    key = _draw(spec.key_type, rng)
    while key in keys:
      key = _draw(spec.key_type, rng)
    keys.append(key)
    values.append([])
    for _ in range(spec.num_values):
      value = _draw(spec.value_type, rng)
      while value in values[-1]:
        value = _draw(spec.value_type, rng)
      values[-1].append(value)
      needles.append(NEEDLE.format(type_v=spec.value_type, key=key, value=value))
  rng.shuffle(needles)
  depths = tuple(rng.sample(DEPTHS, len(needles)))
  asked = rng.sample(range(spec.num_keys), spec.num_queries)
  queries = [keys[i] for i in asked]
  question = (", ".join(queries[:-1]) + ", and " + queries[-1]) if len(queries) > 1 else queries[0]
  return _Needles(needles=tuple(needles), depths=depths, keys=tuple(keys), question=question,
                  answers=tuple(v for i in asked for v in values[i]),
                  distractor_seed=rng.getrandbits(64))


def _min_units(spec: Task) -> int:
  # RULER inserts line needles before distinct haystack lines, so it needs one line per needle.
  return 0 if spec.haystack == "essay" else spec.num_needles


def _builder(spec: Task, needles: _Needles, words: tuple[str, ...], tokenizer,
             placement: tuple) -> Callable[[int], tuple[str, list[int]]]:
  """prompt(n) for a haystack of n units (essay words, noise lines or distractor needles)."""
  one = spec.num_queries * spec.num_values == 1
  template, prefix = (TEMPLATE_ONE, ANSWER_PREFIX_ONE) if one else (TEMPLATE, ANSWER_PREFIX)
  type_v = spec.value_type[:-1] if one else spec.value_type
  distractors: list[str] = []
  distractor_rng = random.Random(needles.distractor_seed)

  def distractor_lines(n: int) -> list[str]:
    # One stream per sample, so the haystack of n + 1 lines extends the haystack of n lines.
    while len(distractors) < n:
      key = _draw(spec.key_type, distractor_rng)
      if key in needles.keys:
        continue
      distractors.append(NEEDLE.format(type_v=spec.value_type, key=key,
                                       value=_draw(spec.value_type, distractor_rng)))
    return distractors[:n]

  def context(n: int) -> str:
    if spec.haystack == "essay":
      return _essay_context(needles, _take_words(words, n))
    lines = [NOISE] * n if spec.haystack == "noise" else distractor_lines(n)
    # Each needle goes before a distinct line drawn uniformly (RULER's noise and needle haystacks).
    spots = _rng(*placement, n).sample(range(n), len(needles.needles))
    for spot, needle in sorted(zip(spots, needles.needles), reverse=True):
      lines.insert(spot, needle)
    return "\n".join(lines)

  built: dict[int, tuple[str, list[int]]] = {}

  def build(n: int) -> tuple[str, list[int]]:
    if n not in built:
      body = template.format(type_v=type_v, context=context(n), query=needles.question)
      prompt = body + " " + prefix.format(type_v=type_v, query=needles.question)
      built[n] = prompt, list(tokenizer.encode(prompt))
    return built[n]

  return build


def _take_words(words: tuple[str, ...], n: int) -> tuple[str, ...]:
  # Past the end of the essays the haystack starts over, as RULER does for long contexts.
  if n <= len(words):
    return words[:n]
  return (words * (n // len(words) + 1))[:n]


def _essay_context(needles: _Needles, words: tuple[str, ...]) -> str:
  """The needles between the sentences of `words`, each at its depth (RULER's essay haystack)."""
  sentences = split_sentences(" ".join(words))
  cuts = sorted(int(len(sentences) * depth / 100) for depth in needles.depths)
  pieces = []
  start = 0
  for cut, needle in zip(cuts, needles.needles):
    pieces.extend([" ".join(sentences[start:cut]), needle])
    start = cut
  pieces.append(" ".join(sentences[start:]))
  return " ".join(p for p in pieces if p)


# Interpolation steps before the search falls back to bisection (the cost is nearly linear in the
# haystack size, so interpolation lands within a unit or two in two or three steps).
_INTERPOLATION_STEPS = 8


def _fit(build: Callable[[int], tuple[str, list[int]]], n_min: int, length: int,
         hint: int | None) -> tuple[str, list[int], int]:
  """(prompt, tokens, n): the largest haystack n found with len(tokens) + 128 <= length, such that
  n + 1 units would not fit; n_min units must fit. Only sizes measured to fit are returned."""

  def cost(n: int) -> int:
    return len(build(n)[1]) + TOKENS_TO_GENERATE

  lo = n_min
  base = cost(lo)
  hi = None  # the smallest size known not to fit
  # A unit costs at least one token with any sane tokenizer; the bound stops a runaway search.
  limit = n_min + 4 * length + 16
  guess = hint if hint is not None and hint > lo else lo + 16
  steps = 0
  while hi is None or hi - lo > 1:
    if hi is None:
      n = max(guess, lo + 1)
      if n > limit:
        raise ValueError(f"tokenizer: {n} haystack units still fit in length={length} tokens; "
                         f"expected every unit to cost at least one token")
    elif steps >= _INTERPOLATION_STEPS:
      n = (lo + hi) // 2
    else:
      n = min(max(guess, lo + 1), hi - 1)
    steps += 1
    c = cost(n)
    if c <= length:
      lo = n
    else:
      hi = n
    # Tokens per unit from the smallest haystack to this one; aim the next size at the target.
    rate = max((c - base) / max(n - n_min, 1), 1e-3)
    guess = lo + int((length - cost(lo)) / rate)
    if hi is None and guess <= lo:
      guess = lo + 1
  prompt, tokens = build(lo)
  return prompt, tokens, lo

