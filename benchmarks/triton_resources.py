"""Registers, spills, shared memory and occupancy of every Pallas kernel, without a GPU.

Lowers a selection or attention call for the GPU on any machine (the compute capability the
lowering asks for is supplied, sm_90), keeps each kernel's Triton IR, compiles it with the
`triton` package (3.6.0, the H200 image's version; install it beside jax: `pip install
triton==3.6.0`) for sm_90a, and runs the bundled ptxas on the PTX. Occupancy is the number of
programs an H200 SM can hold by registers, shared memory and the 32-block / 64-warp limits.

  python benchmarks/triton_resources.py                 # the default configs
  python benchmarks/triton_resources.py --case sel.K8.d64 --set walk_warps=2 --set q_tile=16

This is how to see, before spending device time, why a latency-bound kernel (the walk) runs with
few programs per SM, or whether a new tile spills.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import subprocess
import tempfile
import types
import warnings

import jax
import jax.numpy as jnp

warnings.filterwarnings("ignore")

from jax._src.pallas.triton import pallas_call_registration as _registration  # noqa: E402

from pisa_jax.kernels import attention as attn  # noqa: E402
from pisa_jax.kernels import selection as sel  # noqa: E402

SM_REGISTERS, SM_SHARED, SM_BLOCKS, SM_WARPS = 65536, 227 * 1024, 32, 64


def _capture_kernels():
  """Patches the Pallas Triton lowering: a fixed sm_90 device, and each kernel's IR recorded."""
  captured = []
  _registration.gpu_info_lib = types.SimpleNamespace(
      get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
  lower = _registration.lowering.lower_jaxpr_to_triton_module

  def recording(*args, **kwargs):
    result = lower(*args, **kwargs)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  _registration.lowering.lower_jaxpr_to_triton_module = recording
  return captured


def _launch_of(name: str, cfg) -> tuple[int, int]:
  """(num_warps, num_stages) the dispatch gives kernel `name` under `cfg`."""
  if isinstance(cfg, sel.SelectionConfig):
    if "walk_dense" in name:
      warps = cfg.walk_dense_warps
    elif "walk" in name or "fused" in name:
      warps = cfg.walk_warps
    elif "topk" in name:
      warps = cfg.topk_warps
    elif "leaf" in name or "bsa" in name:
      warps = cfg.leaf_warps
    else:
      warps = 4  # the pyramid kernels
    return warps, cfg.num_stages
  if "reduce" in name:
    return cfg.reduce_num_warps, 2
  for kind in ("dkv", "dq", "fwd"):
    if kind in name:
      return getattr(cfg, f"{kind}_num_warps"), getattr(cfg, f"{kind}_num_stages")
  return 4, 2


def _resources(ttir: str, warps: int, stages: int, sass_path: str | None = None) -> dict:
  import triton
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    ptx = os.path.join(tmp, "kernel.ptx")
    with open(ptx, "w") as f:
      f.write(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                          capture_output=True, text=True, check=True).stderr
    if sass_path:
      # The SASS, to count instructions by opcode (ncu's counters need device time; this not).
      cubin = os.path.join(tmp, "kernel.cubin")
      with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
      cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
      with open(sass_path, "w") as f:
        f.write(subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True,
                               check=True).stdout)
  regs = int(re.search(r"Used (\d+) registers", info).group(1))
  spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info))
  shared = int(kernel.metadata.shared)
  # Registers are allocated per warp in units of 256.
  per_warp = -(-regs * 32 // 256) * 256
  by_regs = SM_REGISTERS // (per_warp * warps)
  by_shared = SM_SHARED // shared if shared else SM_BLOCKS
  programs = min(by_regs, by_shared, SM_BLOCKS, SM_WARPS // warps)
  return dict(warps=warps, registers=regs, spill_bytes=spill, shared_bytes=shared,
              programs_per_sm=programs, warps_per_sm=programs * warps)


def _selection_case(n, top_k, d, beam=None, **changes):
  beam = beam or top_k
  nc = sel.candidate_slots(beam, 2)
  cfg = dataclasses.replace(sel.SelectionConfig.default(seq_len=n, group=16, candidates=nc),
                            **changes)
  fn = functools.partial(sel.select_blocks_pallas, block_size=64, top_k=top_k, branching=2,
                         selector="pisa", scale=d ** -0.5, beam=beam, interpret=False, config=cfg)
  spec = (jax.ShapeDtypeStruct((1, n, 32, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, n, 2, d), jnp.bfloat16))
  return jax.jit(fn), spec, cfg


def _attention_case(n, top_k, d, hkv=2, **changes):
  """32 query heads on `hkv` KV heads: group 16 at the default 2, group 32 at 1."""
  cfg = dataclasses.replace(
      attn.SparseAttentionConfig.default(head_dim=d, group=32 // hkv, top_k=top_k, block_size=64),
      **changes)

  def loss(q, k, v, idx):
    out = attn.sparse_attention_pallas(q, k, v, idx, block_size=64, scale=d ** -0.5,
                                       interpret=False, config=cfg)
    return jnp.sum(out.astype(jnp.float32))

  spec = (jax.ShapeDtypeStruct((1, n, 32, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, n, hkv, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, n, hkv, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, n, hkv, top_k), jnp.int32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), spec, cfg


CASES = {
    "sel.K8.d64": lambda **ch: _selection_case(131072, 8, 64, **ch),
    "sel.K8.d64.beam16": lambda **ch: _selection_case(131072, 8, 64, beam=16, **ch),
    "sel.K32.d128": lambda **ch: _selection_case(65536, 32, 128, **ch),
    "attn.K8.d64": lambda **ch: _attention_case(16384, 8, 64, **ch),
    "attn.K32.d128": lambda **ch: _attention_case(16384, 32, 128, **ch),
    "attn.K32.d128.g32": lambda **ch: _attention_case(16384, 32, 128, hkv=1, **ch),
    "attn.K8.d64.g32": lambda **ch: _attention_case(16384, 8, 64, hkv=1, **ch),
}


def _parse_sets(items):
  out = {}
  for item in items:
    key, value = item.split("=", 1)
    if value.lower() in ("true", "false"):
      out[key] = value.lower() == "true"
    else:
      out[key] = int(value) if value.lstrip("-").isdigit() else value
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--case", action="append", choices=sorted(CASES),
                  help="default: every case")
  ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                  help="config field changes for the cases (SelectionConfig or SparseAttentionConfig)")
  ap.add_argument("--sass", metavar="DIR", help="also write each kernel's SASS to DIR/CASE.NAME.sass")
  args = ap.parse_args()
  if args.sass:
    os.makedirs(args.sass, exist_ok=True)
  captured = _capture_kernels()
  for case in args.case or list(CASES):
    fn, spec, cfg = CASES[case](**_parse_sets(args.set))
    captured.clear()
    fn.trace(*spec).lower(lowering_platforms=("cuda",))
    print(f"== {case}: {cfg}")
    for ttir in captured:
      # The generic form (`sym_name = "..."`) is what MLIR prints for a module that fails to verify.
      name = re.search(r'module @([A-Za-z0-9_]+)|sym_name = "([A-Za-z0-9_]+)"', ttir)
      name = name.group(1) or name.group(2)
      try:
        sass = os.path.join(args.sass, f"{case}.{name}.sass") if args.sass else None
        r = _resources(ttir, *_launch_of(name, cfg), sass_path=sass)
        print(f"  {name:<36} warps {r['warps']}  regs {r['registers']:>3}  spill "
              f"{r['spill_bytes']:>4} B  shared {r['shared_bytes']:>6} B  programs/SM "
              f"{r['programs_per_sm']:>2} ({r['warps_per_sm']} warps)", flush=True)
      except Exception as e:  # a kernel Triton cannot compile is the finding, not a crash
        print(f"  {name:<36} FAILED: {e!r}"[:600], flush=True)


if __name__ == "__main__":
  main()
