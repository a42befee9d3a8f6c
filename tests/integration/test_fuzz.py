"""Schemathesis against the torch runtime: no generated request gets a 5xx or an undocumented
answer, none leaves a traceback in the log, and the engine serves on afterwards.
(The vLLM-backed runtime is fuzzed in test_vllm_backend.py, beside its image.)"""

from __future__ import annotations

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
    assert " 500" not in text.replace("max_model_len=512", "")  # the access log's status column
    assert metric(samples, "request_failure_total", reason="error") == 0
