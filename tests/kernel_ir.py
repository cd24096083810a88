"""Every Pallas kernel of the library lowered to Triton IR for sm_90 on the CPU, hashed.

A kernel's speed is fixed by what Triton compiles: its Triton IR and its launch (warps, stages,
grid, operand and result types). This module lowers every kernel at a set of representative
configurations, with Pallas' Triton lowering told a compute capability of 90 (the H200's), and
records one sha256 per (configuration, kernel) over the IR text (no source locations) and the
launch. Two trees with the same manifest compile to the same GPU programs: a refactor that keeps
every hash has not changed any kernel's speed. A second hash per configuration covers the whole
lowered program around the kernels (the XLA glue: sorts, reshapes, tables), the Triton payloads
and source locations left out.

    python tests/kernel_ir.py --check              # against tests/data/kernel_ir_sm90.json
    python tests/kernel_ir.py --write              # record the manifest of this tree
    python tests/kernel_ir.py --check --dump DIR   # also write each kernel's IR text to DIR
    python tests/kernel_ir.py --only decode        # configurations whose name contains it

The manifest holds the jax and jaxlib versions it was made with: IR is compared within one
version only (another jaxlib lowers differently). `tests/test_kernel_ir.py` checks a subset in
CI and the whole manifest as a slow test; `tests/conftest.py`'s `captured` fixture uses
`sm90_lowering` too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import pathlib
import re
import sys
import types
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import jaxlib
from jax._src.pallas.triton import pallas_call_registration as registration

MANIFEST = pathlib.Path(__file__).parent / "data" / "kernel_ir_sm90.json"
_TRITON_TARGET = "__gpu$xla.gpu.triton"


@dataclasses.dataclass
class Kernel:
  """One lowered kernel: its name, Triton IR text (no locations) and launch."""

  name: str
  ir: str
  launch: dict = dataclasses.field(default_factory=dict)

  def digest(self) -> str:
    launch = json.dumps(self.launch, sort_keys=True)
    return hashlib.sha256((self.ir + "\n" + launch).encode()).hexdigest()


@contextlib.contextmanager
def sm90_lowering(texts: list[str] | None = None) -> Iterator[list[Kernel]]:
  """While active, Pallas' Triton lowering runs on any machine as for sm_90, and every kernel it
  lowers is appended to the yielded list (with its launch parameters once they are known), its
  IR text to `texts` too when given."""
  kernels: list[Kernel] = []
  info = registration.gpu_info_lib
  lower = registration.lowering.lower_jaxpr_to_triton_module
  custom_call = registration.mlir.custom_call

  def recording_lower(*args, **kwargs):
    result = lower(*args, **kwargs)
    asm = result.module.operation.get_asm(enable_debug_info=False)
    kernels.append(Kernel(re.search(r"module @([A-Za-z0-9_]+)", asm).group(1), asm))
    if texts is not None:
      texts.append(asm)
    return result

  def recording_call(call_target_name, *args, **kwargs):
    if call_target_name == _TRITON_TARGET and kernels:
      config = kwargs.get("backend_config", {})
      kernels[-1].launch = {
          "launch": {key: str(config[key]) for key in
                     ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z") if key in config},
          "operands": [str(x.type) for x in kwargs.get("operands", ())],
          "results": [str(x) for x in kwargs.get("result_types", ())],
          "aliases": sorted(dict(kwargs.get("operand_output_aliases") or {}).items()),
      }
    return custom_call(call_target_name, *args, **kwargs)

  registration.gpu_info_lib = types.SimpleNamespace(
      get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
  registration.lowering.lower_jaxpr_to_triton_module = recording_lower
  registration.mlir.custom_call = recording_call
  try:
    yield kernels
  finally:
    registration.gpu_info_lib = info
    registration.lowering.lower_jaxpr_to_triton_module = lower
    registration.mlir.custom_call = custom_call


def lower_for_sm90(fn: Callable, *shapes) -> tuple[list[Kernel], str]:
  """The kernels `jax.jit(fn)` lowers for sm_90 at `shapes` (ShapeDtypeStructs), and the lowered
  program's StableHLO without locations and with each Triton payload replaced by its kernel's
  name. Under jax's default matmul precision (the tests raise it to "highest", which changes
  every 16-bit dot's lowering)."""
  with sm90_lowering() as kernels, jax.default_matmul_precision(None):
    text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  return kernels, re.sub(r'ir = "[^"]*"', "ir = <triton>", text)


