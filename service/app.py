"""build_app(): routers, middleware and error handlers wired in one place."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service import __version__
from service.after_requests import after_requests
from service.api.errors import install_error_handlers
from service.api.middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from service.api.router import attach_routers
from service.runtime import Runtime
from service.settings import Settings

log = logging.getLogger(__name__)


def build_app(runtime: Runtime, on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """The app serves (live, 503 on ready) while the weights load in the background."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        def died(reason: str) -> None:
            runtime.failure = reason
            log.error("engine died: %s; exiting so that the pod restarts", reason)
            if on_fatal:
                on_fatal(reason)

        runtime.engine.on_death = died

        async def load() -> None:
            try:
                await runtime.engine.start()
                if runtime.adapters:
                    await runtime.engine.sync_adapters(runtime.adapters)
                log.info("engine ready: %s serving %s", runtime.profile.name, runtime.served_model_name)
            except Exception as exc:
                runtime.failure = f"{type(exc).__name__}: {exc}"
                log.exception("engine failed to start")
                if on_fatal:
                    on_fatal(runtime.failure)

        loader = asyncio.create_task(load())
        interval = runtime.settings.peft_refresh_interval
        refresher = (asyncio.create_task(runtime.adapters.refresh_every(
            interval, lambda: runtime.engine.sync_adapters(runtime.adapters))) if runtime.adapters and interval else None)
        try:
            yield
        finally:
            loader.cancel()
            if refresher:
                refresher.cancel()
            await runtime.engine.shutdown()
            after_requests.flush()  # the last requests' metrics and access lines

    app = FastAPI(title="inferkiln NIM runtime", version=__version__, lifespan=lifespan)
    app.state.runtime = runtime
    attach_routers(app, runtime)
    install_error_handlers(app)
    for layer, options in contract_layers(runtime.settings):
        app.add_middleware(layer, **options)
    return app


def contract_layers(settings: Settings) -> list[tuple[type, dict]]:
    """The contract's ASGI layers, innermost first: the body limit; the API key outside it (a request
    without the key is never read); the request id outermost (every answer carries it)."""
    layers: list[tuple[type, dict]] = [(BodyLimitMiddleware, {"max_bytes": settings.max_request_bytes})]
    if settings.api_key:
        layers.append((ApiKeyMiddleware, {"api_key": settings.api_key}))
    return layers + [(RequestContextMiddleware, {})]


def with_contract_layers(app, settings: Settings):
    """`app` inside the contract's layers, as build_app's app has them."""
    for layer, options in contract_layers(settings):
        app = layer(app, **options)
    return app
