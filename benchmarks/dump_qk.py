"""Post-RoPE queries and keys of one layer of a trained run, for `benchmarks.attention --indices
real`: the block indices PISA selects on a trained model's q/k, where neighbouring queries pick
nearly the same blocks (random indices are the worst case for a kernel that shares blocks
across a tile of queries).

  python -m benchmarks.dump_qk --workdir runs/small --seq-len 65536 --out /tmp/qk64k.npz
  python -m benchmarks.attention --indices real --qk-npz /tmp/qk64k.npz --case 65536:32:2:128:32

The tokens are the first --seq-len tokens of a pisa-prepare-data split (default: the run's own
data.path, split val), one row. The file holds q `[1, T, HQ, D]` and k `[1, T, HKV, D]` as
float16, and the layer, step, workdir and split they came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pisa_jax.models.decoder import RopeSpec, compute_dtype
from pisa_jax.train.data import token_dtype


def layer_qk(model, tokens, layer: int):
  """q `[B, T, HQ, D]` and k `[B, T, HKV, D]` of `layer`'s attention after RoPE, as the
  decoder computes them (`Attention.__call__`) on tokens `[B, T]` at positions 0 .. T-1."""
  cfg = model.cfg
  cdt = compute_dtype(cfg)
  x = jnp.take(model.embed[...], tokens, axis=0).astype(cdt)
  cos, sin = RopeSpec.of(cfg).angles(tokens.shape[1])
  for block in model.blocks[:layer]:
    x = block(x, cos, sin)
  block = model.blocks[layer]
  return block.attn.rotated_qk(block.attn_norm(x), cos, sin)


def read_tokens(folder: str | Path, split: str, seq_len: int) -> np.ndarray:
  """The first seq_len tokens of `<folder>/<split>.bin` (pisa-prepare-data) as `[1, T]`."""
  path = Path(folder) / f"{split}.bin"
  if not path.is_file():
    raise SystemExit(f"--data {folder}: no {path.name} (write it with pisa-prepare-data)")
  meta_path = Path(folder) / "meta.json"
  try:
    dtype = token_dtype(json.loads(meta_path.read_text()), meta_path)
  except (OSError, ValueError) as e:
    raise SystemExit(f"--data {folder}: {e}") from None
  tokens = np.memmap(path, dtype=dtype, mode="r")
  if tokens.size < seq_len:
    raise SystemExit(f"--seq-len {seq_len}: {path} holds only {tokens.size} tokens")
  return np.asarray(tokens[:seq_len], np.int32)[None]


def main(argv=None) -> Path:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--workdir", required=True, help="a pisa-train run folder")
  p.add_argument("--seq-len", type=int, default=16384)
  p.add_argument("--layer", type=int, default=None, help="default: the middle layer")
  p.add_argument("--data", default=None, help="pisa-prepare-data folder (default: the run's)")
  p.add_argument("--split", default="val")
  p.add_argument("--out", required=True, help="the .npz to write")
  args = p.parse_args(argv)

  from pisa_jax.train.restore import restore_model

  config, model, step = restore_model(args.workdir)
  layers = config.model.num_layers
  layer = layers // 2 if args.layer is None else args.layer
  if not 0 <= layer < layers:
    raise SystemExit(f"--layer {layer} must be in [0, {layers}) for this run")
  folder = args.data or config.data.path
  if not folder:
    raise SystemExit("--data is needed: the run's config names no data.path")
  tokens = jnp.asarray(read_tokens(folder, args.split, args.seq_len))
  q, k = nnx.jit(layer_qk, static_argnums=2)(model, tokens, layer)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  np.savez(out, q=np.asarray(q.astype(jnp.float16)), k=np.asarray(k.astype(jnp.float16)),
           layer=layer, step=step, workdir=str(args.workdir), split=args.split,
           device=str(jax.devices()[0].device_kind))
  print(f"wrote {out}: q {q.shape}, k {k.shape}, layer {layer}, step {step}")
  return out


if __name__ == "__main__":
  main()
