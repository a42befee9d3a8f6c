"""Load levels exported in NVIDIA AIPerf's formats, so that AIPerf's own tools (its plot command,
dashboards, comparisons in CI) read our reports as they read AIPerf's.

Each level gets a run directory named as an AIPerf sweep names its cells (`concurrency_8`) holding
`profile_export_aiperf.json` (AIPerf's JsonExportData: every metric at the top level, input_config
as AIPerf's BenchmarkConfig, start and end times, error_summary) and `profile_export.jsonl` (one
MetricRecordInfo per request, values in AIPerf's display units).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from factory.verify.load import LoadSettings, RequestRecord, epoch_ns

SCHEMA_VERSION = "1.4"  # AIPerf 0.13's JsonExportData.SCHEMA_VERSION, the schema followed here
EXPORT_JSON = "profile_export_aiperf.json"
EXPORT_JSONL = "profile_export.jsonl"
WORKER = "inferkiln-loadgen"


def run_dir_name(settings: LoadSettings) -> str:
    if settings.rate:
        return f"request_rate_{settings.rate:g}_concurrency_{settings.concurrency}"
    return f"concurrency_{settings.concurrency}"


def input_config(url: str, settings: LoadSettings) -> dict:
    """What was run, as AIPerf's BenchmarkConfig (its YAML v2 shape) describes a run."""
    load = ({"type": "poisson", "rate": settings.rate} if settings.rate
            else {"type": "concurrency", "concurrency": settings.concurrency})
    phases = [{"name": "profiling", **load, "requests": settings.requests}]
    if settings.warmup:
        phases.insert(0, {"name": "warmup", **load, "requests": settings.warmup, "exclude_from_results": True})
    return {"models": {"items": [{"name": settings.model}]},
            "endpoint": {"urls": [url], "type": "completions", "streaming": True,
                         "extra": {"ignore_eos": True, "temperature": 0}},
            "datasets": [{"name": "synthetic", "type": "synthetic", "entries": settings.requests,
                          "prompts": {"isl": settings.prompt_tokens, "osl": settings.output_tokens}}],
            "phases": phases}


def error_details(code: int | None, message: str) -> dict:
    """AIPerf's ErrorDetails of a failed request."""
    return {"code": code, "type": "HTTPError" if code else "RequestError", "message": message}


def error_summary(records: list[RequestRecord]) -> list[dict]:
    counts = Counter((r.code, r.error) for r in records if r.error is not None)
    return [{"error_details": error_details(code, message), "count": count}
            for (code, message), count in counts.items()]


def level_export(url: str, settings: LoadSettings, summary: dict, records: list[RequestRecord]) -> dict:
    """One level's profile_export_aiperf.json."""
    starts = [r.start for r in records] or [0.0]
    ends = [r.end for r in records if r.end is not None] or starts
    return {"schema_version": SCHEMA_VERSION, "benchmark_id": str(uuid.uuid4()), **summary,
            "input_config": input_config(url, settings),
            "run_info": {"run_label": run_dir_name(settings), "random_seed": settings.seed},
            "was_cancelled": False, "error_summary": error_summary(records),
            "start_time": _iso(epoch_ns(min(starts))), "end_time": _iso(epoch_ns(max(ends)))}


def record_line(record: RequestRecord) -> dict:
    """One request as AIPerf's MetricRecordInfo."""
    metrics = {"request_latency": _ms(record.latency), "time_to_first_token": _ms(record.ttft),
               "inter_token_latency": _ms(record.inter_token_latency),
               "output_token_throughput_per_user": _value(record.tokens_per_s_per_user, "tokens/sec/user"),
               "input_sequence_length": _value(record.input_tokens or None, "tokens"),
               "output_sequence_length": _value(record.output_tokens or None, "tokens"),
               "inter_chunk_latency": _value([gap * 1000 for gap in record.itls] or None, "ms")}
    end = record.end if record.end is not None else record.start
    return {"metadata": {"session_num": record.index, "request_start_ns": epoch_ns(record.start),
                         "request_end_ns": epoch_ns(end), "worker_id": WORKER, "record_processor_id": WORKER,
                         "benchmark_phase": "profiling"},
            "metrics": {name: value for name, value in metrics.items() if value is not None},
            "error": None if record.error is None else error_details(record.code, record.error)}


def write_level(out: Path, url: str, settings: LoadSettings, summary: dict, records: list[RequestRecord]) -> Path:
    run_dir = out / run_dir_name(settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / EXPORT_JSON).write_text(json.dumps(level_export(url, settings, summary, records), indent=2))
    with open(run_dir / EXPORT_JSONL, "w") as jsonl:
        for record in sorted(records, key=lambda r: r.start):
            jsonl.write(json.dumps(record_line(record)) + "\n")
    return run_dir


def _value(value, unit: str) -> dict | None:
    return None if value is None else {"value": value, "unit": unit}


def _ms(seconds: float | None) -> dict | None:
    return None if seconds is None else _value(seconds * 1000, "ms")


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat()
