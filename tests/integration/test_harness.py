"""The harness against the real service (everything passes) and against deliberately wrong servers.

The wrong servers are a test double: a proxy in front of the real service that breaks one promise
(drops `[DONE]`, miscounts usage, returns the tokens reversed or ignores `response_format`), faults that a correct server
cannot be made to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from typer.testing import CliRunner

from factory.cli import app as cli
from factory.spec import AccuracyTask
from factory.spec import Tests as SpecTests
from factory.verify.accuracy import served_precision
from factory.verify.conformance import run_conformance
from factory.verify.harness import HarnessConfig, load_pairs, run_harness
from factory.verify.lm_eval_tasks import BUNDLED_TASKS
from factory.verify.load import LoadSettings, run_load, summarize
from service.launcher import ServerProcess
from tests.conftest import app_in_thread

QUICK = HarnessConfig(min_exact_match=0.9, concurrency=[1, 4], requests_per_level=8, output_tokens=16,
                      slo={"ttft_p99_ms": 5000}, tasks=[AccuracyTask(name="inferkiln_tiny_lines", min=0.9, limit=16)])
LINES = BUNDLED_TASKS / "inferkiln_tiny_lines.jsonl"  # the bundled task's data is also an exact-match dataset


def broken_proxy(upstream: str, mode: str) -> FastAPI:
    app = FastAPI()
    http = httpx.AsyncClient(base_url=upstream, timeout=120)

    def corrupt(body: dict) -> dict:
        if mode == "miscount" and body.get("usage"):
            body["usage"]["completion_tokens"] += 1
            body["usage"]["total_tokens"] += 1
        if mode == "reverse":
            for choice in body.get("choices", []):
                if choice.get("text"):
                    choice["text"] = choice["text"][::-1]
                if (choice.get("logprobs") or {}).get("tokens"):
                    choice["logprobs"]["tokens"] = choice["logprobs"]["tokens"][::-1]
        return body

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request):
        body = await request.body()
        if mode == "ignore_format" and b"response_format" in body:  # a server that drops the constraint
            body = json.dumps({k: v for k, v in json.loads(body).items() if k != "response_format"}).encode()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        streaming = b'"stream": true' in body or b'"stream":true' in body
        if not streaming:
            reply = await http.request(request.method, f"/{path}", content=body, headers=headers)
            if reply.headers.get("content-type", "").startswith("application/json"):
                return JSONResponse(corrupt(reply.json()), status_code=reply.status_code)
            return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

        async def events():
            async with http.stream("POST", f"/{path}", content=body, headers=headers) as reply:
                async for line in reply.aiter_lines():
                    if not line:
                        continue
                    if line == "data: [DONE]":
                        if mode != "no_done":
                            yield "data: [DONE]\n\n"
                        continue
                    yield f"data: {json.dumps(corrupt(json.loads(line[6:])))}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture
def proxy(server):
    with contextlib.ExitStack() as started:
        yield lambda mode: started.enter_context(app_in_thread(broken_proxy(server.url, mode)))


def failed_ids(report) -> set[str]:
    return {gate.id for gate in report.failed_gates()}


def test_real_service_passes_every_gate_and_the_report_is_complete(server, tiny_model_dir, tmp_path, aiperf_read):
    result = run_harness(server.url, "tiny-llama", QUICK, tmp_path, pairs=load_pairs(LINES), model_dir=tiny_model_dir,
                         progress=lambda _: None)
    assert result.passed, failed_ids(result)
    assert result.exact_match == 1.0 and result.accuracy == {"inferkiln_tiny_lines": 1.0} and not result.skipped
    assert set(result.output_tokens_per_s) == {"1", "4"} and result.profile is not None
    details = json.loads((tmp_path / "summary.json").read_text())
    assert details["passed"] and details["accuracy"]["parity"]["max_logprob_diff"] < 1e-3
    assert details["accuracy"]["parity"]["tolerance"] == 1e-3  # fp32's: the served profile's precision
    for name in ("summary.md", "summary.json", "index.html", "sweep_summary.json", "throughput_vs_concurrency.png",
                 "ttft_vs_concurrency.png", "itl_vs_concurrency.png", "pareto_throughput_vs_interactivity.png", "ttft_distribution.png", "itl_distribution.png",
                 "goodput_vs_slo.png"):
        assert (tmp_path / name).is_file(), name
    sweep = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [(row["concurrency"], row["run_dir"]) for row in sweep["levels"]] == [(1, "concurrency_1"), (4, "concurrency_4")]
    read = aiperf_read(tmp_path / "concurrency_1", tmp_path / "concurrency_4")
    level = read["concurrency_4"]
    assert (level["model"], level["concurrency"], level["records"], level["loaded_rows"]) == ("tiny-llama", 4, 8, 8)
    for metric in ("time_to_first_token", "inter_token_latency", "inter_chunk_latency", "request_latency"):
        assert {"unit", "avg", "min", "max", "p1", "p50", "p90", "p99", "std", "count"} <= set(level["metrics"][metric])
    assert level["metrics"]["output_sequence_length"]["avg"] == 16 and level["metrics"]["error_request_count"]["avg"] == 0
    assert level["metrics"]["output_token_throughput"]["avg"] == pytest.approx(sweep["levels"][1]["output_token_throughput"])
    record = json.loads((tmp_path / "concurrency_4" / "profile_export.jsonl").read_text().splitlines()[0])["metrics"]
    expected_itl = (record["request_latency"]["value"] - record["time_to_first_token"]["value"]) / 15
    assert record["inter_token_latency"]["value"] == pytest.approx(expected_itl)
    assert (tmp_path / "index.html").read_text().count("data:image/png;base64,") == 7
    assert "| 4 |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize("mode,expected", [
    ("no_done", {"chat.stream.framing", "completions.stream.usage"}),
    ("miscount", {"usage.exact_length", "logprobs.chat", "metrics.generation_tokens_total"}),
    ("reverse", {"accuracy.exact_match", "accuracy.task.inferkiln_tiny_lines", "accuracy.parity", "stop.strings"}),
    ("ignore_format", {"structured.json_schema"}),
])
def test_wrong_servers_fail_the_right_checks(proxy, tiny_model_dir, tmp_path, mode, expected):
    url = proxy(mode)
    result = run_harness(url, "tiny-llama", QUICK, tmp_path, pairs=load_pairs(LINES)[:16], model_dir=tiny_model_dir,
                         progress=lambda _: None)
    assert not result.passed
    assert expected <= failed_ids(result), failed_ids(result)
    assert "models.list" not in failed_ids(result) and "health.live" not in failed_ids(result)


def test_test_command_exits_1_on_a_failed_gate(proxy, tmp_path):
    url = proxy("no_done")
    result = CliRunner().invoke(cli, ["test", "--url", url, "--model", "tiny-llama", "--output", str(tmp_path)])
    assert result.exit_code == 1 and "gates passed; failed: " in result.output
    assert "skipped: accuracy.exact_match, accuracy.tasks" in result.output  # no dataset, no tasks: not failed
    assert (tmp_path / "summary.md").read_text().startswith("# Test report: tiny-llama")
    sweep = json.loads((tmp_path / "sweep_summary.json").read_text())["levels"]
    defaults = SpecTests().perf  # `test --url` measures as `test SPEC` does with a spec's defaults
    assert [row["concurrency"] for row in sweep] == defaults.concurrency
    level = json.loads((tmp_path / "concurrency_8" / "profile_export_aiperf.json").read_text())
    assert level["input_config"]["phases"][-1]["requests"] == defaults.requests_per_level


def test_the_parity_tolerance_is_the_served_profiles(server):
    assert served_precision(server.url) == "fp32"  # the tiny model's CPU profile, named by /v1/metadata
    assert served_precision("http://127.0.0.1:9") is None  # nothing listening: no NIM metadata


def test_test_command_needs_a_spec_or_a_url():
    result = CliRunner().invoke(cli, ["test"])
    assert result.exit_code == 2


def test_poisson_rate_mode(server):
    settings = LoadSettings(model="tiny-llama", requests=12, rate=50.0, output_tokens=8, warmup=0)
    records, wall = asyncio.run(run_load(server.url, settings))
    summary = summarize(records, wall, {})
    assert summary["request_count"]["avg"] == 12 and summary["error_request_count"]["avg"] == 0
    assert all(r.output_tokens == 8 for r in records)


def test_failed_requests_are_recorded_with_their_status(server):
    """A 404 (an unknown model) and a refused connection are counted as errors, not raised."""
    records, wall = asyncio.run(run_load(server.url, LoadSettings(model="no-such-model", requests=3, warmup=0)))
    assert [r.code for r in records] == [404] * 3 and all("HTTP 404" in r.error for r in records)
    assert summarize(records, wall, {})["error_request_count"]["avg"] == 3
    records, _ = asyncio.run(run_load("http://127.0.0.1:9", LoadSettings(model="tiny-llama", requests=2, warmup=0)))
    assert all(r.code is None and r.error.startswith("ClientConnectorError") for r in records)


def test_the_tool_call_gate_needs_a_server_that_parses_calls(server, tiny_model_dir, tmp_path):
    """The shared server runs without NIM_TOOL_CALL_PARSER: the gate fails on its 400, and passes
    once the same weights are served with the Hermes parser."""
    [gate] = run_conformance(server.url, "tiny-llama", ("tools",))
    assert not gate.passed and "400" in gate.detail, gate
    with ServerProcess(["--model", str(tiny_model_dir), "--tool-call-parser", "hermes"],
                       log_path=tmp_path / "service.log") as tools_server:
        gates = run_conformance(tools_server.url, "tiny-llama", ("openai", "tools"))
    assert all(gate.passed for gate in gates), [gate for gate in gates if not gate.passed]
    assert {"tools.call", "structured.json_schema"} <= {gate.id for gate in gates}
