"""Packed documents (segment_ids) through the jnp reference, the model and the data loader.

The contract: every query's selected blocks, output and gradients are what its document returns
when run alone from position 0. Each test slices every document out, runs the unpacked reference
on it, and compares rows. Document lengths are ugly on purpose: 1, shorter than a block, starting
and ending mid-block, and a row of hundreds of documents.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import checkify

import pisa_jax
from pisa_jax import segments, testing
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.geometry import level_sizes
from pisa_jax.models import Decoder, ModelConfig
from pisa_jax.train.data import FORMAT, TokenWindows, document_layout
import tolerances

# Two rows with different layouts (T = 111): documents of one token, shorter than a block, and
# starting or ending mid-block for every block size used below. Few distinct lengths, so that
# the documents run alone compile few times.
ROWS = ([1, 3, 5, 13, 3, 50, 1, 13, 5, 1, 3, 13], [13, 1, 1, 50, 5, 3, 13, 5, 3, 13, 1, 3])
# A shorter pair (T = 63) for the attention and gradient tests.
SHORT_ROWS = ([5, 1, 22, 1, 5, 29], [29, 5, 22, 1, 1, 5])


def segment_ids(rows) -> np.ndarray:
  return np.stack([np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32)


def documents(rows):
  """(row, start, length) of every document."""
  for b, lengths in enumerate(rows):
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for s, n in zip(starts, lengths):
      yield b, int(s), int(n)


def make_qkv(seq_len, hq=4, hkv=2, d=8, batch=2, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (batch, seq_len, hq, d)),
          jax.random.normal(kk, (batch, seq_len, hkv, d)),
          jax.random.normal(kv, (batch, seq_len, hkv, d)))


def assert_rows_match_alone(got, q, k, rows, alone, *, selection):
  """Index rows equal each document's own selection; a differing row must be a float32 near-tie
  of the document alone, proven by the float64 re-walk."""
  for b, s, n in documents(rows):
    want = np.asarray(alone(q[b:b + 1, s:s + n], k[b:b + 1, s:s + n]))
    rows_got = np.asarray(got[b:b + 1, s:s + n])
    if np.array_equal(rows_got, want):
      continue
    margins = testing.mismatch_margins(rows_got, want, q[b:b + 1, s:s + n], k[b:b + 1, s:s + n],
                                       **selection)
    assert all(m < tolerances.SELECTION_NEAR_TIE_RTOL for *_, m in margins), (b, s, n, margins)


# Capacities: the static slots of the packed layout hold every possible layout.
@pytest.mark.parametrize("seq_len,block_size,branching", [(37, 4, 2), (64, 2, 3), (100, 3, 4)])
def test_capacities_hold_every_layout(seq_len, block_size, branching):
  caps = segments.packed_capacities(seq_len, block_size, branching)
  assert len(caps) == len(level_sizes(seq_len, block_size, branching)) and caps[0] == seq_len

  def used(lengths):
    per_level = np.zeros(len(caps), int)
    for n in lengths:
      sizes = level_sizes(n, block_size, branching)
      per_level[:len(sizes)] += sizes
    return per_level

  rng = np.random.default_rng(0)
  layouts = [[1] * seq_len]
  # The worst cases of each level: documents one key longer than a node of the level below, or
  # than a node of this level.
  for level in range(1, len(caps)):
    for n in (block_size * branching ** (level - 1) + 1, block_size * branching ** level + 1):
      layouts.append([n] * (seq_len // n) + ([seq_len % n] if seq_len % n else []))
  for _ in range(300):
    cuts = np.sort(rng.choice(np.arange(1, seq_len), rng.integers(0, seq_len // 2), False))
    layouts.append(list(np.diff(np.concatenate([[0], cuts, [seq_len]]))))
  peak = np.max([used(lengths) for lengths in layouts], axis=0)
  assert np.all(peak <= caps), (peak, caps)
  assert peak[0] == caps[0]


def test_pyramid_is_each_documents_own():
  seg = jnp.asarray(segment_ids(ROWS))
  _, k, _ = make_qkv(seg.shape[1], hkv=3)
  pyr = pisa_jax.build_pyramid(k, block_size=4, branching=2, segment_ids=seg, implementation="xla")
  assert isinstance(pyr, pisa_jax.PackedPyramid)
  assert [s.shape[1] for s in pyr.summaries] == list(segments.packed_capacities(111, 4, 2))
  used = np.zeros(pyr.num_levels, int)
  for b, s, n in documents(ROWS):
    alone = pisa_jax.build_pyramid(k[b:b + 1, s:s + n], block_size=4, branching=2)
    for level in range(pyr.num_levels):
      first = int(pyr.first_node[b, s, level])
      # Every position of a document names the same first node.
      np.testing.assert_array_equal(pyr.first_node[b, s:s + n, level], first)
      if level >= alone.num_levels:
        assert first == -1
        continue
      m = alone.summaries[level].shape[1]
      np.testing.assert_allclose(pyr.summaries[level][b, first:first + m],
                                 alone.summaries[level][0], atol=tolerances.PYRAMID_ATOL)
      np.testing.assert_array_equal(pyr.counts[level][b, first:first + m], alone.counts[level])
      used[level] += m
  # Nothing else is stored: the slots past the documents' nodes are empty.
  assert sum(int((c > 0).sum()) for c in pyr.counts) == used.sum()


SELECTION_CASES = [
    # selector, block_size, top_k, branching, beam
    ("pisa", 4, 3, 2, None),
    ("pisa", 4, 3, 2, 6),
    ("pisa1", 8, 4, 3, None),
    ("pisa2", 4, 4, 2, 5),
    ("pisa", 16, 3, 4, None),
    ("bsa", 4, 3, 2, None),
    ("exact", 8, 3, 2, None),
]


@pytest.mark.parametrize("selector,block_size,top_k,branching,beam", SELECTION_CASES,
                         ids=[f"{s}-C{c}-K{k}-g{g}-beam{b}" for s, c, k, g, b in SELECTION_CASES])
def test_selection_equals_each_document_alone(selector, block_size, top_k, branching, beam):
  seg = jnp.asarray(segment_ids(ROWS))
  q, k, _ = make_qkv(seg.shape[1], seed=1)
  selection = dict(block_size=block_size, top_k=top_k, branching=branching, selector=selector)
  got = pisa_jax.select_blocks(q, k, beam=beam, segment_ids=seg, implementation="xla",
                               **selection)

  def alone(q, k):
    return pisa_jax.select_blocks(q, k, beam=beam, implementation="xla", **selection)

  proof = dict(selection, scale=1 / np.sqrt(8), beam=beam or top_k)
  if selector == "exact":
    # decision_margin re-walks the hierarchical and bsa selectors only: exact must match exactly.
    for b, s, n in documents(ROWS):
      np.testing.assert_array_equal(got[b:b + 1, s:s + n], alone(q[b:b + 1, s:s + n],
                                                                  k[b:b + 1, s:s + n]))
  else:
    assert_rows_match_alone(got, q, k, ROWS, alone, selection=proof)


@pytest.mark.parametrize("selector", ["pisa", "bsa"])
def test_hundreds_of_documents_in_a_row(selector):
  lengths = list(np.random.default_rng(2).integers(1, 4, 140))
  lengths[-1] += 300 - sum(lengths)
  rows = (lengths,)
  seg = jnp.asarray(segment_ids(rows))
  assert seg.shape[1] == 300 and len(set(lengths)) <= 4
  q, k, _ = make_qkv(300, batch=1, seed=2)
  selection = dict(block_size=2, top_k=4, branching=2, selector=selector)
  got = pisa_jax.select_blocks(q, k, segment_ids=seg, implementation="xla", **selection)

  def alone(q, k):
    return pisa_jax.select_blocks(q, k, implementation="xla", **selection)

  assert_rows_match_alone(got, q, k, rows, alone,
                          selection=dict(selection, scale=1 / np.sqrt(8), beam=4))


def document_block_indices(rows, hkv, top_k, block_size, seed=0):
  """Random valid document-relative indices `[B, T, HKV, K]`, some rows thinned to fewer blocks."""
  out = np.full((len(rows), sum(rows[0]), hkv, top_k), -1, np.int32)
  for i, (b, s, n) in enumerate(documents(rows)):
    out[b, s:s + n] = testing.random_block_indices(seed + i, n, hkv, top_k, block_size,
                                                   thin_rows=0.2)[0]
  return jnp.asarray(out)


def output_and_grads(attend):
  """jit of (q, k, v, w, *args) -> attend's output and d(sum(out * w))/d(q, k, v)."""
  def run(q, k, v, w, *args):
    def loss(q, k, v):
      out = attend(q, k, v, *args)
      return jnp.sum(out * w), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out,) + grads
  return jax.jit(run)


