"""The NIM contract inside each of vLLM's API server processes (vLLM's `--middleware` option).

vLLM adds `NimContract` around its app in every API server process it runs. Inference routes go,
inside the contract's layers (request id, API key, body limit), to vLLM's app below, in-process
(service/api/passthrough.py); every other request to the contract's own FastAPI app (service/app.py:
management routes, /v1/models, the OpenAPI document, OpenAI-shaped 404s). On vLLM's lifespan start the contract starts its own: the warm-up
that readiness waits for, the engine watch, and a SIGTERM handler that drains before vLLM stops.

What the launcher resolved (settings, profile, weights) comes from the file it names in
INFERKILN_RUNTIME_FILE; an API server process started by vLLM holds no other state of the launcher.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from service.admission import drain_then_stop
from service.api.passthrough import PASSED, PassthroughApp
from service.app import build_app, with_contract_layers
from service.engine.vllm_server import Resolved, VllmServer
from service.logs import lean_records
from service.profiles import detect_hardware
from service.runtime import Runtime, Selection, build_runtime, load_model_manifest

log = logging.getLogger(__name__)

failure: str | None = None  # why this process's engine failed; the launcher then exits non-zero


def resolved_runtime() -> Runtime:
    """The runtime the launcher resolved, built again in this API server process (no second look
    at the weights: their verification comes with the rest)."""
    resolved = Resolved.read()
    manifest, _ = load_model_manifest(resolved.settings)
    profile = next(p for p in manifest.profiles if p.id == resolved.profile_id)
    return build_runtime(resolved.settings, Selection(manifest, detect_hardware(), profile, resolved.model_dir,
                                                      resolved.verification))


class NimContract:
    """Pure ASGI: HTTP goes to the contract's app; vLLM's lifespan starts and stops the contract's."""

    def __init__(self, app) -> None:
        lean_records()  # an API server process vLLM started configured its logging from the file
        self.app = app  # vLLM's ASGI stack below this middleware
        self.runtime = resolved_runtime()
        assert isinstance(self.runtime.engine, VllmServer), "the runtime file names a vLLM profile"
        self.contract = build_app(self.runtime, on_fatal=self._fatal)
        self.inference = with_contract_layers(PassthroughApp(self.runtime), self.runtime.settings)
        self.server = None
        self._lifespan = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._lifespan_send(scope, send))
        if scope["type"] == "http" and scope["path"] in PASSED:
            return await self.inference(scope, receive, send)
        await self.contract(scope, receive, send)

    def _lifespan_send(self, scope, send):
        async def sending(message) -> None:
            if message["type"] == "lifespan.startup.complete":
                await self._start(scope["app"])
            elif message["type"] == "lifespan.shutdown.complete" and self._lifespan is not None:
                await self._lifespan.__aexit__(None, None, None)
            await send(message)

        return sending

    async def _start(self, vllm_app) -> None:
        """vLLM's app is built and its state set: attach the engine, take over SIGTERM from vLLM's
        handler (which would abort in-flight requests), and start the contract's lifespan."""
        self.runtime.engine.attach(self.app, vllm_app)
        self.server = vllm_app.state.server
        loop, grace = asyncio.get_running_loop(), self.runtime.settings.shutdown_grace_seconds
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, drain_then_stop, self.server, self.runtime.admission, grace, sig.name)
        self._lifespan = self.contract.router.lifespan_context(self.contract)
        await self._lifespan.__aenter__()

    def _fatal(self, reason: str) -> None:
        global failure
        failure = reason
        if self.server is not None:
            self.server.should_exit = True
