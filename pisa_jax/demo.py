"""A short CPU tour of selection and attention: `pisa-tour` or `python -m pisa_jax.demo`.

Random queries and keys with planted structure (some key blocks aligned with the queries) show what
each selector finds, how close its choice is to full attention, and that the sparse output
approaches dense attention as K grows.
"""

from __future__ import annotations

import argparse
import time

from pisa_jax import _checks
from pisa_jax._command_line import ArgumentParser


def planted_inputs(seq_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, seed: int):
  """q, k, v `[1, T, H, D]` where a few key blocks share a direction with the queries."""
  import jax
  import jax.numpy as jnp

  kq, kk, kv, kd, kb = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(kq, (1, seq_len, num_q_heads, head_dim))
  k = jax.random.normal(kk, (1, seq_len, num_kv_heads, head_dim))
  v = jax.random.normal(kv, (1, seq_len, num_kv_heads, head_dim))
  direction = jax.random.normal(kd, (head_dim,))
  direction = direction / jnp.linalg.norm(direction)
  q = q + 2.0 * direction
  hot = jax.random.bernoulli(kb, 0.05, (1, seq_len, num_kv_heads, 1))
  k = k + jnp.where(hot, 3.0 * direction, 0.0)
  return q, k, v


def main(argv=None) -> None:
  parser = ArgumentParser(prog="pisa-tour", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-len", type=int, default=2048, help="tokens T (>= 1)")
  parser.add_argument("--block-size", type=int, default=64, help="keys per leaf block C")
  parser.add_argument("--top-k", type=int, default=8, help="blocks per query K (>= 3)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.seq_len < 1:
    parser.error(f"--seq-len={args.seq_len} must be >= 1")
  try:
    _checks.check_block_size(args.block_size, name="--block-size")
    _checks.check_top_k(args.top_k, name="--top-k")
  except ValueError as e:
    parser.error(str(e))
  # Imported once the arguments are known good: a mistake costs no jax start-up.
  import jax
  import jax.numpy as jnp
  from tqdm import tqdm

  import pisa_jax

  q, k, v = planted_inputs(args.seq_len, 8, 2, 64, args.seed)
  dense = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  print(f"T={args.seq_len}, 8 query heads / 2 KV heads, D=64, block_size={args.block_size}, "
        f"top_k={args.top_k}, backend={jax.default_backend()}")
  rows = []
  for selector in tqdm(("pisa", "pisa2", "pisa1", "bsa", "exact"), desc="selectors"):
    start = time.perf_counter()
    idx = jax.block_until_ready(pisa_jax.select_blocks(
        q, k, block_size=args.block_size, top_k=args.top_k, selector=selector, implementation="xla"))
    seconds = time.perf_counter() - start
    quality = pisa_jax.selection_quality(q, k, idx, block_size=args.block_size)
    out = pisa_jax.sparse_attention(q, k, v, idx, block_size=args.block_size, implementation="xla")
    error = float(jnp.sqrt(jnp.mean((out - dense) ** 2) / jnp.mean(dense ** 2)))
    rows.append((selector, float(quality.recall), float(quality.captured_mass),
                 float(quality.mass_ratio), error, seconds))
  print(f"\n{'selector':>8} {'Recall@K':>9} {'captured':>9} {'mass ratio':>10} {'rel. err vs dense':>18} {'select s':>9}")
  for selector, recall, captured, ratio, error, seconds in rows:
    print(f"{selector:>8} {recall:9.1%} {captured:9.1%} {ratio:10.1%} {error:18.4f} {seconds:9.2f}")
  print("\nRecall@K and mass are against the full-attention reference set (forced blocks + highest "
        "attention mass); the error is the sparse output against dense causal attention.")


if __name__ == "__main__":
  main()
