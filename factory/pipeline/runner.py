"""The one runner: a model spec through validate -> build -> chart -> test -> publish.

Every entry point (the CLI's commands, pipeline files and `inferkiln demo`) drives this class, so
the flow and its error policy are written once. Each stage returns a typed result that the later
stages take: the image plan and built images, the chart package (the very file publish pushes),
the test report, the release. An expected failure becomes a StageFailed naming the stage, with the
contract's exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from factory.errors import FactoryError
from factory.spec import LoadedSpec, SpecError

if TYPE_CHECKING:  # the stages' modules load only when their stage runs
    from factory.chart.package import ChartPackage
    from factory.image.build import BuiltImages
    from factory.image.context import ImagePlan
    from factory.release.catalog import Release
    from factory.verify.result import TestReport

Stage = Literal["validate", "build", "chart", "test", "publish"]
STAGES: tuple[Stage, ...] = ("validate", "build", "chart", "test", "publish")
Progress = Callable[[str], None]


class StageFailed(Exception):
    """A stage failed as expected (bad input, a failed check); `exit_code` is the contract's."""

    def __init__(self, stage: str, message: str, exit_code: int) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage, self.message, self.exit_code = stage, message, exit_code


@contextmanager
def stage_errors(name: str) -> Iterator[None]:
    """The error policy: the factory's expected failures become a StageFailed for stage `name`."""
    try:
        yield
    except StageFailed:
        raise
    except SpecError as exc:
        raise StageFailed(name, "\n".join(exc.lines), exc.exit_code) from None
    except FactoryError as exc:
        raise StageFailed(name, str(exc), exc.exit_code) from None


@dataclass
class RunSettings:
    registry: str | None = None  # images and charts are named for it; publish pushes to it
    chart_dir: Path = Path("build/charts")
    report_dir: Path | None = None  # default: results/test-<name>-<time>
    force: bool = False  # publish although the tests failed (recorded)


@dataclass
class StageResults:
    """What each finished stage handed on (None until it has run): the typed hand-offs."""

    spec: LoadedSpec | None = None
    plan: ImagePlan | None = None
    docker: Any = None  # the Docker Engine client
    images: BuiltImages | None = None
    chart: ChartPackage | None = None
    tests: TestReport | None = None
    release: Release | None = None


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    seconds: float
    detail: str


