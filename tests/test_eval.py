"""`pisa-eval` end to end on a tiny trained checkpoint, its numbers checked against independent
computations: perplexity against a plain forward pass, MQAR accuracy against a count of argmax
hits, the selection diagnostic's "exact" rows (one query head per KV head: exact LSE ranks blocks
as full attention does) at recall 1 and its position buckets against the whole; --compare over
two results; RULER through a stand-in task module (and the real one once it is installed); and
every bad input as one line on stderr with exit status 2.
"""

from __future__ import annotations

import json
import random
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pisa_jax
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.models.decoder import Decoder
from pisa_jax.train.data import FORMAT, mqar_examples
from pisa_jax.train.tokenizer import EOT_TOKEN
from pisa_jax.train.evaluation import cli, common, induction, needles, report

# One dense layer, one query head per KV head, leaves of 4 tokens and K = 4: at 32 tokens the
# queries from position 16 on have more than K eligible blocks. Trained for two steps: enough
# for a checkpoint that restores.
TINY_EVAL = [
    "model.attention=dense", "model.num_layers=1", "model.d_model=32", "model.mlp_dim=64",
    "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16", "model.block_size=4",
    "model.top_k=4", "data.mqar_num_pairs=4", "train.seq_len=32", "train.per_device_batch=2",
    "train.grad_accum=1", "train.steps=2", "train.warmup_steps=1", "train.decay_steps=1",
    "train.checkpoint_every=2", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
]
SAMPLES = 3
# Shared by every run below: one compiled forward (batch 3 padded to 4, 32 tokens) for all parts.
COMMON = ["--lengths", "32", "--samples", str(SAMPLES), "--batch-size", "4", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  from pisa_jax.train.trainer import train

  workdir = tmp_path_factory.mktemp("run")
  train(validate(apply_overrides(get_config("tiny"), TINY_EVAL)), workdir, progress=False,
        quiet=True)
  return workdir


@pytest.fixture(scope="module")
def text(tmp_path_factory):
  """A pisa-prepare-data folder of 200 held-out tokens below the tiny vocabulary of 64."""
  folder = tmp_path_factory.mktemp("text")
  rng = np.random.default_rng(0)
  for split, n in (("train", 100), ("val", 200)):
    rng.integers(0, 64, n).astype(np.uint16).tofile(folder / f"{split}.bin")
  (folder / "meta.json").write_text(json.dumps(
      {"format": FORMAT, "vocab_size": 64, "train_tokens": 100, "val_tokens": 200}))
  return folder


@pytest.fixture(scope="module")
def evaluated(tiny_run, tmp_path_factory):
  """eval.json of ppl, mqar, induction and selection in RUN/eval."""
  assert cli.main(["--workdir", str(tiny_run), "--suite", "ppl,mqar,induction,selection",
                   "--mqar-pairs", "4,8,16", "--beam-factors", "1"] + COMMON) == 0
  _, model, _ = cli.restore_model(tiny_run)
  return json.loads((tiny_run / "eval" / "eval.json").read_text()), model


@jax.jit
def _log_probs(model, tokens):
  return jax.nn.log_softmax(model(tokens), axis=-1)


def _nll(model, inputs, targets) -> np.ndarray:
  logp = np.asarray(_log_probs(model, jnp.asarray(inputs)), np.float64)
  return -np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def test_eval_json_records_what_produced_it(evaluated, tiny_run):
  result, _ = evaluated
  assert result["evaluation"] == "pisa-eval" and result["jax"] == jax.__version__
  assert result["checkpoint"] == {"workdir": str(tiny_run), "step": 2}
  assert result["config"]["model"]["num_heads"] == 2 and result["device"].endswith("cpu")
  assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?|unknown.*", result["commit"])
  assert list(result["parts"]) == ["ppl", "mqar", "induction", "selection"]
  for part in result["parts"].values():
    assert part["wall_seconds"] > 0 and part["date"] == result["date"]
  for name in ("eval.md", "ppl.png", "mqar.png", "induction.png", "selection.png"):
    assert (tiny_run / "eval" / name).stat().st_size > 0
  md = (tiny_run / "eval" / "eval.md").read_text()
  assert "## ppl" in md and "| selector | Recall@4 |" in md


def test_ppl_is_exp_of_the_mean_loss_of_a_plain_forward_pass(evaluated):
  result, model = evaluated
  (row,) = result["parts"]["ppl"]["rows"]
  # An MQAR run: its validation examples, the loss on the answers only.
  ex = mqar_examples(np.random.default_rng(row["data"]["seed_sequence"]), SAMPLES, seq_len=32,
                     vocab_size=64, num_pairs=4, power_a=0.01, random_filler=False)
  nll, w = _nll(model, ex["inputs"], ex["targets"]), ex["weights"]
  want = (nll * w).sum() / w.sum()
  assert row["tokens"] == int(w.sum()) == 4 * SAMPLES
  np.testing.assert_allclose(row["loss"], want, rtol=1e-5)
  np.testing.assert_allclose(row["ppl"], np.exp(want), rtol=1e-5)
  _check_buckets(row)


def _check_buckets(row):
  buckets = row["buckets"]
  assert [(b["start"], b["end"]) for b in buckets] == [(0, 16), (16, 32)]
  assert sum(b["tokens"] for b in buckets) == row["tokens"]
  counted = [b for b in buckets if b["tokens"]]
  back = sum(b["loss"] * b["tokens"] for b in counted) / row["tokens"]
  np.testing.assert_allclose(back, row["loss"], rtol=1e-6)


def test_ppl_on_held_out_text(tiny_run, text, tmp_path):
  assert cli.main(["--workdir", str(tiny_run), "--suite", "ppl", "--data", str(text),
                   "--out", str(tmp_path)] + COMMON) == 0
  (row,) = json.loads((tmp_path / "eval.json").read_text())["parts"]["ppl"]["rows"]
  starts = row["data"]["starts"]
  assert row["data"]["source"] == "tokens" and starts == [0, 84, 167]  # spread over 200 tokens
  val = np.fromfile(text / "val.bin", np.uint16).astype(np.int32)
  windows = np.stack([val[s:s + 33] for s in starts])
  _, model, _ = cli.restore_model(tiny_run)
  want = _nll(model, windows[:, :-1], windows[:, 1:]).mean()
  assert row["tokens"] == 32 * SAMPLES
  np.testing.assert_allclose(row["ppl"], np.exp(want), rtol=1e-5)
  _check_buckets(row)


def test_mqar_accuracy_is_a_count_of_argmax_hits_on_the_answers(evaluated):
  result, model = evaluated
  part = result["parts"]["mqar"]
  assert [(r["pairs"], r["length"]) for r in part["rows"]] == [(4, 32), (8, 32)]
  # 16 pairs need 64 tokens: listed as skipped, not dropped.
  assert part["skipped"] == [{"pairs": 16, "length": 32, "reason": "16 pairs need >= 64 tokens"}]
  for row in part["rows"]:
    ex = mqar_examples(np.random.default_rng(row["seed_sequence"]), SAMPLES, seq_len=32,
                       vocab_size=64, num_pairs=row["pairs"], power_a=0.01,
                       random_filler=False)
    hits = np.asarray(_log_probs(model, jnp.asarray(ex["inputs"]))).argmax(-1) == ex["targets"]
    answers = ex["weights"] > 0
    assert row["answers"] == answers.sum() == row["pairs"] * SAMPLES
    assert row["correct"] == (hits & answers).sum()
    assert row["accuracy"] == row["correct"] / row["answers"]


def test_induction_scores_the_second_copy_against_the_first(evaluated, tiny_run):
  result, model = evaluated
  (row,) = result["parts"]["induction"]["rows"]
  assert row["length"] == 32 and row["windows"] == SAMPLES
  part = result["parts"]["induction"]
  config, _, _ = cli.restore_model(tiny_run)
  # The common tokens: the most frequent of 16 held-out MQAR examples of 32 tokens (the run's
  # task), every id counted, end-of-text never.
  held = common.held_out(config, length=32, samples=16, seed=0, data=None)
  counts = np.bincount(held["targets"].ravel(), minlength=64)
  vocabulary, record = induction.common_tokens(config, lengths=[32], seed=0, data=None)
  np.testing.assert_array_equal(vocabulary, np.flatnonzero(counts))
  assert part["vocabulary"] == record and record["tokens"] == len(vocabulary) >= 2
  assert record["counted"] == 16 * 32 and record["data"]["source"] == "mqar"
  windows = induction.repeated_windows(np.random.default_rng(row["seed_sequence"]), SAMPLES, 32,
                                       vocabulary)
  inputs, targets = windows["inputs"], windows["targets"]
  # 17 drawn tokens, then the same 17 cut to 33: targets 1..16 and 18..32 are scored, 17 not.
  np.testing.assert_array_equal(inputs[:, 17:], inputs[:, :15])
  assert windows["first"][0].sum() == 16 and windows["second"][0].sum() == 15
  assert not (windows["first"] & windows["second"]).any()
  assert np.isin(inputs, vocabulary).all() and (inputs != EOT_TOKEN).all()
  nll = _nll(model, inputs, targets)
  hits = np.asarray(_log_probs(model, jnp.asarray(inputs))).argmax(-1) == targets
  np.testing.assert_allclose(row["first_loss"], nll[windows["first"]].mean(), rtol=1e-5)
  np.testing.assert_allclose(row["second_loss"], nll[windows["second"]].mean(), rtol=1e-5)
  np.testing.assert_allclose(row["score"], row["first_loss"] - row["second_loss"], rtol=1e-9)
  assert row["tokens"] == 15 * SAMPLES
  assert row["copy_accuracy"] == hits[windows["second"]].mean()
  assert "| length | first copy | second copy | score | copied |" in (
      report.induction_markdown(result["parts"]["induction"]))


def test_induction_draws_the_most_common_tokens_of_held_out_text(tiny_run, text, monkeypatch):
  config, _, _ = cli.restore_model(tiny_run)
  val = np.fromfile(text / "val.bin", np.uint16).astype(np.int64)
  ids, record = induction.common_tokens(config, lengths=[32], seed=0, data=str(text))
  np.testing.assert_array_equal(ids, np.unique(val))  # fewer than 4,096 distinct: all of them
  assert record == {"tokens": len(ids), "counted": 200,
                    "data": {"source": "tokens", "path": str(text), "split": "val", "first": 200}}
  monkeypatch.setattr(induction, "COMMON_TOKENS", 5)
  ids, _ = induction.common_tokens(config, lengths=[32], seed=0, data=str(text))
  counts = np.bincount(val, minlength=64)
  # The five largest counts, ties to the lower id.
  want = sorted(sorted(range(64), key=lambda i: (-counts[i], i))[:5])
  np.testing.assert_array_equal(ids, want)


def _check_selection(part, *, layers, windows, length=32, top_k=4):
  rows = {r["selector"]: r for r in part["rows"]}
  assert set(rows) == {"bsa", "pisa1", "pisa2", "pisa", "exact"}
  # Queries 16..31 (more than K = 4 eligible blocks of 4), every layer, window and KV head.
  counted = layers * windows * (length - 16) * 2
  for name, row in rows.items():
    assert row["rows"] == counted and row["top_k"] == top_k and row["length"] == length
    for metric in ("recall", "captured_mass", "mass_ratio"):
      assert 0 <= row[metric] <= 1 + 1e-6, (name, metric, row)
    buckets = [b for b in part["by_position"] if b["selector"] == name]
    assert [(b["start"], b["end"]) for b in buckets] == [(16, 24), (24, 32)]
    assert sum(b["rows"] for b in buckets) == row["rows"]
    for metric in ("recall", "captured_mass", "mass_ratio"):
      back = sum(b[metric] * b["rows"] for b in buckets) / row["rows"]
      np.testing.assert_allclose(back, row[metric], rtol=1e-5, atol=1e-6)
  # One query head per KV head: full attention's block mass ranks as the exact LSE does.
  np.testing.assert_allclose(rows["exact"]["recall"], 1.0, atol=1e-6)
  np.testing.assert_allclose(rows["exact"]["mass_ratio"], 1.0, atol=1e-6)


def test_selection_on_the_checkpoint(evaluated):
  result, _ = evaluated
  part = result["parts"]["selection"]
  assert part["block_size"] == 4 and part["top_k"] == [4] and part["layers"] == 1
  _check_selection(part, layers=1, windows=SAMPLES)


def _npz(path, **arrays):
  np.savez(path, **arrays)
  return str(path)


def test_selection_on_arrays_from_an_npz(evaluated, tmp_path):
  # Two layers of random post-RoPE-like arrays, of the checkpoint's shapes (compiled code reused).
  rng = np.random.default_rng(1)
  q = rng.normal(size=(2, SAMPLES, 32, 2, 16)).astype(np.float32)
  k = rng.normal(size=(2, SAMPLES, 32, 2, 16)).astype(np.float32)
  out = tmp_path / "arrays"
  assert cli.main(["--npz", _npz(tmp_path / "qk.npz", q=q, k=k), "--out", str(out),
                   "--block-size", "4", "--top-k", "4", "--beam-factors", "1",
                   "--no-progress"]) == 0
  result = json.loads((out / "eval.json").read_text())
  assert result["checkpoint"] is None and list(result["parts"]) == ["selection"]
  part = result["parts"]["selection"]
  assert part["source"]["kind"] == "npz" and part["source"]["layers"] == 2
  _check_selection(part, layers=2, windows=SAMPLES)
  # The row for pisa is selection_quality of pisa's own selection, averaged over the layers
  # (placed on the device as the suite places them, which reuses its compiled selector).
  put = lambda a: jax.device_put(a, jax.devices()[0])
  want = [pisa_jax.selection_quality(
      put(q[i]), put(k[i]), pisa_jax.select_blocks(put(q[i]), put(k[i]), block_size=4, top_k=4,
                                                   implementation="xla"),
      block_size=4).recall for i in range(2)]
  (pisa,) = [r for r in part["rows"] if r["selector"] == "pisa"]
  np.testing.assert_allclose(pisa["recall"], np.mean(want), rtol=1e-6)


def test_ctrl_c_keeps_the_finished_parts_whole_and_says_how_to_finish(evaluated, tmp_path,
                                                                     capsys, monkeypatch):
  import os
  import signal

  from pisa_jax.train.evaluation import report

  saved, _ = evaluated
  result = {**saved, "parts": {}}
  real_plots = report.write_plots

  def plots_under_ctrl_c(result, out):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while ppl's files are being written
    return real_plots(result, out)

  def interrupted():
    raise KeyboardInterrupt

  monkeypatch.setattr(report, "write_plots", plots_under_ctrl_c)
  run = {"ppl": lambda: dict(saved["parts"]["ppl"]), "mqar": interrupted,
         "selection": interrupted}
  assert cli._run_parts(run, result, tmp_path, report) == 130
  err = capsys.readouterr().err
  assert err.strip() == (
      f"pisa-eval: interrupted during mqar: {tmp_path / 'eval.json'} keeps ppl of this run; "
      f"rerun with --suite mqar,selection to finish (parts already in eval.json from the same "
      f"checkpoint are kept)"), err
  # The Ctrl-C waited for ppl's files: eval.json, eval.md and the plot are whole.
  assert list(json.loads((tmp_path / "eval.json").read_text())["parts"]) == ["ppl"]
  assert sorted(os.listdir(tmp_path)) == ["eval.json", "eval.md", "ppl.png"]
  assert "## ppl" in (tmp_path / "eval.md").read_text()
  # Nothing written yet: the command says so, with status 130.
  monkeypatch.setattr(report, "write_plots", real_plots)
  from pisa_jax.train.evaluation import selection
  monkeypatch.setattr(selection, "run_on_arrays", lambda *a, **kw: interrupted())
  good = np.zeros((1, 1, 16, 2, 8), np.float32)
  out = tmp_path / "arrays"
  assert cli.main(["--npz", _npz(tmp_path / "qk.npz", q=good, k=good), "--out", str(out),
                   "--block-size", "4", "--top-k", "4"]) == 130
  assert capsys.readouterr().err.strip() == (
      f"pisa-eval: interrupted during selection: nothing of this run was written to {out}; "
      f"rerun with --suite selection to finish (parts already in eval.json from the same "
      f"checkpoint are kept)")
  assert os.listdir(out) == []


def test_compare_puts_runs_in_one_table(evaluated, tiny_run, tmp_path, capsys):
  out = tmp_path / "arrays"
  rng = np.random.default_rng(2)
  q = rng.normal(size=(1, SAMPLES, 32, 2, 16)).astype(np.float32)
  assert cli.main(["--npz", _npz(tmp_path / "qk.npz", q=q, k=q), "--out", str(out),
                   "--block-size", "4", "--top-k", "4", "--beam-factors", "1",
                   "--no-progress"]) == 0
  capsys.readouterr()
  assert cli.main(["--compare", str(tiny_run), str(out / "eval.json"),
                   "--out", str(tmp_path)]) == 0
  printed = capsys.readouterr().out
  table = (tmp_path / "compare.md").read_text()
  assert table in printed
  ppl = evaluated[0]["parts"]["ppl"]["rows"][0]["ppl"]
  assert re.search(rf"\| {tiny_run.name} \| 2 \| dense \| {ppl:.3f} \|", table)
  assert "| arrays | – | – | – |" in table
  assert "## Selection, Recall@4 at 32 tokens" in table and "## MQAR" in table


def _fake_ruler():
  """RULER's interface with prompts of 4-12 random GPT-2 tokens and answers that score 1 for
  "yes": the scores do not depend on the model, so the aggregation can be checked exactly."""
  def make_samples(task, *, length, num_samples, seed=0, tokenizer=None, haystack=None):
    assert haystack == "the essays" and tokenizer.encode("Hello world") == [15496, 995]
    rng = random.Random(f"{task}/{length}/{seed}")
    samples = []
    for _ in range(num_samples):
      tokens = [rng.randrange(50_000) for _ in range(rng.randint(4, 12))]
      samples.append(types.SimpleNamespace(
          task=task, length=length, prompt=tokenizer.decode(tokens), prompt_tokens=tokens,
          answers=(rng.choice(["yes", "no"]),), max_new_tokens=2 if task[0] == "m" else 3))
    return samples

  return types.SimpleNamespace(
      FAMILIES={"single_key": ("s1", "s2", "s3"), "multi_key": ("m1", "m2", "m3"),
                "multi_query": ("q",), "multi_value": ("v",)},
      make_samples=make_samples, load_haystack=lambda cache_dir=None: "the essays",
      score=lambda prediction, answers: float(answers[0] == "yes"))


@pytest.fixture(scope="module")
def gpt2_model():
  """A dense model over GPT-2's vocabulary with random weights (nothing to train for checking
  the runner), as a run restored at step 7 with a context of 64 tokens. The weights are drawn
  with numpy into the model's abstract shapes: Decoder's own initialisation compiles each of its
  random ops for its shape, which takes longer than everything else this fixture feeds."""
  config = validate(apply_overrides(get_config("tiny"), TINY_EVAL + [
      "model.vocab_size=50257", "train.seq_len=64", "data.source=tokens",
      "data.path=unused"]))
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config.model, rngs=nnx.Rngs(0))),
                               nnx.Param)
  rng = np.random.default_rng(0)
  weights = jax.tree_util.tree_map_with_path(
      lambda path, a: np.ones(a.shape, a.dtype) if "scale" in jax.tree_util.keystr(path)
      else rng.normal(0, 0.3, a.shape).astype(a.dtype), nnx.to_pure_dict(params))
  nnx.replace_by_pure_dict(params, weights)
  return config, nnx.merge(graphdef, params)


