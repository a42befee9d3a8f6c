"""Model sources: local paths, local:// relative to the manifest, hf:// through the hub cache."""

import os
import subprocess
import sys

import pytest

from service.model_store import ModelSourceError, download_to_cache, parse_hf, resolve_model


def make_model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_plain_and_local_paths(tmp_path):
    model = make_model_dir(tmp_path / "m")
    assert resolve_model(str(model), cache_path=tmp_path / "cache") == model
    assert resolve_model("local://m", cache_path=tmp_path / "cache", base_dir=tmp_path) == model


def test_local_source_falls_back_to_cache_copy(tmp_path):
    model = make_model_dir(tmp_path / "m")
    cached = download_to_cache("local://m", cache_path=tmp_path / "cache", base_dir=tmp_path, name="tiny")
    assert (cached / "config.json").is_file() and cached != model
    (model / "config.json").unlink()
    assert resolve_model("local://m", cache_path=tmp_path / "cache", base_dir=tmp_path, name="tiny") == cached


def test_missing_local_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelSourceError, match="no model directory"):
        resolve_model("local://absent", cache_path=tmp_path, base_dir=tmp_path)


@pytest.mark.parametrize("source,expected", [("hf://org/name", ("org/name", None)),
                                             ("hf://org/name@v1.2", ("org/name", "v1.2"))])
def test_parse_hf(source, expected):
    assert parse_hf(source) == expected


@pytest.mark.parametrize("source", ["hf://justname", "hf://a/b/c", "hf:///x"])
def test_bad_hf_sources(source):
    with pytest.raises(ModelSourceError, match="expected hf://org/name"):
        parse_hf(source)


def test_hf_with_downloads_disabled_fails_clearly(tmp_path):
    with pytest.raises(ModelSourceError, match="NIM_DISABLE_MODEL_DOWNLOAD=1"):
        resolve_model("hf://org/model", cache_path=tmp_path, allow_download=False)


def test_hf_is_served_from_a_populated_cache_offline(tmp_path):
    """The standard hub cache layout under NIM_CACHE_PATH is used without any network."""
    revision = "0" * 40
    repo = tmp_path / "huggingface" / "models--org--model"
    snapshot = make_model_dir(repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    assert resolve_model("hf://org/model", cache_path=tmp_path, allow_download=False) == snapshot


def test_download_to_cache_cli_with_unreachable_hub(tmp_path):
    """No hub is reachable on these machines: the command must fail with a clear line, not hang."""
    env = {**os.environ, "NIM_CACHE_PATH": str(tmp_path), "HF_HUB_ETAG_TIMEOUT": "3", "HF_HUB_DOWNLOAD_TIMEOUT": "3"}
    result = subprocess.run([sys.executable, "-m", "service", "download-to-cache", "--model", "hf://org/model",
                             "--manifest", str(tmp_path / "none.yaml")], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 1 and "hf://org/model" in result.stderr and "could not download" in result.stderr


def test_download_to_cache_cli_copies_local_model(tiny_model_dir, tmp_path):
    env = {**os.environ, "NIM_CACHE_PATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "service", "download-to-cache", "--model", str(tiny_model_dir),
                             "--manifest", str(tmp_path / "none.yaml")], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "local" / "tiny-llama" / "model.safetensors").is_file()


def test_list_model_profiles_cli(tiny_model_dir, tmp_path):
    result = subprocess.run([sys.executable, "-m", "service", "list-model-profiles", "--model", str(tiny_model_dir),
                             "--manifest", str(tmp_path / "none.yaml")], capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 0
    compatible, incompatible = result.stdout.split("Incompatible with system:")
    assert "torch-fp32-tp1-cpu-latency" in compatible and "torch-bf16-tp1-any-latency" in incompatible


def test_serve_with_no_compatible_profile_exits_nonzero(tiny_model_dir, tmp_path):
    manifest = tmp_path / "model_manifest.yaml"
    manifest.write_text(f"schema_version: '1'\nmodel: {{name: m, source: 'local://{tiny_model_dir}'}}\n"
                        "profiles:\n  - tags: {engine: vllm, precision: bf16, gpu: h100}\n")
    result = subprocess.run([sys.executable, "-m", "service", "serve", "--manifest", str(manifest)],
                            capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 1
    assert "no compatible profile" in result.stderr and "vllm-bf16-tp1-h100-latency" in result.stderr
