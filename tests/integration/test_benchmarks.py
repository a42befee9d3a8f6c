"""The benchmark that needs no server, run as a user runs it (the others start Docker images, vLLM's
CPU build or AIPerf, and are run by hand): a change to the contract's layers or to logging that
breaks it fails here, not at the next measurement."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_passthrough_overhead_benchmark_writes_its_result(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.passthrough_overhead", "--events", "200",
                          "--requests", "50", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "passthrough_overhead.json").read_text())
    for part in ("per_event_us", "per_request_us"):  # the contract does more than the app alone
        assert result[part]["through_the_contract"] > result[part]["engine_app_alone"] > 0, result
    assert result["machine"]["cpu_count"] >= 1 and (result["events"], result["requests"]) == (200, 50)
