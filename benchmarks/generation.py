"""What does an inference user get? `pisa_jax.generate` end to end, PISA against dense attention.

A model of a preset (`small`, `418m`) with random weights (bf16 compute) generates
--new-tokens tokens (greedy, no stop token) after a batch of B prompts of random tokens, ragged:
row b's prompt is L - new_tokens - b * (L // 2B) tokens long, so the longest row's prompt and
new tokens fill a cache of L (32K, 128K; 512K at B = 1) and the shortest holds about half.
The 1M case at B = 1 reads its prompt in chunks of 64K (`prefill_chunk`: each chunk appended to
the cache, selecting over everything before it), and also in one pass where that fits; large
batches read theirs in chunks of 1M / B tokens (the activations of 1M tokens a pass).

Each case runs in a fresh process (`--worker`), the persistent compilation cache off:
  first_token_cold_s   the first generation's time to its first token: compilation and prefill
  prefill_warm_s       the second generation's: the prefill alone (dense at 1M runs one
                       generation, its prefill minutes long: no warm figure)
  tokens_per_s         the second generation's new tokens after the first, B per step, over
                       their time; ms_per_token its time per step (every row advances one)
  cache_mib_per_row    the decode state (every layer's keys, values and, for PISA, the pyramid)
                       at the capacity generate allocates, per row
  peak_gib             the device allocator's peak over the process
  first_tokens         each row's first token (a 1M chunked row against its one pass: same)
With --cached, each case runs a second fresh process reading the compilation cache the first
wrote: first_token_cached_s is what a second `pisa-generate` on the same shapes waits.

Cases are named PRESET-ATTENTION-B<batch>-<L>[-chunk<S>]; --cases takes comma-separated
fnmatch patterns (`small-*-B1-*`), --list prints every case with a rough estimate of its seconds
and the calls of at most --call-seconds (default 450, a margin under a 10-minute limit)
that cover the selection. A run keeps the
rows of the cases it did not run from the result already in --out, so calls of a few cases each
build one result (each row has its own date and commit).

  python -m benchmarks.generation --list                    # cases, estimates, one command a call
  python -m benchmarks.generation --cases 'small-*-32K'     # one call's cases
  python -m benchmarks.generation --presets tiny --lengths 256 --batches 2 --new-tokens 8 \\
      --no-long --implementation xla --out /tmp/g           # any CPU, a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _record

NAME = "generation"
PRESETS = ("small", "418m")
ATTENTIONS = ("pisa", "dense")
BATCHES = (1, 8, 32)
LENGTHS = (32768, 131072)
LONG = 524288  # at B = 1
MILLION = 1 << 20  # at B = 1: in chunks of CHUNK, and in one pass
CHUNK = 65536
# Tokens a prefill pass holds activations for: past it, a batch reads its prompts in chunks.
PASS_TOKENS = 1 << 20
# Cases of more cache tokens than this (B = 32 at 128K) are not run, and their rows say so: a
# chunked prefill stacks every layer's cache for its scan over the layers and splits it after
# (`Decoder.prefill_chunk`), about twice the cache in scratch beside it: ~100 GiB for `small` at
# 32 x 128K.
MAX_BATCH_TOKENS = 1 << 21
LEFT_OUT = (f"not run: more than {MAX_BATCH_TOKENS:,} cache tokens, where the chunked prefill's "
            f"stacked caches (about twice the cache) outgrow one GPU's memory")
NEW_TOKENS = 256
CALL_SECONDS = 450


@dataclasses.dataclass(frozen=True)
class Case:
  preset: str
  attention: str
  batch: int
  length: int  # cache tokens of the longest row: its prompt plus the new tokens
  chunk: int | None = None  # prefill_chunk

  @property
  def name(self) -> str:
    chunk = "" if self.chunk is None else f"-chunk{_size(self.chunk)}"
    return f"{self.preset}-{self.attention}-B{self.batch}-{_size(self.length)}{chunk}"

  @classmethod
  def parse(cls, name: str) -> "Case":
    """The case a name stands for (presets may hold '-': the fields are read from the right)."""
    found = re.fullmatch(r"(.+)-([a-z0-9]+)-B(\d+)-(\w+?)(?:-chunk(\w+))?", name)
    if not found:
      raise SystemExit(f"{name!r} is no case name: PRESET-ATTENTION-B<batch>-<L>[-chunk<S>]")
    preset, attention, batch, length, chunk = found.groups()
    return cls(preset, attention, int(batch), _tokens(length),
               None if chunk is None else _tokens(chunk))

  @property
  def once(self) -> bool:
    """Dense attention at 1M: one generation (a prefill of minutes), no warm repeat; its
    tokens/s are timed after its first call of steps (the one that compiles)."""
    return self.attention == "dense" and self.length >= MILLION

  def prompt_lengths(self, new_tokens: int) -> list[int]:
    longest = self.length - new_tokens
    step = self.length // (2 * self.batch)
    return [longest - b * step for b in range(self.batch)]


def _size(n: int) -> str:
  if n % (1 << 20) == 0:
    return f"{n >> 20}M"
  return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def _tokens(text: str) -> int:
  units = {"K": 1 << 10, "M": 1 << 20}
  return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def left_out(presets=PRESETS, lengths=LENGTHS, batches=BATCHES) -> list[Case]:
  """The cases of the grid's presets, lengths and batches past MAX_BATCH_TOKENS: each gets a row
  saying why it was not run (LEFT_OUT)."""
  return [Case(preset, attention, batch, length) for preset in presets
          for attention in ATTENTIONS for length in lengths for batch in batches
          if batch * length > MAX_BATCH_TOKENS]


def grid(presets=PRESETS, lengths=LENGTHS, batches=BATCHES, long: bool = True) -> list[Case]:
  """Every case: each preset and attention at each B and L up to MAX_BATCH_TOKENS; at B = 1 also
  512K, and 1M in chunks and (PISA, and dense as the baseline) in one pass. Dense attention is
  not read in chunks at 1M: its chunks' jnp attention would take ~10 minutes
  (`dense_chunk_attention`)."""
  cases = []
  for preset in presets:
    for attention in ATTENTIONS:
      for length in lengths:
        for batch in batches:
          if batch * length > MAX_BATCH_TOKENS:
            continue
          chunk = None if batch * length <= PASS_TOKENS else PASS_TOKENS // batch
          cases.append(Case(preset, attention, batch, length, chunk))
      if long:
        cases.append(Case(preset, attention, 1, LONG))
        cases.append(Case(preset, attention, 1, MILLION))
        if attention != "dense":
          cases.append(Case(preset, attention, 1, MILLION, CHUNK))
  return cases


# Rough H200 rates for --list (a plan, not a measurement): forward tokens/s of a preset's layers
# without attention, dense attention's FLOP/s, the compile and process start-up, a decode step.
_FORWARD_TOKENS_PER_S = {"small": 6e5, "418m": 2e5}
_DENSE_FLOPS = 3.5e14
_START_S = {"small": 25.0, "418m": 40.0}
_STEP_S = {"small": 0.003, "418m": 0.006}


def estimate_s(case: Case, new_tokens: int = NEW_TOKENS, cached: bool = False) -> float:
  """Seconds a case's process takes on an H200, roughly: start-up and compilation, two
  prefills, two generations' steps."""
  from pisa_jax.configs import get_config

  model = get_config(case.preset).model
  lengths = case.prompt_lengths(new_tokens)
  prefill = sum(lengths) / _FORWARD_TOKENS_PER_S.get(case.preset, 6e5)
  if case.attention == "dense":  # causal: 2 T^2 HQ D FLOPs a layer (QK^T and PV, half)
    prefill += sum(2 * n * n * model.num_heads * model.head_dim * model.num_layers
                   for n in lengths) / _DENSE_FLOPS
  decode = new_tokens * _STEP_S.get(case.preset, 0.003) * (1 + case.batch / 16)
  runs = 1 if case.once else 2
  once = _START_S.get(case.preset, 25.0) + runs * (prefill + decode)
  return once * (2 if cached else 1)


