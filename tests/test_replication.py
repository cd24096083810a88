"""benchmarks/replication.py and its data: the manifest and its one-line errors, the retrieval
mixture's documents and batches (and their disjointness from RULER's templates), RULER's needle
depths, resuming past done runs, the summary from stand-in results, and a toy manifest run end to
end on the CPU (both stages and every evaluation; `slow`, with a two-stage smoke run in CI).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from benchmarks import _replication_report as report
from benchmarks import replication as rep
from pisa_jax.train.tokenizer import EOT_TOKEN, gpt2_bpe_path

needs_bpe = pytest.mark.skipif(
    gpt2_bpe_path() is None,
    reason="gpt2.tiktoken absent: pip install --no-deps openai-whisper==20250625",
)

# The CPU pilot: 2 layers of d 64 over GPT-2's vocabulary, C = 16, stages of 256 and 512 tokens.
TOY = """
[backbone]
num_layers = 2
d_model = 64
mlp_dim = 128
num_heads = 4
num_kv_heads = 2
head_dim = 16
block_size = 16

[data]
text = "{root}/text"
haystack = "{root}/haystack"
ruler_dir = "{root}"
retrieval_fraction = 0.5
retrieval_min_length = 128

[[stage]]
name = "pretrain"
seq_len = 256
top_k = 4
rope_base = 10000.0
batch = 4
steps = 3
peak_lr = 1e-3
loss_chunk = 128
log_every = 1
[stage.eval]
ppl = [256]
selection = [256]

[[stage]]
name = "cpt"
seq_len = 512
top_k = 8
rope_base = 80000.0
batch = 2
steps = 2
peak_lr = 3e-4
loss_chunk = 128
log_every = 1
[stage.eval]
ppl = [256, 512]
ruler = [512]
mqar = [256]
induction = [512]

[eval]
batch_size = 8
ppl_samples = 2
ruler_samples = 1
mqar_samples = 2
mqar_pairs = [16]
selection_samples = 1
selection_beam_factors = [1.0]

[[method]]
name = "dense"
seeds = [0]
[[method]]
name = "pisa"
seeds = [0, 1]
[[method]]
name = "nsa"
seeds = [0]

