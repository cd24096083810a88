"""How well does each selector find the blocks that full attention weights most, on a trained model?

Takes a training run's workdir (`pisa-train --workdir DIR`; trained first here with
`--train-seconds`), restores its latest checkpoint, and captures every layer's post-RoPE q and k
(as its attention sees them) on held-out windows of the validation split. For each K in
--top-k, every selector runs on those q/k through the jnp reference: bsa, pisa1, pisa2, pisa with
beam K x each of --beam-factors, and "exact" (every complete past block by its exact key LSE:
the upper bound of any block selector). `pisa_jax.selection_quality` (Appendix D.2) gives
Recall@K, captured mass and mass ratio, averaged over layers, KV heads and rows with more than K
eligible blocks.

  pisa-train --config small --set model.attention=dense --workdir runs/dense
  python -m pisa_jax.train.eval_selection --workdir runs/dense --out runs/dense/selection
  # train a dense small model for 150 s first, then evaluate it:
  python -m pisa_jax.train.eval_selection --workdir runs/d --train-seconds 150 \\
      --set data.path=data/corpus --out runs/d/selection

Writes selection_quality.json (the setting, the training run, one row per selector) and
selection_quality.png (Recall@K against the beam, the flat selectors as lines) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pisa_jax
from pisa_jax.configs import Config, apply_overrides, get_config
from pisa_jax.models.decoder import Decoder, apply_rope, compute_dtype, rope_angles
from pisa_jax.train.checkpoint import Checkpointer
from pisa_jax.train.data import make_batches
from pisa_jax.train.trainer import build_trainer, train

FLAT = ("bsa", "pisa1", "pisa2")


def restore_model(workdir: Path) -> tuple[Config, Decoder, int]:
  """The latest checkpoint of `workdir` as a Decoder, with the config it was trained with."""
  ckpt = Checkpointer(workdir / "checkpoints", keep=1, use_async=False)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise FileNotFoundError(f"{workdir}/checkpoints holds no complete checkpoint: train first "
                              f"(pisa-train --workdir {workdir}, or --train-seconds here)")
    config = Config.from_dict(ckpt.read_meta(step)["config"])
    state = ckpt.restore(step, build_trainer(config).abstract_state, config)
  finally:
    ckpt.close()
  abstract = nnx.eval_shape(lambda: Decoder(config.model, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  nnx.replace_by_pure_dict(params, state["params"])
  return config, nnx.merge(graphdef, params), step


def capture_qk(model: Decoder, tokens) -> list[tuple[jax.Array, jax.Array]]:
  """Each layer's post-RoPE q `[B, T, HQ, D]` and k `[B, T, HKV, D]` in float32."""
  cfg = model.cfg
  cdt = compute_dtype(cfg)

  @nnx.jit
  def run(model, tokens):
    x = jnp.take(model.embed[...], tokens, axis=0).astype(cdt)
    cos, sin = rope_angles(tokens.shape[1], cfg.head_dim, cfg.rope_base)
    out = []
    for block in model.blocks:
      h = block.attn_norm(x)
      q = jnp.einsum("bte,ehd->bthd", h, block.attn.wq[...].astype(cdt))
      k = jnp.einsum("bte,ehd->bthd", h, block.attn.wk[...].astype(cdt))
      out.append((apply_rope(q, cos, sin).astype(jnp.float32),
                  apply_rope(k, cos, sin).astype(jnp.float32)))
      x = block(x, cos, sin)
    return out

  return run(model, tokens)


def held_out_tokens(config: Config, windows: int, seq_len: int) -> jax.Array:
  """`windows` validation windows of `seq_len` tokens, `[windows, seq_len]` int32."""
  cfg = apply_overrides(config, [f"train.seq_len={seq_len}"])
  batches = make_batches(cfg, "val", global_batch=windows, accum=1)
  return jnp.asarray(batches.batch(0)["inputs"][0], jnp.int32)


