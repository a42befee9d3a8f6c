"""The model spec (`pipelines/models/*.yaml`), validated with pydantic.

Every error names the file, the field path and what was expected, one line each.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from factory.errors import InputError
from service.engine.ngram import NgramConfig
from service.manifest import Engine, Precision

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,51}[a-z0-9])?$")  # usable as image name, chart name and DNS label
SEMVER = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")
QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|Ki|M|Mi|G|Gi|T|Ti)?$")


class SpecError(InputError):
    """The spec is invalid; `lines` has one `file: field: problem` line per error."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _resource_name(value: str) -> str:
    if not NAME.match(value):
        raise ValueError("must be 1-53 lower-case letters, digits or '-', starting and ending alphanumeric")
    return value


ResourceName = Annotated[str, AfterValidator(_resource_name)]
OCI_PINNED = re.compile(r"^oci://[^/]+/[^@]+@sha256:[0-9a-f]{64}$")  # an artifact named by its digest


class Metadata(Strict):
    name: ResourceName = Field(description="lower-case letters, digits and '-'; names the image and the chart")
    version: str = Field(description="semantic version of this model's release, e.g. 0.1.0")

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not SEMVER.match(value):
            raise ValueError("must be a semantic version such as 0.1.0")
        return value


class ModelSource(Strict):
    source: str
    served_name: str | None = None
    license: str = "unknown"
    bake: bool = True
    # A public key (PEM file, relative to the spec) the model's signature must verify against; the
    # image carries it (NIM_MODEL_VERIFY_KEY). Needed by oci:// sources.
    verify_key: str | None = None
    # How the model writes tool calls, by vLLM's parser names (the image's NIM_TOOL_CALL_PARSER);
    # unset: the image serves no tool calls.
    tool_call_parser: Literal["hermes"] | None = None

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value.startswith("oci://"):
            if not OCI_PINNED.match(value):
                raise ValueError("an oci:// source is named by digest: oci://REGISTRY/REPO[:TAG]@sha256:<64 hex> "
                                 "(`inferkiln model push` prints it)")
            return value
        if not (value.startswith("local://") and len(value) > 8) and not re.match(r"^hf://[^/@]+/[^/@]+(@.+)?$", value):
            raise ValueError("must be local://<dir>, hf://org/name[@revision] or oci://REGISTRY/REPO@sha256:...")
        return value

    @model_validator(mode="after")
    def _oci_is_pulled_and_verified(self) -> ModelSource:
        if self.source.startswith("oci://") and self.bake:
            raise ValueError("bake: an oci:// model is pulled into the cache at start, not baked; set bake: false")
        if self.source.startswith("oci://") and not self.verify_key:
            raise ValueError("verify_key: an oci:// model is served only once its signature verifies; name the "
                             "public key (PEM) it was signed for")
        return self


class AdapterSpec(Strict):
    """A LoRA adapter served beside the model (NIM_PEFT_SOURCE), baked into the model image."""

    name: ResourceName = Field(description="the model id clients send for it; lower-case letters, digits and '-'")
    source: str = Field(description="local://<dir> (a PEFT adapter) or oci://REGISTRY/REPO@sha256:... "
                                    "(one pushed with `inferkiln model push`, pulled and verified at build)")
    verify_key: str | None = Field(None, description="PEM public key an oci:// adapter's signature must verify "
                                                     "against; default: model.verify_key")
    dataset: str | None = Field(None, description="JSONL of {prompt, completion} the adapter must complete, "
                                                  "relative to the spec: its own accuracy gate")
    min_exact_match: float = Field(0.9, ge=0, le=1)

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value.startswith("oci://"):
            if not OCI_PINNED.match(value):
                raise ValueError("an oci:// adapter is named by digest: oci://REGISTRY/REPO[:TAG]@sha256:<64 hex>")
        elif not (value.startswith("local://") and len(value) > 8):
            raise ValueError("must be local://<dir> or oci://REGISTRY/REPO@sha256:...")
        return value


class Runtime(Strict):
    flavor: Literal["cpu", "vllm-cpu", "cuda"] = "cpu"
    base_image: str | None = None