[summary]
pretrain = "pretrain"
cpt = "cpt"
"""
_WORDS = ("the a river stone house garden light evening morning road market window letter "
          "child old new quiet long small bright").split()


def _manifest(tmp_path: Path, text: str = TOY, root: Path | None = None) -> Path:
  tmp_path.mkdir(parents=True, exist_ok=True)
  path = tmp_path / "toy.toml"
  path.write_text(text.replace("{root}", str(root or tmp_path / "data")))
  return path


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
  """Text and haystack corpora of made-up sentences, and a stand-in RULER essay file."""
  import random

  from pisa_jax.train.prepare_data import write_corpus

  if gpt2_bpe_path() is None:
    pytest.skip("gpt2.tiktoken absent")
  root = tmp_path_factory.mktemp("data")

  def docs(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
      yield " ".join(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 12))).capitalize()
                     + "." for _ in range(rng.randint(5, 30)))

  write_corpus(docs(300, 0), root / "text", val_fraction=0.2, seed=0, sources=["toy"])
  write_corpus(docs(100, 1), root / "haystack", val_fraction=0.1, seed=0, sources=["toy"])
  (root / "ruler").mkdir()
  (root / "ruler" / "essays.txt").write_text("\n\n".join(" ".join(docs(1, i)) for i in range(40)))
  return root


# ----------------------------------------------------------------------------- manifest


def test_the_shipped_manifest_gives_every_method_the_same_config_but_attention():
  m = rep.load_manifest(rep.DEFAULT_MANIFEST)
  assert [r.name for r in m.runs][:5] == ["dense-s0", "pisa-s0", "bsa-s0", "pisa1-s0", "pisa2-s0"]
  assert {r.name for r in m.runs} >= {"dense-s1", "pisa-s1", "nsa-s0", "hils-s0"}
  pre, cpt = m.stage(m.summary["pretrain"]), m.stage(m.summary["cpt"])
  assert (pre.seq_len, pre.top_k, pre.rope_base) == (4096, 8, 10_000.0)
  assert (cpt.seq_len, cpt.top_k, cpt.rope_base) == (16_384, 32, 80_000.0)
  assert m.backbone["block_size"] == 64
  for index, _ in enumerate(m.stages):
    configs = {k: rep.stage_config(m, rep.Run(k, 0), index, init_from="prev", devices=1).to_dict()
               for k in ("dense", "pisa", "pisa1", "pisa2", "bsa")}
    for kind, c in configs.items():
      assert c["model"].pop("attention") == kind
      c["model"].pop("attention_implementation")
      assert c == configs["dense"]
  cfg = rep.stage_config(m, rep.Run("pisa", 1), 1, init_from="runs/x/pretrain", devices=1)
  assert cfg.train.init_from == "runs/x/pretrain" and cfg.train.lr_schedule == "cosine"
  assert cfg.train.warmup_fraction == 0.1 and cfg.data.packing and cfg.data.retrieval_fraction
  assert cfg.train.seed == 1 + 1000  # the run's seed, its own windows per stage


@pytest.mark.parametrize("edit, message", [
    (("top_k = 4", "top_k = 2"), "stage 'pretrain': model.top_k=2 must be an int >= 3"),
    (("steps = 3", 'steps = "3"'), "stage[0].steps='3' must be an integer"),
    (("peak_lr = 1e-3\n", "peak_lr = 1e-3\nbogus = 1\n"), "stage[0].bogus is not a field"),
    (("seq_len = 256\n", ""), "stage[0].seq_len is missing"),
    (("ruler = [512]", "ruler = [1024]"), "eval.ruler length 1024 exceeds the stage's seq_len=512"),
    (("ppl = [256, 512]", "ppl = [512, 256]"), "eval.ppl=[512, 256] must be increasing"),
    (("selection = [256]", "selection = [8]"), "below backbone.block_size=16"),
    (("selection = [256]", "selection = [256]\nmixture = [16]"),
     "eval.mixture length 16 must be >= 128"),
    (('name = "cpt"', 'name = "pretrain"'), "stage name 'pretrain' is used twice"),
    (('cpt = "cpt"', 'cpt = "cpt16k"'), "summary.cpt='cpt16k' names no stage"),
    (("seeds = [0, 1]", "seeds = []"), "method[1].seeds is empty"),
    (("seeds = [0, 1]", "seeds = [-1]"), "method[1].seeds=[-1] must be a list of integers >= 0"),
    (("retrieval_fraction = 0.5", "retrieval_fraction = 1.5"), "retrieval_fraction=1.5 must be"),
    (("retrieval_fraction = 0.5", 'retrieval_fraction = 0.5\nretrieval_templates = "mixed"'),
     "data.retrieval_templates='mixed': expected 'fixed' or 'composed'"),
    (("retrieval_fraction = 0.5", "retrieval_fraction = 0.5\nretrieval_text_share = 1.5"),
     "data.retrieval_text_share=1.5 must be in [0, 1]"),
    (("mqar_pairs = [16]", "mqar_pairs = [128]"), "no eval.mqar_pairs fits"),
    (("[summary]", "[sumary]"), "unknown section 'sumary'"),
])
def test_bad_manifest_fields_are_one_line_errors(tmp_path, capsys, edit, message):
  old, new = edit
  assert old in TOY
  path = _manifest(tmp_path, TOY.replace(old, new, 1))
  assert rep.main(["--manifest", str(path), "--list"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("replication: ") and message in err, err


# ----------------------------------------------------------------------------- the mixture


@pytest.fixture(scope="module", params=["fixed", "composed"])
def maker(request):
  from pisa_jax.train.retrieval import NeedleMaker
  from pisa_jax.train.tokenizer import gpt2_encoding

  if gpt2_bpe_path() is None:
    pytest.skip("gpt2.tiktoken absent")
  encoding = gpt2_encoding()
  sentences = " ".join(f"Sentence {i} tells of the {_WORDS[i % len(_WORDS)]}." for i in range(3000))
  tokens = np.array(encoding.encode_ordinary(sentences) + [EOT_TOKEN] * 3, np.uint16)
  return NeedleMaker(np.tile(tokens, 2), encoding, templates=request.param)


@needs_bpe
@pytest.mark.parametrize("family", ["single_key", "multi_key", "multi_query", "multi_value"])
def test_needle_documents_are_well_formed(maker, family):
  from pisa_jax.train.retrieval import join_items

  enc = maker.encoding
  for i, length in enumerate([128, 200, 700, 3000] * 4):
    doc = maker.make(np.random.default_rng([7, i]), length, family)
    t = doc.tokens
    assert t.dtype == np.int32 and len(t) == length
    assert t[-1] == EOT_TOKEN and (t[:-1] != EOT_TOKEN).all()
    text = enc.decode(t[:-1].tolist())
    # The answer tokens are the values in the answer's order, then the period.
    assert enc.decode(t[doc.answer[0]:doc.answer[1]].tolist()) == f" {join_items(doc.answers)}."
    assert doc.answer[1] == length - 1
    assert text.endswith(doc.question + f" {join_items(doc.answers)}.")
    for needle in doc.needles:
      assert needle in text
    assert len(set(doc.keys)) == len(doc.keys) and set(doc.asked) <= set(doc.keys)
    assert all(0 <= d <= 1 for d in doc.depths) and list(doc.depths) == sorted(doc.depths)
    # The question comes after every needle.
    assert max(text.index(n) for n in doc.needles) < text.rindex(doc.question)
    if doc.family == "multi_value":
      assert len(doc.keys) == 1 and len(doc.answers) == len(doc.needles) >= 2
    elif doc.family == "multi_query":
      assert len(doc.asked) >= 2 and len(doc.answers) == len(doc.asked)
    elif doc.family == "multi_key":
      assert len(doc.keys) >= 2 and len(doc.answers) == 1
    if length >= 700:
      assert doc.family == family  # only short documents fall back to fewer needles
    # Each answer is the value a needle gives its asked key; several values of one key are
    # answered in the order their needles stand in the document.
    def holding(value, key):
      word = re.compile(rf"(?<![\w-]){re.escape(value)}(?![\w-])")
      return [n for n in doc.needles if word.search(n) and key in n]

    asked = doc.asked if doc.family == "multi_query" else doc.asked * len(doc.answers)
    places = []
    for value, key in zip(doc.answers, asked, strict=True):
      found = holding(value, key)
      assert len(found) == 1, (value, key, doc.needles)
      places.append(text.index(found[0]))
    if doc.family == "multi_value":
      assert places == sorted(places), (doc.answers, doc.needles)


@needs_bpe
def test_a_text_share_draws_haystacks_from_the_text(maker):
  from pisa_jax.train.retrieval import NeedleMaker

  enc = maker.encoding
  # A text of other sentences: each document's haystack is one source's, or the other's.
  text = np.array(enc.encode_ordinary(" ".join(
      f"Line {i} of the manual lists option {i % 97}." for i in range(3000))) + [EOT_TOKEN],
      np.uint16)
  templates = maker.templates.name
  half = NeedleMaker(maker.haystack, enc, templates=templates, text=text, text_share=0.5)
  none = NeedleMaker(maker.haystack, enc, templates=templates, text=text, text_share=0.0)
  counts = {True: 0, False: 0}
  for i in range(40):
    rng = [11, i]
    doc = half.make(np.random.default_rng(rng), 600, "single_key")
    words = enc.decode(doc.tokens[:-1].tolist())
    counts[doc.from_text] += 1
    if not doc.ledger:
      assert ("of the manual lists option" in words) == doc.from_text
      assert ("tells of the" in words) != doc.from_text
    # A share of 0 draws nothing more: the documents are those of a maker without text.
    plain = maker.make(np.random.default_rng(rng), 600, "single_key")
    np.testing.assert_array_equal(none.make(np.random.default_rng(rng), 600, "single_key").tokens,
                                  plain.tokens)
    assert not plain.from_text
  assert counts[True] >= 10 and counts[False] >= 10, counts
  with pytest.raises(ValueError, match="text_share=0.5 needs the text tokens"):
    NeedleMaker(maker.haystack, enc, text_share=0.5)
  with pytest.raises(ValueError, match=r"text_share=1.5 must be in \[0, 1\]"):
    NeedleMaker(maker.haystack, enc, text=text, text_share=1.5)


@needs_bpe
def test_filler_haystacks_repeat_a_few_sentences(maker):
  enc, fillers = maker.encoding, 0
  for i in range(60):
    doc = maker.make(np.random.default_rng([8, i]), 1000, "single_key")
    text = enc.decode(doc.tokens[:-1].tolist())
    # The haystack without its needle and question; the fixture's sentences are all distinct.
    hay = text[:text.rindex(doc.question)].replace(" " + doc.needles[0], "", 1)
    sentences = [x for x in re.split(r"(?<=\.)\s+", hay.strip()) if x]
    # The first two may be a preamble's, the last is cut short.
    distinct = len(set(sentences[2:-1]))
    if doc.filler:
      fillers += 1
      assert len(sentences) > 30 and 1 <= distinct <= 3, sentences[:6]
    else:
      assert distinct > 30, sentences[:6]
  assert 3 <= fillers <= 20  # one prose haystack in six


@needs_bpe
def test_short_documents_fall_back_and_too_short_ones_raise(maker):
  families = set()
  for seed in range(20):
    doc = maker.make(np.random.default_rng(seed), 128, "multi_query")
    assert len(doc.tokens) == 128 and len(doc.asked) == len(doc.answers)
    families.add(doc.family)
  assert "multi_query" in families
  # Below the shortest length a run may set (128), every family still fits: composed
  # sentences vary in length, and a long draw is redrawn.
  from pisa_jax.train.retrieval import FAMILIES

  rng = np.random.default_rng(1)
  for family in FAMILIES:
    for _ in range(200):
      assert len(maker.make(rng, 112, family).tokens) == 112
  with pytest.raises(ValueError, match="length=40 is too short"):
    maker.make(np.random.default_rng(0), 40, "single_key")


def _ngrams(text: str, n: int = 4) -> set:
  words = re.sub(r"\{[a-z_]+\}", " slot ", text.lower())
  words = re.findall(r"[a-z]+", words)
  return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


_TELLING = {"special", "magic", "memorize", "quiz", "mentioned", "provided", "hidden", "uuid",
            "uuids", "number", "numbers", "afterwards"}


def _assert_disjoint_from_rulers(ours: list[str]) -> None:
  """No four-word sequence of RULER's texts (slots read as one word) and none of its telling
  words in any of `ours`."""
  from pisa_jax.train.evaluation import ruler

  theirs = [ruler.NEEDLE, ruler.NOISE, ruler.TEMPLATE, ruler.ANSWER_PREFIX, ruler.TEMPLATE_ONE,
            ruler.ANSWER_PREFIX_ONE]
  rulers = set().union(*map(_ngrams, theirs))
  for template in ours:
    assert not _ngrams(template) & rulers, (template, _ngrams(template) & rulers)
    assert not _TELLING & set(re.findall(r"[a-z]+", template.lower())), template


def test_composed_templates_are_disjoint_from_rulers():
  from pisa_jax.train import retrieval

  t = retrieval.template_set("composed")
  rng = np.random.default_rng(0)
  ours, needles, questions = [], set(), set()
  for _ in range(4000):
    # The attribute as a slot too, as RULER's "special magic {type_v}" is one: the frames alone.
    needle = t.needle(rng, "{attr}")
    family = retrieval.FAMILIES[int(rng.integers(4))]
    question, prefix = t.question(rng, family)
    where = t.where(rng)
    # An answer prefix as the model reads it, with its answer after it.
    ours += [needle, t.preamble(rng), question.replace("{where}", where),
             prefix.replace("{where}", where) + " {value}.", *t.attribute(rng)]
    needles.add(needle)
    questions.add((question, prefix))
  _assert_disjoint_from_rulers(ours)
  # The point of composing: far more frames than the fixed lists' 10 needles and 15 questions,
  # each with any of 37 x 30 attribute phrases.
  assert len(needles) > 800 and len(questions) > 300, (len(needles), len(questions))
  assert len({a for pair in retrieval.ATTRIBUTE_HEADS for a in pair}) == 60
  with pytest.raises(ValueError, match="data.retrieval_templates='mixed'"):
    retrieval.template_set("mixed")


@pytest.mark.parametrize("name", ["fixed", "composed"])
def test_the_word_after_an_answer_prefix_is_always_the_value(name):
  """No answer prefix is another one cut short ("... is" / "... is now"): a model that has seen
  both answers a prefix ending in "is" with " now" half the time, and RULER's prefix ends so."""
  from pisa_jax.train import retrieval

  t = retrieval.template_set(name)
  rng = np.random.default_rng(0)
  prefixes = set()
  for _ in range(20000):
    family = retrieval.FAMILIES[int(rng.integers(4))]
    _, prefix = t.question(rng, family)
    prefixes.add(prefix.format(attr="A", attrs="As", key="K", keys="K and L",
                               where=t.where(rng)))
  cut_short = {(p[:i], p) for p in prefixes for i, c in enumerate(p) if c == " "
               and p[:i] in prefixes}
  assert not cut_short, sorted(cut_short)[:5]
  # The root of it: no copula extends another, and in a needle the value follows the copula.
  assert not [(a, b) for a in retrieval.COPULAS for b in retrieval.COPULAS
              if b.startswith(a + " ")]
  assert all("{copula} {value}" in f for f in retrieval.NEEDLE_FRAMES if "{copula}" in f)
  assert not [p for p in prefixes if p.endswith(tuple(f" {c}:" for c in retrieval.COPULAS))]
  if name == "composed":
    assert len(prefixes) > 300, len(prefixes)
    # A share of needles put a colon between the copula and the value, which no answer prefix
    # holds: the value is found past punctuation.
    needles = [t.needle(rng, "A") for _ in range(4000)]
    with_colon = [n for n in needles if any(f" {c}: {{value}}" in n for c in retrieval.COPULAS)]
    # COLON_SHARE of the needles whose frame has a copula (3 of 9 frames).
    assert 0.07 < len(with_colon) / len(needles) < 0.13, len(with_colon)


