"""Every command-line tool but pisa-train (its own tests cover it) reports a bad argument before
jax is imported: exit status 2 and one line on stderr naming the argument.

All cases run in one fresh interpreter (this test process has imported jax already), one after
another, each through the `main` that pyproject's [project.scripts] names; the interpreter
records after each case whether jax has been imported.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None

# (tool, argv, a phrase of the message). {tmp} is a folder of the test: {tmp}/notes.txt is text,
# {tmp}/one.npy a single array, {tmp}/prompts.jsonl a prompt, a blank line and a JSON number,
# {tmp}/run no run folder at all.
CASES = [
    ("pisa-prepare-data", ["--fiels", "{tmp}/notes.txt", "--out", "{tmp}/corpus"],
     "unrecognized arguments: --fiels"),
    ("pisa-prepare-data", ["--files", "{tmp}/notes.txt", "--out", "{tmp}/corpus",
                           "--val-fraction", "2"], "--val-fraction 2.0 must be between 0 and 1"),
    ("pisa-generate", ["--workdir", "{tmp}/run", "--prompt", "Once"],
     "--workdir: {tmp}/run does not exist"),
    ("pisa-generate", ["--workdir", "{tmp}", "--prompt", "Once", "--top-p", "0"],
     "argument --top-p: 0 must be in (0, 1]"),
    ("pisa-generate", ["--workdir", "{tmp}", "--prompt", "Once", "--prefill-chunk", "0"],
     "argument --prefill-chunk: 0 must be >= 1"),
    ("pisa-generate", ["--workdir", "{tmp}", "--prompt-file", "{tmp}/missing.txt"],
     "--prompt-file: {tmp}/missing.txt does not exist"),
    ("pisa-generate", ["--workdir", "{tmp}", "--prompt-file", "{tmp}/prompts.jsonl"],
     "--prompt-file: {tmp}/prompts.jsonl line 3 is no prompt: expected a JSON string"),
    ("pisa-generate", ["--workdir", "{tmp}", "--prompt", "Once", "--prompt-file", "{tmp}/p"],
     "argument --prompt-file: not allowed with argument --prompt"),
    ("pisa-eval", ["--workdir", "{tmp}", "--suite", "ppl"],
     "--workdir: {tmp} has no config.json and no checkpoint"),
    ("pisa-eval", ["--workdir", "{tmp}", "--suite", "ppl,bleu"], "unknown suite 'bleu'"),
    ("pisa-eval", ["--npz", "{tmp}/notes.txt", "--out", "{tmp}/eval"],
     "--npz: {tmp}/notes.txt is not an .npz file (it is not a zip archive); expected an .npz "
     "archive (np.savez) of q [L, B, T, HQ, D] and k [L, B, T, HKV, D]"),
    ("pisa-eval", ["--npz", "{tmp}/one.npy", "--out", "{tmp}/eval"],
     "--npz: {tmp}/one.npy holds one array (.npy, np.save)"),
    ("pisa-eval", ["--npz", "{tmp}/missing.npz", "--out", "{tmp}/eval"],
     "--npz: {tmp}/missing.npz does not exist"),
    ("pisa-demo", ["--set", "model.top_k=2"],
     "model.top_k=2 must be an int >= 3: the first, previous and current blocks are forced"),
    ("pisa-demo", ["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    ("pisa-tour", ["--block-size", "0"], "--block-size=0 must be an int >= 1"),
    ("pisa-tour", ["--top-k", "2"], "--top-k=2 must be an int >= 3"),
    ("pisa-import", ["{tmp}/missing.gguf", "--out", "{tmp}/imported"],
     "PATH: {tmp}/missing.gguf does not exist"),
    ("pisa-import", ["{tmp}/notes.txt"], "the following arguments are required: --out"),
    ("pisa-export", ["{tmp}/run", "--out", "{tmp}/exported"], "RUN: {tmp}/run does not exist"),
] + ([
    ("pisa-lm-eval", ["--model", "pisa-jax", "--model_args", "workdir={tmp}/run", "--tasks", "t"],
     "--model_args workdir: {tmp}/run does not exist"),
    ("pisa-lm-eval", ["--model", "pisa-jax", "--tasks", "t"],
     "--model_args: --model pisa-jax needs workdir=RUN"),
    ("pisa-lm-eval", ["--model", "pisa-jax", "--model_args", "workdir={tmp},implementation=cuda",
                      "--tasks", "t"], "implementation='cuda' is unknown"),
    ("pisa-lm-eval", ["--model", "pisa-jax", "--tasks", "t", "--batchsize", "4"],
     "unrecognized arguments: --batchsize"),
] if HAS_LM_EVAL else [])

# Runs each case's `main` in turn; prints one JSON line per case.
RUNNER = r"""
import contextlib, importlib, io, json, sys
cases = json.loads(sys.stdin.read())
import pisa_jax.configs
print(json.dumps({"configs_without_jax": "jax" not in sys.modules}), flush=True)
for target, argv in cases:
  module, function = target.split(":")
  jax_before = "jax" in sys.modules
  err, out = io.StringIO(), io.StringIO()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
      getattr(importlib.import_module(module), function)(argv)
    code = 0
  except SystemExit as e:
    code = e.code
  except BaseException as e:
    code = f"{type(e).__name__}: {e}"
  print(json.dumps({"code": code, "stderr": err.getvalue(), "jax_before": jax_before,
                    "jax_after": "jax" in sys.modules}), flush=True)
"""


def test_every_tool_but_pisa_train_has_a_case():
  tools = {tool for tool, _, _ in CASES}
  expected = set(SCRIPTS) - {"pisa-train"} - (set() if HAS_LM_EVAL else {"pisa-lm-eval"})
  assert tools == expected


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("cli")
  (tmp / "notes.txt").write_text("These are notes, not arrays.\n")
  (tmp / "prompts.jsonl").write_text('"Once"\n\n{"prompt": 3}\n')
  np.save(tmp / "one.npy", np.zeros((2, 3), np.float32))
  cases = [(SCRIPTS[tool], [a.format(tmp=tmp) for a in argv]) for tool, argv, _ in CASES]
  run = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(cases), cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  lines = [json.loads(line) for line in run.stdout.splitlines()]
  assert lines[0] == {"configs_without_jax": True}
  return tmp, lines[1:]


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{tool}-{i}" for i, (tool, _, _) in enumerate(CASES)])
def test_a_bad_argument_is_one_line_before_jax(results, index):
  tmp, lines = results
  tool, _, phrase = CASES[index]
  got = lines[index]
  assert not got["jax_before"], "an earlier case imported jax"
  assert got["code"] == 2, got
  err = got["stderr"]
  assert err.count("\n") == 1 and err.startswith(f"{tool}: error: "), err
  assert phrase.format(tmp=tmp) in err, err
  assert not got["jax_after"], f"{tool} imported jax before reporting: {err}"
