#!/usr/bin/env bash
# Sourced at the start of every command sent to the H200 (see WORKSPACE.md, "Running on the H200").
# The image has jax 0.11.2, flax, optax, orbax, chex and torch/triton, but no registry access:
# carried pure-Python wheels (.whl/, git-ignored, named in `carry`) and this project go to /tmp/site.
export PYTHONUNBUFFERED=1
# `python -m` from the repo root must import the installed pisa_jax (with .train, .models...), not
# the source folder pisa_jax/ that lacks the mapped sub-packages.
export PYTHONSAFEPATH=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
fi
# --upgrade: a warm machine keeps /tmp/site between calls, and pip would keep its older copy.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
  --upgrade --target /tmp/site . || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