@dataclass
class Runner:
    spec_path: Path
    settings: RunSettings = field(default_factory=RunSettings)
    progress: Progress = lambda _: None
    results: StageResults = field(default_factory=StageResults, init=False, repr=False)

    def _once(self, key: str, stage: str, work: Callable[[], Any]) -> Any:
        """The result `key` of `stage`, from `work` the first time it is asked for."""
        if getattr(self.results, key) is None:
            with stage_errors(stage):
                setattr(self.results, key, work())
        return getattr(self.results, key)

    def _docker(self):
        from factory.stack import docker_client

        return self._once("docker", "stack", docker_client)

    # -- the stages -----------------------------------------------------------------------------
    def validate(self) -> LoadedSpec:
        from factory.spec import load_spec

        return self._once("spec", "validate", lambda: load_spec(self.spec_path))

    def plan(self):
        """Both image references, known from the inputs alone (no Docker, no network)."""
        from factory.image.context import ImagePlan

        loaded = self.validate()
        return self._once("plan", "render", lambda: ImagePlan.for_spec(loaded))

    def render(self, out: Path, fetch_wheels: bool = False):
        """The contexts `build` builds, and the chart; the wheelhouse is linked in when cached (or fetched)."""
        from factory.chart.render import render_chart
        from factory.image.context import write_contexts
        from factory.image.wheelhouse import cached_wheelhouse, ensure_wheelhouse

        loaded, plan = self.validate(), self.plan()
        with stage_errors("render"):
            wheels = ensure_wheelhouse(plan.flavor, self.progress) if fetch_wheels else cached_wheelhouse(plan.flavor)
            contexts = write_contexts(loaded, plan, out, wheels)
            return contexts, render_chart(loaded, self.image_reference(), out / "chart")

    def build(self):
        from factory.image.build import build_images

        loaded, plan = self.validate(), self.plan()
        return self._once("images", "build", lambda: build_images(self._docker(), loaded, plan, self.progress))

    def image_reference(self) -> str:
        """The model image as charts and clients name it: in the registry when there is one."""
        from factory.release.publish import remote_reference

        local = self.plan().model_reference
        return remote_reference(local, self.settings.registry) if self.settings.registry else local

    def chart(self):
        from factory.chart.package import package_chart

        loaded, reference = self.validate(), self.image_reference()
        return self._once("chart", "chart", lambda: package_chart(loaded, reference, self.settings.chart_dir))

    def chart_run(self, values: dict[str, Any]) -> dict[str, Any]:
        """The pod spec of the validated chart package, run in Docker with the local image and its
        probes asked; `values` override the chart's."""
        from factory.chart.render import deep_merge
        from factory.chart.run import image_values, run_chart

        images, chart = self.build(), self.chart()
        with stage_errors("chart run"):
            return run_chart(self._docker(), chart.path, deep_merge(image_values(images.model.reference), values))

    def test_report(self):
        """The harness against the running image, pass or fail (recorded for publish's gate). The
        container runs as the pod of the validated chart package would (its env, user, filesystem,
        capabilities), with the local image."""
        from factory.chart.run import pod_options
        from factory.verify.stage import record_tests, test_image

        loaded, images, chart = self.validate(), self.build(), self.chart()
        name = loaded.spec.metadata.name
        report_dir = self.settings.report_dir or Path("results") / f"test-{name}-{time.strftime('%Y%m%d-%H%M%S')}"

        def work():
            pod = pod_options(chart.path, images.model.reference, release=name)
            report = test_image(self._docker(), loaded, images.model.reference, report_dir, self.progress, pod)
            record_tests(images.model.image_id, report)
            return report

        return self._once("tests", "test", work)

    def test(self):
        """The harness against the running image; a failed gate fails the stage (the report is kept)."""
        report = self.test_report()
        if not report.passed:
            raise StageFailed("test", f"{report.summary} (report: {report.report_dir / 'summary.md'})", 1)
        return report

    def publish(self):
        from factory.release.publish import publish
        from factory.verify.stage import recorded_tests

        if not self.settings.registry:
            raise StageFailed("publish", "no registry to publish to (give --registry HOST[:PORT])", 2)
        loaded, plan, images, chart = self.validate(), self.plan(), self.build(), self.chart()
        tests = self.results.tests or recorded_tests(images.model.image_id) or self.test_report()
        return self._once("release", "publish", lambda: publish(
            self._docker(), loaded, plan.flavor, images, chart, tests, self.settings.registry, self.progress,
            force=self.settings.force))

    # -- several stages ---------------------------------------------------------------------------
    def run(self, stages: list[Stage] | tuple[Stage, ...], on_stage: Callable[[StageOutcome], None] = lambda _: None
            ) -> list[StageOutcome]:
        """The given stages in the factory's order; stops at the first failure (StageFailed)."""
        outcomes = []
        for name in sorted(set(stages), key=STAGES.index):
            start = time.perf_counter()
            detail = describe(name, getattr(self, name)())
            outcomes.append(StageOutcome(name, round(time.perf_counter() - start, 2), detail))
            on_stage(outcomes[-1])
        return outcomes


def describe(stage: str, result: Any) -> str:
    """One line for a stage's result."""
    if stage == "validate":
        return f"{result.spec.metadata.name} {result.spec.metadata.version}"
    if stage == "build":
        return f"{result.model.reference} {result.model.image_id}" + ("" if result.model.built else " (unchanged)")
    if stage == "chart":
        return f"{result.path} {result.digest}"
    if stage == "test":
        return f"{result.summary}; report: {result.report_dir / 'summary.md'}"
    if stage == "publish":
        return f"{result.image.reference}@{result.image.digest}"
    return str(result)