def plan(cases: list[Case], call_seconds: float, new_tokens: int, cached: bool
         ) -> list[list[Case]]:
  """The cases packed into calls of at most call_seconds (estimated), in order, first fit."""
  calls: list[list[Case]] = []
  loads: list[float] = []
  for case in cases:
    t = estimate_s(case, new_tokens, cached)
    for i, load in enumerate(loads):
      if load + t <= call_seconds:
        calls[i].append(case)
        loads[i] += t
        break
    else:
      calls.append([case])
      loads.append(t)
  return calls


# ----------------------------------------------------------------------------- one case


def run_case(case: Case, *, new_tokens: int, steps_per_call: int, implementation: str | None
             ) -> dict:
  """A case's measurements, in this process (`--worker` runs it in a fresh one)."""
  import jax
  import numpy as np
  from flax import nnx

  import pisa_jax
  from pisa_jax import generation
  from pisa_jax.configs import get_config
  from pisa_jax.models.decoder import Decoder

  config = get_config(case.preset).model
  fields = dict(attention=case.attention)
  if implementation is not None:
    fields["attention_implementation"] = implementation
  config = dataclasses.replace(config, **fields)
  model = Decoder(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  lengths = case.prompt_lengths(new_tokens)
  prompts = [rng.integers(0, config.vocab_size, n, dtype=np.int32) for n in lengths]
  options = dict(max_new_tokens=new_tokens, steps_per_call=steps_per_call,
                 prefill_chunk=case.chunk)
  jax.block_until_ready(jax.tree.leaves(model))

  def one_generation(skip: int):
    """(first tokens, seconds to them, steps after the first `skip` steps, their seconds)."""
    t0 = time.perf_counter()
    stream = pisa_jax.generate_stream(model, prompts, **options)
    first = next(stream)  # the prefill and the first token
    first_s = time.perf_counter() - t0
    for _ in range(skip):
      next(stream, None)
    t0 = time.perf_counter()
    steps = sum(1 for _ in stream)
    return first, first_s, steps, time.perf_counter() - t0

  if case.once:
    first, cold, steps, decode_s = one_generation(skip=steps_per_call)
    warm = None
  else:
    first, cold, _, _ = one_generation(skip=0)  # compiles the prefill and the steps
    _, warm, steps, decode_s = one_generation(skip=0)
  longest = max(lengths)
  width = longest if case.chunk is None else -(-longest // case.chunk) * case.chunk
  capacity = max(generation._bucket(longest + new_tokens - 1), width)
  state = jax.eval_shape(lambda: model.init_decode_state(case.batch, capacity))
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  stats = jax.devices()[0].memory_stats() or {}
  row = dict(first_token_cold_s=round(cold, 3),
             prefill_warm_s=None if warm is None else round(warm, 3),
             prompt_tokens=int(sum(lengths)), longest_prompt=int(longest), new_tokens=new_tokens,
             capacity=capacity, cache_mib_per_row=round(cache_bytes / case.batch / 2**20, 1),
             first_tokens=[int(t) for t in first])
  if steps:
    row.update(tokens_per_s=round(case.batch * steps / decode_s, 1),
               ms_per_token=round(1e3 * decode_s / steps, 3))
  if "peak_bytes_in_use" in stats:
    row["peak_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 2)
  return row


# The parent only names the device and collects rows: it must not take the GPU's memory from the
# workers (jax preallocates 75% of it in the first process that touches it). Its own value, if
# the user set one, goes back to the workers.
_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_USER_PREALLOCATE = os.environ.get(_PREALLOCATE)


def _worker_env(cache_dir: str | None) -> dict:
  env = dict(os.environ)
  env.pop(_PREALLOCATE, None)
  if _USER_PREALLOCATE is not None:
    env[_PREALLOCATE] = _USER_PREALLOCATE
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env["PISA_COMPILATION_CACHE"] = cache_dir or "off"
  return env


def _spawn(case: Case, args, cache_dir: str | None) -> dict:
  """Runs the case in a fresh process; its last stdout line is the row (or an error)."""
  argv = [sys.executable, "-m", "benchmarks.generation", "--worker", case.name,
          "--new-tokens", str(args.new_tokens), "--steps-per-call", str(args.steps_per_call)]
  if args.implementation:
    argv += ["--implementation", args.implementation]
  try:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.case_timeout,
                          env=_worker_env(cache_dir), cwd=Path(__file__).resolve().parents[1])
  except subprocess.TimeoutExpired:
    return dict(error=f"over --case-timeout={args.case_timeout} s")
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(error=f"exit {done.returncode}: {tail[:300]}")
  return json.loads(lines[-1])


def _worker(args) -> None:
  from pisa_jax.train import compilation_cache

  case = Case.parse(args.worker)
  compilation_cache.enable(prog="benchmarks.generation")  # $PISA_COMPILATION_CACHE, set above
  try:
    row = run_case(case, new_tokens=args.new_tokens, steps_per_call=args.steps_per_call,
                   implementation=args.implementation)
  except Exception as e:  # out of memory, a refused shape: the row says so
    row = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
  print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------- the benchmark


def _matching(args, cases: list[Case]) -> list[Case]:
  patterns = args.cases.split(",") if args.cases else ["*"]
  return [c for c in cases if any(fnmatch.fnmatch(c.name, p) for p in patterns)]


def not_run(args) -> list[Case]:
  """The `left_out` cases --cases selects: rows that say why they were not run."""
  return _matching(args, left_out(args.presets, args.lengths, args.batches))


def selected(args) -> list[Case]:
  """The grid's cases --cases selects."""
  cases = _matching(args, grid(args.presets, args.lengths, args.batches, long=args.long))
  if not cases and not not_run(args):
    raise SystemExit(f"--cases {args.cases!r} matches no case (--list shows them)")
  return cases


def measure(args, rec: _record.Recorder) -> None:
  from pisa_jax.train.provenance import environment

  cases, skipped = selected(args), not_run(args)
  env = environment()
  # One device a result: rows of earlier calls on another device (or not saying) are dropped.
  earlier = [r for r in args.earlier_rows
             if r["case"] not in {c.name for c in cases + skipped}]
  kept = [r for r in earlier if r.get("device") == env["device"]]
  for row in kept:
    rec.add(**row)
  if kept:
    rec.note(f"{len(kept)} rows of earlier runs kept (their own date and commit)")
  if len(kept) < len(earlier):
    rec.note(f"{len(earlier) - len(kept)} rows of earlier runs dropped: measured on another "
             f"device than {env['device']}")
  for case in cases:
    base = dict(case=case.name, preset=case.preset, attention=case.attention, batch=case.batch,
                length=case.length, prefill_chunk=case.chunk, date=env["date"],
                commit=env["commit"], device=env["device"])
    if args.in_process:
      try:
        row = run_case(case, new_tokens=args.new_tokens, steps_per_call=args.steps_per_call,
                       implementation=args.implementation)
      except Exception as e:
        row = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    elif args.cached:
      with tempfile.TemporaryDirectory() as cache_dir:
        row = _spawn(case, args, cache_dir)
        again = _spawn(case, args, cache_dir)
      row["first_token_cached_s"] = again.get("first_token_cold_s")
    else:
      row = _spawn(case, args, None)
    rec.add(**base, **row)
    print(table({"rows": [r for r in rec.rows if r["case"] == case.name]}), flush=True)
  for case in skipped:
    rec.add(case=case.name, preset=case.preset, attention=case.attention, batch=case.batch,
            length=case.length, prefill_chunk=None, date=env["date"], commit=env["commit"],
            device=env["device"], error=LEFT_OUT)
  _compare_chunked(rec)


def _earlier_rows(path: Path) -> list[dict]:
  """The rows of a result already at path (read before the new result overwrites it)."""
  if not path.exists():
    return []
  try:
    record = _record.load(path)
  except (ValueError, json.JSONDecodeError):
    return []
  if record["benchmark"] != NAME:
    return []
  return [r for r in record["rows"] if "case" in r]


def _compare_chunked(rec: _record.Recorder) -> None:
  """Notes whether each chunked case's first token equals its one pass's."""
  by_name = {r["case"]: r for r in rec.rows}
  for row in rec.rows:
    if row.get("prefill_chunk") and "first_tokens" in row:
      one = by_name.get(row["case"].rsplit("-chunk", 1)[0], {})
      if "first_tokens" in one:
        same = one["first_tokens"] == row["first_tokens"]
        # Random weights give near-flat logits, where bf16 rounding alone can move the argmax;
        # tests/test_gpu_decode.py compares the chunked prefill's logits in float32.
        rec.note(f"{row['case']}: first token {'equals' if same else 'DIFFERS from'} the one "
                 f"pass's ({row['first_tokens']} vs {one['first_tokens']})"
                 + ("" if same else "; random weights: near-flat logits, likely rounding"))


def table(record: dict) -> str:
  rows = [r for r in record["rows"] if "case" in r]
  body = [[r["preset"], r["attention"], r["batch"], _size(r["length"]),
           _size(r["prefill_chunk"]) if r.get("prefill_chunk") else None,
           r.get("first_token_cold_s"), r.get("first_token_cached_s"), r.get("prefill_warm_s"),
           r.get("tokens_per_s"), r.get("ms_per_token"), r.get("cache_mib_per_row"),
           r.get("peak_gib"), r.get("error")] for r in rows]
  return _record.markdown(["preset", "attention", "B", "L", "chunk", "first token s (cold)",
                           "first token s (compilation cache)", "prefill s (warm)", "tokens/s",
                           "ms/token", "cache MiB/row", "peak GiB", "error"], body)


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  rows = [r for r in record["rows"] if r.get("tokens_per_s") or r.get("prefill_warm_s")]
  presets = list(dict.fromkeys(r["preset"] for r in rows)) or ["-"]
  fig, axes = plt.subplots(2, len(presets), figsize=(5 * len(presets), 7.5), squeeze=False)
  for col, preset in enumerate(presets):
    for attention, style in (("pisa", "o-"), ("dense", "s--")):
      for batch in sorted({r["batch"] for r in rows if r["preset"] == preset}):
        pts = [(r["length"], r) for r in rows if (r["preset"], r["attention"], r["batch"])
               == (preset, attention, batch) and not r.get("prefill_chunk")]
        pts.sort(key=lambda p: p[0])
        speed = [(n, r["tokens_per_s"]) for n, r in pts if r.get("tokens_per_s")]
        if speed:
          axes[0][col].plot(*zip(*speed), style, label=f"{attention} B={batch}")
        ttft = [(n, r["prefill_warm_s"]) for n, r in pts if r.get("prefill_warm_s")]
        if ttft:
          axes[1][col].plot(*zip(*ttft), style, label=f"{attention} B={batch}")
      chunked = [(r["length"], r["prefill_warm_s"]) for r in rows
                 if (r["preset"], r["attention"]) == (preset, attention)
                 and r.get("prefill_chunk") and r["batch"] == 1 and r.get("prefill_warm_s")]
      if chunked:
        axes[1][col].plot(*zip(*chunked), "*", markersize=10, label=f"{attention} chunked")
    for row, ylabel in ((0, "generated tokens/s"), (1, "time to first token, warm (s)")):
      ax = axes[row][col]
      ax.set_xscale("log", base=2)
      ax.set_yscale("log")
      ax.set_xlabel("cache tokens L (longest prompt + new tokens)")
      ax.set_ylabel(ylabel)
      ax.set_title(f"`{preset}`, random weights", fontsize=9)
      ax.legend(fontsize=6)
  fig.suptitle(f"generation, {record['device']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(presets=list(args.presets), lengths=list(args.lengths), batches=list(args.batches),
              long=args.long, new_tokens=args.new_tokens, steps_per_call=args.steps_per_call,
              implementation=args.implementation, cases=args.cases, cached=args.cached,
              prompts="random tokens, row b of L - new_tokens - b L / 2B tokens",
              weights="random (nnx.Rngs(0)), the preset's dtypes", sampling="greedy, no stop")


def main(argv=None) -> dict | None:
  p = _record.parser(__doc__)
  p.add_argument("--cases", default=None,
                 help="comma-separated fnmatch patterns of case names (default: every case)")
  p.add_argument("--list", action="store_true",
                 help="print the selected cases, their estimated seconds and a command a call")
  p.add_argument("--call-seconds", type=float, default=CALL_SECONDS,
                 help="--list packs the cases into calls of at most this many seconds")
  p.add_argument("--presets", type=lambda s: tuple(s.split(",")), default=PRESETS)
  p.add_argument("--lengths", type=_record.parse_ints, default=LENGTHS,
                 help="cache tokens L of the longest row")
  p.add_argument("--batches", type=_record.parse_ints, default=BATCHES)
  p.add_argument("--no-long", dest="long", action="store_false",
                 help="leave out the B = 1 cases at 512K and 1M")
  p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
  p.add_argument("--steps-per-call", type=int, default=16)
  p.add_argument("--implementation", default=None, choices=("pallas", "xla"),
                 help="the models' attention_implementation (default: the preset's)")
  p.add_argument("--cached", action="store_true",
                 help="also time a second fresh process that reads the compilation cache")
  p.add_argument("--case-timeout", type=int, default=560,
                 help="seconds a case's process may run")
  p.add_argument("--in-process", action="store_true",
                 help="run the cases in this process (no cold start: a smoke run)")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    _worker(args)
    return None
  if args.list:
    cases = selected(args)
    for case in cases:
      print(f"{case.name:36s} ~{estimate_s(case, args.new_tokens, args.cached):6.0f} s")
    for case in not_run(args):
      print(f"{case.name:36s} {LEFT_OUT}")
    for calls in plan(cases, args.call_seconds, args.new_tokens, args.cached):
      total = sum(estimate_s(c, args.new_tokens, args.cached) for c in calls)
      print(f"# ~{total:.0f} s\npython -m benchmarks.generation --cases "
            f"'{','.join(c.name for c in calls)}'")
    return None
  if not args.in_process:
    os.environ[_PREALLOCATE] = "false"  # before this process first touches the device
  args.earlier_rows = [] if args.replot else _earlier_rows(args.out / f"{NAME}.json")
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
