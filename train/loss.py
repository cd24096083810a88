"""The language-model loss over chunks of tokens, never holding the `[B, T, Vp]` logits.

At long context the logits dominate a train step's memory: `[T, 50,432]` float32 is 12 GiB at 64K
tokens, and its gradient as much again. `token_loss_sums` cuts the tokens into chunks of `chunk`
and runs the output projection, log-sum-exp and argmax one chunk at a time under `lax.scan`, each
chunk under `jax.checkpoint`: the forward keeps only the chunk's inputs, and the backward
recomputes that chunk's logits, turns them into its gradient and moves on. The output projection's
weight gradient is summed over chunks in the parameter's dtype (float32 in every preset). The sums
equal the unchunked ones to float32 rounding; only their order changes.

With the sequence split over devices (context parallelism), chunk i holds the i-th `chunk` tokens
of every device's shard, so each device computes the loss of its own tokens, `chunk` at a time,
and no activation moves between devices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pisa_jax.models.decoder import output_logits
from pisa_jax.models.sharding import constrain_batch, seq_axis_of


def _sums(x, lm_head, targets, weights, *, vocab_size: int):
  """(summed NLL, summed weight, summed argmax hits) of one chunk, float32."""
  logits = output_logits(x, lm_head, vocab_size)
  logz = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return (jnp.sum((logz - target_logit) * weights), jnp.sum(weights), jnp.sum(hits * weights))


def token_loss_sums(x: Float[Array, "B T E"], lm_head: Float[Array, "E Vp"],
                    targets: Int[Array, "B T"], weights: Float[Array, "B T"], *,
                    vocab_size: int, chunk: int | None) -> tuple[Array, Array, Array]:
  """Summed token NLL, summed weight and summed argmax hits (float32 scalars) of the next tokens.

  x: the decoder's final-normed activations (`Decoder.hidden_states`); lm_head: its output
  projection, padded rows (>= vocab_size) given logit -1e9 as in `Decoder.__call__`; weights: 0
  where the loss does not count. chunk: tokens per chunk, dividing T; None or 0 computes all T at
  once (the `[B, T, Vp]` logits and their gradient are then live together).
  """
  b, seq_len, _ = x.shape
  sums = functools.partial(_sums, vocab_size=vocab_size)
  mesh = jax.sharding.get_abstract_mesh()
  seq = seq_axis_of(mesh)
  shards = 1 if seq is None else mesh.shape[seq]
  if not chunk or chunk * shards >= seq_len:
    return sums(x, lm_head, targets, weights)
  if seq_len % (chunk * shards):
    raise ValueError(f"train.loss_chunk={chunk} must divide the sequence length {seq_len}"
                     + (f" / train.context_parallel={shards}" if shards > 1 else ""))
  n = seq_len // (chunk * shards)

  def split(a):  # [B, T, ...] -> [n, B, shards * chunk, ...]: a chunk from each shard
    a = jnp.moveaxis(a.reshape(b, shards, n, chunk, *a.shape[2:]), 2, 0)
    a = a.reshape(n, b, shards * chunk, *a.shape[4:])
    # Pinned so that each device's part of a chunk is its own tokens.
    return a if shards == 1 else constrain_batch(a, batch_dim=1)

  # Only the chunk's inputs are kept for the backward: its logits are made again there.
  chunk_sums = jax.checkpoint(sums)

  def body(carry, xs):
    return jax.tree.map(jnp.add, carry, chunk_sums(xs[0], lm_head, xs[1], xs[2])), None

  zero = jnp.zeros((), jnp.float32)
  totals, _ = jax.lax.scan(body, (zero, zero, zero), (split(x), split(targets), split(weights)))
  return totals
