"""The wheel holds every package: pyproject's explicit `packages` list names each folder with code.

An editable install finds sub-packages through the package-dir mapping, so a sub-package missing
from the list only fails in a regular install (`pip install .`), as on a GPU machine.
"""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_code_folder_is_a_listed_package():
  setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  listed = set(setuptools["packages"])
  package_dir = setuptools["package-dir"]
  expected = set()
  for package, folder in package_dir.items():
    for init in (ROOT / folder).rglob("__init__.py"):
      relative = init.parent.relative_to(ROOT / folder).parts
      expected.add(".".join((package, *relative)))
  missing = sorted(expected - listed)
  assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
  unknown = sorted(listed - expected)
  assert not unknown, f"{unknown} in pyproject.toml's packages have no folder with __init__.py"


def test_pisa_demo_is_the_readme_main_job():
  scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
  run_sh = (ROOT / "run.sh").read_text()
  module, _ = scripts["pisa-demo"].split(":")
  assert f"-m {module} " in run_sh, f"./run.sh demo must run pisa-demo's module {module}"


def test_public_names_survive_the_import_of_their_submodule():
  # `pisa_jax.generate` is both a submodule and the function it defines; importing the one must
  # not hide the other (names are imported on first use).
  import importlib
  import sys

  import pisa_jax

  module = importlib.import_module("pisa_jax.generate")
  assert sys.modules["pisa_jax.generate"] is module
  assert pisa_jax.generate is module.generate
