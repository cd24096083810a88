"""Tokenizer golden values, packed token files, the loader's determinism, MQAR, the schedules."""

import json

import numpy as np
import pytest

from pisa_jax.configs import TrainConfig
from pisa_jax.train.data import FORMAT, MQARBatches, TokenWindows, mqar_examples
from pisa_jax.train.schedule import make_schedule
from pisa_jax.train.tokenizer import EOT_TOKEN, gpt2_bpe_path

# CI installs the BPE file with `pip install --no-deps openai-whisper==20250625` (never imported).
needs_bpe = pytest.mark.skipif(
    gpt2_bpe_path() is None,
    reason="gpt2.tiktoken absent: pip install --no-deps openai-whisper==20250625",
)


@needs_bpe
def test_gpt2_tokenizer_golden_values():
  from pisa_jax.train.tokenizer import gpt2_encoding

  enc = gpt2_encoding()
  assert enc.n_vocab == 50_257
  assert enc.encode("Hello world") == [15496, 995]
  # Contractions, numbers, repeated spaces, non-ASCII and a newline: the r50k pre-tokeniser.
  assert enc.encode_ordinary("It's 2024, h\u00e9llo   world!\n") == [
      1026, 338, 48609, 11, 289, 2634, 18798, 220, 220, 995, 0, 198]
  assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_TOKEN]
  assert enc.decode([15496, 995]) == "Hello world"


@needs_bpe
def test_prepare_data_packs_documents_with_eot(tmp_path):
  from pisa_jax.train.prepare_data import main

  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(40):
    (docs / f"{i:02d}.txt").write_text(f"Document number {i} says hello world. " * 5)
  jsonl = tmp_path / "more.jsonl"
  jsonl.write_text("\n".join(json.dumps({"body": f"json doc {i}"}) for i in range(10)) + "\n")
  out = tmp_path / "packed"
  main(["--files", str(docs), "--jsonl", str(jsonl), "--jsonl-field", "body", "--out", str(out),
        "--val-fraction", "0.2"])
  meta = json.loads((out / "meta.json").read_text())
  assert meta["format"] == FORMAT and meta["train_documents"] + meta["val_documents"] == 50
  train = np.fromfile(out / "train.bin", np.uint16)
  val = np.fromfile(out / "val.bin", np.uint16)
  assert train.size == meta["train_tokens"] and val.size == meta["val_tokens"]
  # One EOT after every document; every document ends with one.
  assert int((train == EOT_TOKEN).sum()) == meta["train_documents"]
  assert int((val == EOT_TOKEN).sum()) == meta["val_documents"]
  assert train[-1] == EOT_TOKEN and val[-1] == EOT_TOKEN


def _packed(tmp_path, n_train=5000, n_val=700, vocab=50_257):
  rng = np.random.default_rng(0)
  rng.integers(0, vocab, n_train).astype(np.uint16).tofile(tmp_path / "train.bin")
  rng.integers(0, vocab, n_val).astype(np.uint16).tofile(tmp_path / "val.bin")
  (tmp_path / "meta.json").write_text(json.dumps({
      "format": FORMAT, "vocab_size": vocab, "train_tokens": n_train, "val_tokens": n_val}))
  return tmp_path


def _windows(folder, **kw):
  args = dict(seq_len=64, global_batch=8, accum=2, seed=3, vocab_size=50_257)
  args.update(kw)
  return TokenWindows(folder, "train", **args)


def test_loader_is_deterministic_from_seed_and_step(tmp_path):
  folder = _packed(tmp_path)
  a, b = _windows(folder), _windows(folder)
  for step in (0, 7, 123):
    x, y = a.batch(step), b.batch(step)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert not np.array_equal(a.batch(0)["inputs"], a.batch(1)["inputs"])
  assert not np.array_equal(a.batch(0)["inputs"], _windows(folder, seed=4).batch(0)["inputs"])
  x = a.batch(5)
  assert x["inputs"].shape == (2, 8, 64) and x["inputs"].dtype == np.int32
  # targets are the inputs shifted by one inside each window of seq_len + 1 tokens
  np.testing.assert_array_equal(x["inputs"][..., 1:], x["targets"][..., :-1])


