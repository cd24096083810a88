"""Every numerical tolerance of the test suite, in one place.

Loosening one needs a written reason beside it. Kernels are compared with the jnp reference run on
float32-upcast inputs at Precision.HIGHEST.
"""

import jax.numpy as jnp

# Forward outputs, by input dtype.
OUTPUT_ATOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
OUTPUT_RTOL = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}
# Gradients: twice the forward tolerance for the low-precision dtypes (tokamax's convention).
GRAD_ATOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
GRAD_RTOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}

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
