"""A model image with a LoRA adapter baked beside the model: build, test stage gates, spec errors.

Slow (an image build); CI runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from factory.pipeline.runner import RunSettings, Runner
from factory.spec import SpecError, load_spec
from factory.stack import REGISTRY
from factory.tinymodel.adapter import ensure_tiny_adapter, random_adapter
from factory.verify.container import start_model
from service import image_contract as contract
from tests.integration.test_lora import served_then_gone

pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).parents[2] / "pipelines" / "models" / "tiny-llama-lora.yaml"


def lora_spec(directory: Path, model_dir: Path, adapter_dir: Path, **adapter) -> Path:
    data = yaml.safe_load(SAMPLE.read_text())
    data["metadata"]["name"] = "tiny-lora-test"
    data["model"]["source"] = f"local://{model_dir}"
    data["adapters"] = [{"name": "tiny-lora", "source": f"local://{adapter_dir}",
                         "dataset": str(adapter_dir / "eval.jsonl"), **adapter}]
    data["tests"]["accuracy"] = {}  # the adapter's gates are the point; the model's are test_factory's
    data["tests"]["perf"] = {"concurrency": [1], "requests_per_level": 8}
    path = directory / "tiny-lora-test.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_baked_adapter_is_served_and_gated_by_name_and_adapters_dropped_in_are_served(own_catalog, tiny_model_dir,
                                                                                       tmp_path):
    import docker

    client = docker.from_env()
    runner = Runner(lora_spec(tmp_path, tiny_model_dir, ensure_tiny_adapter("tiny-lora")),
                    RunSettings(registry=REGISTRY, report_dir=tmp_path / "report"))
    built = runner.build()
    env = dict(item.split("=", 1) for item in client.images.get(built.model.reference).attrs["Config"]["Env"])
    assert env["NIM_PEFT_SOURCE"] == contract.PEFT_DIR
    report = runner.test()
    gates = {gate.id: gate for gate in report.gates}
    assert gates["adapter.tiny-lora.listed"].passed, gates["adapter.tiny-lora.listed"].detail
    assert gates["accuracy.adapter.tiny-lora.exact_match"].passed, gates["accuracy.adapter.tiny-lora.exact_match"].detail
    assert "accuracy.adapter.tiny-lora.exact_match" in (report.report_dir / "summary.md").read_text()

    # the same image serving a directory of adapters that changes (NIM_PEFT_SOURCE on a volume)
    source = tmp_path / "peft"
    source.mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    made = random_adapter(tiny_model_dir, tmp_path / "made", 16, ["gate_proj", "down_proj", "v_proj"], seed=9)
    running = start_model(client, built.model.reference, env={"NIM_PEFT_SOURCE": "/opt/peft",
                                                              "NIM_PEFT_REFRESH_INTERVAL": "1"},
                          volumes={str(source): {"bind": "/opt/peft", "mode": "ro"}})
    try:
        served_then_gone(running.url, source, "dropped-in", made, tiny_model_dir)
    finally:
        running.stop()


def test_an_adapter_the_model_cannot_serve_is_a_spec_error_naming_the_field(tiny_model_dir, tmp_path):
    big = random_adapter(tiny_model_dir, tmp_path / "big", 128, ["q_proj"], seed=1)
    (big / "eval.jsonl").write_text("")
    with pytest.raises(SpecError) as error:
        load_spec(lora_spec(tmp_path, tiny_model_dir, big))
    assert f"adapters.0.source: {big}: rank 128 is above NIM_MAX_LORA_RANK=64" in str(error.value)
    with pytest.raises(SpecError, match="adapters.0.source: no PEFT adapter"):
        load_spec(lora_spec(tmp_path, tiny_model_dir, tmp_path / "nothing"))
