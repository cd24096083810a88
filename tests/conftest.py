"""Test configuration: float32 matmuls at full precision, and the slow / gpu markers."""

import os

import jax
import pytest

# The reference is compared at Precision.HIGHEST; make that the default for every jnp op in tests.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  on_gpu = jax.default_backend() == "gpu"
  run_slow = os.environ.get("PISA_SLOW") == "1"
  skip_slow = pytest.mark.skip(reason="slow: set PISA_SLOW=1 to run")
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU backend")
  for item in items:
    if "slow" in item.keywords and not run_slow:
      item.add_marker(skip_slow)
    if "gpu" in item.keywords and not on_gpu:
      item.add_marker(skip_gpu)
