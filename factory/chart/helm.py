"""The real helm binary: lint, package and push (OCI)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from factory.errors import CheckFailed
from factory.stack import helm_binary


class ChartError(CheckFailed):
    """helm refused the chart (lint, template or package), or a check failed; the message says which."""


def helm(*args: str) -> str:
    result = subprocess.run([helm_binary(), *args], capture_output=True, text=True)
    if result.returncode:
        # lint prints its findings on stdout and only a count on stderr: name the findings
        findings = [line.removeprefix("[ERROR] ") for line in result.stdout.splitlines() if line.startswith("[ERROR]")]
        detail = "; ".join(findings) or result.stdout.strip()
        raise ChartError(f"helm {args[0]} failed: {'; '.join(filter(None, [detail, result.stderr.strip()]))}")
    return result.stdout + result.stderr  # helm reports some results (push) on stderr


def lint(chart_dir: Path, values: list[Path] | None = None) -> str:
    return helm("lint", "--strict", str(chart_dir), *[arg for v in values or [] for arg in ("-f", str(v))])


def package(chart_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    output = helm("package", str(chart_dir), "-d", str(out))
    return Path(re.search(r"saved it to: (\S+)", output).group(1))


def push(package_path: Path, registry: str) -> tuple[str, str]:
    """`helm push` to oci://registry/charts; returns the chart reference and its manifest digest."""
    output = helm("push", str(package_path), f"oci://{registry}/charts", "--plain-http")
    reference = re.search(r"Pushed: (\S+)", output)
    digest = re.search(r"Digest: (sha256:[0-9a-f]+)", output)
    if not (reference and digest):
        raise ChartError(f"helm push gave no reference and digest: {output}")
    return reference.group(1), digest.group(1)
