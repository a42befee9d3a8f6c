"""Logging: plain or one JSON object per line, with the current request id on every record."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Fields a record may carry through `extra=` that the JSON formatter writes out.
EXTRA_FIELDS = ("route", "method", "status", "latency_ms", "prompt_tokens", "completion_tokens", "client")


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        for name in EXTRA_FIELDS:
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")


def configure_logging(level: str, jsonl: bool) -> None:
    """Route the root, uvicorn and library loggers through one handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
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
