"""How fast is one decode step at long context? PISA's cached pyramid against dense decoding.

One step appends a token per row and attends over its whole past: N cached tokens (the cache
filled by prefill with random keys and values), B rows, bf16. Sides:
  pisa-jax     `pisa_jax.decode_step` (cache update O(log N), the selection's walk and leaf
               scores, attention over top_k blocks), selector pisa with the default beam
  dense        the same step with a plain KV cache: write the token's key and value at position N,
               then `jax.nn.dot_product_attention` of the one query over the N + 1 keys
               (`key_value_seq_lengths`), cuDNN where it takes the shape, XLA otherwise (the row
               says which)
With --summary-dtype float32,bfloat16 (the default) PISA runs once per pyramid dtype: side
"pisa-jax" its float32 pyramid, "pisa-jax bf16" the bfloat16 one (`DecodeCache.create(...,
summary_dtype=jnp.bfloat16)`: half the pyramid's bytes, one bf16 dot per walk level); the dense
row's x_ours / loop_x_ours compare with the first dtype, x_ours_<dtype> / loop_x_ours_<dtype>
with each other.
Both threads the cache through the jitted step with donation, as a generation loop does, so
neither side pays a copy of the cache per step. Rows: median ms per step (a batch of back-to-back
steps ended by one synchronisation, as benchmarks/timing.py; the length grows by one per step,
well inside the cache), tokens/s (B / step time) and x_ours (dense over ours). `loop_ms` is the
same step run LOOP times inside one jitted `fori_loop`, per step: the device's time without the
host's dispatch of every step (what a compiled generation loop pays), and `loop_ms_append`,
`_select`, `_append_select`, `_attention` each stage of the PISA step alone through its own op,
timed the same way (the step itself runs the append in the walk's launch, the leaf scores, then
Select_K inside the attention's launch, so its stages overlap these). With
--select-warps W1,W2,.. (Pallas only) the selection stage is also timed at each launch width,
`loop_ms_select_w<W>` (the prefill kernels' measured settings need not be the decode
kernels' best: at small B there are few programs). Memory: cache_mb, every array a step threads
(keys, values and, for PISA, the pyramid), and step_temp_mb, the compiled step's scratch beyond
its arguments and outputs (XLA's memory analysis): the goal is a scratch independent of N.
kernels_per_step, device_ms and kernel_us (microseconds a step of each kernel name), from a
profile of 16 threaded steps: the GPU kernels a step launches and their device time (the in-loop time is about their sum; each dependent launch
costs a few microseconds however little it does).

Goals: at N = 1M, dense / ours >= 10 at B = 1 and >= 60 at B = 16 (in the jitted loop); our step at 1M within 1.5x
of our step at 32K (O(log N) work plus the K C keys attended).

The second part times generation end to end (`pisa_jax.generate`, greedy) with the `small`
preset's decoder, its attention pisa against dense, randomly initialised: prefill of a prompt
of each --gen-prompt length (32K and 128K tokens), then --gen-tokens new tokens, twice, with
--gen-steps-per-call tokens a jitted call (generate's `steps_per_call`: a loop on the device):
first_token_s is the first call's time to its first token (compilation included), prefill_s the
second call's; tokens/s and ms_per_step count the second call's new tokens after the first;
device_ms_per_step and launches_per_step, from a profile of 4 more calls, are the GPU kernels'
share of a step (the rest is the host's: dispatch and kernel launches).

  python -m benchmarks.decode                              # the default cases, benchmarks/results/
  python -m benchmarks.decode --lengths 32768,131072 --batches 1 --no-generation --out /tmp/d
  python -m benchmarks.decode --lengths 1048576 --batches 1,16 --heads 32:2:128:32 \
      --summary-dtype float32,bfloat16 --no-generation --out /tmp/d     # bf16 pyramid at 1M
  python -m benchmarks.decode --lengths 512 --batches 2 --heads 4:2:16:4 --gen-preset tiny \\
      --gen-prompt 256 --gen-tokens 8 --implementation xla --out /tmp/d     # any CPU
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pisa_jax
from benchmarks import _record, timing

NAME = "decode"
C = 64
LOOP = 32  # steps per jitted loop for loop_ms
# The stages of a step, each through its own op: append_select (the append in the walk's launch)
# and attention; append and select alone show the split.
STAGES = ("append", "select", "append_select", "attention")
LENGTHS = (32768, 131072, 524288, 1048576)
BATCHES = (1, 16)
# (HQ, HKV, D, K): the anchors' two settings.
HEADS = ((32, 2, 128, 32), (32, 2, 64, 8))
GEN_PROMPTS = (32768, 131072)
SUMMARY_DTYPES = ("float32", "bfloat16")


def side_name(summary_dtype: str) -> str:
  """The side of PISA rows with this pyramid dtype ("pisa-jax": float32, as before the option)."""
  return "pisa-jax" if summary_dtype == "float32" else "pisa-jax bf16"


def parse_dtypes(text: str) -> tuple[str, ...]:
  values = tuple(x.strip() for x in text.split(","))
  bad = [x for x in values if x not in SUMMARY_DTYPES]
  if bad or not values:
    raise SystemExit(f"--summary-dtype {text!r} must be a comma-separated list of "
                     f"{SUMMARY_DTYPES}")
  return values


def parse_heads(text: str) -> tuple[int, int, int, int]:
  try:
    hq, hkv, d, k = (int(x) for x in text.split(":"))
  except ValueError:
    raise SystemExit(f"--heads {text!r} must be HQ:HKV:D:K, e.g. 32:2:128:32") from None
  if hq % hkv:
    raise SystemExit(f"--heads {text!r}: HQ must be a multiple of HKV")
  return hq, hkv, d, k


def case_name(n, b, hq, hkv, d, k) -> str:
  size = f"{n // 1024}K" if n % 1024 == 0 else str(n)
  return f"{size} B{b} d{d} K{k}"


def time_threaded(step, state, reps: int = 7, batch_s: float = 0.2) -> float:
  """Median ms per call of `state = step(state)`: the state (a donated cache) is threaded
  through the calls, so each call consumes the previous call's output."""
  state = jax.block_until_ready(step(state))
  t0 = time.perf_counter()
  state = jax.block_until_ready(step(state))
  calls = max(1, min(50, int(batch_s / max(time.perf_counter() - t0, 1e-6))))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(calls):
      state = step(state)
    jax.block_until_ready(state)
    samples.append((time.perf_counter() - t0) / calls)
  return round(statistics.median(samples) * 1e3, 4)


