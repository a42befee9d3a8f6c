"""The perf gates: each SLO limit is checked at every load level, and failed requests always fail."""

from factory.verify.harness import slo_gates
from factory.verify.result import Gate


def level(ttft_p99: float | None, itl_p99: float | None = 5.0, errors: int = 0) -> dict:
    return {"time_to_first_token": {"p99": ttft_p99}, "inter_token_latency": {"p99": itl_p99},
            "error_request_count": {"avg": errors}, "retried_request_count": {"avg": 0}}


def by_id(gates: list[Gate]) -> dict[str, bool]:
    return {gate.id: gate.passed for gate in gates}


def test_each_limit_is_checked_at_every_level():
    gates = slo_gates({1: level(120.0), 32: level(2400.0)}, {"ttft_p99_ms": 2000, "itl_p99_ms": None})
    assert by_id(gates) == {"slo.ttft_p99_ms@1": True, "slo.ttft_p99_ms@32": False,
                            "perf.errors@1": True, "perf.errors@32": True}


def test_a_missing_measurement_fails_the_limit_and_errors_fail_without_an_slo():
    gates = by_id(slo_gates({8: level(None, itl_p99=None, errors=2)}, {"ttft_p99_ms": 500, "itl_p99_ms": 50}))
    assert gates == {"slo.ttft_p99_ms@8": False, "slo.itl_p99_ms@8": False, "perf.errors@8": False}
