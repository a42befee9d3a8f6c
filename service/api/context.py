"""What every route handler needs of a request: the runtime, and cancellation when its client leaves."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response

if TYPE_CHECKING:
    from service.runtime import Runtime


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


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
