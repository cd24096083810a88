"""Packed documents: each document's own block grid and pyramid inside one row of `[B, T]`.

`segment_ids` `[B, T]` int32, non-decreasing within a row: a document is a run of equal ids.
Everything a query sees is its document's, as if the document ran alone from position 0: its
leaf i holds the document's keys [i C, (i + 1) C) (so a document that starts mid-block has its
own grid from its first token, and its last leaf may be partial), its pyramid is Eq. 7-15 over
those leaves alone, and block indices are the document's own block numbers.

Packed node layout. Level l (1 = the leaves) of every document of a row lies in one array,
documents in order and each document's nodes in order, so a document's level-l nodes are the
consecutive slots first_node .. first_node + ceil(L / S_l) - 1 (L its length, S_l = C g^(l-1)
keys per full node). A document has a level l >= 2 only while its level l - 1 has more than one
node (L > S_(l-1)): its root is its own top level, as when it runs alone.

Static capacities (`packed_capacities`), bounds that hold for every `segment_ids` of shape
[B, T], so that no input can overflow them and nothing needs a runtime check:
  level 1:  N_1 = T. A leaf holds at least one key; T leaves when every document has one token.
    (The leaves in use are sum ceil(L_d / C) <= T / C + number of documents.)
  level l >= 2:  N_l = max(T // (S_(l-1) + 1), 2T // (S_l + 1)). Only documents longer than
    S_(l-1) reach level l, and such a document of L keys has ceil(L / S_l) nodes, at most
    L / (S_(l-1) + 1) (when L <= S_l) or 2L / (S_l + 1) (when L > S_l) of them.
Memory: N_1 leaves of `[HKV, D]` are as many float32 elements as the keys, and the upper levels
add about max(g, 2) / (g - 1) T / C nodes (2T / C for g = 2): O(T) per head, against the
T / C + T / (C (g - 1)) nodes of one unpacked pyramid. Building it is O(T) segment sums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pisa_jax.geometry import level_sizes, node_span


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["start", "length", "node", "first_node"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Documents:
  """Where each position's document lies, and its nodes in the packed layout.

  Attributes:
    start: int32 `[B, T]`, the first position of position t's document.
    length: int32 `[B, T]`, that document's number of tokens.
    node: int32 `[B, T, L]`, the packed slot of the level-l node (l = 1 + last index) that holds
      position t; -1 where t's document has no level l.
    first_node: int32 `[B, T, L]`, the packed slot of the first level-l node of t's document;
      -1 where it has no level l.
  L is the number of levels of a document of T tokens (`geometry.level_sizes`), the most any
  document of the row can have.
  """

  start: Int[Array, "B T"]
  length: Int[Array, "B T"]
  node: Int[Array, "B T L"]
  first_node: Int[Array, "B T L"]


def document_bounds(segment_ids: Int[Array, "B T"]) -> tuple[Array, Array]:
  """Each position's document start and length, int32 `[B, T]`: a document is a run of
  equal ids."""
  seq_len = segment_ids.shape[1]
  t = jnp.arange(seq_len, dtype=jnp.int32)
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  first = jnp.concatenate([jnp.ones_like(change[:, :1]), change], axis=1)
  last = jnp.concatenate([change, jnp.ones_like(change[:, :1])], axis=1)
  start = lax.cummax(jnp.where(first, t, 0), axis=1)
  end = lax.cummin(jnp.where(last, t + 1, seq_len), axis=1, reverse=True)
  return start, end - start


def documents(segment_ids: Int[Array, "B T"], block_size: int, branching: int) -> Documents:
  """The `Documents` geometry of packed rows (see the module docstring for the layout)."""
  seq_len = segment_ids.shape[1]
  start, length = document_bounds(segment_ids)
  rel = jnp.arange(seq_len, dtype=jnp.int32) - start
  nodes, firsts = [], []
  for level in range(1, len(level_sizes(seq_len, block_size, branching)) + 1):
    span = node_span(level, block_size, branching)
    # Eq. 10: a level above the leaves exists while the one below has more than one node.
    has = length > span // branching if level > 1 else jnp.ones_like(length, bool)
    begins = has & (rel % span == 0)
    node = jnp.cumsum(begins, axis=1, dtype=jnp.int32) - 1
    nodes.append(jnp.where(has, node, -1))
    # A document's nodes are consecutive: its first is t's node less t's node number in it.
    firsts.append(jnp.where(has, node - rel // span, -1))
  return Documents(start, length, jnp.stack(nodes, -1), jnp.stack(firsts, -1))


def packed_capacities(seq_len: int, block_size: int, branching: int) -> tuple[int, ...]:
  """Static slots per level of the packed layout, leaves first (bounds in the module docstring)."""
  caps = [seq_len]
  for level in range(2, len(level_sizes(seq_len, block_size, branching)) + 1):
    span = node_span(level, block_size, branching)
    caps.append(max(seq_len // (span // branching + 1), 2 * seq_len // (span + 1)))
  return tuple(caps)


def level_node_counts(first_node: Int[Array, "... L"], length: Int[Array, "..."], level: int,
                      block_size: int, branching: int) -> Int[Array, "..."]:
  """Nodes of a document at `level` (1 = leaves), M_l = ceil(L / S_l) (Eq. 10, 13), from its
  `Documents.first_node` and length; 1 where the document has no such level: the walk treats a
  level above a document's root as holding one node, kept without scoring, so that it walks the
  document's own levels below."""
  count = -(-length // node_span(level, block_size, branching))
  return jnp.where(first_node[..., level - 1] >= 0, count, 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["summaries", "counts", "first_node"],
    meta_fields=["block_size", "branching", "seq_len"],
)
@dataclasses.dataclass(frozen=True)
class PackedPyramid:
  """The pyramid of every document of packed rows, in the packed node layout.

  Attributes:
    summaries: float32 `[B, N_l, HKV, D]` per level, leaves first: slot first_node[b, t, l - 1]
      + i holds node i of level l of position t's document, the mean of Eq. 15 over that
      document's own children (its leaves: the means of its own keys, Eq. 2). Slots past a
      row's last node are zero.
    counts: int32 `[B, N_l]` per level: valid keys of each leaf, valid children of each upper
      node (the denominators of Eq. 15); 0 for an unused slot.
    first_node: int32 `[B, T, L]`, the slot of the first level-l node of position t's document,
      -1 where that document has no level l (its root lies lower).
    block_size, branching, seq_len: C, g and T.
  `packed_capacities` gives N_l; the rows' documents never need more.
  """

  summaries: tuple[Float[Array, "B N H D"], ...]
  counts: tuple[Int[Array, "B N"], ...]
  first_node: Int[Array, "B T L"]
  block_size: int
  branching: int
  seq_len: int

  @property
  def num_levels(self) -> int:
    return len(self.summaries)


def _segment_sum(x, ids, num_segments: int):
  """Rows of x `[B, N, ...]` summed into `num_segments` rows by ids `[B, N]`, per batch entry;
  an id outside [0, num_segments) is dropped."""
  return jax.vmap(functools.partial(jax.ops.segment_sum, num_segments=num_segments))(x, ids)


def packed_pyramid(k: Float[Array, "B T HKV D"], docs: Documents, *, block_size: int,
                   branching: int) -> PackedPyramid:
  """The `PackedPyramid` of k's documents; `docs` from `documents(segment_ids, ...)`."""
  b, seq_len = k.shape[:2]
  caps = packed_capacities(seq_len, block_size, branching)
  # Eq. 2 / Eq. 15 with l = 0: a leaf is the mean of its document's keys in it.
  leaf = docs.node[..., 0]
  total = _segment_sum(k.astype(jnp.float32), leaf, caps[0])
  count = _segment_sum(jnp.ones((b, seq_len), jnp.int32), leaf, caps[0])
  summaries = [total / jnp.maximum(count, 1)[:, :, None, None].astype(jnp.float32)]
  counts = [count]
  rel = jnp.arange(seq_len, dtype=jnp.int32) - docs.start
  rows = jnp.arange(b)[:, None]
  for level in range(2, len(caps) + 1):
    below = docs.node[..., level - 2]
    begins = (below >= 0) & (rel % node_span(level - 1, block_size, branching) == 0)
    # The parent of each node one level down: the node of this level that holds its first
    # position (a document's nodes of both levels start at its first token). Unused slots, and
    # nodes of documents whose root is lower, keep the out-of-range parent and are dropped.
    above = docs.node[..., level - 1]
    parent = jnp.full((b, caps[level - 2]), caps[level - 1], jnp.int32).at[
        rows, jnp.where(begins, below, caps[level - 2])].set(
            jnp.where(above >= 0, above, caps[level - 1]), mode="drop")
    # Eq. 15: the mean of the valid children, divided by how many exist.
    total = _segment_sum(summaries[-1], parent, caps[level - 1])
    count = _segment_sum((counts[-1] > 0).astype(jnp.int32), parent, caps[level - 1])
    summaries.append(total / jnp.maximum(count, 1)[:, :, None, None].astype(jnp.float32))
    counts.append(count)
  return PackedPyramid(tuple(summaries), tuple(counts), docs.first_node, block_size, branching,
                       seq_len)
