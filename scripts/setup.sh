#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with inferkiln and its test tools.
# Every other script sources this first, so a fresh clone needs nothing else.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}

# The local stack's programs, from Debian's packages: the Docker Engine, debootstrap (the base
# image) and the Distribution registry. helm comes from PyPI on first use (factory/stack.py).
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-registry >/dev/null || missing+=(docker-registry)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing ${missing[*]}" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "setup: missing ${missing[*]}: install them (Debian: apt-get install ${missing[*]})" >&2
        exit 1
    fi
fi
# The CPU build of torch; where pip has no local copy of it, set INFERKILN_TORCH to another spec.
TORCH_SPEC=${INFERKILN_TORCH:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)" >&2
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: installing $TORCH_SPEC" >&2
    .venv/bin/pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
fi
# The rest through uv (a factory dependency, installed first): with it, set-up from a fresh clone
# takes 2 to 2.5 minutes on 2 cores, where pip took 8. uv reads no pip.conf: a private index is
# given to it as UV_INDEX_URL (or UV_EXTRA_INDEX_URL, UV_FIND_LINKS).
if [ ! -x .venv/bin/uv ]; then
    .venv/bin/pip install --quiet --disable-pip-version-check uv
fi
uv_install() { .venv/bin/uv pip install --quiet --python "$@"; }
# The runtime's dependencies at the versions the cpu image locks (its lock as constraints): the
# suite's in-process servers then run what the image ships, not whatever the index has newest today.
stamp=.venv/.inferkiln-installed
lock=dockerfiles/locks/cpu.txt
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$lock" -nt "$stamp" ]; then
    echo "setup: installing inferkiln and its dependencies" >&2
    uv_install .venv/bin/python -e '.[dev]' --constraint "$lock"
    # xgrammar declares Triton for its CUDA kernel only; the CPU image leaves it out (its lock's
    # no-emit), and so does this environment: transformers imports an installed Triton with every
    # model, whose bindings then print reference-leak warnings into the runtime's JSON log at exit.
    .venv/bin/uv pip uninstall --quiet --python .venv/bin/python triton 2>/dev/null || true
    touch "$stamp"
fi
# NVIDIA AIPerf, in a virtual environment of its own (its pins would move the factory's): the tests
# load every report export with AIPerf's own models, as its tools read them.
AIPERF_SPEC=aiperf==0.13.0
if ! .venv-aiperf/bin/python -c "import aiperf" 2>/dev/null; then
    echo "setup: installing $AIPERF_SPEC into .venv-aiperf" >&2
    "$PYTHON" -m venv .venv-aiperf
    uv_install .venv-aiperf/bin/python "$AIPERF_SPEC"
fi
# Schemathesis, likewise in its own environment (its pins are its own): the suite fuzzes both
# runtimes with its CLI, from the OpenAPI document they serve.
SCHEMATHESIS_SPEC=schemathesis==4.32.5
if ! .venv-schemathesis/bin/st --version >/dev/null 2>&1; then
    echo "setup: installing $SCHEMATHESIS_SPEC into .venv-schemathesis" >&2
    "$PYTHON" -m venv .venv-schemathesis
    uv_install .venv-schemathesis/bin/python "$SCHEMATHESIS_SPEC"
fi
