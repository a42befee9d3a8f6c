"""Model artifacts without a registry: references, ModelPack layers and config, signatures checked
with model-signing and a key pair made here."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from factory.errors import InputError
from factory.model.source import model_to_push
from service.model_signature import SignatureError, key_identity, verify_model
from service.model_store import ModelSourceError, Trust, locate_model
from service.modelpack import DOC, WEIGHT, WEIGHT_CONFIG, media_type, model_config, model_files
from service.oci import OciError, Ref, _scheme


@pytest.mark.parametrize("text,expected", [
    ("oci://127.0.0.1:5000/models/tiny:v1", ("127.0.0.1:5000", "models/tiny", "v1", None)),
    ("registry.example.com/org/llama@sha256:" + "a" * 64, ("registry.example.com", "org/llama", None, "sha256:" + "a" * 64)),
    ("localhost/m", ("localhost", "m", None, None)),
    ("127.0.0.1:5000/m:t@sha256:" + "b" * 64, ("127.0.0.1:5000", "m", "t", "sha256:" + "b" * 64)),
])
def test_references(text, expected):
    ref = Ref.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == expected
    assert Ref.parse(str(ref)) == ref


@pytest.mark.parametrize("text", ["models/tiny:v1", "oci://", "127.0.0.1:5000/", "r.io/m@sha256:short",
                                  "r.io/m@md5:" + "a" * 32])
def test_bad_references(text):
    with pytest.raises(OciError, match="expected"):
        Ref.parse(text)


def test_loopback_registries_speak_plain_http_as_docker_allows():
    assert [_scheme(r) for r in ("127.0.0.1:5000", "localhost:5000", "[::1]:5000", "127.0.0.2")] == ["http"] * 4
    assert [_scheme(r) for r in ("registry.example.com", "10.0.0.5:5000", "nvcr.io")] == ["https"] * 3


def test_layer_media_types_follow_modelpack():
    kinds = {name: media_type(PurePosixPath(name)) for name in
             ("model-00001-of-00002.safetensors", "pytorch_model.bin", "config.json", "tokenizer.json",
              "chat_template.jinja", "README.md", "LICENSE")}
    assert kinds == {"model-00001-of-00002.safetensors": WEIGHT, "pytorch_model.bin": WEIGHT,
                     "config.json": WEIGHT_CONFIG, "tokenizer.json": WEIGHT_CONFIG, "chat_template.jinja": WEIGHT_CONFIG,
                     "README.md": DOC, "LICENSE": DOC}


def test_model_files_leave_out_git_and_signature(tmp_path):
    for name in ("config.json", "sub/extra.json", ".git/HEAD", "model.sig", "w.safetensors"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert [str(p) for p in model_files(tmp_path)] == ["config.json", "sub/extra.json", "w.safetensors"]


def test_config_lists_layers_and_precision(tmp_path):
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    (tmp_path / "model.safetensors").write_bytes(b"w")
    config = model_config("llama", "1.0", tmp_path, ["sha256:1", "sha256:2"])
    assert config["modelfs"] == {"type": "layers", "diffIds": ["sha256:1", "sha256:2"]}
    assert config["config"] == {"architecture": "transformer", "format": "safetensors", "precision": "bf16"}
    assert config["descriptor"] == {"name": "llama", "version": "1.0"}


def key_pair(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "key.pem", directory / "pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def signed_model(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    from model_signing import signing

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights" * 100)
    private, public = key_pair(tmp_path)
    signing.Config().use_elliptic_key_signer(private_key=private).sign(model, tmp_path / "model.sig")
    return model, tmp_path / "model.sig", private, public


def test_a_signed_model_verifies_and_names_its_key(tmp_path):
    model, signature, private, public = signed_model(tmp_path)
    assert verify_model(model, signature, public) == key_identity(public) == key_identity(private)


@pytest.mark.parametrize("change,expected", [
    (lambda m: (m / "model.safetensors").write_bytes(b"other"), "Hash mismatch for 'model.safetensors'"),
    (lambda m: (m / "added.json").write_text("{}"), "Extra files found in model 'model': added.json"),
    (lambda m: (m / "config.json").unlink(), "Missing files in model 'model': config.json"),
])
def test_any_change_to_a_signed_model_is_one_clear_line(tmp_path, change, expected):
    model, signature, _, public = signed_model(tmp_path)
    change(model)
    with pytest.raises(SignatureError) as failure:
        verify_model(model, signature, public)
    assert expected in str(failure.value) and "\n" not in str(failure.value)


def test_another_key_does_not_verify(tmp_path):
    model, signature, _, _ = signed_model(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SignatureError, match="Key mismatch"):
        verify_model(model, signature, key_pair(other)[1])


def test_an_oci_source_needs_a_key_unless_verification_is_off(tmp_path):
    with pytest.raises(ModelSourceError, match="NIM_DISABLE_MODEL_DOWNLOAD=1"):
        locate_model("oci://127.0.0.1:9/m:v1", cache_path=tmp_path, base_dir=None, name="m", allow_download=False,
                     trust=Trust(True, None))
    with pytest.raises(ModelSourceError, match="expected"):
        locate_model("oci://m:v1", cache_path=tmp_path, base_dir=None, name="m", allow_download=True,
                     trust=Trust(True, None))


def test_model_push_takes_a_directory_or_a_specs_local_source(tmp_path, tiny_model_dir):
    assert model_to_push(tiny_model_dir) == (tiny_model_dir.resolve(), tiny_model_dir.resolve().name, None)
    spec = tmp_path / "m.yaml"
    spec.write_text(f"""apiVersion: inferkiln/v1
