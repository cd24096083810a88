"""lm-eval (the LM Evaluation Harness, 0.4.13) on a `pisa-train` run, offline: the model "pisa-jax".

  python -m pisa_jax.train.evaluation.lm_eval_adapter --model pisa-jax \\
      --model_args workdir=runs/small --tasks mytask --include_path DIR --batch_size 16

How lm-eval finds the model. lm-eval 0.4.13 resolves `--model NAME` in its model registry, which
holds the names its own `lm_eval.models` maps and whatever the running process has registered with
`lm_eval.api.registry.register_model`. It reads no entry points and has no plugin hook, so no line
in pyproject can make the plain `lm_eval` command see a model of another package. `pisa-lm-eval`
(`pisa_jax.train.evaluation.lm_eval_cli`; `python -m` on this module runs the same) parses the
arguments with lm-eval's own command line, imports this module, which registers `PisaLM` as
"pisa-jax", and runs lm-eval: every option of `lm_eval` (and of `lm_eval run`,
`lm_eval ls tasks`, ...) works with its own meaning. From Python, importing the module is enough:

  import lm_eval
  from lm_eval.tasks import TaskManager
  import pisa_jax.train.evaluation.lm_eval_adapter  # registers "pisa-jax"
  lm_eval.simple_evaluate(model="pisa-jax", model_args={"workdir": "runs/small"},
                          tasks=["mytask"], task_manager=TaskManager(include_path="DIR"))

model_args (`--model_args key=value,...`):
  workdir         the pisa-train run folder (required); its newest checkpoint that passes its
                  checksums is restored. Its model.vocab_size must cover its tokenizer's tokens:
                  the run's own tokenizer.json (a `pisa-import` run), else GPT-2's 50,257.
  max_length      tokens the model reads at once (default: the run's train.seq_len, as
                  pisa-generate's --context); longer inputs lose tokens on the left
  implementation  "xla" or "pallas": the sparse attention kernels (default: the run's
                  model.attention_implementation; None there is pallas on a GPU, xla elsewhere)
  max_gen_toks    new tokens per generate_until request when its task sets none (default 256)
  seed            the random stream of sampled generation (do_sample: true), default 0
Rows per forward pass come from lm-eval's `--batch_size N` (an int, default 1): larger is faster.
The model runs on JAX's default device (pick one with JAX_PLATFORMS or CUDA_VISIBLE_DEVICES);
lm-eval's `--device` may name that backend ("cpu", "cuda") or stay at its default.

The tokenizer is the run's own: a run imported by `pisa-import` carries its model's
tokenizer.json, tokenized as `pisa-prepare-data --tokenizer RUN` tokenized its corpus (with the
BOS token where the model's tokenizer adds one); its end of text is <|endoftext|> where the
tokenizer has it, else the model's first end-of-sequence token, and its generations stop at any
of the model's end-of-sequence tokens. Any other run reads GPT-2's BPE (`pisa_jax.train.tokenizer`,
<|endoftext|> inside a text is text). "The prefix" below is the model's BOS where its tokenizer
adds one, else the end of text (<|endoftext|> for GPT-2).
- loglikelihood: the sum of log p(continuation tokens | context) and whether each was the argmax.
  Context and continuation are tokenized together and split as lm-eval's HF model does; an empty
  context reads the prefix. Inputs longer than max_length lose tokens on the left (a warning
  says how many requests); a continuation longer than max_length is an error.
- loglikelihood_rolling: a document's total log-likelihood from the prefix on, in windows of
  max_length tokens that each predict new tokens only (lm_eval.utils.get_rolling_token_windows).
- generate_until: greedy, or sampled with do_sample: true / temperature / top_p, through
  `pisa_jax.generate`; a row stops at the end of text, at max_gen_toks, or as soon as its text
  holds one of `until`, and is cut before it. The prompt keeps its last max_length - max_gen_toks
  tokens. Other gen_kwargs (num_beams, top_k, ...) are errors, not ignored.
Requests are sorted by length and batched, and the results come back in request order. Every
batch is padded to batch_size rows and its length to a power of two (at least 16 tokens): a run
compiles each forward pass O(log max_length) times, not once per length.

Local task files: `--include_path DIR` names a folder of task YAMLs; `dataset_path: json` reads
JSON Lines through `datasets` without any hub. A multiple-choice task, DIR/mychoice.yaml:

  task: mychoice
  dataset_path: json
  dataset_kwargs:
    data_files:
      test: /data/mychoice.jsonl   # the `datasets` library resolves a relative path against the
  test_split: test                 # directory lm_eval runs in, not against the YAML's
  output_type: multiple_choice
  doc_to_text: "{{question}}"
  doc_to_choice: choices           # a field that holds the list of answers
  doc_to_target: label             # the index of the right one
  metric_list:
    - {metric: acc, aggregation: mean, higher_is_better: true}

with lines like {"question": "2+2=", "choices": ["3", "4"], "label": 1} (lm-eval puts
`target_delimiter`, a space by default, between the question and each choice). A generation
task differs in `output_type: generate_until`, `doc_to_target: "{{answer}}"`,
`generation_kwargs: {until: ["\\n"], max_gen_toks: 32, do_sample: false}` and
`metric: exact_match`. Set HF_DATASETS_OFFLINE=1 so that `datasets` never tries the network, and
HF_HOME to move its cache.
"""