def test_ruler_through_a_stand_in_module(gpt2_model, tmp_path, monkeypatch):
  from pisa_jax.train.tokenizer import gpt2_encoding

  config, model = gpt2_model
  fake = _fake_ruler()
  monkeypatch.setitem(__import__("sys").modules, needles.RULER_MODULE, fake)
  monkeypatch.setattr(cli, "restore_model", lambda workdir: (config, model, 7))
  (tmp_path / "config.json").write_text(config.to_json())  # a run folder, as the CLI checks
  assert cli.main(["--workdir", str(tmp_path), "--suite", "ruler", "--lengths", "32,64",
                   "--samples", "2", "--batch-size", "2", "--no-progress",
                   "--ruler-answers"]) == 0
  part = json.loads((tmp_path / "eval" / "eval.json").read_text())["parts"]["ruler"]
  assert {(a["family"], a["length"]) for a in part["answer_scores"]} <= {
      (f, n) for f in fake.FAMILIES for n in (32, 64)} and part["answer_scores"]
  encoding = gpt2_encoding()
  # Each prediction is the greedy continuation of its prompt alone (a batch of two copies).
  records = [json.loads(line) for line in (tmp_path / "eval" / part["predictions"]).open()]
  assert len(records) == 2 * 8 * 2
  for r in records[::5]:
    (s,) = [s for s in fake.make_samples(r["task"], length=r["length"], num_samples=2,
                                         tokenizer=encoding, haystack="the essays")
            [r["index"]:r["index"] + 1]]
    alone = pisa_jax.generate(model, [s.prompt_tokens] * 2, max_new_tokens=s.max_new_tokens,
                              stop_tokens=(50256,)).sequences()[0]
    assert r["prediction"] == encoding.decode([t for t in alone if t != 50256])
  # Per task the mean score, per family the mean of its tasks, the average over both.
  want = {}
  for family, tasks in fake.FAMILIES.items():
    for length in (32, 64):
      per_task = [np.mean([a == ("yes",) for a in (s.answers for s in fake.make_samples(
          t, length=length, num_samples=2, tokenizer=encoding, haystack="the essays"))])
                  for t in tasks]
      want[(family, length)] = np.mean(per_task)
  got = {(r["family"], r["length"]): r["score"] for r in part["families"]}
  assert got == pytest.approx(want)
  assert part["average"] == pytest.approx(np.mean(list(want.values())))
  assert [r["length"] for r in part["by_length"]] == [32, 64]
  md = (tmp_path / "eval" / "eval.md").read_text()
  assert "| run | niah_single 32 | niah_single 64 | niah_multikey 32 |" in md


