"""The runtime's connections to an engine server it supervises, against a real uvicorn server (the
server vLLM's OpenAI API runs on) over loopback.

uvicorn closes a connection idle for its keep-alive (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s). A
request written on a pooled connection as the server closes it fails (ServerDisconnectedError or
ClientOSError; a scratch sweep of idle gaps around the keep-alive failed 2 of 60 requests with
aiohttp's default pool, 0 of 60 with this one). That race cannot be caused on demand, so this test
checks what prevents it: a connection is reused while fresh and never once idle for half the keep-alive.
"""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request

from service.engine.vllm_process import engine_session
from tests.conftest import app_in_thread

KEEP_ALIVE_S = 1


@pytest.fixture
def server_url():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        return {"client_port": request.client.port}  # one port per TCP connection

    with app_in_thread(app, timeout_keep_alive=KEEP_ALIVE_S) as url:
        yield url


async def test_a_connection_idle_for_half_the_servers_keep_alive_is_not_reused(server_url):
    async def port(session) -> int:
        async with session.post("/v1/completions", json={}) as response:
            return (await response.json())["client_port"]

    async with engine_session(server_url, KEEP_ALIVE_S) as session:
        first = await port(session)
        assert await port(session) == first  # back to back: the pooled connection
        await asyncio.sleep(0.6 * KEEP_ALIVE_S)  # past half the keep-alive, before the server's close
        assert await port(session) != first