def test_training_templates_keys_and_values_are_disjoint_from_rulers():
  from pisa_jax.train import retrieval

  # Questions, and answer prefixes with their answer after them.
  ours = list(retrieval.NEEDLES) + list(retrieval.PREAMBLES) + [
      (question + suffix).replace("{where}", where)
      for pair in retrieval.QUESTIONS_ONE + retrieval.QUESTIONS_KEYS + retrieval.QUESTIONS_VALUES
      for question, suffix in zip(pair, ("", " {value}.")) for where in ("",) + retrieval.WHERES]
  ours += [a for pair in retrieval.ATTRIBUTES for a in pair]
  _assert_disjoint_from_rulers(ours)
  rng = np.random.default_rng(0)
  uuid = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
  for _ in range(500):
    for kind in retrieval.VALUE_FORMATS:
      value = retrieval.draw_value(rng, kind)
      assert not re.fullmatch(r"\d{7}", value) and not uuid.match(value), value
    for kind in retrieval.KEY_FORMATS:
      key = retrieval.draw_key(rng, kind, words=("quietly", "harvesting"))
      # RULER's keys: adjective-noun pairs of its word lists, seven-digit numbers, uuids.
      # Hyphenated pairs are only ever of haystack words (the test below).
      assert not re.fullmatch(r"[a-z]+-[a-z]+", key) or set(key.split("-")) == {
          "quietly", "harvesting"}, key
      assert not uuid.match(key) and not re.fullmatch(r"\d{7}", key), key


@needs_bpe
def test_word_keys_come_from_the_haystack_less_rulers_word_lists():
  from pisa_jax.train import retrieval
  from pisa_jax.train.tokenizer import gpt2_encoding

  haystack = pytest.importorskip("pisa_jax.train.evaluation.haystack")
  try:
    adjectives, nouns = haystack.word_lists()
  except ModuleNotFoundError:
    pytest.skip("wonderwords absent")
  encoding = gpt2_encoding()
  rng = np.random.default_rng(2)
  own = sorted({retrieval.pseudo_word(rng, 3) for _ in range(150)})
  ruler_words = list(adjectives[:50]) + list(nouns[:50])
  # Each word twice (key words must recur), RULER's words many times, one word only once.
  text = " ".join(own * 2 + ruler_words * 3 + ["solitaryword"]) + "."
  tokens = np.array(encoding.encode_ordinary(text) + [EOT_TOKEN], np.uint16)
  words = retrieval.haystack_key_words(tokens, encoding)
  assert set(words) == {w for w in own if 4 <= len(w) <= 12}
  maker = retrieval.NeedleMaker(np.tile(tokens, 4), encoding)
  assert "words" in maker.key_formats
  seen = hyphenated = 0
  for i in range(60):
    doc = maker.make(np.random.default_rng([3, i]), 400, "multi_key")
    for key in doc.keys:
      parts = re.split(r"[ -]", key)
      if len(parts) == 2 and all(p in words for p in parts):
        seen += 1
        hyphenated += "-" in key
  assert seen > 0 and 0 < hyphenated < seen, (seen, hyphenated)


def test_pseudo_words_are_not_rulers_key_words():
  from pisa_jax.train import retrieval

  haystack = pytest.importorskip("pisa_jax.train.evaluation.haystack")
  try:
    adjectives, nouns = haystack.word_lists()
  except ModuleNotFoundError:
    pytest.skip("wonderwords absent")
  words = set(adjectives) | set(nouns)
  rng = np.random.default_rng(1)
  drawn = {retrieval.pseudo_word(rng, 3) for _ in range(3000)}
  assert not drawn & words, sorted(drawn & words)[:10]


@needs_bpe
def test_mixture_batches(toy_data):
  from pisa_jax.train.data import TokenWindows, document_layout
  from pisa_jax.train.retrieval import RetrievalMixture

  def mixture(index=0, count=1, weight=3.0):
    text = TokenWindows(toy_data / "text", "train", seq_len=512, global_batch=4, accum=2, seed=5,
                        vocab_size=50_257, packing=True, process_index=index,
                        process_count=count)
    return RetrievalMixture(text, str(toy_data / "haystack"), fraction=0.4, min_length=128,
                            answer_weight=weight)

  mix = mixture()
  assert mix.rows_per_step == 3 and mix.token_fraction == 3 / 8
  b = mix.batch(7)
  assert {k: v.shape for k, v in b.items()} == {k: (2, 4, 512) for k in
                                                ("inputs", "targets", "weights", "segment_ids",
                                                 "positions")}
  np.testing.assert_array_equal(b["inputs"][..., 1:], b["targets"][..., :-1])
  layout = document_layout(b["inputs"], EOT_TOKEN)
  for key in ("segment_ids", "positions"):
    np.testing.assert_array_equal(b[key], layout[key])
  rows = mix.chosen_rows(7)
  flat = {k: v.reshape(8, 512) for k, v in b.items()}
  for row in range(8):
    heavy = flat["weights"][row] == 3.0
    if row in rows:
      docs = mix.documents(7, row)
      window = np.concatenate([d.tokens for d in docs])
      np.testing.assert_array_equal(window[:-1], flat["inputs"][row])
      # The answer tokens (targets) and nothing else carry the answer weight.
      want = np.zeros(513, bool)
      at = 0
      for d in docs:
        want[at + d.answer[0]:at + d.answer[1]] = True
        at += len(d.tokens)
      np.testing.assert_array_equal(heavy, want[1:])
    else:
      assert not heavy.any()
  # Deterministic, and the same rows whatever the number of hosts.
  again = mixture().batch(7)
  for key in b:
    np.testing.assert_array_equal(b[key], again[key])
  halves = [mixture(i, 2).batch(7) for i in range(2)]
  np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves], axis=1),
                                b["inputs"])
  assert not np.array_equal(mixture().batch(8)["inputs"], b["inputs"])
  assert mix.describe()["templates"] == "fixed"


