"""Named presets: tiny (CPU, MQAR), small (~105M, one H200), small-1m (small at 1M tokens of
context), the paper's models and their CPT runs.

The 418M / 1.47B / 2.67B presets are Table 5 exactly: the 24/24/32 layers, model and MLP widths,
32 query / 2 KV heads, head dims, 4096 tokens, per-device batch / accumulation, 100K steps with a 1K
linear warm-up, 90K plateau and 9K square-root decay to 0.1x of 3e-4, AdamW (0.9, 0.95, 1e-8, wd
0.1), clipping at 1.0, seed 42, sparse methods with C=64, K=8. Table 5's "bfloat16 parameters, FP32
reductions" is PyTorch FSDP's MixedPrecision(param_dtype=bf16, reduce_dtype=fp32), which keeps the
sharded master weights in float32 and gathers bf16 copies for compute: here param_dtype="float32"
with compute_dtype="bfloat16" (at the decay's 3e-5 an AdamW step is below bf16's resolution of a
0.02-sized weight, so bf16 master weights would stop learning).

The continued-pretraining presets (Appendix C.1, "Continued pretraining") change the context to
16K, the RoPE base to 80,000, K to 32 and the schedule to a 10% linear warm-up to 3e-5 followed by
a cosine decay to 3e-6. The paper gives the CPT budget (10B tokens) but not its batch: we keep
Table 5's 2^20 tokens per step (64 sequences of 16K: per-device 2 x accumulation 2 on 16 devices for
418M, 1 x 2 on 32 devices for the larger two), so 10B tokens are ~9,537 steps, rounded to 10,000.
"""

from __future__ import annotations

import dataclasses

from pisa_jax.configs.base import Config, DataConfig, TrainConfig
from pisa_jax.models.config import ModelConfig

_PAPER_TRAIN = TrainConfig(
    seq_len=4096,
    steps=100_000,
    warmup_steps=1_000,
    decay_steps=9_000,
    peak_lr=3e-4,
    final_lr_ratio=0.1,
    lr_schedule="wsd_sqrt",
    seed=42,
)


def _paper(num_layers, d_model, mlp_dim, head_dim, per_device_batch) -> Config:
  model = ModelConfig(
      num_layers=num_layers, d_model=d_model, mlp_dim=mlp_dim, num_heads=32, num_kv_heads=2,
      head_dim=head_dim, rope_base=10_000.0, attention="pisa", block_size=64, top_k=8,
      param_dtype="float32", compute_dtype="bfloat16",
  )
  train = dataclasses.replace(_PAPER_TRAIN, per_device_batch=per_device_batch, grad_accum=2)
  return Config(model=model, data=DataConfig(source="tokens", path="data/corpus"), train=train)


def _cpt(base: Config, per_device_batch: int) -> Config:
  model = dataclasses.replace(base.model, rope_base=80_000.0, top_k=32)
  train = dataclasses.replace(
      base.train, seq_len=16_384, per_device_batch=per_device_batch, grad_accum=2, steps=10_000,
      lr_schedule="cosine", peak_lr=3e-5, final_lr_ratio=0.1, warmup_steps=0,
      warmup_fraction=0.1, decay_steps=0,
  )
  return dataclasses.replace(base, model=model, train=train)


def _tiny() -> Config:
  # MQAR (Zoology): 128 tokens, 8 key-value pairs in the first 16 positions (leaf blocks 0 and 1
  # of 8 tokens), each key queried once in the remaining 112. Every query sees the forced first,
  # previous and current blocks; K=8 of 16 blocks leaves 5 slots for up to 12 other past blocks,
  # so for every query past position 24 PISA has to select block 1 itself. Filler positions hold
  # token 0 (Zoology's random_non_queries=False): with random filler the loss barely moves in CPU
  # minutes. Measured on a CPU (450 steps, held-out recall): dense 100%;
  # PISA K=8 100% (keys in block 1, which only selection can reach: 100%); K=4 12.6% and K=3 16.8%
  # (keys in block 0, always visible: 11% and 28%): with one free slot or none the model stays on
  # the "one of the 8 values" plateau. The PISA model's loss and gradients equal dense attention
  # under the same block mask (checked to 1.5e-7), so this is learning dynamics, not a bug.
  model = ModelConfig(
      vocab_size=64, vocab_pad_multiple=64, num_layers=2, d_model=128, mlp_dim=256,
      num_heads=4, num_kv_heads=2, head_dim=32, attention="pisa", block_size=8, top_k=8,
      branching=2, init_std=0.05, param_dtype="float32",
  )
  data = DataConfig(source="mqar", mqar_num_pairs=8, mqar_random_filler=False)
  train = TrainConfig(
      seq_len=128, per_device_batch=64, grad_accum=1, steps=450, peak_lr=3e-3,
      lr_schedule="wsd_sqrt", warmup_steps=30, decay_steps=100, final_lr_ratio=0.1,
      weight_decay=0.1, seed=0, checkpoint_every=150, keep_checkpoints=2, log_every=25,
      eval_every=150, eval_batches=4,
  )
  return Config(model=model, data=data, train=train)


def _small() -> Config:
  # ~105M parameters (52M of them the two padded embedding tables), Table 5's shape family.
  model = ModelConfig(
      num_layers=16, d_model=512, mlp_dim=1408, num_heads=16, num_kv_heads=2, head_dim=64,
      attention="pisa", block_size=64, top_k=8, param_dtype="float32",
  )
  train = dataclasses.replace(
      _PAPER_TRAIN, per_device_batch=8, grad_accum=1, steps=2_000, warmup_steps=100,
      decay_steps=200, checkpoint_every=500, log_every=10, eval_every=250, eval_batches=4,
  )
  return Config(model=model, data=DataConfig(source="tokens", path="data/corpus"), train=train)


def _small_1m() -> Config:
  # `small` at 2^20 tokens of context on one H200, batch 1: each block keeps only its input for
  # the backward (remat "full": the whole step's saved activations are 16 x [2^20, 512] bf16,
  # 16 GiB) and the loss runs over chunks of 8,192 tokens (a chunk's float32 logits are 1.5 GiB;
  # whole they would be 197 GiB). Dense attention at this length is O(T^2): the preset is PISA.
  base = _small()
  model = dataclasses.replace(base.model, attention="pisa", remat="full")
  train = dataclasses.replace(base.train, seq_len=1_048_576, per_device_batch=1, grad_accum=1,
                              loss_chunk=8192)
  return dataclasses.replace(base, model=model, train=train)


PRESETS = {
    "tiny": _tiny,
    "small": _small,
    "small-1m": _small_1m,
    "418m": lambda: _paper(24, 1024, 2816, 64, 8),
    "1.47b": lambda: _paper(24, 2048, 5632, 128, 4),
    "2.67b": lambda: _paper(32, 2560, 6912, 128, 4),
    "cpt-418m": lambda: _cpt(_paper(24, 1024, 2816, 64, 8), 2),
    "cpt-1.47b": lambda: _cpt(_paper(24, 2048, 5632, 128, 4), 1),
    "cpt-2.67b": lambda: _cpt(_paper(32, 2560, 6912, 128, 4), 1),
}


def get_config(name: str) -> Config:
  """Returns the named preset (`tiny`, `small`, `small-1m`, `418m`, `1.47b`, `2.67b`, `cpt-*`)."""
  if name not in PRESETS:
    raise ValueError(f"config={name!r} is unknown: expected one of {sorted(PRESETS)}")
  return PRESETS[name]()
