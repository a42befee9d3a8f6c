"""The release catalog: what was published, where, with which digests and test results.

One JSON file under the state directory, changed only by an atomic replace under a lock, so a
failed publish (or two publishers at once) never leaves it half written.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, Field, computed_field

from factory.locking import exclusive, replacing
from factory.paths import state_dir


class Artifact(BaseModel):
    reference: str
    digest: str


class ModelArtifact(BaseModel):
    """Weights served from a registry rather than the image: the artifact and what proves it."""

    reference: str  # REGISTRY/REPO@sha256:...
    digest: str
    signature: str = Field(description="the model-signing bundle that verified, a referrer of the artifact")
    key: str = Field(description="the public key it verified against: sha256 of its DER SubjectPublicKeyInfo")


class TestSummary(BaseModel):
    """What the catalog keeps of a test run: the verdict and the headline numbers."""

    __test__ = False  # not a pytest test class

    passed: bool
    summary: str
    exact_match: float | None = None
    accuracy: dict[str, float] = Field(default_factory=dict, description="score per lm-eval task")
    output_tokens_per_s: dict[str, float] = Field(default_factory=dict)
    profile: str | None = Field(None, description="the profile served while tested")
    hardware: str | None = Field(None, description="what it was tested on")


class RegressionCheck(BaseModel):
    check: str  # "output_tokens_per_s@8", "accuracy.gsm8k"
    previous: float
    new: float | None  # None: not measured this time
    limit: float  # the lowest passing value

    @computed_field
    @property
    def passed(self) -> bool:
        return self.new is not None and self.new >= self.limit


class Comparison(BaseModel):
    """A release against the previous one (factory/release/regression.py)."""

    previous: str | None  # "name version (time)" compared with; None: nothing comparable was published
    rows: list[RegressionCheck] = []

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.rows)

    def failures(self) -> list[str]:
        return [f"{r.check} {r.new if r.new is None else round(r.new, 3)} < {round(r.limit, 3)} "
                f"(previous {round(r.previous, 3)})" for r in self.rows if not r.passed]


class Release(BaseModel):
    name: str
    version: str
    image: Artifact
    chart: Artifact
    sbom: Artifact | None = Field(None, description="the runtime image's CycloneDX SBOM, referring to the image")
    model: ModelArtifact | None = Field(None, description="the weights, when an oci:// artifact rather than the image "
                                                          "holds them")
    tests: TestSummary
    regression: Comparison | None = Field(None, description="against the previous release, when one compared")
    forced: bool = False
    time: str


def catalog_path() -> Path:
    return state_dir() / "catalog.json"


def releases(path: Path | None = None) -> list[Release]:
    path = path or catalog_path()
    if not path.is_file():
        return []
    return [Release.model_validate(entry) for entry in json.loads(path.read_text())["releases"]]


def record(release: Release, path: Path | None = None) -> None:
    path = path or catalog_path()
    with exclusive(path.with_suffix(".lock")):
        entries = [r.model_dump() for r in releases(path)] + [release.model_dump()]
        with replacing(path) as staged:
            staged.write_text(json.dumps({"releases": entries}, indent=2))