kind: ModelSpec
metadata: {{name: tiny, version: 1.2.0}}
model: {{source: "local://{tiny_model_dir}"}}
profiles: [{{engine: torch, precision: fp32, tp: 1, gpu: cpu}}]
""")
    assert model_to_push(spec) == (tiny_model_dir, "tiny", "1.2.0")
    with pytest.raises(InputError, match="not a model directory"):
        model_to_push(tmp_path)


def certificate_authority(directory: Path, name: str = "ca") -> tuple[Path, Path, Path]:
    """A CA certificate, and a code-signing certificate it issued with that certificate's key."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def named(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    usage = dict(content_commitment=False, key_encipherment=False, data_encipherment=False, key_agreement=False,
                 encipher_only=False, decipher_only=False)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def issue(subject: str, public, **extensions) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(named(subject)).issuer_name(named(name)).public_key(public)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=30)))
        for extension, critical in extensions.values():
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(ca_key, hashes.SHA256())

    ca = issue(name, ca_key.public_key(), basic=(x509.BasicConstraints(ca=True, path_length=None), True),
               usage=(x509.KeyUsage(digital_signature=False, key_cert_sign=True, crl_sign=True, **usage), True))
    leaf = issue("model-signer", key.public_key(),
                 usage=(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, **usage), True),
                 eku=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), False))
    paths = directory / f"{name}.pem", directory / f"{name}-leaf.pem", directory / f"{name}-leaf-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_a_certificate_signature_verifies_against_its_ca_only(tmp_path):
    from model_signing import signing

    model, _, _, public = signed_model(tmp_path)
    ca, leaf, key = certificate_authority(tmp_path)
    signature = tmp_path / "cert.sig"
    signing.Config().use_certificate_signer(private_key=key, signing_certificate=leaf,
                                            certificate_chain=[ca]).sign(model, signature)
    assert verify_model(model, signature, ca) == key_identity(ca)
    with pytest.raises(SignatureError, match="made with a certificate, but .* holds a key"):
        verify_model(model, signature, public)
    other, _, _ = certificate_authority(tmp_path, "other-ca")
    with pytest.raises(SignatureError):
        verify_model(model, signature, other)
    (model / "config.json").write_text('{"changed": true}')
    with pytest.raises(SignatureError, match="Hash mismatch for 'config.json'"):
        verify_model(model, signature, ca)


def test_a_registry_that_answers_other_content_is_refused(tmp_path):
    """A test double of a registry (real HTTP on loopback) that answers a manifest and a blob other
    than the digests asked for: a fault a real registry cannot be made to commit."""
    import hashlib
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from service.modelpack import pull_model

    blob = b"weights"
    layer = {"mediaType": WEIGHT, "digest": "sha256:" + hashlib.sha256(b"other").hexdigest(), "size": len(blob),
             "annotations": {"org.cncf.model.filepath": "model.safetensors"}}
    config = json.dumps({"modelfs": {"type": "layers", "diffIds": [layer["digest"]]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "artifactType": "application/vnd.cncf.model.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.cncf.model.config.v1+json", "size": len(config),
                                      "digest": "sha256:" + hashlib.sha256(config).hexdigest()},
                           "layers": [layer]}).encode()
    served = {"manifest": manifest}

    class Registry(BaseHTTPRequestHandler):
        def do_GET(self):
            if "/manifests/" in self.path:
                body = served["manifest"]
            elif self.path.endswith(hashlib.sha256(config).hexdigest()):
                body = config
            else:
                body = blob  # not the content of the digest asked for
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        registry = f"127.0.0.1:{server.server_address[1]}"
        pinned = Ref.parse(f"{registry}/m@sha256:" + hashlib.sha256(manifest).hexdigest())
        with pytest.raises(OciError, match="arrived with other content"):
            pull_model(pinned, tmp_path / "a")
        assert not (tmp_path / "a" / "model.safetensors").exists()
        served["manifest"] = manifest + b" "
        with pytest.raises(OciError, match="answered a manifest of digest"):
            pull_model(pinned, tmp_path / "b")
        located = pytest.raises(ModelSourceError, locate_model, f"oci://{pinned}", cache_path=tmp_path / "cache",
                                base_dir=None, name="m", allow_download=True, trust=Trust(False, None))
        assert str(pinned.digest) in str(located.value) and "answered a manifest" in str(located.value)
    finally:
        server.shutdown()
