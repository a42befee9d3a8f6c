"""The benchmarks that need no image and no vLLM, run as a user runs them (the others are run by
hand), and the AIPerf driver the others share: a change to the contract's layers, the engine,
logging or AIPerf's flags that breaks one fails here, not at the next measurement."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.engine import sampling

ROOT = Path(__file__).resolve().parents[2]


def test_the_passthrough_overhead_benchmark_writes_its_result(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.passthrough_overhead", "--events", "200",
                          "--requests", "50", "--stream-tokens", "8", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "passthrough_overhead.json").read_text())
    for part in ("per_event_us", "per_request_us", "per_stream_us"):  # the contract does more than the app alone
        assert result[part]["through_the_contract"] > result[part]["engine_app_alone"] > 0, result
    assert result["machine"]["cpu_count"] >= 1 and (result["events"], result["requests"]) == (200, 50)
    assert result["stream_tokens"] == 8


def test_the_http_overhead_benchmark_writes_its_result(tmp_path):
    """The tiny model direct and through a served process, small counts (about 15 s)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.http_overhead", "--requests", "8", "--max-tokens", "4",
                          "--levels", "1,2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "http_overhead.json").read_text())
    assert set(result["levels"]) == {"concurrency_1", "concurrency_2"}, result
    for level in result["levels"].values():
        assert level["engine_direct"]["requests_per_s"] > 0 and level["http"]["requests_per_s"] > 0, level
    assert result["settings"]["server_profile"] and result["settings"]["direct_device"] == "cpu", result["settings"]


def test_the_structured_outputs_benchmark_writes_its_result(tmp_path):
    """The torch runtime alone (vLLM is the user's --vllm-python), small counts (about 30 s)."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.structured_outputs", "--rounds", "1", "--requests", "4",
                          "--hostile", "2", "--enum-values", "300", "--unions", "2", "--union-width", "501",
                          "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "structured_outputs.json").read_text())["torch"]
    assert result["c1"]["constrained_over_free_itl"]["median"] > 0 and result["compile"]["ttft_new_schema_ms_p50"] > 0
    isolation = result["isolation"]
    assert isolation["statuses"] == [200, 200] and isolation["enum_values"] == 300, isolation
    assert isolation["streams_during"] >= 1 and isolation["itl_during_compiles_ms_p50"] > 0, isolation
    wide = result["wide_union"]
    assert wide["status"] == 400 and wide["streams_during"] >= 1 and wide["gap_max_during_ms"] > 0, wide


def test_a_bad_levels_flag_is_a_usage_error_not_a_traceback():
    run = subprocess.run([sys.executable, "-m", "benchmarks.http_overhead", "--levels", "1,0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "concurrency levels must be at least 1" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_the_decode_matmuls_benchmark_checks_each_kernel_and_writes_its_result(tmp_path):
    """Three of its kernels, one round, few steps (about 30 s): each computes the step's matmuls
    right (against x @ W.T) and reads at a positive rate beside the sum's; the AVX2 kernel where it
    suits the CPU, else skipped with the reason."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.decode_matmuls", "--kernels", "avx2_panels,onednn_packed,openblas",
                          "--rounds", "1", "--repeats", "4", "--rows", "1,2", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "decode_matmuls.json").read_text())
    assert set(result["kernels"]) | set(result["skipped"]) == {"avx2_panels", "onednn_packed", "openblas"}, result
    assert set(result["kernels"]) >= {"onednn_packed", "openblas"}, result
    for kernel in result["kernels"].values():
        assert kernel["weight_mb"] > 300, kernel  # the 76M shape's 40 fused fp32 weights
        for rows in ("rows_1", "rows_2"):
            assert kernel[rows]["max_abs_error"] < 1e-4 and kernel[rows]["read_gb_s"] > 0, kernel
            assert kernel[rows]["sum_gb_s"] > 0, kernel
    assert result["machine"]["cpu"]["flags"] is not None and result["threads"] >= 1


def test_the_sampling_benchmark_runs_both_ways_and_writes_its_result(tmp_path):
    """One vocabulary, c=1, two rounds (about 20 s): the draw alone and the engine's step, each way."""
    if not sampling.native_draw(torch.device("cpu")):
        pytest.skip("the native draw needs x86 with AVX2 and FMA and the kernel library")
    run = subprocess.run([sys.executable, "-m", "benchmarks.sampling", "--rounds", "2", "--vocabularies", "640",
                          "--concurrency", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "sampling.json").read_text())["vocabularies"]["640"]
    for measure in (result["draw_us"]["hot"], result["draw_us"]["cold"], result["step_ms"]["c1"]):
        assert measure["native"] > 0 and measure["aten"] > 0 and measure["native_over_aten"] > 0, result
        assert measure["range"][0] <= measure["native_over_aten"] <= measure["range"][1], result


def test_the_benchmarks_aiperf_driver_holds_its_concurrency_under_the_rate_cap(server, tiny_model_dir, tmp_path):
    """benchmarks.common.aiperf against the tiny model's server: AIPerf accepts the flags, every
    request completes with the tokens asked for, and the client's CPU share is reported."""
    from benchmarks.common import aiperf

    result = aiperf(server.url, "tiny-llama", tiny_model_dir, 2, 6, tmp_path, prompt_tokens=8, output_tokens=8)
    assert result["output_tokens"] == 8 and result["prompt_tokens"] == 8, result
    assert result["output_tok_s"] > 0 and result["ttft_p50_ms"] > 0, result
    assert 0 < result["client_cpu_share"] <= 1, result
