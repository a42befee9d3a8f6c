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
