"""Models as signed OCI artifacts against the real local registry (CNCF Distribution): push, sign,
verify, and the runtime serving an `oci://` source only when its signature checks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from factory.model.push import push_model
from factory.model.signing import sign_artifact
from factory.stack import ensure_registry
from service.launcher import ServerProcess
from service.model_signature import key_identity
from service.modelpack import ARTIFACT_TYPE, CONFIG_TYPE, FILEPATH, SIGNATURE_TYPE, WEIGHT, WEIGHT_CONFIG
from service.oci import MANIFEST_TYPE, Ref, add_referrer, file_descriptor, get_manifest, push_blob, put_manifest, referrers
from tests.unit.test_model_artifacts import certificate_authority, key_pair


@pytest.fixture(scope="module")
def registry() -> str:
    return ensure_registry()


@pytest.fixture
def repo(registry) -> Ref:
    return Ref.parse(f"{registry}/test-models/tiny-{uuid.uuid4().hex[:8]}:v1")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    return key_pair(tmp_path_factory.mktemp("keys"))


def inferkiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "factory.cli", *args], capture_output=True, text=True, timeout=300)


def service(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_push_makes_a_modelpack_artifact_and_sends_only_changed_files(repo, tiny_model_dir, tmp_path):
    result = inferkiln("model", "push", str(tiny_model_dir), "--to", str(repo))
    assert result.returncode == 0, result.stderr
    pinned = Ref.parse(result.stdout.strip().splitlines()[-1])
    assert pinned.tag == "v1" and pinned.digest
    manifest, digest, _ = get_manifest(pinned)
    assert digest == pinned.digest and manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"]["mediaType"] == CONFIG_TYPE
    kinds = {layer["annotations"][FILEPATH]: layer["mediaType"] for layer in manifest["layers"]}
    assert kinds["model.safetensors"] == WEIGHT and kinds["config.json"] == WEIGHT_CONFIG
    assert set(kinds) == {p.name for p in tiny_model_dir.iterdir()}
    # the same files again: nothing sent, the same digest (the artifact is a function of its files)
    again = push_model(tiny_model_dir, repo, tiny_model_dir.resolve().name)
    assert again.bytes_sent == 0 and again.ref.digest == pinned.digest
    # a second version that changes one file sends that file only
    changed = tmp_path / "v2"
    shutil.copytree(tiny_model_dir, changed)
    (changed / "generation_config.json").write_text('{"temperature": 0.5}')
    second = push_model(changed, repo.tagged("v2"), "tiny")
    assert second.bytes_sent == (changed / "generation_config.json").stat().st_size
    assert second.ref.digest != pinned.digest


def test_sign_and_verify_through_the_cli(repo, tiny_model_dir, keys, tmp_path):
    private, public = keys
    pinned = push_model(tiny_model_dir, repo, "tiny").ref
    unsigned = inferkiln("model", "verify", str(repo), "--key", str(public))
    assert unsigned.returncode == 1 and "no signature" in unsigned.stderr
    signed = inferkiln("model", "sign", str(repo), "--key", str(private))
    assert signed.returncode == 0, signed.stderr
    [signature] = referrers(pinned, SIGNATURE_TYPE)
    assert signature["annotations"]["io.inferkiln.model-signing.key"].startswith("sha256:")
    verified = inferkiln("model", "verify", str(repo), "--key", str(public), "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["artifact"] == f"{repo.name}@{pinned.digest}"
    other = tmp_path / "other"
    other.mkdir()
    wrong = inferkiln("model", "verify", str(repo), "--key", str(key_pair(other)[1]))
    assert wrong.returncode == 1 and "Key mismatch" in wrong.stderr
    bad_ref = inferkiln("model", "verify", "no-registry-here", "--key", str(public))
    assert bad_ref.returncode == 2 and "expected" in bad_ref.stderr


def test_sign_as_a_certificate_and_verify_against_its_ca(repo, tiny_model_dir, tmp_path):
    ca, leaf, key = certificate_authority(tmp_path)
    push_model(tiny_model_dir, repo, "tiny")
    signed = inferkiln("model", "sign", str(repo), "--key", str(key), "--cert", str(leaf), "--chain", str(ca), "--json")
    assert signed.returncode == 0, signed.stderr
    assert json.loads(signed.stdout)["key"] == key_identity(ca)
    verified = inferkiln("model", "verify", str(repo), "--key", str(ca))
    assert verified.returncode == 0, verified.stderr
    other = certificate_authority(tmp_path, "other-ca")[0]
    assert inferkiln("model", "verify", str(repo), "--key", str(other)).returncode == 1


def test_the_runtime_serves_a_verified_artifact_from_its_cache(repo, tiny_model_dir, keys, tmp_path):
    private, public = keys
    pinned = push_model(tiny_model_dir, repo, "tiny").ref
    sign_artifact(pinned, private)
    env = {"NIM_CACHE_PATH": str(tmp_path / "cache"), "NIM_MODEL_VERIFY_KEY": str(public),
           "NIM_MANIFEST_PATH": str(tmp_path / "none.yaml")}
    source = f"oci://{repo.name}@{pinned.digest}"
    fetched = service("download-to-cache", "--model", source, env=env)
    assert fetched.returncode == 0, fetched.stderr
    cached = Path(fetched.stdout.strip().splitlines()[-1])
    assert (cached / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    # serving reuses the cache: the registry is not asked again (downloads forbidden)
    with ServerProcess(["--model", source], env={**env, "NIM_DISABLE_MODEL_DOWNLOAD": "1"},
                       log_path=tmp_path / "serve.log") as server:
        verification = httpx.get(server.url + "/v1/metadata").json()["modelVerification"]
        assert verification["status"] == "verified" and verification["artifact"] == source
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="The", max_tokens=4).usage.completion_tokens > 0
    # a file changed in the cache after it was verified is found on the next start
    with (cached / "model.safetensors").open("r+b") as weights:
        weights.seek(-1, os.SEEK_END)
        last = weights.read(1)
        weights.seek(-1, os.SEEK_END)
        weights.write(bytes([last[0] ^ 0xFF]))
    refused = service("serve", "--model", source, "--port", "0", env=env)
    assert refused.returncode == 1
    [line] = refused.stderr.strip().splitlines()[-1:]
    assert source in line and "Hash mismatch for 'model.safetensors'" in line


def push_altered(model_dir: Path, repo: Ref, scratch: Path) -> Ref:
    """The model with one weight changed, pushed under the same tag (and not signed)."""
    altered = scratch / "altered"
    shutil.copytree(model_dir, altered)
    with (altered / "model.safetensors").open("r+b") as weights:
        weights.seek(-4, os.SEEK_END)
        weights.write(b"\x00\x00\x80\x7f")
    return push_model(altered, repo, "tiny").ref


def test_a_mounted_artifact_is_verified_in_place_and_not_pulled(repo, tiny_model_dir, keys, tmp_path):
    """NIM_MODEL_MOUNT: the files a kubelet mounted (an image volume; a copy here) are served after
    the signature, the only thing pulled, checks them; a changed mounted file is refused."""
    private, public = keys
    pinned = push_model(tiny_model_dir, repo, "tiny").ref
    sign_artifact(pinned, private)
    mount = tmp_path / "mounted"
    shutil.copytree(tiny_model_dir, mount)
    source = f"oci://{repo.name}@{pinned.digest}"
    env = {"NIM_CACHE_PATH": str(tmp_path / "cache"), "NIM_MODEL_VERIFY_KEY": str(public),
           "NIM_MANIFEST_PATH": str(tmp_path / "none.yaml"), "NIM_MODEL_MOUNT": str(mount)}
    fetched = service("download-to-cache", "--model", source, env=env)
    assert fetched.returncode == 0, fetched.stderr
    assert Path(fetched.stdout.strip().splitlines()[-1]) == mount
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == ["model.sig"]
    with ServerProcess(["--model", source], env=env, log_path=tmp_path / "serve.log") as server:
        assert httpx.get(server.url + "/v1/metadata").json()["modelVerification"]["status"] == "verified"
    (mount / "tokenizer_config.json").write_text("{}")
    refused = service("serve", "--model", source, env=env)
    assert refused.returncode == 1 and f"(mounted at {mount})" in refused.stderr
    assert "Hash mismatch for 'tokenizer_config.json'" in refused.stderr


def test_weights_altered_in_the_registry_are_refused(repo, tiny_model_dir, keys, tmp_path):
    """The same tag pushed again with other weights and not re-signed: no signature; with the old
    signature copied onto it (as an attacker could), a mismatch."""
    private, public = keys
    original = push_model(tiny_model_dir, repo, "tiny").ref
    sign_artifact(original, private)
    moved = push_altered(tiny_model_dir, repo, tmp_path)
    env = {"NIM_CACHE_PATH": str(tmp_path / "cache"), "NIM_MODEL_VERIFY_KEY": str(public),
           "NIM_MANIFEST_PATH": str(tmp_path / "none.yaml")}
    unsigned = service("serve", "--model", f"oci://{repo}", env=env)
    assert unsigned.returncode == 1 and f"{moved.digest}: no signature" in unsigned.stderr
    [old] = referrers(original, SIGNATURE_TYPE)
    add_referrer(moved, old)
    shutil.rmtree(tmp_path / "cache")
    forged = service("serve", "--model", f"oci://{repo}", env=env)
    assert forged.returncode == 1 and "Hash mismatch for 'model.safetensors'" in forged.stderr
    # verification off: served, and said so
    with ServerProcess(["--model", f"oci://{repo}"], env={**env, "NIM_MODEL_VERIFY": "0"},
                       log_path=tmp_path / "serve.log") as server:
        assert httpx.get(server.url + "/v1/metadata").json()["modelVerification"] == {
            "status": "disabled", "artifact": f"oci://{repo.name}@{moved.digest}"}
    assert "model verification is off" in (tmp_path / "serve.log").read_text()


def test_a_layer_path_that_leaves_the_cache_is_refused(repo, tmp_path, keys):
    """A hostile manifest whose file path climbs out of the model directory: nothing is written."""
    blob = tmp_path / "x"
    blob.write_bytes(b"x")
    layer = file_descriptor(blob, WEIGHT) | {"annotations": {FILEPATH: "../../escaped"}}
    push_blob(repo, blob, layer)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"modelfs": {"type": "layers", "diffIds": [layer["digest"]]}}))
    config_blob = file_descriptor(config, CONFIG_TYPE)
    push_blob(repo, config, config_blob)
    put_manifest(repo, {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "artifactType": ARTIFACT_TYPE,
                        "config": config_blob, "layers": [layer]})
    env = {"NIM_CACHE_PATH": str(tmp_path / "cache"), "NIM_MODEL_VERIFY_KEY": str(keys[1]),
           "NIM_MANIFEST_PATH": str(tmp_path / "none.yaml")}
    result = service("download-to-cache", "--model", f"oci://{repo}", env=env)
    assert result.returncode == 1 and "no usable file path" in result.stderr
    assert not list(tmp_path.rglob("escaped"))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def oci_spec(directory: Path, source: str, public: Path) -> Path:
    shutil.copyfile(public, directory / "model-signing.pub")
    spec = directory / "tiny-oci.yaml"
    spec.write_text(f"""apiVersion: inferkiln/v1