def assert_grads_match_alone(run, rows, packed_args, alone_args, per_query):
  """run(q, k, v, w, *args) on the packed rows against each document alone (its rows of the
  `per_query` arrays, the other arguments as given)."""
  got = run(*per_query, *packed_args)
  for b, s, n in documents(rows):
    want = run(*(x[b:b + 1, s:s + n] for x in per_query), *alone_args(b, s, n))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
      np.testing.assert_allclose(g[b:b + 1, s:s + n], w, atol=tolerances.GRAD_ATOL[jnp.float32],
                                 rtol=tolerances.GRAD_RTOL[jnp.float32], err_msg=name)


@pytest.mark.parametrize("block_size,top_k", [(4, 3)])
def test_sparse_attention_and_gradients_equal_each_document_alone(block_size, top_k):
  seg = jnp.asarray(segment_ids(SHORT_ROWS))
  q, k, v = make_qkv(seg.shape[1], hq=6, hkv=2, seed=3)
  idx = document_block_indices(SHORT_ROWS, 2, top_k, block_size)
  cotangent = jax.random.normal(jax.random.key(4), q.shape)
  run = output_and_grads(lambda q, k, v, idx, *seg: pisa_jax.sparse_attention(
      q, k, v, idx, block_size=block_size, segment_ids=seg[0] if seg else None,
      implementation="xla"))
  assert_grads_match_alone(run, SHORT_ROWS, (idx, seg),
                           lambda b, s, n: (idx[b:b + 1, s:s + n],), (q, k, v, cotangent))