def quality_rows(layers, *, block_size: int, top_ks, beam_factors) -> list[dict]:
  """Quality per selector, averaged over layers, KV heads and rows.

  The layers are stacked along the batch axis: every layer contributes the same number of rows, so
  the row average of the stack is the average over layers, and each selector runs as one call.
  """
  q = jnp.concatenate([q for q, _ in layers], axis=0)
  k = jnp.concatenate([k for _, k in layers], axis=0)
  rows = []
  for top_k in top_ks:
    variants = [(s, None) for s in FLAT]
    variants += [("pisa", int(round(f * top_k))) for f in beam_factors]
    variants += [("exact", None)]
    for selector, beam in variants:
      idx = pisa_jax.select_blocks(q, k, block_size=block_size, top_k=top_k, selector=selector,
                                   beam=beam, implementation="xla")
      quality = pisa_jax.selection_quality(q, k, idx, block_size=block_size)
      row = {"top_k": top_k, "selector": selector, "beam": beam or top_k,
             "recall": float(quality.recall), "captured_mass": float(quality.captured_mass),
             "mass_ratio": float(quality.mass_ratio), "rows": int(quality.num_rows)}
      rows.append(row)
      print(f"K={top_k:<3d} {selector:<6s} beam {row['beam']:<4d} recall {row['recall']:.4f}  "
            f"captured {row['captured_mass']:.4f}  ratio {row['mass_ratio']:.4f}", flush=True)
  return rows


def plot(result: dict, path: Path) -> None:
  """Recall@K against the beam width, one panel per K; flat selectors and "exact" as lines."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = {"bsa": "tab:gray", "pisa1": "tab:orange", "pisa2": "tab:green", "exact": "tab:red"}
  s = result["settings"]
  top_ks = sorted({r["top_k"] for r in result["rows"]})
  fig, axes = plt.subplots(1, len(top_ks), figsize=(6 * len(top_ks), 4.5), squeeze=False)
  for ax, top_k in zip(axes[0], top_ks):
    rows = [r for r in result["rows"] if r["top_k"] == top_k]
    pisa = sorted((r for r in rows if r["selector"] == "pisa"), key=lambda r: r["beam"])
    ax.plot([r["beam"] for r in pisa], [r["recall"] for r in pisa], "o-", color="tab:blue",
            label="pisa")
    for r in rows:
      if r["selector"] in colors:
        ax.axhline(r["recall"], ls="--", lw=1, color=colors[r["selector"]],
                   label=f"{r['selector']} ({r['recall']:.3f})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("beam (nodes kept per level)")
    ax.set_ylabel(f"Recall@{top_k}")
    ax.set_title(f"K = {top_k}: {s['layers']} layers, {s['windows']} windows of {s['seq_len']} "
                 f"tokens, step {s['checkpoint_step']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", type=Path, required=True, help="a training run's workdir")
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--seq-len", type=int, default=None,
                      help="window length (default: the run's train.seq_len)")
  parser.add_argument("--windows", type=int, default=4, help="held-out windows")
  parser.add_argument("--top-k", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
  parser.add_argument("--beam-factors", type=lambda s: [float(x) for x in s.split(",")],
                      default=[1.0, 1.5, 2.0, 4.0], help="PISA beams as multiples of K")
  parser.add_argument("--train-seconds", type=float, default=0.0,
                      help="first train (or resume) the run in --workdir for this long")
  parser.add_argument("--preset", default="small", help="with --train-seconds: the preset")
  parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="with --train-seconds: config overrides (default attention: dense)")
  args = parser.parse_args(argv)

  training = None
  if args.train_seconds > 0:
    config = apply_overrides(get_config(args.preset), ["model.attention=dense"] + args.set)
    result = train(config, args.workdir, max_seconds=args.train_seconds, progress=False,
                   print_config=False)
    losses = sorted(result.losses.items())
    training = {"preset": args.preset, "overrides": args.set, "seconds": args.train_seconds,
                "steps": result.end_step - result.start_step,
                "first_loss": losses[0][1] if losses else None,
                "last_loss": losses[-1][1] if losses else None}
  config, model, step = restore_model(args.workdir)
  seq_len = args.seq_len or config.train.seq_len
  tokens = held_out_tokens(config, args.windows, seq_len)
  layers = capture_qk(model, tokens)
  rows = quality_rows(layers, block_size=config.model.block_size, top_ks=args.top_k,
                      beam_factors=args.beam_factors)
  result = {
      "evaluation": "selection_quality", "jax": jax.__version__,
      "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
      "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "settings": {"workdir": str(args.workdir), "checkpoint_step": step, "training": training,
                   "model": {"layers": config.model.num_layers, "heads": config.model.num_heads,
                             "kv_heads": config.model.num_kv_heads,
                             "attention": config.model.attention},
                   "layers": len(layers), "windows": int(tokens.shape[0]), "seq_len": seq_len,
                   "block_size": config.model.block_size, "data": config.data.path},
      "rows": rows}
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "selection_quality.json").write_text(json.dumps(result, indent=1) + "\n")
  plot(result, args.out / "selection_quality.png")
  print(f"wrote {args.out / 'selection_quality.json'} and {args.out / 'selection_quality.png'}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