class ProfileSpec(Strict):
    engine: Engine = "torch"
    precision: Precision = "fp32"
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    gpu: str = "cpu"
    profile: Literal["latency", "throughput"] = "latency"
    engine_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("engine_args")
    @classmethod
    def _torch_args(cls, value: dict[str, Any], info) -> dict[str, Any]:
        """The torch engine reads `speculative_config` and `compile_decode` itself (vLLM checks its
        own arguments at start)."""
        torch = info.data.get("engine") == "torch"
        if torch and "speculative_config" in value:
            try:
                NgramConfig.model_validate(value["speculative_config"])
            except ValidationError as exc:
                raise ValueError(f"speculative_config: the torch engine speculates with n-grams only: {exc}") from exc
        if "compile_decode" in value:
            if not torch:
                raise ValueError("compile_decode: a torch engine setting (vLLM compiles by default: enforce_eager)")
            if not isinstance(value["compile_decode"], bool):
                raise ValueError(f"compile_decode: true or false, not {value['compile_decode']!r}")
            if value["compile_decode"] and (info.data.get("gpu") != "cpu"
                                            or info.data.get("precision") not in ("fp32", "bf16")):
                raise ValueError("compile_decode: the torch engine compiles fp32 and bf16 decode steps on CPU only")
        return value


class Resources(Strict):
    gpus: int = Field(0, ge=0)
    cpu: str = "2"
    memory: str = "4Gi"

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value: str) -> str:
        if not QUANTITY.match(str(value)):
            raise ValueError("must be a Kubernetes quantity such as 2, 500m or 4Gi")
        return str(value)


class ChartSpec(Strict):
    values: dict[str, Any] = Field(default_factory=dict)


class AccuracyTask(Strict):
    """An lm-evaluation-harness task (or group) and the score it must reach."""

    name: str = Field(description="an lm-eval task (`lm-eval ls tasks`), or one under include_path")
    min: float = Field(ge=0, le=1, description="the lowest passing score")
    limit: int | None = Field(None, ge=1, description="score only the first N samples")
    metric: str | None = Field(None, description="e.g. exact_match or exact_match,flexible-extract; "
                                                 "default: the task's first")
    num_fewshot: int | None = Field(None, ge=0)


class AccuracyTests(Strict):
    min_exact_match: float = Field(0.9, ge=0, le=1)
    dataset: str | None = Field(None, description="JSONL of {prompt, completion}, relative to the spec, for "
                                                  "exact match; none: exact match is skipped, with a reason")
    tasks: list[AccuracyTask] = Field(default_factory=list, description="lm-eval tasks; none: skipped, with a reason")
    include_path: str | None = Field(None, description="a directory of lm-eval task YAMLs, relative to the spec")
    endpoint: Literal["completions", "chat"] = Field("completions", description="the route lm-eval calls")


class Slo(Strict):
    ttft_p99_ms: float | None = Field(None, gt=0)
    itl_p99_ms: float | None = Field(None, gt=0)


class PerfTests(Strict):
    concurrency: list[int] = Field(default_factory=lambda: [1, 8, 32], min_length=1)
    requests_per_level: int = Field(64, ge=1)
    slo: Slo = Field(default_factory=Slo)


class Regression(Strict):
    """How far a release may fall behind the previous one (same profile and hardware) before publish refuses it."""

    max_throughput_drop: float = Field(0.10, ge=0, le=1, description="fraction of output tok/s, at any level")
    max_accuracy_drop: float | None = Field(None, ge=0, le=1, description="score points; none: only a "
                                                                          "threshold crossed counts")


class Tests(Strict):
    accuracy: AccuracyTests = Field(default_factory=AccuracyTests)
    perf: PerfTests = Field(default_factory=PerfTests)
    regression: Regression = Field(default_factory=Regression)
    tool_calls: bool | None = Field(None, description="gate on tool calls (harness group `tools`); default: when "
                                                      "the model has a tool_call_parser")