def test_the_config_chooses_the_template_set(toy_data):
  """data.retrieval_templates reaches the training batches and the held-out mixture alike."""
  from pisa_jax.configs import Config, DataConfig, ModelConfig, TrainConfig, validate
  from pisa_jax.train import data as train_data

  def config(templates, text_share=0.0):
    return Config(
        model=ModelConfig(vocab_size=50_257),
        data=DataConfig(source="tokens", path=str(toy_data / "text"), packing=True,
                        retrieval_fraction=0.5, retrieval_path=str(toy_data / "haystack"),
                        retrieval_min_length=128, retrieval_templates=templates,
                        retrieval_text_share=text_share),
        train=TrainConfig(seq_len=512, per_device_batch=2, grad_accum=1))

  # data.retrieval_text_share reaches the maker, which draws from the run's train text.
  windows = train_data.make_batches(config("composed", 1.0), "train", global_batch=2, accum=1)
  assert windows.describe()["text_share"] == 1.0
  docs = [d for step in range(2) for row in windows.chosen_rows(step)
          for d in windows.documents(step, int(row))]
  assert docs and all(d.from_text for d in docs)
  assert windows.maker.text is windows.text.tokens  # the text's memmap itself, never a copy
  with pytest.raises(ValueError, match=r"data.retrieval_text_share=-0.1 must be in \[0, 1\]"):
    validate(config("fixed", -0.1))
  without = config("fixed", 0.5)
  without = dataclasses.replace(without, data=dataclasses.replace(without.data,
                                                                  retrieval_fraction=0.0))
  with pytest.raises(ValueError, match=r"data.retrieval_text_share=0.5 needs "
                                       r"data.retrieval_fraction > 0"):
    validate(without)

  questions = {}
  for templates in ("fixed", "composed"):
    cfg = config(templates)
    validate(cfg)
    windows = train_data.make_batches(cfg, "train", global_batch=2, accum=1)
    assert windows.describe()["templates"] == templates
    questions[templates] = {d.question for step in range(4) for row in windows.chosen_rows(step)
                            for d in windows.documents(step, int(row))}
  # Each fixed question (with its answer prefix) is one of the fixed lists' frames; composed
  # ones mostly are not.
  from pisa_jax.train import retrieval

  frames = [re.compile(re.sub(r"\\\{(attrs?|keys?|where)\\\}", ".*",
                              re.escape(f"{question} {prefix}")))
            for question, prefix in retrieval.QUESTIONS_ONE + retrieval.QUESTIONS_KEYS
            + retrieval.QUESTIONS_VALUES]

  def fixed_frame(question):
    return any(f.fullmatch(question) for f in frames)

  assert questions["fixed"] and all(map(fixed_frame, questions["fixed"]))
  assert questions["composed"] and not all(map(fixed_frame, questions["composed"]))


@needs_bpe
def test_mixture_documents_keep_to_their_lengths(toy_data):
  """Every document of a row is min_length to max_length tokens (the last one too: it takes the
  rest of the row, or leaves exactly min_length), and the row is filled exactly."""
  from pisa_jax.train.data import TokenWindows
  from pisa_jax.train.retrieval import RetrievalMixture

  text = TokenWindows(toy_data / "text", "train", seq_len=1023, global_batch=4, accum=1, seed=5,
                      vocab_size=50_257, packing=True)
  for max_length, shortest_max in [(None, 1024), (300, 300), (256, 256)]:
    mix = RetrievalMixture(text, str(toy_data / "haystack"), fraction=1.0, min_length=128,
                           answer_weight=1.0, max_length=max_length)
    lengths = [len(d.tokens) for step in range(6) for row in range(4)
               for d in mix.documents(step, row)]
    assert min(lengths) >= 128 and max(lengths) <= shortest_max, (max_length, lengths)
    assert sum(lengths) == 6 * 4 * 1024
    assert mix.describe()["max_length"] == shortest_max
  with pytest.raises(ValueError, match=re.escape("max_length=200 must be None or in [2 x "
                                                 "min_length = 256, 1024]")):
    RetrievalMixture(text, str(toy_data / "haystack"), fraction=1.0, min_length=128,
                     answer_weight=1.0, max_length=200)


@needs_bpe
def test_training_batches_mix_and_held_out_batches_do_not(toy_data):
  from pisa_jax.configs import apply_overrides, get_config, validate
  from pisa_jax.train.data import TokenWindows, make_batches
  from pisa_jax.train.retrieval import RetrievalMixture

  sets = ["data.source=tokens", f"data.path={toy_data / 'text'}", "data.packing=true",
          "model.vocab_size=50257", "train.seq_len=256", "data.retrieval_fraction=0.5",
          f"data.retrieval_path={toy_data / 'haystack'}", "data.retrieval_min_length=128"]
  config = validate(apply_overrides(get_config("tiny"), sets))
  assert isinstance(make_batches(config, "train", global_batch=2, accum=1), RetrievalMixture)
  assert isinstance(make_batches(config, "val", global_batch=2, accum=1), TokenWindows)
  for bad, message in [("data.packing=false", "data.packing=true"),
                       ("data.retrieval_path=none", "data.retrieval_path must name"),
                       ("data.retrieval_min_length=64", "retrieval_min_length=64 must be in"),
                       ("data.retrieval_max_length=200", "retrieval_max_length=200 must be None "
                                                         "or in [2 x data.retrieval_min_length"),
                       ("data.retrieval_max_length=512", "train.seq_len=256"),
                       ("model.vocab_size=1000", "model.vocab_size=1000 must be >= 50257")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      validate(apply_overrides(config, [bad]))


def test_brown_samples_read_as_plain_text():
  from pisa_jax.train.corpora import brown_text

  tagged = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ./.\n"
            "\tIt/pps cost/vbd 1/2/cd of/in it/ppo (/( about/rb )/) ;/. yes/rb ?/.\n\n\n"
            "\tNew/jj paragraph/nn ./.\n")
  assert brown_text(tagged) == ('The jury said "no evidence" was found. It cost 1/2 of it (about);'
                                ' yes?\nNew paragraph.')


@needs_bpe
def test_ruler_samples_say_where_their_needles_are():
  pytest.importorskip("wonderwords")
  from pisa_jax.train.evaluation import ruler

  for s in ruler.make_samples("niah_single_1", length=1024, num_samples=4, seed=3):
    (depth,) = s.depths
    lines = s.prompt.split("\n")[1:-1]  # the noise lines and the needle, in order
    spot = next(i for i, line in enumerate(lines) if line.startswith("One of the special"))
    assert depth == spot / (len(lines) - 1)
  essay = " ".join(f"Sentence {i} is here." for i in range(2000))
  for s in ruler.make_samples("niah_multikey_1", length=2048, num_samples=2, seed=0,
                              haystack=essay):
    assert len(s.depths) == 4 and list(s.depths) == sorted(s.depths)
    body = s.prompt.split("\n", 1)[1].rsplit("\n", 1)[0]
    where = [m.start() / len(body) for m in re.finditer("One of the special", body)]
    assert np.allclose(where, s.depths, atol=0.05)


# ----------------------------------------------------------------------------- resume


def _fake_record(m, run: rep.Run, *, status="complete", fingerprint=None, **numbers) -> dict:
  """A complete result of `run` shaped like run_one's, holding `numbers`."""
  loss, ppl = numbers.get("loss", 3.0), numbers.get("ppl", 30.0)
  single, avg = numbers.get("single", 0.9), numbers.get("avg", 0.6)
  recall = numbers.get("recall", {"bsa": 0.8, "pisa1": 0.79, "pisa2": 0.82, "pisa": 0.85,
                                   "exact": 0.9})
  families = [{"family": f, "length": n, "score": single if f == "single_key" else avg}
              for f in report.FAMILIES for n in (256, 512)]
  records = [{"task": "niah_single_1", "family": "single_key", "length": 512, "index": i,
              "score": float(i % 2), "depths": [i / 4], "new_tokens": 3, "prediction": "x"}
             for i in range(4)]
  pre = {"stage": "pretrain", "params": 6.5e6, "final_loss": loss + 0.5, "tokens": 3072,
         "tokens_per_step": 1024, "train_seconds": 5.0, "tokens_per_s": 200.0, "truncated": False,
         "passes": {"text": 0.1, "haystack": 0.2}, "loss_curve": [[1, 10.0], [2, loss + 0.5]],
         "eval": {"ppl": {"rows": [{"length": 256, "ppl": ppl + 5}]}}}
  if run.method == "dense":
    pre["eval"]["selection"] = {
        "top_k": [4], "source": {"windows": 1},
        "rows": [{"length": 256, "top_k": 4, "selector": s, "beam": 4, "recall": r,
                  "captured_mass": r - 0.1, "mass_ratio": 0.99} for s, r in recall.items()]}
  cpt = {"stage": "cpt", "params": 6.5e6, "final_loss": loss, "tokens": 2048,
         "tokens_per_step": 1024, "train_seconds": 5.0, "tokens_per_s": 200.0, "truncated": False,
         "passes": {"text": 0.1, "haystack": 0.2}, "loss_curve": [[1, 9.0], [2, loss]],
         "eval": {"ppl": {"rows": [{"length": 256, "ppl": ppl}, {"length": 512, "ppl": ppl}]},
                  "ruler": {"families": families, "average": (single + 3 * avg) / 4,
                            "records": records, "answer_scores": [
                                {"family": f, "length": n, "samples": 2, "nll": 1.0,
                                 "hit": numbers.get("hit", 0.5)}
                                for f in ("single_key", "multi_key") for n in (256, 512)]},
                  "mqar": {"rows": [{"pairs": 16, "length": 256, "accuracy": 0.5}]},
                  "induction": {"rows": [{"length": 512, "copy_accuracy": numbers.get("copy", 0.5),
                                          "score": 2.0}]}}}
  return {"benchmark": "replication", "run": run.name, "method": run.method, "seed": run.seed,
          "status": status, "fingerprint": fingerprint or m.fingerprint(run.method), "commit": "abc",
          "jax": "0.11.2", "jaxlib": "0.11.2", "device": "1 x cpu", "date": "2026-12-04T00:00:00Z",
          "settings": {}, "notes": [], "rows": [pre, cpt], "data": {}, "wall_seconds": 10.0}


