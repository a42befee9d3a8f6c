"""Model specs, rendering and pipeline files: pure logic, no Docker."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from factory.chart.render import model_values
from factory.cli import app
from factory.image.context import model_manifest, runtime_dockerfile, runtime_flavor
from factory.image.flavors import CUDA_LEFT_OUT, DEBIAN_BASE_IMAGE, FLAVORS
from factory.pipeline.files import PipelineError, load_pipeline
from factory.pipeline.runner import Runner
from factory.spec import SpecError, load_spec
from service import image_contract as contract

SAMPLE = Path(__file__).parents[2] / "pipelines" / "models" / "tiny-llama.yaml"


def write_spec(tmp_path: Path, model_dir: Path, **changes) -> Path:
    data = yaml.safe_load(SAMPLE.read_text())
    data["model"]["source"] = f"local://{model_dir}"
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if value is None:
            node.pop(last)
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_sample_spec_is_valid(tiny_model_dir, tmp_path):
    loaded = load_spec(write_spec(tmp_path, tiny_model_dir))
    assert loaded.spec.metadata.name == "tiny-llama" and loaded.spec.served_name == "tiny-llama"
    assert loaded.local_source() == tiny_model_dir


OCI = "oci://127.0.0.1:5000/models/tiny:0.1.0@sha256:" + "a" * 64


@pytest.mark.parametrize("changes,field,words", [
    ({"apiVersion": "inferkiln/v2"}, "apiVersion", "'inferkiln/v1'"),
    ({"metadata.name": "Tiny_Llama"}, "metadata.name", "lower-case"),
    ({"metadata.version": "one"}, "metadata.version", "semantic version"),
    ({"model.source": "s3://bucket/x"}, "model.source", "local://<dir>, hf://org/name[@revision] or oci://"),
    ({"model.source": "oci://r.io/m:v1"}, "model.source", "an oci:// source is named by digest"),
    ({"model.source": OCI}, "model", "bake: an oci:// model is pulled into the cache at start"),
    ({"model.source": OCI, "model.bake": False}, "model", "verify_key: an oci:// model is served only once"),
    ({"model.verify_key": "absent.pem"}, "model.verify_key", "no file at"),
    ({"runtime.flavor": "tpu"}, "runtime.flavor", "'cpu', 'vllm-cpu' or 'cuda'"),
    ({"profiles.0.engine": "vllm"}, "profiles.0.engine", "runtime.flavor 'cpu' runs torch; got 'vllm'"),
    ({"profiles.0.precision": "fp7"}, "profiles.0.precision", "one of"),
    ({"profiles.0.tp": 0}, "profiles.0.tp", "greater than or equal to 1"),
    ({"profiles.0.engine_args": {"speculative_config": {"method": "eagle", "num_speculative_tokens": 3}}},
     "profiles.0.engine_args", "speculates with n-grams only"),
    ({"profiles.0.engine_args": {"speculative_config": {"method": "ngram"}}}, "profiles.0.engine_args",
     "num_speculative_tokens"),
    ({"profiles.0.engine_args": {"compile_decode": "yes"}}, "profiles.0.engine_args", "true or false"),
    ({"profiles.0.precision": "fp16", "profiles.0.engine_args": {"compile_decode": True}}, "profiles.0.engine_args",
     "fp32 and bf16 decode steps on CPU only"),
    ({"resources.memory": "lots"}, "resources.memory", "Kubernetes quantity"),
    ({"tests.accuracy.min_exact_match": 2}, "tests.accuracy.min_exact_match", "less than or equal to 1"),
    ({"tests.accuracy.tasks": [{"name": "gsm8k", "min": 1.5}]}, "tests.accuracy.tasks.0.min", "less than or equal to 1"),
    ({"tests.accuracy.tasks": [{"name": "gsm8k"}]}, "tests.accuracy.tasks.0.min", "required"),
    ({"metadata.colour": "blue"}, "metadata.colour", "unknown field"),
    ({"profiles": None}, "profiles", "required"),
])
def test_bad_specs_name_file_field_and_expectation(tiny_model_dir, tmp_path, changes, field, words):
    path = write_spec(tmp_path, tiny_model_dir, **changes)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    line = next(line for line in err.value.lines if f": {field}:" in line)
    assert line.startswith(str(path)) and words in line, err.value.lines


def test_missing_weights_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="no model directory"):
        load_spec(write_spec(tmp_path, tmp_path / "absent"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("apiVersion: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(broken)


def test_validate_command_exit_codes(tiny_model_dir, tmp_path):
    good = write_spec(tmp_path, tiny_model_dir)
    result = CliRunner().invoke(app, ["validate", str(good)])
    assert result.exit_code == 0 and "ok (tiny-llama 0.1.0)" in result.output
    bad = write_spec(tmp_path, tiny_model_dir, **{"runtime.flavor": "tpu"})
    result = CliRunner().invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2 and "runtime.flavor" in result.output


def test_render_writes_the_contexts_build_builds(tiny_model_dir, tmp_path):
    contexts, chart = Runner(write_spec(tmp_path, tiny_model_dir)).render(tmp_path / "out")
    runtime = (contexts.runtime_dir / "Dockerfile").read_text()
    assert runtime.startswith(f"FROM {DEBIAN_BASE_IMAGE}\n") and "AS build" not in runtime, "one stage"
    assert f"USER {contract.UID}:{contract.UID}" in runtime and 'ENTRYPOINT ["nim-serve"]' in runtime
    assert "--no-index" in runtime and "--require-hashes" in runtime, "the lock, from the wheelhouse alone"
    lock = (contexts.runtime_dir / "requirements.lock").read_text()
    assert "torch==2.13.0+cpu" in lock and "--hash=sha256:" in lock
    assert (contexts.runtime_dir / "service" / "__main__.py").is_file()
    assert not (contexts.runtime_dir / "factory").exists(), "the runtime image holds the runtime, not the factory"
    model = (contexts.model_dir / "Dockerfile").read_text()
    assert f"FROM {contexts.plan.runtime_reference}" in model, "the model builds on the runtime build would make"
    assert "COPY model/ /opt/nim/model/" in model and '"io.inferkiln.spec-digest"' in model
    assert (contexts.model_dir / "model" / "model.safetensors").is_file()
    manifest = yaml.safe_load((contexts.model_dir / "model_manifest.yaml").read_text())
    assert manifest["model"]["source"] == "local:///opt/nim/model"
    assert [p["name"] for p in manifest["profiles"]] == ["torch-fp32-tp1-cpu-latency", "torch-bf16-tp1-any-latency"]
    assert (chart / "Chart.yaml").is_file()


def test_cuda_flavor_renders_on_our_base_with_its_lock_and_the_toolkits_env(tiny_model_dir, tmp_path):
    loaded = load_spec(write_spec(tmp_path, tiny_model_dir, **{"runtime.flavor": "cuda"}))
    flavor = runtime_flavor(loaded)
    dockerfile = runtime_dockerfile(flavor)
    assert dockerfile.startswith(f"FROM {FLAVORS['vllm-cpu'].base_image}\n"), "the vLLM flavors share a base"
    assert "nvcr.io" not in dockerfile and "apt-get" not in dockerfile
    assert 'ENV NVIDIA_DRIVER_CAPABILITIES="compute,utility"' in dockerfile
    assert 'ENV NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in dockerfile  # the lock's nvidia-cuda-runtime 13.0.x
    lock = flavor.lock_path.read_text()
    assert "vllm==" in lock and "nvidia-cuda-runtime==13.0." in lock
    assert all(f"\n{name}==" not in lock for name in CUDA_LEFT_OUT), "left-out packages stay out of the lock"
    assert "rm -rf" in dockerfile and "triton/backends/nvidia/lib/cupti" in dockerfile
    assert f"CUDA_HOME=\"{contract.VENV}/lib/python3.11/site-packages/nvidia/cu13\"" in dockerfile
    assert 'ENV NVIDIA_VISIBLE_DEVICES' not in runtime_dockerfile(FLAVORS["vllm-cpu"])
    custom = load_spec(write_spec(tmp_path, tiny_model_dir, **{"runtime.flavor": "cuda",
                                                                 "runtime.base_image": "registry.example/base:1"}))
    assert runtime_dockerfile(runtime_flavor(custom)).startswith("FROM registry.example/base:1\n")


def test_unbaked_model_keeps_its_source(tiny_model_dir, tmp_path):
    loaded = load_spec(write_spec(tmp_path, tiny_model_dir, **{"model.bake": False}))
    assert model_manifest(loaded).model.source == f"local://{tiny_model_dir}"


def test_a_model_free_image_carries_the_key_and_its_chart_fills_the_cache(tiny_model_dir, tmp_path):
    (tmp_path / "pub.pem").write_text("-----BEGIN PUBLIC KEY-----\n")
    path = write_spec(tmp_path, tiny_model_dir, **{"model.source": OCI, "model.bake": False,
                                                   "model.verify_key": "pub.pem"})
    contexts, chart = Runner(path).render(tmp_path / "out")
    model = (contexts.model_dir / "Dockerfile").read_text()
    assert "COPY model/" not in model and not (contexts.model_dir / "model").exists()
    assert f"COPY verify-key.pem {contract.MODEL_VERIFY_KEY}" in model
    assert f'ENV NIM_MODEL_VERIFY_KEY="{contract.MODEL_VERIFY_KEY}"' in model
    assert yaml.safe_load((contexts.model_dir / "model_manifest.yaml").read_text())["model"]["source"] == OCI
    values = yaml.safe_load((chart / "values.yaml").read_text())
    assert values["modelStore"] | {"verifyKey": None} == {"initContainer": True, "source": OCI, "verify": True,
                                                          "imageVolume": False, "verifyKey": None}
    other_key = Runner(write_spec(tmp_path, tiny_model_dir, **{
        "model.source": OCI, "model.bake": False, "model.verify_key": "pub.pem"})).plan().model_digest
    (tmp_path / "pub.pem").write_text("-----BEGIN PUBLIC KEY-----\nother\n")
    assert Runner(path).plan().model_digest != other_key, "the key is an input of the image"


def test_chart_values_follow_the_spec(tiny_model_dir, tmp_path):
    loaded = load_spec(write_spec(tmp_path, tiny_model_dir, **{"resources.gpus": 2,
                                                                 "chart.values": {"replicaCount": 3}}))
    values = model_values(loaded, "registry/inferkiln/tiny-llama", "0.1.0-abc")
    assert values["image"] == {"repository": "registry/inferkiln/tiny-llama", "tag": "0.1.0-abc",
                               "pullPolicy": "IfNotPresent", "digest": ""}
    assert values["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert values["resources"]["limits"]["cpu"] == values["resources"]["requests"]["cpu"] == "2"
    assert values["tolerations"] == [] and values["shmSize"] == "16Gi"  # the chart adds the toleration, once
    assert values["replicaCount"] == 3 and values["model"]["name"] == "tiny-llama"


def test_pipeline_files(tmp_path):
    loaded = load_pipeline(Path(__file__).parents[2] / "pipelines" / "tiny.yaml")
    assert loaded.pipeline.stages == ["validate", "build", "chart", "test", "publish"]
    assert loaded.spec_paths()[0].name == "tiny-llama.yaml"
    bad = tmp_path / "p.yaml"
    bad.write_text("apiVersion: inferkiln/v1\nkind: Pipeline\nspecs: [a.yaml]\nstages: [bake]\n")
    with pytest.raises(PipelineError, match="stages.0"):
        load_pipeline(bad)


@pytest.mark.parametrize("command", [["validate"], ["render", "-o", "out"], ["chart"], ["build"]])
@pytest.mark.parametrize("make,words", [
    (lambda d: d, "is a directory"),
    (lambda d: (d / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1")) and d / "latin1.yaml", "not UTF-8"),
    (lambda d: d / "absent.yaml", "file not found"),
])
def test_a_spec_path_that_is_no_spec_file_is_one_line_and_exit_2(tmp_path, command, make, words):
    path = make(tmp_path)
    result = CliRunner().invoke(app, [*command[:1], str(path), *command[1:]], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
