"""`inferkiln model sign` and `inferkiln model verify`: OpenSSF model-signing over a ModelPack
artifact's files, the signature (a Sigstore bundle) stored as the artifact's OCI referrer.

Signing pulls the artifact (every blob checked against its digest) and signs what was pulled, so
the signature covers what the registry serves, whatever directory it was pushed from. Verifying
runs the runtime's own path (service/model_store.py) into a scratch cache: what passes here passes
at start-up.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from factory.errors import CheckFailed
from service.model_signature import key_identity
from service.model_store import ModelSourceError, Trust, locate_model
from service.modelpack import SIGNATURE_TYPE, pull_model, signatures
from service.oci import Ref, get_manifest, push_referrer


class SignatureCheckFailed(CheckFailed):
    """The artifact has no signature that verifies against the key."""


@dataclass(frozen=True)
class Signed:
    artifact: Ref  # pinned
    signature: Ref  # the referrer holding the bundle
    key: str  # the signing key's identity (sha256 of its public half)


def sign_artifact(ref: Ref, private_key: Path, certificate: Path | None = None, chain: tuple[Path, ...] = ()) -> Signed:
    """Sign with the key, or, given its certificate (and the chain up to the CA), as that certificate."""
    from model_signing import hashing, signing

    _, digest, _ = get_manifest(ref)
    pinned = ref.at(digest)
    with tempfile.TemporaryDirectory() as scratch:
        model, bundle = Path(scratch) / "model", Path(scratch) / "model.sig"
        pull_model(pinned, model)
        config = signing.Config()
        if certificate is None:
            config.use_elliptic_key_signer(private_key=private_key)
        else:
            config.use_certificate_signer(private_key=private_key, signing_certificate=certificate,
                                          certificate_chain=list(chain))
        config.set_hashing_config(hashing.Config().set_ignored_paths(paths=[], ignore_git_paths=True))
        config.sign(model, bundle)
        key = key_identity(chain[-1] if certificate and chain else certificate or private_key)
        signature = push_referrer(pinned, SIGNATURE_TYPE, [(bundle, SIGNATURE_TYPE)],
                                  {"io.inferkiln.model-signing.key": key}, Path(scratch))
    return Signed(pinned, signature, key)


def verify_artifact(ref: Ref, public_key: Path) -> Signed:
    """Raise SignatureCheckFailed unless the artifact's signature verifies against `public_key`."""
    with tempfile.TemporaryDirectory() as scratch:
        try:
            located = locate_model(f"oci://{ref}", cache_path=Path(scratch), base_dir=None, name=ref.repository,
                                   allow_download=True, trust=Trust(True, public_key))
        except ModelSourceError as exc:
            raise SignatureCheckFailed(str(exc)) from None
    verification = located.verification
    pinned = Ref.parse(verification.artifact)
    newest = signatures(pinned)[-1]  # the one the runtime checked
    return Signed(pinned, pinned.at(newest["digest"]), verification.key)
