"""Every Python block of README.md runs as written, on the CPU.

The blocks run in order in one namespace, as a reader would run them in one Python session (the
decode block continues with the arrays of the first); nothing in them is substituted.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
  return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_the_readme_python_blocks_run_as_written(capsys):
  blocks = _python_blocks()
  assert len(blocks) >= 2, "README.md has lost its Python blocks"
  namespace: dict = {"__name__": "readme"}
  for number, block in enumerate(blocks, start=1):
    exec(compile(block, f"README.md python block {number}", "exec"), namespace)
  # The decode block printed the 32 new tokens of its one row.
  (row,) = eval(capsys.readouterr().out.strip().splitlines()[-1])
  assert len(row) == 32 and all(0 <= token < 50257 for token in row)