def test_ruler_with_the_real_task_module(gpt2_model):
  ruler = pytest.importorskip(needles.RULER_MODULE)
  config, model = gpt2_model
  # The two tasks whose haystack is generated (noise lines, distractor needles), not essays.
  subset = types.SimpleNamespace(
      FAMILIES={"single_key": ("niah_single_1",), "multi_key": ("niah_multikey_2",)},
      make_samples=ruler.make_samples, score=ruler.score, load_haystack=ruler.load_haystack)
  part, records = needles.run_ruler(model, config, lengths=[256], samples=1, seed=0,
                                    batch_size=1, progress=False, ruler=subset, haystack="")
  assert [r["task"] for r in records] == ["niah_single_1", "niah_multikey_2"]
  for r in records:
    assert r["prompt_tokens"] + 128 <= 256 and r["new_tokens"] <= 128
    assert r["score"] == ruler.score(r["prediction"], r["answers"])
  assert part["average"] == pytest.approx(np.mean([r["score"] for r in records]))
  assert "answer_scores" not in part and "answer_hit" not in records[0]
  # The answer teacher-forced after the prompt: its tokens' NLL and whether each is the argmax.
  from pisa_jax.train.tokenizer import gpt2_encoding

  part, records = needles.run_ruler(model, config, lengths=[256], samples=1, seed=0,
                                    batch_size=1, progress=False, ruler=subset, haystack="",
                                    answer_scores=True)
  encoding = gpt2_encoding()
  for r in records:
    (sample,) = ruler.make_samples(r["task"], length=256, num_samples=1, seed=0,
                                   tokenizer=encoding, haystack="")
    answer = encoding.encode(" " + r["answers"][0])
    tokens = np.array(sample.prompt_tokens + answer)
    logp = np.asarray(_log_probs(model, jnp.asarray(tokens[None, :-1])), np.float64)[0]
    span = np.arange(len(sample.prompt_tokens) - 1, len(tokens) - 1)
    np.testing.assert_allclose(r["answer_nll"], -logp[span, tokens[span + 1]].mean(), rtol=2e-4)
    assert r["answer_hit"] == bool((logp[span].argmax(-1) == tokens[span + 1]).all())
  assert [(a["family"], a["samples"]) for a in part["answer_scores"]] == [
      ("single_key", 1), ("multi_key", 1)]
  assert part["answer_scores"][0]["nll"] == pytest.approx(records[0]["answer_nll"])


