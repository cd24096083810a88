"""`pisa-import`: a pretrained Llama-family model as a `pisa-train` run folder, for continued
pretraining (the paper's CPT) and for `pisa-eval` / `pisa-generate` with the model's own tokenizer.

  pisa-import SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smol --set model.attention=pisa \\
      --set model.top_k=16 --set train.seq_len=8192
  pisa-train --workdir runs/smol --set data.path=data/smol-corpus   # continues it
  pisa-generate --workdir runs/smol --prompt "The pyramid"

PATH is a Hugging Face folder (config.json, *.safetensors, tokenizer.json) or a .gguf file
(`pisa_jax.models.load_pretrained` says which architectures load). The run folder holds what
`pisa-train` writes when a run starts: config.json (the model's architecture, then every --set:
attention, K, RoPE base, sequence length, ...), and checkpoints/0, a sealed checkpoint of the
imported parameters with a fresh optimizer state at step 0; beside them the model's
tokenizer.json and pretrained.json (where the weights came from, the context they were trained
for, the tokens that end a generation). `pisa-train --workdir RUN` resumes that step-0 checkpoint
under the folder's own config.json: the parameters are the imported ones, Adam's moments start
at zero and the schedule at step 0. The train section starts as the paper's CPT schedule
(cosine from 3e-5 to 3e-6 after a 10% warm-up, `IMPORT_TRAIN`) over 1,000 steps; data.path is
left unset for `--set data.path=...` here or at `pisa-train` (a corpus tokenized with the model's
own tokenizer).

A mistake ends in one line on stderr: exit status 2 for a bad argument or config, 1 for a file
that is not a supported model (the message names the field) or a run folder that cannot be
written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from pisa_jax._command_line import ArgumentParser
from pisa_jax.train.tokenizer import PRETRAINED_RECORD, RUN_TOKENIZER

PROG = "pisa-import"


def import_train_config():
  """The paper's CPT schedule (Appendix C.1): a 10% linear warm-up to 3e-5, cosine to 3e-6."""
  from pisa_jax.configs import TrainConfig

  return TrainConfig(
      seq_len=4096, per_device_batch=1, grad_accum=1, steps=1_000, lr_schedule="cosine",
      peak_lr=3e-5, final_lr_ratio=0.1, warmup_steps=0, warmup_fraction=0.1, decay_steps=0,
      checkpoint_every=250, log_every=10, eval_every=250, eval_batches=4,
  )


def import_config(source, overrides: list[str]):
  """The run's Config: the checkpoint's architecture, the CPT train section, then `overrides`.

  Raises ValueError naming the field for an override of a field the checkpoint fixes, or for
  any impossible value (`pisa_jax.configs.validate`; an unset data.path is left for pisa-train).
  """
  from pisa_jax.configs import Config, DataConfig, apply_overrides, validate
  from pisa_jax.models.pretrained import ARCHITECTURE_FIELDS

  train = import_train_config()
  if source.context_length:
    train = dataclasses.replace(train, seq_len=min(train.seq_len, int(source.context_length)))
  config = Config(model=dataclasses.replace(source.config, compute_dtype="auto"),
                  data=DataConfig(source="tokens", path=None), train=train)
  changed = apply_overrides(config, overrides)
  fixed = [f for f in ARCHITECTURE_FIELDS if f != "param_dtype"
           and getattr(changed.model, f) != getattr(config.model, f)]
  if fixed:
    raise ValueError(f"model.{fixed[0]}={getattr(changed.model, fixed[0])!r}: the pretrained "
                     f"checkpoint fixes this field ({getattr(config.model, fixed[0])!r})")
  unset = changed.data.source == "tokens" and not changed.data.path
  checked = dataclasses.replace(changed, data=dataclasses.replace(changed.data, path="unset"))
  validate(checked if unset else changed)
  return changed


def _check_out(out: Path) -> None:
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"--out {out} exists and is not an empty folder: give a new run folder")


