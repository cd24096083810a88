"""How fast could two kernels be on this GPU at best? Floors and ceilings measured without our
kernels' logic, to tell what a rewrite could win before writing it.

Part "walk floor": a level of the decode walk (`kernels/decode/select.py`) gathers the children
of its 2 * beam candidates, 2 * NC summary rows of D float32, in one program per (row, KV head),
and the next level's rows depend on this level's scores. Here a Pallas-Triton kernel runs
`--levels` such dependent gathers and nothing else of the walk: no Select_K, no expansion; the
next rows come from the signs of the values loaded. Variants: "f32 dots" (the float32 rows as
bfloat16 high + low halves, two `[16, D] x [D, 2NC]` dots, summed over the heads: what the walk
does before ranking), "bf16 dot" (bfloat16 rows, one dot: half the bytes), "f32 sum" (the float32
rows summed, no dot). One program per KV head, 2 KV heads, B = 1, the summaries of a 1M-token
pyramid (32K nodes per head). Time per level: (time at L2 - time at L1) / (L2 - L1), each the
kernel launched 200 times in one jitted loop.

Part "tile ceiling": a query-tile attention program (TQ queries x G heads = 64 rows per
warpgroup, over the union of the blocks its queries selected) cannot run its dots faster than
dense attention on the same shapes. Dense attention of 128 query rows over U blocks of 64 keys,
4,096 programs, the keys and values shared by 16 query heads (as neighbouring tiles share
blocks in L2), forward and forward + backward, by cuDNN (`jax.nn.dot_product_attention`, bf16)
and by jax's Mosaic GPU FlashAttention-3-style kernel (`attention_mgpu`, float16: its bfloat16
path does not build in jax 0.11.2; best of block_kv 64 and 128). TFLOP/s count 4 * rows * keys
* D per forward and 3.5x that per forward + backward. "long" rows: one 16K x 16K sequence, 32/2
heads, for the kernels' best case.

  python -m benchmarks.ceilings                      # both parts, benchmarks/results/
  python -m benchmarks.ceilings --parts walk --nodes 256 --levels 1,3 --out /tmp/c   # any CPU
  python -m benchmarks.ceilings --replot benchmarks/results/ceilings.json
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from benchmarks import _record, timing
from pisa_jax.kernels._common import qk_dot, triton_deprecation_silenced
from pisa_jax.kernels.decode.layout import load_scalar
from pisa_jax.kernels.decode.scoring import split_logits

NAME = "ceilings"
HKV, GROUP, LOOP = 2, 16, 200
WALK_VARIANTS = (("f32 dots", (4, 8, 16)), ("bf16 dot", (8,)), ("f32 sum", (8, 16)))


def _chain_kernel(start_ref, s_ref, q_ref, o_ref, *, levels: int, variant: str, nodes: int,
                  d: int):
  """`levels` dependent gathers of `[2NC, D]` rows for KV head `program_id`, from the nodes
  `start + 7 j`; writes the last row ids `[2NC]`."""
  head = pl.program_id(0)
  cols = jnp.arange(d)
  q = q_ref[...]
  width = o_ref.shape[1]

  def level(i, node):
    rows = plt.load(s_ref.at[(node * HKV + head)[:, None], cols[None, :]])
    if variant == "f32 sum":
      value = jnp.sum(rows, axis=1)
    elif variant == "bf16 dot":
      value = jnp.sum(qk_dot(q, rows, True), axis=0)
    else:  # the walk's own scoring of float32 summaries (`summary_logits`)
      value = jnp.sum(split_logits(q, rows), axis=0)
    return (node * 2 + (value > 0).astype(jnp.int32) + i) % nodes

  start = load_scalar(start_ref, 0)
  node = lax.fori_loop(0, levels, level, (start + jnp.arange(width, dtype=jnp.int32) * 7) % nodes)
  o_ref[pl.ds(head, 1), :] = node[None, :]


def chain(start, summaries, q, *, levels: int, variant: str, warps: int, width: int,
          interpret: bool):
  """The chain kernel from node `start` (int32 `[1]`) over summaries `[nodes * HKV, D]` and the
  group's queries `[16, D]`."""
  nodes, d = summaries.shape[0] // HKV, summaries.shape[1]
  kernel = functools.partial(_chain_kernel, levels=levels, variant=variant, nodes=nodes, d=d)
  with triton_deprecation_silenced():
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((HKV, width), jnp.int32), grid=(HKV,),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="ceiling_walk_chain")(start, summaries, q)


