"""vLLM's HTTP metrics (prometheus-fastapi-instrumentator's), recorded by the contract after each
request, equal what the instrumentator's own middleware records on the request's path, as in vLLM's
own server. A FastAPI app with the real middleware stands in for vLLM's (its routes, CORS above the
middleware as vLLM adds it); tests/integration/test_vllm_backend.py counts the real one's."""

import asyncio
import json
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware

from service.admission import Admission
from service.after_requests import after_requests
from service.api.passthrough import Passthrough
from service.engine.base import EngineStats
from service.engine.vllm_http_metrics import unlinked
from service.metrics import ServiceMetrics

EXCLUDED = ["/metrics", "/health", "/load", "/ping", "/version", "/server_info"]  # vLLM's
HTTP = ("http_requests_total", "http_request_size_bytes_count", "http_request_size_bytes_sum",
        "http_response_size_bytes_count", "http_response_size_bytes_sum", "http_request_duration_seconds_count",
        "http_request_duration_highr_seconds_count")


def vllm_like(registry: CollectorRegistry, **options) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body.get("max_tokens", 1) < 0:
            return JSONResponse({"error": {"message": "max_tokens must be at least 0"}}, status_code=400)
        if body.get("stream"):
            return StreamingResponse(_events(body["max_tokens"]), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "hi " * body["max_tokens"], "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 2, "completion_tokens": body["max_tokens"]}})

    @app.post("/v1/chat/completions")
    async def chat():
        raise RuntimeError("a bug in the engine's app")

    Instrumentator(excluded_handlers=EXCLUDED, registry=registry, **options).add().instrument(app)
    app.add_middleware(CORSMiddleware, allow_origins=["*"])
    return app


async def _events(n: int):
    for i in range(n):
        reason = json.dumps("length" if i == n - 1 else None)
        yield f'data: {{"choices":[{{"index":0,"text":"hi","finish_reason":{reason}}}]}}\n\n'
    yield f'data: {{"choices":[],"usage":{{"prompt_tokens":2,"completion_tokens":{n}}}}}\n\n'
    yield "data: [DONE]\n\n"


REQUESTS = [("/v1/completions", {"max_tokens": 3}), ("/v1/completions", {"max_tokens": 5, "stream": True}),
            ("/v1/completions", {"max_tokens": -1}), ("/v1/completions", {"max_tokens": 7}),
            ("/v1/chat/completions", {"max_tokens": 2})]


def samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect()
            for s in family.samples if s.name in HTTP}


def through_the_contract(registry: CollectorRegistry) -> None:
    app = vllm_like(registry)
    chain = app.build_middleware_stack().app  # below Starlette's outermost layer, where vLLM's --middleware sits
    engine = SimpleNamespace(root_app=app)
    engine.app, engine.http_metrics = unlinked(chain)
    assert engine.http_metrics is not None and not _holds_instrumentator(engine.app)
    stats = EngineStats(running=0, waiting=0, max_num_seqs=4, kv_cache_usage=0.0)
    rt = SimpleNamespace(admission=Admission(4, 4, 8), metrics=ServiceMetrics("m", 512, lambda: stats), engine=engine)

    async def send(message):
        pass

    async def receive():
        return {"type": "http.disconnect"}

    for path, body in REQUESTS:
        data = json.dumps(body).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 8000), "state": {"request_id": "req-1"}}
        rt.admission.enter(bounded=False)
        try:
            asyncio.run(Passthrough(rt, data, generates=True, keep_usage=True)(scope, receive, send))
        except RuntimeError:
            assert path == "/v1/chat/completions"
    after_requests.flush()


def served_directly(registry: CollectorRegistry) -> None:
    transport = httpx.ASGITransport(app=vllm_like(registry), raise_app_exceptions=False)

    async def run():
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            for path, body in REQUESTS:
                await client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    asyncio.run(run())


def _holds_instrumentator(app) -> bool:
    while app is not None:
        if isinstance(app, PrometheusInstrumentatorMiddleware):
            return True
        app = getattr(app, "app", None)
    return False


def test_the_contract_records_vllms_http_metrics_as_its_middleware_does():
    own, contract = CollectorRegistry(), CollectorRegistry()
    served_directly(own)
    through_the_contract(contract)
    expected = samples(own)
    assert expected[("http_requests_total", (("handler", "/v1/completions"), ("method", "POST"), ("status", "2xx")))] == 3
    assert expected[("http_requests_total", (("handler", "/v1/chat/completions"), ("method", "POST"),
                                             ("status", "5xx")))] == 1
    assert samples(contract) == expected


def test_a_middleware_that_must_record_on_the_path_stays_there():
    app = vllm_like(CollectorRegistry(), body_handlers=[".*"])  # it reads every response's body
    chain = app.build_middleware_stack()
    assert unlinked(chain) == (chain, None) and _holds_instrumentator(chain)
    plain = FastAPI().build_middleware_stack()
    assert unlinked(plain) == (plain, None)
