"""The names under which PISA attention tags what a `jax.checkpoint` policy may save.

A leaf module (it imports nothing of pisa-jax), shared by the jnp reference and the kernels.
`pisa_attention` (and `pisa_attention_at`) tag the selected block indices, and the forward rule
of sparse attention's `custom_vjp` tags the two residuals its backward reads, with
`jax.ad_checkpoint.checkpoint_name`. Outside `jax.checkpoint` the tags do nothing.

How a checkpointed backward then avoids the work: jax differentiates a `custom_vjp` by tracing
its forward rule into the checkpointed function, so a policy sees the tags there, and a value it
saves is kept from the forward pass. What only fed saved values is dead in the backward's
recomputation and removed, with one exception: jax never removes a bare `pallas_call` (its
dead-code rule keeps every one, jax 0.11), so the selection and the attention forward kernel each
run inside a `jax.jit`, which jax does remove when none of its outputs is used.

Saved per layer when a policy names them (bytes; B batch, T tokens):

  BLOCK_INDICES   int32 `[B, T, HKV, K]`: B * T * HKV * K * 4 (T = 16K, HKV 2, K 32: 4 MiB a row)
  ATTENTION_OUT   `[B, T, HKV, G, D]` in the compute dtype: B * T * HQ * D * 2 in bf16
  ATTENTION_LSE   float32 `[B, T, HKV, G]`: B * T * HQ * 4

e.g. `jax.checkpoint_policies.save_only_these_names(BLOCK_INDICES)` keeps the indices alone;
`pisa_jax.models.decoder.REMAT_POLICIES` composes these with the decoder's own names.
"""

BLOCK_INDICES = "pisa_block_indices"
ATTENTION_OUT = "pisa_attention_out"
ATTENTION_LSE = "pisa_attention_lse"