def _in_loop_us(step, *args) -> float:
  """Microseconds per call of `step(start, *args)` run LOOP times in one jitted loop, each call
  from the previous call's first node (so that no call can be hoisted out of the loop)."""
  def many(*args):
    return lax.fori_loop(0, LOOP, lambda i, node: step(node, *args)[0, :1],
                         jnp.zeros((1,), jnp.int32))
  return timing.time_jax(jax.jit(many), *args) / LOOP * 1e3


def measure_walk(args, rec: _record.Recorder) -> None:
  interpret = jax.default_backend() == "cpu"
  key = jax.random.split(jax.random.key(0), 2)
  s32 = jax.random.normal(key[0], (args.nodes * HKV, args.d), jnp.float32)
  q = jax.random.normal(key[1], (GROUP, args.d), jnp.bfloat16)
  lo, hi = args.levels
  for variant, warps_list in WALK_VARIANTS:
    s = s32.astype(jnp.bfloat16) if variant == "bf16 dot" else s32
    for warps in warps_list:
      us = {}
      for levels in (lo, hi):
        step = functools.partial(chain, levels=levels, variant=variant, warps=warps,
                                 width=2 * args.candidates, interpret=interpret)
        us[levels] = _in_loop_us(step, s, q)
      rec.add(part="walk floor", variant=variant, warps=warps, rows=2 * args.candidates,
              d=args.d, kb_per_level=round(2 * args.candidates * args.d * s.dtype.itemsize / 1024,
                                           1),
              us_at={str(k): round(v, 2) for k, v in us.items()},
              us_per_level=round((us[hi] - us[lo]) / (hi - lo), 3))


