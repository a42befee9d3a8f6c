"""Thin routes: OpenAI inference, NIM management (health, metadata, manifest), metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from service.admission import Admission, ShuttingDown
from service.api.serving import SSEStream
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from service.api.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                  CompletionRequest, CompletionResponse, ErrorResponse, HealthResponse, ModelCard,
                                  ModelList)
from service.runtime import Runtime

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def refuse_while_draining(request: Request) -> None:
    """Async because it never blocks: FastAPI runs a plain `def` dependency in its thread pool."""
    if runtime(request).admission.draining:
        raise ShuttingDown("the server is shutting down")


# NIM_API_KEY is checked before any of these routes reads its body (ApiKeyMiddleware).
inference = APIRouter(responses=ERRORS)  # the in-process engine's routes
models_router = APIRouter(dependencies=[Depends(refuse_while_draining)], responses=ERRORS)
management = APIRouter()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work):
    """Run `work`, cancelling it (and so aborting its generation) if the client goes away first."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        return Response(status_code=499)
    finally:
        watcher.cancel()


async def respond(request: Request, work) -> Response:
    """Turn a serving result into a response, admitted and counted in flight until its last byte."""
    admission = runtime(request).admission
    try:
        admission.enter()
    except Exception:
        work.close()  # never started
        raise
    try:
        result = await cancel_on_disconnect(request, work)
    except BaseException:
        admission.leave()
        raise
    if isinstance(result, SSEStream):
        return StreamingResponse(_counted(admission, request, result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    admission.leave()
    if isinstance(result, Response):
        return result
    request.state.usage = result.usage
    return JSONResponse(result.model_dump())


async def _counted(admission: Admission, request: Request, stream: SSEStream):
    try:
        async for chunk in stream:
            yield chunk
    finally:
        admission.leave()
        request.state.usage = stream.usage
        await stream.aclose()


def _streamed(model: type, chunk: type) -> dict:
    """The OpenAPI answer of a route that streams with `stream: true`: JSON, or Server-Sent Events.
    For an event stream, OpenAPI 3.1's schema describes each event: its `data` is a chunk (or the
    error shape, once a stream fails) as JSON text, or the final `[DONE]`."""
    def ref(name: str) -> dict:
        return {"$ref": f"#/components/schemas/{name}"}

    json_chunk = {"type": "string", "contentMediaType": "application/json",
                  "contentSchema": {"anyOf": [ref(chunk.__name__), ref(ErrorResponse.__name__)]}}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_chunk]}, "event": {"type": "string"}}}
    return {200: {"content": {"application/json": {"schema": ref(model.__name__)},
                              "text/event-stream": {"schema": event}}}}


STREAM_CHUNKS = (ChatCompletionChunk, CompletionResponse, ErrorResponse)


def openapi_with_stream_chunks(app: FastAPI) -> dict:
    """FastAPI's document, with the chunk models the event streams name among its components."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, definitions = models_json_schema([(m, "serialization") for m in STREAM_CHUNKS],
                                            ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in definitions.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        app.openapi_schema = document
    return app.openapi_schema


@inference.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_streamed(ChatCompletionResponse, ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await respond(request, runtime(request).serving.chat(body, request.state.request_id))


@inference.post("/v1/completions", response_model=CompletionResponse, responses=_streamed(CompletionResponse, CompletionResponse))
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await respond(request, runtime(request).serving.completion(body, request.state.request_id))


@models_router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    rt = runtime(request)
    return ModelList(data=[ModelCard(id=rt.served_model_name, created=rt.started, root=rt.model_source,
                                     max_model_len=rt.engine.max_model_len)])


@management.get("/v1/health/live", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def live(request: Request) -> Response:
    """200 while the process serves; 503 once the engine has failed for good (the process is exiting)."""
    rt = runtime(request)
    if rt.failure:
        return JSONResponse(HealthResponse(message=rt.not_ready_reason(), status="not_live").model_dump(), status_code=503)
    return JSONResponse(HealthResponse(message="Service is live.", status="live").model_dump())


@management.get("/v1/health/ready", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
async def ready(request: Request) -> Response:
    rt = runtime(request)
    if rt.ready:
        return JSONResponse(HealthResponse(message="Service is ready.", status="ready").model_dump())
    return JSONResponse(HealthResponse(message=rt.not_ready_reason(), status="not_ready").model_dump(), status_code=503)


@management.get("/v1/metadata")
async def metadata(request: Request) -> dict:
    return runtime(request).metadata()


@management.get("/v1/version")
async def version(request: Request) -> dict:
    return runtime(request).version()


@management.get("/v1/manifest")
async def manifest(request: Request) -> dict:
    return {"manifest_file": runtime(request).manifest.to_yaml()}


@management.get("/v1/metrics", response_class=Response)
@management.get("/metrics", response_class=Response, include_in_schema=False)
async def metrics(request: Request) -> Response:
    rt = runtime(request)
    engine_own = await rt.engine.scrape()  # refreshes the gauges first
    return Response(rt.metrics.exposition() + engine_own, media_type=PROMETHEUS_TEXT)


def attach_routers(app: FastAPI, runtime_: Runtime) -> None:
    """Management routes always; inference routes served in-process, or proxied to an engine process."""
    app.openapi = lambda: openapi_with_stream_chunks(app)
    app.include_router(management)
    app.include_router(models_router)
    if runtime_.serving is not None:
        app.include_router(inference)
    else:
        from service.api.proxy import attach_proxy

        proxied = APIRouter(responses=ERRORS)
        attach_proxy(proxied)
        app.include_router(proxied)
