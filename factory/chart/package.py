"""The chart stage: render the model's chart for its image, lint it, check it, package it.

The package it returns is the very file `publish` pushes: its digest is recorded here and checked
again before the push.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from factory.chart.checks import ChartChecks, check_chart
from factory.chart.helm import ChartError, lint, package
from factory.chart.render import render_chart
from factory.spec import LoadedSpec


@dataclass(frozen=True)
class ChartPackage:
    path: Path
    digest: str  # sha256 of the .tgz: the chart layer's digest once pushed
    image_reference: str
    checks: ChartChecks


def file_digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def package_chart(loaded: LoadedSpec, image_reference: str, out: Path) -> ChartPackage:
    """Render, lint and check (value matrix, API schemas, policy) the model's chart; package it."""
    chart_dir = render_chart(loaded, image_reference, out / "src")
    lint(chart_dir)
    checks = check_chart(chart_dir)
    if not checks.passed:
        errors = checks.errors()
        raise ChartError(f"chart {chart_dir.name}: {len(errors)} problem(s): " + "; ".join(errors[:10]))
    path = package(chart_dir, out)
    return ChartPackage(path, file_digest(path), image_reference, checks)