from __future__ import annotations

if __name__ == "__main__":
  # `python -m` runs this file as `__main__`: the command line imports the module under its own
  # name, which registers the model once (a second copy of the class under "pisa-jax" would be
  # refused by lm-eval), and this copy ends here, before jax is imported.
  import sys

  from pisa_jax.train.evaluation.lm_eval_cli import main

  sys.exit(main())

import dataclasses
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int
from tqdm import tqdm

try:
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
  from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
  raise ImportError(f"the pisa-jax lm-eval model needs lm-eval==0.4.13: pip install -e '.[eval]' "
                    f"({e})") from None

from pisa_jax import _checks
from pisa_jax.generation import PAD, generate_stream
from pisa_jax.models.decoder import output_logits
from pisa_jax.train.restore import restore_model
from pisa_jax.train.tokenizer import (EOT_TOKEN, RUN_TOKENIZER, VOCAB_SIZE, gpt2_encoding,
                                      run_encoding)

log = logging.getLogger(__name__)

# The shortest padded input: short requests share one compiled shape.
MIN_BUCKET = 16
# float32 logits per chunk of the scoring pass (256 MiB): the [B, T, V] logits are never whole.
LOGITS_PER_CHUNK = 2**26
DEFAULT_MAX_GEN_TOKS = 256
# The gen_kwargs that generate_until reads (after lm-eval's normalize_gen_kwargs).
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p")


