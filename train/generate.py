"""`pisa-generate`: continue prompts with the latest checkpoint of a `pisa-train` run.

  pisa-generate --workdir runs/s --prompt "The pyramid"
  pisa-generate --workdir runs/s --prompt "Once upon a time" --max-new-tokens 200 \\
      --temperature 0.8 --top-p 0.95 --seed 1 --stop "."
  pisa-generate --workdir runs/s --prompt-file prompts.jsonl --prefill-chunk 65536

The newest checkpoint that passes its checksums is restored (its parameters on the default
device, the optimizer state it also holds in host memory), the prompt is tokenised with the run's
own tokenizer (a `pisa-import` run's tokenizer.json, else GPT-2's), and the continuation is
written to stdout token by token as it is generated (greedy with --temperature 0, the default).
Generation stops at <|endoftext|> (an imported model: at its end-of-sequence tokens) when the
vocabulary has it, and at each --stop text (one token of the tokenizer each).

--prompt-file reads many prompts, generated as one batch of rows of different lengths (each row
as it would be alone): a `.jsonl` file holds one JSON string, or object with a "prompt" string,
per line; any other file one prompt per line (blank lines skipped). The output is then one JSON
line per prompt, in order: {"prompt", "completion", "new_tokens", "stopped"}. Row b samples
from the key fold_in(key(--seed), b).
--prefill-chunk N reads the prompts N tokens at a time (each chunk appended to the cache, its
queries selecting over everything before): the same first token as one pass, with the
activations of N tokens. --summary-dtype bfloat16 stores a PISA run's pyramid in bfloat16 for
this generation. The prompt and the new tokens must fit in the context the run was
trained with (train.seq_len) unless --context says otherwise.

A mistake ends in one line on stderr: exit status 2 for a bad argument (one that names it), 1 for
a checkpoint or tokenizer that cannot be read, 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import sys
from pathlib import Path

from pisa_jax._command_line import ArgumentParser
from pisa_jax.train import compilation_cache, restore

PROG = "pisa-generate"
DEFAULT_NEW_TOKENS = 64


class _ArgumentError(Exception):
  """A bad argument: the message starts with its name."""


def _number(kind, check, requirement: str):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not {'an int' if kind is int else 'a number'}"
                                       ) from None
    if not check(value):
      raise argparse.ArgumentTypeError(f"{text} must be {requirement}")
    return value

  parse.__name__ = kind.__name__
  return parse


def restore_model(workdir: str | Path, *, summary_dtype: str | None = None):
  """`pisa_jax.train.restore.restore_model`, its missing-run error as a bad --workdir."""
  try:
    return restore.restore_model(workdir, summary_dtype=summary_dtype)
  except restore.NoCheckpointError as e:
    raise _ArgumentError(f"--{e}") from None


def read_prompts(path: str) -> list[str]:
  """The prompts of a --prompt-file (see the module docstring); raises _ArgumentError naming the
  file and line of a mistake."""
  file = Path(path)
  if not file.is_file():
    raise _ArgumentError(f"--prompt-file: {path} does not exist" if not file.exists()
                         else f"--prompt-file: {path} is not a file")
  try:
    text = file.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise _ArgumentError(f"--prompt-file: cannot read {path} as UTF-8 text: {e}") from None
  prompts = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    if file.suffix != ".jsonl":
      prompts.append(line)
      continue
    try:
      value = json.loads(line)
    except json.JSONDecodeError as e:
      raise _ArgumentError(f"--prompt-file: {path} line {number} is not JSON ({e.msg}): a .jsonl "
                           'file holds one JSON string or {"prompt": ...} object a line') from None
    if isinstance(value, dict):
      value = value.get("prompt")
    if not isinstance(value, str):
      raise _ArgumentError(f"--prompt-file: {path} line {number} is no prompt: expected a JSON "
                           'string or an object with a "prompt" string')
    if not value:
      raise _ArgumentError(f"--prompt-file: {path} line {number}: empty prompt")
    prompts.append(value)
  if not prompts:
    raise _ArgumentError(f"--prompt-file: {path} holds no prompt")
  return prompts


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog=PROG, description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the run folder of pisa-train")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="the text to continue")
  source.add_argument("--prompt-file", help="many prompts, one batch: one a line, or a .jsonl "
                                            'file of JSON strings or {"prompt": ...} objects')
  parser.add_argument("--max-new-tokens", type=_number(int, lambda n: n >= 1, ">= 1"),
                      default=None, help=f"default: {DEFAULT_NEW_TOKENS}, or what the context "
                                         "leaves after the longest prompt if that is less")
  parser.add_argument("--temperature", type=_number(float, lambda t: math.isfinite(t) and t >= 0,
                                                    "a finite number >= 0"), default=0.0,
                      help="0 (the default) is greedy")
  parser.add_argument("--top-p", type=_number(float, lambda p: 0 < p <= 1, "in (0, 1]"),
                      default=1.0, help="nucleus sampling with --temperature > 0")
  parser.add_argument("--seed", type=_number(int, lambda s: True, "an int"), default=0,
                      help="sampling's key, jax.random.key(seed); row b draws from "
                           "fold_in(key, b)")
  parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                      help="also stop a row at this text, one token of the tokenizer "
                           "(repeatable), beside the end-of-text token")
  parser.add_argument("--prefill-chunk", type=_number(int, lambda n: n >= 1, ">= 1"),
                      default=None, help="read the prompts this many tokens at a time "
                                         "(default: one pass)")
  parser.add_argument("--context", type=_number(int, lambda n: n >= 1, ">= 1"), default=None,
                      help="tokens (prompt and new ones) the model may see; default: the run's "
                           "train.seq_len")
  parser.add_argument("--summary-dtype", choices=("float32", "bfloat16"), default=None,
                      help="the PISA pyramid's dtype for this generation (default: the run's): "
                           "bfloat16 halves the cache's pyramid and the walk's loads")
  parser.add_argument("--steps-per-call", type=_number(int, lambda n: n >= 1, ">= 1"),
                      default=16, help="tokens each device call generates before they print "
                                       "(1: each token as soon as it exists, slower)")
  args = parser.parse_args(argv)
  if args.prompt is not None and not args.prompt:
    parser.error("--prompt: empty: give the text to continue")
  if any(not stop for stop in args.stop):
    parser.error("--stop: empty: give the text (one token) that ends a row")
  try:
    args.prompts = [args.prompt] if args.prompt_file is None else read_prompts(args.prompt_file)
  except _ArgumentError as e:
    parser.error(str(e))
  try:
    restore.read_run_config(args.workdir)  # a folder that is no run fails before jax loads
  except restore.NoCheckpointError as e:
    parser.error(f"--{e}")
  compilation_cache.enable_for(parser)

  try:
    return _generate(args)
  except _ArgumentError as e:
    parser.error(str(e))
  except KeyboardInterrupt:
    print(f"\n{PROG}: interrupted", file=sys.stderr)
    return 130
  except (ValueError, OSError) as e:
    # The tokenizer's missing file, and corrupt or incompatible checkpoints.
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1


def _generate(args) -> int:
  # Imported once the arguments are known good: a mistake costs no JAX start-up.
  from pisa_jax.generation import generate, generate_stream
  from pisa_jax.models.decoder import count_params
  from pisa_jax.train.tokenizer import encode_text, gpt2_encoding, run_encoding

  encoding, stop = run_encoding(args.workdir)
  encoding = encoding or gpt2_encoding()
  try:
    # The newest checkpoint's attention decides (a run may have changed it on a resume).
    config, model, step = restore_model(args.workdir, summary_dtype=args.summary_dtype)
  except restore.SummaryDtypeError as e:
    raise _ArgumentError(f"--summary-dtype: {e}") from None
  vocab = config.model.vocab_size
  context = config.train.seq_len if args.context is None else args.context
  where = "train.seq_len of the run; --context raises it" if args.context is None else "--context"
  name = "--prompt" if args.prompt_file is None else "--prompt-file"
  rows = []
  for line, prompt in enumerate(args.prompts, start=1):
    which = name if args.prompt_file is None else f"{name}: prompt {line}"
    tokens = encode_text(encoding, prompt)
    if len(tokens) >= context:
      raise _ArgumentError(f"{which}: {len(tokens)} tokens exceed the model's context of "
                           f"{context} ({where}) or leave no room for a new one")
    for token in tokens:
      if token >= vocab:
        text = encoding.decode_single_token_bytes(token).decode("utf-8", "replace")
        raise _ArgumentError(f"{which}: token {text!r} (id {token}) is outside the model's "
                             f"vocabulary of {vocab} tokens (model.vocab_size)")
    rows.append(tokens)
  longest = max(map(len, rows))
  new_tokens = args.max_new_tokens
  if new_tokens is None:
    new_tokens = min(DEFAULT_NEW_TOKENS, context - longest)
  elif longest + new_tokens > context:
    raise _ArgumentError(f"--max-new-tokens={new_tokens}: the longest prompt's {longest} tokens "
                         f"and {new_tokens} new ones exceed the model's context of {context} "
                         f"({where})")
  stop = [t for t in stop if t < vocab]
  for text in args.stop:
    ids = encoding.encode_ordinary(text)
    if len(ids) != 1 or ids[0] >= vocab:
      raise _ArgumentError(f"--stop={text!r} must be one token of the model's vocabulary: it is "
                           f"{len(ids)} tokens {ids}")
    stop.append(ids[0])
  stop = tuple(dict.fromkeys(stop))
  print(f"{PROG}: step {step} of {args.workdir} ({config.model.attention} attention, "
        f"{count_params(config.model):,} parameters): {len(rows)} prompt(s) of up to {longest} "
        f"tokens, up to {new_tokens} new", file=sys.stderr)
  options = dict(max_new_tokens=new_tokens, temperature=args.temperature, top_p=args.top_p,
                 stop_tokens=stop, seed=args.seed, prefill_chunk=args.prefill_chunk,
                 steps_per_call=args.steps_per_call)
  out = sys.stdout
  if args.prompt_file is not None:
    result = generate(model, rows, **options)
    for prompt, tokens, count, stopped in zip(args.prompts, result.tokens, result.lengths,
                                              result.stopped):
      kept = tokens[:count - 1 if stopped else count].tolist()  # the stop token is not text
      completion = b"".join(map(encoding.decode_single_token_bytes, kept))
      out.write(json.dumps({"prompt": prompt, "completion": completion.decode("utf-8", "replace"),
                            "new_tokens": int(count), "stopped": bool(stopped)}) + "\n")
    out.flush()
    return 0
  # A token may end inside a UTF-8 character: bytes wait for the rest of it.
  text = codecs.getincrementaldecoder("utf-8")(errors="replace")
  for step in generate_stream(model, rows, **options):
    token = int(step[0])
    if token < 0 or token in stop:
      break
    out.write(text.decode(encoding.decode_single_token_bytes(token)))
    out.flush()
  out.write(text.decode(b"", final=True) + "\n")
  out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())
