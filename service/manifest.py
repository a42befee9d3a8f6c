"""The model manifest (`model_manifest.yaml`): the model and the profiles an image can run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Engine = Literal["torch", "vllm", "sglang", "tensorrt_llm"]
Precision = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4"]


class ManifestError(ValueError):
    """The manifest is missing or invalid; the message names the file and the field."""


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    source: str = Field(min_length=1, description="local://<dir> (relative to the manifest) or hf://org/name[@rev]")
    revision: str | None = None
    license: str | None = None


class ProfileTags(BaseModel):
    model_config = ConfigDict(extra="allow")

    engine: Engine
    precision: Precision
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    gpu: str = Field(default="cpu", description="cpu, any, or a GPU kind such as h100")
    profile: Literal["latency", "throughput"] = "latency"

    def canonical(self) -> str:
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))


def profile_id(tags: ProfileTags) -> str:
    return hashlib.sha256(tags.canonical().encode()).hexdigest()


def profile_name(tags: ProfileTags) -> str:
    return f"{tags.engine}-{tags.precision}-tp{tags.tp}-{tags.gpu}-{tags.profile}"


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = ""
    name: str = ""
    tags: ProfileTags
    engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _derive_names(self) -> Profile:
        self.id = self.id or profile_id(self.tags)
        self.name = self.name or profile_name(self.tags)
        return self


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal["1"] = "1"
    model: ModelInfo
    profiles: list[Profile] = Field(min_length=1)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def load_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: manifest not found (set NIM_MANIFEST_PATH or --model)") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        lines = [f"{path}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ManifestError("\n".join(lines)) from None


def default_manifest(model_dir: Path, name: str | None = None, source: str | None = None) -> Manifest:
    """A manifest for a plain Hugging Face directory: one torch profile per device kind."""
    cpu = ProfileTags(engine="torch", precision="fp32", gpu="cpu", profile="latency")
    gpu = ProfileTags(engine="torch", precision="bf16", gpu="any", profile="latency")
    return Manifest(
        model=ModelInfo(name=name or model_dir.name, source=source or f"local://{model_dir.resolve()}"),
        profiles=[Profile(tags=cpu, engine_args={"max_num_seqs": 32}),
                  Profile(tags=gpu, engine_args={"max_num_seqs": 64})],
    )
