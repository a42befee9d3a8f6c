import asyncio
import logging
import time

from service.after_requests import AfterRequests
from service.api.middleware import RequestContextMiddleware


def test_outside_an_event_loop_a_call_is_made_at_once():
    done = []
    AfterRequests().add(done.append, 1)
    assert done == [1]


def test_on_a_loop_calls_wait_for_the_delay_then_are_made_together_in_order():
    after, done = AfterRequests(delay=0.05), []

    async def main() -> list:
        for i in range(3):
            after.add(done.append, i)
        queued = list(done)
        await asyncio.sleep(0.1)
        return queued

    assert asyncio.run(main()) == [] and done == [0, 1, 2]


def test_a_failing_call_is_logged_and_the_rest_are_made(caplog):
    after, done = AfterRequests(), []

    async def main() -> None:
        after.add(lambda: 1 / 0)
        after.add(done.append, "next")
        after.flush()

    asyncio.run(main())
    assert done == ["next"] and "ZeroDivisionError" in caplog.text


def test_calls_left_by_a_loop_that_closed_are_made_on_the_next():
    after, done = AfterRequests(delay=0.05), []

    async def queue(value) -> None:
        after.add(done.append, value)

    asyncio.run(queue("first"))  # its timer dies with its loop
    assert done == []

    async def queue_and_wait() -> None:
        await queue("second")
        await asyncio.sleep(0.1)

    asyncio.run(queue_and_wait())
    assert done == ["first", "second"]


def test_the_access_line_is_logged_off_the_path_with_the_time_the_request_ended(caplog):
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message) -> None:
        pass

    async def main() -> tuple[list, float]:
        scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": [(b"x-request-id", b"id-1")]}
        await RequestContextMiddleware(app)(scope, receive, send)
        ended = time.time()
        logged = [r for r in caplog.records if r.name == "service.access"]
        await asyncio.sleep(0.15)  # past DEFER_S
        return logged, ended

    with caplog.at_level(logging.INFO, logger="service.access"):
        logged_at_once, ended = asyncio.run(main())
    [line] = [r for r in caplog.records if r.name == "service.access"]
    assert logged_at_once == []
    assert (line.getMessage(), line.request_id, line.status, line.route) == ("GET /v1/models 204", "id-1", 204,
                                                                            "/v1/models")
    assert ended - 0.05 < line.created <= ended and line.msecs == int(line.created * 1000) % 1000