def _write(folder: Path, record: dict) -> None:
  folder.mkdir(parents=True, exist_ok=True)
  (folder / f"{record['run']}.json").write_text(json.dumps(record))


def _without_nsa(monkeypatch):
  """A build without the nsa kind: its runs are unavailable (their rows stay pending)."""
  from pisa_jax.models import config

  monkeypatch.setattr(config, "ATTENTION_KINDS",
                      tuple(k for k in config.ATTENTION_KINDS if k != "nsa"))


def test_done_runs_are_skipped_and_the_next_ones_run(tmp_path, capsys, monkeypatch):
  _without_nsa(monkeypatch)
  path = _manifest(tmp_path)
  m = rep.load_manifest(path)
  results, out = tmp_path / "results", tmp_path / "out"
  _write(results, _fake_record(m, rep.Run("dense", 0)))
  _write(out, _fake_record(m, rep.Run("pisa", 0)))
  _write(results, _fake_record(m, rep.Run("pisa", 1), fingerprint="0123"))
  ran = []
  monkeypatch.setattr(rep, "run_one", lambda m, run, **kw: ran.append(run.name))
  common = ["--manifest", str(path), "--results", str(results), "--out", str(out)]
  assert rep.main(common + ["--list"]) == 0
  listed = dict(line.split()[:2] for line in capsys.readouterr().out.splitlines())
  assert listed == {"dense-s0": "done", "pisa-s0": "done", "nsa-s0": "unavailable",
                    "pisa-s1": "stale"}
  assert rep.main(common + ["--run", "dense-s0"]) == 0
  assert rep.main(common + ["--method", "pisa", "--seed", "0"]) == 0
  assert ran == [] and "done" in capsys.readouterr().out
  assert rep.main(common + ["--next", "5"]) == 0
  assert ran == ["pisa-s1"]  # the stale one; nsa waits for its attention kind
  assert rep.main(common + ["--run", "dense-s0", "--force"]) == 0
  assert ran == ["pisa-s1", "dense-s0"]
  _write(out, _fake_record(m, rep.Run("pisa", 1), status="failed"))
  assert rep.status(m, rep.Run("pisa", 1), [results, out])[0] == "incomplete"
  capsys.readouterr()
  assert rep.main(common + ["--run", "nsa-s0"]) == 2
  assert "model.attention='nsa' is not an attention kind" in capsys.readouterr().err


def test_a_time_limit_starts_no_run_that_would_not_fit(tmp_path, capsys, monkeypatch):
  """--next N --time-limit S: after each run, the next starts only while more than the longest
  run's time is left of S; exit 3 says runs are left."""
  _without_nsa(monkeypatch)
  path = _manifest(tmp_path)
  # main's start, then per run: the check, its start, its end.
  clock = iter([0.0, 0.0, 0.0, 40.0, 40.0, 40.0, 80.0, 80.0])
  monkeypatch.setattr(rep, "_clock", lambda: next(clock, 80.0))
  ran = []
  monkeypatch.setattr(rep, "run_one", lambda m, run, **kw: ran.append(run.name))
  common = ["--manifest", str(path), "--results", str(tmp_path / "results")]
  # Start 0; dense-s0 0 -> 40 s; 60 s left >= 40: pisa-s0 40 -> 80; 20 s left < 40: stop.
  assert rep.main(common + ["--next", "5", "--time-limit", "100"]) == 3
  assert ran == ["dense-s0", "pisa-s0"]
  assert "stopping before pisa-s1: 20 s of --time-limit left, and a run here took 40 s" in (
      capsys.readouterr().out)
  for bad in (["--next", "1", "--time-limit", "0"], ["--run", "dense-s0", "--time-limit", "9"]):
    with pytest.raises(SystemExit):
      rep.main(common + bad)
    assert "--time-limit" in capsys.readouterr().err
  for n in ("0", "-1"):
    assert rep.main(common + ["--next", n]) == 2
    assert f"--next {n} must be >= 1" in capsys.readouterr().err


# A third stage whose dense steps fit the wall time pisa's took (the 64K stage's `match_wall`).
LONG = """
[[stage]]
name = "long"
methods = ["pisa", "dense"]
match_wall = "pisa"
seq_len = 256
top_k = 8
rope_base = 160000.0
batch = 2
steps = 2
peak_lr = 1e-4
log_every = 1
"""


def test_a_stage_for_some_methods_leaves_the_others_results_done(tmp_path, monkeypatch):
  m = rep.load_manifest(_manifest(tmp_path))
  longer = rep.load_manifest(_manifest(tmp_path / "x", TOY.replace("\n[eval]", LONG + "\n[eval]",
                                                                   1)))
  assert longer.fingerprint("nsa") == m.fingerprint("nsa")
  assert longer.fingerprint("pisa") != m.fingerprint("pisa")
  assert longer.fingerprint("dense") not in (m.fingerprint("dense"), longer.fingerprint("pisa"))
  # Budgets that change no finished result change no fingerprint; a hyper-parameter does.
  assert rep.load_manifest(_manifest(tmp_path / "y", TOY.replace(
      "log_every = 1", "log_every = 2").replace("peak_lr = 1e-3", "peak_lr = 1e-3\nmax_seconds"
                                               " = 60.0"))).fingerprint("pisa") == (
      m.fingerprint("pisa"))
  assert rep.load_manifest(_manifest(tmp_path / "z", TOY.replace(
      "peak_lr = 1e-3", "peak_lr = 2e-3"))).fingerprint("pisa") != m.fingerprint("pisa")
  # The templates: the default "fixed" spelt out keeps the fingerprint, "composed" changes it.
  for name, same in (("fixed", True), ("composed", False)):
    edited = TOY.replace("retrieval_fraction = 0.5",
                         f'retrieval_fraction = 0.5\nretrieval_templates = "{name}"', 1)
    assert edited != TOY
    other = rep.load_manifest(_manifest(tmp_path / name, edited))
    assert (other.fingerprint("pisa") == m.fingerprint("pisa")) == same, name
  # A field added later: at its default (the documents as before it) it keeps the fingerprint.
  for share, same in (("0.0", True), ("0.5", False)):
    edited = TOY.replace("retrieval_fraction = 0.5",
                         f"retrieval_fraction = 0.5\nretrieval_text_share = {share}", 1)
    other = rep.load_manifest(_manifest(tmp_path / f"share{share}", edited))
    assert (other.fingerprint("pisa") == m.fingerprint("pisa")) == same, share
  # So does a new version of the code that makes the needle documents.
  from pisa_jax.train import retrieval

  before = m.fingerprint("pisa")
  monkeypatch.setattr(retrieval, "NEEDLE_GENERATOR", retrieval.NEEDLE_GENERATOR + 1)
  assert m.fingerprint("pisa") != before


