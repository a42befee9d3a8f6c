"""No request can take the torch engine down; a real engine fault takes the whole process down.

The hostile requests go to the shared real server. The engine fault is injected (a test double:
no request can make a working engine's forward pass fail, which is what these tests show).
"""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from service.launcher import free_port, wait_until_ready

HOSTILE_SAMPLING = [{"top_p": 5e-324}, {"temperature": 1e-300}, {"temperature": 1e-300, "top_p": 5e-324},
                    {"temperature": 2.0, "top_p": 1e-45, "top_k": 1}, {"temperature": 1e-5},
                    {"logit_bias": {str(i): -100 for i in range(64)}, "temperature": 0.01}]


@pytest.mark.parametrize("stream", [False, True])
def test_hostile_sampling_values_are_served_and_the_engine_survives(server, stream):
    """Each of these once took a 503 and counted as an engine failure: three killed the engine."""
    for extra in HOSTILE_SAMPLING * 2:
        body = {"model": "tiny-llama", "prompt": "The owl", "max_tokens": 4, "stream": stream, **extra}
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 200, (extra, response.text)
        if stream:
            assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text, extra
        else:
            assert response.json()["usage"]["completion_tokens"] == 4, extra
    assert httpx.get(server.url + "/v1/health/ready").status_code == 200


def _broken_forward(*args, **kwargs):
    raise RuntimeError("injected fault")


def test_an_engine_fault_turns_ready_and_live_503_and_asks_the_process_to_exit(tiny_model_dir):
    from service.app import build_app
    from service.runtime import build_runtime
    from service.settings import load_settings

    runtime = build_runtime(load_settings({"model_path": str(tiny_model_dir)}, {}))
    fatal: list[str] = []
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 3}
    with TestClient(build_app(runtime, on_fatal=fatal.append)) as http:
        deadline = time.monotonic() + 60
        while http.get("/v1/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.05)
        runtime.engine.runner.forward = _broken_forward
        for _ in range(3):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 503, response.text
            assert "injected" not in response.text, "internal exception text reaches the client"
        deadline = time.monotonic() + 10
        while not fatal:
            assert time.monotonic() < deadline, "the engine's death never reached the runtime"
            time.sleep(0.01)
        ready, live = http.get("/v1/health/ready"), http.get("/v1/health/live")
        assert ready.status_code == 503 and "injected fault" in ready.json()["message"]
        assert live.status_code == 503 and live.json()["status"] == "not_live"
        assert http.post("/v1/completions", json=body).status_code == 503
    assert len(fatal) == 1 and "injected fault" in fatal[0]


FAULTY_SERVICE = """
import sys
from service.engine.llama_runner import LlamaRunner

def broken(*args, **kwargs):
    raise RuntimeError("injected fault")

LlamaRunner.forward = broken
from service.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_engine_fault_exits_the_process_non_zero(tiny_model_dir, tmp_path):
    """What Kubernetes needs to restart the pod: the process ends, with a non-zero status."""
    port = free_port()
    log = (tmp_path / "service.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-c", FAULTY_SERVICE, "serve", "--model", str(tiny_model_dir),
                             "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_until_ready(url, lambda: proc.poll() is not None and "exited", 120) is None, (tmp_path / "service.log").read_text()
        for _ in range(3):
            httpx.post(url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 3})
        assert proc.wait(30) == 1
    finally:
        proc.kill()
    assert "engine died" in (tmp_path / "service.log").read_text()
