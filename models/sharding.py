"""Logical axis names on parameters and activations, mapped to mesh axes in ONE table.

Every parameter of the decoder carries `logical_axes` metadata (e.g. `("embed", "mlp")`). The mesh
has two axes: "data" (pure data parallelism) and "fsdp" (data parallelism whose members also shard
the parameters and optimizer state, ZeRO-3 style). The batch is split over both; parameters are
split over "fsdp" along their model dimension. Context parallelism (`train.context_parallel` > 1)
adds a third axis, "seq", that splits the sequence of every activation; parameters are whole
along it, and attention gathers the keys and values over it (`pisa_jax.models.context_parallel`).
In a multi-process run the mesh spans every process's devices, seq and fsdp innermost so that
their collectives stay inside a process, and so a host (`mesh_devices`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp")
# The context-parallel axis, innermost: its members exchange keys and values every layer, so they
# are neighbouring devices.
SEQ_AXIS = "seq"

LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": SEQ_AXIS,
    "embed": "fsdp",
    "vocab": None,
    "mlp": None,
    "q_heads": None,
    "kv_heads": None,
    "head_dim": None,
    "norm": None,
}


def logical_to_spec(logical_axes: tuple[str | None, ...]) -> P:
  """`("embed", "mlp")` -> `P("fsdp", None)` through `LOGICAL_AXIS_RULES`."""
  spec = []
  for name in logical_axes:
    if name is not None and name not in LOGICAL_AXIS_RULES:
      raise ValueError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES")
    spec.append(None if name is None else LOGICAL_AXIS_RULES[name])
  return P(*spec)


def axes_size(mesh, entry) -> int:
  """How many ways mesh axis `entry` (a name, a tuple of names, or None) splits a dimension."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  size = 1
  for n in names:
    size *= mesh.shape[n]
  return size


def param_shardings(abstract_state: nnx.State, mesh: Mesh) -> Any:
  """NamedShardings for a (pure-dict) parameter tree, from each Param's `logical_axes`.

  Raises ValueError naming the parameter when a sharded dimension does not divide evenly.
  """
  flat = {}
  for path, var in nnx.to_flat_state(abstract_state):
    axes = var.get_metadata().get("logical_axes")
    name = "/".join(str(p) for p in path)
    if axes is None or len(axes) != len(var.get_value().shape):
      raise ValueError(f"parameter {name} {var.get_value().shape} lacks matching logical_axes={axes}")
    spec = logical_to_spec(axes)
    for dim, entry in zip(var.get_value().shape, spec):
      if dim % axes_size(mesh, entry):
        raise ValueError(
            f"parameter {name} dimension {dim} ({axes}) is not divisible by mesh axis {entry} of "
            f"size {axes_size(mesh, entry)}: change the model width or train.fsdp"
        )
    flat[path] = NamedSharding(mesh, spec)
  return _nest(flat)