def test_a_run_matching_another_runs_wall_time_waits_for_it(tmp_path, capsys, monkeypatch):
  _without_nsa(monkeypatch)
  path = _manifest(tmp_path, TOY.replace("\n[eval]", LONG + "\n[eval]", 1))
  m = rep.load_manifest(path)
  assert m.stage("long").match_wall == "pisa"
  ran = []
  monkeypatch.setattr(rep, "run_one", lambda m, run, **kw: ran.append(run.name))
  common = ["--manifest", str(path), "--results", str(tmp_path / "results")]
  assert rep.main(common + ["--next", "5"]) == 0
  assert ran == ["pisa-s0", "pisa-s1"]
  assert "dense-s0 waits for pisa-s0" in capsys.readouterr().out
  assert rep.main(common + ["--run", "dense-s0"]) == 2
  assert "matches a stage's wall time to pisa-s0" in capsys.readouterr().err
  # pisa-s0 stopped at its max_seconds: --next leaves it, and says how to free dense-s0.
  truncated = _fake_record(m, rep.Run("pisa", 0))
  truncated["rows"][0]["truncated"] = True
  _write(tmp_path / "results", truncated)
  assert rep.main(common + ["--list"]) == 0
  assert re.search(r"pisa-s0 +truncated", capsys.readouterr().out)
  assert rep.main(common + ["--next", "1"]) == 0
  assert ran[-1] == "pisa-s1"
  assert ("dense-s0 waits for pisa-s0, which stopped at its max_seconds: raise it and run "
          "`--run pisa-s0 --force`") in capsys.readouterr().out
  _write(tmp_path / "results", _fake_record(m, rep.Run("pisa", 0)))
  assert rep.main(common + ["--next", "1"]) == 0
  assert ran[-1] == "dense-s0"
  bad = TOY.replace("\n[eval]", LONG.replace('match_wall = "pisa"', 'match_wall = "bsa"')
                    + "\n[eval]", 1)
  assert rep.main(["--manifest", str(_manifest(tmp_path, bad)), "--list"]) == 2
  assert "match_wall='bsa' is no method of this stage (pisa, dense)" in capsys.readouterr().err


def test_runs_sharing_a_gpu_say_so_and_time_nothing(tmp_path, capsys, monkeypatch):
  """--shared-device N: each process takes its share of the GPU's memory, and neither side of a
  wall-time match may be a shared run (its seconds are not its own)."""
  _without_nsa(monkeypatch)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  path = _manifest(tmp_path)
  calls, run_one = [], rep.run_one
  monkeypatch.setattr(rep, "run_one", lambda m, run, **kw: calls.append((run.name, kw)))
  common = ["--manifest", str(path), "--results", str(tmp_path / "results")]
  assert rep.main(common + ["--run", "dense-s0", "--shared-device", "3"]) == 0
  assert calls[-1][1]["shared_device"] == 3
  assert rep.os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.300"
  assert rep.main(common + ["--run", "dense-s0", "--shared-device", "0"]) == 2
  assert "--shared-device 0 must be >= 1" in capsys.readouterr().err
  # A stage that matches wall times refuses a shared run, and a shared run as its target.
  longer = _manifest(tmp_path / "long", TOY.replace("\n[eval]", LONG + "\n[eval]", 1))
  m = rep.load_manifest(longer)
  monkeypatch.setattr(rep, "preflight", lambda m, run: None)
  with pytest.raises(rep.ManifestError, match="needs the GPU to itself"):
    run_one(m, rep.Run("pisa", 0), out=tmp_path / "o", workdir=tmp_path / "w", progress=False,
            shared_device=2)
  shared = _fake_record(m, rep.Run("pisa", 0))
  shared["rows"].append({**shared["rows"][1], "stage": "long"})
  shared["shared_device"] = 2
  _write(tmp_path / "results", shared)
  with pytest.raises(rep.ManifestError, match="shared its GPU with other runs"):
    rep.matched_steps(m, rep.Run("dense", 0), m.stage("long"), None, [tmp_path / "results"])


# ----------------------------------------------------------------------------- summary


def test_summary_from_stand_in_results(tmp_path):
  m = rep.load_manifest(_manifest(tmp_path))
  folder = tmp_path / "results"
  # PISA: lower loss than dense by more than the seeds' spread; two seeds of PISA.
  _write(folder, _fake_record(m, rep.Run("dense", 0), loss=3.1, single=0.95, avg=0.7))
  _write(folder, _fake_record(m, rep.Run("pisa", 0), loss=3.00, single=0.9, avg=0.5, copy=0.3))
  resumed = _fake_record(m, rep.Run("pisa", 1), loss=3.02, single=0.7, avg=0.5, copy=0.5)
  resumed["notes"] = ["stage pretrain: trained earlier in /tmp/w; its timing is reused"]
  _write(folder, resumed)
  _write(folder, _fake_record(m, rep.Run("nsa", 0), fingerprint="other"))
  readme = tmp_path / "README.md"
  readme.write_text(f"intro\n{report.README_BEGIN}\nold\n{report.README_END}\noutro\n")
  report.summarize(m, folder, readme=readme)
  text = (folder / "summary.md").read_text()
  assert (folder / "loss.png").stat().st_size > 0 and (folder / "niah.png").stat().st_size > 0
  # Means over seeds with +- half their range; RULER cells in percent.
  assert "| PISA | 2 | 3.510 ±0.010 | 3.010 ±0.010 | 80.0 ±10.0 | 57.5 ±2.5 |" in text
  assert "| Full attention | 1 | 3.600 | 3.100 | 95.0 | 76.2 |" in text
  assert "| PISA | 40.0 ±10.0 (2.00 ±0.00) |" in text and "| NSA | pending |" in text
  assert "| Method | single-key 512 | multi-key 512 |\n|---|---|---|\n| Full attention | 50.0 |" in (
      text)
  assert ("| Method | single-key 512 | multi-key 512 | multi-query 512 | multi-value 512 | Avg |"
          in text)
  assert "`nsa-s0.json` (made from other settings" in text
  # A resumed run's wall time is its last process's, and the table says so.
  assert re.search(r"\| pisa-s1 \| [^|]+ \| [^|]+ \| [^|]+ \| [\d.]+ \(resumed\) \|", text)
  assert not re.search(r"\| pisa-s0 \|[^\n]*\(resumed\)", text)
  claims = {c[1]: (c[2], c[3]) for c in report.claims(report.Results(m, folder))}
  # NSA's result is set aside (other settings): dense is not yet compared with every method.
  assert claims["Full attention has the highest RULER average after CPT"] == ("pending",
                                                                            "needs nsa")
  assert claims["PISA's RULER average is above BSA's"][0] == "pending"
  assert claims["Every method retrieves single-key needles at 1K-4K (>= 90%)"] == (
      "pending", "needs nsa")
  assert claims["On dense q/k, PISA has the highest Recall@8 of the four selectors"][0] == (
      "reproduced")
  assert claims["PISA has the highest containment and a comparable multiple-choice accuracy "
                "among sparse methods"][0] == "not testable at this scale"
  assert "| Table 3 | PISA's RULER average is above BSA's | pending | needs bsa |" in text
  assert readme.read_text().startswith(f"intro\n{report.README_BEGIN}\n| Method | seeds |")
  assert readme.read_text().endswith(f"{report.README_END}\noutro\n")


def test_the_committed_summary_and_readme_block_are_the_results(tmp_path):
  # What `--summarize` writes from the committed run JSONs and the shipped manifest.
  m = rep.load_manifest(rep.DEFAULT_MANIFEST)
  folder = tmp_path / "results"
  folder.mkdir()
  for path in rep.DEFAULT_RESULTS.glob("*.json"):
    (folder / path.name).write_text(path.read_text())
  readme = tmp_path / "README.md"
  readme.write_text((rep.REPO / "README.md").read_text())
  report.summarize(m, folder, readme=readme)
  stale = "rerun `python -m benchmarks.replication --summarize` and commit what it writes"
  assert (folder / "summary.md").read_text() == (
      rep.DEFAULT_RESULTS / "summary.md").read_text(), stale
  assert readme.read_text() == (rep.REPO / "README.md").read_text(), stale


def test_claims_follow_the_numbers_and_the_retrieval_gate(tmp_path):
  m = rep.load_manifest(_manifest(tmp_path, TOY.replace(
      'name = "nsa"\nseeds = [0]', 'name = "bsa"\nseeds = [0]')))
  folder = tmp_path / "results"

  def verdict(claim, **numbers):
    for run in m.runs:
      _write(folder, _fake_record(m, run, **numbers.get(run.method, {})))
    return {c[1]: c[2] for c in report.claims(report.Results(m, folder))}[claim]

  above = "PISA's RULER average is above BSA's"
  assert verdict(above, pisa={"avg": 0.6}, bsa={"avg": 0.4}) == "reproduced"
  assert verdict(above, pisa={"avg": 0.3}, bsa={"avg": 0.4}) == "not reproduced"
  # Dense below 80% single-key: the RULER claims cannot be read.
  assert verdict(above, dense={"single": 0.5}, pisa={"avg": 0.6}, bsa={"avg": 0.4}) == (
      "not testable at this scale")
  # A difference within the spread of PISA's two seeds is no reproduction: averages 0.675 and
  # 0.45 for PISA (spread 0.225), 0.525 for BSA.
  assert verdict(above, pisa={"avg": 0.6}, bsa={"avg": 0.4}) == "reproduced"
  _write(folder, _fake_record(m, rep.Run("pisa", 1), avg=0.3))
  results = report.Results(m, folder)
  assert results.noise("cpt", report.ruler_average) == pytest.approx(0.225)
  (status, evidence), = [c[2:] for c in report.claims(results) if c[1] == above]
  assert status == "not reproduced" and "within the seed spread" in evidence, evidence


