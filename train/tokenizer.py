"""The exact GPT-2 BPE tokenizer (the paper's, 50,257 tokens), offline; and a run's own tokenizer.

tiktoken fetches its `r50k_base` file from a blob store the machines cannot reach. The PyPI source
package `openai-whisper==20250625` ships the byte-identical file `whisper/assets/gpt2.tiktoken`:
install it with `pip install --no-deps openai-whisper==20250625` and it is found here without ever
importing `whisper` (that would pull torch). `PISA_GPT2_TIKTOKEN=/path/gpt2.tiktoken` points at a
copy elsewhere.

A run imported from a pretrained model (`pisa-import`) carries the model's own tokenizer.json:
`run_encoding` gives it to the tools in place of GPT-2's.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

EOT_TOKEN = 50_256
VOCAB_SIZE = 50_257
# tiktoken's r50k_base / gpt2 pre-tokenisation pattern.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
INSTALL_HINT = (
    "the GPT-2 BPE file gpt2.tiktoken was not found: run "
    "`pip install --no-deps openai-whisper==20250625` (a source package that ships it; it is never "
    "imported) or set PISA_GPT2_TIKTOKEN to the file's path"
)


def gpt2_bpe_path() -> Path | None:
  """Where gpt2.tiktoken is, or None when neither the env var nor openai-whisper provides it."""
  env = os.environ.get("PISA_GPT2_TIKTOKEN")
  if env:
    return Path(env)
  # find_spec locates the package's folder without executing its __init__ (which imports torch).
  spec = importlib.util.find_spec("whisper")
  if spec is None or not spec.submodule_search_locations:
    return None
  for location in spec.submodule_search_locations:
    path = Path(location) / "assets" / "gpt2.tiktoken"
    if path.is_file():
      return path
  return None


@functools.cache
def gpt2_encoding():
  """A `tiktoken.Encoding` identical to tiktoken's "gpt2": "Hello world" -> [15496, 995]."""
  import tiktoken
  import tiktoken.load

  path = gpt2_bpe_path()
  if path is None:
    raise FileNotFoundError(INSTALL_HINT)
  if not path.is_file():
    raise FileNotFoundError(f"PISA_GPT2_TIKTOKEN={path} is not a file")
  try:
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
  except ValueError as e:  # tiktoken's parse errors, base64's binascii.Error, UnicodeDecodeError
    raise ValueError(f"{path} is not a tiktoken BPE file ({e})") from None
  if len(ranks) != EOT_TOKEN:
    raise ValueError(f"{path} holds {len(ranks)} merges, expected {EOT_TOKEN} for GPT-2")
  return tiktoken.Encoding(
      name="gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
      special_tokens={"<|endoftext|>": EOT_TOKEN},
  )


# A pretrained model's own tokenizer (`pisa-import` writes both files into the run folder).
RUN_TOKENIZER = "tokenizer.json"
PRETRAINED_RECORD = "pretrained.json"


@functools.cache
def _byte_of_char() -> dict[str, int]:
  """GPT-2's byte-level alphabet inverted: the character each byte is written as -> the byte."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


class RunTokenizer:
  """A run's own `tokenizers.Tokenizer` with what the tools use of a tiktoken Encoding:
  `encode` (a text as the model reads it from its start: a BOS token where its tokenizer adds
  one), `encode_ordinary` (a piece inside a text: no special tokens), `decode`,
  `decode_single_token_bytes`, `n_vocab`."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    # Byte-level BPE writes each byte as one character of GPT-2's alphabet; SentencePiece pieces
    # are text with "▁" for a space (and `<0xNN>` byte-fallback tokens).
    decoder = tokenizer.decoder
    self._byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()

  @property
  def n_vocab(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text).ids

  def encode_ordinary(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode(list(ids))

  def decode_single_token_bytes(self, token: int) -> bytes:
    """The bytes of one token: a byte-level BPE token's characters mapped back to bytes, a
    byte-fallback token `<0xNN>` its byte, a SentencePiece piece with "▁" as a space; special
    tokens decode to nothing, as `decode` leaves them out."""
    piece = self.tokenizer.id_to_token(int(token))
    if piece is None or int(token) in self._special:
      return b""
    table = _byte_of_char()
    if self._byte_level and all(c in table for c in piece):
      return bytes(table[c] for c in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
      return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode()


def tokenizer_digest(workdir) -> str | None:
  """The SHA-256 of a run's own tokenizer's vocabulary (`pisa-import`; every token and its id,
  added tokens included: unlike the file's bytes, the same whichever `tokenizers` version wrote
  it), None for a run of GPT-2's BPE. `pisa-prepare-data --tokenizer RUN` records it, and a
  run reads only a corpus of its own."""
  import hashlib
  import json

  path = Path(workdir) / RUN_TOKENIZER
  if not path.is_file():
    return None
  from tokenizers import Tokenizer

  vocabulary = sorted(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).items(),
                      key=lambda item: item[1])
  return hashlib.sha256(json.dumps(vocabulary).encode()).hexdigest()


def encode_text(encoding, text: str) -> list[int]:
  """`text` as the model reads it from its start: a run tokenizer's `encode` (with the BOS token
  its tokenizer adds); GPT-2's BPE adds none and reads special-token text as plain text."""
  if isinstance(encoding, RunTokenizer):
    return encoding.encode(text)
  return encoding.encode_ordinary(text)


def run_encoding(workdir) -> tuple[object, tuple[int, ...]]:
  """(encoding, stop tokens) of a run: its own tokenizer.json (`pisa-import`) as a
  `RunTokenizer` with the tokens that end its generations, else None (GPT-2's BPE, which the
  tools load themselves) with <|endoftext|>."""
  import json

  folder = Path(workdir)
  if not (folder / RUN_TOKENIZER).is_file():
    return None, (EOT_TOKEN,)
  from tokenizers import Tokenizer

  try:
    tokenizer = Tokenizer.from_file(str(folder / RUN_TOKENIZER))
  except Exception as e:  # tokenizers raises its own Exception type for a bad file
    raise ValueError(f"{folder / RUN_TOKENIZER} is not a tokenizers file ({e})") from None
  record = folder / PRETRAINED_RECORD
  stop = json.loads(record.read_text()).get("eos_token_ids", []) if record.is_file() else []
  return RunTokenizer(tokenizer), tuple(int(t) for t in stop)
