"""Pipeline files (`pipelines/*.yaml`): stages to run, in the factory's order, for a list of specs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from factory.errors import InputError
from factory.pipeline.runner import RunSettings, Runner, Stage, StageFailed, StageOutcome


class PipelineError(InputError):
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
        raise PipelineError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except ValidationError as exc:
        raise PipelineError("\n".join(f"{path}: {'.'.join(map(str, e['loc']))}: {e['msg']}"
                                      for e in exc.errors())) from None


def run_pipeline(loaded: LoadedPipeline, progress: Callable[[str], None],
                 report: Callable[[Path, StageOutcome | StageFailed], None]) -> list[StageFailed]:
    """Each spec through the pipeline's stages, stopping at its first failure; every outcome and
    failure goes to `report`. Returns the failures."""
    failures = []
    for spec_path in loaded.spec_paths():
        runner = Runner(spec_path, RunSettings(registry=loaded.pipeline.registry), progress)
        try:
            runner.run(loaded.pipeline.stages, on_stage=lambda outcome: report(spec_path, outcome))
        except StageFailed as failure:
            report(spec_path, failure)
            failures.append(failure)
    return failures
