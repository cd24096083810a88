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



def test_public_functions_are_not_shadowed_by_submodules():
  # Names are imported on first use: a submodule of the same name would take the package
  # attribute once imported, so no public name is also a submodule's name.
  import importlib
  import pkgutil

  import pisa_jax

  submodules = {m.name for m in pkgutil.iter_modules(pisa_jax.__path__)}
  assert not submodules & set(pisa_jax.__all__)
  for module in submodules - {"demo"}:
    importlib.import_module(f"pisa_jax.{module}")
  assert callable(pisa_jax.generate) and pisa_jax.generate.__module__ == "pisa_jax.generation"