def test_pisa_attention_gradients_equal_each_document_alone():
  seg = jnp.asarray(segment_ids(SHORT_ROWS))
  q, k, v = make_qkv(seg.shape[1], seed=5)
  cotangent = jax.random.normal(jax.random.key(6), q.shape)
  run = output_and_grads(lambda q, k, v, *seg: pisa_jax.pisa_attention(
      q, k, v, block_size=4, top_k=3, segment_ids=seg[0] if seg else None,
      implementation="xla"))
  assert_grads_match_alone(run, SHORT_ROWS, (seg,), lambda b, s, n: (), (q, k, v, cotangent))


def test_one_document_per_row_is_the_unpacked_call():
  q, k, v = make_qkv(70, seed=7)
  seg = jnp.zeros((2, 70), jnp.int32)
  kw = dict(block_size=8, top_k=3, implementation="xla")
  idx = pisa_jax.select_blocks(q, k, **kw)
  np.testing.assert_array_equal(pisa_jax.select_blocks(q, k, segment_ids=seg, **kw), idx)
  np.testing.assert_allclose(
      pisa_jax.sparse_attention(q, k, v, idx, block_size=8, segment_ids=seg),
      pisa_jax.sparse_attention(q, k, v, idx, block_size=8),
      atol=tolerances.OUTPUT_ATOL[jnp.float32], rtol=tolerances.OUTPUT_RTOL[jnp.float32])


def test_packed_calls_jit_with_traced_segment_ids():
  seg = jnp.asarray(segment_ids(SHORT_ROWS))
  q, k, v = make_qkv(seg.shape[1], seed=8)
  kw = dict(block_size=4, top_k=3, implementation=None)  # None resolves to xla on a CPU
  attend = jax.jit(pisa_jax.pisa_attention, static_argnames=tuple(kw))
  select = jax.jit(pisa_jax.select_blocks, static_argnames=tuple(kw))
  np.testing.assert_array_equal(select(q, k, segment_ids=seg, **kw),
                                pisa_jax.select_blocks(q, k, segment_ids=seg, **kw))
  np.testing.assert_allclose(attend(q, k, v, segment_ids=seg, **kw),
                             pisa_jax.pisa_attention(q, k, v, segment_ids=seg, **kw), atol=1e-6)
  pyramid = jax.jit(pisa_jax.build_pyramid, static_argnames=("block_size",))(
      k, block_size=4, segment_ids=seg)
  assert pyramid.summaries[0].shape == (2, seg.shape[1], 2, 8)