def _bucket(n: int) -> int:
  """The power of two >= n (at least MIN_BUCKET) that inputs of n tokens are padded to."""
  return max(MIN_BUCKET, 1 << (int(n) - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("chunk",))
def token_scores(model, inputs: Int[Array, "B T"], targets: Int[Array, "B T"], *,
                 chunk: int) -> tuple[Float[Array, "B T"], Bool[Array, "B T"]]:
  """log p(targets[b, t] | inputs[b, :t + 1]) and whether targets[b, t] is the argmax there.

  One forward pass over right-padded rows (causal: padding after a row's tokens never reaches
  them); the output projection and log-softmax run over chunks of `chunk` positions (dividing T).
  """
  x = model.hidden_states(inputs)  # [B, T, E]
  lm_head, vocab_size = model.output_embedding(), model.cfg.vocab_size
  b, t = inputs.shape

  def score(xs):
    x_chunk, target = xs  # [B, C, E], [B, C]
    logits = output_logits(x_chunk, lm_head, vocab_size)  # [B, C, Vp] float32
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    return logp, jnp.argmax(logits, axis=-1) == target

  def split(a):  # [B, T, ...] -> [T / C, B, C, ...]
    return jnp.moveaxis(a.reshape(b, t // chunk, chunk, *a.shape[2:]), 1, 0)

  logp, greedy = jax.lax.map(score, (split(x), split(targets)))
  return tuple(jnp.moveaxis(a, 0, 1).reshape(b, t) for a in (logp, greedy))


@register_model("pisa-jax")
class PisaLM(TemplateLM):
  """A `pisa-train` run's newest checkpoint as an lm-eval model (the module docstring says how
  to run it and what each request type computes)."""

  def __init__(self, workdir: str | Path | None = None, *, max_length: int | None = None,
               implementation: str | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
               seed: int = 0, batch_size: int | str = 1, max_batch_size: int | None = None,
               device: str | None = None):
    super().__init__()
    if workdir is None or str(workdir) == "":
      raise ValueError("workdir: missing: give the pisa-train run folder, "
                       "--model_args workdir=RUN")
    self.workdir = Path(str(workdir))
    self.batch_size = _positive_int(batch_size, "batch_size", "(requests per forward pass; "
                                    "lm-eval's --batch_size auto is not supported)")
    if max_batch_size is not None:
      raise ValueError(f"max_batch_size={max_batch_size!r} applies to --batch_size auto, which "
                       "pisa-jax does not support: give --batch_size N")
    _check_device(device)
    self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks", "")
    if isinstance(seed, bool) or not isinstance(seed, int):
      raise ValueError(f"seed={seed!r} must be an int")
    self.seed = seed
    _checks.check_implementation(implementation, name="implementation")
    if max_length is not None:
      max_length = _positive_int(max_length, "max_length", "(tokens per forward pass)")
    # A missing BPE file, a bad tokenizer.json or a vocabulary too small for it fails before
    # the weights are read.
    own, stop = run_encoding(self.workdir)
    if own is None:
      self.encoding, self.run_tokenizer = gpt2_encoding(), None
      self._eot = self._prefix = EOT_TOKEN
      self._stop, self._text_vocab = (EOT_TOKEN,), VOCAB_SIZE
    else:
      self.encoding = self.run_tokenizer = own.tokenizer
      endoftext = own.tokenizer.token_to_id("<|endoftext|>")
      if endoftext is None and not stop:
        raise ValueError(f"workdir: {self.workdir}/{RUN_TOKENIZER} has no <|endoftext|> and the "
                         f"run names no end-of-sequence token (pretrained.json): lm-eval's end "
                         f"of text is unknown")
      self._eot = int(stop[0] if endoftext is None else endoftext)
      self._stop = tuple(dict.fromkeys((self._eot, *stop)))
      bos = _added_bos(own.tokenizer)
      self._prefix = self._eot if bos is None else bos
      self._text_vocab = own.n_vocab
    _check_vocab_early(self.workdir, self._text_vocab, self.tokenizer_name)

    config, model, self.step = restore_model(self.workdir)
    _check_vocab(self.workdir, config.model.vocab_size, self._text_vocab, self.tokenizer_name)
    if implementation is not None:
      model = _with_implementation(self.workdir, config, model, implementation)
    self.config, self.model = config, model
    self.max_length = config.train.seq_len if max_length is None else max_length

  # ----------------------------------------------------------------------- TemplateLM's hooks

  @property
  def eot_token_id(self) -> int:
    return self._eot

  @property
  def prefix_token_id(self) -> int:
    return self._prefix

  @property
  def tokenizer_name(self) -> str:
    return "gpt2" if self.run_tokenizer is None else f"{self.workdir / RUN_TOKENIZER}"

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    # Text as the run's data was tokenized (pisa-prepare-data): GPT-2's "<|endoftext|>" inside a
    # document is ordinary text, never the special token; a run's own tokenizer adds its BOS
    # unless lm-eval asks for none (a continuation of an empty context).
    if self.run_tokenizer is None:
      return self.encoding.encode_ordinary(string)
    return self.run_tokenizer.encode(string, add_special_tokens=add_special_tokens is not False).ids

  def get_model_info(self) -> dict:
    m = self.model.cfg
    return {"workdir": str(self.workdir), "step": self.step, "attention": m.attention,
            "attention_implementation": m.attention_implementation,
            "vocab_size": m.vocab_size, "max_length": self.max_length}

  # ----------------------------------------------------------------------- loglikelihood

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                            ) -> list[tuple[float, bool]]:
    """requests: ((context, continuation) or None, context tokens, continuation tokens)."""
    windows, truncated = [], 0
    for i, (_, context, continuation) in enumerate(requests):
      if not context:
        raise ValueError(f"request {i}: no context token: the first continuation token needs "
                         "one to be predicted from (lm-eval gives <|endoftext|>)")
      if len(continuation) > self.max_length:
        raise ValueError(f"request {i}: its continuation is {len(continuation)} tokens, more than "
                         f"max_length={self.max_length}; raise --model_args max_length")
      whole = (list(context) + list(continuation))[-(self.max_length + 1):]
      truncated += len(context) + len(continuation) > len(whole)
      windows.append((whole[:-1], whole[1:], len(continuation)))
    if truncated:
      log.warning("%d of %d requests are longer than max_length=%d + 1 tokens: their contexts "
                  "lose tokens on the left", truncated, len(requests), self.max_length)

    # Longest first: the first batch shows the worst memory and time, and rows of a batch
    # have similar lengths.
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
    results: list[tuple[float, bool] | None] = [None] * len(windows)
    bar = tqdm(total=len(windows), disable=disable_tqdm, desc="pisa-jax loglikelihood")
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      for i, scored in zip(batch, self._score([windows[i] for i in batch]), strict=True):
        results[i] = scored
        request = requests[i][0]
        if request is not None:
          self.cache_hook.add_partial("loglikelihood", request, scored)
      bar.update(len(batch))
    bar.close()
    return results

  def _score(self, windows) -> list[tuple[float, bool]]:
    """(summed log-prob, all greedy) of each window (inputs, targets, number scored at its end)."""
    # Every batch has batch_size rows (the last one padded): one compile per width.
    rows = self.batch_size
    width = _bucket(max(len(w[0]) for w in windows))
    inputs = np.zeros((rows, width), np.int32)
    targets = np.zeros((rows, width), np.int32)
    for r, (inp, tgt, _) in enumerate(windows):
      inputs[r, :len(inp)] = inp
      targets[r, :len(tgt)] = tgt
    per_position = rows * self.model.cfg.padded_vocab_size
    chunk = min(width, _floor_pow2(LOGITS_PER_CHUNK // per_position))
    logp, greedy = token_scores(self.model, jnp.asarray(inputs), jnp.asarray(targets),
                                chunk=chunk)
    logp, greedy = np.asarray(logp), np.asarray(greedy)
    out = []
    for r, (inp, _, scored) in enumerate(windows):
      span = slice(len(inp) - scored, len(inp))
      out.append((float(logp[r, span].sum(dtype=np.float64)), bool(greedy[r, span].all())))
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owner = [], []
    for i, (text,) in enumerate(request.args for request in requests):
      for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
          token_list=self.tok_encode(text, add_special_tokens=False),
          prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((None, context, continuation))
        owner.append(i)
    totals = np.zeros(len(requests), np.float64)
    for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm),
                            strict=True):
      totals[i] += logp
    for request, total in zip(requests, totals, strict=True):
      self.cache_hook.add_partial("loglikelihood_rolling", request.args, float(total))
    return totals.tolist()

  # ----------------------------------------------------------------------- generate_until

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    # Requests with the same gen_kwargs share batches; each group is sorted longest first.
    groups: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
      groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=repr), []).append(i)
    results: list[str | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="pisa-jax generate_until")
    batch_index = 0
    for indices in groups.values():
      options = self._generation_options(requests[indices[0]].args[1])
      room = self.max_length - options["max_new_tokens"]
      prompts = {}
      for i in indices:
        # An empty context reads the prefix, as loglikelihood's does.
        tokens = self.tok_encode(requests[i].args[0]) or [self.prefix_token_id]
        prompts[i] = tokens[-room:]
      indices = sorted(indices, key=lambda i: -len(prompts[i]))
      for start in range(0, len(indices), self.batch_size):
        batch = indices[start:start + self.batch_size]
        texts = self._generate([prompts[i] for i in batch], seed=self.seed + batch_index,
                               **options)
        batch_index += 1
        for i, text in zip(batch, texts, strict=True):
          results[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.update(len(batch))
    bar.close()
    return results

  def _generation_options(self, gen_kwargs) -> dict:
    """generate()'s arguments from a request's gen_kwargs; unknown keys are errors."""
    if not isinstance(gen_kwargs, dict):
      raise ValueError(f"gen_kwargs={gen_kwargs!r} must be a dict")
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
    unknown = sorted(set(kwargs) - set(GEN_KWARGS))
    if unknown:
      raise ValueError(f"gen_kwargs {unknown} are not supported by pisa-jax: expected only "
                       f"{GEN_KWARGS} (or max_gen_toks' aliases max_new_tokens, max_tokens)")
    until = handle_stop_sequences(kwargs["until"], eos=None)
    if not all(isinstance(u, str) and u for u in until):
      raise ValueError(f"gen_kwargs until={until!r} must be non-empty strings")
    new_tokens = kwargs["max_gen_toks"]
    if new_tokens < 1 or new_tokens >= self.max_length:
      raise ValueError(f"gen_kwargs max_gen_toks={new_tokens} must be in [1, max_length="
                       f"{self.max_length}): the prompt keeps max_length - max_gen_toks tokens")
    temperature = float(kwargs.get("temperature", 0.0)) if kwargs["do_sample"] else 0.0
    return {"until": tuple(until), "max_new_tokens": new_tokens, "temperature": temperature,
            "top_p": float(kwargs.get("top_p", 1.0))}

  def _generate(self, prompts: list[list[int]], *, until: tuple[str, ...], max_new_tokens: int,
                temperature: float, top_p: float, seed: int) -> list[str]:
    """The text each prompt continues with, cut before the first stop string."""
    n = len(prompts)
    # Padding rows (one end of text each) keep the batch at a compiled size; nobody reads them.
    padded = prompts + [[self._eot]] * (self.batch_size - n)
    tokens: list[list[int]] = [[] for _ in range(n)]
    done = np.zeros(n, bool)
    for step in generate_stream(self.model, padded, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_p=top_p, stop_tokens=self._stop,
                                seed=seed):
      for r in np.flatnonzero(~done):
        token = int(step[r])
        if token == PAD or token in self._stop:
          done[r] = True
          continue
        tokens[r].append(token)
        done[r] = any(u in self._decode(tokens[r]) for u in until)
      if done.all():
        break
    texts = []
    for row in tokens:
      text = self._decode(row)
      cut = min((text.find(u) for u in until if u in text), default=len(text))
      texts.append(text[:cut])
    return texts

  def _decode(self, tokens: list[int]) -> str:
    if tokens and max(tokens) >= self._text_vocab:
      raise ValueError(f"token id {max(tokens)} was generated: {self.workdir} has "
                       f"model.vocab_size={self.model.cfg.vocab_size}, more ids than its "
                       f"tokenizer's ({self.tokenizer_name}) {self._text_vocab:,}, and that one "
                       f"has no text")
    return self.encoding.decode(tokens)


# ----------------------------------------------------------------------------- arguments


def _positive_int(value, name: str, what: str) -> int:
  """`value` as an int >= 1; lm-eval's command line may pass numbers as strings."""
  if isinstance(value, str) and value.strip().isdigit():
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name}={value!r} must be an int >= 1 {what}".rstrip())
  return value


