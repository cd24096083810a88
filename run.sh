#!/usr/bin/env bash
# The README's two commands. Each sets up everything on a fresh machine first:
#   ./run.sh demo   the main job: trains the tiny PISA model on CPU and prints what it learned
#   ./run.sh test   the test suite (what CI runs, through .ci/run)
# The set-up makes .venv with Python >= 3.12 and installs this project with its extras;
# it is skipped when pyproject.toml has not changed since the last install.
set -euo pipefail
cd "$(dirname "$0")"
PISA_JAX=${PISA_JAX:-0.11.2}

find_python() {
  local c
  for c in "${PISA_PYTHON:-}" python3.13 python3.12 python3 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "run.sh: no Python >= 3.12 found; install one or set PISA_PYTHON=/path/to/python3.12" >&2
  return 1
}

# pip, silent unless it fails (then its whole log is shown).
pip_quiet() {
  local log; log=$(mktemp)
  if ! .venv/bin/python -m pip "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}

setup() {
  local stamp=.venv/.pisa-installed want
  want=$( (cat pyproject.toml run.sh; echo "$PISA_JAX") | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  local py; py=$(find_python)
  echo "run.sh: setting up .venv with $("$py" --version) (first run only; a few minutes)" >&2
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  pip_quiet install --upgrade pip
  # pyproject accepts any jax 0.11.x from 0.11.2; the suite runs on the GPU image's release.
  pip_quiet install -e ".[test,data,bench,eval,import]" "jax==$PISA_JAX" "jaxlib==$PISA_JAX"
  # The exact GPT-2 BPE ranks ship inside this source package (see WORKSPACE.md, "Data"); it is
  # installed without its dependencies and never imported.
  pip_quiet install --no-deps "openai-whisper==20250625"
  echo "$want" > "$stamp"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    setup
    exec .venv/bin/python -m pisa_jax.train.demo "$@"
    ;;
  test)
    setup
    workers=$(( $(nproc) < 2 ? 1 : 2 ))
    exec .venv/bin/python -m pytest -q -n "$workers" --durations=15 tests "$@"
    ;;
  *)
    echo "usage: ./run.sh demo [args] | ./run.sh test [pytest args]" >&2
    exit 2
    ;;
esac