# ----------------------------------------------------------------------------- configurations

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
SEQ = 4096  # 64 leaves of 64 keys: 7 levels, every code path of the walk
DECODE_CAPACITY = 1 << 20


def _s(shape, dtype=BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _selection(selector="pisa", *, d=64, top_k=8, beam=None, hq=32, hkv=2, dtype=BF16,
               config=None, offset=False, t=SEQ, branching=2, block_size=64,
               summary_dtype="float32"):
  from pisa_jax.kernels import selection as sel

  kw = dict(block_size=block_size, top_k=top_k, branching=branching, selector=selector, scale=d ** -0.5,
            beam=beam or top_k, interpret=False, config=config, summary_dtype=summary_dtype)
  q, k = _s((1, t, hq, d), dtype), _s((1, t, hkv, d), dtype)
  if offset:
    return (lambda q, k, off: sel.select_blocks_pallas(q, k, query_offset=off, **kw),
            _s((1, t // 4, hq, d), dtype), k, _s((), jnp.int32))
  return functools.partial(sel.select_blocks_pallas, **kw), q, k


def _selection_config(**changes):
  from pisa_jax.kernels.selection import SelectionConfig

  return dataclasses.replace(SelectionConfig.default(seq_len=SEQ, group=16), **changes)


def _packed_selection(selector="pisa", *, d=64, top_k=8, beam=None, hq=32, hkv=2, dtype=BF16,
                      branching=2, block_size=64):
  from pisa_jax import selection

  fn = functools.partial(selection.select_blocks_packed_pallas, block_size=block_size,
                         top_k=top_k,
                         branching=branching, selector=selector, scale=d ** -0.5,
                         beam=beam or top_k,
                         interpret=False)
  return fn, _s((1, SEQ, hq, d), dtype), _s((1, SEQ, hkv, d), dtype), _s((1, SEQ), jnp.int32)


def _pyramid(*, d=64, branching=2, packed=False, summary_dtype="float32"):
  from pisa_jax.kernels import packed_pyramid, pyramid

  k = _s((1, SEQ, 2, d))
  if packed:
    return (functools.partial(packed_pyramid.build_packed_pyramid_pallas, block_size=64,
                              branching=branching, interpret=False),
            k, _s((1, SEQ), jnp.int32))
  return functools.partial(pyramid.build_pyramid_pallas, block_size=64, branching=branching,
                           interpret=False, summary_dtype=summary_dtype), k


def _attention(*, d=64, top_k=8, hq=32, hkv=2, dtype=BF16, packed=False, offset=False):
  """Forward and backward (dq, the dk / dv kernels) under the custom_vjp."""
  from pisa_jax.kernels import attention as attn

  kw = dict(block_size=64, scale=d ** -0.5, interpret=False)
  t, tq = SEQ, SEQ // 4 if offset else SEQ
  q, kv, idx = _s((1, tq, hq, d), dtype), _s((1, t, hkv, d), dtype), _s((1, tq, hkv, top_k),
                                                                        jnp.int32)
  if packed:
    attend, extra = functools.partial(attn.sparse_attention_packed_pallas, **kw), (
        _s((1, t), jnp.int32),)
  elif offset:
    attend, extra = functools.partial(attn.sparse_attention_pallas_at, **kw), (
        _s((), jnp.int32),)
  else:
    attend, extra = functools.partial(attn.sparse_attention_pallas, **kw), ()

  def loss(q, k, v, idx, *rest):
    return jnp.sum(attend(q, k, v, idx, *rest).astype(F32))

  return jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, idx, *extra


def _nsa_range(branch, *, d=64, hq=32, hkv=2, packed=False, dtype=BF16):
  """NSA's compressed attention (l = 32, d = 16) or window (w = 512) on the range kernels:
  forward, dq and dk / dv under the custom_vjp."""
  from pisa_jax import nsa

  if branch == "compressed":
    n = nsa.num_compressed_slots(SEQ, 32, 16, packed)
    kv = _s((1, n, hkv, d), dtype)
    attend = functools.partial(nsa.compressed_attention_pallas, block_length=32, stride=16,
                               scale=d ** -0.5, interpret=False)
  else:
    kv = _s((1, SEQ, hkv, d), dtype)
    attend = functools.partial(nsa.sliding_window_attention_pallas, window=512, scale=d ** -0.5,
                               interpret=False, backend="pallas")

  def loss(q, k, v, *segment_ids):
    out = attend(q, k, v, segment_ids[0] if segment_ids else None)
    return jnp.sum((out[0] if branch == "compressed" else out).astype(F32))

  extra = (_s((1, SEQ), jnp.int32),) if packed else ()
  return jax.grad(loss, argnums=(0, 1, 2)), _s((1, SEQ, hq, d), dtype), kv, kv, *extra


def _nsa_select(*, d=64, hq=32, hkv=2, block_length=64, stride=64, dtype=BF16, packed=False):
  """NSA's selection kernel (l' = 64, n = 16) given the compressed keys and the lse (packed:
  and the segment ids, the packed launch)."""
  from pisa_jax import nsa

  n = nsa.num_compressed_slots(SEQ, block_length, stride, packed)
  kw = dict(block_length=block_length, stride=stride, select_block_size=64, top_n=16,
            scale=d ** -0.5, interpret=False)
  shapes = (_s((1, SEQ, hq, d), dtype), _s((1, n, hkv, d), dtype), _s((1, SEQ, hq), F32))
  if packed:
    select = functools.partial(nsa.nsa_select_blocks_pallas, **kw)
    return select, *shapes, _s((1, SEQ), jnp.int32)
  return functools.partial(nsa.nsa_select_blocks_pallas, segment_ids=None, **kw), *shapes


def _hils(*, d=128, top_k=32, hq=32, hkv=2, dtype=BF16, packed=False):
  """HiLS: the selection kernel and the attention's forward, dq and dk / dv (under the
  custom_vjp), at chunk 64 and window 512."""
  from pisa_jax import hils

  kw = dict(chunk_size=64, top_k=top_k, window=512, scale=d ** -0.5, interpret=False)
  q, kv = _s((1, SEQ, hq, d), dtype), _s((1, SEQ, hkv, d), dtype)
  extra = (_s((1, SEQ), jnp.int32),) if packed else ()

  def loss(q, k, v, lq, *ids):
    return jnp.sum(hils.hils_attention_pallas(q, k, v, lq, *ids, **kw).astype(F32))

  return jax.grad(loss, argnums=(0, 1, 2, 3)), q, kv, kv, q, *extra


def _decode_shapes(*, batch, d, hq, hkv=2, dtype=BF16, branching=2, summary_dtype="float32"):
  from pisa_jax.decode_cache import DecodeCache

  cache = jax.eval_shape(lambda: DecodeCache.create(batch, DECODE_CAPACITY, hkv, d, dtype=dtype,
                                                    branching=branching,
                                                    summary_dtype=summary_dtype))
  return (_s((batch, hq, d), dtype), _s((batch, hkv, d), dtype), cache,
          _s((batch,), jnp.int32))


def _decode(what, selector="pisa", *, batch=16, d=128, top_k=32, beam=None, hq=32, dtype=BF16,
            branching=2, summary_dtype="float32"):
  from pisa_jax.kernels import decode

  q, kv_new, cache, positions = _decode_shapes(batch=batch, d=d, hq=hq, dtype=dtype,
                                               branching=branching, summary_dtype=summary_dtype)
  walk = dict(block_size=64, branching=branching, top_k=top_k, beam=beam or top_k,
              selector=selector, scale=d ** -0.5, interpret=False, summary_dtype=summary_dtype)
  caches = (cache.k, cache.v, cache.summaries)
  if what == "step":
    return (functools.partial(decode.decode_step_pallas, **walk), q, kv_new, kv_new, *caches,
            positions)
  if what == "append_select":
    return (functools.partial(decode.decode_append_select_pallas, **walk), q, kv_new, kv_new,
            *caches, positions)
  if what == "select":
    return (functools.partial(decode.decode_select_pallas, **walk), q, cache.k, cache.summaries,
            positions)
  if what == "append":
    return (functools.partial(decode.decode_append_pallas, block_size=64, branching=branching,
                              interpret=False), kv_new, kv_new, *caches, positions)
  if what == "attention":
    return (functools.partial(decode.decode_attention_pallas, block_size=64, scale=d ** -0.5,
                              interpret=False),
            q, cache.k, cache.v, _s((batch, 2, top_k), jnp.int32), positions)
  raise ValueError(f"{what=} is not a decode entry point")


def _as_on_gpu(fn):
  """`fn` traced as on a GPU: the public API's `implementation="pallas"` compiles the kernels
  instead of interpreting them (the backend is read at trace time)."""
  from pisa_jax import _dispatch

  def traced(*args):
    on_gpu = _dispatch.on_gpu
    _dispatch.on_gpu = lambda: True
    try:
      return fn(*args)
    finally:
      _dispatch.on_gpu = on_gpu

  return traced


def _api_selection(t, *, d=64, top_k=8, packed=False):
  """`pisa_jax.select_blocks` at `t` tokens, 32/2 heads, bfloat16 (Table 4's setting at d64 K8),
  whole documents or packed ones: the validation, pyramid and kernels a user's call runs."""
  import pisa_jax

  q, k = _s((1, t, 32, d)), _s((1, t, 2, d))
  if packed:
    return (_as_on_gpu(lambda q, k, seg: pisa_jax.select_blocks(
        q, k, block_size=64, top_k=top_k, segment_ids=seg, implementation="pallas")),
            q, k, _s((1, t), jnp.int32))
  return (_as_on_gpu(lambda q, k: pisa_jax.select_blocks(
      q, k, block_size=64, top_k=top_k, implementation="pallas")), q, k)


def _api_attention(t, *, d=128, top_k=32):
  """`pisa_jax.sparse_attention` forward + backward at `t` tokens, 32/2 heads, bfloat16."""
  import pisa_jax

  def loss(q, k, v, idx):
    out = pisa_jax.sparse_attention(q, k, v, idx, block_size=64, implementation="pallas")
    return jnp.sum(out.astype(F32))

  kv = _s((1, t, 2, d))
  return (_as_on_gpu(jax.grad(loss, argnums=(0, 1, 2))), _s((1, t, 32, d)), kv, kv,
          _s((1, t, 2, top_k), jnp.int32))


def _api_decode(batch, *, d=128, top_k=32, summary_dtype="float32"):
  """`pisa_jax.decode_step` at 1M cached tokens, 32/2 heads, bfloat16 (the cache donated)."""
  import pisa_jax

  q, kv, cache, _ = _decode_shapes(batch=batch, d=d, hq=32, summary_dtype=summary_dtype)
  step = lambda q, k, v, cache: pisa_jax.decode_step(q, k, v, cache, top_k=top_k,
                                                      implementation="pallas")
  return (_as_on_gpu(step), _s((batch, 1, 32, d)), _s((batch, 1, 2, d)), _s((batch, 1, 2, d)),
          cache)


# name -> a function returning (fn, *shapes). "ci" marks the subset CI checks (one or two of each
# kernel family, the defaults at both settings).
CASES: dict[str, Callable[[], tuple]] = {
    # Selection: the SelectionConfig defaults at d64 K8 (fused) and d128 K32 (two-stage), GQA 16.
    "selection/d64k8/pisa": lambda: _selection(),
    "selection/d64k8/pisa1": lambda: _selection("pisa1"),
    "selection/d64k8/pisa2": lambda: _selection("pisa2"),
    "selection/d64k8/bsa": lambda: _selection("bsa"),
    "selection/d128k32/pisa": lambda: _selection(d=128, top_k=32),
    "selection/d128k32/pisa2": lambda: _selection("pisa2", d=128, top_k=32),
    "selection/d128k32/bsa": lambda: _selection("bsa", d=128, top_k=32),
    "selection/d128k32/beam64": lambda: _selection(d=128, top_k=32, beam=64),
    # The non-default variants of SelectionConfig.
    "selection/d64k8/two_stage": lambda: _selection(config=_selection_config(variant="two_stage")),
    "selection/d64k8/two_stage_passes": lambda: _selection(config=_selection_config(
        variant="two_stage", topk_impl="passes", walk_pair_lse=False)),
    "selection/d64k8/fused_no_pair_lse": lambda: _selection(config=_selection_config(
        walk_pair_lse=False)),
    "selection/d64k8/fused_passes_shifted": lambda: _selection(config=_selection_config(
        topk_impl="passes", fused_unshifted_lse=False)),
    # Other dtypes, head dims and groups.
    "selection/d64k8/f32": lambda: _selection(dtype=F32),
    "selection/d128k32/f16": lambda: _selection(d=128, top_k=32, dtype=F16),
    "selection/d48k8/g3": lambda: _selection(d=48, hq=6),
    # Branching 3 (not a power of two) and 4: the walks' table reads and other expansions.
    "selection/d64k8/branching3": lambda: _selection(branching=3),
    "selection/d64k8/branching4_two_stage": lambda: _selection(
        branching=4, config=_selection_config(variant="two_stage")),
    # A block size that is not a power of two (padded key tiles with masks).
    "selection/d64k8/c48": lambda: _selection(block_size=48),
    "selection/d64k8/c48_two_stage": lambda: _selection(
        block_size=48, config=_selection_config(variant="two_stage")),
    # A sequence shard (query offset input).
    "selection/d64k8/offset": lambda: _selection(offset=True),
    "selection/d128k32/offset": lambda: _selection(d=128, top_k=32, offset=True),
    "selection/d64k8/bsa_offset": lambda: _selection("bsa", offset=True),
    # A bfloat16 pyramid: one bfloat16 dot per summary (fused, two-stage, BSA; float32 and
    # float16 queries against it in float32 dots).
    "selection/d64k8/bf16_summaries": lambda: _selection(summary_dtype="bfloat16"),
    "selection/d128k32/bf16_summaries": lambda: _selection(d=128, top_k=32,
                                                           summary_dtype="bfloat16"),
    "selection/d64k8/bsa/bf16_summaries": lambda: _selection("bsa", summary_dtype="bfloat16"),
    "selection/d64k8/f32/bf16_summaries": lambda: _selection(dtype=F32, summary_dtype="bfloat16"),
    "selection/d128k32/f16/bf16_summaries": lambda: _selection(d=128, top_k=32, dtype=F16,
                                                               summary_dtype="bfloat16"),
    # Packed documents.
    "packed_selection/d64k8/pisa": lambda: _packed_selection(),
    "packed_selection/d64k8/pisa2": lambda: _packed_selection("pisa2"),
    "packed_selection/d128k32/pisa": lambda: _packed_selection(d=128, top_k=32),
    "packed_selection/d64k8/bsa": lambda: _packed_selection("bsa"),
    "packed_selection/d128k32/bsa": lambda: _packed_selection("bsa", d=128, top_k=32),
    "packed_selection/d64k4/branching3": lambda: _packed_selection(top_k=4, beam=5, branching=3),
    "packed_selection/d64k8/c48": lambda: _packed_selection(block_size=48),
    "packed_selection/d64k32/c48": lambda: _packed_selection(top_k=32, block_size=48),
    # The pyramid alone (the selection cases lower it too).
    "pyramid/d64/g2": lambda: _pyramid(),
    "pyramid/d128/g4": lambda: _pyramid(d=128, branching=4),
    "pyramid/d64/g2/packed": lambda: _pyramid(packed=True),
    "pyramid/d128/g4/packed": lambda: _pyramid(d=128, branching=4, packed=True),
    "pyramid/d64/g2/bf16_summaries": lambda: _pyramid(summary_dtype="bfloat16"),
    "pyramid/d128/g4/bf16_summaries": lambda: _pyramid(d=128, branching=4,
                                                       summary_dtype="bfloat16"),
    # Attention: forward, dq, dk / dv.
    "attention/d64k8": lambda: _attention(),
    "attention/d128k32": lambda: _attention(d=128, top_k=32),
    "attention/d128k8/g3": lambda: _attention(d=128, hq=6),
    "attention/d64k8/f32": lambda: _attention(dtype=F32),
    "attention/d64k8/packed": lambda: _attention(packed=True),
    "attention/d128k32/packed": lambda: _attention(d=128, top_k=32, packed=True),
    "attention/d64k8/offset": lambda: _attention(offset=True),
    "attention/d128k32/offset": lambda: _attention(d=128, top_k=32, offset=True),
    # NSA's range kernels: the compressed attention and the window, forward and backward.
    "nsa/compressed/d64g16": lambda: _nsa_range("compressed"),
    "nsa/compressed/d128g4/packed": lambda: _nsa_range("compressed", d=128, hkv=8, packed=True),
    "nsa/compressed/d64g3/f32": lambda: _nsa_range("compressed", hq=6, dtype=F32),
    "nsa/window/d64g8/packed": lambda: _nsa_range("window", hkv=4, packed=True),
    # NSA's selection: fla's l = d = l' = 64 (no Eq. 9 dot), the paper's l = 32, d = 16 (the
    # count-matrix dot, halo 1), float32 with group 3 at d128.
    "nsa/select/d64g16": lambda: _nsa_select(),
    "nsa/select/d64g16/l32d16": lambda: _nsa_select(block_length=32, stride=16),
    "nsa/select/d128g3/f32": lambda: _nsa_select(d=128, hq=6, dtype=F32),
    # ... and its packed launch (a query tile's documents one at a time).
    "nsa/select/d64g16/packed": lambda: _nsa_select(packed=True),
    "nsa/select/d64g16/l32d16/packed": lambda: _nsa_select(block_length=32, stride=16,
                                                           packed=True),
    "nsa/select/d128g3/f32/packed": lambda: _nsa_select(d=128, hq=6, dtype=F32, packed=True),
    # HiLS: its selection, attention forward and backward.
    "hils/d128k32": lambda: _hils(),
    "hils/d64k32/g3": lambda: _hils(d=64, hq=6),
    "hils/d64k32/f32": lambda: _hils(d=64, dtype=F32),
    "hils/d128k32/packed": lambda: _hils(packed=True),
    # Decode at 1M cached tokens: the whole step and each entry point.
    "decode/d128k32/b16/step": lambda: _decode("step"),
    "decode/d128k32/b1/step": lambda: _decode("step", batch=1),
    "decode/d64k8/b16/step": lambda: _decode("step", d=64, top_k=8),
    "decode/d48k8/beam64/f16/step": lambda: _decode("step", "pisa2", d=48, top_k=8, beam=64,
                                                    hq=6, dtype=F16),
    "decode/d64k8/f32/pisa1/step": lambda: _decode("step", "pisa1", d=64, top_k=8, hq=4,
                                                   dtype=F32),
    "decode/d128k32/bsa/step": lambda: _decode("step", "bsa"),
    "decode/d64k8/branching3/step": lambda: _decode("step", d=64, top_k=8, branching=3),
    "decode/d64k8/branching4/append": lambda: _decode("append", d=64, top_k=8, branching=4),
    "decode/d128k32/select": lambda: _decode("select"),
    "decode/d128k32/append_select": lambda: _decode("append_select"),
    "decode/d128k32/append": lambda: _decode("append"),
    "decode/d128k32/attention": lambda: _decode("attention"),
    # A bfloat16 pyramid: the append rounds each mean once, the walk gathers bfloat16 summaries
    # and scores them in one bfloat16 dot (float16 / float32 queries: float32 dots).
    "decode/d128k32/b16/step/bf16_summaries": lambda: _decode("step", summary_dtype="bfloat16"),
    "decode/d128k32/b1/step/bf16_summaries": lambda: _decode("step", batch=1,
                                                             summary_dtype="bfloat16"),
    "decode/d64k8/b16/step/bf16_summaries": lambda: _decode("step", d=64, top_k=8,
                                                            summary_dtype="bfloat16"),
    "decode/d128k32/bsa/step/bf16_summaries": lambda: _decode("step", "bsa",
                                                              summary_dtype="bfloat16"),
    "decode/d48k8/beam64/f16/step/bf16_summaries": lambda: _decode(
        "step", "pisa2", d=48, top_k=8, beam=64, hq=6, dtype=F16, summary_dtype="bfloat16"),
    "decode/d64k8/f32/pisa1/step/bf16_summaries": lambda: _decode(
        "step", "pisa1", d=64, top_k=8, hq=4, dtype=F32, summary_dtype="bfloat16"),
    "decode/d64k8/branching3/step/bf16_summaries": lambda: _decode(
        "step", d=64, top_k=8, branching=3, summary_dtype="bfloat16"),
    "decode/d128k32/select/bf16_summaries": lambda: _decode("select", summary_dtype="bfloat16"),
    # What a user's call runs, through the public API, at the sizes the speed figures quote.
    "api/select/128k/d64k8": lambda: _api_selection(1 << 17),
    "api/select/256k/d64k8": lambda: _api_selection(1 << 18),
    "api/select/128k/d128k32": lambda: _api_selection(1 << 17, d=128, top_k=32),
    "api/select_packed/128k/d64k8": lambda: _api_selection(1 << 17, packed=True),
    "api/select_packed/128k/d128k32": lambda: _api_selection(1 << 17, d=128, top_k=32,
                                                             packed=True),
    "api/attention_fwd_bwd/64k/d128k32": lambda: _api_attention(1 << 16),
    "api/decode_step/1m/b1": lambda: _api_decode(1),
    "api/decode_step/1m/b16": lambda: _api_decode(16),
    "api/decode_step/1m/b1/bf16_summaries": lambda: _api_decode(1, summary_dtype="bfloat16"),
    "api/decode_step/1m/b16/bf16_summaries": lambda: _api_decode(16, summary_dtype="bfloat16"),
}

CI_CASES = ("selection/d64k8/pisa", "selection/d128k32/pisa", "selection/d64k8/bsa",
            "packed_selection/d64k8/pisa", "packed_selection/d128k32/pisa",
            "attention/d128k32", "attention/d64k8/packed", "attention/d64k8/offset",
            "decode/d128k32/b16/step", "decode/d128k32/bsa/step", "nsa/compressed/d64g16",
            "nsa/select/d64g16", "nsa/select/d64g16/packed",
            "decode/d128k32/b16/step/bf16_summaries", "selection/d128k32/bf16_summaries",
            "hils/d128k32")


def lower_case(name: str) -> tuple[list[Kernel], str]:
  fn, *shapes = CASES[name]()
  return lower_for_sm90(fn, *shapes)


def manifest(names=None, dump: pathlib.Path | None = None) -> dict:
  """{"jax", "jaxlib", "kernels": {"case/kernel": sha256}, "programs": {case: sha256}} for the
  configurations `names` (default all). A kernel launched twice by one configuration gets
  "#1", "#2"... after its name. dump: also write each kernel's IR and launch there."""
  kernels, programs = {}, {}
  for name in names or CASES:
    lowered, program = lower_case(name)
    programs[name] = hashlib.sha256(program.encode()).hexdigest()
    seen: dict[str, int] = {}
    for kernel in lowered:
      n = seen[kernel.name] = seen.get(kernel.name, 0) + 1
      key = f"{name}/{kernel.name}" + (f"#{n}" if n > 1 else "")
      kernels[key] = kernel.digest()
      if dump is not None:
        path = dump / (key.replace("/", "__") + ".mlir")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(kernel.ir + "\n// launch: " + json.dumps(kernel.launch, sort_keys=True))
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "kernels": kernels,
          "programs": programs}


def compare(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
  """(kernel differences, program differences) of `current` against the same configurations
  of `recorded`: changed, missing or new keys, one line each."""
  def diff(section):
    old = recorded[section]
    new = current[section]
    cases = set(current["programs"])
    old = {k: v for k, v in old.items() if k in cases or k.rsplit("/", 1)[0] in cases}
    lines = [f"changed: {k}" for k in sorted(old.keys() & new.keys()) if old[k] != new[k]]
    lines += [f"missing: {k}" for k in sorted(old.keys() - new.keys())]
    lines += [f"new: {k}" for k in sorted(new.keys() - old.keys())]
    return lines

  return diff("kernels"), diff("programs")


def same_versions(recorded: dict) -> bool:
  return (recorded.get("jax"), recorded.get("jaxlib")) == (jax.__version__, jaxlib.__version__)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--write", action="store_true", help="record the manifest of this tree")
  parser.add_argument("--check", action="store_true", help="compare with the manifest (default)")
  parser.add_argument("--manifest", type=pathlib.Path, default=MANIFEST)
  parser.add_argument("--only", default="", help="configurations whose name contains this")
  parser.add_argument("--dump", type=pathlib.Path, help="write each kernel's IR text here")
  args = parser.parse_args(argv)
  names = [n for n in CASES if args.only in n]
  if not names:
    parser.error(f"--only={args.only!r} matches no configuration: {list(CASES)}")
  current = manifest(names, args.dump)
  if args.write:
    if args.only and args.manifest.exists():
      old = json.loads(args.manifest.read_text())
      current["kernels"] = {k: v for k, v in old["kernels"].items()
                            if k.rsplit("/", 1)[0] not in names} | current["kernels"]
      current["programs"] = {k: v for k, v in old["programs"].items()
                             if k not in names} | current["programs"]
    args.manifest.parent.mkdir(parents=True, exist_ok=True)
    args.manifest.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    print(f"{len(current['kernels'])} kernels of {len(current['programs'])} configurations "
          f"written to {args.manifest}")
    return 0
  recorded = json.loads(args.manifest.read_text())
  if not same_versions(recorded):
    print(f"the manifest is of jax {recorded.get('jax')} / jaxlib {recorded.get('jaxlib')}; "
          f"this is {jax.__version__} / {jaxlib.__version__}: IR compares within one version")
    return 2
  kernel_diff, program_diff = compare(recorded, current)
  print(f"{len(current['kernels'])} kernels of {len(names)} configurations: "
        f"{len(kernel_diff)} kernel and {len(program_diff)} program differences")
  for line in kernel_diff:
    print("  kernel " + line)
  for line in program_diff:
    print("  program " + line)
  return 1 if kernel_diff else 0


if __name__ == "__main__":
  sys.exit(main())