def test_checkify_reports_decreasing_segment_ids_under_jit():
  _, k, _ = make_qkv(12, seed=9)
  bad = jnp.asarray([[0] * 6 + [1] * 6, [0] * 4 + [2] * 4 + [1] * 4], jnp.int32)
  fn = checkify.checkify(jax.jit(lambda k, s: pisa_jax.build_pyramid(
      k, block_size=4, segment_ids=s, implementation="xla").summaries))
  err, _ = fn(k, bad)
  err.throw()  # not traced outside traced_checks(True)
  with pisa_jax.traced_checks(True):
    err, _ = fn(k, bad)
  with pytest.raises(checkify.JaxRuntimeError, match="segment_ids must be non-decreasing"):
    err.throw()
  with pisa_jax.traced_checks(True):
    err, _ = fn(k, jnp.sort(bad, axis=1))
  err.throw()


@pytest.mark.parametrize("segment,error,match", [
    (jnp.zeros((1, 20), jnp.float32), TypeError, "segment_ids must be an int32 array"),
    (np.zeros((1, 20), np.int64), TypeError, "segment_ids must be an int32 array"),
    (jnp.zeros((20,), jnp.int32), ValueError, r"segment_ids.shape=\(20,\) must be \[B, T\] = \[1, 20\]"),
    (jnp.zeros((1, 21), jnp.int32), ValueError, r"must be \[B, T\] = \[1, 20\]"),
    (jnp.asarray([[0] * 10 + [1] * 5 + [0] * 5], jnp.int32), ValueError,
     "segment_ids must be non-decreasing within each row.*t=14"),
])
@pytest.mark.parametrize("function", ["build_pyramid", "select_blocks", "sparse_attention",
                                      "pisa_attention"])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_bad_segment_ids_are_rejected_by_name(function, implementation, segment, error, match):
  q, k, v = make_qkv(20, batch=1)
  kw = dict(block_size=4, implementation=implementation)
  calls = {
      "build_pyramid": lambda s: pisa_jax.build_pyramid(k, segment_ids=s, **kw),
      "select_blocks": lambda s: pisa_jax.select_blocks(q, k, top_k=3, segment_ids=s, **kw),
      "sparse_attention": lambda s: pisa_jax.sparse_attention(
          q, k, v, jnp.full((1, 20, 2, 3), -1, jnp.int32), segment_ids=s, **kw),
      "pisa_attention": lambda s: pisa_jax.pisa_attention(q, k, v, top_k=3, segment_ids=s,
                                                          **kw),
  }
  with pytest.raises(error, match=match):
    calls[function](segment)


# The model: a packed row equals each of its documents run alone.
MODEL = ModelConfig(vocab_size=61, vocab_pad_multiple=32, num_layers=2, d_model=32, mlp_dim=64,
                    num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, top_k=3,
                    compute_dtype="float32")


@pytest.mark.parametrize("attention,remat", [("dense", "none"), ("pisa", "full")])
def test_model_on_packed_rows_equals_each_document_alone(attention, remat):
  rows = ([1, 14, 5, 14, 14], [14, 20, 14])
  graphdef, params = nnx.split(Decoder(dataclasses.replace(MODEL, attention=attention, remat=remat),
                                       rngs=nnx.Rngs(0)))
  forward = jax.jit(lambda params, tokens, *args: nnx.merge(graphdef, params).hidden_states(
      tokens, *args))
  hidden = functools.partial(forward, params)
  tokens = jax.random.randint(jax.random.key(1), (2, 48), 0, 61)
  seg = jnp.asarray(segment_ids(rows))
  got = hidden(tokens, seg)
  # Positions default to each token's place in its document.
  positions = jnp.arange(48) - segments.document_bounds(seg)[0]
  np.testing.assert_array_equal(got, hidden(tokens, seg, positions))
  for b, s, n in documents(rows):
    # Float32 sums of a two-layer model, in another order than the document alone's.
    np.testing.assert_allclose(got[b:b + 1, s:s + n], hidden(tokens[b:b + 1, s:s + n]),
                               atol=2e-5, rtol=2e-5)


def test_model_rejects_bad_positions():
  model = Decoder(MODEL, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match=r"positions must be an int32 array \[B, T\] = \[1, 8\]"):
    model.hidden_states(tokens, jnp.zeros((1, 8), jnp.int32), jnp.zeros((8,), jnp.int32))
  with pytest.raises(TypeError, match="segment_ids must be an int32 array"):
    model.hidden_states(tokens, jnp.zeros((1, 8), jnp.float32))


# The data loader.
EOT = 50_256


