"""The lm-eval model "pisa-jax" (`pisa_jax.train.evaluation.lm_eval_adapter`) on a run trained here.

Each request type against an independent computation: loglikelihood (batched, sorted, left-
truncated) and loglikelihood_rolling against the log-softmax of a plain forward pass of the
model, generate_until against `pisa_jax.generate`; then lm-eval end to end, through the module's
`python -m` entry and lm-eval's own command line, on a local multiple-choice task and a local
generation task; then the bad arguments.
"""

from __future__ import annotations

import json
import runpy
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lm_eval.api.instance import Instance

import pisa_jax
from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.train.evaluation import lm_eval_adapter
from pisa_jax.train.tokenizer import EOT_TOKEN, gpt2_bpe_path

from tolerances import OUTPUT_ATOL, OUTPUT_RTOL

pytestmark = pytest.mark.skipif(
    gpt2_bpe_path() is None,
    reason="gpt2.tiktoken absent: pip install --no-deps openai-whisper==20250625",
)

PisaLM = lm_eval_adapter.PisaLM

SEQ_LEN = 32
# One dense layer over GPT-2's vocabulary, trained one step on a few sentences: what matters is
# that the checkpoint is a real pisa-train run; the adapter's code is the same for sparse models.
RUN = [
    "model.attention=dense", "model.vocab_size=50257", "model.num_layers=1", "model.d_model=32",
    "model.mlp_dim=64", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
    "data.source=tokens", f"train.seq_len={SEQ_LEN}", "train.per_device_batch=2",
    "train.grad_accum=1", "train.steps=1", "train.warmup_steps=0", "train.decay_steps=1",
    "train.checkpoint_every=1", "train.async_checkpointing=false", "train.log_every=1",
    "train.eval_every=1", "train.eval_batches=0",
]
SENTENCES = ["The capital of France is Paris.", "Two and two make four.",
             "The pyramid holds a summary of every block of keys."]
BATCH = 4
# The adapter reads at most this many tokens at once (model_args max_length; the run's own
# train.seq_len is the default): every test request then fits one compiled width.
MAX_LENGTH = 16
ATOL, RTOL = OUTPUT_ATOL[jnp.float32], OUTPUT_RTOL[jnp.float32]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  from pisa_jax.train.prepare_data import write_corpus
  from pisa_jax.train.trainer import train

  root = tmp_path_factory.mktemp("lm_eval")
  write_corpus(iter(SENTENCES * 20), root / "data", val_fraction=0.5, seed=0, sources=["test"])
  config = validate(apply_overrides(get_config("tiny"), RUN + [f"data.path={root / 'data'}"]))
  train(config, root / "run", progress=False, quiet=True)
  return root / "run"


@pytest.fixture(scope="module")
def lm(run):
  return PisaLM(workdir=str(run), batch_size=BATCH, max_length=MAX_LENGTH)


def _encode(text: str) -> list[int]:
  return lm_eval_adapter.gpt2_encoding().encode_ordinary(text)


@jax.jit
def _log_softmax(model, tokens):
  return jax.nn.log_softmax(model(tokens), axis=-1)


def _forward_scores(model, inputs: list[int], targets: list[int]) -> tuple[float, bool]:
  """Summed log-softmax of `targets` after each prefix of `inputs` (the last len(targets)
  positions), and whether each was the argmax: the model's own forward pass over `inputs`
  right-padded to SEQ_LEN (causal: the padding never reaches them; one shape, one compile)."""
  return _scores(_log_softmax_rows(model, inputs), len(inputs), targets)


def _log_softmax_rows(model, inputs: list[int]) -> np.ndarray:
  padded = np.zeros((1, SEQ_LEN), np.int32)
  padded[0, :len(inputs)] = inputs
  return np.asarray(_log_softmax(model, jnp.asarray(padded)))[0]  # [SEQ_LEN, Vp]


def _scores(logp: np.ndarray, length: int, targets: list[int]) -> tuple[float, bool]:
  rows = np.arange(length - len(targets), length)
  return (float(logp[rows, targets].sum(dtype=np.float64)),
          bool((logp[rows].argmax(-1) == np.asarray(targets)).all()))