def _attention_sides(backward: bool):
  """(side, dtype, fn(q, k, v)) of the dense kernels; fn returns what a step would."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

  def with_grad(fn):
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))

  sides = [("cudnn", jnp.bfloat16, cudnn)]
  for block_kv in (64, 128):
    extra = dict(block_q_dkv=64, block_kv_dkv=block_kv, block_q_dq=64,
                 block_kv_dq=block_kv) if backward else {}
    config = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, **extra)
    sides.append((f"mosaic kv{block_kv}", jnp.float16,
                  functools.partial(mgpu.attention, config=config)))
  return [(side, dtype, with_grad(fn) if backward else fn) for side, dtype, fn in sides]


def _attention_row(rec, shape, d, backward, kind, blocks):
  batch, rows, hq, hkv, keys = shape
  flops = 4 * batch * rows * hq * keys * d * (3.5 if backward else 1.0)
  best = {}
  for side, dtype, fn in _attention_sides(backward):
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (batch, rows, hq, d), dtype)
    k = jax.random.normal(ks[1], (batch, keys, hkv, d), dtype)
    v = jax.random.normal(ks[2], (batch, keys, hkv, d), dtype)
    try:
      ms = timing.time_jax(jax.jit(fn), q, k, v)
    except Exception as e:  # a config the kernel rejects (shared memory): noted, not fatal
      rec.note(f"{side} d{d} {kind} U={blocks} {'fwd+bwd' if backward else 'fwd'}: "
               f"{type(e).__name__}: {str(e)[:160]}")
      continue
    name = "mosaic" if side.startswith("mosaic") else side
    if name not in best or ms < best[name][0]:
      best[name] = (ms, side)
  for name, (ms, side) in best.items():
    rec.add(part="tile ceiling", kind=kind, d=d, blocks=blocks, side=name, config=side,
            phase="fwd+bwd" if backward else "fwd", ms=ms, tflops=round(flops / ms / 1e9, 1))


def measure_tiles(args, rec: _record.Recorder) -> None:
  if jax.default_backend() != "gpu":
    rec.note("tile ceiling: cuDNN and Mosaic GPU need a GPU; part skipped")
    return
  for d in (64, 128):
    _attention_row(rec, (1, 16384, 32, 2, 16384), d, False, "long", 256)
  _attention_row(rec, (1, 16384, 32, 2, 16384), 128, True, "long", 256)
  # 4,096 programs of 128 rows (two 64-row tiles), keys shared by 16 heads.
  for d, blocks_list, backward in ((64, (8, 12, 16, 24), False), (128, (32, 48, 64), False),
                                   (128, (48, 64), True)):
    for blocks in blocks_list:
      _attention_row(rec, (256, 128, 16, 1, blocks * 64), d, backward, "tile", blocks)


def measure(args, rec: _record.Recorder) -> None:
  if "walk" in args.parts:
    measure_walk(args, rec)
  if "tile" in args.parts:
    measure_tiles(args, rec)


def table(record: dict) -> str:
  walk = [[r["variant"], r["warps"], r["kb_per_level"], r["us_per_level"]]
          for r in record["rows"] if r["part"] == "walk floor"]
  tile = [[r["kind"], r["d"], r["blocks"], r["phase"], r["side"], r["ms"], r["tflops"]]
          for r in record["rows"] if r["part"] == "tile ceiling"]
  out = []
  if walk:
    out.append(_record.markdown(["walk floor", "warps", "KiB a level", "us a level"], walk))
  if tile:
    out.append(_record.markdown(["shape", "d", "blocks", "phase", "side", "ms", "TFLOP/s"], tile))
  return "\n\n".join(out)


def plot(record: dict, path) -> None:
  pyplot = _record.pyplot()
  fig, (ax_w, ax_t) = pyplot.subplots(1, 2, figsize=(13, 5))
  walk = [r for r in record["rows"] if r["part"] == "walk floor"]
  ax_w.bar(np.arange(len(walk)), [r["us_per_level"] for r in walk])
  ax_w.set_xticks(np.arange(len(walk)))
  ax_w.set_xticklabels([f"{r['variant']}\n{r['warps']} warps\n{r['kb_per_level']} KiB"
                        for r in walk], fontsize=7)
  ax_w.set_ylabel("us per dependent level")
  ax_w.set_title("decode walk: a chain of summary gathers, nothing else", fontsize=9)
  tile = [r for r in record["rows"] if r["part"] == "tile ceiling" and r["kind"] == "tile"]
  for (side, d, phase) in dict.fromkeys((r["side"], r["d"], r["phase"]) for r in tile):
    pts = sorted((r["blocks"], r["tflops"]) for r in tile
                 if (r["side"], r["d"], r["phase"]) == (side, d, phase))
    ax_t.plot(*zip(*pts), marker="o", label=f"{side} d{d} {phase}")
  for r in record["rows"]:
    if r["part"] == "tile ceiling" and r["kind"] == "long":
      ax_t.axhline(r["tflops"], lw=0.6, ls=":", color="gray")
  ax_t.set_xlabel("blocks of 64 keys per 64-row tile")
  ax_t.set_ylabel("TFLOP/s (dotted: 16K x 16K dense)")
  ax_t.set_title("dense attention on query-tile shapes", fontsize=9)
  if tile:
    ax_t.legend(fontsize=7)
  fig.suptitle(f"ceilings, {record['device']}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  pyplot.close(fig)


def settings(args) -> dict:
  return dict(parts=list(args.parts), nodes=args.nodes, kv_heads=HKV, group=GROUP, d=args.d,
              candidates=args.candidates, levels=list(args.levels), loop=LOOP,
              timing="median of 7 batches of back-to-back calls (benchmarks/timing.py)")


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(","))


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--parts", type=lambda s: tuple(s.split(",")), default=("walk", "tile"),
                 help="walk, tile or both (default both)")
  p.add_argument("--nodes", type=int, default=32768, help="pyramid nodes per KV head")
  p.add_argument("--d", type=int, default=128, help="head dim of the walk floor")
  p.add_argument("--candidates", type=int, default=64, help="NC: 2 * beam (K = 32: 64)")
  p.add_argument("--levels", type=_ints, default=(1, 17), help="two level counts, L1,L2")
  args = p.parse_args(argv)
  if not set(args.parts) <= {"walk", "tile"}:
    p.error(f"--parts {','.join(args.parts)}: expected walk, tile or walk,tile")
  if len(args.levels) != 2 or not 1 <= args.levels[0] < args.levels[1]:
    p.error(f"--levels {args.levels}: expected two counts 1 <= L1 < L2")
  if args.candidates & (args.candidates - 1) or args.candidates < 8:
    p.error(f"--candidates {args.candidates}: expected a power of two >= 8")
  if args.d & (args.d - 1) or args.d < 16:
    p.error(f"--d {args.d}: expected a power of two >= 16 (a Triton dot's dimension)")
  if args.nodes < 1:
    p.error(f"--nodes {args.nodes}: expected >= 1")
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