def test_claims_wait_for_the_methods_they_speak_of(tmp_path):
  """Without dense's RULER results no RULER claim is read (the gate needs them); "every method"
  and "the highest" wait for every method of the manifest; a run whose stage stopped at
  max_seconds is set aside."""
  m = rep.load_manifest(_manifest(tmp_path, TOY.replace(
      'name = "nsa"\nseeds = [0]', 'name = "bsa"\nseeds = [0]')))
  folder = tmp_path / "results"
  _write(folder, _fake_record(m, rep.Run("pisa", 0), single=0.95, avg=0.6))
  _write(folder, _fake_record(m, rep.Run("bsa", 0), single=0.95, avg=0.4))
  # With no result that counts, plots of earlier results are removed.
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "loss.png").write_bytes(b"stale")
  report.summarize(m, empty)
  assert not (empty / "loss.png").exists() and (empty / "summary.md").is_file()
  claims = {c[1]: c[2:] for c in report.claims(report.Results(m, folder))}
  for claim in ("PISA's RULER average is above BSA's", "Full attention has the highest RULER "
                "average after CPT", "Every method retrieves single-key needles at 1K-4K (>= 90%)"):
    assert claims[claim][0] == "pending" and "needs dense" in claims[claim][1], claims[claim]
  # Dense retrieves, but its run stopped early: set aside, and the claims still wait for it.
  dense = _fake_record(m, rep.Run("dense", 0), single=0.95, avg=0.7)
  dense["rows"][0]["truncated"] = True
  _write(folder, dense)
  results = report.Results(m, folder)
  assert "dense" not in results.by_method
  assert any(name == "dense-s0.json" and "not comparable" in why for name, why in results.aside)
  dense["rows"][0]["truncated"] = False
  _write(folder, dense)
  claims = {c[1]: c[2:] for c in report.claims(report.Results(m, folder))}
  assert claims["PISA's RULER average is above BSA's"][0] == "reproduced"
  assert claims["Full attention has the highest RULER average after CPT"][0] == "reproduced"
  assert claims["Every method retrieves single-key needles at 1K-4K (>= 90%)"][0] == (
      "reproduced")


def test_methods_are_compared_seed_by_seed(tmp_path):
  """A seed sets the data order and the initialisation for every method alike: PISA 0.1 below
  dense on each of two seeds whose losses differ by 0.4 is a difference, read against the spread
  of same-seed differences (0 here), not against the spread of one method's seeds."""
  m = rep.load_manifest(_manifest(tmp_path, TOY.replace(
      'name = "nsa"\nseeds = [0]', 'name = "bsa"\nseeds = [0]').replace(
      'name = "dense"\nseeds = [0]', 'name = "dense"\nseeds = [0, 1]')))
  folder = tmp_path / "results"
  losses = {("dense", 0): 3.0, ("dense", 1): 3.4, ("pisa", 0): 2.9, ("pisa", 1): 3.3,
            ("bsa", 0): 3.0}
  for run in m.runs:
    _write(folder, _fake_record(m, run, loss=losses[run.method, run.seed]))
  res = report.Results(m, folder)
  assert res.noise("cpt", report.final_loss) == pytest.approx(0.4)
  assert res.paired_noise("cpt", report.final_loss) == pytest.approx(0.0)
  status, evidence = report._compare(res, "cpt", report.final_loss, "pisa", ["bsa", "dense"],
                                     lower=True, what="loss")
  assert status == "reproduced" and "same-seed differences" in evidence, evidence
  # A spread of exactly 0 bounds nothing: the evidence says the spread is unknown.
  assert "the spread is unknown" in evidence, evidence
  # Seed 1 reversed (PISA 0.1 above dense): the same-seed differences spread 0.2, and the gain
  # over BSA on seed 0 (0.1) is within it.
  _write(folder, _fake_record(m, rep.Run("pisa", 1), loss=3.5))
  res = report.Results(m, folder)
  assert res.paired_noise("cpt", report.final_loss) == pytest.approx(0.2)
  status, evidence = report._compare(res, "cpt", report.final_loss, "pisa", ["bsa"],
                                     lower=True, what="loss")
  assert status == "not reproduced" and "within the seed spread" in evidence, evidence


# ----------------------------------------------------------------------------- end to end


def _smoke(text: str) -> str:
  """The toy manifest cut to what proves the pipeline's joints: two training steps, one CPT
  step from the first stage's checkpoint, perplexity after each, held-out needle documents after
  the first, the induction test after the second."""
  for old, new in [("steps = 3", "steps = 2"), ("steps = 2\npeak_lr = 3e-4", "steps = 1\n"
                                                                             "peak_lr = 3e-4"),
                   ("selection = [256]", "mixture = [256]"), ("ruler = [512]", ""),
                   ("mqar = [256]\n", ""),
                   ("ppl = [256, 512]", "ppl = [512]")]:
    assert old in text
    text = text.replace(old, new, 1)
  return text


@needs_bpe
def test_toy_pipeline_smoke(toy_data, tmp_path, monkeypatch):
  path = _manifest(tmp_path, _smoke(TOY), root=toy_data)
  record = _run_toy(path, tmp_path, monkeypatch)
  pre, cpt = record["rows"]
  assert set(pre["eval"]) == {"ppl", "mixture"} and set(cpt["eval"]) == {"ppl", "induction"}
  assert cpt["eval"]["ppl"]["rows"][0]["length"] == 512
  (copy,) = cpt["eval"]["induction"]["rows"]
  assert copy["length"] == 512 and copy["windows"] == 16 and 0 <= copy["copy_accuracy"] <= 1
  held_out = pre["eval"]["mixture"]
  assert [(r["length"], r["family"]) for r in held_out["rows"]] == [
      (256, f) for f in ("single_key", "multi_key", "multi_query", "multi_value")]
  assert all(0 <= r["accuracy"] <= 1 and r["answer_nll"] > 0 for r in held_out["rows"])
  assert len(held_out["records"]) == 4 * 16


def test_held_out_needles_score_exactly_the_answer_tokens(monkeypatch):
  """An answer is retrieved when the argmax is right at each of its tokens, read at the input
  position before each (teacher forcing): a model right exactly there retrieves every document,
  one wrong at a single answer token loses that document only."""
  from pisa_jax.train.evaluation import common, mixture
  from pisa_jax.train.retrieval import NeedleMaker

  rng = np.random.default_rng(0)
  hay = rng.integers(0, 5000, 20_000).astype(np.int32)
  maker = NeedleMaker(hay)
  docs = {}

  def fake_haystack(config):
    return hay

  def fake_scores(model, inputs, targets, *, batch_size, bar=None, **kw):
    hit = np.zeros(inputs.shape, bool)
    for i, row in enumerate(targets):
      doc = next(d for d in docs[len(row) + 1] if np.array_equal(d.tokens[1:], row))
      hit[i, doc.answer[0] - 1:doc.answer[1] - 1] = True
      if model == "miss" and i == 0:
        hit[i, doc.answer[1] - 2] = False  # the answer's last token
    return np.ones(inputs.shape, np.float32), hit

  def fake_documents(maker_, *, length, family, samples, seed):
    made = [maker.make(np.random.default_rng([seed, length, i]), length, family)
            for i in range(samples)]
    docs.setdefault(length, []).extend(made)
    return made

  monkeypatch.setattr(mixture, "haystack", fake_haystack)
  monkeypatch.setattr(mixture, "NeedleMaker",
                      lambda tokens, encoding=None, templates="fixed": maker)
  monkeypatch.setattr(mixture, "documents", fake_documents)
  monkeypatch.setattr(common, "token_scores", fake_scores)

  class Config:
    class train:
      seq_len = 512

    class data:
      retrieval_templates = "fixed"

  kw = dict(lengths=[300], samples=4, seed=0, batch_size=2, progress=False)
  right = mixture.run_mixture("right", Config, **kw)
  assert [r["accuracy"] for r in right["rows"]] == [1.0] * 4 and right["average"] == 1.0
  assert [r["fallbacks"] for r in right["rows"]] == [sum(d.family != r["family"] for d in
                                                         docs[300][4 * i:4 * i + 4])
                                                     for i, r in enumerate(right["rows"])]
  missed = mixture.run_mixture("miss", Config, **kw)
  assert [r["accuracy"] for r in missed["rows"]] == [0.75] * 4
  with pytest.raises(common.EvalArgumentError, match="exceeds the context 512"):
    mixture.run_mixture("right", Config, **{**kw, "lengths": [1024]})
  assert mixture.run_mixture("right", Config, **{**kw, "lengths": [1024]}, context=1024)