def _greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
  """`pisa_jax.generate`'s greedy tokens after each prompt, up to <|endoftext|> (dropped); in
  rows of BATCH, the adapter's shapes, so that the compiled steps are shared."""
  rows = prompts + [[EOT_TOKEN]] * (BATCH - len(prompts))
  out = pisa_jax.generate(model, rows, max_new_tokens=new_tokens, stop_tokens=(EOT_TOKEN,))
  return [[t for t in row if t != EOT_TOKEN] for row in out.sequences()[:len(prompts)]]


def _requests(kind: str, arguments: list[tuple]) -> list[Instance]:
  return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


# ----------------------------------------------------------------------------- exactness


def test_loglikelihood_is_the_plain_forward_log_softmax_in_request_order(lm):
  long_context = " ".join(["a pyramid of blocks"] * 6)  # > MAX_LENGTH tokens: cut on the left
  pairs = [("The capital of France is", " Paris."), ("", "Two and two"),
           (long_context, " make four."), ("Two", " and two make four."),
           ("The pyramid holds", " a summary"), ("x", " y")]
  got = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)

  lengths = []
  for (context, continuation), (logp, greedy) in zip(pairs, got, strict=True):
    if context:
      whole = _encode(context + continuation)
      scored = len(whole) - len(_encode(context))
    else:  # an empty context reads <|endoftext|>
      whole = [EOT_TOKEN] + _encode(continuation)
      scored = len(whole) - 1
    window = whole[-(MAX_LENGTH + 1):]
    lengths.append(len(whole))
    want_logp, want_greedy = _forward_scores(lm.model, window[:-1], window[len(window) - scored:])
    np.testing.assert_allclose(logp, want_logp, atol=ATOL, rtol=RTOL)
    assert greedy == want_greedy
  # Six requests over two batches, sorted longest first: results are put back in request order.
  assert lengths != sorted(lengths, reverse=True) and max(lengths) > MAX_LENGTH + 1
  assert len({round(logp, 3) for logp, _ in got}) == len(pairs)

  # A continuation that is the argmax of the forward pass is greedy (token requests, as
  # TemplateLM passes them on).
  context = _encode("The capital of France is")
  best = int(_log_softmax_rows(lm.model, context)[len(context) - 1].argmax())
  (logp, greedy), = lm._loglikelihood_tokens([(None, context, [best])])
  assert greedy and np.isclose(logp, _forward_scores(lm.model, context, [best])[0], atol=ATOL,
                               rtol=RTOL)


def test_rolling_loglikelihood_is_the_plain_forward_sum(lm):
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

  short = "The capital of France is Paris."
  long = " ".join(SENTENCES * 2)  # about three windows of MAX_LENGTH tokens
  got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long,), ("",)]),
                                 disable_tqdm=True)

  tokens = _encode(short)
  want_short, _ = _forward_scores(lm.model, [EOT_TOKEN] + tokens[:-1], tokens)
  np.testing.assert_allclose(got[0], want_short, atol=ATOL, rtol=RTOL)
  tokens = _encode(long)
  assert len(tokens) > 2 * MAX_LENGTH
  want_long = 0.0
  for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
      tokens, prefix_token=EOT_TOKEN, max_seq_len=MAX_LENGTH, context_len=1)):
    window = context + continuation
    want_long += _forward_scores(lm.model, window[:-1], continuation)[0]
  np.testing.assert_allclose(got[1], want_long, atol=ATOL, rtol=RTOL)
  assert got[2] == 0.0


def _first_stop(tokens: list[int], until: str) -> int:
  """How many generated tokens it takes for their text to hold `until` (len(tokens) if never)."""
  decode = lm_eval_adapter.gpt2_encoding().decode
  return next((k for k in range(1, len(tokens) + 1) if until in decode(tokens[:k])), len(tokens))