def time_in_loop(step, state) -> float:
  """Median ms per step of `state = step(state)` run LOOP times in one jitted `fori_loop`."""
  run = jax.jit(lambda s: jax.lax.fori_loop(0, LOOP, lambda i, s: step(s), s), donate_argnums=0)
  return round(time_threaded(run, state, reps=5, batch_s=0.1) / LOOP, 4)


def step_inputs(b, hq, hkv, d, seed=1):
  keys = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16),
          jax.random.normal(keys[1], (b, 1, hkv, d), jnp.bfloat16),
          jax.random.normal(keys[2], (b, 1, hkv, d), jnp.bfloat16))


def filled(n, b, hkv, d, seed=0):
  """Random bf16 keys and values `[B, N, HKV, D]` (generated on the device, one row at a time to
  bound the float32 temporaries)."""
  def one(key):
    return jax.random.normal(key, (1, n, hkv, d), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(seed), 2 * b)
  k = jnp.concatenate([one(keys[i]) for i in range(b)])
  v = jnp.concatenate([one(keys[b + i]) for i in range(b)])
  return k, v


def time_pisa(n, b, hq, hkv, d, top_k, implementation, steps_room: int,
              summary_dtype: str = "float32"):
  """(ms, loop_ms) of `pisa_jax.decode_step` over a cache of N random tokens per row, its
  pyramid in summary_dtype."""
  def fresh_cache():
    cache = pisa_jax.DecodeCache.create(b, n + steps_room, hkv, d, block_size=C,
                                        summary_dtype=summary_dtype)
    return cache.prefill(*filled(n, b, hkv, d))

  q, k1, v1 = step_inputs(b, hq, hkv, d)
  one = functools.partial(pisa_jax.decode_step, top_k=top_k, implementation=implementation)
  cache = fresh_cache()
  # Compiled once: its memory analysis and the timed calls share the executable.
  step = jax.jit(one, donate_argnames="cache").lower(q, k1, v1, cache).compile()
  memory = dict(cache_mb=mib(sum(x.nbytes for x in jax.tree.leaves(cache))),
                step_temp_mb=temp_mib(step))
  ms = time_threaded(lambda s: step(q, k1, v1, s[1]), (None, cache))
  loop_ms = time_in_loop(lambda s: one(q, k1, v1, s[1]), (jnp.zeros_like(q), fresh_cache()))
  memory.update(step_kernels(lambda s: step(q, k1, v1, s[1]), (None, fresh_cache())))
  return ms, loop_ms, memory


