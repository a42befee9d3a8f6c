"""Our load levels, read back by NVIDIA AIPerf's own export models and its plot loader."""

import json

import numpy as np
import pytest

from factory.verify.aiperf_export import run_dir_name, write_level
from factory.verify.load import PERCENTILES, LoadSettings, RequestRecord, describe, summarize


def records(n: int = 20) -> list[RequestRecord]:
    out = []
    for i in range(n):
        start = 100.0 + i * 0.05
        ttft = 0.010 + 0.001 * i
        out.append(RequestRecord(start=start, index=i, ttft=ttft, itls=[0.004] * 7, latency=ttft + 0.028,
                                 end=start + ttft + 0.028, input_tokens=32, output_tokens=8))
    out.append(RequestRecord(start=101.5, index=n, end=101.6, error="HTTP 503: b'busy'", code=503))
    return out


def test_describe_has_aiperfs_fields_and_numpys_linear_percentiles():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    stats = describe(values, "ms")
    assert set(stats) == {"unit", "avg", "min", "max", "std", "count", "sum", *(f"p{q}" for q in PERCENTILES)}
    for q in PERCENTILES:
        assert stats[f"p{q}"] == pytest.approx(np.percentile(values, q))
    assert (stats["count"], stats["sum"], stats["std"]) == (6, pytest.approx(21.1), pytest.approx(np.std(values)))


def test_aiperf_reads_a_level_as_it_reads_its_own(tmp_path, aiperf_read):
    settings = LoadSettings(model="tiny-llama", output_tokens=8, requests=21, concurrency=4)
    level = records()
    summary = summarize(level, 1.25, {})
    run_dir = write_level(tmp_path, "http://127.0.0.1:8000", settings, summary, level)
    assert run_dir.name == run_dir_name(settings) == "concurrency_4"

    read = aiperf_read(run_dir)["concurrency_4"]
    assert (read["schema_version"], read["model"], read["concurrency"], read["request_count"]) == ("1.4", "tiny-llama", 4, 21)
    assert (read["records"], read["loaded_rows"], read["errors"], read["was_cancelled"]) == (21, 21, [1], False)
    metrics = read["metrics"]
    for name in ("time_to_first_token", "inter_token_latency", "request_latency", "output_token_throughput_per_user"):
        assert metrics[name]["count"] == 20
        for stat in ("avg", "p1", "p50", "p99", "min", "max", "std", "sum"):
            assert metrics[name][stat] == pytest.approx(summary[name][stat]), (name, stat)
    assert metrics["output_token_throughput"] == {"unit": "tokens/sec", "avg": pytest.approx(160 / 1.25)}
    assert metrics["time_to_first_token"]["unit"] == "ms" and metrics["benchmark_duration"]["avg"] == 1.25
    assert {"time_to_first_token", "inter_chunk_latency", "output_sequence_length"} <= set(read["record_metrics"])
    first = json.loads((run_dir / "profile_export.jsonl").read_text().splitlines()[0])
    assert first["metrics"]["time_to_first_token"] == {"value": pytest.approx(10.0), "unit": "ms"}
    assert first["metadata"]["request_end_ns"] - first["metadata"]["request_start_ns"] == pytest.approx(38e6, abs=1e3)


def test_the_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    from factory.verify.report import pareto_front

    # (tok/s per user, tok/s per instance) at concurrency 1, 8, 32, and one dominated run
    points = [(250.0, 240.0), (120.0, 900.0), (30.0, 950.0), (100.0, 800.0)]
    assert pareto_front(points) == [(30.0, 950.0), (120.0, 900.0), (250.0, 240.0)]


def test_the_distribution_plots_step_through_every_request():
    from factory.verify.report import ecdf

    assert ecdf([30.0, 10.0, 20.0, 10.0]) == ([10.0, 10.0, 20.0, 30.0], [0.25, 0.5, 0.75, 1.0])
