"""The load generator sends a request once more when its connection closes before any answer.

The server here is a test double: a real HTTP server on loopback that closes chosen connections
as soon as a request arrives, a fault no real server here can be made to show on demand (vLLM's
own server does it now and then at c=32; see the README's vLLM image section).
"""

import asyncio
import json

import aiohttp

from factory.verify.load import LoadSettings, one_request, run_load, summarize

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
EVENTS = [{"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]},
          {"choices": [], "usage": USAGE}]


async def _serve(drops: int, counter: list[int]) -> asyncio.Server:
    """Closes the first `drops` connections once a request's headers are read; answers the rest
    with a two-token stream."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counter[0] += 1
        headers = await reader.readuntil(b"\r\n\r\n")
        if counter[0] <= drops:
            writer.close()
            return
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        body = b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in EVENTS) + b"data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _run(drops: int, requests: int) -> tuple[list, int]:
    async def main():
        counter = [0]
        server = await _serve(drops, counter)
        port = server.sockets[0].getsockname()[1]
        async with server:
            records, wall = await run_load(f"http://127.0.0.1:{port}",
                                           LoadSettings(model="m", requests=requests, warmup=0))
        return records, counter[0], summarize(records, wall, {})

    return asyncio.run(main())


def test_a_connection_closed_before_any_answer_is_tried_once_more_and_counted():
    records, connections, summary = _run(drops=1, requests=2)
    assert connections == 3
    assert [r.error for r in records] == [None, None]
    assert [r.retried for r in records] == [True, False]
    assert [r.output_tokens for r in records] == [2, 2] and records[0].ttft is not None
    assert summary["retried_request_count"]["avg"] == 1 and summary["error_request_count"]["avg"] == 0


def test_a_second_close_is_a_failed_request():
    records, connections, summary = _run(drops=2, requests=1)
    assert connections == 2
    assert records[0].retried and records[0].error.startswith("ServerDisconnectedError")
    assert summary["error_request_count"]["avg"] == 1 and summary["retried_request_count"]["avg"] == 1


def test_a_refused_connection_is_not_tried_again():
    async def main():
        async with aiohttp.ClientSession("http://127.0.0.1:9") as http:
            return await one_request(http, LoadSettings(model="m"), 0)

    record = asyncio.run(main())
    assert record.error.startswith("ClientConnectorError") and not record.retried
