"""Pipeline files (`pipelines/*.yaml`): stages to run, in order, for each of a list of specs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from factory.images import Progress
from factory.spec import SpecError, load_spec

Stage = Literal["validate", "build", "chart", "test", "publish"]


class PipelineError(ValueError):
    """The pipeline file is invalid; the message names the file and the field."""


class Pipeline(BaseModel):
    model_config = ConfigDict(extra="forbid")

    apiVersion: Literal["inferkiln/v1"]
    kind: Literal["Pipeline"]
    metadata: dict[str, str] = Field(default_factory=dict)
    registry: str = "127.0.0.1:5000"
    specs: list[str] = Field(min_length=1, description="spec files, relative to the pipeline file")
    stages: list[Stage] = Field(min_length=1)


class LoadedPipeline(BaseModel):
    pipeline: Pipeline
    path: Path

    def spec_paths(self) -> list[Path]:
        return [(self.path.parent / s).resolve() for s in self.pipeline.specs]


def load_pipeline(path: Path) -> LoadedPipeline:
    try:
        data = yaml.safe_load(Path(path).read_text())
        return LoadedPipeline(pipeline=Pipeline.model_validate(data), path=Path(path).resolve())
    except FileNotFoundError:
        raise PipelineError(f"{path}: file not found") from None
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        raise PipelineError("\n".join(f"{path}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None


def run(loaded: LoadedPipeline, progress: Progress) -> list[str]:
    """Each spec goes through the stages in order and stops at its first failure; one line per stage."""
    from factory.publish import publish
    from factory.stack import docker_client
    from factory.stages import build, chart, run_tests, tests_for

    lines = []
    for spec_path in loaded.spec_paths():
        name = spec_path.name
        try:
            spec = load_spec(spec_path)
        except SpecError as exc:
            lines.append(f"FAIL {name} validate: {exc}")
            continue
        image = None
        for stage in loaded.pipeline.stages:
            start = time.perf_counter()
            try:
                detail = "ok"
                if stage in ("build", "chart", "test", "publish") and image is None:
                    image = build(spec, progress)[1]
                if stage == "build":
                    detail = image.reference
                elif stage == "chart":
                    detail = str(chart(spec, Path("build/charts"), image.reference))
                elif stage == "test":
                    result, report = run_tests(spec, None, progress)
                    if not result["passed"]:
                        raise RuntimeError(f"{result['summary']} (report: {report})")
                    detail = f"{result['summary']}; report: {report}"
                elif stage == "publish":
                    tests = tests_for(spec, image, progress)
                    release = publish(docker_client(), spec, image.reference, loaded.pipeline.registry, tests, progress)
                    detail = f"{release.image.reference}@{release.image.digest}"
            except Exception as exc:
                lines.append(f"FAIL {name} {stage}: {exc}")
                break
            lines.append(f"PASS {name} {stage} ({time.perf_counter() - start:.1f}s): {detail}")
    return lines
