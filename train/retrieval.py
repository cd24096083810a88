"""A long-context retrieval mixture for training: needle documents over held-out haystack text.

`data.retrieval_fraction` of the rows of every training batch are filled with needle documents
instead of windows of `data.path`. A needle document is, in GPT-2 tokens and exactly as long as
drawn (log-uniform from `data.retrieval_min_length` to `data.retrieval_max_length`, default the
row; a row's last document takes what is left):

  [preamble "\\n"]  haystack with needles planted between sentences  "\\n" question " " prefix
  " " answer "."  <|endoftext|>

The haystack is a slice of the train split of `data.retrieval_path` (a pisa-prepare-data folder of
text held out of `data.path`), or, in `data.retrieval_text_share` of the documents, of
`data.path`'s own train split, starting at a sentence, its end-of-text tokens turned into blank
lines. Four families, as RULER's (Hsieh et al., 2024), each with its own draws:

  family       keys  values per key  keys asked  haystack
  single_key   1     1               1           prose
  multi_key    2-8   1               1           prose, or (1 in 4) a ledger of distractor records
  multi_query  2-4   1               2-all       prose
  multi_value  1     2-4             1           prose; every value answered

One prose haystack in six is filler instead: one to three sentences of the haystack text repeated
to the length (the passkey-retrieval setting of Mohtashami and Jaggi, 2023, in sentences of our
own haystack, never RULER's noise sentences), where nothing but the needles differs.

Two template sets (`data.retrieval_templates`): "fixed", ten needle sentences, ten attributes and
fifteen questions; "composed", sentences built from parts (an intro, a frame, a link, a copula, a
qualifier of where the value was read), over two thousand needle sentence forms, 1,110 attribute
phrases and several thousand questions with their answer prefixes, so that a model cannot lean on
a few memorised frames and has to learn the skill itself: find the asked key, copy its value.

The templates, keys and values are this module's own and disjoint from `pisa-eval --suite ruler`
(`train.evaluation.ruler`), so that the evaluation measures retrieval, not a memorised template.
Keys are capitalised pseudo-word names ("Vorandel Kestrum"), letter-digit tags ("QX-482"),
lowercase pseudo-words, or two words of the haystack's own prose outside RULER's adjective and
noun lists ("harvest fielding", half of them hyphenated; `haystack_key_words`, of the haystack
corpus even where a document's haystack is the run's text), never RULER's adjective-noun pairs
or uuids. Values are numbers of 4-6, 8 or 9 digits, two to six groups of four hex digits
("3fa9-91bc") or pseudo-words, never seven digits or uuids. No template shares a four-word
sequence or one of RULER's telling words ("special", "magic", "mentioned", ...) with RULER's
(tests/test_replication.py checks all three).

Packed with `segment_ids` (`data.packing`): every document attends only to itself, positions
restart, and the loss on its answer tokens is weighted `data.retrieval_answer_weight`. Rows are
drawn from `np.random.default_rng([seed, split, step, 1, row])`: a resumed run, or one on another
host count, sees the same documents.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re

import numpy as np

from pisa_jax.train.data import TRAIN, TokenWindows, document_layout
from pisa_jax.train.tokenizer import EOT_TOKEN

FAMILIES = ("single_key", "multi_key", "multi_query", "multi_value")
# The version of the documents this module makes from a given seed and settings: raised with
# every change to what they hold, so that a result records which documents it trained on (the
# replication manifest's fingerprint includes it). 2: multi_value answers in document order.
# 3: no copula extends another ("is now" taught " now" after an answer prefix's "is").
# 4: a share of needles write a colon after the copula ("... equals: 4821"), which the answer
# prefixes never hold: a model learns to skip punctuation between the key and its value; and
# half the keys of two haystack words are hyphenated ("harvest-fielding").
NEEDLE_GENERATOR = 4
# The random stream of the mixture within a step (the text windows use the bare [seed, split,
# step]).
_STREAM = 1
# GPT-2's "\n\n": end-of-text tokens inside a haystack slice become a paragraph break.
_PARAGRAPH = 628
# A document keeps at least this many haystack tokens around its needles.
_MIN_HAYSTACK = 16
_LEDGER_SHARE = 0.25
_FILLER_SHARE = 1 / 6
# A filler span is the sentences ending within this many tokens of its start (at most three).
_FILLER_SPAN = 128

ATTRIBUTES = (
    ("access code", "access codes"), ("locker code", "locker codes"), ("serial", "serials"),
    ("passphrase", "passphrases"), ("ticket", "tickets"), ("badge", "badges"),
    ("room code", "room codes"), ("password", "passwords"), ("account id", "account ids"),
    ("catalogue mark", "catalogue marks"),
)
NEEDLES = (
    "The {attr} of {key} is {value}.",
    "{key} keeps {value} as the {attr}.",
    "Record for {key}: {attr} {value}.",
    "Remember that the {attr} assigned to {key} is {value}.",
    "{key} was issued the {attr} {value}.",
    "According to the ledger, {key} has {attr} {value}.",
    "The {attr} on file under {key} is {value}.",
    "For {key}, the {attr} is {value}.",
    "{key} received {value} as the {attr}.",
    "Among the entries, {key} is listed with the {attr} {value}.",
)
# (question, answer prefix): one key, one value. {where}, in most answer prefixes, is "" or a
# qualifier between the key and the answer (WHERES), so that the value is learnt to follow the
# end of the prefix rather than the key itself.
QUESTIONS_ONE = (
    ("Which {attr} was issued to {key}?", "The {attr} issued to {key}{where} is"),
    ("Give the {attr} of {key}.", "The {attr} of {key}{where} is"),
    ("Question: what {attr} does {key} have? Answer:", "{key} has the {attr}"),
    ("Look up {key} in the text above and report its {attr}.", "The {attr} of {key}{where} is"),
    ("What {attr} belongs to {key}?", "The {attr} that belongs to {key}{where} is"),
    ("What is the {attr} for {key}?", "The {attr} listed for {key}{where} reads"),
    ("Report the {attr} recorded for {key}.", "The {attr} recorded for {key}{where} reads"),
)
# Several keys asked at once (multi_query): their values in the order the keys are asked.
QUESTIONS_KEYS = (
    ("Which {attrs} were issued to {keys}?", "The {attrs} issued to {keys}{where} are"),
    ("Give the {attrs} of {keys}, in that order.", "The {attrs} of {keys}{where} are"),
    ("Look up {keys} in the text above and report their {attrs}.", "Their {attrs} are"),
    ("What are the {attrs} for {keys}?", "The {attrs} for {keys}{where} are"),
)
# One key with several values (multi_value): all of them.
QUESTIONS_VALUES = (
    ("Which {attrs} were issued to {key}?", "The {attrs} issued to {key}{where} are"),
    ("Give every {attr} of {key}.", "The {attrs} of {key}{where} are"),
    ("{key} holds several {attrs}. List them all.", "The {attrs} of {key} are"),
    ("Which {attrs} does {key} hold?", "The {attrs} held by {key}{where} are"),
)
# Half the answer prefixes with a {where} get one of these.
WHERES = (
    " in the text above", " according to the passage", " as recorded earlier",
    " in this document", " given above", " that the passage records",
    " named earlier in the text", " listed in the document above", " from the records above",
)
PREAMBLES = (
    "Read the passage below and keep track of the {attrs} it records.",
    "The following document lists some {attrs} among other things. A question comes at the end.",
    "Below is a long text with a few {attrs} scattered through it.",
)
# data.retrieval_templates="composed" (the module docstring). Every part keeps to the rules of the
# fixed lists (tests/test_replication.py draws thousands of sentences and checks them).
ATTRIBUTE_HEADS = (
    ("code", "codes"), ("key", "keys"), ("pin", "pins"), ("serial", "serials"),
    ("password", "passwords"), ("passphrase", "passphrases"), ("token", "tokens"),
    ("id", "ids"), ("tag", "tags"), ("label", "labels"), ("ticket", "tickets"),
    ("badge", "badges"), ("mark", "marks"), ("reference", "references"),
    ("identifier", "identifiers"), ("figure", "figures"), ("value", "values"),
    ("entry", "entries"), ("cipher", "ciphers"), ("combination", "combinations"),
    ("codeword", "codewords"), ("designation", "designations"), ("handle", "handles"),
    ("callsign", "callsigns"), ("stamp", "stamps"), ("voucher", "vouchers"),
    ("permit", "permits"), ("locator", "locators"), ("checksum", "checksums"),
    ("signature", "signatures"),
)
ATTRIBUTE_MODIFIERS = (
    "", "", "", "", "secret", "private", "personal", "backup", "spare", "reserve", "primary",
    "master", "official", "temporary", "current", "registered", "confidential", "unique", "daily",
    "access", "locker", "room", "account", "vault", "gate", "door", "safe", "server", "network",
    "parking", "library", "membership", "shipping", "billing", "tracking", "booking", "staff",
    "storage", "archive", "login",
)
# "the {attr} <link> {key}"
LINKS = ("of", "for", "issued to", "assigned to", "belonging to", "recorded for", "listed for",
         "given to", "linked to", "kept for", "registered to", "on file for", "held by",
         "tied to", "set for", "attached to")
# No copula extends another ("is" / "is now"): an answer prefix ends with one, and the word
# after it must be the value. With "is now" drawn as often as "is", a model trained here answered
# RULER's "... is" with " now" in nearly every sample (teacher-forced hits 0%).
COPULAS = ("is", "reads", "equals", "was set to", "has been recorded as",
           "was listed as", "stands at", "remains", "was given as")
# The share of composed needles with a copula that write a colon after it (3 of the 9 frames
# have one: about 10% of all composed needles). Dense models trained without any
# answered RULER's "... is" (its needles read "... is: V") by copying prose after "is" in the
# haystack (" blue."), teacher-forced hits 13% at 1K (H100, 2026-12-06).
COLON_SHARE = 0.3
HAS = ("has", "holds", "keeps", "uses", "was given", "received", "carries", "was issued", "got",
       "owns")
INTROS = ("", "", "", "", "Note that ", "For the record, ", "Incidentally, ", "Please note: ",
          "As it happens, ", "Keep in mind that ", "One detail: ", "By the way, ",
          "It is worth knowing that ", "Also, ")
NEEDLE_FRAMES = (
    "the {attr} {link} {key} {copula} {value}.",
    "{key} {has} the {attr} {value}.",
    "{key} {has} {value} as {det} {attr}.",
    "for {key}, the {attr} {copula} {value}.",
    "{key}'s {attr} {copula} {value}.",
    "{Attr} {link} {key}: {value}.",
    "the {attr} {value} belongs to {key}.",
    "the {attr} {value} goes with {key}.",
    "entry for {key}: {attr} {value}.",
)
# Where the value was read, between the key and the answer: participle, place, and what follows.
WHERE_PARTICIPLES = ("stated", "cited", "recorded", "named", "listed", "noted", "written", "given",
                     "found", "shown", "reported", "quoted", "included", "set down", "referred to")
# Places read as one thing (the preambles take only these) and as several.
PLACES_ONE = ("text", "passage", "document", "material", "article", "report", "excerpt",
              "context", "story", "input")
PLACES_MANY = ("notes", "records", "pages", "lines")
WHERE_DETERMINERS = ("the", "the given", "the long")
# These already say where: no tail after them.
WHERE_DETERMINERS_PLACED = ("the above", "the earlier", "the preceding")
WHERE_TAILS = ("", "", "", " above", " earlier", " you just read", " before this question")
# (question, answer prefix), the single value of one key; {link}, {copula}, {where} are drawn.
COMPOSED_ONE = (
    ("What is the {attr} {link} {key}?", "The {attr} {link} {key}{where} {copula}"),
    ("Which {attr} was {linkp} {key}?", "The {attr} {linkp} {key}{where} {copula}"),
    ("Give the {attr} {link} {key}.", "The {attr} {link} {key}{where} {copula}"),
    ("Report the {attr} {link} {key}.", "The {attr} {link} {key}{where} {copula}"),
    ("Tell me the {attr} {link} {key}.", "The {attr} {link} {key}{where} {copula}"),
    ("What is {key}'s {attr}?", "{key}'s {attr}{where} {copula}"),
    ("Look up {key} and give its {attr}.", "The {attr} of {key}{where} {copula}"),
    ("Find the {attr} {link} {key}.", "Answer: the {attr} {link} {key}{where} {copula}"),
    ("Question: what {attr} does {key} have? Answer:", "{key} has the {attr}"),
    ("Which {attr} does {key} hold?", "{key}{where} holds the {attr}"),
    ("Name the {attr} {link} {key}.", "The {attr}{where} {copula}"),
)
COMPOSED_KEYS = (
    ("What are the {attrs} {link} {keys}?", "The {attrs} {link} {keys}{where} are"),
    ("Give the {attrs} {link} {keys}, in that order.", "The {attrs} {link} {keys}{where} are"),
    ("Report the {attrs} of {keys}.", "In order, the {attrs}{where} are"),
    ("Look up {keys} and give their {attrs}.", "Their {attrs}{where} are"),
)
COMPOSED_VALUES = (
    ("List each of the {attrs} {link} {key}.", "The {attrs} {link} {key}{where} are"),
    ("Give every {attr} {link} {key}.", "Every {attr} {link} {key}{where}:"),
    ("{key} has several {attrs}. List them all.", "The {attrs} of {key}{where} are"),
    ("Which {attrs} does {key} hold?", "{key}{where} holds the {attrs}"),
)
# Participles for "Which {attr} was {linkp} {key}?" (the links that read as one).
LINKS_PARTICIPLE = ("issued to", "assigned to", "recorded for", "listed for", "given to",
                    "registered to", "kept for", "set for")
COMPOSED_PREAMBLES = (
    "{read} the {place} below and keep track of the {attrs} it records.",
    "{read} the {place} below, noting every {attr} in it.",
    "{read} the {place} below; a few {attrs} are scattered through it.",
    "{read} the {place} below carefully. A question about one of its {attrs} follows.",
    "The {place} below lists some {attrs} among other things. Answer the question after it.",
)
PREAMBLE_VERBS = ("Read", "Go through", "Study", "Look over", "Scan")
KEY_FORMATS = ("name", "tag", "word", "words")
# The share of "words" keys joined by a hyphen: a key of several tokens with punctuation inside,
# as keys often are ("harvest-fielding"), in words of the haystack and never RULER's lists.
HYPHEN_SHARE = 0.5
# "words" keys are drawn only from a haystack that offers at least this many key words.
MIN_KEY_WORDS = 100
VALUE_FORMATS = ("digits", "hex", "word")
# Numbers of every length but RULER's seven digits.
DIGIT_LENGTHS = (4, 5, 6, 8, 9)

_ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "pr", "r",
           "s", "sk", "st", "t", "th", "tr", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "", "l", "m", "n", "r", "s", "x", "th", "nd", "rk")
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
_HEX = "0123456789abcdef"


def _pick(rng: np.random.Generator, options):
  return options[int(rng.integers(len(options)))]


def pseudo_word(rng: np.random.Generator, syllables: int) -> str:
  """A pronounceable made-up word of `syllables` consonant-vowel(-consonant) syllables; at three
  syllables practically never an English word (keys and values use three)."""
  return "".join(_pick(rng, _ONSETS) + _pick(rng, _VOWELS) + _pick(rng, _CODAS)
                 for _ in range(syllables))


def draw_key(rng: np.random.Generator, kind: str, words: tuple[str, ...] = ()) -> str:
  if kind == "name":    # "Vorandel Kestrum"
    return " ".join(pseudo_word(rng, 3).capitalize() for _ in range(2))
  if kind == "tag":     # "QX-482"
    letters = "".join(_pick(rng, _LETTERS) for _ in range(int(rng.integers(2, 4))))
    return f"{letters}-{int(rng.integers(10, 10_000))}"
  if kind == "word":    # "taxoumirk"
    return pseudo_word(rng, 3)
  if kind == "words":   # "harvest fielding" or "harvest-fielding"
    if len(words) < 2:
      raise ValueError(f"key kind 'words' needs at least two key words, got {len(words)}")
    first, second = rng.choice(len(words), 2, replace=False)
    joint = "-" if rng.random() < HYPHEN_SHARE else " "
    return f"{words[first]}{joint}{words[second]}"
  raise ValueError(f"key kind {kind!r}: expected one of {KEY_FORMATS}")


def draw_value(rng: np.random.Generator, kind: str) -> str:
  if kind == "digits":  # 4-6, 8 or 9 digits, never RULER's 7
    n = _pick(rng, DIGIT_LENGTHS)
    return str(int(rng.integers(10 ** (n - 1), 10 ** n)))
  if kind == "hex":     # "3fa9-91bc" to six groups of four, never a uuid's 8-4-4-4-12
    groups = int(rng.integers(2, 7))
    return "-".join("".join(_pick(rng, _HEX) for _ in range(4)) for _ in range(groups))
  if kind == "word":    # "skoumavex"
    return pseudo_word(rng, 3)
  raise ValueError(f"value kind {kind!r}: expected one of {VALUE_FORMATS}")


class FixedTemplates:
  """The fixed lists above: 10 attributes, 10 needle sentences, 7 + 4 + 4 questions."""

  name = "fixed"

  def attribute(self, rng) -> tuple[str, str]:
    return _pick(rng, ATTRIBUTES)

  def needle(self, rng, attr: str) -> str:
    """A needle sentence with {key} and {value} left to fill."""
    return _pick(rng, NEEDLES).replace("{attr}", attr)

  def question(self, rng, family: str) -> tuple[str, str]:
    """(question, answer prefix) with {attr}, {attrs}, {key}, {keys} and {where} left to fill."""
    return _pick(rng, {"multi_query": QUESTIONS_KEYS, "multi_value": QUESTIONS_VALUES}
                 .get(family, QUESTIONS_ONE))

  def where(self, rng) -> str:
    return _pick(rng, WHERES) if rng.random() < 0.5 else ""

  def preamble(self, rng) -> str:
    return _pick(rng, PREAMBLES)


def _link_copula(rng, links: tuple[str, ...] = LINKS) -> tuple[str, str]:
  """A link and a copula that never read "... for {key} is {value}" (RULER's needle)."""
  link, copula = _pick(rng, links), _pick(rng, COPULAS)
  if link.endswith("for") and copula.split()[0] == "is":
    copula = "reads"
  return link, copula


class ComposedTemplates(FixedTemplates):
  """Sentences composed from the parts above (the block after PREAMBLES)."""

  name = "composed"

  def attribute(self, rng) -> tuple[str, str]:
    modifier = _pick(rng, ATTRIBUTE_MODIFIERS)
    head, heads = _pick(rng, ATTRIBUTE_HEADS)
    lead = modifier + " " if modifier else ""
    return lead + head, lead + heads

  def needle(self, rng, attr: str) -> str:
    link, copula = _link_copula(rng)
    if rng.random() < COLON_SHARE:
      copula += ":"
    frame = _pick(rng, NEEDLE_FRAMES)
    intro = _pick(rng, INTROS)
    if frame.startswith(("entry", "{Attr}")) and not intro.endswith(": "):
      intro = ""  # a record reads "Entry for X: ..." or "Please note: Entry for X: ...", no more
    text = frame.format(attr=attr, Attr=attr[0].upper() + attr[1:], link=link, copula=copula,
                        has=_pick(rng, HAS), det=_pick(rng, ("the", "its")),
                        key="{key}", value="{value}")
    if not intro or intro.endswith(": "):
      text = text[0].upper() + text[1:]
    return intro + text

  def question(self, rng, family: str) -> tuple[str, str]:
    pairs = {"multi_query": COMPOSED_KEYS, "multi_value": COMPOSED_VALUES}.get(family,
                                                                               COMPOSED_ONE)
    question, prefix = _pick(rng, pairs)
    # The prefix holds a link or a participle before its copula, each kept off RULER's needle.
    link, copula = _link_copula(rng, LINKS_PARTICIPLE if "{linkp}" in prefix else LINKS)
    fill = dict(link=link, linkp=link, copula=copula)
    keep = {name: "{" + name + "}" for name in ("attr", "attrs", "key", "keys", "where")}
    return question.format(**fill, **keep), prefix.format(**fill, **keep)

  def where(self, rng) -> str:
    if rng.random() < 0.4:
      return ""
    participle = _pick(rng, WHERE_PARTICIPLES)
    many = rng.random() < 0.25
    place = _pick(rng, PLACES_MANY if many else PLACES_ONE)
    this = ("these", "those") if many else ("this", "that")
    determiner = _pick(rng, WHERE_DETERMINERS + this + WHERE_DETERMINERS_PLACED)
    tail = "" if determiner in WHERE_DETERMINERS_PLACED else _pick(rng, WHERE_TAILS)
    return f" {participle} in {determiner} {place}{tail}"

  def preamble(self, rng) -> str:
    frame = _pick(rng, COMPOSED_PREAMBLES)
    return frame.format(read=_pick(rng, PREAMBLE_VERBS), place=_pick(rng, PLACES_ONE),
                        attr="{attr}", attrs="{attrs}")


TEMPLATES = {t.name: t for t in (FixedTemplates(), ComposedTemplates())}
TEMPLATE_SETS = tuple(TEMPLATES)


def template_set(name: str) -> FixedTemplates:
  """The template set `name` (data.retrieval_templates)."""
  if name not in TEMPLATES:
    raise ValueError(f"data.retrieval_templates={name!r}: expected one of {TEMPLATE_SETS}")
  return TEMPLATES[name]


def join_items(items) -> str:
  """"a", "a and b", "a, b and c"."""
  items = list(items)
  return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@dataclasses.dataclass(frozen=True)
class NeedleDocument:
  """One needle document: `tokens` int32 `[L]` ending with <|endoftext|>, its answer tokens at
  `tokens[answer[0]:answer[1]]` (the values and the closing period), and what was drawn."""

  tokens: np.ndarray
  answer: tuple[int, int]
  family: str
  keys: tuple[str, ...]        # every planted key
  asked: tuple[str, ...]       # the keys the question asks, in its order
  answers: tuple[str, ...]     # the values answered, in the answer's order
  needles: tuple[str, ...]     # the planted sentences, in document order
  depths: tuple[float, ...]    # where each needle went, as a fraction of the haystack
  question: str
  ledger: bool
  filler: bool = False         # the haystack is a few sentences repeated
  from_text: bool = False      # the haystack is the run's text, not its haystack corpus


@dataclasses.dataclass(frozen=True)
class _Draw:
  """A document's text before tokenisation."""
  family: str
  keys: tuple[str, ...]
  asked: tuple[str, ...]
  answers: tuple[str, ...]
  needles: tuple[str, ...]
  question: str             # question, " ", answer prefix
  answer: str               # " " + values + "."
  preamble: str | None
  ledger: bool
  attr: str
  key_kind: str
  value_kind: str


def _distinct(rng, draw, kind, n: int, avoid=(), **kw) -> list[str]:
  out: list[str] = []
  while len(out) < n:
    item = draw(rng, kind, **kw)
    if item not in out and item not in avoid:
      out.append(item)
  return out


def _draw_text(rng: np.random.Generator, family: str, size: int, key_formats: tuple[str, ...],
               words: tuple[str, ...], t: FixedTemplates = TEMPLATES["fixed"]) -> _Draw:
  """The keys, values and sentences of one document; `size` is its number of keys (multi_key,
  multi_query) or values (multi_value), ignored for single_key."""
  attr, attrs = t.attribute(rng)
  key_kind, value_kind = _pick(rng, key_formats), _pick(rng, VALUE_FORMATS)
  n_keys = size if family in ("multi_key", "multi_query") else 1
  n_values = size if family == "multi_value" else 1
  keys = _distinct(rng, draw_key, key_kind, n_keys, words=words)
  values = _distinct(rng, draw_value, value_kind, n_keys * n_values)
  pairs = [(keys[i // n_values], values[i]) for i in range(len(values))]
  needles = [t.needle(rng, attr).format(key=k, value=v) for k, v in pairs]
  order = rng.permutation(len(needles))
  needles = [needles[i] for i in order]
  if family == "multi_query":
    # Two to all of the keys, in a random order.
    asked_idx = [int(i) for i in rng.choice(n_keys, int(rng.integers(2, n_keys + 1)),
                                            replace=False)]
  else:
    asked_idx = [int(rng.integers(n_keys))]
  asked = [keys[i] for i in asked_idx]
  question, prefix = t.question(rng, family)
  if family == "multi_query":
    answers = [values[i] for i in asked_idx]
  elif family == "multi_value":
    # In the order the needles stand in the document (one key: needle i holds value i).
    answers = [values[i] for i in order]
  else:
    answers = [values[asked_idx[0]]]
  where = t.where(rng)
  fields = dict(attr=attr, attrs=attrs, key=asked[0], keys=join_items(asked), where=where)
  preamble = t.preamble(rng).format(**fields) if rng.random() < 0.5 else None
  ledger = family == "multi_key" and rng.random() < _LEDGER_SHARE
  return _Draw(family=family, keys=tuple(keys), asked=tuple(asked), answers=tuple(answers),
               needles=tuple(needles),
               question=question.format(**fields) + " " + prefix.format(**fields),
               answer=" " + join_items(answers) + ".", preamble=preamble, ledger=ledger,
               attr=attr, key_kind=key_kind, value_kind=value_kind)


_SIZES = {"single_key": (1, 1), "multi_key": (2, 8), "multi_query": (2, 4), "multi_value": (2, 4)}


def haystack_key_words(haystack: np.ndarray, encoding, *, sample: int = 2_000_000,
                       min_count: int = 2) -> tuple[str, ...]:
  """Lowercase words of 4 to 12 letters seen at least `min_count` times in the first `sample`
  tokens of the haystack, less every word of RULER's adjective and noun lists (its word keys are
  pairs of those), sorted."""
  from pisa_jax.train.evaluation.haystack import word_lists

  try:
    adjectives, nouns = word_lists()
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(f"the retrieval mixture keeps RULER's key words out of its own: "
                              f"{e}") from None
  tokens = np.asarray(haystack[:sample])
  text = encoding.decode(tokens[tokens != EOT_TOKEN].tolist())
  counts = collections.Counter(re.findall(r"\b[a-z]{4,12}\b", text))
  banned = set(adjectives) | set(nouns)
  return tuple(sorted(w for w, c in counts.items() if c >= min_count and w not in banned))


@functools.cache
def sentence_ends(encoding) -> np.ndarray:
  """bool `[vocab]`: the tokens whose text ends a sentence (., ! or ?, then any closing quotes or
  brackets); a needle goes after one of them."""
  ends = np.zeros(EOT_TOKEN + 1, bool)
  for token in range(EOT_TOKEN):
    text = encoding.decode_single_token_bytes(token).rstrip(b"\"')]")
    ends[token] = text.endswith((b".", b"!", b"?"))
  return ends


# Last-resort single_key draws before a length counts as too short: about 1% of composed
# single_key draws need more than 112 tokens, so eight fresh draws all fail at 128 tokens with
# odds near 1e-16.
_SINGLE_KEY_DRAWS = 8


class NeedleMaker:
  """Needle documents over one haystack: `make(rng, length, family)`.

  haystack: uint16 or int tokens of held-out text (documents closed by <|endoftext|>), at least
  as long as the longest document asked for.
  """

  def __init__(self, haystack: np.ndarray, encoding=None, *, templates: str = "fixed",
               text: np.ndarray | None = None, text_share: float = 0.0):
    if not 0 <= text_share <= 1:
      raise ValueError(f"{text_share=} must be in [0, 1]")
    if text_share and text is None:
      raise ValueError(f"{text_share=} needs the text tokens to draw those haystacks from")
    self.templates = template_set(templates)
    self.text, self.text_share = text, text_share
    if encoding is None:
      from pisa_jax.train.tokenizer import gpt2_encoding
      encoding = gpt2_encoding()
    self.haystack = haystack
    self.encoding = encoding
    self.ends = sentence_ends(encoding)
    self.key_words = haystack_key_words(haystack, encoding)
    # A haystack too small to offer key words of its own draws the other formats only (the
    # run's record lists the formats in use).
    self.key_formats = tuple(k for k in KEY_FORMATS
                             if k != "words" or len(self.key_words) >= MIN_KEY_WORDS)

  def encode(self, text: str) -> list[int]:
    return self.encoding.encode_ordinary(text)

  def make(self, rng: np.random.Generator, length: int, family: str) -> NeedleDocument:
    """A document of exactly `length` tokens. When the family's draw leaves fewer than 16
    haystack tokens, it retries with fewer keys or values, then without its preamble, then as
    up to `_SINGLE_KEY_DRAWS` fresh single_key draws (composed sentences vary in length); a
    length too short even for those raises ValueError."""
    if family not in FAMILIES:
      raise ValueError(f"family={family!r}: expected one of {FAMILIES}")
    low, high = _SIZES[family]
    size = int(rng.integers(low, high + 1))
    tries = ([(family, s) for s in range(size, low - 1, -1)]
             + [("single_key", 1)] * _SINGLE_KEY_DRAWS)
    for fam, s in tries:
      draw = _draw_text(rng, fam, s, self.key_formats, self.key_words, self.templates)
      for preamble in dict.fromkeys((draw.preamble, None)):
        draw = dataclasses.replace(draw, preamble=preamble)
        doc = self._build(rng, draw, length)
        if doc is not None:
          return doc
    raise ValueError(f"length={length} is too short for a needle document: its question, "
                     f"needle and answer leave fewer than {_MIN_HAYSTACK} haystack tokens")

  def _build(self, rng, draw: _Draw, length: int) -> NeedleDocument | None:
    # No draw at a share of 0: the documents of NEEDLE_GENERATOR 4 stay as they were.
    from_text = bool(self.text_share) and rng.random() < self.text_share
    source = self.text if from_text else self.haystack
    head = self.encode(draw.preamble + "\n") if draw.preamble else []
    tail = self.encode("\n" + draw.question)
    answer = self.encode(draw.answer)
    lead = "\n" if draw.ledger else " "
    needles = [self.encode(lead + n) for n in draw.needles]
    n_hay = length - 1 - len(head) - len(tail) - len(answer) - sum(map(len, needles))
    if n_hay < _MIN_HAYSTACK:
      return None
    filler = not draw.ledger and rng.random() < _FILLER_SHARE
    if draw.ledger:
      hay, spots = self._ledger(rng, draw, n_hay, source)
    else:
      hay = self._filler(rng, n_hay, source) if filler else self._prose(rng, n_hay, source)
      # Between sentences: after a sentence-ending token, or at either end.
      spots = np.unique(np.concatenate([[0, n_hay], np.flatnonzero(self.ends[hay]) + 1]))
    # Each needle at a uniform depth, moved to the nearest place between sentences (or records).
    wanted = np.sort(rng.random(len(needles))) * n_hay
    nearest = np.clip(np.searchsorted(spots, wanted), 1, len(spots) - 1)
    below = spots[nearest - 1]
    above = spots[nearest]
    at = np.where(wanted - below <= above - wanted, below, above)
    pieces, start = [np.asarray(head, np.int32)], 0
    for cut, needle in zip(at, needles):
      pieces += [hay[start:cut], np.asarray(needle, np.int32)]
      start = cut
    pieces += [hay[start:], np.asarray(tail, np.int32)]
    answer_start = sum(len(p) for p in pieces)
    pieces += [np.asarray(answer + [EOT_TOKEN], np.int32)]
    tokens = np.concatenate(pieces).astype(np.int32)
    assert len(tokens) == length, (len(tokens), length)
    return NeedleDocument(
        tokens=tokens, answer=(answer_start, answer_start + len(answer)), family=draw.family,
        keys=draw.keys, asked=draw.asked, answers=draw.answers, needles=draw.needles,
        depths=tuple(float(x) / n_hay for x in at), question=draw.question, ledger=draw.ledger,
        filler=filler, from_text=from_text)

  def _prose(self, rng, n: int, source: np.ndarray) -> np.ndarray:
    """n tokens of `source` (the haystack or the text) from a random sentence start, end-of-text
    tokens as paragraph breaks."""
    last = len(source) - n
    if last < 1:
      where = ("the run's text (data.path)" if source is self.text
               else "the haystack (data.retrieval_path)")
      raise ValueError(f"{where} holds {len(source)} tokens, fewer than the {n + 1} a "
                       f"document of this length needs")
    offset = int(rng.integers(0, last))
    look = np.asarray(source[offset:offset + min(64, last - offset)], np.int32)
    ends = np.flatnonzero(self.ends[look])
    if ends.size:
      offset += int(ends[0]) + 1
    hay = np.asarray(source[offset:offset + n], np.int32)
    return np.where(hay == EOT_TOKEN, _PARAGRAPH, hay)

  def _filler(self, rng, n: int, source: np.ndarray) -> np.ndarray:
    """n tokens of one to three haystack sentences repeated (a span cut at _FILLER_SPAN tokens
    where no sentence ends sooner)."""
    span = self._prose(rng, min(n, _FILLER_SPAN), source)
    ends = np.flatnonzero(self.ends[span]) + 1
    if ends.size:
      span = span[:ends[min(int(rng.integers(3)), ends.size - 1)]]
    return np.resize(span, n)

  def _ledger(self, rng, draw: _Draw, n: int,
              source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """n tokens of distractor records (other keys, the same attribute and formats), a prose
    fragment first to make up the length; the places between records."""
    lines: list[list[int]] = []
    total = 0
    used = set(draw.keys)
    while True:
      key = _distinct(rng, draw_key, draw.key_kind, 1, avoid=used, words=self.key_words)[0]
      used.add(key)
      line = self.encode("\n" + self.templates.needle(rng, draw.attr).format(
          key=key, value=draw_value(rng, draw.value_kind)))
      if total + len(line) > n:
        break
      lines.append(line)
      total += len(line)
    fragment = self._prose(rng, n - total, source) if n > total else np.zeros(0, np.int32)
    bounds = len(fragment) + np.cumsum([0] + [len(x) for x in lines])
    hay = np.concatenate([fragment] + [np.asarray(x, np.int32) for x in lines])
    return hay.astype(np.int32), np.unique(np.concatenate([[0], bounds]))


class RetrievalMixture:
  """Training batches of `text` windows with `fraction` of the rows replaced by needle documents
  (the module docstring): the same arrays as `TokenWindows` with packing, `[A, B_local, T]`."""

  def __init__(self, text: TokenWindows, haystack_path: str, *, fraction: float,
               min_length: int, answer_weight: float, max_length: int | None = None,
               encoding=None, templates: str = "fixed", text_share: float = 0.0):
    if not text.packing:
      raise ValueError("the retrieval mixture needs packed text windows (data.packing=true)")
    if not 0 < fraction <= 1:
      raise ValueError(f"fraction={fraction} must be in (0, 1]")
    haystack = TokenWindows(haystack_path, "train", seq_len=text.seq_len, global_batch=1,
                            accum=1, seed=0, vocab_size=EOT_TOKEN + 1, packing=True)
    self.text = text
    self.maker = NeedleMaker(haystack.tokens, encoding, templates=templates,
                             text=text.tokens if text_share else None, text_share=text_share)
    self.haystack_tokens = len(haystack.tokens)
    row = text.seq_len + 1
    if max_length is not None and not 2 * min_length <= max_length <= row:
      raise ValueError(f"max_length={max_length} must be None or in [2 x min_length = "
                       f"{2 * min_length}, {row}] (the row's tokens)")
    self.min_length, self.answer_weight = min_length, answer_weight
    self.max_length = row if max_length is None else max_length
    total = text.accum * text.global_batch
    # A whole number of rows per step, at least one.
    self.rows_per_step = max(1, round(fraction * total))
    self.token_fraction = self.rows_per_step / total

  def documents(self, step: int, row: int) -> list[NeedleDocument]:
    """The documents filling global row `row` (micro-batch-major) of step `step`: seq_len + 1
    tokens (inputs and the last target)."""
    rng = np.random.default_rng([self.text.seed, TRAIN, step, _STREAM, row])
    left, docs = self.text.seq_len + 1, []
    log_lo, log_hi = math.log(self.min_length), math.log(self.max_length)
    while left:
      length = min(left, int(math.exp(rng.uniform(log_lo, log_hi))))
      if left - length < self.min_length:
        # Too little would be left for a document: this one takes the rest of the row, or,
        # where that is over max_length, leaves exactly min_length (max >= 2 min: both fit).
        length = left if left <= self.max_length else left - self.min_length
      docs.append(self.maker.make(rng, length, _pick(rng, FAMILIES)))
      left -= length
    return docs

  def chosen_rows(self, step: int) -> np.ndarray:
    """The global rows (micro-batch-major) of step `step` that hold needle documents."""
    rng = np.random.default_rng([self.text.seed, TRAIN, step, _STREAM])
    total = self.text.accum * self.text.global_batch
    return np.sort(rng.choice(total, self.rows_per_step, replace=False))

  def batch(self, step: int) -> dict[str, np.ndarray]:
    base = self.text.batch(step)
    windows = np.concatenate([base["inputs"], base["targets"][..., -1:]], axis=-1)
    answers = np.zeros(windows.shape, bool)
    g, rows = self.text.global_batch, self.text.rows
    for row in self.chosen_rows(step):
      micro, j = divmod(int(row), g)
      if not rows.start <= j < rows.stop:
        continue
      at = 0
      for doc in self.documents(step, int(row)):
        windows[micro, j - rows.start, at:at + len(doc.tokens)] = doc.tokens
        answers[micro, j - rows.start, at + doc.answer[0]:at + doc.answer[1]] = True
        at += len(doc.tokens)
    inputs = windows[..., :-1]
    out = {"inputs": inputs, "targets": windows[..., 1:]}
    out.update(document_layout(inputs, self.text.meta["eot"]))
    # An answer token at window position p is the target of input position p - 1.
    out["weights"] = np.where(answers[..., 1:], out["weights"] * self.answer_weight,
                              out["weights"]).astype(np.float32)
    return out

  def describe(self) -> dict:
    """What the mixture is, for a run's record."""
    return {"rows_per_step": self.rows_per_step, "token_fraction": self.token_fraction,
            "min_length": self.min_length, "max_length": self.max_length,
            "answer_weight": self.answer_weight, "templates": self.maker.templates.name,
            "haystack_tokens": self.haystack_tokens, "text_share": self.maker.text_share,
            "families": list(FAMILIES),
            "key_formats": list(self.maker.key_formats), "key_words": len(self.maker.key_words)}
