#!/usr/bin/env bash
# The main job on the embedded default: `inferkiln demo` (pass --no-keep to stop the model afterwards).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec .venv/bin/inferkiln demo "$@"
