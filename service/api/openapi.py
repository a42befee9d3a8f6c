"""The OpenAPI document's parts that FastAPI cannot infer: error answers and streamed answers."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from service.api.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                  CompletionRequest, CompletionResponse, ErrorResponse)

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)}


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


STREAMED = {"/v1/chat/completions": _streamed(ChatCompletionResponse, ChatCompletionChunk),
            "/v1/completions": _streamed(CompletionResponse, CompletionResponse)}
REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
# Models the document names by reference without a route of ours declaring them (the passthrough's
# routes read raw bodies; chunks are inside the event streams).
REFERENCED = (ChatCompletionRequest, CompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
              CompletionResponse, ErrorResponse)


def request_body(path: str) -> dict:
    """`openapi_extra` for a route that reads its body raw: the body it takes, as the document says."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{REQUESTS[path].__name__}"}}}}}


def openapi_document(app: FastAPI, served_elsewhere: list | None = None) -> dict:
    """FastAPI's document of the app's routes and of `served_elsewhere` (routes the app's own
    layers serve before routing), with every model it names by reference among its components."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes + (served_elsewhere or []))
        modes = [(m, "validation" if m in REQUESTS.values() else "serialization") for m in REFERENCED]
        _, definitions = models_json_schema(modes, ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in definitions.get("$defs", {}).items():
            schemas.setdefault(name, schema)
        app.openapi_schema = document
    return app.openapi_schema
