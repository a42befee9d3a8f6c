"""Checking a model directory against its OpenSSF model-signing signature (a Sigstore bundle over
every file's digest) with what a platform engineer trusts: a public key (PEM), or the PEM
certificate(s) of the CA that issued the signing certificate.

The runtime checks before a single weight is loaded, on every start: a cached copy is hashed again,
so a file changed in the cache after it was verified is found. The factory signs and verifies
through the same library (factory/model/signing.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

# What model-signing's ValueError lists (the repr of a list, quotes escaped), one finding each.
MISMATCH = re.compile(r"(Hash mismatch for|Extra files found in model|Missing files in model) \\?'([^'\\]*)\\?'"
                      r"(?:: ([^\"'\]]*))?")


class SignatureError(RuntimeError):
    """The model does not verify; the message is one line saying what failed."""


@dataclass(frozen=True)
class Verification:
    """How the served weights were checked, for the metadata endpoint and the logs."""

    status: str  # "verified", or "disabled" (NIM_MODEL_VERIFY=0)
    key: str | None = None  # the public key's identity: sha256 of its DER SubjectPublicKeyInfo
    artifact: str | None = None  # the oci:// reference, pinned by digest

    def report(self) -> dict:
        return {k: v for k, v in {"status": self.status, "publicKey": self.key, "artifact": self.artifact}.items() if v}


def is_certificate(trusted: Path) -> bool:
    return b"-----BEGIN CERTIFICATE-----" in trusted.read_bytes()


def key_identity(public_key: Path) -> str:
    """`sha256:<hex>` of the key's DER SubjectPublicKeyInfo: the same for the PEM file of either
    half; for certificates, that of the first one's key (the CA a chain is trusted by)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    pem = public_key.read_bytes()
    if is_certificate(public_key):
        key = x509.load_pem_x509_certificates(pem)[0].public_key()
    else:
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError:
            key = serialization.load_pem_private_key(pem, password=None).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def verify_model(model_dir: Path, signature: Path, public_key: Path) -> str:
    """Raise SignatureError unless every file of `model_dir`, and no other, is as signed by the
    holder of `public_key`; return the key's identity."""
    from model_signing import hashing, verifying

    if not public_key.is_file():
        raise SignatureError(f"no public key file at {public_key}")
    trusted, signed = ("certificate" if is_certificate(public_key) else "key"), _signed_with(signature)
    if trusted != signed:
        raise SignatureError(f"the signature was made with a {signed}, but {public_key} holds a {trusted}")
    config = verifying.Config()
    if trusted == "certificate":
        config.use_certificate_verifier(certificate_chain=[public_key])
    else:
        config.use_elliptic_key_verifier(public_key=public_key)
    config.set_hashing_config(hashing.Config().set_ignored_paths(paths=[], ignore_git_paths=True))
    try:
        config.verify(model_dir, signature)
    except Exception as exc:  # the library raises ValueError and others (a malformed bundle)
        raise SignatureError(_one_line(str(exc))) from None
    return key_identity(public_key)


def _signed_with(signature: Path) -> str:
    """"key" or "certificate": what the bundle's verification material names."""
    try:
        material = json.loads(signature.read_text()).get("verificationMaterial") or {}
    except (OSError, ValueError):
        raise SignatureError(f"{signature} is not a Sigstore bundle") from None
    return "key" if "publicKey" in material else "certificate"


def _one_line(message: str) -> str:
    found = [f"{what} '{name}'" + (f": {files}" if files and what != "Hash mismatch for" else "")
             for what, name, files in MISMATCH.findall(message)]
    if found:
        return "signature mismatch: " + "; ".join(found)
    return message.strip().splitlines()[0][:300] if message.strip() else "the signature does not verify"
