"""Publishing: push the model image and its chart to an OCI registry, then record the release.

All or nothing: the catalog is written only after both pushes succeeded, so a push that fails
leaves it as it was, and the error says which push failed and why.
"""

from __future__ import annotations

import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from factory import catalog
from factory.chart import lint, package, push, render_chart
from factory.images import Progress
from factory.spec import LoadedSpec


class PublishError(RuntimeError):
    """A push failed or the gates refused; nothing was recorded."""


def test_summary(tests: dict[str, Any]) -> dict[str, Any]:
    """What the catalog keeps of a test run: the verdict and the headline numbers, JSON-safe."""
    summary: dict[str, Any] = {"passed": bool(tests.get("passed")), "summary": tests.get("summary", "no test results")}
    if "accuracy" in tests:
        summary["exact_match"] = tests["accuracy"]["exact_match"]["score"]
    if "performance" in tests:
        summary["output_tokens_per_s"] = {str(level): round(m["output_token_throughput"]["avg"], 1)
                                          for level, m in tests["performance"].items()}
    return summary


def push_image(client, local_reference: str, registry: str, progress: Progress) -> catalog.Artifact:
    repository, tag = local_reference.rsplit(":", 1)
    remote = f"{registry}/{repository}"
    client.images.get(local_reference).tag(remote, tag)
    digest = None
    try:
        for chunk in client.api.push(remote, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise PublishError(f"pushing the image to {registry} failed: {chunk['error'].strip()}")
            if "aux" in chunk and "Digest" in chunk["aux"]:
                digest = chunk["aux"]["Digest"]
            elif "status" in chunk and chunk.get("id") is None:
                progress(f"  {chunk['status']}")
    finally:
        client.api.remove_image(f"{remote}:{tag}", noprune=True)
    if not digest:
        raise PublishError(f"pushing the image to {registry} reported no digest")
    return catalog.Artifact(reference=f"{remote}:{tag}", digest=digest)


def publish(client, loaded: LoadedSpec, image_reference: str, registry: str, tests: dict[str, Any],
            progress: Progress, force: bool = False) -> catalog.Release:
    """Push image and chart; record the release. Refuses a build whose gates failed unless forced."""
    if not tests.get("passed") and not force:
        raise PublishError(f"refusing to publish {image_reference}: its test gates failed "
                           f"({tests.get('summary', 'no test results')}); --force publishes anyway and is recorded")
    spec = loaded.spec
    progress(f"pushing {image_reference} to {registry}...")
    image = push_image(client, image_reference, registry, progress)
    repository, tag = image.reference.rsplit(":", 1)
    with tempfile.TemporaryDirectory() as tmp:
        chart_dir = render_chart(loaded, repository, tag, Path(tmp))
        lint(chart_dir)
        chart_package = package(chart_dir, Path(tmp) / "packages")
        progress(f"pushing chart {chart_package.name} to oci://{registry}/charts...")
        try:
            reference, digest = push(chart_package, registry)
        except Exception as exc:
            raise PublishError(f"pushing the chart to {registry} failed: {exc}") from exc
    release = catalog.Release(
        name=spec.metadata.name, version=spec.metadata.version, image=image,
        chart=catalog.Artifact(reference=reference, digest=digest), tests=test_summary(tests),
        forced=force and not tests.get("passed"),
        time=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    catalog.record(release)
    return release
