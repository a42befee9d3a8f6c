"""The JSON log line: its fields, and its time as the record's, second by second (the formatter keeps
the second's text)."""

import json
import logging
from datetime import datetime, timezone

from service.logs import JsonFormatter


def line(formatter: JsonFormatter, created: float, **extra) -> dict:
    record = logging.LogRecord("service.access", logging.INFO, __file__, 1, "%s %s", ("POST", "/v1/completions"), None)
    record.created, record.msecs = created, (created % 1) * 1000
    record.__dict__.update(extra)
    return json.loads(formatter.format(record))


def test_each_line_has_its_records_time_and_fields():
    formatter = JsonFormatter()
    for created in (1796433311.25, 1796433311.875, 1796433312.0, 1796433311.5, 1796519711.125):
        expected = datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        assert line(formatter, created)["time"] == expected
    entry = line(formatter, 1796433311.0, request_id="req-1", status=200, route="/v1/completions", unknown="x")
    assert entry == {"time": "2026-12-05T01:15:11.000Z", "level": "INFO", "logger": "service.access",
                     "message": "POST /v1/completions", "request_id": "req-1", "route": "/v1/completions",
                     "status": 200}
