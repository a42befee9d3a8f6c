"""Thin routes: OpenAI inference, NIM management (health, metadata, manifest), metrics."""

from __future__ import annotations

import asyncio
import secrets
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from service.api.errors import ServingError
from service.api.serving import SSEStream
from service.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                  CompletionResponse, ErrorResponse, HealthResponse, ModelCard, ModelList)
from service.runtime import Runtime

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def require_api_key(request: Request) -> None:
    """With NIM_API_KEY set, inference routes need `Authorization: Bearer <key>`. The dependencies are
    async because they never block: FastAPI runs a plain `def` one in its thread pool, two thread
    hops on every inference request."""
    key = runtime(request).settings.api_key
    if not key:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
        raise ServingError(401, "missing or invalid API key: send `Authorization: Bearer <NIM_API_KEY>`",
                           headers={"WWW-Authenticate": "Bearer"})


async def refuse_while_draining(request: Request) -> None:
    if runtime(request).draining:
        raise ServingError(503, "the server is shutting down", headers={"Retry-After": "1"})


INFERENCE_DEPENDENCIES = [Depends(require_api_key), Depends(refuse_while_draining)]
inference = APIRouter(dependencies=INFERENCE_DEPENDENCIES, responses=ERRORS)  # the in-process engine's routes
models_router = APIRouter(dependencies=INFERENCE_DEPENDENCIES, responses=ERRORS)
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
    """Turn a serving result into a response, counting the request in flight until its last byte."""
    rt = runtime(request)
    rt.in_flight += 1
    try:
        result = await cancel_on_disconnect(request, work)
    except BaseException:
        rt.in_flight -= 1
        raise
    if isinstance(result, SSEStream):
        return StreamingResponse(_counted(rt, request, result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    rt.in_flight -= 1
    if isinstance(result, Response):
        return result
    request.state.usage = result.usage
    return JSONResponse(result.model_dump())


async def _counted(rt: Runtime, request: Request, stream: SSEStream):
    try:
        async for chunk in stream:
            yield chunk
    finally:
        rt.in_flight -= 1
        request.state.usage = stream.usage
        await stream.aclose()


@inference.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await respond(request, runtime(request).serving.chat(body, request.state.request_id))


@inference.post("/v1/completions", response_model=CompletionResponse)
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
    app.include_router(management)
    app.include_router(models_router)
    if runtime_.serving is not None:
        app.include_router(inference)
    else:
        from service.api.proxy import attach_proxy

        proxied = APIRouter(dependencies=INFERENCE_DEPENDENCIES, responses=ERRORS)
        attach_proxy(proxied)
        app.include_router(proxied)
