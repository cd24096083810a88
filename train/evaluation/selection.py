"""How well does each selector find the blocks that full attention weights most (Section 4.4,
Appendix D.2, Table 7, Figure 2)?

Every selector replays on the same post-RoPE queries and keys: each layer's, captured from a
checkpoint's forward pass over held-out windows (its own attention, dense or sparse, produces the
activations), or read from an .npz of any model's attention. For each K in `top_ks`: bsa, pisa1,
pisa2, pisa with beam K x each beam factor, and "exact" (every complete past block by its exact
key LSE, the upper bound of a block selector), all through the jnp reference.
`pisa_jax.selection_quality` scores each against the full-attention reference set: Recall@K,
captured mass and mass ratio, averaged with equal weight per (window, position, layer, KV head)
decision over the rows with more than K eligible blocks, as Table 7.

By query position (Figure 2): selection for a query reads nothing after it, so the quality over
the first p positions is `selection_quality` of the arrays cut at p. Sums over nested prefixes at
log-spaced cuts (`prefix_edges`) give each bucket between two cuts exactly, at about twice the
cost of the whole (the cuts grow by 4/3 and 3/2 in turn; each costs O(p^2)).

The .npz layout: `q` float `[L, B, T, HQ, D]` and `k` float `[L, B, T, HKV, D]`, post-RoPE, as
the attention uses them (L layers, B windows, T positions; HQ a multiple of HKV).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from pisa_jax.models.decoder import RopeSpec, compute_dtype
from pisa_jax.train.evaluation import common

FLAT = ("bsa", "pisa1", "pisa2")


# ----------------------------------------------------------------------------- inputs


@jax.jit
def _embed(model, tokens):
  return jnp.take(model.embed[...], tokens, axis=0).astype(compute_dtype(model.cfg))


@jax.jit
def _layer(block, x, cos, sin):
  """One block: its post-RoPE q `[B, T, HQ, D]` and k `[B, T, HKV, D]` in float32, as its
  attention sees them, and its output (the next block's input)."""
  q, k = block.attn.rotated_qk(block.attn_norm(x), cos, sin)
  return q.astype(jnp.float32), k.astype(jnp.float32), block(x, cos, sin)


def capture_layers(model, tokens: np.ndarray) -> Iterator[tuple[jax.Array, jax.Array]]:
  """Each layer's (q, k) over `tokens` `[B, T]`, one layer at a time: all layers at once would
  hold L x B x T x (HQ + HKV) x D floats."""
  cfg = model.cfg
  cos, sin = RopeSpec.of(cfg).angles(tokens.shape[1])
  x = _embed(model, jnp.asarray(tokens, jnp.int32))
  for block in model.blocks:
    q, k, x = _layer(block, x, cos, sin)
    yield q, k


# ----------------------------------------------------------------------------- quality


def variants(top_k: int, beam_factors: list[float]) -> list[tuple[str, int]]:
  """(selector, beam) pairs at one K: the flat selectors, pisa at each beam, then exact."""
  beams = sorted({max(top_k, int(round(f * top_k))) for f in beam_factors})
  return ([(s, top_k) for s in FLAT] + [("pisa", b) for b in beams] + [("exact", top_k)])


def prefix_edges(length: int, block_size: int, top_k: int) -> tuple[int, list[int]]:
  """(first, cuts): rows before `first` = K x C have at most K eligible blocks and are never
  counted; the buckets are [first, cuts[0]), [cuts[0], cuts[1]), ... with cuts[-1] = length.
  The cuts are the multiples of C nearest to 2^i and 1.5 x 2^i."""
  first = top_k * block_size
  if first >= length:
    return first, [length]
  marks, power = set(), 1
  while power < length:
    marks.update({power, 3 * power // 2})
    power *= 2
  cuts = sorted({-(-m // block_size) * block_size for m in marks})
  return first, [c for c in cuts if first < c < length] + [length]


def _quality_sums(q, k, idx, cuts: list[int], block_size: int) -> np.ndarray:
  """float64 `[len(cuts), 4]`: summed recall, captured mass, mass ratio, and rows over the
  positions before each cut."""
  out = np.zeros((len(cuts), 4))
  for i, p in enumerate(cuts):
    quality = pisa_jax.selection_quality(q[:, :p], k[:, :p], idx[:, :p], block_size=block_size)
    rows = int(quality.num_rows)
    if rows:
      out[i] = [float(quality.recall) * rows, float(quality.captured_mass) * rows,
                float(quality.mass_ratio) * rows, rows]
  return out


def _metrics(sums: np.ndarray) -> dict:
  recall, captured, ratio, rows = sums
  return {"rows": int(rows), "recall": common.mean_or_none(recall, rows),
          "captured_mass": common.mean_or_none(captured, rows),
          "mass_ratio": common.mean_or_none(ratio, rows)}


def run_selection(layers_at: Callable[[int], Iterator[tuple]], *, num_layers: int,
                  lengths: list[int], block_size: int, top_ks: list[int],
                  beam_factors: list[float], progress: bool, source: dict) -> dict:
  """Table 7 rows and Figure 2's quality by query position at each length.

  layers_at(length) yields each layer's (q `[B, T, HQ, D]`, k `[B, T, HKV, D]`) at that length.
  Returns the `selection` part of eval.json: rows [{length, top_k, selector, beam, recall,
  captured_mass, mass_ratio, rows}] and by_position [{... start, end, rows, recall, ...}].
  """
  start = time.perf_counter()
  rows, by_position = [], []
  work = num_layers * sum(len(variants(t, beam_factors)) for t in top_ks) * len(lengths)
  bar = common.progress_bar(work, "selection", progress)
  for length in lengths:
    bar.set_description(f"selection {length}")
    edges = {t: prefix_edges(length, block_size, t) for t in top_ks}
    sums = {}
    for q, k in layers_at(length):
      for top_k in top_ks:
        for selector, beam in variants(top_k, beam_factors):
          idx = pisa_jax.select_blocks(q, k, block_size=block_size, top_k=top_k,
                                       selector=selector,
                                       beam=beam if selector == "pisa" else None,
                                       implementation="xla")
          key = (top_k, selector, beam)
          layer = _quality_sums(q, k, idx, edges[top_k][1], block_size)
          sums[key] = sums.get(key, 0) + layer
          bar.update(1)
    for (top_k, selector, beam), total in sums.items():
      head = {"length": length, "top_k": top_k, "selector": selector, "beam": beam}
      rows.append({**head, **_metrics(total[-1])})
      first, cuts = edges[top_k]
      starts = [first] + cuts[:-1]
      for i, (lo, hi) in enumerate(zip(starts, cuts)):
        if lo >= hi:
          continue
        bucket = total[i] - (total[i - 1] if i else 0)
        by_position.append({**head, "start": lo, "end": hi, **_metrics(bucket)})
  bar.close()
  return {"block_size": block_size, "top_k": top_ks, "beam_factors": beam_factors,
          "layers": num_layers, "source": source, "rows": rows, "by_position": by_position,
          "wall_seconds": time.perf_counter() - start}


def run_on_checkpoint(model, config, *, lengths: list[int], samples: int, seed: int,
                      data: str | None, block_size: int, top_ks: list[int],
                      beam_factors: list[float], progress: bool) -> dict:
  """`run_selection` on each layer of `model` over the held-out windows of `common.held_out`."""
  sources = {}

  def layers_at(length):
    windows = common.held_out(config, length=length, samples=samples, seed=seed, data=data)
    sources[length] = windows["source"]
    return capture_layers(model, windows["inputs"])

  part = run_selection(layers_at, num_layers=config.model.num_layers, lengths=lengths,
                       block_size=block_size, top_ks=top_ks, beam_factors=beam_factors,
                       progress=progress, source={"kind": "checkpoint", "windows": samples})
  part["source"]["data"] = {str(n): s for n, s in sources.items()}
  return part


def run_on_arrays(q: np.ndarray, k: np.ndarray, *, path: str, lengths: list[int],
                  block_size: int, top_ks: list[int], beam_factors: list[float],
                  progress: bool) -> dict:
  """`run_selection` on the layers of an .npz (`arguments.load_npz`); each length is a prefix
  of T."""

  device = jax.devices()[0]

  def layers_at(length):
    # Placed (committed) like a restored model's activations: both share compiled selectors.
    for layer in range(q.shape[0]):
      yield (jax.device_put(q[layer, :, :length].astype(np.float32), device),
             jax.device_put(k[layer, :, :length].astype(np.float32), device))

  layers, batch, seq_len, heads, head_dim = q.shape
  source = {"kind": "npz", "path": str(path), "layers": layers, "batch": batch,
            "seq_len": seq_len, "heads": heads, "kv_heads": k.shape[3], "head_dim": head_dim,
            "dtype": str(q.dtype)}
  return run_selection(layers_at, num_layers=layers, lengths=lengths, block_size=block_size,
                       top_ks=top_ks, beam_factors=beam_factors, progress=progress,
                       source=source)