def test_generate_until_is_greedy_generation_cut_at_until(lm, monkeypatch):
  decode = lm_eval_adapter.gpt2_encoding().decode
  prompts = ["The capital of France is", "Two and two", ""]
  free = _greedy(lm.model, [_encode(p) or [EOT_TOKEN] for p in prompts], 10)
  # Stop strings the model does produce: the text of its third and fifth tokens.
  stops = [decode(free[0][2:3]), decode(free[1][4:5])]
  assert all(stops), stops
  arguments = [(prompts[0], {"until": [stops[0]], "max_gen_toks": 10}),
               (prompts[1], {"until": ["never said", stops[1]], "max_gen_toks": 10,
                             "do_sample": False}),
               (prompts[2], {"until": [], "max_gen_toks": 6})]

  steps = []  # steps each generate_stream ran
  stream = lm_eval_adapter.generate_stream

  def counted(*args, **kwargs):
    steps.append(0)
    for step in stream(*args, **kwargs):
      steps[-1] += 1
      yield step

  monkeypatch.setattr(lm_eval_adapter, "generate_stream", counted)
  got = lm.generate_until(_requests("generate_until", arguments), disable_tqdm=True)

  texts = [decode(free[0]), decode(free[1]), decode(free[2][:6])]
  want = [texts[0][:texts[0].find(stops[0])], texts[1][:texts[1].find(stops[1])], texts[2]]
  assert got == want
  # Each group is one batch (three kinds of gen_kwargs), in request order; a batch ends as soon
  # as its row's text holds a stop string, not at max_gen_toks.
  assert steps == [_first_stop(free[0], stops[0]), _first_stop(free[1], stops[1]),
                   min(6, len(free[2]) + 1)]


# ----------------------------------------------------------------------------- lm-eval itself


MC_TASK = """\
task: pisa_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
"""
GEN_TASK = """\
task: pisa_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true}}
"""
CHOICES = [("The capital of France is", ["Paris.", "Rome, of course.", "a block"], 0),
           ("Two and two make", ["four.", "five", "the pyramid of keys"], 0),
           ("The pyramid holds", ["a summary", "nothing at all", "four"], 2)]


def _cut(text: str, until: list[str]) -> str:
  return text[:min((text.find(u) for u in until if u in text), default=len(text))]


# runpy warns that the module is imported already (here, by this file); `python -m` in a fresh
# process has not.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")
def test_lm_eval_runs_local_tasks_through_the_module_entry(lm, run, tmp_path, monkeypatch):
  from lm_eval import tasks

  decode = lm_eval_adapter.gpt2_encoding().decode
  # The multiple-choice task: lm-eval scores " " + choice after the question.
  (tmp_path / "choice.jsonl").write_text("".join(
      json.dumps({"question": q, "choices": c, "label": label}) + "\n" for q, c, label in CHOICES))
  (tmp_path / "choice.yaml").write_text(MC_TASK.format(data=tmp_path / "choice.jsonl"))
  want_choice = []
  for question, choices, _ in CHOICES:
    scores = []
    for choice in choices:
      whole = _encode(question + " " + choice)
      scores.append(_forward_scores(lm.model, whole[:-1], whole[len(_encode(question)):])[0])
    want_choice.append(scores)
  want_acc = np.mean([np.argmax(s) == label for s, (_, _, label) in zip(want_choice, CHOICES)])
  # The generation task: the first answer is the model's own greedy text, the second is not.
  prompts = ["The capital of France is", "Two and two make"]
  greedy = _greedy(lm.model, [_encode(p) for p in prompts], 8)
  texts = [_cut(decode(row), ["\n", "."]) for row in greedy]
  answers = [texts[0], texts[1] + " and more"]
  (tmp_path / "generate.jsonl").write_text("".join(
      json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in zip(prompts, answers)))
  (tmp_path / "generate.yaml").write_text(GEN_TASK.format(data=tmp_path / "generate.jsonl"))

  # lm-eval's command line indexes its own thousands of task files first (tens of CPU seconds):
  # here only the local folder.
  class LocalTasks(tasks.TaskManager):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, include_defaults=False, **kwargs)

  monkeypatch.setattr(tasks, "TaskManager", LocalTasks)
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  out = tmp_path / "out"
  monkeypatch.setattr(sys, "argv", [
      "lm_eval_adapter", "--model", "pisa-jax", "--model_args", f"workdir={run}",
      "--tasks", "pisa_choice,pisa_generate", "--include_path", str(tmp_path),
      "--batch_size", str(BATCH), "--output_path", str(out), "--log_samples"])
  with pytest.raises(SystemExit) as e:
    runpy.run_module("pisa_jax.train.evaluation.lm_eval_adapter", run_name="__main__")
  assert not e.value.code

  (results_file,) = out.rglob("results_*.json")
  report = json.loads(results_file.read_text())
  assert report["config"]["max_length"] == SEQ_LEN  # the run's train.seq_len by default
  results = report["results"]
  assert results["pisa_choice"]["acc,none"] == pytest.approx(want_acc)
  assert results["pisa_generate"]["exact_match,none"] == pytest.approx(0.5)
  samples = {}
  for path in out.rglob("samples_*.jsonl"):
    task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
    samples[task] = sorted(map(json.loads, path.read_text().splitlines()),
                           key=lambda s: s["doc_id"])
  for sample, want in zip(samples["pisa_choice"], want_choice, strict=True):
    got = [float(resp[0]) for resp in sample["filtered_resps"]]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
  assert [s["filtered_resps"][0] for s in samples["pisa_generate"]] == texts


