"""The tools' persistent compilation cache: where it goes, how it turns off, what bad values get,
and that a tool's compiled program lands in it (in a subprocess: jax's cache setting is global)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pisa_jax.train import compilation_cache, generate


def test_cache_dir_default_explicit_and_off(tmp_path):
  cache_dir = compilation_cache.cache_dir
  assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pisa_jax" / "xla"
  assert cache_dir({}) == Path.home() / ".cache" / "pisa_jax" / "xla"
  assert cache_dir({"PISA_COMPILATION_CACHE": str(tmp_path / "c")}) == tmp_path / "c"
  for off in ("off", "OFF", " Off "):
    assert compilation_cache.cache_dir({"PISA_COMPILATION_CACHE": off}) is None
    assert compilation_cache.enable({"PISA_COMPILATION_CACHE": off}) is None


def test_bad_values_name_the_variable(tmp_path):
  with pytest.raises(ValueError, match="PISA_COMPILATION_CACHE=' ': give a folder"):
    compilation_cache.cache_dir({"PISA_COMPILATION_CACHE": " "})
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(ValueError, match="PISA_COMPILATION_CACHE=.*cannot make the folder"):
    compilation_cache.enable({"PISA_COMPILATION_CACHE": str(blocker / "sub")})


def test_default_folder_that_cannot_be_made_runs_uncached(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("")
  assert compilation_cache.enable({"XDG_CACHE_HOME": str(blocker)}, prog="pisa-x") is None
  err = capsys.readouterr().err
  assert "pisa-x: compilation cache off: cannot make" in err and "PISA_COMPILATION_CACHE" in err


def test_a_tool_rejects_a_bad_value_before_any_work(tmp_path, monkeypatch, capsys):
  from pisa_jax.configs import get_config

  (tmp_path / "config.json").write_text(get_config("tiny").to_json())  # a run folder's marker
  monkeypatch.setenv("PISA_COMPILATION_CACHE", "")
  with pytest.raises(SystemExit) as exit_info:
    generate.main(["--workdir", str(tmp_path), "--prompt", "hi"])
  assert exit_info.value.code == 2
  assert "PISA_COMPILATION_CACHE='': give a folder" in capsys.readouterr().err


def test_compiled_programs_land_in_the_folder_and_are_read_back(tmp_path):
  folder = tmp_path / "xla"
  env = dict(os.environ, PISA_COMPILATION_CACHE=str(folder),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PLATFORMS="cpu")
  # jax records a persistent-cache hit as a monitoring event.
  script = ("import jax, jax.numpy as jnp\n"
            "from pisa_jax.train import compilation_cache\n"
            "hits = []\n"
            "jax.monitoring.register_event_listener(\n"
            "    lambda event, **kw: hits.append(event) if 'cache_hits' in event else None)\n"
            "print(compilation_cache.enable())\n"
            "jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()\n"
            "print('hits', len(hits))\n")
  first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         check=True)
  assert first.stdout.splitlines() == [str(folder), "hits 0"], first.stdout
  assert any(p.name.startswith("jit__lambda") for p in folder.iterdir())
  second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          check=True)
  assert second.stdout.splitlines()[1] != "hits 0", second.stdout


def test_jax_own_folder_is_kept_when_ours_is_unset(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "PISA_COMPILATION_CACHE"}
  env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "own"), JAX_PLATFORMS="cpu",
             XDG_CACHE_HOME=str(tmp_path / "xdg"))
  out = subprocess.run([sys.executable, "-c", "from pisa_jax.train import compilation_cache\n"
                        "print(compilation_cache.enable())"], env=env, capture_output=True,
                       text=True, check=True).stdout
  assert out.strip() == str(tmp_path / "own")
  assert not (tmp_path / "xdg").exists()