def _floor_pow2(n: int) -> int:
  return 1 << (max(int(n), 1).bit_length() - 1)


def _check_device(device: str | None) -> None:
  """lm-eval's --device names JAX's backend or is left at lm-eval's default, "cuda:0" (sent
  whether or not the user gave it, so it cannot be told apart and is accepted on any backend)."""
  backend = jax.default_backend()
  accepted = {None, "cuda:0", backend} | ({"cuda", "gpu"} if backend == "gpu" else set())
  if device not in accepted:
    raise ValueError(f"device={device!r}: pisa-jax runs on JAX's default backend, {backend!r} "
                     "here; leave --device out, or pick devices with JAX_PLATFORMS / "
                     "CUDA_VISIBLE_DEVICES")


def _added_bos(tokenizer) -> int | None:
  """The token a `tokenizers.Tokenizer` puts before every text (its post-processor's BOS), or
  None."""
  plain = tokenizer.encode("a", add_special_tokens=False).ids
  full = tokenizer.encode("a").ids
  return full[0] if len(full) == len(plain) + 1 and full[1:] == plain else None


def _check_vocab(workdir: Path, vocab_size: int, needed: int, tokenizer: str) -> None:
  if vocab_size < needed:
    raise ValueError(f"workdir: {workdir} holds a model with model.vocab_size={vocab_size}, "
                     f"fewer ids than its tokenizer's ({tokenizer}) {needed:,}: lm-eval's text "
                     "cannot be fed to it")


def _check_vocab_early(workdir: Path, needed: int, tokenizer: str) -> None:
  """The vocabulary check on config.json, before any weight is read (the checkpoint's own config
  has the same shapes). A folder without a readable config.json is left to restore_model."""
  try:
    saved = json.loads((workdir / "config.json").read_text())
    vocab_size = saved["model"]["vocab_size"]
  except (OSError, ValueError, KeyError, TypeError):
    return
  if isinstance(vocab_size, int):
    _check_vocab(workdir, vocab_size, needed, tokenizer)


def _with_implementation(workdir: Path, config, model, implementation: str):
  """The restored model with its sparse attention on `implementation` (same parameters)."""
  from flax import nnx

  from pisa_jax.configs import validate
  from pisa_jax.models.decoder import Decoder

  model_config = dataclasses.replace(config.model, attention_implementation=implementation)
  try:
    validate(dataclasses.replace(config, model=model_config))
  except ValueError as e:
    raise ValueError(f"implementation={implementation!r} does not fit the model of {workdir}: "
                     f"{e}") from None
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))