def _nest(flat: dict[tuple, Any]) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def batch_axes_of(mesh) -> str | tuple[str, ...] | None:
  """The mesh axes the batch is split over under `mesh` (a Mesh or AbstractMesh), or None when
  there is nothing to split (no mesh, or one device).

  Inside a `shard_map` the Manual axes are already split per device: only the batch axes that
  are still Auto are returned, and None when they split nothing.

  Raises ValueError when a multi-device mesh lacks an axis of the "batch" rule (the decoder's
  activations and the per-device attention are laid out over those axes by name, and a mesh with
  other names, a user's own `("dp", "tp")`, must be mapped through LOGICAL_AXIS_RULES first), or
  when a batch axis is Explicit (jax.make_mesh's default in jax 0.11: the trainer's meshes are
  Auto, where XLA propagates shardings and these constraints steer it).
  """
  if mesh.empty or mesh.size == 1:
    return None
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if all(t == AxisType.Manual for t in types.values()):
    return None  # wholly inside a shard_map: the code already runs per device
  axes = LOGICAL_AXIS_RULES["batch"]
  names = axes if isinstance(axes, tuple) else (axes,)
  missing = [n for n in names if n not in types]
  if missing:
    raise ValueError(
        f"the ambient mesh has axes {tuple(mesh.axis_names)}, but the decoder splits the batch over "
        f"{names} (LOGICAL_AXIS_RULES['batch']): missing {tuple(missing)}; use make_mesh() or "
        f"change LOGICAL_AXIS_RULES")
  explicit = [n for n in names if types[n] == AxisType.Explicit]
  if explicit:
    raise ValueError(
        f"mesh axes {tuple(explicit)} are Explicit; the decoder needs Auto batch axes: build the "
        f"mesh with pisa_jax.models.sharding.make_mesh() or jax.make_mesh(..., "
        f"axis_types=(AxisType.Auto,) * {len(mesh.axis_names)})")
  # Axes of length 1 stay in: a shard_map spec that leaves a mesh axis out adds all-reduces over
  # it (size-1 groups, but collectives in the program all the same).
  auto = tuple(n for n in names if types[n] == AxisType.Auto)
  if not auto or axes_size(mesh, auto) == 1:
    return None
  return auto if len(auto) > 1 else auto[0]


def seq_axis_of(mesh) -> str | None:
  """The mesh axis the sequence is split over ("seq", the "length" rule), or None when `mesh`
  (a Mesh or AbstractMesh) has no such axis, splits nothing along it, or runs inside a
  `shard_map` that made it Manual."""
  name = LOGICAL_AXIS_RULES["length"]
  if mesh.empty or name not in mesh.axis_names:
    return None
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if types[name] != AxisType.Auto or mesh.shape[name] == 1:
    return None
  return name


