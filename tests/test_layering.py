"""The import rules WORKSPACE.md states: kernels import only the library's base modules, and
benchmarks never import the tests."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a kernel may import of the library besides the kernel package: the leaf modules the
# reference shares with it, never the API or the jnp reference.
KERNEL_BASES = {"pisa_jax.geometry", "pisa_jax.spec", "pisa_jax.segments",
                "pisa_jax.checkpoint_names"}
TEST_MODULES = {path.stem for path in (ROOT / "tests").glob("*.py")} | {"tests"}


def _imports(path: pathlib.Path) -> set[str]:
  """Every module `path` imports, `from a import b` counted as a.b (b may be a module)."""
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
  return names


def test_kernels_import_only_the_base_modules():
  bad = {}
  for path in sorted((ROOT / "kernels").rglob("*.py")):
    ours = {n for n in _imports(path) if n.startswith("pisa_jax")}
    # `from pisa_jax import geometry` names pisa_jax itself too.
    wrong = {n for n in ours - {"pisa_jax"} if not n.startswith("pisa_jax.kernels")
             and not any(n == b or n.startswith(b + ".") for b in KERNEL_BASES)}
    if wrong:
      bad[str(path.relative_to(ROOT))] = sorted(wrong)
  assert not bad, bad


def test_benchmarks_never_import_the_tests():
  bad = {str(path.relative_to(ROOT)): sorted(hit)
         for path in sorted((ROOT / "benchmarks").rglob("*.py"))
         if (hit := {n.split(".")[0] for n in _imports(path)} & TEST_MODULES)}
  assert not bad, bad
