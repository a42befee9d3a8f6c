"""The factory's stages as plain functions; the CLI and pipeline files call these."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from factory.chart import ChartError, lint, package, render_chart
from factory.chart_checks import check_chart
from factory.chart_run import run_chart
from factory.container import ContainerError, start_model
from factory.harness.run import HarnessConfig, load_pairs, run_harness
from factory.images import BuiltImage, Progress, build_model, model_digest, model_labels, runtime_requirements
from factory.render import RuntimePlan, write_model_context, write_runtime_context
from factory.paths import state_dir
from factory.spec import LoadedSpec
from factory.stack import docker_client


def render(loaded: LoadedSpec, out: Path) -> dict[str, Path]:
    """Build contexts and chart as files, building nothing (the runtime reference is the one a build would use)."""
    plan = RuntimePlan.for_spec(loaded)
    runtime = write_runtime_context(plan, out / "runtime", runtime_requirements(plan))
    runtime_reference = f"inferkiln/runtime-{plan.flavor}:<built>"
    digest = model_digest(loaded, runtime_reference)
    model = write_model_context(loaded, out / "model", runtime_reference, model_labels(loaded, digest))
    chart = render_chart(loaded, f"inferkiln/{loaded.spec.metadata.name}", loaded.spec.metadata.version, out / "chart")
    return {"runtime": runtime, "model": model, "chart": chart}


def build(loaded: LoadedSpec, progress: Progress) -> tuple[BuiltImage, BuiltImage]:
    return build_model(docker_client(), loaded, progress)


def chart(loaded: LoadedSpec, out: Path, image_reference: str | None = None) -> Path:
    """Render, lint and check (value matrix, API schemas, policy) the model's chart; package it."""
    repository, tag = _image(loaded, image_reference).rsplit(":", 1)
    chart_dir = render_chart(loaded, repository, tag, out / "src")
    lint(chart_dir)
    report = check_chart(chart_dir)
    if not report["passed"]:
        errors = [f"[{name}] {e}" for name, r in report["value_sets"].items() for e in r["errors"]]
        raise ChartError(f"{chart_dir.name}: {len(errors)} problem(s):\n" + "\n".join(errors[:20]))
    return package(chart_dir, out)


def chart_run(loaded: LoadedSpec, values: dict[str, Any], image_reference: str | None = None) -> dict[str, Any]:
    """Run the pod spec the model's chart renders in Docker and ask its probes."""
    repository, tag = _image(loaded, image_reference).rsplit(":", 1)
    with tempfile.TemporaryDirectory() as tmp:
        return run_chart(docker_client(), render_chart(loaded, repository, tag, Path(tmp)), values)


def _image(loaded: LoadedSpec, reference: str | None) -> str:
    """The given image reference, or the spec's model image (built first if it is not)."""
    return reference or build_model(docker_client(), loaded, lambda _: None)[1].reference


def harness_config(loaded: LoadedSpec) -> HarnessConfig:
    tests = loaded.spec.tests
    return HarnessConfig(min_exact_match=tests.accuracy.min_exact_match, concurrency=tests.perf.concurrency,
                         requests_per_level=tests.perf.requests_per_level, slo=tests.perf.slo.model_dump())


def container_test(loaded: LoadedSpec, image_reference: str, report_dir: Path, progress: Progress) -> dict[str, Any]:
    """Start the image as the chart's pod would and run the whole harness against it."""
    dataset = loaded.spec.tests.accuracy.dataset
    pairs = load_pairs((loaded.path.parent / dataset) if dataset else None)
    report_dir.mkdir(parents=True, exist_ok=True)
    progress(f"starting {image_reference}...")
    start = time.perf_counter()
    try:
        running = start_model(docker_client(), image_reference)
    except ContainerError as exc:
        result = {"passed": False, "summary": "the container never became ready", "image": image_reference,
                  "checks": [{"id": "container.ready", "passed": False, "detail": str(exc)[-2000:]}]}
        (report_dir / "summary.json").write_text(json.dumps(result, indent=2))
        return result
    try:
        ready = time.perf_counter() - start
        result = run_harness(running.url, loaded.spec.served_name, harness_config(loaded), report_dir, pairs=pairs,
                             model_dir=loaded.local_source(), progress=progress)
    finally:
        (report_dir / "container.log").write_text(running.logs(500))
        running.stop()
    result.update(image=image_reference, start_to_ready_s=round(ready, 2))
    return result


def built_summary(image: BuiltImage) -> dict[str, Any]:
    return asdict(image)


def test_results_path(image_id: str) -> Path:
    return state_dir() / "tests" / f"{image_id.replace(':', '-')}.json"


def run_tests(loaded: LoadedSpec, output: Path | None, progress: Progress) -> tuple[dict[str, Any], Path]:
    """Test the spec's image (built if needed) and keep the result for publish's gate."""
    _, model = build(loaded, progress)
    report_dir = output or Path("results") / f"test-{loaded.spec.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = container_test(loaded, model.reference, report_dir, progress)
    stored = test_results_path(model.image_id)
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps(result))
    return result, report_dir


def tests_for(loaded: LoadedSpec, model: BuiltImage, progress: Progress) -> dict[str, Any]:
    """The recorded test results of exactly this image, testing it first if it never was."""
    stored = test_results_path(model.image_id)
    return json.loads(stored.read_text()) if stored.is_file() else run_tests(loaded, None, progress)[0]
