"""The runtime image's SBOM: CycloneDX JSON made from the flavor's lock (cyclonedx-bom), stored in
the registry as an OCI artifact that refers to the image (oras).

The local Distribution registry has no referrers API, so the SBOM is found the way ORAS falls back
to: the artifact's manifest names the image as its `subject`, and an image index tagged
`sha256-<image digest hex>` in the same repository lists the image's referrers.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from factory.errors import CheckFailed
from factory.image.flavors import Flavor
from factory.release.catalog import Artifact

SBOM_MEDIA_TYPE = "application/vnd.cyclonedx+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}  # b"{}"


class SbomError(CheckFailed):
    """The SBOM could not be made or stored; nothing was recorded."""


def make_sbom(flavor: Flavor, out: Path) -> Path:
    """A CycloneDX JSON SBOM of every package the flavor's lock installs."""
    result = subprocess.run([sys.executable, "-m", "cyclonedx_py", "requirements", str(flavor.lock_path),
                             "--of", "JSON", "--output-reproducible", "-o", str(out)], capture_output=True, text=True)
    if result.returncode:
        raise SbomError(f"cyclonedx-py could not make the {flavor.name} SBOM: {result.stderr.strip()[-1500:]}")
    return out


def _registry(registry: str):
    import oras.provider

    return oras.provider.Registry(hostname=registry, insecure=True)


def _put_manifest(client, container, body: bytes, media_type: str):
    response = client.do_request(f"{client.prefix}://{container.manifest_url()}", "PUT",
                                 headers={"Content-Type": media_type}, data=body)
    if response.status_code not in (200, 201):
        raise SbomError(f"the registry refused a manifest ({response.status_code}): {response.text[:300]}")
    return response


def attach_sbom(sbom: Path, image: Artifact) -> Artifact:
    """Push `sbom` as an artifact whose subject is the pushed image; list it under the fallback tag."""
    import oras.container
    import oras.oci

    registry, repository = image.reference.split("/", 1)
    repository = repository.rsplit(":", 1)[0]
    client = _registry(registry)
    subject = _head(client, f"{registry}/{repository}@{image.digest}")
    layer = oras.oci.NewLayer(str(sbom), media_type=SBOM_MEDIA_TYPE)
    layer["annotations"] = {"org.opencontainers.image.title": sbom.name}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.json"
        config.write_bytes(b"{}")
        target = client.get_container(f"{registry}/{repository}:sbom")
        for path, descriptor in ((sbom, layer), (config, EMPTY_CONFIG)):
            response = client.upload_blob(str(path), target, descriptor)
            if response.status_code not in (200, 201, 202):
                raise SbomError(f"uploading {path.name} to {registry} failed ({response.status_code})")
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": SBOM_MEDIA_TYPE,
                "config": EMPTY_CONFIG, "layers": [layer], "subject": subject,
                "annotations": {"org.opencontainers.image.description": "CycloneDX SBOM of the runtime's packages"}}
    body = json.dumps(manifest, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    _put_manifest(client, oras.container.Container(f"{registry}/{repository}@{digest}"), body, MANIFEST_TYPE)
    _add_referrer(client, registry, repository, image.digest,
                  {"mediaType": MANIFEST_TYPE, "digest": digest, "size": len(body), "artifactType": SBOM_MEDIA_TYPE,
                   "annotations": manifest["annotations"]})
    return Artifact(reference=f"{registry}/{repository}@{digest}", digest=digest)


def _head(client, reference: str) -> dict:
    """The descriptor (mediaType, digest, size) of a manifest in the registry."""
    import oras.container

    container = oras.container.Container(reference)
    accept = ", ".join([MANIFEST_TYPE, INDEX_TYPE, "application/vnd.docker.distribution.manifest.v2+json"])
    response = client.do_request(f"{client.prefix}://{container.manifest_url()}", "GET", headers={"Accept": accept})
    if response.status_code != 200:
        raise SbomError(f"{reference}: the image manifest is not in the registry ({response.status_code})")
    return {"mediaType": response.headers["Content-Type"], "digest": response.headers["Docker-Content-Digest"],
            "size": len(response.content)}


def referrers_tag(digest: str) -> str:
    return digest.replace(":", "-")


def _add_referrer(client, registry: str, repository: str, subject_digest: str, descriptor: dict) -> None:
    """Add `descriptor` to the index at the referrers fallback tag (created when absent)."""
    import oras.container

    container = oras.container.Container(f"{registry}/{repository}:{referrers_tag(subject_digest)}")
    url = f"{client.prefix}://{container.manifest_url()}"
    response = client.do_request(url, "GET", headers={"Accept": INDEX_TYPE})
    index = response.json() if response.status_code == 200 else {"schemaVersion": 2, "mediaType": INDEX_TYPE,
                                                                  "manifests": []}
    index["manifests"] = [m for m in index["manifests"] if m["digest"] != descriptor["digest"]] + [descriptor]
    _put_manifest(client, container, json.dumps(index, separators=(",", ":")).encode(), INDEX_TYPE)


def referrers(image: Artifact) -> list[dict]:
    """The descriptors listed under the image's referrers fallback tag."""
    import oras.container

    registry, repository = image.reference.split("/", 1)
    repository = repository.rsplit(":", 1)[0]
    client = _registry(registry)
    container = oras.container.Container(f"{registry}/{repository}:{referrers_tag(image.digest)}")
    response = client.do_request(f"{client.prefix}://{container.manifest_url()}", "GET", headers={"Accept": INDEX_TYPE})
    return response.json()["manifests"] if response.status_code == 200 else []
