"""OCI registries through oras: references, manifests, blobs and referrers.

Shared by the factory (pushing models, signatures, SBOMs, bundles) and the runtime (pulling a model
into its cache), which must work without the factory. Every blob read is checked against its digest
as it streams, and a manifest fetched by digest against that digest: a registry is not trusted.

Registries without the referrers API (CNCF Distribution 2.x, the local one) are served the way ORAS
falls back: an image index tagged `sha256-<subject hex>` lists the subject's referrers. Readers ask
the referrers API first and read the tag when it is absent.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from dataclasses import dataclass, replace
from pathlib import Path

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}  # b"{}"
CHUNKED_ABOVE = 64 * 1024 * 1024  # larger blobs go up in chunks rather than read whole into memory
READ_CHUNK = 1024 * 1024


class OciError(RuntimeError):
    """A registry could not be reached, refused a request, or answered content that fails its digest."""


@dataclass(frozen=True)
class Ref:
    """`[oci://]REGISTRY/REPOSITORY[:TAG][@sha256:HEX]`."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Ref:
        body = text.removeprefix("oci://")
        body, _, digest = body.partition("@")
        registry, _, path = body.partition("/")
        name, tag = path, None
        if ":" in path.rsplit("/", 1)[-1]:
            name, tag = path.rsplit(":", 1)
        if not registry or not name or (digest and not _is_digest(digest)) or ("." not in registry and ":" not in registry
                                                                             and registry != "localhost"):
            raise OciError(f"{text!r}: expected [oci://]REGISTRY/REPOSITORY[:TAG][@sha256:HEX]")
        return cls(registry, name, tag, digest or None)

    def at(self, digest: str) -> Ref:
        return replace(self, digest=digest)

    def tagged(self, tag: str) -> Ref:
        return replace(self, tag=tag, digest=None)

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def _url(self, kind: str, what: str) -> str:
        return f"{_scheme(self.registry)}://{self.registry}/v2/{self.repository}/{kind}/{what}"

    def manifest_url(self) -> str:
        return self._url("manifests", self.digest or self.tag or "latest")


def _is_digest(text: str) -> bool:
    algorithm, _, hexa = text.partition(":")
    return algorithm == "sha256" and len(hexa) == 64 and all(c in "0123456789abcdef" for c in hexa)


def _scheme(registry: str) -> str:
    """Plain HTTP for loopback registries (as Docker treats them), HTTPS for every other."""
    host = registry[1:registry.index("]")] if registry.startswith("[") else registry.split(":")[0]
    if host == "localhost":
        return "http"
    try:
        return "http" if ipaddress.ip_address(host).is_loopback else "https"
    except ValueError:
        return "https"


_clients: dict[str, object] = {}


def client(registry: str):
    """The oras client of `registry` (one per process and registry, so its token is reused); the
    credentials are oras's: a Docker config file (DOCKER_CONFIG) where the registry needs them."""
    import oras.provider

    if registry not in _clients:
        _clients[registry] = oras.provider.Registry(hostname=registry, insecure=_scheme(registry) == "http")
    return _clients[registry]


def _request(ref: Ref, url: str, method: str = "GET", **kwargs):
    import requests

    try:
        return client(ref.registry).do_request(url, method, **kwargs)
    except (requests.RequestException, OSError) as exc:
        raise OciError(f"{ref.registry}: {type(exc).__name__}: {exc}") from None


def get_manifest(ref: Ref, accept: tuple[str, ...] = (MANIFEST_TYPE, INDEX_TYPE, DOCKER_MANIFEST_TYPE)
                 ) -> tuple[dict, str, bytes]:
    """The manifest `ref` names, its digest and its bytes; a pinned digest must match the bytes."""
    response = _request(ref, ref.manifest_url(), headers={"Accept": ", ".join(accept)})
    if response.status_code != 200:
        raise OciError(f"{ref}: no manifest in the registry ({response.status_code})")
    body = response.content
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    if ref.digest and digest != ref.digest:
        raise OciError(f"{ref}: the registry answered a manifest of digest {digest}")
    return json.loads(body), digest, body


def descriptor(ref: Ref) -> dict:
    """mediaType, digest and size of the manifest `ref` names (a referrer's subject)."""
    manifest, digest, body = get_manifest(ref)
    return {"mediaType": manifest.get("mediaType", MANIFEST_TYPE), "digest": digest, "size": len(body)}


def put_manifest(ref: Ref, manifest: dict, media_type: str = MANIFEST_TYPE) -> str:
    """Store `manifest` under `ref`'s tag (or by its digest) and return its digest."""
    return put_manifest_bytes(ref, _canonical(manifest), media_type)


def put_manifest_bytes(ref: Ref, body: bytes, media_type: str) -> str:
    """Store a manifest exactly as `body` (its digest is that of these bytes) under `ref`'s tag, or by digest."""
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    target = replace(ref, digest=None) if ref.tag else ref.at(digest)
    response = _request(ref, target.manifest_url(), "PUT", headers={"Content-Type": media_type}, data=body)
    if response.status_code not in (200, 201):
        raise OciError(f"{target}: the registry refused the manifest ({response.status_code}): {response.text[:300]}")
    return digest


