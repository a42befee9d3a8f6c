"""`inferkiln bundle export|import`: a release carried into an air gap as one OCI image layout.

Export copies, from the registries the catalog names, every manifest of a release (the model
image, its SBOM, the chart, and for a model-free image the model artifact and its signature) with
all their blobs into an OCI image layout (github.com/opencontainers/image-spec, image-layout.md),
tarred. Each manifest keeps its bytes, so its digest; `index.json` names each one's repository and
tag and its role, and carries the release's catalog entry.

Import pushes the same bytes into another registry (referrers listed again under their subject),
then rewrites the chart's values to name that registry (the image, pinned by digest, and the
model source), packages and pushes it, and records the release as it now stands. Nothing of the
first registry is needed after the export.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from factory.chart.helm import package as helm_package
from factory.chart.helm import push as push_chart
from factory.errors import CheckFailed, InputError
from factory.release import catalog
from service.oci import INDEX_TYPE, MANIFEST_TYPE, OciError, Ref, add_referrer, get_manifest, pull_blob, push_blob, \
    put_manifest_bytes

REF_NAME = "org.opencontainers.image.ref.name"
ROLE = "io.inferkiln.bundle.role"
RELEASE = "io.inferkiln.bundle.release"


class BundleError(CheckFailed):
    """A bundle could not be written or loaded; the registry or the catalog was left as it was found."""


@dataclass(frozen=True)
class Imported:
    release: catalog.Release
    registry: str
    manifests: int
    blobs: int


def find_release(name_version: str) -> catalog.Release:
    """MODEL[:VERSION] in the catalog: that version, or the newest release of MODEL."""
    name, _, version = name_version.partition(":")
    found = [r for r in catalog.releases() if r.name == name and (not version or r.version == version)]
    if not found:
        raise InputError(f"no release {name_version} in the catalog (inferkiln catalog lists them)")
    return found[-1]


def _members(release: catalog.Release) -> list[tuple[str, Ref]]:
    members = [("image", Ref.parse(f"{release.image.reference}@{release.image.digest}")),
               ("chart", Ref.parse(f"{release.chart.reference}@{release.chart.digest}"))]
    if release.sbom:
        members.append(("sbom", Ref.parse(release.sbom.reference)))
    if release.model:
        members += [("model", Ref.parse(release.model.reference)), ("signature", Ref.parse(release.model.signature))]
    return members


def export_bundle(release: catalog.Release, out: Path) -> int:
    """Write the release's bundle to `out` (a tar); returns the number of blobs it holds."""
    with tempfile.TemporaryDirectory() as scratch:
        layout = Path(scratch) / "layout"
        (layout / "blobs" / "sha256").mkdir(parents=True)
        (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        entries = []
        try:
            for role, ref in _members(release):
                entries.append(_copy_out(ref, layout) | {"annotations": {REF_NAME: _name(ref), ROLE: role}})
        except OciError as exc:
            raise BundleError(f"exporting {release.name} {release.version}: {exc}") from None
        index = {"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": entries,
                 "annotations": {RELEASE: release.model_dump_json()}}
        (layout / "index.json").write_text(json.dumps(index, indent=2))
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w") as tar:
            for path in sorted(layout.rglob("*")):
                tar.add(path, arcname=str(path.relative_to(layout)), recursive=False)
        return len(list((layout / "blobs" / "sha256").iterdir()))


def _name(ref: Ref) -> str:
    """The repository and tag a manifest had (the tag from the catalog's reference, when there was one)."""
    return ref.repository + (f":{ref.tag}" if ref.tag else "")


def _blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _copy_out(ref: Ref, layout: Path) -> dict:
    """The manifest `ref` names and every blob it lists into the layout; its descriptor."""
    manifest, digest, body = get_manifest(ref)
    _blob_path(layout, digest).write_bytes(body)
    for blob in [manifest["config"], *manifest.get("layers", [])]:
        if not _blob_path(layout, blob["digest"]).exists():
            pull_blob(ref, blob, _blob_path(layout, blob["digest"]))
    return {"mediaType": manifest.get("mediaType", MANIFEST_TYPE), "digest": digest, "size": len(body)}


def import_bundle(bundle: Path, registry: str, charts_out: Path) -> Imported:
    """Load a bundle into `registry`; push the chart rewritten for it; record the release."""
    with tempfile.TemporaryDirectory() as scratch:
        layout = Path(scratch)
        try:
            with tarfile.open(bundle) as tar:
                tar.extractall(layout, filter="data")
            index = json.loads((layout / "index.json").read_text())
            release = catalog.Release.model_validate_json(index["annotations"][RELEASE])
        except (OSError, tarfile.TarError, KeyError, ValueError) as exc:
            raise InputError(f"{bundle}: not an inferkiln bundle ({type(exc).__name__}: {exc})") from None
        placed, blobs = {}, 0
        try:
            for entry in index["manifests"]:
                role = entry["annotations"][ROLE]
                placed[role], sent = _copy_in(layout, entry, registry)
                blobs += sent
        except OciError as exc:
            raise BundleError(f"importing {bundle} into {registry}: {exc}") from None
        chart = _rewrite_chart(layout, placed, registry, charts_out)
    moved = _moved_release(release, placed, chart)
    catalog.record(moved)
    return Imported(moved, registry, len(placed), blobs)


def _copy_in(layout: Path, entry: dict, registry: str) -> tuple[Ref, int]:
    """Push one manifest's blobs and its exact bytes; list it as its subject's referrer."""
    body = _blob_path(layout, entry["digest"]).read_bytes()
    manifest = json.loads(body)
    repository, _, tag = entry["annotations"][REF_NAME].partition(":")
    target = Ref(registry, repository, tag or None)
    sent = 0
    for blob in [manifest["config"], *manifest.get("layers", [])]:
        sent += push_blob(target, _blob_path(layout, blob["digest"]), blob)
    digest = put_manifest_bytes(target, body, entry["mediaType"])
    if "subject" in manifest:
        add_referrer(Ref(registry, repository, digest=manifest["subject"]["digest"]),
                     {k: v for k, v in {"mediaType": entry["mediaType"], "digest": digest, "size": len(body),
                                        "artifactType": manifest.get("artifactType"),
                                        "annotations": manifest.get("annotations")}.items() if v})
    return Ref(registry, repository, tag or None, digest), sent


def _rewrite_chart(layout: Path, placed: dict[str, Ref], registry: str, out: Path) -> catalog.Artifact:
    """The chart package with its image (pinned by digest) and model source in `registry`."""
    chart_manifest = json.loads(_blob_path(layout, placed["chart"].digest).read_bytes())
    content = next(l for l in chart_manifest["layers"] if l["mediaType"].endswith("chart.content.v1.tar+gzip"))
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(_blob_path(layout, content["digest"])) as tar:
            tar.extractall(scratch, filter="data")
        [chart_dir] = [p for p in Path(scratch).iterdir() if p.is_dir()]
        values_file = chart_dir / "values.yaml"
        header = "".join(line for line in values_file.read_text().splitlines(keepends=True) if line.startswith("#"))
        values = yaml.safe_load(values_file.read_text())
        image = placed["image"]
        values["image"].update(repository=image.name, tag=image.tag or values["image"].get("tag", ""),
                               digest=image.digest)
        if "model" in placed:
            values.setdefault("modelStore", {})["source"] = f"oci://{placed['model'].name}@{placed['model'].digest}"
        values_file.write_text(header + yaml.safe_dump(values, sort_keys=False))
        out.mkdir(parents=True, exist_ok=True)
        packaged = helm_package(chart_dir, out)
    reference, digest = push_chart(packaged, registry)
    return catalog.Artifact(reference=reference, digest=digest)


def _moved_release(release: catalog.Release, placed: dict[str, Ref], chart: catalog.Artifact) -> catalog.Release:
    image = placed["image"]
    moved = {"image": catalog.Artifact(reference=f"{image.name}:{image.tag}" if image.tag else image.name,
                                       digest=image.digest), "chart": chart}
    if "sbom" in placed:
        moved["sbom"] = catalog.Artifact(reference=str(placed["sbom"]), digest=placed["sbom"].digest)
    if release.model and "model" in placed:
        model = placed["model"]
        moved["model"] = release.model.model_copy(update={
            "reference": f"{model.name}@{model.digest}", "signature": f"{placed['signature'].name}@"
                                                                      f"{placed['signature'].digest}"})
    return release.model_copy(update=moved)
