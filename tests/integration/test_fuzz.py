"""Schemathesis against the torch runtime: no generated request gets a 5xx or an undocumented
answer, none leaves a traceback in the log, and the engine serves on afterwards.
(The vLLM-backed runtime is fuzzed in test_vllm_backend.py, beside its image.)"""

from __future__ import annotations

import re

import httpx

from service.launcher import ServerProcess
from tests.conftest import metric, scrape
from tests.fuzzing import fuzz


def test_the_torch_runtime_survives_fuzzing(tiny_model_dir, tmp_path):
    log = tmp_path / "service.log"
    with ServerProcess(["--model", str(tiny_model_dir)], log_path=log) as server:
        cases = fuzz(server.url, "tiny-llama", examples=150)
        samples = scrape(server.url)
        assert httpx.get(server.url + "/v1/health/ready").status_code == 200
        served = metric(samples, "request_success_total")
    text = log.read_text()
    assert cases > 500 and served > 20, f"{cases} cases, {served} reached the engine: the fuzzing stopped at the door"
    assert "Traceback" not in text, text[text.index("Traceback") - 500:][:4000]
    # The access log's status column; readiness is 503 by contract while the weights load.
    server_errors = [line for line in text.splitlines()
                     if "service.access" in line and "/v1/health/ready" not in line and re.search(r" 5\d\d$", line)]
    assert not server_errors, server_errors[:5]
    assert metric(samples, "request_failure_total", reason="error") == 0
