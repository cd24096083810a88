"""Test configuration: float32 matmuls at full precision, and the slow / gpu markers."""

import gc
import os

import jax
import pytest

import kernel_ir

# The tools' persistent compilation cache stays off in tests: nothing is written under the home
# folder, and no test reads what another compiled (tests/test_compilation_cache.py turns it on).
os.environ["PISA_COMPILATION_CACHE"] = "off"

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


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops jax's compiled programs after each test module. Every XLA CPU executable holds a few
  memory maps of JIT code; a worker that runs half the suite in one process would otherwise pass
  the kernel's limit (vm.max_map_count, 65,530 by default), where LLVM's JIT cannot map code and
  the worker dies of a segmentation fault inside a compile."""
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def captured():
  """Triton IR of every kernel lowered while the fixture is active, as text: Pallas' Triton
  lowering given a compute capability (sm_90), so kernels lower on a machine without a GPU
  (`kernel_ir.sm90_lowering`)."""
  modules = []
  with kernel_ir.sm90_lowering(modules):
    yield modules
