"""The exact GPT-2 BPE tokenizer (the paper's, 50,257 tokens), offline.

tiktoken fetches its `r50k_base` file from a blob store the machines cannot reach. The PyPI source
package `openai-whisper==20250625` ships the byte-identical file `whisper/assets/gpt2.tiktoken`:
install it with `pip install --no-deps openai-whisper==20250625` and it is found here without ever
importing `whisper` (that would pull torch). `PISA_GPT2_TIKTOKEN=/path/gpt2.tiktoken` points at a
copy elsewhere.
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
