"""Start-up, readiness, auth, queueing, disconnects, logs and SIGTERM, each on a server of its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from service.launcher import ServerProcess
from tests.conftest import metric, scrape

LONG = {"model": "tiny-llama", "prompt": "A", "max_tokens": 480, "ignore_eos": True}


def wait_for(condition, timeout: float = 10.0, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def run_service(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


# -- start-up -------------------------------------------------------------------------------
@pytest.mark.parametrize("args,env,named", [
    (["--port", "abc"], {}, "--port"),
    ([], {"NIM_LOG_LEVEL": "LOUD"}, "NIM_LOG_LEVEL"),
    ([], {"NIM_SERVER_PORT": "99999"}, "NIM_SERVER_PORT"),
    ([], {"NIM_MAX_NUM_SEQS": "0"}, "NIM_MAX_NUM_SEQS"),
    ([], {"NIM_JSONL_LOGGING": "maybe"}, "NIM_JSONL_LOGGING"),
])
def test_bad_setting_fails_with_one_line(args, env, named, tiny_model_dir):
    result = run_service("serve", "--model", str(tiny_model_dir), *args, env=env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr


def test_cli_flag_beats_environment(tiny_model_dir, tmp_path):
    with ServerProcess(["--model", str(tiny_model_dir), "--served-model-name", "from-flag"],
                       env={"NIM_SERVED_MODEL_NAME": "from-env"}, log_path=tmp_path / "log") as server:
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "from-flag"


def test_environment_beats_profile(tiny_model_dir, tmp_path):
    with ServerProcess(["--model", str(tiny_model_dir)], env={"NIM_MAX_NUM_SEQS": "5"},
                       log_path=tmp_path / "log") as server:
        assert metric(scrape(server.url), "num_request_max") == 5


def test_missing_model_fails_clearly(tmp_path):
    result = run_service("serve", "--model", str(tmp_path / "nowhere"), "--manifest", str(tmp_path / "none.yaml"))
    assert result.returncode == 1 and "no model directory" in result.stderr


def test_readiness_is_503_until_the_engine_loads(tiny_model_dir):
    from service.app import build_app
    from service.runtime import build_runtime
    from service.settings import load_settings

    runtime = build_runtime(load_settings({"model_path": str(tiny_model_dir)}, {}))
    # A test double for a slow weight load (large models take minutes): loading waits for the event.
    weights_arrived = threading.Event()
    real_load = runtime.engine._load

    def slow_load() -> None:
        weights_arrived.wait(30)
        real_load()

    runtime.engine._load = slow_load
    with TestClient(build_app(runtime)) as http:  # the lifespan starts loading in the background
        first = http.get("/v1/health/ready")
        assert first.status_code == 503 and first.json()["status"] == "not_ready"
        assert http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x"}).status_code == 503
        assert http.get("/v1/health/live").status_code == 200
        weights_arrived.set()
        wait_for(lambda: http.get("/v1/health/ready").status_code == 200)
        assert http.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x"}).status_code == 200


# -- auth, logs, secrets ----------------------------------------------------------------------
def test_api_key_guards_inference_and_never_leaks(tiny_model_dir, tmp_path):
    secret = "sk-test-very-secret-4711"
    log = tmp_path / "service.log"
    env = {"NIM_API_KEY": secret, "NIM_JSONL_LOGGING": "1"}
    with ServerProcess(["--model", str(tiny_model_dir)], env=env, log_path=log) as server:
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        missing = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        unread = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', headers={"authorization": "Bearer no"})
        assert unread.status_code == 401, "the key is checked before the body is parsed"
        assert unread.headers["www-authenticate"] == "Bearer" and unread.headers["x-request-id"]
        good = OpenAI(base_url=f"{server.url}/v1", api_key=secret, max_retries=0)
        reply = good.completions.create(model="tiny-llama", prompt="Owls", max_tokens=5,
                                        extra_headers={"X-Request-Id": "logged-request"})
        assert httpx.get(server.url + "/v1/health/ready").status_code == 200
        metadata = httpx.get(server.url + "/v1/metadata").text + httpx.get(server.url + "/v1/manifest").text
    text = log.read_text()
    assert secret not in text and secret not in metadata
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert len(records) == len(text.strip().splitlines()), "every log line is one JSON object"
    access = [r for r in records if r.get("request_id") == "logged-request"]
    assert access and access[-1]["route"] == "/v1/completions" and access[-1]["status"] == 200
    assert access[-1]["prompt_tokens"] == reply.usage.prompt_tokens
    assert access[-1]["completion_tokens"] == reply.usage.completion_tokens
    assert {"time", "level", "logger", "message", "latency_ms"} <= set(access[-1])


# -- queueing, disconnects, shutdown ----------------------------------------------------------
def test_full_queue_gets_503_with_retry_after(tiny_model_dir, tmp_path):
    """20 long requests at once, one decoding and one waiting allowed: the rest are refused."""
    env = {"NIM_MAX_QUEUE": "1", "NIM_MAX_NUM_SEQS": "1"}
    with ServerProcess(["--model", str(tiny_model_dir)], env=env, log_path=tmp_path / "log") as server:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=LONG) for _ in range(20)))

        responses = asyncio.run(burst())
        refused = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(refused) + len(served) == 20
        assert refused and len(served) >= 2
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "service_unavailable"
                   for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == LONG["max_tokens"] for r in served)
        assert metric(scrape(server.url), "request_success_total") == len(served)


def test_client_disconnect_stops_generation(tiny_model_dir, tmp_path):
    with ServerProcess(["--model", str(tiny_model_dir)], log_path=tmp_path / "log") as server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
                lines = response.iter_lines()
                for _ in range(3):
                    next(lines)
        samples = wait_for(lambda: (s := scrape(server.url)) and metric(s, "request_failure_total", reason="abort") == 1 and s)
        generated = metric(samples, "generation_tokens_total")
        assert 0 < generated < LONG["max_tokens"] / 2, f"{generated} tokens generated after the client left"
        assert metric(samples, "num_requests_running") == 0
        # The engine is free again at once.
        assert httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x",
                                                                 "max_tokens": 2}).status_code == 200


def test_non_streaming_disconnect_stops_generation(tiny_model_dir, tmp_path):
    with ServerProcess(["--model", str(tiny_model_dir)], log_path=tmp_path / "log") as server:
        # The client leaves once the engine runs the request, not after a fixed time: how far a fast
        # engine gets in a fixed time is its speed, not whether the disconnect stops it.
        body = json.dumps({**LONG, "n": 8}).encode()
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: metric(scrape(server.url), "num_requests_running") > 0, interval=0.001)
        samples = wait_for(lambda: (s := scrape(server.url)) and metric(s, "request_failure_total", reason="abort") == 1 and s)
        generated = metric(samples, "generation_tokens_total")
        assert generated < 8 * LONG["max_tokens"] / 2, f"{generated} tokens generated after the client left"
        assert metric(samples, "num_requests_running") == 0


def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_model_dir, tmp_path):
    server = ServerProcess(["--model", str(tiny_model_dir)], log_path=tmp_path / "log")
    with server:
        result: dict = {}

        def long_stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "n": 32, "stream": True},
                              timeout=60) as response:
                result["lines"] = [line for line in response.iter_lines() if line]

        worker = threading.Thread(target=long_stream)
        worker.start()
        wait_for(lambda: metric(scrape(server.url), "num_requests_running") == 1)
        server.proc.send_signal(signal.SIGTERM)
        ready = wait_for(lambda: (r := httpx.get(server.url + "/v1/health/ready")).status_code == 503 and r)
        assert ready.json()["status"] == "not_ready"
        refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny-llama", "prompt": "x"})
        assert refused.status_code == 503
        worker.join(60)
        assert server.proc.wait(60) == 0
    assert result["lines"][-1] == "data: [DONE]"
    finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in result["lines"][:-1]]
    assert finishes.count("length") == 32, "every choice ran to its end"
