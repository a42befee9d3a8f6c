"""benchmarks.engine_vs_vllm_cpu's read bandwidth: stream_read.c's readers, and the best of them."""

import shutil

import pytest

from benchmarks import engine_vs_vllm_cpu


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="stream_read.c needs a C compiler")
@pytest.mark.parametrize("huge", [True, False])
def test_the_reader_reads_every_float_with_each_stream_count(huge):
    # stream_read exits 1 ("misread") where its sum of the 1 GiB of ones is not their count
    rates = engine_vs_vllm_cpu.stream_reads(1, 1, huge)
    assert sorted(rates) == [1, 2, 4, 8] and all(1e8 < rate < 1e13 for rate in rates.values())


def test_the_bandwidth_is_the_best_reader_or_torchs_sum_alone_without_a_compiler(monkeypatch):
    monkeypatch.setattr(engine_vs_vllm_cpu, "stream_reads", lambda gib, tries, huge: {4: 1e15})
    assert engine_vs_vllm_cpu.read_bandwidth(1, 1) == 1e15
    monkeypatch.undo()
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.warns(UserWarning, match="no C compiler"):
        assert engine_vs_vllm_cpu.stream_reads(1, 1, True) == {}
    assert 1e8 < engine_vs_vllm_cpu.read_bandwidth(1, 1) < 1e13


def test_a_run_whose_readings_differ_by_over_15_percent_changed_state():
    def run(before: float, after: float) -> dict:
        return {"read_bandwidth_before": before, "read_bandwidth_after": after}

    assert not engine_vs_vllm_cpu.changed(run(50e9, 50e9))
    assert not engine_vs_vllm_cpu.changed(run(50e9, 57e9))
    assert engine_vs_vllm_cpu.changed(run(50e9, 80e9))
    assert engine_vs_vllm_cpu.changed(run(80e9, 50e9))


def test_a_c1_run_is_run_again_while_its_readings_disagree(monkeypatch, tmp_path):
    # the memory's states are not ours to cause: the readings are a scripted sequence
    readings = iter([36e9, 66e9, 66e9, 36e9, 66e9, 65e9] + [36e9, 66e9] * 3)
    runs = []
    monkeypatch.setattr(engine_vs_vllm_cpu, "read_bandwidth", lambda tries: next(readings))
    monkeypatch.setattr(engine_vs_vllm_cpu, "settle", lambda: 0.0)
    monkeypatch.setattr(engine_vs_vllm_cpu, "aiperf", lambda *args, **kwargs: runs.append(args[5]) or {"itl_p50_ms": 5.0})
    server = engine_vs_vllm_cpu.HostServer("http://127.0.0.1:1", 0.0, 0)  # alone: nothing is paused
    run = engine_vs_vllm_cpu.run_alone({"torch": server}, "torch", 1, tmp_path, tmp_path / "run0")
    assert run["state_retries"] == 2 and (run["read_bandwidth_before"], run["read_bandwidth_after"]) == (66e9, 65e9)
    assert runs == [tmp_path / "run0" / f"try{i}" for i in range(3)]  # each try's export of its own
    engine_vs_vllm_cpu.run_alone({"torch": server}, "torch", 1, tmp_path, tmp_path / "run1")  # never agrees
    assert len(runs) == 6


def test_the_share_of_the_limit_leaves_out_runs_whose_state_changed(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_vs_vllm_cpu, "decode_step_bytes", lambda *args: 300e6)

    def run(itl_ms: float, before: float, after: float) -> dict:
        return {"itl_p50_ms": itl_ms, "read_bandwidth_before": before, "read_bandwidth_after": after,
                "read_bandwidth": (before + after) / 2, "state_retries": 2}

    # the limit at 60 GB/s is 200 tok/s, 5 ms a token; at the mean of 60 and 30, 150 tok/s
    torch = [run(6.25, 60e9, 60e9), run(11.0, 60e9, 30e9), run(12.0, 60e9, 30e9)]
    result = {"rounds": {"levels": {"torch": {1: torch}, "vllm": {1: [run(20.0, 60e9, 30e9)]}}},
              "levels": {"torch": {1: {"itl_p50_ms": 11.0}}, "vllm": {1: {"itl_p50_ms": 20.0}}}}
    limit = engine_vs_vllm_cpu.bandwidth_limit(result, tmp_path, "float32")
    assert limit["torch"]["fraction_of_limit"]["median"] == 0.8 and limit["torch"]["runs_of_a_known_state"] == 1
    assert limit["torch"]["fraction_of_limit_every_run"]["median"] == 0.606
    assert limit["vllm"]["runs_of_a_known_state"] == 0  # none left: every run's
    assert limit["vllm"]["fraction_of_limit"]["median"] == 0.333  # 50 tok/s of 150 (spread rounds to 3 places)
    assert (limit["state_changed"], limit["c1_runs"], limit["state_retries"]) == (3, 4, 8)
