"""The op registry: every implementation is registered in `pisa_jax._ops`, and `lookup` loads it
itself, so nothing depends on which modules were imported first."""

from __future__ import annotations

import importlib
import pathlib
import re
import sys

import pytest

from pisa_jax import _dispatch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_register_call_is_in_the_ops_module():
  calls = [f"{path.relative_to(ROOT)}:{n}"
           for folder in ("pisa_jax", "kernels")
           for path in sorted((ROOT / folder).rglob("*.py")) if path.name not in ("_ops.py", "_dispatch.py")
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"\bregister\(", line) and not line.lstrip().startswith("def ")]
  assert not calls, f"register() outside pisa_jax/_ops.py: {calls}"


def test_lookup_loads_the_registrations_itself(monkeypatch):
  # A fresh process in miniature: an empty registry and `_ops` not yet imported. Without the
  # import in `lookup`, no op would be registered until a module registered it as a side effect
  # of its import.
  importlib.import_module("pisa_jax._ops")  # so that the patches below restore a full registry
  monkeypatch.setattr(_dispatch, "_REGISTRY", {})
  monkeypatch.delitem(sys.modules, "pisa_jax._ops")
  from pisa_jax import attention

  assert (_dispatch.lookup("sparse_attention_packed", "xla")
          is attention.sparse_attention_packed_reference)
  assert {"build_pyramid", "select_blocks", "decode_step", "nsa_attention"} <= set(
      _dispatch._REGISTRY)
  with pytest.raises(ValueError, match=r"op='select' is not registered"):
    _dispatch.lookup("select", "xla")
  with pytest.raises(ValueError, match=r"implementation='pallas' is not available for "
                                       r"selection_quality"):
    _dispatch.lookup("selection_quality", "pallas")
