"""`pisa-generate`: continue a prompt with the latest checkpoint of a `pisa-train` run.

  pisa-generate --workdir runs/s --prompt "The pyramid"
  pisa-generate --workdir runs/s --prompt "Once upon a time" --max-new-tokens 200 \\
      --temperature 0.8 --top-p 0.95 --seed 1

The newest checkpoint that passes its checksums is restored (its parameters on the default
device, the optimizer state it also holds in host memory), the prompt is tokenised with the run's
own tokenizer (a `pisa-import` run's tokenizer.json, else GPT-2's), and the continuation is written to stdout token by token as it is generated (greedy
with --temperature 0, the default). Generation stops at <|endoftext|> (an imported model: at its
end-of-sequence tokens) when the vocabulary has it.
The prompt and the new tokens must fit in the context the run was trained with (train.seq_len)
unless --context says otherwise.

A mistake ends in one line on stderr: exit status 2 for a bad argument (one that names it), 1 for
a checkpoint or tokenizer that cannot be read, 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import codecs
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


def restore_model(workdir: str | Path):
  """`pisa_jax.train.restore.restore_model`, its missing-run error as a bad --workdir."""
  try:
    return restore.restore_model(workdir)
  except restore.NoCheckpointError as e:
    raise _ArgumentError(f"--{e}") from None


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog=PROG, description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the run folder of pisa-train")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--max-new-tokens", type=_number(int, lambda n: n >= 1, ">= 1"),
                      default=None, help=f"default: {DEFAULT_NEW_TOKENS}, or what the context "
                                         "leaves after the prompt if that is less")
  parser.add_argument("--temperature", type=_number(float, lambda t: math.isfinite(t) and t >= 0,
                                                    "a finite number >= 0"), default=0.0,
                      help="0 (the default) is greedy")
  parser.add_argument("--top-p", type=_number(float, lambda p: 0 < p <= 1, "in (0, 1]"),
                      default=1.0, help="nucleus sampling with --temperature > 0")
  parser.add_argument("--seed", type=_number(int, lambda s: True, "an int"), default=0)
  parser.add_argument("--context", type=_number(int, lambda n: n >= 1, ">= 1"), default=None,
                      help="tokens (prompt and new ones) the model may see; default: the run's "
                           "train.seq_len")
  parser.add_argument("--steps-per-call", type=_number(int, lambda n: n >= 1, ">= 1"),
                      default=16, help="tokens each device call generates before they print "
                                       "(1: each token as soon as it exists, slower)")
  args = parser.parse_args(argv)
  if not args.prompt:
    parser.error("--prompt: empty: give the text to continue")
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
  from pisa_jax.generation import generate_stream
  from pisa_jax.models.decoder import count_params
  from pisa_jax.train.tokenizer import gpt2_encoding, run_encoding

  encoding, stop = run_encoding(args.workdir)
  encoding = encoding or gpt2_encoding()
  tokens = encoding.encode_ordinary(args.prompt)
  config, model, step = restore_model(args.workdir)
  vocab = config.model.vocab_size
  context = config.train.seq_len if args.context is None else args.context
  where = "train.seq_len of the run; --context raises it" if args.context is None else "--context"
  if len(tokens) >= context:
    raise _ArgumentError(f"--prompt: {len(tokens)} tokens exceed the model's context of "
                         f"{context} ({where}) or leave no room for a new one")
  new_tokens = args.max_new_tokens
  if new_tokens is None:
    new_tokens = min(DEFAULT_NEW_TOKENS, context - len(tokens))
  elif len(tokens) + new_tokens > context:
    raise _ArgumentError(f"--max-new-tokens={new_tokens}: the prompt's {len(tokens)} tokens and "
                         f"{new_tokens} new ones exceed the model's context of {context} "
                         f"({where})")
  for token in tokens:
    if token >= vocab:
      text = encoding.decode_single_token_bytes(token).decode("utf-8", "replace")
      raise _ArgumentError(f"--prompt: token {text!r} (id {token}) is outside the model's "
                           f"vocabulary of {vocab} tokens (model.vocab_size)")
  stop = tuple(t for t in stop if t < vocab)
  print(f"{PROG}: step {step} of {args.workdir} ({config.model.attention} attention, "
        f"{count_params(config.model):,} parameters): {len(tokens)} prompt tokens, up to "
        f"{new_tokens} new", file=sys.stderr)
  # A token may end inside a UTF-8 character: bytes wait for the rest of it.
  text = codecs.getincrementaldecoder("utf-8")(errors="replace")
  out = sys.stdout
  for step in generate_stream(model, [tokens], max_new_tokens=new_tokens,
                              temperature=args.temperature, top_p=args.top_p, stop_tokens=stop,
                              seed=args.seed, steps_per_call=args.steps_per_call):
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