def import_checkpoint(path: str | Path, out: str | Path, overrides: list[str] = ()):
  """Writes the run folder `out` of the pretrained checkpoint `path` (the module docstring says
  what it holds); returns its Config."""
  from pisa_jax.models.pretrained import read_pretrained

  _check_out(Path(out))
  source = read_pretrained(path)
  try:
    config = import_config(source, list(overrides))
    write_run(source, config, Path(out), path)
  finally:
    source.tensors.close()
  return config


def write_run(source, config, out: Path, path) -> None:
  """The run folder of `source` under `config`; nothing is left in `out` when it fails."""
  _check_out(out)
  created = not out.exists()
  try:
    _write(source, config, out, path)
  except BaseException:
    if created:
      shutil.rmtree(out, ignore_errors=True)
    else:
      for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    raise


def _write(source, config, out: Path, path) -> None:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from pisa_jax.models.pretrained import build_decoder
  from pisa_jax.models.sharding import make_mesh
  from pisa_jax.train import checkpoint as ckpt_lib
  from pisa_jax.train import run_folder
  from pisa_jax.train.trainer import build_optimizer

  t = config.train
  mesh = make_mesh(t.fsdp, t.context_parallel)
  model = build_decoder(config.model, source.tensors, mesh=mesh, where=str(path))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  # The train state's layout (`trainer.Trainer.init_state`): Adam's moments at zero, step 0.
  state = {"params": params, "opt_state": build_optimizer(t).init(params),
           "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.key_data(jax.random.key(t.seed))}
  out.mkdir(parents=True, exist_ok=True)
  source.tokenizer.save(str(out / RUN_TOKENIZER))
  record = {"source": str(Path(path).absolute()), "format": "gguf" if Path(path).is_file()
            else "huggingface", "context_length": source.context_length,
            "eos_token_ids": list(source.eos_token_ids)}
  (out / PRETRAINED_RECORD).write_text(json.dumps(record, indent=1) + "\n")
  checkpoints = ckpt_lib.Checkpointer(out / "checkpoints", keep=t.keep_checkpoints,
                                      use_async=False)
  try:
    checkpoints.save(0, state, config, force=True)
  finally:
    checkpoints.close()
  # Last: config.json beside a sealed checkpoint, then the run-folder marker.
  (out / "config.json").write_text(config.to_json() + "\n")
  run_folder.mark(out)


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog=PROG, description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("path", metavar="PATH",
                      help="a Hugging Face model folder or a .gguf file")
  parser.add_argument("--out", required=True, help="the run folder to write (new or empty)")
  parser.add_argument("--set", dest="overrides", action="append", default=[],
                      metavar="SECTION.FIELD=VALUE",
                      help="override a config field (repeatable), e.g. model.attention=pisa")
  parser.add_argument("--print-config", action="store_true",
                      help="print the run's config and exit without writing anything")
  args = parser.parse_args(argv)
  from pisa_jax.models.pretrained import UnsupportedModelError, read_pretrained

  if not Path(args.path).exists():
    parser.error(f"PATH: {args.path} does not exist: give a Hugging Face model folder or a "
                 f".gguf file")
  try:
    if not args.print_config:
      _check_out(Path(args.out))
    source = read_pretrained(args.path)
  except (UnsupportedModelError, FileNotFoundError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1
  except ValueError as e:
    parser.error(str(e))
  try:
    try:
      config = import_config(source, args.overrides)
    except ValueError as e:
      parser.error(str(e))
    if args.print_config:
      print(config.to_json())
      return 0
    write_run(source, config, Path(args.out), args.path)
  except KeyboardInterrupt:
    print(f"{PROG}: interrupted; nothing was left in {args.out}", file=sys.stderr)
    return 130
  except (ValueError, OSError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 1
  finally:
    source.tensors.close()
  print(f"{PROG}: wrote {args.out} ({config.model.num_layers} layers, "
        f"{config.model.attention} attention, train.seq_len={config.train.seq_len}); continue "
        f"it with: pisa-train --workdir {args.out}"
        + ("" if config.data.path else f" --set data.path=CORPUS, a corpus of "
                                       f"pisa-prepare-data --tokenizer {args.out}"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
