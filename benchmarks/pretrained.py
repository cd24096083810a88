"""Training-free PISA on a pretrained model: the model's own dense attention swapped for PISA, BSA
or PISA-2 at K = 8, 16 and 32 (PISA also with a wider beam), without any training.

  python -m benchmarks.fetch_smollm2                               # SmolLM2-135M-Instruct, GGUF
  pisa-import ~/.cache/pisa_jax/pretrained/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smol
  pisa-prepare-data --tokenizer runs/smol --corpus wiki-offline --corpus sotu --out data/smol
  python -m benchmarks.pretrained --data data/smol                 # on a GPU

For every variant: perplexity on held-out windows of real text (the val split of --data, a
pisa-prepare-data corpus in the model's own tokens) at --ppl-lengths (2K and 8K), and RULER's
needle-in-a-haystack tasks (the four families, `pisa-eval`'s generator, prompts in the model's
tokenizer, greedy through the decode path until the model's end-of-sequence token) at
--ruler-lengths (1K to 8K). Once, on the dense model: Recall@K and captured attention mass of each
selector at each K on the model's own post-RoPE q / k of every layer (`pisa-eval`'s selection
suite, Table 7's measure) at --selection-length. Rows:

  {"part": "ppl", "variant", "attention", "top_k", "beam", "length", "loss", "ppl"}
  {"part": "ruler", "variant", ..., "length", "score"}  and  {"part": "ruler", ..., "length":
      "average", "score"}  (the paper's average over families and lengths)
  {"part": "selection", "length", "top_k", "selector", "beam", "recall", "captured_mass", ...}
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks import _record

NAME = "pretrained"


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
  return [float(x) for x in text.split(",") if x]


def variants(top_ks: list[int], beam_factors: list[float],
             kinds: tuple[str, ...] = ("pisa", "bsa", "pisa2")) -> list[tuple[str, int, int]]:
  """(attention, top_k, beam) of every variant: dense first (K and beam 0: none), then each K's
  kinds, and PISA at each wider beam (beam_factor x K)."""
  out = [("dense", 0, 0)]
  for k in top_ks:
    for kind in kinds:
      out.append((kind, k, 0))
      if kind == "pisa":
        out += [("pisa", k, int(round(f * k))) for f in beam_factors if round(f * k) > k]
  return out


def variant_name(attention: str, top_k: int, beam: int) -> str:
  if attention == "dense":
    return "dense"
  return f"{attention} K{top_k}" + (f" beam {beam}" if beam else "")


def settings(args) -> dict:
  return {"model": str(args.model), "data": str(args.data), "ppl_lengths": args.ppl_lengths,
          "ruler_lengths": args.ruler_lengths, "top_ks": args.top_ks,
          "beam_factors": args.beam_factors, "block_size": args.block_size,
          "ppl_samples": args.ppl_samples, "ruler_samples": args.ruler_samples,
          "selection_length": args.selection_length,
          "selection_samples": args.selection_samples, "compute_dtype": args.compute_dtype,
          "implementation": args.implementation, "only": args.only}


def measure(args, rec: _record.Recorder) -> None:
  from pisa_jax.configs import Config, DataConfig, TrainConfig
  from pisa_jax.models import load_pretrained
  from pisa_jax.models.pretrained import read_pretrained
  from pisa_jax.train.evaluation import needles, perplexity, selection
  from pisa_jax.train.tokenizer import RunTokenizer

  source = read_pretrained(args.model)
  source.tensors.close()
  encoding, stop = RunTokenizer(source.tokenizer), source.eos_token_ids
  if not stop:
    rec.note("the model names no end-of-sequence token: RULER generates each answer's full "
             "budget")
  longest = max(args.ppl_lengths + args.ruler_lengths + [args.selection_length])
  chosen = variants(args.top_ks, args.beam_factors)
  if args.only:
    chosen = [v for v in chosen if variant_name(*v) in args.only]
  for attention, top_k, beam in chosen:
    options = {} if attention == "dense" else dict(
        top_k=top_k, beam=beam or None, block_size=args.block_size,
        attention_implementation=args.implementation)
    model, cfg, _ = load_pretrained(args.model, attention=attention,
                                    compute_dtype=args.compute_dtype, **options)
    config = Config(model=cfg, data=DataConfig(source="tokens", path=str(args.data)),
                    train=TrainConfig(seq_len=longest))
    head = {"variant": variant_name(attention, top_k, beam), "attention": attention,
            "top_k": top_k or None, "beam": beam or None}
    start = time.perf_counter()
    ppl = perplexity.run_perplexity(model, config, lengths=args.ppl_lengths,
                                    samples=args.ppl_samples, seed=0, data=str(args.data),
                                    batch_size=args.batch_size, progress=False)
    for row in ppl["rows"]:
      rec.add(part="ppl", **head, length=row["length"], loss=row["loss"], ppl=row["ppl"])
    ruler, _ = needles.run_ruler(model, config, lengths=args.ruler_lengths,
                                 samples=args.ruler_samples, seed=0, batch_size=args.batch_size,
                                 progress=False, encoding=encoding, stop=stop)
    for row in ruler["by_length"]:
      rec.add(part="ruler", **head, length=row["length"], score=row["score"])
    rec.add(part="ruler", **head, length="average", score=ruler["average"])
    print(f"{head['variant']}: ppl {[round(r['ppl'], 3) for r in ppl['rows']]}, RULER "
          f"{ruler['average']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
    if attention == "dense" and args.selection_length:
      part = selection.run_on_checkpoint(
          model, config, lengths=[args.selection_length], samples=args.selection_samples,
          seed=0, data=str(args.data), block_size=args.block_size, top_ks=args.top_ks,
          beam_factors=[1.0, *args.beam_factors], progress=False)
      for row in part["rows"]:
        rec.add(part="selection", **row)
    del model


def table(record: dict) -> str:
  rows = record["rows"]
  names = list(dict.fromkeys(r["variant"] for r in rows if r["part"] != "selection"))
  ppl_lengths = sorted({r["length"] for r in rows if r["part"] == "ppl"})
  ruler_lengths = sorted({r["length"] for r in rows if r["part"] == "ruler"
                          and r["length"] != "average"})

  def value(part, name, length, key):
    hit = [r[key] for r in rows if r["part"] == part and r.get("variant") == name
           and r["length"] == length]
    return hit[0] if hit else None

  lines = [[n] + [value("ppl", n, L, "ppl") for L in ppl_lengths]
           + [value("ruler", n, L, "score") for L in ruler_lengths]
           + [value("ruler", n, "average", "score")] for n in names]
  out = _record.markdown(["variant"] + [f"ppl {L}" for L in ppl_lengths]
                         + [f"NIAH {L}" for L in ruler_lengths] + ["NIAH avg"], lines)
  chosen = [r for r in rows if r["part"] == "selection"]
  if chosen:
    out += "\n\n" + _record.markdown(
        ["length", "K", "selector", "beam", "Recall@K", "captured mass"],
        [[r["length"], r["top_k"], r["selector"], r["beam"], r["recall"], r["captured_mass"]]
         for r in chosen])
  return out


def plot(record: dict, path: Path) -> None:
  plt = _record.pyplot()
  rows = record["rows"]
  names = list(dict.fromkeys(r["variant"] for r in rows if r["part"] != "selection"))
  fig, axes = plt.subplots(1, 3, figsize=(18, 5))
  ax = axes[0]
  ppl_lengths = sorted({r["length"] for r in rows if r["part"] == "ppl"})
  width = 0.8 / max(len(ppl_lengths), 1)
  for i, length in enumerate(ppl_lengths):
    values = [next((r["ppl"] for r in rows if r["part"] == "ppl" and r["variant"] == n
                    and r["length"] == length), 0) for n in names]
    ax.bar([j + i * width for j in range(len(names))], values, width, label=f"{length} tokens")
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=60, ha="right")
  ax.set_ylabel("perplexity")
  ax.set_title("held-out perplexity")
  ax.legend()
  ax = axes[1]
  scores = [next((r["score"] for r in rows if r["part"] == "ruler" and r["variant"] == n
                  and r["length"] == "average"), 0) for n in names]
  ax.bar(range(len(names)), scores, color="tab:green")
  ax.set_xticks(range(len(names)), names, rotation=60, ha="right")
  ax.set_ylim(0, 1)
  ax.set_ylabel("RULER NIAH average")
  ax.set_title("needle in a haystack (training-free)")
  ax = axes[2]
  chosen = [r for r in rows if r["part"] == "selection"]
  labels = list(dict.fromkeys(f"{r['selector']}" + (f" beam {r['beam']}" if r["selector"]
                                                    == "pisa" else "") for r in chosen))
  ks = sorted({r["top_k"] for r in chosen})
  for label in labels:
    ys = [next((r["recall"] for r in chosen if r["top_k"] == k and (
        f"{r['selector']}" + (f" beam {r['beam']}" if r["selector"] == "pisa" else "")) == label),
               None) for k in ks]
    ax.plot(ks, ys, marker="o", label=label)
  ax.set_xlabel("K (blocks)")
  ax.set_ylabel("Recall@K")
  ax.set_title("selection on the model's own q / k")
  if labels:
    ax.legend(fontsize=7)
  fig.suptitle(_record.header(record), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--model", type=Path, default=None,
                 help="a .gguf file or Hugging Face folder (default: benchmarks.fetch_smollm2's)")
  p.add_argument("--data", type=Path, help="a pisa-prepare-data folder in the model's tokens")
  p.add_argument("--ppl-lengths", type=_ints, default=[2048, 8192])
  p.add_argument("--ruler-lengths", type=_ints, default=[1024, 2048, 4096, 8192])
  p.add_argument("--top-ks", type=_ints, default=[8, 16, 32])
  p.add_argument("--beam-factors", type=_floats, default=[2.0],
                 help="PISA's wider beams, as multiples of K")
  p.add_argument("--block-size", type=int, default=64)
  p.add_argument("--ppl-samples", type=int, default=16)
  p.add_argument("--ruler-samples", type=int, default=10)
  p.add_argument("--selection-length", type=int, default=8192, help="0: no selection part")
  p.add_argument("--selection-samples", type=int, default=2)
  p.add_argument("--batch-size", type=int, default=4)
  p.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
  p.add_argument("--implementation", default=None, choices=("xla", "pallas"),
                 help="sparse attention's (default: the library's for the device)")
  p.add_argument("--only", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                 default=None, help="comma-separated variant names, e.g. 'dense,pisa K8'")
  args = p.parse_args(argv)
  if not args.replot:
    if args.model is None:
      from benchmarks.fetch_smollm2 import default_path

      args.model = default_path()
    if args.data is None:
      p.error("--data: give a pisa-prepare-data folder tokenized with the model's tokenizer "
              "(pisa-prepare-data --tokenizer RUN)")
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
