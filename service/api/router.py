"""Thin routes: OpenAI inference, NIM management (health, metadata, manifest), metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from service.admission import Admission
from service.after_requests import after_requests
from service.api.context import cancel_on_disconnect, runtime
from service.api.openapi import ERRORS, STREAMED, openapi_document
from service.api.passthrough import documented_routes
from service.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                  CompletionResponse, HealthResponse, ModelCard, ModelList)
from service.api.serving import SSEStream
from service.runtime import Runtime

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def refuse_while_draining(request: Request) -> None:
    """Async because it never blocks: FastAPI runs a plain `def` dependency in its thread pool."""
    runtime(request).admission.check_open()


# NIM_API_KEY is checked before any of these routes reads its body (ApiKeyMiddleware).
inference = APIRouter(responses=ERRORS)  # the in-process engine's routes
models_router = APIRouter(dependencies=[Depends(refuse_while_draining)], responses=ERRORS)
management = APIRouter()


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


@inference.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAMED["/v1/chat/completions"])
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await respond(request, runtime(request).serving.chat(body, request.state.request_id))


@inference.post("/v1/completions", response_model=CompletionResponse, responses=STREAMED["/v1/completions"])
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await respond(request, runtime(request).serving.completion(body, request.state.request_id))


@models_router.get("/v1/models", response_model=ModelList)
async def models(request: Request) -> ModelList:
    rt = runtime(request)
    base = ModelCard(id=rt.served_model_name, created=rt.started, root=rt.model_source,
                     max_model_len=rt.engine.max_model_len)
    adapters = [ModelCard(id=name, created=rt.started, root=str(adapter.path), parent=rt.served_model_name,
                          max_model_len=rt.engine.max_model_len)
                for name, adapter in sorted((rt.adapters.adapters if rt.adapters else {}).items())]
    return ModelList(data=[base, *adapters])


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
    after_requests.flush()  # every request that has ended is counted
    engine_own = await rt.engine.scrape()  # refreshes the gauges first
    return Response(rt.metrics.exposition() + engine_own, media_type=PROMETHEUS_TEXT)


def attach_routers(app: FastAPI, runtime_: Runtime) -> None:
    """Management routes always; inference routes served by our OpenAI layer, or, in front of an
    engine with an app of its own, by service.api.passthrough before any routing (documented here)."""
    app.include_router(management)
    app.include_router(models_router)
    if runtime_.serving is not None:
        app.include_router(inference)
        app.openapi = lambda: openapi_document(app)
    else:
        app.openapi = lambda: openapi_document(app, documented_routes())