def test_implementation_swaps_the_attention_kernels_and_keeps_the_parameters():
  from flax import nnx

  from pisa_jax.models.decoder import Decoder

  config = validate(apply_overrides(get_config("tiny"), ["model.attention_implementation=xla"]))
  model = nnx.eval_shape(lambda: Decoder(config.model, rngs=nnx.Rngs(0)))
  swapped = lm_eval_adapter._with_implementation("runs/x", config, model, "pallas")
  assert swapped.cfg.attention_implementation == "pallas"
  assert [b.attn.cfg.attention_implementation for b in swapped.blocks] == ["pallas"] * 2
  params, kept = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(swapped))
  assert len(params) == len(kept) and all(a is b for a, b in zip(params, kept))


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("kwargs,pattern", [
    ({}, "workdir: missing"),
    ({"workdir": "runs/x", "batch_size": "auto"}, r"batch_size='auto' must be an int >= 1"),
    ({"workdir": "runs/x", "batch_size": 0}, r"batch_size=0 must be an int >= 1"),
    ({"workdir": "runs/x", "max_batch_size": 8}, r"max_batch_size=8 applies to --batch_size auto"),
    ({"workdir": "runs/x", "implementation": "cuda"}, r"implementation='cuda' is unknown"),
    ({"workdir": "runs/x", "max_length": 0}, r"max_length=0 must be an int >= 1"),
    ({"workdir": "runs/x", "max_gen_toks": 0}, r"max_gen_toks=0 must be an int >= 1"),
    ({"workdir": "runs/x", "seed": 0.5}, r"seed=0.5 must be an int"),
    ({"workdir": "runs/x", "device": "tpu"}, r"device='tpu': pisa-jax runs on JAX's default"),
], ids=["workdir", "batch_size-auto", "batch_size-0", "max_batch_size", "implementation",
        "max_length", "max_gen_toks", "seed", "device"])
def test_bad_model_args_name_themselves(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    PisaLM(**kwargs)


def test_a_run_that_cannot_serve_gpt2_text_is_refused(run, tmp_path):
  from pisa_jax.train.restore import NoCheckpointError

  with pytest.raises(NoCheckpointError, match="^workdir: .* not a pisa-train run folder"):
    PisaLM(workdir=str(tmp_path))
  # The vocabulary is checked on config.json, before any weight is read.
  config = json.loads((run / "config.json").read_text())
  config["model"]["vocab_size"] = 64
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=rf"^workdir: {tmp_path} holds a model with "
                                       r"model.vocab_size=64, fewer ids than .* 50,257"):
    PisaLM(workdir=str(tmp_path))
  with pytest.raises(ValueError, match=r"implementation='xla' does not fit the model of .*: "
                                       r"model.attention_implementation='xla' applies to sparse"):
    PisaLM(workdir=str(run), implementation="xla")


def test_bad_requests_name_themselves(lm):
  with pytest.raises(ValueError, match=rf"request 0: its continuation is \d+ tokens, more than "
                                       rf"max_length={MAX_LENGTH}"):
    lm.loglikelihood(_requests("loglikelihood", [("a", " b" * (MAX_LENGTH + 1))]),
                     disable_tqdm=True)
  generate = [("Two and two", {"until": ["\n"], "num_beams": 4})]
  with pytest.raises(ValueError, match=r"gen_kwargs \['num_beams'\] are not supported"):
    lm.generate_until(_requests("generate_until", generate), disable_tqdm=True)
  generate = [("Two and two", {"until": ["\n"], "max_gen_toks": MAX_LENGTH})]
  with pytest.raises(ValueError, match=rf"max_gen_toks={MAX_LENGTH} must be in \[1, max_length="):
    lm.generate_until(_requests("generate_until", generate), disable_tqdm=True)
  generate = [("Two and two", {"until": [""]})]
  with pytest.raises(ValueError, match=r"until=\[''\] must be non-empty strings"):
    lm.generate_until(_requests("generate_until", generate), disable_tqdm=True)
