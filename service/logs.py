"""Logging: plain or one JSON object per line, with the current request id on every record."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Fields a record may carry through `extra=` that the JSON formatter writes out.
EXTRA_FIELDS = ("route", "method", "status", "latency_ms", "prompt_tokens", "completion_tokens", "client")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):  # set by the first of the handlers it passes
            record.request_id = request_id_var.get()
        return True


BATCH_S = 0.1  # how long the writer gathers lines after the first: a log line is at most this late


class ThreadedStreamHandler(logging.StreamHandler):
    """A StreamHandler that formats and writes from a thread of its own. A write to stderr blocks
    while whatever reads it (the container runtime's log pipe) is behind, as it is on a node whose
    cores the engine keeps busy; in the serving thread that stalls every stream. The caller only
    resolves the message (and, through the handler's filters, the request id) and queues the record.

    It is a handler class, not a step after configuration, so that every `dictConfig` of the runtime's
    logging config gets a writer thread: vLLM's processes apply it, and uvicorn applies it again
    after vLLM has added the contract to its app. Queued records are written before the handler
    closes (logging's exit hook, or a `dictConfig` that replaces it); a forked child starts a writer
    of its own; once closed, the handler writes in the caller."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        self._queueing = True
        self._start()
        _writing.add(self)

    def _start(self) -> None:
        self._records: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, args=(self._records,), name="log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        if not self._queueing:
            return super().emit(record)
        record.msg, record.args = record.getMessage(), None  # the arguments as they are now
        self._records.put(record)

    def _write(self, records: queue.SimpleQueue) -> None:
        """StreamHandler.emit's work without its flush(), which takes the handler's lock: logging's
        exit hook holds that lock while it closes the handler, which waits for this thread.

        The first record wakes the thread; it then waits BATCH_S and writes what came meanwhile in
        one write, so a busy server wakes it (and hands it the GIL) at most ten times a second, not once
        a line: vLLM image, tiny model, c=32 on 2 cores, TTFT p50 0.91x (5 paired rounds) what it was
        with a wake a line."""
        while (first := records.get()) is not None:  # None: the handler closed, with nothing queued
            time.sleep(BATCH_S)
            batch, ended = [first], False
            with contextlib.suppress(queue.Empty):
                while not ended:
                    record = records.get_nowait()
                    ended = record is None
                    batch += [] if ended else [record]
            self._write_lines(batch)
            if ended:
                return

    def _write_lines(self, records: list[logging.LogRecord]) -> None:
        lines = []
        for record in records:
            try:
                lines.append(self.format(record) + self.terminator)
            except Exception:
                self.handleError(record)
        try:
            if lines:
                self.stream.write("".join(lines))
                self.stream.flush()
        except Exception:
            self.handleError(records[0])

    def close(self) -> None:
        """Called under the handler's lock (logging.shutdown), which the writer never takes."""
        if self._queueing:
            self._queueing = False
            _writing.discard(self)
            self._records.put(None)
            self._writer.join(timeout=5)
        super().close()


_writing: weakref.WeakSet[ThreadedStreamHandler] = weakref.WeakSet()  # the handlers whose writer runs
os.register_at_fork(after_in_child=lambda: [handler._start() for handler in _writing])


class JsonFormatter(logging.Formatter):
    """A line a record; behind vLLM an access line a request, in the API server's process (its
    writer thread holds the GIL while it formats): the second's text is kept, one encoder serves."""

    _encode = json.JSONEncoder(ensure_ascii=False).encode
    _second: tuple[int, str] = (-1, "")

    def format(self, record: logging.LogRecord) -> str:
        fields = record.__dict__
        entry = {
            "time": f"{self._utc(int(record.created))}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": fields.get("request_id"),
        }
        for name in EXTRA_FIELDS:
            if name in fields:
                entry[name] = fields[name]
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._encode(entry)

    def _utc(self, second: int) -> str:
        if self._second[0] != second:
            self._second = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
        return self._second[1]


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")


def lean_records() -> None:
    """Log records without what no format here writes: the caller's file and line (a walk up the
    stack), thread and process names (the logging HOWTO's optimizations). Behind vLLM an access line
    a request is made in the serving thread: 4 us less of the contract's 45 us a request
    (benchmarks.passthrough_overhead)."""
    logging._srcfile = None  # noqa: SLF001 (documented: "Set logging._srcfile to None")
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False


def configure_logging(level: str, jsonl: bool) -> None:
    """Route the root, uvicorn and library loggers through one handler on stderr."""
    lean_records()
    handler = ThreadedStreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if jsonl else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # Our access middleware logs each request with its id; uvicorn's access log would repeat it.
    logging.getLogger("uvicorn.access").disabled = True
    for noisy in ("httpx", "httpcore", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


@contextmanager
def json_lines_for_raw_output() -> Iterator[None]:
    """With NIM_JSONL_LOGGING, every line a log collector reads must be JSON, also what bypasses
    logging: native code's warnings on file descriptor 2, progress bars, `print`, Python's warnings,
    in this process and in the processes it starts (they inherit its descriptors). Descriptors 1
    and 2 go to a pipe; a thread passes JSON lines on as they are and wraps the others as records."""
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    thread = threading.Thread(target=_wrap_lines, args=(read_end, out), name="raw-output", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(out, 2)
        thread.join(timeout=2.0)  # to the pipe's end, unless a child that outlived us still holds it


def _wrap_lines(read_end: int, out: int) -> None:
    formatter = JsonFormatter()
    with os.fdopen(read_end, "rb") as source, os.fdopen(out, "wb", buffering=0) as sink:
        for line in source:
            text = line.rstrip(b"\r\n")
            if not text.strip():
                continue
            if not (text.startswith(b"{") and text.endswith(b"}")):
                record = logging.makeLogRecord({"name": "output", "levelname": "INFO",
                                                "msg": text.decode(errors="replace").strip()})
                text = formatter.format(record).encode()
            sink.write(text + b"\n")
