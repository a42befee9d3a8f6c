"""Publishing: push the model image, its SBOM and the validated chart package, then record the release.

All or nothing: the catalog is written only after every push succeeded, so a push that fails
leaves it as it was, and the error says which push failed and why.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from factory.chart.helm import push as push_chart
from factory.chart.package import ChartPackage, file_digest
from factory.errors import CheckFailed
from factory.image.build import BuiltImages
from factory.image.flavors import Flavor
from factory.release import catalog
from factory.release.regression import check_regression, write_comparison
from factory.release.sbom import attach_sbom, make_sbom
from factory.spec import LoadedSpec
from factory.verify.result import TestReport

Progress = Callable[[str], None]


class PublishError(CheckFailed):
    """A push failed or the gates refused; nothing was recorded."""


def remote_reference(local_reference: str, registry: str) -> str:
    return f"{registry}/{local_reference}"


def push_image(client, local_reference: str, registry: str, progress: Progress) -> catalog.Artifact:
    repository, tag = remote_reference(local_reference, registry).rsplit(":", 1)
    client.images.get(local_reference).tag(repository, tag)
    digest = None
    try:
        for chunk in client.api.push(repository, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise PublishError(f"pushing the image to {registry} failed: {chunk['error'].strip()}")
            if "aux" in chunk and "Digest" in chunk["aux"]:
                digest = chunk["aux"]["Digest"]
            elif "status" in chunk and chunk.get("id") is None:
                progress(f"  {chunk['status']}")
    finally:
        client.api.remove_image(f"{repository}:{tag}", noprune=True)
    if not digest:
        raise PublishError(f"pushing the image to {registry} reported no digest")
    return catalog.Artifact(reference=f"{repository}:{tag}", digest=digest)


def verified_model(loaded: LoadedSpec) -> catalog.ModelArtifact | None:
    """An oci:// model's artifact, checked against the spec's key as the runtime will check it:
    a release names the weights it serves and what proves them."""
    source = loaded.spec.model.source
    if not source.startswith("oci://"):
        return None
    from factory.model.signing import verify_artifact
    from service.oci import OciError, Ref

    try:
        signed = verify_artifact(Ref.parse(source), loaded.verify_key())
    except (CheckFailed, OciError) as exc:
        raise PublishError(f"refusing to publish: the model {source} does not verify: {exc}") from None
    return catalog.ModelArtifact(reference=str(signed.artifact), digest=signed.artifact.digest,
                                 signature=str(signed.signature), key=signed.key)


def publish(client, loaded: LoadedSpec, flavor: Flavor, images: BuiltImages, chart: ChartPackage, tests: TestReport,
            registry: str, progress: Progress, force: bool = False) -> catalog.Release:
    """Push image, SBOM and chart; record the release. Refuses, unless forced, a build whose gates failed
    or that regresses against the previous release."""
    spec = loaded.spec
    summary = catalog.TestSummary(**tests.model_dump(include=set(catalog.TestSummary.model_fields)))
    comparison = check_regression(catalog.releases(), spec.metadata.name, spec.metadata.version, summary, spec.tests)
    write_comparison(tests.report_dir, comparison)
    if not tests.passed and not force:
        raise PublishError(f"refusing to publish {images.model.reference}: its test gates failed "
                           f"({tests.summary}); --force publishes anyway and is recorded")
    if not comparison.passed and not force:
        raise PublishError(f"refusing to publish {images.model.reference}: it regresses against "
                           f"{comparison.previous}: {'; '.join(comparison.failures())}; --force publishes anyway "
                           "and is recorded")
    wanted = remote_reference(images.model.reference, registry)
    if chart.image_reference != wanted:
        raise PublishError(f"the chart package {chart.path.name} names the image {chart.image_reference}, "
                           f"not the one being published ({wanted})")
    if not chart.path.is_file() or file_digest(chart.path) != chart.digest:
        raise PublishError(f"the chart package {chart.path} changed since the chart stage validated it")
    model = verified_model(loaded)
    progress(f"pushing {images.model.reference} to {registry}...")
    image = push_image(client, images.model.reference, registry, progress)
    progress("pushing the runtime's SBOM...")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            sbom = attach_sbom(make_sbom(flavor, Path(tmp) / f"sbom-{flavor.name}.cdx.json"), image)
        except CheckFailed:
            raise
        except Exception as exc:  # requests and oras raise several kinds for a registry that fails
            raise PublishError(f"pushing the SBOM to {registry} failed: {exc}") from None
    progress(f"pushing chart {chart.path.name} to oci://{registry}/charts...")
    try:
        reference, digest = push_chart(chart.path, registry)
    except CheckFailed as exc:
        raise PublishError(f"pushing the chart to {registry} failed: {exc}") from None
    release = catalog.Release(
        name=spec.metadata.name, version=spec.metadata.version, image=image, sbom=sbom, model=model,
        chart=catalog.Artifact(reference=reference, digest=digest),
        tests=summary, regression=comparison if comparison.previous else None,
        forced=force and not (tests.passed and comparison.passed),
        time=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
    catalog.record(release)
    return release
