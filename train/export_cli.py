"""`pisa-export`: a run's newest checkpoint as a Hugging Face folder.

  pisa-export runs/smol --out exported/smol

The folder holds config.json, model.safetensors (float32) and the run's tokenizer.json when it
has one (a `pisa-import` run does, with the end-of-sequence tokens config.json then names). The run's model must be a Llama, Qwen2 or Qwen3 one: a full
RoPE (model.rope_fraction=1.0, as every imported model; the paper's RoPE on half of each head has
no Hugging Face equivalent), biases as one of them has them. Its RoPE base and scaling are
exported as trained (a CPT run's new base included). A run with sparse attention is exported
with its attention settings under config.json's "pisa_attention" (attention, block_size, top_k,
branching, beam): transformers ignores them and runs the weights densely, while
`pisa_jax.models.load_pretrained` restores them.

A mistake ends in one line on stderr: exit status 2 for a bad argument, 1 for a run that cannot
be read or exported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from pisa_jax._command_line import ArgumentParser
from pisa_jax.train import restore
from pisa_jax.train.tokenizer import PRETRAINED_RECORD, RUN_TOKENIZER

PROG = "pisa-export"


def export_run(workdir: str | Path, out: str | Path) -> Path:
  """Writes the Hugging Face folder `out` of the run `workdir`'s newest good checkpoint."""
  from pisa_jax.models.pretrained import export_config, save_pretrained

  workdir, out = Path(workdir), Path(out)
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"--out {out} exists and is not an empty folder: give a new folder")
  config = restore.read_run_config(workdir)
  record_file = workdir / PRETRAINED_RECORD
  record = json.loads(record_file.read_text()) if record_file.is_file() else {}
  context = max(config.train.seq_len, int(record.get("context_length") or 0))
  eos = tuple(record.get("eos_token_ids", ()))
  # The config is checked before any weight is read.
  export_config(config.model, context_length=context)
  tokenizer = None
  if (workdir / RUN_TOKENIZER).is_file():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(workdir / RUN_TOKENIZER))
  config, model, _ = restore.restore_model(workdir)
  created = not out.exists()
  try:
    return save_pretrained(model, out, context_length=context, tokenizer=tokenizer,
                           eos_token_ids=eos)
  except BaseException:
    if created:
      shutil.rmtree(out, ignore_errors=True)
    raise


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog=PROG, description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", metavar="RUN", help="a pisa-train (or pisa-import) run folder")
  parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
  args = parser.parse_args(argv)
  try:
    restore.read_run_config(args.workdir)
  except restore.NoCheckpointError as e:
    parser.error(f"RUN: {str(e).removeprefix('workdir: ')}")
  try:
    out = export_run(args.workdir, args.out)
  except KeyboardInterrupt:
    print(f"{PROG}: interrupted", file=sys.stderr)
    return 130
  except (ValueError, OSError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1
  print(f"{PROG}: wrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