def test_document_layout_from_end_of_text_tokens():
  inputs = np.array([[5, 6, EOT, EOT, 7, 8, 9, EOT], [EOT, 1, 2, 3, 4, 5, 6, 7]])
  layout = document_layout(inputs, EOT)
  # An EOT closes (and belongs to) its document; the next token starts a new one.
  np.testing.assert_array_equal(layout["segment_ids"], [[0, 0, 0, 1, 2, 2, 2, 2],
                                                        [0, 1, 1, 1, 1, 1, 1, 1]])
  np.testing.assert_array_equal(layout["positions"], [[0, 1, 2, 0, 0, 1, 2, 3],
                                                      [0, 0, 1, 2, 3, 4, 5, 6]])
  # The target of an EOT position is the next document's first token: not predicted.
  np.testing.assert_array_equal(layout["weights"], [[1, 1, 0, 0, 1, 1, 1, 0],
                                                    [0, 1, 1, 1, 1, 1, 1, 1]])
  assert all(x.dtype == np.int32 for x in (layout["segment_ids"], layout["positions"]))


def _token_folder(tmp_path, eot=63, vocab=64, n=4000, write_eot=True):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab - 1, n)
  tokens[rng.random(n) < 0.05] = eot  # documents of about 20 tokens
  for split in ("train", "val"):
    tokens.astype(np.uint16).tofile(tmp_path / f"{split}.bin")
  meta = {"format": FORMAT, "vocab_size": vocab, "train_tokens": n, "val_tokens": n}
  if write_eot:
    meta["eot"] = eot
  (tmp_path / "meta.json").write_text(json.dumps(meta))
  return tmp_path


def test_loader_packing_emits_segment_ids_and_positions(tmp_path):
  folder = _token_folder(tmp_path)
  args = dict(seq_len=64, global_batch=4, accum=2, seed=3, vocab_size=64)
  packed = TokenWindows(folder, "train", packing=True, **args).batch(5)
  plain = TokenWindows(folder, "train", **args).batch(5)
  assert set(packed) == {"inputs", "targets", "weights", "segment_ids", "positions"}
  np.testing.assert_array_equal(packed["inputs"], plain["inputs"])
  np.testing.assert_array_equal(packed["targets"], plain["targets"])
  for key, value in document_layout(packed["inputs"], 63).items():
    np.testing.assert_array_equal(packed[key], value)
  assert packed["segment_ids"].shape == (2, 4, 64) and (packed["inputs"] == 63).any()
  with pytest.raises(ValueError, match='data.packing=true needs the end-of-text token'):
    (tmp_path / "no_eot").mkdir()
    TokenWindows(_token_folder(tmp_path / "no_eot", write_eot=False), "train", packing=True,
                 **args)


def test_packing_config_is_validated():
  with pytest.raises(ValueError, match="data.packing=true needs data.source='tokens'"):
    validate(apply_overrides(get_config("tiny"), ["data.source=mqar", "data.packing=true"]))
  # Every stage's kernels take segment_ids: packing runs on either implementation.
  validate(apply_overrides(get_config("tiny"), [
      "data.source=tokens", "data.path=x", "data.packing=true", "model.attention=pisa",
      "model.attention_implementation=pallas"]))


def test_a_packed_train_step_runs(tmp_path):
  from pisa_jax.train.data import make_batches
  from pisa_jax.train.trainer import build_trainer

  folder = _token_folder(tmp_path)
  cfg = validate(apply_overrides(get_config("tiny"), [
      "model.vocab_size=64", "model.vocab_pad_multiple=64", "model.num_layers=1",
      "model.d_model=32", "model.mlp_dim=64", "model.num_heads=4", "model.num_kv_heads=2",
      "model.head_dim=16", "model.block_size=16", "model.top_k=3", "model.attention=pisa",
      "data.source=tokens", f"data.path={folder}", "data.packing=true", "train.seq_len=64",
      "train.per_device_batch=2", "train.grad_accum=1", "train.steps=4", "train.warmup_steps=1",
      "train.decay_steps=1"]))
  trainer = build_trainer(cfg)
  batches = make_batches(cfg, "train", global_batch=trainer.global_batch, accum=1)
  _, metrics = trainer.train_step(trainer.init_state(),
                                  trainer.place_batch(batches.batch(0), trainer.batch_shardings))
  assert np.isfinite(float(metrics["loss"]))