def test_ppl_of_a_packed_run_scores_each_document_alone(evaluated, tmp_path):
  """A run trained with data.packing is scored as it trained: no token sees another document,
  positions restart, and the target after an end-of-text token does not count."""
  from pisa_jax.train.data import document_layout
  from pisa_jax.train.evaluation import perplexity

  _, model = evaluated
  eot = 63
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, eot, 200)
  tokens[rng.choice(200, 12, replace=False)] = eot
  for split in ("train", "val"):
    tokens.astype(np.uint16).tofile(tmp_path / f"{split}.bin")
  (tmp_path / "meta.json").write_text(json.dumps(
      {"format": FORMAT, "vocab_size": 64, "train_tokens": 200, "val_tokens": 200, "eot": eot}))
  config = validate(apply_overrides(get_config("tiny"), TINY_EVAL + [
      "data.source=tokens", f"data.path={tmp_path}", "data.packing=true"]))
  part = perplexity.run_perplexity(model, config, lengths=[32], samples=SAMPLES, seed=0,
                                   data=None, batch_size=4, progress=False)
  (row,) = part["rows"]
  assert row["data"]["packing"] is True
  total = count = 0.0
  for start in row["data"]["starts"]:
    x, y = tokens[start:start + 32], tokens[start + 1:start + 33]
    layout = document_layout(x[None], eot)
    ids, weights = layout["segment_ids"][0], layout["weights"][0]
    for doc in np.unique(ids):
      at = np.flatnonzero(ids == doc)
      nll = _nll(model, x[None, at], y[None, at])[0]
      total += float((nll * weights[at]).sum())
      count += float(weights[at].sum())
  assert row["tokens"] == int(count) < SAMPLES * 32
  np.testing.assert_allclose(row["loss"], total / count, rtol=1e-5)


