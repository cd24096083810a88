"""Resume checks for the attention kinds with parameters of their own (NSA, HiLS): a changed
shape field or kind is refused by name before Orbax sees the checkpoint, and a changed size is an
attention change (refused unless `--allow-attention-change`)."""

from __future__ import annotations

import dataclasses

import pytest

from pisa_jax.configs import get_config
from pisa_jax.train import checkpoint


def _saved(model) -> dict:
  return dataclasses.asdict(model)


@pytest.mark.parametrize("kind,field,value", [
    ("nsa", "nsa_block_length", 64),
    ("nsa", "nsa_compression", "mean"),
    ("hils", "hils_landmark_rank", 16),
])
def test_a_changed_shape_field_of_a_kind_is_named(kind, field, value):
  model = dataclasses.replace(get_config("tiny").model, attention=kind)
  saved = _saved(model)
  now = dataclasses.replace(model, **{field: value})
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match=f"model.{field}: checkpoint"):
    checkpoint.check_compatible(saved, now, where="runs/x/10")
  checkpoint.check_compatible(saved, model, where="runs/x/10")  # unchanged: no error


@pytest.mark.parametrize("saved_kind,kind", [("dense", "nsa"), ("hils", "pisa"), ("nsa", "hils")])
def test_a_kind_with_other_parameters_cannot_restore(saved_kind, kind):
  base = get_config("tiny").model
  saved = _saved(dataclasses.replace(base, attention=saved_kind))
  with pytest.raises(checkpoint.IncompatibleCheckpointError, match="model.attention: checkpoint"):
    checkpoint.check_compatible(saved, dataclasses.replace(base, attention=kind), where="r/1")


def test_sparse_kinds_without_own_parameters_still_restore_into_each_other():
  base = get_config("tiny").model
  saved = _saved(dataclasses.replace(base, attention="dense"))
  checkpoint.check_compatible(saved, dataclasses.replace(base, attention="pisa"), where="r/1")
  # A checkpoint written before the kinds' fields existed lacks them: not a difference.
  old = {k: v for k, v in saved.items() if not k.startswith(("nsa_", "hils_"))}
  checkpoint.check_compatible(old, dataclasses.replace(base, attention="bsa"), where="r/1")


def test_a_changed_size_of_a_kind_is_an_attention_change():
  model = dataclasses.replace(get_config("tiny").model, attention="hils")
  changes = checkpoint.attention_changes(_saved(model),
                                         dataclasses.replace(model, hils_top_k=8))
  assert changes == ["model.hils_top_k: checkpoint 32, now 8"]
  assert checkpoint.attention_changes(_saved(model), model) == []