def test_loader_windows_at_two_million_tokens(tmp_path):
  # Windows of T + 1 = 2^21 + 2 consecutive tokens: token i of the file is i mod 65,521, so each
  # target is its input + 1 (mod 65,521) and no window is cut or stitched.
  n, seq_len = 2**21 + 5000, 2**21 + 1
  (np.arange(n) % 65_521).astype(np.uint16).tofile(tmp_path / "train.bin")
  (tmp_path / "meta.json").write_text(json.dumps(
      {"format": FORMAT, "vocab_size": 65_521, "train_tokens": n, "val_tokens": 0}))
  b = _windows(tmp_path, seq_len=seq_len, global_batch=2, accum=1, vocab_size=65_521).batch(5)
  assert b["inputs"].shape == b["targets"].shape == b["weights"].shape == (1, 2, seq_len)
  assert b["inputs"].dtype == np.int32
  np.testing.assert_array_equal((b["targets"] - b["inputs"]) % 65_521, 1)
  np.testing.assert_array_equal(np.diff(b["inputs"], axis=-1) % 65_521, 1)


def test_loader_reads_windows_past_2_31_tokens(tmp_path):
  # A sparse file of 2^32 + 4096 tokens (8 GiB apparent, a few pages written): the windows the
  # seeded draw picks get distinct patterns, and the loader must return exactly those.
  n, seq_len, batch, step = 2**32 + 4096, 1000, 4, 2
  with open(tmp_path / "train.bin", "wb") as f:
    f.truncate(2 * n)
  (tmp_path / "meta.json").write_text(json.dumps(
      {"format": FORMAT, "vocab_size": 50_257, "train_tokens": n, "val_tokens": 0}))
  starts = np.random.default_rng([3, 0, step]).integers(0, n - seq_len, size=(1, batch))[0]
  assert starts.max() > 2**31, starts  # the draw reaches past int32's range
  tokens = np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="r+")
  for i, start in enumerate(starts):
    tokens[start:start + seq_len + 1] = (np.arange(seq_len + 1) + 7000 * i) % 50_257
  tokens.flush()
  del tokens
  b = _windows(tmp_path, seq_len=seq_len, global_batch=batch, accum=1).batch(step)
  for i in range(batch):
    want = (np.arange(seq_len + 1) + 7000 * i) % 50_257
    np.testing.assert_array_equal(b["inputs"][0, i], want[:-1])
    np.testing.assert_array_equal(b["targets"][0, i], want[1:])


def test_mqar_at_two_million_tokens():
  # The answers sit at the query positions of a 2^21-token sequence (int64 index arithmetic).
  seq_len = 2**21
  ex = mqar_examples(np.random.default_rng(0), 1, seq_len=seq_len, vocab_size=512, num_pairs=64)
  assert ex["inputs"].shape == ex["targets"].shape == (1, seq_len)
  queries = np.flatnonzero(ex["weights"][0])
  assert queries.size == 64 and queries.max() < seq_len
  keys, values = ex["inputs"][0, 0:128:2], ex["inputs"][0, 1:128:2]
  answer = dict(zip(keys.tolist(), values.tolist()))
  assert [answer[k] for k in ex["inputs"][0, queries]] == ex["targets"][0, queries].tolist()


def test_loader_hosts_split_the_global_batch(tmp_path):
  folder = _packed(tmp_path)
  whole = _windows(folder).batch(9)
  parts = [_windows(folder, process_index=i, process_count=2).batch(9) for i in range(2)]
  for k in whole:
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts], axis=1), whole[k])


def test_loader_rejects_missing_and_corrupt_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="meta.json"):
    _windows(tmp_path)
  folder = _packed(tmp_path)
  with open(folder / "train.bin", "ab") as f:
    f.write(b"\x00")
  with pytest.raises(ValueError, match="corrupt"):
    _windows(folder)
  (folder / "meta.json").write_text("{not json")
  with pytest.raises(ValueError, match="corrupt"):
    _windows(folder)


def test_loader_rejects_a_vocabulary_larger_than_the_model(tmp_path):
  folder = _packed(tmp_path)
  with pytest.raises(ValueError, match="vocab_size"):
    _windows(folder, vocab_size=1000)