def test_ruler_reads_ids_past_the_tokenizer_as_nothing(monkeypatch):
  """A model's table may hold more rows than its tokenizer has ids (Qwen pads 151,665 tokens to
  151,936): RULER runs, and a generated id past the tokenizer's has no text."""
  from pisa_jax.train.tokenizer import gpt2_encoding

  encoding = gpt2_encoding()
  config = types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=50304))
  answer = encoding.encode_ordinary(" yes")
  monkeypatch.setattr(needles, "greedy", lambda model, prompts, budgets, **kw: [
      [50300, *answer, 50303] for _ in prompts])
  part, records = needles.run_ruler(None, config, lengths=[32], samples=1, seed=0,
                                    batch_size=1, progress=False, ruler=_fake_ruler(),
                                    haystack="the essays")
  assert records and {r["prediction"] for r in records} == {" yes"}


def test_bad_input_is_one_line_naming_it(tiny_run, text, tmp_path, capsys):
  def fails(argv, pattern):
    with pytest.raises(SystemExit) as e:
      cli.main(argv + ["--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pisa-eval: error: "), err
    assert re.search(pattern, err), err

  run = ["--workdir", str(tiny_run)]
  fails(["--workdir", str(tmp_path), "--suite", "ppl"], r"--workdir: .* no config\.json")
  fails(run + ["--suite", "ppl,bleu"],
        r"--suite: unknown suite 'bleu': known ppl, ruler, mqar, induction, selection")
  fails(run, r"--suite: required")
  fails(run + ["--suite", "ppl", "--lengths", "32,16"], r"--lengths: 32,16 must be increasing")
  fails(run + ["--suite", "ppl", "--lengths", "16,16"], r"--lengths: 16,16 must be increasing")
  fails(run + ["--suite", "ppl", "--lengths", "0"], r"--lengths: 0 must be > 0")
  fails(run + ["--suite", "ppl", "--lengths", "1k"], r"--lengths: '1k' is not an int")
  fails(run + ["--suite", "ppl", "--lengths", "64"],
        r"--lengths: 64 exceeds the model's context of 32 \(train\.seq_len")
  fails(run + ["--suite", "ppl", "--lengths", "8"], r"--lengths: 8 is too short .* 4 pairs")
  fails(run + ["--suite", "ppl", "--data", str(tmp_path)], r"--data: .* not a folder written")
  fails(run + ["--suite", "ppl", "--data", str(text), "--lengths", "256", "--context", "512"],
        r"--lengths: 256 needs 257 tokens of held-out text")
  fails(run + ["--suite", "ruler", "--lengths", "32"], r"--suite: ruler prompts are GPT-2 tokens")
  fails(run + ["--suite", "mqar", "--mqar-pairs", "32"], r"--mqar-pairs: 32 pairs need 32")
  fails(run + ["--suite", "induction", "--lengths", "3,32"],
        r"--lengths: 3 is too short for the induction suite")
  fails(run + ["--suite", "selection", "--top-k", "2"], r"--top-k=2 must be an int >= 3")
  fails(run + ["--suite", "selection", "--block-size", "64"], r"--block-size: 64 exceeds")
  fails(run + ["--suite", "ppl", "--top-k", "4"], r"--top-k: applies to the selection suite only")
  fails(run + ["--suite", "ppl", "--ruler-answers"],
        r"--ruler-answers: applies to the ruler suite only")
  fails(run + ["--suite", "mqar", "--data", str(text)],
        r"--data: applies to the ppl and selection suites only")
  fails(["--compare", str(tmp_path)], r"--compare: .* has no eval\.json")
  fails(["--compare", str(tmp_path), "--samples", "3"], r"--samples: does not apply to --compare")

  good = np.zeros((1, 1, 16, 2, 8), np.float32)
  npz = ["--out", str(tmp_path / "out")]
  fails(["--npz", str(tmp_path / "missing.npz")] + npz, r"--npz: .*missing\.npz does not exist")
  (tmp_path / "notes.txt").write_text("not arrays")
  fails(["--npz", str(tmp_path / "notes.txt")] + npz,
        r"--npz: .*notes\.txt is not an \.npz file \(it is not a zip archive\); expected an "
        r"\.npz archive \(np\.savez\) of q \[L, B, T, HQ, D\] and k")
  fails(["--npz", _npz(tmp_path / "a.npz", q=good)] + npz, r"--npz: .* has no array 'k'")
  fails(["--npz", _npz(tmp_path / "b.npz", q=good[0], k=good)] + npz,
        r"--npz: q has shape \(1, 16, 2, 8\), rank 4; expected rank 5")
  fails(["--npz", _npz(tmp_path / "c.npz", q=good, k=good.astype(np.int32))] + npz,
        r"--npz: k has dtype int32")
  fails(["--npz", _npz(tmp_path / "d.npz", q=good, k=good[:, :, :8])] + npz,
        r"--npz: k has shape \(1, 1, 8, 2, 8\) and q \(1, 1, 16, 2, 8\)")
  fails(["--npz", _npz(tmp_path / "e.npz", q=good[:, :, :, :1], k=good)] + npz,
        r"--npz: q has 1 heads, not a multiple of k's 2")
  fails(["--npz", _npz(tmp_path / "f.npz", q=good, k=good), "--lengths", "32"] + npz,
        r"--lengths: 32 exceeds the arrays' T = 16")
  fails(["--npz", str(tmp_path / "f.npz"), "--suite", "ppl"] + npz, r"--suite: ppl: --npz")
  fails(["--npz", str(tmp_path / "f.npz")], r"--out: required with --npz")


def test_mixture_suite_scores_held_out_needle_documents(gpt2_model, tmp_path, monkeypatch):
  """--suite mixture: needle documents of the training templates over the val split of the run's
  data.retrieval_path, every family at every length, with a table, a plot and a compare row."""
  pytest.importorskip("tiktoken")
  from pisa_jax.train.prepare_data import write_corpus
  from pisa_jax.train.tokenizer import gpt2_bpe_path

  if gpt2_bpe_path() is None:
    pytest.skip("gpt2.tiktoken absent")
  words = "the river ran past a quiet town where people kept small gardens and old books".split()
  rng = random.Random(0)
  docs = [" ".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 12))).capitalize()
                   + "." for _ in range(rng.randint(10, 30))) for _ in range(60)]
  write_corpus(iter(docs), tmp_path / "haystack", val_fraction=0.5, seed=0, sources=["toy"])
  config, model = gpt2_model
  config = apply_overrides(config, ["train.seq_len=256",
                                    f"data.retrieval_path={tmp_path / 'haystack'}"])
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text(config.to_json())
  monkeypatch.setattr(cli, "restore_model", lambda workdir: (config, model, 7))
  assert cli.main(["--workdir", str(run), "--suite", "mixture", "--lengths", "128,256",
                   "--samples", "2", "--batch-size", "2", "--no-progress"]) == 0
  result = json.loads((run / "eval" / "eval.json").read_text())
  part = result["parts"]["mixture"]
  assert [(r["length"], r["family"]) for r in part["rows"]] == [
      (n, f) for n in (128, 256) for f in ("single_key", "multi_key", "multi_query",
                                           "multi_value")]
  assert all(0 <= r["accuracy"] <= 1 and r["answer_nll"] > 0 for r in part["rows"])
  assert len(part["records"]) == 2 * 4 * 2
  assert "Held-out needle documents" in (run / "eval" / "eval.md").read_text()
  assert (run / "eval" / "mixture.png").is_file()
  from pisa_jax.train.evaluation import report
  assert "single-key @ 128" in report.compare([("run", result)])
  # A run trained without the mixture has no templates to test.
  plain = apply_overrides(config, ["data.retrieval_path=none"])
  monkeypatch.setattr(cli, "restore_model", lambda workdir: (plain, model, 7))
  with pytest.raises(SystemExit) as e:
    cli.main(["--workdir", str(run), "--suite", "mixture", "--lengths", "128", "--no-progress"])
  assert e.value.code == 2