kind: ModelSpec
metadata: {{name: tiny-oci, version: 0.1.0}}
model: {{source: "oci://{source}", served_name: tiny-llama, bake: false, verify_key: model-signing.pub}}
runtime: {{flavor: cpu}}
profiles: [{{engine: torch, precision: fp32, tp: 1, gpu: cpu}}]
resources: {{gpus: 0, cpu: "2", memory: 4Gi}}
""")
    return spec


@pytest.mark.slow
def test_a_model_free_image_serves_through_its_charts_init_container(local_stack, repo, tiny_model_dir, keys,
                                                                      tmp_path):
    """`bake: false`: the image holds no weights; the chart's init container pulls and verifies them
    into the cache the server mounts. Weights altered under the same tag and not re-signed never serve."""
    private, public = keys
    pinned = push_model(tiny_model_dir, repo, "tiny").ref
    sign_artifact(pinned, private)
    spec = oci_spec(tmp_path, str(pinned), public)
    served = inferkiln("chart", "run", str(spec), "--json")
    assert served.returncode == 0, served.stderr[-3000:]
    result = json.loads(served.stdout)
    assert result["initContainer download-to-cache"] == "completed"
    assert all(result[p].endswith(": ok") for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    moved = push_altered(tiny_model_dir, repo, tmp_path)
    assert moved.tag == pinned.tag and moved.digest != pinned.digest
    refused = inferkiln("chart", "run", str(oci_spec(tmp_path, str(moved), public)))
    assert refused.returncode == 1
    assert f"{moved.digest}: no signature" in refused.stderr and "readinessProbe" not in refused.stdout
    # the same release with the artifact mounted as an image volume (chart run stands in for the kubelet)
    mounted = inferkiln("chart", "run", str(oci_spec(tmp_path, str(pinned), public)), "--set",
                        "modelStore.imageVolume=true", "--json")
    assert mounted.returncode == 0, mounted.stderr[-3000:]
    assert json.loads(mounted.stdout)["readinessProbe"].endswith(": ok")


def test_a_spec_bakes_an_oci_adapter_only_once_it_verifies(repo, tiny_model_dir, keys, tmp_path):
    """A LoRA adapter pushed as a ModelPack artifact and signed: a spec naming it by digest gets its
    files (pulled, verified, checked against the model); with another key, an error naming the field."""
    import yaml

    from factory.errors import InputError
    from factory.image.context import adapter_dirs
    from factory.spec import load_spec
    from factory.tinymodel.adapter import random_adapter

    private, public = keys
    adapter = random_adapter(tiny_model_dir, tmp_path / "adapter", 4, ["q_proj"], seed=2)
    pushed = push_model(adapter, repo, "adapter").ref
    assert inferkiln("model", "sign", str(repo), "--key", str(private)).returncode == 0

    def spec_with(key: Path) -> Path:
        path = tmp_path / f"spec-{key.parent.name}.yaml"
        path.write_text(yaml.safe_dump({
            "apiVersion": "inferkiln/v1", "kind": "ModelSpec", "metadata": {"name": "with-oci-adapter", "version": "0.1.0"},
            "model": {"source": f"local://{tiny_model_dir}"}, "profiles": [{"engine": "torch"}],
            "adapters": [{"name": "signed", "source": f"oci://{pushed.name}@{pushed.digest}", "verify_key": str(key)}]}))
        return path

    dirs = adapter_dirs(load_spec(spec_with(public)))
    assert sorted(p.name for p in dirs["signed"].iterdir()) == sorted(p.name for p in adapter.iterdir())
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(InputError, match="adapters.0.source: .*Key mismatch"):
        adapter_dirs(load_spec(spec_with(key_pair(other)[1])))
