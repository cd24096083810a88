"""The command-line tools' persistent XLA compilation cache.

A rerun of `pisa-train` (a resume), `pisa-generate`, `pisa-eval`, `pisa-lm-eval` or the demo loads
the programs an earlier run compiled from disk instead of compiling them again. The folder is
`$PISA_COMPILATION_CACHE`, by default `$XDG_CACHE_HOME/pisa_jax/xla` (else
`~/.cache/pisa_jax/xla`, beside the data caches); with `PISA_COMPILATION_CACHE=off` the tools set
none (jax's own setting still applies). A folder set through jax's own
`JAX_COMPILATION_CACHE_DIR` is kept when `PISA_COMPILATION_CACHE` is unset. Only the tools set
it: code that imports `pisa_jax` keeps its own jax configuration. jax keeps a program only if
compiling it took at least `jax_persistent_cache_min_compile_time_secs` (1 s by default).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "PISA_COMPILATION_CACHE"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
  """The cache folder the environment asks for, or None when it turns the cache off."""
  value = environ.get(ENV)
  if value is not None:
    if value.strip().lower() == "off":
      return None
    if not value.strip():
      raise ValueError(f"{ENV}={value!r}: give a folder, or 'off' to turn the cache off")
    return Path(value).expanduser()
  base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(base).expanduser() / "pisa_jax" / "xla"


def enable(environ: Mapping[str, str] = os.environ, *, prog: str = "pisa-jax") -> Path | None:
  """Points jax's persistent compilation cache at `cache_dir(environ)`; returns the folder in use
  (None: off). Call it before anything compiles: jax reads the setting once. A folder the user
  named that cannot be made is an error; the default folder that cannot be made (a read-only
  home) is reported on stderr and the tool runs uncached. A bad value raises ValueError before
  jax is imported."""
  path = cache_dir(environ)
  import jax

  own = jax.config.jax_compilation_cache_dir
  if ENV not in environ and own:
    return Path(own)  # the user's JAX_COMPILATION_CACHE_DIR
  if path is None:
    return None
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    if ENV in environ:
      raise ValueError(f"{ENV}={environ[ENV]!r}: cannot make the folder: {e}") from None
    print(f"{prog}: compilation cache off: cannot make {path}: {e} (set {ENV} to a writable "
          f"folder, or to 'off')", file=sys.stderr)
    return None
  jax.config.update("jax_compilation_cache_dir", str(path))
  return path


def enable_for(parser) -> Path | None:
  """`enable` for an argparse tool: a bad `$PISA_COMPILATION_CACHE` is a usage error."""
  try:
    return enable(prog=parser.prog)
  except ValueError as e:
    parser.error(str(e))