class ModelSpec(Strict):
    apiVersion: Literal["inferkiln/v1"]
    kind: Literal["ModelSpec"]
    metadata: Metadata
    model: ModelSource
    adapters: list[AdapterSpec] = Field(default_factory=list)
    runtime: Runtime = Field(default_factory=Runtime)
    profiles: list[ProfileSpec] = Field(min_length=1)
    resources: Resources = Field(default_factory=Resources)
    chart: ChartSpec = Field(default_factory=ChartSpec)
    tests: Tests = Field(default_factory=Tests)

    @property
    def served_name(self) -> str:
        return self.model.served_name or self.metadata.name

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()

    @model_validator(mode="after")
    def _adapter_names(self) -> ModelSpec:
        names = [adapter.name for adapter in self.adapters]
        if self.served_name in names:
            raise ValueError(f"adapters: an adapter may not be named as the model, {self.served_name!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"adapters: names must be unique; got {names}")
        return self


class LoadedSpec(BaseModel):
    """A valid spec and the file it came from (relative `local://` sources resolve against it)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    spec: ModelSpec
    path: Path

    def verify_key(self) -> Path | None:
        key = self.spec.model.verify_key
        return None if key is None else self.relative(key).resolve()

    def relative(self, value: str) -> Path:
        """A path the spec names, relative to the spec's directory unless absolute."""
        return Path(value) if Path(value).is_absolute() else (self.path.parent / value).resolve()

    def adapter_key(self, adapter: AdapterSpec) -> Path | None:
        key = adapter.verify_key or self.spec.model.verify_key
        return None if key is None else self.relative(key)

    def local_source(self) -> Path | None:
        source = self.spec.model.source
        return self.relative(source.removeprefix("local://")) if source.startswith("local://") else None

    def local_adapter(self, adapter: AdapterSpec) -> Path | None:
        """A local:// adapter's directory; None for an oci:// one (pulled at build)."""
        source = adapter.source
        return self.relative(source.removeprefix("local://")) if source.startswith("local://") else None


def check_adapter(adapter_dir: Path, model_dir: Path | None) -> None:
    """The runtime's own checks of an adapter against the model (at the runtime's default
    NIM_MAX_LORA_RANK); nothing to check against without local weights. Raises AdapterError."""
    from service.adapters import ModelShape, read_adapter
    from service.settings import Settings

    if model_dir is not None:
        read_adapter(adapter_dir, ModelShape.of_model(model_dir), Settings.model_fields["max_lora_rank"].default)


def _describe(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if error["type"] == "missing":
        return "required field is missing"
    if error["type"] == "literal_error":
        return f"must be one of {error['ctx']['expected']}; got {error.get('input')!r}"
    return f"{message}; got {error.get('input')!r}" if error.get("input") is not None and not isinstance(
        error.get("input"), dict | list) else message


def _engines_the_flavor_lacks(spec: ModelSpec) -> list[str]:
    from factory.image.flavors import FLAVORS

    engines = FLAVORS[spec.runtime.flavor].engines
    return [f"profiles.{i}.engine: runtime.flavor {spec.runtime.flavor!r} runs {' or '.join(engines)}; "
            f"got {profile.engine!r}" for i, profile in enumerate(spec.profiles) if profile.engine not in engines]


def load_spec(path: str | Path) -> LoadedSpec:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError([f"{path}: file not found"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a directory; name a spec file in it (pipelines/models/*.yaml)"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError([f"{path}: not UTF-8 text (byte {exc.start}): a spec is a YAML file"]) from None
    except OSError as exc:
        raise SpecError([f"{path}: cannot be read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: not valid YAML: {' '.join(str(exc).split())}"]) from None
    if not isinstance(data, dict):
        raise SpecError([f"{path}: expected a mapping with apiVersion, kind, metadata, model, profiles"])
    try:
        spec = ModelSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError([f"{path}: {'.'.join(map(str, e['loc'])) or '(top level)'}: {_describe(e)}"
                         for e in exc.errors()]) from None
    if mismatched := _engines_the_flavor_lacks(spec):
        raise SpecError([f"{path}: {line}" for line in mismatched])
    loaded = LoadedSpec(spec=spec, path=path.resolve())
    if (local := loaded.local_source()) is not None and not (local / "config.json").is_file():
        raise SpecError([f"{path}: model.source: no model directory (config.json) at {local}"])
    if (key := loaded.verify_key()) is not None and not key.is_file():
        raise SpecError([f"{path}: model.verify_key: no file at {key}"])
    if problems := _adapter_problems(loaded):
        raise SpecError([f"{path}: {line}" for line in problems])
    return loaded


def _adapter_problems(loaded: LoadedSpec) -> list[str]:
    """A local adapter must be a PEFT adapter the model can serve (`check_adapter`); an oci:// one
    needs a key, and is checked once pulled."""
    from service.adapters import AdapterError

    problems = []
    for i, adapter in enumerate(loaded.spec.adapters):
        local = loaded.local_adapter(adapter)
        if local is None:
            if loaded.adapter_key(adapter) is None:
                problems.append(f"adapters.{i}.verify_key: an oci:// adapter is baked only once its signature "
                                "verifies; name its public key (or model.verify_key)")
            continue
        if not (local / "adapter_config.json").is_file():
            problems.append(f"adapters.{i}.source: no PEFT adapter (adapter_config.json) at {local}")
        else:
            try:
                check_adapter(local, loaded.local_source())
            except AdapterError as exc:
                problems.append(f"adapters.{i}.source: {local}: {exc}")
        if adapter.dataset and not loaded.relative(adapter.dataset).is_file():
            problems.append(f"adapters.{i}.dataset: no file at {loaded.relative(adapter.dataset)}")
    return problems