def step_kernels(step, state, calls: int = 16) -> dict:
  """The GPU kernels of one `state = step(state)`, from a profile of `calls` threaded calls:
  kernels_per_step and their device_ms (the in-loop time, where launches queue back to back, is
  about their sum). Empty on a CPU backend."""
  state = [jax.block_until_ready(step(state))]

  def run():
    for _ in range(calls):
      state[0] = step(state[0])
    jax.block_until_ready(state[0])

  events = timing.gpu_kernel_events(run)
  if not events:
    return {}
  kernels, ms = timing.per_call(events, calls)
  per_kernel = timing.kernel_totals(events, calls)
  return dict(kernels_per_step=round(kernels, 1), device_ms=round(ms, 4),
              kernel_us={name: round(v * 1e3, 2) for name, v in per_kernel.items()})


def mib(nbytes) -> float:
  return round(nbytes / 2**20, 3)


def temp_mib(compiled) -> float | None:
  """The compiled step's scratch memory beyond its arguments and outputs (XLA's memory analysis),
  MiB: what a step costs on top of the cache it threads."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else mib(analysis.temp_size_in_bytes)


def time_stages(n, b, hq, hkv, d, top_k, implementation, select_warps=(),
                summary_dtype: str = "float32") -> dict:
  """ms per step of each stage of the pisa step alone, LOOP times in one jitted loop: append
  and append_select (the cache threaded), select and attention (at positions N and N + 1
  alternately, so that the loop body depends on the iteration and cannot be hoisted);
  "select_w<W>" the selection kernel launched on W warps, for each W of select_warps (the
  default config otherwise)."""
  from pisa_jax import _dispatch
  from pisa_jax.kernels.decode import DecodeConfig

  def fresh_cache():
    return pisa_jax.DecodeCache.create(b, n + 2, hkv, d, block_size=C,
                                       summary_dtype=summary_dtype).prefill(*filled(n, b, hkv, d))

  cache = fresh_cache()
  q, k1, v1 = step_inputs(b, hq, hkv, d)
  scale = d ** -0.5
  append = _dispatch.lookup("decode_append", implementation)
  append_select = _dispatch.lookup("decode_append_select", implementation)
  select = _dispatch.lookup("decode_select", implementation)
  attend = _dispatch.lookup("decode_attention", implementation)
  geometry = dict(block_size=C)
  pyramid = dict(summary_dtype=summary_dtype)
  positions = cache.lengths
  idx = select(q[:, 0], cache.k, cache.summaries, positions - 1, branching=cache.branching,
               top_k=top_k, beam=top_k, selector="pisa", scale=scale, **geometry, **pyramid)

  def one_append(s, i, arrays):
    del i, arrays
    return append(k1[:, 0], v1[:, 0], s[0], s[1], s[2], positions, branching=cache.branching,
                  **geometry)

  def one_append_select(s, i, arrays):
    del i, arrays  # the indices are threaded too, so that the selection is not dropped
    return append_select(q[:, 0], k1[:, 0], v1[:, 0], s[0], s[1], s[2], positions,
                         branching=cache.branching, top_k=top_k, beam=top_k, selector="pisa",
                         scale=scale, **geometry, **pyramid)

  def one_select(s, i, arrays, **config):
    del s
    return select(q[:, 0], arrays[0], arrays[1], positions - 1 - (i & 1),
                  branching=cache.branching, top_k=top_k, beam=top_k, selector="pisa",
                  scale=scale, **geometry, **pyramid, **config)

  def one_attention(s, i, arrays):
    del s
    return attend(q[:, 0], arrays[0], arrays[1], idx, positions - 1 - (i & 1), scale=scale,
                  **geometry)

  # The cache is an argument of the jitted loop, never closed over (a constant) nor returned (a
  # copy); append and append_select, timed last, thread and donate it.
  out = {}
  # The kernels' own default, the warps changed per variant.
  default = DecodeConfig.default(head_dim=d)
  widths = [(f"select_w{w}",
             functools.partial(one_select, config=dataclasses.replace(default, select_warps=w,
                                                                    walk_warps=w)),
             idx, (cache.k, cache.summaries)) for w in select_warps]
  for name, body, state, arrays in [
      ("select", one_select, idx, (cache.k, cache.summaries)), *widths,
      ("attention", one_attention, q[:, 0], (cache.k, cache.v)),
      ("append", one_append, (cache.k, cache.v, cache.summaries), ())]:
    run = jax.jit(lambda s, a, body=body: jax.lax.fori_loop(0, LOOP,
                                                            lambda i, s: body(s, i, a), s),
                  donate_argnums=0 if name == "append" else ())
    out[name] = round(time_threaded(lambda s, run=run, a=arrays: run(s, a), state, reps=5,
                                    batch_s=0.1) / LOOP, 4)
  cache = fresh_cache()  # append's loop consumed the first
  run = jax.jit(lambda s: jax.lax.fori_loop(0, LOOP, lambda i, s: one_append_select(s, i, ()), s),
                donate_argnums=0)
  out["append_select"] = round(time_threaded(run, (cache.k, cache.v, cache.summaries, idx),
                                             reps=5, batch_s=0.1) / LOOP, 4)
  return out


def dense_step(q, k1, v1, kv, length, *, implementation):
  """Writes the token at `length` and attends over keys 0..length (the plain KV-cache step)."""
  k_cache, v_cache = kv
  k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k1, length, axis=1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v1, length, axis=1)
  lengths = jnp.full((q.shape[0],), length + 1, jnp.int32)
  out = jax.nn.dot_product_attention(q, k_cache, v_cache, key_value_seq_lengths=lengths,
                                     implementation=implementation)
  return out, (k_cache, v_cache), length + 1


def time_dense(n, b, hq, hkv, d, steps_room: int):
  """((ms, loop_ms, memory), implementation, errors): cuDNN when it takes a one-query step,
  else XLA's attention (errors says why not cuDNN)."""
  q, k1, v1 = step_inputs(b, hq, hkv, d)
  errors = []
  for implementation in ("cudnn", "xla"):
    k, v = filled(n + steps_room, b, hkv, d)
    try:
      step = jax.jit(functools.partial(dense_step, implementation=implementation),
                     donate_argnums=(3,)).lower(q, k1, v1, (k, v), jnp.int32(n)).compile()

      def call(state, step=step):
        return step(q, k1, v1, state[1], state[2])

      memory = dict(cache_mb=mib(k.nbytes + v.nbytes), step_temp_mb=temp_mib(step))
      ms = time_threaded(call, (None, (k, v), jnp.int32(n)))
      k, v = filled(n + steps_room, b, hkv, d)
      plain = functools.partial(dense_step, implementation=implementation)
      loop_ms = time_in_loop(lambda s: plain(q, k1, v1, s[1], s[2]),
                             (jnp.zeros_like(q), (k, v), jnp.int32(n)))
      k, v = filled(n + steps_room, b, hkv, d)
      memory.update(step_kernels(call, (None, (k, v), jnp.int32(n))))
      return (ms, loop_ms, memory), implementation, errors
    except Exception as e:  # cuDNN refuses some one-query shapes: XLA then runs the step
      errors.append(f"{implementation}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
      del k, v
  return None, None, errors


def generation_times(model, prompt, new_tokens: int, steps_per_call: int):
  """(seconds to the first token, tokens after it, seconds for them) of one generation."""
  t0 = time.perf_counter()
  stream = pisa_jax.generate_stream(model, prompt, max_new_tokens=new_tokens,
                                    steps_per_call=steps_per_call)
  next(stream)  # the prefill and the first token
  first = time.perf_counter() - t0
  t0 = time.perf_counter()
  count = sum(1 for _ in stream)
  return first, count, time.perf_counter() - t0


def generation_device_time(model, prompt, steps_per_call: int, calls: int = 4) -> dict:
  """Per generated token, from a profile of `calls` warm calls of steps_per_call steps each:
  the GPU kernels' total ms and their count. Empty on a CPU backend."""
  stream = pisa_jax.generate_stream(model, prompt,
                                    max_new_tokens=1 + (calls + 1) * steps_per_call,
                                    steps_per_call=steps_per_call)
  next(stream)  # the first token; the first call is dispatched
  # One kernel queued behind the first call on the same stream: once it is done, so is the
  # call, and the profile holds exactly the next `calls` calls.
  (jnp.arange(2) + 1).block_until_ready()
  steps = calls * steps_per_call
  events = timing.gpu_kernel_events(lambda: sum(1 for _ in stream))
  if not events:
    return {}
  launches, ms = timing.per_call(events, steps)
  return dict(device_ms_per_step=round(ms, 3), launches_per_step=round(launches, 1))


def generation_rows(args, rec: _record.Recorder) -> None:
  from flax import nnx

  from pisa_jax.configs import get_config
  from pisa_jax.models.decoder import Decoder
  for prompt_len, attention in itertools.product(args.gen_prompt, ("pisa", "dense")):
    config = dataclasses.replace(get_config(args.gen_preset).model, attention=attention,
                                 attention_implementation=args.implementation)
    model = Decoder(config, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size,
                                               (args.gen_batch, prompt_len), dtype=np.int32)
    base = dict(part="generation", preset=args.gen_preset, attention=attention,
                batch=args.gen_batch, prompt=prompt_len, new_tokens=args.gen_tokens,
                steps_per_call=args.gen_steps_per_call)
    try:
      # The first call compiles the prefill and the step; the second reuses both.
      (first, _, _), (prefill, count, rest) = (
          generation_times(model, prompt, args.gen_tokens, args.gen_steps_per_call)
          for _ in range(2))
      device = generation_device_time(model, prompt, args.gen_steps_per_call)
    except Exception as e:
      rec.add(**base, error=f"{type(e).__name__}: {str(e)[:300]}")
      continue
    rec.add(**base, first_token_s=round(first, 3), prefill_s=round(prefill, 3),
            tokens_per_s=round(args.gen_batch * count / rest, 1) if count else None,
            ms_per_step=round(1e3 * rest / max(count, 1), 3), **device)
    print(table(rec.record), flush=True)


def measure(args, rec: _record.Recorder) -> None:
  if jax.default_backend() != "gpu":
    rec.note(f"backend {jax.default_backend()}: a smoke run, not a measurement")
  # Room for every timed step: LOOP steps per call, at most 50 calls per batch, 7 batches.
  room = 16384
  for hq, hkv, d, top_k in args.heads if args.steps else ():
    for b in args.batches:
      ours_by_n = {dtype: {} for dtype in args.summary_dtype}
      for n in args.lengths:
        name = case_name(n, b, hq, hkv, d, top_k)
        base = dict(part="step", case=name, n=n, batch=b, hq=hq, hkv=hkv, d=d, top_k=top_k)
        for dtype in args.summary_dtype:
          side = dict(side=side_name(dtype), summary_dtype=dtype)
          try:
            ms, loop_ms, memory = time_pisa(n, b, hq, hkv, d, top_k, args.implementation, room,
                                            dtype)
            ours_by_n[dtype][n] = ms, loop_ms
            first = ours_by_n[dtype][min(ours_by_n[dtype])]
            stages = time_stages(n, b, hq, hkv, d, top_k, args.implementation,
                                 args.select_warps, dtype)
            rec.add(**base, **side, ms=ms, loop_ms=loop_ms, **memory,
                    **{f"loop_ms_{k}": v for k, v in stages.items()},
                    tokens_per_s=round(b / ms * 1e3, 1), x_ours=1.0,
                    x_own_shortest=round(ms / first[0], 3),
                    loop_x_own_shortest=round(loop_ms / first[1], 3))
          except Exception as e:
            rec.add(**base, **side, error=f"{type(e).__name__}: {str(e)[:300]}")
        ms, impl, errors = time_dense(n, b, hq, hkv, d, room)
        row = dict(base, side="dense", implementation=impl)
        if errors:
          row["fallback_reasons"] = errors
        if ms is None:
          rec.add(**row, error="; ".join(errors))
        else:
          (ms, loop_ms, memory) = ms
          ratios = {}
          for i, dtype in enumerate(args.summary_dtype):
            ours = ours_by_n[dtype].get(n)
            suffix = "" if i == 0 else f"_{dtype}"
            ratios[f"x_ours{suffix}"] = round(ms / ours[0], 3) if ours else None
            ratios[f"loop_x_ours{suffix}"] = round(loop_ms / ours[1], 3) if ours else None
          rec.add(**row, ms=ms, loop_ms=loop_ms, **memory, tokens_per_s=round(b / ms * 1e3, 1),
                  **ratios)
        print(table(rec.record), flush=True)
  if args.generation:
    generation_rows(args, rec)


def table(record: dict) -> str:
  steps = [r for r in record["rows"] if r.get("part") == "step"]
  by = {(r["case"], r["side"]): r for r in steps}
  lines = []
  cases = list(dict.fromkeys(r["case"] for r in steps))
  bf16 = [r for r in steps if r.get("side") == side_name("bfloat16")]
  if bf16:
    body = []
    for case in dict.fromkeys(r["case"] for r in bf16):
      ours, f32, dense = (by.get((case, side), {}) for side in
                          (side_name("bfloat16"), side_name("float32"), "dense"))
      body.append([case, f32.get("loop_ms"), ours.get("loop_ms"), dense.get("loop_ms"),
                   dense.get("loop_x_ours"), dense.get("loop_x_ours_bfloat16"),
                   f32.get("loop_ms_select"), ours.get("loop_ms_select"), f32.get("cache_mb"),
                   ours.get("cache_mb")])
    lines.append(_record.markdown(
        ["case", "in-loop ms, f32 pyramid", "in-loop ms, bf16 pyramid", "in-loop dense ms",
         "dense / f32", "dense / bf16", "in-loop select ms, f32", "in-loop select ms, bf16",
         "cache MiB, f32", "cache MiB, bf16"], body))
  if cases:
    body = []
    for case in cases:
      ours, dense = by.get((case, "pisa-jax"), {}), by.get((case, "dense"), {})
      body.append([case, ours.get("ms"), dense.get("ms"), dense.get("implementation"),
                   dense.get("x_ours"), ours.get("x_own_shortest"), ours.get("loop_ms"),
                   dense.get("loop_ms"), dense.get("loop_x_ours"),
                   ours.get("loop_x_own_shortest")] + [ours.get(f"loop_ms_{k}") for k in STAGES]
                  + [ours.get("kernels_per_step"), ours.get("device_ms"),
                     dense.get("kernels_per_step"), dense.get("device_ms")]
                  + [ours.get("cache_mb"), ours.get("step_temp_mb"), dense.get("step_temp_mb")]
                  + [", ".join(f"{k.removeprefix('loop_ms_select_')} {v}" for k, v in ours.items()
                               if k.startswith("loop_ms_select_w"))
                     or None])
    lines.append(_record.markdown(
        ["case", "pisa-jax ms", "dense ms", "dense via", "dense / ours",
         "ours / ours at shortest N", "in-loop ours ms", "in-loop dense ms",
         "in-loop dense / ours", "in-loop ours / at shortest N"]
        + [f"in-loop {k} ms" for k in STAGES]
        + ["ours kernels/step", "ours device ms", "dense kernels/step", "dense device ms"]
        + ["ours cache MiB", "ours step scratch MiB", "dense step scratch MiB"]
        + ["in-loop select ms by warps (w)"], body))
  gen = [r for r in record["rows"] if r.get("part") == "generation"]
  if gen:
    body = [[r["preset"], r["attention"], r["batch"], r["prompt"], r.get("steps_per_call", 1),
             r.get("first_token_s"), r.get("prefill_s"), r.get("tokens_per_s"),
             r.get("ms_per_step"), r.get("device_ms_per_step"), r.get("launches_per_step"),
             r.get("error")] for r in gen]
    lines.append(_record.markdown(["preset", "attention", "B", "prompt", "steps a call",
                                   "first token s (cold)", "prefill s (warm)", "tokens/s",
                                   "ms/step",
                                   "device kernels ms/step", "launches/step", "error"], body))
  return "\n\n".join(lines)


def plot(record: dict, path) -> None:
  plt = _record.pyplot()
  steps = [r for r in record["rows"] if r.get("part") == "step" and r.get("ms")]
  groups = list(dict.fromkeys((r["batch"], r["d"], r["top_k"]) for r in steps))
  fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(4.5 * max(1, len(groups)), 4.2),
                           squeeze=False)
  for ax, (b, d, k) in zip(axes[0], groups):
    for side, key, style in (("pisa-jax", "ms", "o-"), ("dense", "ms", "s--"),
                             ("pisa-jax", "loop_ms", "o:"), ("dense", "loop_ms", "s:"),
                             ("pisa-jax bf16", "loop_ms", "^:")):
      pts = sorted((r["n"], r[key]) for r in steps if r.get(key)
                   and (r["batch"], r["d"], r["top_k"], r["side"]) == (b, d, k, side))
      if pts:
        ax.plot(*zip(*pts), style, label=side + (", in one jitted loop" if key == "loop_ms"
                                                 else ""))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("cached tokens N")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title(f"B={b} d{d} K{k}", fontsize=9)
    ax.legend(fontsize=7)
  fig.suptitle(f"one decode step, bf16, {record['device']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def settings(args) -> dict:
  return dict(block_size=C, dtype="bfloat16", selector="pisa", lengths=list(args.lengths),
              batches=list(args.batches),
              heads=[dict(zip(("hq", "hkv", "d", "top_k"), h)) for h in args.heads],
              implementation=args.implementation, generation=args.generation,
              gen_preset=args.gen_preset, gen_batch=args.gen_batch,
              gen_prompt=list(args.gen_prompt),
              gen_tokens=args.gen_tokens, gen_steps_per_call=args.gen_steps_per_call,
              select_warps=list(args.select_warps), summary_dtype=list(args.summary_dtype),
              timing="median of 7 batches of back-to-back steps, the cache threaded and donated",
              loop_steps=LOOP)


def main(argv=None) -> dict:
  p = _record.parser(__doc__)
  p.add_argument("--lengths", type=_record.parse_ints, default=LENGTHS, help="cached tokens N")
  p.add_argument("--batches", type=_record.parse_ints, default=BATCHES, help="rows B")
  p.add_argument("--heads", type=parse_heads, action="append",
                 help="HQ:HKV:D:K, repeatable (default: 32:2:128:32 and 32:2:64:8)")
  p.add_argument("--implementation", default="pallas", choices=("pallas", "xla"))
  p.add_argument("--select-warps", type=_record.parse_ints, default=(),
                 help="also time the selection kernel on each of these warp counts (pallas)")
  p.add_argument("--summary-dtype", type=parse_dtypes, default=SUMMARY_DTYPES,
                 help="the PISA pyramid's dtypes, comma-separated (default float32,bfloat16)")
  p.add_argument("--no-generation", dest="generation", action="store_false",
                 help="leave out the end-to-end generation part")
  p.add_argument("--gen-preset", default="small")
  p.add_argument("--gen-batch", type=int, default=1)
  p.add_argument("--no-steps", dest="steps", action="store_false",
                 help="leave out the one-step part (generation only)")
  p.add_argument("--gen-prompt", type=_record.parse_ints, default=GEN_PROMPTS,
                 help="prompt lengths, comma-separated")
  p.add_argument("--gen-tokens", type=int, default=256)
  p.add_argument("--gen-steps-per-call", type=int, default=16,
                 help="generate's steps_per_call (tokens a jitted call generates)")
  args = p.parse_args(argv)
  args.heads = args.heads or list(HEADS)
  if args.select_warps and args.implementation != "pallas":
    raise SystemExit("--select-warps times the Pallas selection kernels: it needs "
                     "--implementation pallas")
  return _record.run(NAME, args, measure, settings, plot, table)


if __name__ == "__main__":
  main()
