"""The decoder's attention under a sequence-sharded mesh (`train.context_parallel` > 1).

Everything else in a block is token-wise and runs where its tokens are (`constrain_batch` pins
the activations `[B, T, ...]` to batch over (data, fsdp) and sequence over "seq"). Attention is
not: each query needs the keys before it. Here it runs in a `shard_map` over the batch axes and
"seq": each device keeps its queries, all-gathers the keys and values of its sequence over
"seq", and attends with its queries' global positions (`pisa_jax.context_parallel`). The
backward pass of the gather is a reduce-scatter that JAX derives: no communication code here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from pisa_jax.context_parallel import dense_attention_at, pisa_attention_at, sequence_sharded
from pisa_jax.models.config import ModelConfig
from pisa_jax.models.sharding import LOGICAL_AXIS_RULES, axes_size, batch_axes_of, seq_axis_of


def sequence_axis() -> str | None:
  """The ambient mesh's sequence axis, or None when the sequence is not split."""
  return seq_axis_of(jax.sharding.get_abstract_mesh())


def sequence_sharded_attention(cfg: ModelConfig, q, k, v, segment_ids=None):
  """`cfg.attention` of q `[B, T, HQ, D]` over k, v `[B, T, HKV, D]` with the sequence split
  over the ambient mesh's "seq" axis (which must exist: see `sequence_axis`)."""
  mesh = jax.sharding.get_abstract_mesh()
  seq = seq_axis_of(mesh)
  batch_axes_of(mesh)  # raises for a mesh without the batch axes, or with Explicit ones
  # Every Auto batch axis is named, those of length 1 too: an axis left out of the specs is one
  # the backward pass all-reduces over (size-1 groups, but collectives all the same).
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  batch = tuple(n for n in LOGICAL_AXIS_RULES["batch"] if types[n] == AxisType.Auto) or None
  if segment_ids is not None:
    raise ValueError("packed documents (segment_ids, data.packing=true) are not supported with "
                     "the sequence split over devices: set train.context_parallel=1")
  if q.shape[1] % mesh.shape[seq]:
    raise ValueError(f"sequence length {q.shape[1]} must be divisible by the "
                     f"{mesh.shape[seq]} devices of mesh axis {seq!r} (train.context_parallel)")
  if q.shape[0] % axes_size(mesh, batch):
    raise ValueError(f"batch size {q.shape[0]} must be divisible by the "
                     f"{axes_size(mesh, batch)} devices of mesh axes {batch}")
  if cfg.attention == "dense":
    cudnn = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)
    attend_at = functools.partial(dense_attention_at, implementation="cudnn" if cudnn else "xla")
  else:
    attend_at = functools.partial(
        pisa_attention_at, block_size=cfg.block_size, top_k=cfg.top_k, branching=cfg.branching,
        selector=cfg.attention, beam=cfg.beam, summary_dtype=cfg.summary_dtype,
        implementation=cfg.attention_implementation)
  spec = P(batch, seq)
  # check_vma=False as in `per_batch_shard`: the attention's outputs carry no varying-manual-axes
  # annotation.
  sharded = jax.shard_map(sequence_sharded(attend_at, seq), mesh=mesh, in_specs=(spec,) * 3,
                          out_specs=spec, check_vma=False)
  return sharded(q, k, v)
