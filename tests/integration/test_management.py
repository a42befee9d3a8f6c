"""NIM management routes and Prometheus metrics that agree with what clients were told."""

from __future__ import annotations

import httpx
import pytest
import yaml
from openai import OpenAI

from service.launcher import ServerProcess
from tests.conftest import metric, scrape


def test_health_live_and_ready(server):
    live = httpx.get(server.url + "/v1/health/live")
    assert live.status_code == 200
    assert live.json() == {"object": "health.response", "message": "Service is live.", "status": "live"}
    ready = httpx.get(server.url + "/v1/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_metadata_names_model_and_profile(server, tiny_model_dir):
    data = httpx.get(server.url + "/v1/metadata").json()
    assert set(data) >= {"version", "modelInfo", "selectedModelProfileId", "assetInfo", "licenseInfo"}
    assert data["modelInfo"] == [{"shortName": "tiny-llama", "modelUrl": str(tiny_model_dir)}]
    assert len(data["selectedModelProfileId"]) == 64
    assert "model.safetensors" in data["assetInfo"] and "config.json" in data["assetInfo"]


def test_version(server):
    data = httpx.get(server.url + "/v1/version").json()
    assert set(data) == {"release", "api"} and data["release"]


def test_manifest_is_the_default_manifest_as_yaml(server):
    text = httpx.get(server.url + "/v1/manifest").json()["manifest_file"]
    manifest = yaml.safe_load(text)
    assert manifest["schema_version"] == "1"
    assert manifest["model"]["name"] == "tiny-llama"
    names = [p["name"] for p in manifest["profiles"]]
    assert names == ["torch-fp32-tp1-cpu-latency", "torch-bf16-tp1-any-latency"]
    selected = httpx.get(server.url + "/v1/metadata").json()["selectedModelProfileId"]
    assert selected == manifest["profiles"][0]["id"]


def test_openapi_document_lists_every_route(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/health/live", "/v1/health/ready",
                  "/v1/metadata", "/v1/version", "/v1/manifest", "/v1/metrics"):
        assert route in paths
    assert httpx.get(server.url + "/docs").status_code == 200


def test_metrics_have_nim_names_and_vllm_buckets(server):
    for path in ("/metrics", "/v1/metrics"):
        response = httpx.get(server.url + path)
        assert response.headers["content-type"].startswith("text/plain") and "num_requests_running" in response.text
    samples = scrape(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "num_request_max", "gpu_cache_usage_perc"):
        assert ("%s" % name, (("model_name", "tiny-llama"),)) in samples
    assert metric(samples, "num_request_max") == 32
    buckets = sorted(float(dict(lbls)["le"]) for (n, lbls) in samples if n == "time_to_first_token_seconds_bucket")
    assert buckets[:3] == [0.001, 0.005, 0.01] and buckets[-2] == 2560.0
    token_buckets = sorted(float(dict(lbls)["le"]) for (n, lbls) in samples if n == "request_prompt_tokens_bucket")
    assert token_buckets[:-1] == [1, 2, 5, 10, 20, 50, 100, 200, 500]


@pytest.fixture
def fresh_server(tiny_model_dir, tmp_path):
    with ServerProcess(["--model", str(tiny_model_dir)], log_path=tmp_path / "service.log") as proc:
        yield proc


def test_counters_equal_the_usage_clients_received(fresh_server):
    client = OpenAI(base_url=f"{fresh_server.url}/v1", api_key="unused", max_retries=0)
    usages, engine_requests = [], 0
    for i in range(3):
        usages.append(client.completions.create(model="tiny-llama", prompt=f"Owls hunt {i}", max_tokens=20).usage)
        engine_requests += 1
    usages.append(client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Tea"}],
                                                 max_tokens=30, n=3).usage)
    engine_requests += 1
    stream = client.completions.create(model="tiny-llama", prompt="Frost forms", max_tokens=25, stream=True,
                                       stream_options={"include_usage": True})
    usages.append([c for c in stream][-1].usage)
    engine_requests += 1
    usages.append(client.completions.create(model="tiny-llama", prompt=["Maps use", "Whales"], max_tokens=9).usage)
    engine_requests += 2
    system = "You answer in one short sentence about rivers, stones and the light of the north. " * 3
    for question in ("Why?", "How?"):  # the second finds the shared prefix's blocks in the cache
        usages.append(client.completions.create(model="tiny-llama", prompt=system + question, max_tokens=4).usage)
        engine_requests += 1

    samples = scrape(fresh_server.url)
    prompt_total = sum(u.prompt_tokens for u in usages)
    completion_total = sum(u.completion_tokens for u in usages)
    assert metric(samples, "prompt_tokens_total") == prompt_total
    assert metric(samples, "generation_tokens_total") == completion_total
    assert metric(samples, "request_success_total") == engine_requests
    assert metric(samples, "request_failure_total") == 0
    assert metric(samples, "e2e_request_latency_seconds_count") == engine_requests
    assert metric(samples, "time_to_first_token_seconds_count") == engine_requests
    assert metric(samples, "request_prompt_tokens_sum") == prompt_total
    assert metric(samples, "request_generation_tokens_sum") == completion_total
    assert metric(samples, "request_generation_tokens_count") == engine_requests
    assert metric(samples, "num_requests_running") == 0
    assert metric(samples, "gpu_cache_usage_perc") == 0
    # one lookup per prompt (n choices share it), counted in tokens as vLLM counts them
    assert metric(samples, "prefix_cache_queries_total", model_name="tiny-llama") == prompt_total
    hits = metric(samples, "prefix_cache_hits_total", model_name="tiny-llama")
    assert hits % 16 == 0 and hits >= 16 * (usages[-2].prompt_tokens // 16 - 1)