def file_descriptor(path: Path, media_type: str) -> dict:
    """A blob descriptor for a file: its digest (read in chunks, any size) and size."""
    sha = hashlib.sha256()
    with path.open("rb") as fd:
        while chunk := fd.read(READ_CHUNK):
            sha.update(chunk)
    return {"mediaType": media_type, "digest": f"sha256:{sha.hexdigest()}", "size": path.stat().st_size}


def push_blob(ref: Ref, path: Path, blob: dict) -> bool:
    """Upload `path` as the blob `blob` describes unless the repository holds it; True when sent."""
    registry = client(ref.registry)
    target = registry.get_container(ref.name)
    if registry.blob_exists(blob, target):
        return False
    response = registry.upload_blob(str(path), target, blob, do_chunked=blob["size"] > CHUNKED_ABOVE)
    if response.status_code not in (200, 201, 202):
        raise OciError(f"{ref.name}: uploading {path.name} failed ({response.status_code})")
    return True


def pull_blob(ref: Ref, blob: dict, path: Path) -> None:
    """Stream the blob into `path`, checking its size and digest; nothing is left on a mismatch."""
    url = ref._url("blobs", blob["digest"])
    response = _request(ref, url, stream=True)
    if response.status_code != 200:
        raise OciError(f"{ref.name}: blob {blob['digest']} is not in the registry ({response.status_code})")
    sha, size = hashlib.sha256(), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with response, path.open("wb") as out:
        for chunk in response.iter_content(chunk_size=READ_CHUNK):
            sha.update(chunk)
            size += len(chunk)
            out.write(chunk)
    if f"sha256:{sha.hexdigest()}" != blob["digest"] or size != blob["size"]:
        path.unlink()
        raise OciError(f"{ref.name}: blob {blob['digest']} arrived with other content (sha256:{sha.hexdigest()}, "
                       f"{size} bytes)")


def pull_bytes(ref: Ref, blob: dict, scratch: Path) -> bytes:
    """A small blob's content, checked as pull_blob checks it."""
    path = scratch / blob["digest"].replace(":", "-")
    pull_blob(ref, blob, path)
    try:
        return path.read_bytes()
    finally:
        path.unlink()


def referrers_tag(digest: str) -> str:
    return digest.replace(":", "-")


def referrers(subject: Ref, artifact_type: str | None = None) -> list[dict]:
    """The descriptors of the manifests that name `subject` (pinned by digest) as their subject."""
    assert subject.digest, "referrers are found by the subject's digest"
    response = _request(subject, subject._url("referrers", subject.digest), headers={"Accept": INDEX_TYPE})
    if response.status_code != 200:
        response = _request(subject, subject.tagged(referrers_tag(subject.digest)).manifest_url(),
                            headers={"Accept": INDEX_TYPE})
    found = response.json().get("manifests", []) if response.status_code == 200 else []
    return [m for m in found if artifact_type is None or m.get("artifactType") == artifact_type]


def add_referrer(subject: Ref, referrer: dict) -> None:
    """List `referrer` under the subject's fallback tag (read by registries without the API too)."""
    assert subject.digest, "referrers are listed by the subject's digest"
    tagged = subject.tagged(referrers_tag(subject.digest))
    response = _request(subject, tagged.manifest_url(), headers={"Accept": INDEX_TYPE})
    index = response.json() if response.status_code == 200 else {"schemaVersion": 2, "mediaType": INDEX_TYPE,
                                                                  "manifests": []}
    index["manifests"] = [m for m in index["manifests"] if m["digest"] != referrer["digest"]] + [referrer]
    put_manifest(tagged, index, INDEX_TYPE)


def push_referrer(subject: Ref, artifact_type: str, files: list[tuple[Path, str]], annotations: dict[str, str],
                  scratch: Path) -> Ref:
    """An artifact of `files` (path, media type) whose subject is `subject`, listed as its referrer."""
    layers = []
    for path, media_type in files:
        blob = file_descriptor(path, media_type) | {"annotations": {"org.opencontainers.image.title": path.name}}
        push_blob(subject, path, blob)
        layers.append(blob)
    empty = scratch / "empty-config.json"
    empty.write_bytes(b"{}")
    push_blob(subject, empty, EMPTY_CONFIG)
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": artifact_type,
                "config": EMPTY_CONFIG, "layers": layers, "subject": descriptor(subject), "annotations": annotations}
    repository = replace(subject, tag=None, digest=None)
    digest = put_manifest(repository, manifest)
    add_referrer(subject, {"mediaType": MANIFEST_TYPE, "digest": digest, "size": len(_canonical(manifest)),
                           "artifactType": artifact_type, "annotations": annotations})
    return repository.at(digest)


def _canonical(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":")).encode()