def test_mqar_matches_the_zoology_definition():
  v, t, p = 128, 256, 12
  ex = mqar_examples(np.random.default_rng(0), 64, seq_len=t, vocab_size=v, num_pairs=p)
  x, y, w = ex["inputs"], ex["targets"], ex["weights"]
  assert x.shape == y.shape == w.shape == (64, t)
  assert (w.sum(1) == p).all()
  for row in range(64):
    keys, values = x[row, 0:2 * p:2], x[row, 1:2 * p:2]
    assert ((1 <= keys) & (keys < v // 2)).all() and len(set(keys)) == p
    assert ((v // 2 <= values) & (values < v)).all() and len(set(values)) == p
    table = dict(zip(keys.tolist(), values.tolist()))
    (qpos,) = np.nonzero(w[row])
    assert (qpos >= 2 * p).all() and ((qpos - 2 * p) % 2 == 0).all()
    # Every key is queried exactly once and the target is its value.
    assert sorted(x[row, qpos].tolist()) == sorted(keys.tolist())
    for q in qpos:
      assert y[row, q] == table[int(x[row, q])]
    # Outside the answers, targets are just the next input token.
    others = np.setdiff1d(np.arange(t - 1), qpos)
    np.testing.assert_array_equal(y[row, others], x[row, others + 1])


def test_mqar_gaps_favour_short_distances():
  """p(gap i) ~ a * i^(a-1) with a = 0.01 puts most queries close to the key-value block."""
  ex = mqar_examples(np.random.default_rng(1), 2000, seq_len=256, vocab_size=128, num_pairs=8)
  gaps = (np.nonzero(ex["weights"])[1] - 16) // 2
  assert np.mean(gaps < 30) > np.mean(gaps >= 90) * 2


def test_mqar_batches_are_deterministic_and_host_sharded():
  kw = dict(vocab_size=64, seq_len=128, num_pairs=4, power_a=0.01, global_batch=4, accum=2, seed=5)
  a, b = MQARBatches(**kw), MQARBatches(**kw)
  np.testing.assert_array_equal(a.batch(3)["inputs"], b.batch(3)["inputs"])
  assert a.batch(3)["inputs"].shape == (2, 4, 128)
  assert not np.array_equal(a.batch(3)["inputs"], a.batch(4)["inputs"])
  half = MQARBatches(**kw, process_index=1, process_count=2).batch(3)
  np.testing.assert_array_equal(half["targets"], a.batch(3)["targets"][:, 2:])
  val = MQARBatches(**kw, split="val").batch(3)
  assert not np.array_equal(val["inputs"], a.batch(3)["inputs"])


def test_paper_schedule_breakpoints():
  """Table 5: 1K linear warm-up, 90K plateau, 9K square-root decay to 0.1x peak."""
  t = TrainConfig(steps=100_000, warmup_steps=1_000, decay_steps=9_000, peak_lr=3e-4,
                  final_lr_ratio=0.1, lr_schedule="wsd_sqrt")
  lr = make_schedule(t)
  f = lambda s: float(lr(s))
  np.testing.assert_allclose(f(0), 3e-4 / 1000, rtol=1e-5)
  np.testing.assert_allclose(f(499), 3e-4 / 2, rtol=1e-5)
  np.testing.assert_allclose(f(999), 3e-4, rtol=1e-6)
  np.testing.assert_allclose(f(1000), 3e-4, rtol=1e-6)
  np.testing.assert_allclose(f(90_999), 3e-4, rtol=1e-6)
  # Half-way through the decay: 1 - 0.9 * sqrt(1/2) of the peak.
  np.testing.assert_allclose(f(91_000 + 4_499), 3e-4 * (1 - 0.9 * np.sqrt(0.5)), rtol=1e-4)
  np.testing.assert_allclose(f(99_999), 3e-5, rtol=1e-5)
  assert f(91_000) < 3e-4
  decay = [f(s) for s in range(91_000, 100_000, 500)]
  assert all(a > b for a, b in zip(decay, decay[1:]))


def test_cpt_cosine_schedule_breakpoints():
  """CPT: 10% linear warm-up to 3e-5, then cosine to 3e-6."""
  t = TrainConfig(steps=10_000, warmup_steps=0, warmup_fraction=0.1, decay_steps=0, peak_lr=3e-5,
                  final_lr_ratio=0.1, lr_schedule="cosine")
  f = lambda s: float(make_schedule(t)(s))
  np.testing.assert_allclose(f(999), 3e-5, rtol=1e-6)
  np.testing.assert_allclose(f(499), 1.5e-5, rtol=1e-5)
  np.testing.assert_allclose(f(1_000 + 4_499), 3e-6 + 2.7e-5 * 0.5, rtol=1e-3)
  np.testing.assert_allclose(f(9_999), 3e-6, rtol=1e-5)


def test_mqar_without_random_filler_leaves_zeros_outside_pairs_and_queries():
  ex = mqar_examples(np.random.default_rng(2), 8, seq_len=128, vocab_size=64, num_pairs=4,
                     random_filler=False)
  x, w = ex["inputs"], ex["weights"]
  used = w.astype(bool)
  used[:, :8] = True
  assert (x[~used] == 0).all() and (x[:, :8] > 0).all()


def test_prepare_data_writes_uint32_ids_for_a_vocabulary_over_65536(tmp_path):
  tokenizers = pytest.importorskip("tokenizers", reason="the `import` extra")
  from pisa_jax.train.prepare_data import main

  # A run's own word-level tokenizer of 70,000 tokens (Llama 3's 128K needs the same).
  vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 70_000)}}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.add_special_tokens(["<|endoftext|>"])
  run = tmp_path / "run"
  run.mkdir()
  tokenizer.save(str(run / "tokenizer.json"))
  docs = tmp_path / "docs"
  docs.mkdir()
  documents = [[65_535, 65_536, 69_999, 7], [2, 66_000], [123, 45_678, 68_000, 3, 9]] * 4
  for i, ids in enumerate(documents):
    (docs / f"{i:02d}.txt").write_text(" ".join(f"w{t}" for t in ids))
  out = tmp_path / "corpus"
  main(["--files", str(docs), "--out", str(out), "--tokenizer", str(run), "--val-fraction",
        "0.3", "--seed", "1"])
  meta = json.loads((out / "meta.json").read_text())
  assert (meta["dtype"], meta["vocab_size"], meta["eot"]) == ("uint32", 70_000, 0)
  ids = {s: np.fromfile(out / f"{s}.bin", np.uint32) for s in ("train", "val")}
  for split in ("train", "val"):
    assert (out / f"{split}.bin").stat().st_size == 4 * meta[f"{split}_tokens"]
  written = sorted(tuple(d[:-1]) for s in ids.values()
                   for d in np.split(s, np.flatnonzero(s == 0) + 1) if d.size)
  assert written == sorted(tuple(d) for d in documents)
  # The loader reads the ids whole: a window of the train split is a slice of the file.
  windows = TokenWindows(out, "train", seq_len=4, global_batch=2, accum=1, seed=0,
                         vocab_size=70_000).batch(0)
  train = ids["train"].astype(np.int64)
  for row in windows["inputs"][0]:
    starts = [s for s in range(train.size - 4) if np.array_equal(train[s:s + 4], row)]
    assert starts, row
  assert ids["train"].max() > 65_535


def test_token_files_say_their_dtype(tmp_path):
  folder = _packed(tmp_path)
  meta = json.loads((folder / "meta.json").read_text())
  # Without "dtype" (folders written before it) and with "uint16": the same uint16 tokens.
  before = _windows(folder).batch(0)
  (folder / "meta.json").write_text(json.dumps({**meta, "dtype": "uint16"}))
  np.testing.assert_array_equal(_windows(folder).batch(0)["inputs"], before["inputs"])
  (folder / "meta.json").write_text(json.dumps({**meta, "dtype": "uint32"}))
  with pytest.raises(ValueError, match=r"train\.bin is corrupt: 10000 bytes, meta\.json promises "
                                       r"5000 uint32 tokens"):
    _windows(folder)
  (folder / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
  with pytest.raises(ValueError, match=r"meta\.json: dtype='int8' must be one of \('uint16', "
                                       r"'uint32'\)"):
    _windows(folder)


def test_evaluation_counts_held_out_tokens_of_their_dtype(tmp_path):
  from pisa_jax.configs import get_config
  from pisa_jax.train.evaluation.arguments import EvalArgumentError
  from pisa_jax.train.evaluation.common import check_data

  np.zeros(100, np.uint32).tofile(tmp_path / "val.bin")
  (tmp_path / "meta.json").write_text(json.dumps({
      "format": FORMAT, "dtype": "uint32", "vocab_size": 64, "train_tokens": 0,
      "val_tokens": 100}))
  config = get_config("tiny")
  check_data(config, lengths=[99], data=str(tmp_path), what="ppl")
  with pytest.raises(EvalArgumentError, match=r"--lengths: 150 needs 151 tokens of held-out "
                                              r"text; .*val\.bin holds 100"):
    check_data(config, lengths=[150], data=str(tmp_path), what="ppl")
