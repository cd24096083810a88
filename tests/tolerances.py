"""Every numerical tolerance of the test suite, in one place.

Loosening one needs a written reason beside it. Kernels are compared with the jnp reference run on
float32-upcast inputs at Precision.HIGHEST.
"""

import jax.numpy as jnp

# Forward outputs, by input dtype. Each is a few times the worst kernel error seen, max over the
# elements of |got - want| / (1 + |want|) in interpret mode (CI's cases and PISA-shaped ones up to
# T = 256), beside the largest |got - want| of the H200 check at T = 777..4096 (2026-11):
#   float32  outputs 2.7e-7 (H200 4.8e-7), gradients 4.3e-6 (H200 6.7e-5 on a dv ~10);
#   float16  outputs 3.7e-4 (H200 1.1e-3), gradients 1.3e-3 (H200 1.5e-3);
#   bfloat16 outputs 2.8e-3 (H200 9.4e-3), gradients 9.3e-3 (H200 4.8e-2 on a dv ~10).
# bfloat16 stays at tokamax's 1e-2 / 2e-2: its own rounding (2^-9 of each output element, and of
# the weights before the PV dot) already takes half of that, whatever the reference does.
OUTPUT_ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 3e-3}
OUTPUT_RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 3e-3}
# Gradients: about twice the forward tolerance (tokamax's convention), as their errors are.
GRAD_ATOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
GRAD_RTOL = {jnp.float32: 5e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}

# The reference on bf16 inputs against itself on the same inputs upcast to float32, relative RMS of
# the output and each gradient: bf16 rounds each of them once (~0.17%); a bf16 sum of the many
# queries that select one block reached 2% (T = 2048, CPU) and 4.3% (T = 8192, H200).
REFERENCE_LOW_PRECISION_REL_RMS = 1e-2
# Gradients of keys that many queries attend (NSA's compressed keys: the first one by every query
# of its document) take GRAD_ATOL times the key's RMS over the head dim (at least 1), as their
# 16-bit rounding errors add up like a random walk over the terms whatever the sum
# (`test_gpu_nsa._check`). The compressed kernel in the interpreter, bfloat16, T = 1500: 1 to 26
# elements a case beyond the plain GRAD_ATOL (sums near zero of terms ~10), the worst at 0.40 of
# the scaled tolerance (0.48 at T = 300), relative RMS 2.1e-3 to 3.3e-3; the same kernel on the
# same inputs in float32 within 3.5e-5 of the reference.

# Reference sparse attention with every block selected against jax.nn.dot_product_attention.
DENSE_MATCH_ATOL = 1e-5
# Pyramid summaries, kernel against reference (float32 means of the same numbers).
PYRAMID_ATOL = 1e-6
# Selection: a kernel's indices may differ from the reference's only where the competing scores
# differ by less than this relative amount (a near-tie that float32 summation order can flip).
SELECTION_NEAR_TIE_RTOL = 1e-4
# Golden cases were computed in float64; the float32 reference output matches to this.
GOLDEN_OUTPUT_ATOL = 2e-5
GOLDEN_QUALITY_ATOL = 1e-5
