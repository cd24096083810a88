"""On a GPU: the `small-1m` preset's train step compiles within the 1M memory goal, and remat with
the chunked loss cuts the 64K step's temporaries. XLA's analysis of the compiled step only:
nothing runs. `python -m benchmarks.long_context` measures the steps themselves."""

import pytest

from pisa_jax.configs import apply_overrides, get_config, validate
from pisa_jax.train import trainer as trainer_lib

pytestmark = pytest.mark.gpu


def _memory(*overrides) -> dict:
  config = validate(apply_overrides(get_config("small-1m"), list(overrides)))
  return trainer_lib.build_trainer(config).memory


def test_the_1m_preset_compiles_within_100_gib():
  memory = _memory()
  assert trainer_lib.step_memory(memory) < 100 * 2**30, memory


def test_remat_and_the_chunked_loss_cut_the_64k_step():
  # Without them the step holds [64K, 50,432] float32 logits and their gradient (12 GiB each)
  # and every layer's activations: 41.7 GiB of temporaries measured on an H200.
  plain = _memory("train.seq_len=65536", "model.remat=none", "train.loss_chunk=0")
  lean = _memory("train.seq_len=65536")
  assert lean["temp_size_in_bytes"] < plain["temp_size_in_bytes"] / 3, (plain, lean)
