"""Every Pallas kernel lowers for sm_90 to the Triton IR and launch the manifest records
(`tests/kernel_ir.py`): a change of a hash is a change of what the GPU runs, made on purpose
and recorded with `python tests/kernel_ir.py --write`, or a refactor that was not one."""

from __future__ import annotations

import json

import pytest

import kernel_ir


@pytest.fixture(scope="module")
def recorded():
  manifest = json.loads(kernel_ir.MANIFEST.read_text())
  if not kernel_ir.same_versions(manifest):
    pytest.skip(f"the manifest is of jax {manifest['jax']} / jaxlib {manifest['jaxlib']}: IR "
                "compares within one version (rerun `python tests/kernel_ir.py --write`)")
  return manifest


def test_the_manifest_covers_every_configuration(recorded):
  assert set(recorded["programs"]) == set(kernel_ir.CASES)
  assert set(kernel_ir.CI_CASES) <= set(kernel_ir.CASES)


def _check(recorded, names):
  kernel_diff, _ = kernel_ir.compare(recorded, kernel_ir.manifest(names))
  assert not kernel_diff, "\n".join(kernel_diff)


def test_default_kernels_lower_to_the_recorded_ir(recorded):
  # One or two configurations of each kernel family: the selection defaults at d64 K8 and d128
  # K32, packed selection, attention (plain, packed, offset), the decode step (walk and BSA).
  _check(recorded, kernel_ir.CI_CASES)


@pytest.mark.slow
def test_every_kernel_lowers_to_the_recorded_ir(recorded):
  _check(recorded, [n for n in kernel_ir.CASES if n not in kernel_ir.CI_CASES])
