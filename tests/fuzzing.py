"""Fuzzing a running server with Schemathesis's CLI, from the OpenAPI document the server serves.

Schemathesis runs in its own environment (`.venv-schemathesis`, made by scripts/setup.sh) and
loads tests/schemathesis_hooks.py, which gives every generated body the served model's id.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCHEMATHESIS = ROOT / ".venv-schemathesis" / "bin" / "st"
# A schema-valid request may still be refused: a prompt plus max_tokens over the context, token
# ids outside the vocabulary. No schema states those limits, so this check cannot hold for an LLM API.
CANNOT_HOLD = ("positive_data_acceptance",)


def fuzz(url: str, model: str, *, examples: int, seed: int = 0, exclude: tuple[str, ...] = CANNOT_HOLD,
         timeout: float = 900) -> int:
    """Every check but `exclude` (no 5xx, responses and status codes as documented, schema-invalid
    input refused) on every operation; fails with Schemathesis's report. Returns the cases run."""
    assert SCHEMATHESIS.exists(), "Schemathesis's environment is missing: run scripts/setup.sh"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "INFERKILN_FUZZ_MODEL": model,
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(SCHEMATHESIS), "run", f"{url}/openapi.json", "--max-examples", str(examples),
                           "--seed", str(seed), "--exclude-checks", ",".join(exclude), "--request-timeout", "120",
                           "--max-failures", "5", "--no-color"],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
    cases = re.search(r"(\d+) generated", done.stdout)
    return int(cases.group(1)) if cases else 0
