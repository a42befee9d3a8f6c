#!/usr/bin/env bash
# The whole test suite, slow tests included (what .ci/run calls). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra "$@"
