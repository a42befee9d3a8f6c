"""The release-to-release gate: a new release's throughput and accuracy against the previous release
of the same model, measured on the same profile and hardware (numbers from other machines or
profiles say nothing about a regression).

The previous release is the catalog's latest of the highest version below the new one, so
publishing a version again compares it with the version before, not with itself.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from packaging.version import InvalidVersion, Version
from factory.release.catalog import Comparison, Release, RegressionCheck, TestSummary
from factory.spec import Tests


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def previous_release(releases: list[Release], name: str, version: str, profile: str | None,
                     hardware: str | None) -> Release | None:
    new = _version(version)
    if new is None or profile is None or hardware is None:
        return None
    earlier = [r for r in releases if r.name == name and r.tests.profile == profile and r.tests.hardware == hardware
               and (v := _version(r.version)) is not None and v < new]
    return max(earlier, key=lambda r: (Version(r.version), r.time), default=None)


def compare(previous: TestSummary, new: TestSummary, tests: Tests) -> list[RegressionCheck]:
    """Throughput may drop by the spec's fraction at any level measured by both; an accuracy score
    may not fall below its threshold when the previous one was above it, nor drop by more than
    max_accuracy_drop when the spec sets one."""
    tolerance = tests.regression
    rows = [RegressionCheck(check=f"output_tokens_per_s@{level}", previous=before, new=new.output_tokens_per_s[level],
                            limit=before * (1 - tolerance.max_throughput_drop))
            for level, before in previous.output_tokens_per_s.items() if level in new.output_tokens_per_s]
    thresholds = {task.name: task.min for task in tests.accuracy.tasks}
    thresholds["exact_match"] = tests.accuracy.min_exact_match
    scores = [(task, before, new.accuracy.get(task)) for task, before in previous.accuracy.items()]
    if previous.exact_match is not None:
        scores.append(("exact_match", previous.exact_match, new.exact_match))
    for task, before, after in scores:
        threshold = thresholds.get(task, 0.0)
        floor = threshold if before >= threshold else 0.0
        if tolerance.max_accuracy_drop is not None:
            floor = max(floor, before - tolerance.max_accuracy_drop)
        rows.append(RegressionCheck(check=f"accuracy.{task}", previous=before, new=after, limit=floor))
    return rows


def check_regression(releases: list[Release], name: str, version: str, new: TestSummary, tests: Tests) -> Comparison:
    previous = previous_release(releases, name, version, new.profile, new.hardware)
    if previous is None:
        return Comparison(previous=None)
    return Comparison(previous=f"{previous.name} {previous.version} ({previous.time})",
                      rows=compare(previous.tests, new, tests))


HEADING = "## Against the previous release"


def comparison_markdown(comparison: Comparison) -> str:
    if comparison.previous is None:
        return f"{HEADING}\n\nNo earlier release on this profile and hardware.\n"
    table = "\n".join(f"| {r.check} | {r.previous:.3f} | {'-' if r.new is None else f'{r.new:.3f}'} | {r.limit:.3f} | "
                      f"{'pass' if r.passed else 'FAIL'} |" for r in comparison.rows)
    return (f"{HEADING}: {comparison.previous}\n\n"
            f"| check | previous | new | lowest passing | result |\n|---|---|---|---|---|\n{table}\n")


def write_comparison(report_dir: Path, comparison: Comparison) -> None:
    """The comparison joins the test report: regression.json, and a section at the end of summary.md and
    index.html, which a later publish of the same test run replaces (a refused publish, then a forced one)."""
    if not (report_dir / "summary.md").is_file():
        return
    (report_dir / "regression.json").write_text(json.dumps(comparison.model_dump(), indent=2))
    markdown = comparison_markdown(comparison)
    for name, opening, body, closing in (("summary.md", "\n", markdown, ""),
                                         ("index.html", "<pre>", html.escape(markdown), "</pre>")):
        kept = (report_dir / name).read_text().split(opening + HEADING, 1)[0]
        (report_dir / name).write_text(kept + opening + body + closing)
