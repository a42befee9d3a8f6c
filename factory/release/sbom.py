"""The runtime image's SBOM: CycloneDX JSON made from the flavor's lock (cyclonedx-bom), stored in
the registry as an OCI artifact that refers to the image (oras).

The artifact's manifest names the image as its `subject` and is listed under the image's referrers
fallback tag (service/oci.py), which registries without the referrers API serve too.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from factory.errors import CheckFailed
from factory.image.flavors import Flavor
from factory.release.catalog import Artifact
from service.oci import OciError, Ref, push_referrer

SBOM_MEDIA_TYPE = "application/vnd.cyclonedx+json"


class SbomError(CheckFailed):
    """The SBOM could not be made or stored; nothing was recorded."""


def make_sbom(flavor: Flavor, out: Path) -> Path:
    """A CycloneDX JSON SBOM of every package the flavor's lock installs."""
    result = subprocess.run([sys.executable, "-m", "cyclonedx_py", "requirements", str(flavor.lock_path),
                             "--of", "JSON", "--output-reproducible", "-o", str(out)], capture_output=True, text=True)
    if result.returncode:
        raise SbomError(f"cyclonedx-py could not make the {flavor.name} SBOM: {result.stderr.strip()[-1500:]}")
    return out


def attach_sbom(sbom: Path, image: Artifact) -> Artifact:
    """Push `sbom` as an artifact whose subject is the pushed image, listed as the image's referrer."""
    registry, repository = image.reference.split("/", 1)
    subject = Ref(registry, repository.rsplit(":", 1)[0], digest=image.digest)
    annotations = {"org.opencontainers.image.description": "CycloneDX SBOM of the runtime's packages"}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            pushed = push_referrer(subject, SBOM_MEDIA_TYPE, [(sbom, SBOM_MEDIA_TYPE)], annotations, Path(scratch))
    except OciError as exc:
        raise SbomError(f"storing the SBOM failed: {exc}") from None
    return Artifact(reference=str(pushed), digest=pushed.digest)