def constrain_batch(x: jax.Array, batch_dim: int = 0) -> jax.Array:
  """Pins an activation `[B, T, ...]` to "batch over (data, fsdp), the sequence over seq, the rest
  whole" under the ambient mesh (`batch_dim` says where B is; T follows it).

  Parameters are sharded over "fsdp" along their model dimension. Left to itself, XLA's sharding
  propagation follows them into the activations: it shards `[B, T, E]` along E and gathers the
  batch, moving activation-sized tensors every layer instead of parameter-sized ones (on 2 fake
  devices, all-gathers of the global `[B, T, E]`). Pinning the activations makes it gather the
  parameters, which is what fsdp means. A no-op without a mesh or on one device.

  Under a mesh with a "seq" axis the sequence dimension is pinned to it the same way: every
  token-wise op (projections, norms, MLP, logits) then stays on the device that holds the token.
  A length that the axis cannot split (a decode step's single token) stays whole.

  The mesh is the ambient one (`jax.set_mesh`, as the trainer does): under a plain `jit` with
  `in_shardings` and no ambient mesh this does nothing, and XLA decides the layouts alone.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = batch_axes_of(mesh)
  seq = seq_axis_of(mesh)
  if seq is not None and (x.ndim <= batch_dim + 1 or x.shape[batch_dim + 1] % mesh.shape[seq]):
    seq = None
  if axes is None and seq is None:
    return x
  spec = [None] * x.ndim
  spec[batch_dim] = axes
  if seq is not None:
    spec[batch_dim + 1] = seq
  return jax.lax.with_sharding_constraint(x, P(*spec))


def batch_sharding(mesh: Mesh, rank: int, batch_dim: int) -> NamedSharding:
  """Shards dimension `batch_dim` of a rank-`rank` array over the "batch" rule's mesh axes, and
  the next one (the sequence) over "seq" when the mesh splits it."""
  spec = [None] * rank
  spec[batch_dim] = LOGICAL_AXIS_RULES["batch"]
  seq = seq_axis_of(mesh)
  if seq is not None and batch_dim + 1 < rank:
    spec[batch_dim + 1] = seq
  return NamedSharding(mesh, P(*spec))


def batch_ways(mesh: Mesh, context_parallel: int = 1) -> int:
  """How many ways `mesh` splits the batch (data x fsdp): the global batch is
  `train.per_device_batch` times this. Raises ValueError when the mesh's "seq" axis is not
  `context_parallel` long."""
  seq = mesh.shape.get(SEQ_AXIS, 1)
  if seq != context_parallel:
    raise ValueError(f"train.context_parallel={context_parallel} does not match the mesh "
                     f"{dict(mesh.shape)}: its {SEQ_AXIS!r} axis must have {context_parallel} "
                     f"devices (make_mesh(fsdp, context_parallel) builds it)")
  return mesh.devices.size // seq


def mesh_devices(devices, fsdp: int = -1, context_parallel: int = 1) -> "np.ndarray":
  """`devices` (every process's) laid out as the `(data, fsdp)` or `(data, fsdp, seq)` device
  array of `make_mesh`.

  The layout rule: devices are ordered by (process, device id) and reshaped, seq innermost, then
  fsdp, then data. So a "seq" group (context parallelism, keys and values exchanged every layer)
  is always inside one process, and an "fsdp" group (parameters gathered every layer) is inside
  one process when `fsdp * context_parallel` divides a process's devices, else whole consecutive
  processes; "data" (one gradient all-reduce a step) spans the rest. Launchers number the
  processes of one host consecutively (srun's block distribution, a host list in order), so
  these groups stay inside a host where they can. Within a process the order is jax.make_mesh's
  on GPU and CPU (device ids). `fsdp=-1` puts every device of one process (over
  `context_parallel`) on "fsdp". Each process's devices hold a contiguous range of the batch
  rows, in process order: the rows `pisa_jax.train.data` gives each process.
  """
  per_process: dict[int, list] = {}
  for d in devices:
    per_process.setdefault(d.process_index, []).append(d)
  counts = {len(v) for v in per_process.values()}
  if len(counts) != 1:
    sizes = {p: len(v) for p, v in sorted(per_process.items())}
    raise ValueError(f"every process must have as many devices (devices per process: {sizes})")
  (local,) = counts
  total = len(devices)
  if context_parallel < 1 or local % context_parallel:
    raise ValueError(f"train.context_parallel={context_parallel} must be >= 1 and divide the "
                     f"{local} local devices (a sequence's shards stay in one process)")
  fsdp = local // context_parallel if fsdp == -1 else fsdp
  group = fsdp * context_parallel
  within = fsdp >= 1 and local % group == 0
  whole = fsdp >= 1 and group % local == 0 and total % group == 0
  if not (within or whole):
    many = len(per_process) > 1
    raise ValueError(
        f"train.fsdp={fsdp} must divide the {local} local devices"
        + (f" / train.context_parallel={context_parallel} = {local // context_parallel}"
           if context_parallel > 1 else "")
        + (f", or span whole processes ({local} devices each, {total} in all)" if many else ""))
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  shape = (total // group, fsdp) + ((context_parallel,) if context_parallel > 1 else ())
  return np.asarray(ordered, dtype=object).reshape(shape)


def make_mesh(fsdp: int = -1, context_parallel: int = 1) -> Mesh:
  """A (data, fsdp) mesh over every device of every process (`mesh_devices` gives the layout);
  `fsdp=-1` puts every device of one process on "fsdp".

  With `context_parallel` > 1, a (data, fsdp, seq) mesh whose "seq" axis has that many devices
  of one process (`fsdp=-1`: every other device of the process on "fsdp"). In a single process
  the devices are jax.make_mesh's.
  """
  names = MESH_AXES + ((SEQ_AXIS,) if context_parallel > 1 else ())
  layout = mesh_devices(jax.devices(), fsdp, context_parallel)
  if jax.process_count() == 1:
    return jax.make_mesh(layout.shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.local_devices())
  return Mesh(layout, names, axis_types=(AxisType.Auto,) * len(names))