@pytest.mark.slow
@needs_bpe
def test_toy_pipeline_end_to_end(toy_data, tmp_path, monkeypatch, capsys):
  pytest.importorskip("wonderwords")
  path = _manifest(tmp_path, TOY.replace("\n[eval]", LONG + "\n[eval]", 1), root=toy_data)
  m = rep.load_manifest(path)
  # pisa-s0's stand-in result: its "long" stage took 4 steps of 512 tokens at 200 tokens/s.
  pisa = _fake_record(m, rep.Run("pisa", 0))
  pisa["rows"].append({**pisa["rows"][1], "stage": "long", "steps": 4, "tokens_per_step": 512,
                       "tokens_per_s": 200.0})
  _write(tmp_path / "out", pisa)
  record = _run_toy(path, tmp_path, monkeypatch)
  pre, cpt, long = record["rows"]
  matched = long["matched_wall"]
  assert matched["run"] == "pisa-s0" and matched["target_seconds"] == pytest.approx(10.24)
  assert long["steps"] == long["planned_steps"] == matched["steps"] == max(
      1, int(matched["target_seconds"] / matched["seconds_per_step"]))
  assert long["config"]["train"]["init_from"].endswith("dense-s0/cpt")
  assert set(pre["eval"]) == {"ppl", "selection"}
  assert set(cpt["eval"]) == {"ppl", "ruler", "mqar", "induction"}
  ruler = cpt["eval"]["ruler"]
  assert len(ruler["records"]) == 8 and all(r["depths"] for r in ruler["records"])
  assert [r["length"] for r in ruler["by_length"]] == [512]
  assert {r["selector"] for r in pre["eval"]["selection"]["rows"]} == {
      "bsa", "pisa1", "pisa2", "pisa", "exact"}
  # Done: a second invocation skips it; the summary reads it.
  results = tmp_path / "out"
  args = ["--manifest", str(path), "--results", str(results), "--workdir", str(tmp_path / "w")]
  assert rep.main(args + ["--run", "dense-s0"]) == 0
  assert "dense-s0: done" in capsys.readouterr().out
  report.summarize(rep.load_manifest(path), results)
  assert "| Full attention | 1 |" in (results / "summary.md").read_text()


def test_passes_count_the_text_read_as_haystack():
  data = {"text_train_tokens": 1000, "haystack_train_tokens": 100}
  assert rep.passes(400, {"token_fraction": 0.5}, data) == {"text": 0.2, "haystack": 2.0}
  assert rep.passes(400, {"token_fraction": 0.5, "text_share": 0.25}, data) == {
      "text": 0.25, "haystack": 1.5}


def _run_toy(path: Path, tmp_path: Path, monkeypatch) -> dict:
  """dense-s0 of the manifest at `path` through `main`, its record checked and returned."""
  monkeypatch.setenv("PISA_COMPILATION_CACHE", "off")
  for name in ("PISA_DATA_DIR", "PISA_GPT2_TIKTOKEN"):
    monkeypatch.delenv(name, raising=False)
  m = rep.load_manifest(path)
  out, work = tmp_path / "out", tmp_path / "w"
  assert rep.main(["--manifest", str(path), "--run", "dense-s0", "--results", str(out),
                   "--workdir", str(work), "--no-progress"]) == 0
  record = json.loads((out / "dense-s0.json").read_text())
  assert record["status"] == "complete" and record["fingerprint"] == m.fingerprint("dense")
  pre, cpt = record["rows"][:2]
  assert [pre["stage"], cpt["stage"]] == ["pretrain", "cpt"]
  assert pre["steps"] == m.stages[0].steps and not pre["truncated"]
  assert pre["tokens"] == m.stages[0].steps * 4 * 256
  assert len(pre["loss_curve"]) == m.stages[0].steps
  # Stage 2 starts from stage 1's checkpoint with its own K, RoPE base and schedule.
  c = cpt["config"]
  assert c["train"]["init_from"] == str(work / "dense-s0" / "pretrain")
  assert (c["model"]["top_k"], c["model"]["rope_base"], c["train"]["seq_len"]) == (8, 80000.0, 512)
  assert pre["mixture"]["rows_per_step"] == 2 and cpt["mixture"]["token_fraction"] == 0.5
  assert record["data"]["text_train_tokens"] > 0 and pre["passes"]["text"] > 0
  return copy.deepcopy(record)


@needs_bpe
def test_prepare_keeps_what_is_there(toy_data, tmp_path, capsys):
  """--prepare fetches nothing that is already prepared (the corpora, RULER's essays)."""
  path = _manifest(tmp_path, TOY, root=toy_data)
  before = {p: p.stat().st_mtime_ns for p in toy_data.rglob("*") if p.is_file()}
  assert rep.main(["--manifest", str(path), "--prepare"]) == 0
  out = capsys.readouterr().out
  assert f"kept {toy_data / 'text'}" in out and f"kept {toy_data / 'haystack'}" in out
  assert {p: p.stat().st_mtime_ns for p in toy_data.rglob("*") if p.is_file()} == before


@needs_bpe
def test_data_prepared_from_other_corpora_is_prepared_again_and_never_trained_on(
    toy_data, tmp_path, capsys, monkeypatch):
  """A manifest whose data.text_corpora changed: --prepare makes the corpus again, and a run on
  the old one is refused before any training."""
  from pisa_jax.train import prepare_data

  same = TOY.replace('text = "{root}/text"', 'text = "{root}/text"\ntext_corpora = ["toy"]')
  other = TOY.replace('text = "{root}/text"', 'text = "{root}/text"\ntext_corpora = ["gcide"]')
  assert rep.main(["--manifest", str(_manifest(tmp_path / "a", same, root=toy_data)),
                   "--prepare"]) == 0
  assert f"kept {toy_data / 'text'}" in capsys.readouterr().out
  calls = []
  monkeypatch.setattr(prepare_data, "main", calls.append)
  path = _manifest(tmp_path / "b", other, root=toy_data)
  assert rep.main(["--manifest", str(path), "--prepare"]) == 0
  assert calls == [["--corpus", "gcide", "--out", str(toy_data / "text")]]
  assert "was prepared from ['toy']" in capsys.readouterr().out
  monkeypatch.setattr(rep, "train_stage", lambda *a, **k: pytest.fail("trained on stale data"))
  assert rep.main(["--manifest", str(path), "--run", "dense-s0", "--results",
                   str(tmp_path / "r"), "--workdir", str(tmp_path / "w")]) == 2
  err = capsys.readouterr().err.strip()
  assert "data.text_corpora = ['gcide'], but" in err and "--prepare` again" in err
  assert len(err.splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_stage_trained_beside_other_runs_says_so_when_reused(tmp_path, monkeypatch):
  """A stage found trained in --workdir (a resumed run) brings its --shared-device with it: a
  run finished alone still says its tokens/s were measured beside other runs."""
  import jax

  _without_nsa(monkeypatch)
  m = rep.load_manifest(_manifest(tmp_path))
  run = rep.Run("pisa", 0)
  record = rep.Record(m, run, tmp_path / "out")
  record.record["shared_device"] = 1
  record.record["data"] |= {"text_train_tokens": 1000, "haystack_train_tokens": 1000}
  folder = tmp_path / "w" / run.name / m.stages[0].name
  folder.mkdir(parents=True)
  config = rep.stage_config(m, run, 0, init_from=None, devices=jax.device_count())
  timing = {"compile_seconds": 1.0, "train_seconds": 2.0, "end_step": 3, "truncated": False,
            "final_loss": 4.0, "tokens_per_step": 10, "mixture": {"token_fraction": 0.5},
            "config": json.loads(config.to_json()), "matched_wall": None, "shared_device": 2}
  (folder / "stage.json").write_text(json.dumps(timing))
  row = rep.train_stage(m, run, 0, folder, None, record, progress=False, dirs=[])
  assert row["train_seconds"] == 2.0 and record.record["shared_device"] == 2
  assert any("trained beside 1 other run(s)" in n for n in record.record["notes"])
