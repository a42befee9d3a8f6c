#!/usr/bin/env bash
# The whole test suite, slow tests included (what .ci/run calls), with its 25 slowest steps at the
# end (a fresh machine builds every image once: CI must stay under 45 minutes). Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra --durations=25 "$@"
