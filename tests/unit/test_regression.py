"""The release-to-release gate: which release is the previous one, and what counts as a regression."""

from __future__ import annotations

import pytest

from factory.release.catalog import Artifact, Release, TestSummary
from factory.release.regression import check_regression, compare, previous_release
from factory.spec import Tests as SpecTests

HW, PROFILE = "Xeon x2; no GPU (CPU only)", "abc123"
TESTS = SpecTests.model_validate({"accuracy": {"tasks": [{"name": "gsm8k", "min": 0.75}]}})


def summary(tok_s: dict[str, float], gsm8k: float | None = 0.8, profile: str = PROFILE, hardware: str = HW,
            exact_match: float | None = None) -> TestSummary:
    return TestSummary(passed=True, summary="", output_tokens_per_s=tok_s, profile=profile, hardware=hardware,
                       accuracy={} if gsm8k is None else {"gsm8k": gsm8k}, exact_match=exact_match)


def release(version: str, tests: TestSummary, time: str = "2026-11-01T00:00:00Z", name: str = "m") -> Release:
    art = Artifact(reference="r", digest="d")
    return Release(name=name, version=version, image=art, chart=art, tests=tests, time=time)


def failed(rows) -> set[str]:
    return {row.check for row in rows if not row.passed}


def test_a_drop_beyond_the_tolerance_at_any_level_fails():
    before = summary({"1": 100.0, "8": 400.0})
    assert failed(compare(before, summary({"1": 91.0, "8": 400.0}), TESTS)) == set()
    assert failed(compare(before, summary({"1": 100.0, "8": 350.0}), TESTS)) == {"output_tokens_per_s@8"}
    assert failed(compare(before, summary({"1": 100.0}), TESTS)) == set()  # a level not measured now: no row
    loose = SpecTests.model_validate({"regression": {"max_throughput_drop": 0.2}})
    assert failed(compare(before, summary({"1": 100.0, "8": 350.0}), loose)) == set()


@pytest.mark.parametrize("previous,new,max_drop,fails", [
    (0.80, 0.76, None, False),  # still above the task's min of 0.75
    (0.80, 0.70, None, True),  # crossed the threshold
    (0.70, 0.60, None, False),  # was below it already: the test gate, not this one, says so
    (0.80, None, None, True),  # the task was not scored this time
    (0.90, 0.84, 0.05, True),  # above the threshold but dropped more than allowed
])
def test_accuracy_fails_when_its_threshold_is_crossed_or_it_drops_too_far(previous, new, max_drop, fails):
    tests = TESTS.model_copy(update={"regression": TESTS.regression.model_copy(update={"max_accuracy_drop": max_drop})})
    assert bool(failed(compare(summary({}, previous), summary({}, new), tests))) == fails


def test_exact_match_is_compared_with_its_threshold():
    rows = compare(summary({}, None, exact_match=1.0), summary({}, None, exact_match=0.5), TESTS)
    assert failed(rows) == {"accuracy.exact_match"}


def test_the_previous_release_is_the_latest_lower_version_on_the_same_profile_and_hardware():
    releases = [release("0.1.0", summary({"1": 1.0})), release("0.2.0", summary({"1": 2.0})),
                release("0.2.0", summary({"1": 3.0}), time="2026-11-02T00:00:00Z"),
                release("0.3.0", summary({"1": 9.0}, hardware="H100 x1")),
                release("0.3.0", summary({"1": 9.0}, profile="other")),
                release("0.3.0", summary({"1": 9.0}), name="another-model"),
                release("0.4.0", summary({"1": 9.0}))]
    found = previous_release(releases, "m", "0.3.0", PROFILE, HW)
    assert (found.version, found.tests.output_tokens_per_s) == ("0.2.0", {"1": 3.0})
    assert previous_release(releases, "m", "0.1.0", PROFILE, HW) is None  # republishing the first: nothing before
    assert previous_release(releases, "m", "0.3.0", None, HW) is None  # a server that names no profile


def test_with_nothing_to_compare_the_gate_passes_and_says_so():
    comparison = check_regression([], "m", "0.1.0", summary({"1": 1.0}), TESTS)
    assert comparison.previous is None and comparison.passed and comparison.rows == []
