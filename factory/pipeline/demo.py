"""`inferkiln demo`: the whole path on the embedded default model.

The bundled tiny model, the local stack (dockerd, registry, helm), then the runner's stages
(validate, build, chart, test, publish) and a report; the model keeps running so the printed
curl line works.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from factory.paths import repo_root
from factory.pipeline.runner import STAGES, RunSettings, Runner, StageFailed, StageOutcome, stage_errors

SPEC = "pipelines/models/tiny-llama.yaml"
DEMO_CONTAINER = "inferkiln-demo"


def run_demo(*, registry: str, keep: bool, echo: Callable[[str], None], progress: Callable[[str], None],
             spec: Path | None = None) -> None:
    """Raises StageFailed (after writing the report) when a stage fails."""
    from factory.stack import stack_up
    from factory.tinymodel import ensure_tiny_model

    root = repo_root()
    report_dir = root / "results" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    timings: dict[str, float] = {}
    for name, work in (("tiny model", lambda: ensure_tiny_model(root / "build" / "tiny-llama")),
                       ("local stack", lambda: stack_up(registry))):
        echo(f"==> {name}")
        start = time.perf_counter()
        with stage_errors(name):
            work()
        timings[name] = round(time.perf_counter() - start, 2)

    runner = Runner(spec or root / SPEC, RunSettings(registry=registry, report_dir=report_dir / "tests"), progress)

    def on_stage(outcome: StageOutcome) -> None:
        timings[outcome.stage] = outcome.seconds
        echo(f"==> {outcome.stage} ({outcome.seconds}s): {outcome.detail}")

    failure = None
    try:
        runner.run(STAGES, on_stage)
    except StageFailed as exc:
        failure = exc
    _write_report(runner, report_dir, timings, failure)
    echo(f"report: {report_dir / 'report.md'}")
    if failure:
        raise failure
    release = runner.publish()
    echo(f"published: {release.image.reference}@{release.image.digest}")
    echo(f"           {release.chart.reference}@{release.chart.digest}")
    echo(f"           SBOM {release.sbom.reference}")
    if keep:
        url = _serve(runner.build().model.reference)
        echo(f"the model is running at {url} (stop it: docker rm -f {DEMO_CONTAINER}); try:")
        echo(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
             "-d '{\"model\": \"tiny-llama\", \"messages\": [{\"role\": \"user\", \"content\": "
             "\"The capital of France is Paris,\"}], \"temperature\": 0}'")


def _serve(reference: str) -> str:
    from factory.stack import docker_client
    from factory.verify.container import start_model

    client = docker_client()
    for old in client.containers.list(all=True, filters={"name": DEMO_CONTAINER}):
        old.remove(force=True)
    running = start_model(client, reference)
    running.container.rename(DEMO_CONTAINER)
    return running.url


def _write_report(runner: Runner, report_dir: Path, timings: dict[str, float], failure: StageFailed | None) -> None:
    """report.json and report.md from the typed results the stages left (a failed run has fewer)."""
    results = runner.results
    images, chart, tests, release = results.images, results.chart, results.tests, results.release
    summary = {
        "runtime_image": images.runtime.reference if images else None,
        "model_image": images.model.reference if images else None,
        "chart_package": {"path": str(chart.path), "digest": chart.digest} if chart else None,
        "tests": tests.model_dump(mode="json") if tests else None,
        "release": release.model_dump() if release else None,
        "failure": str(failure) if failure else None, "timings_s": timings}
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.json").write_text(json.dumps(summary, indent=2))
    rows = "".join(f"| {g.id} | {'pass' if g.passed else 'FAIL'} | {g.detail[:100].replace('|', '/')} |\n"
                   for g in tests.gates) if tests else ""
    published = (f"- image `{release.image.reference}@{release.image.digest}`\n"
                 f"- chart `{release.chart.reference}@{release.chart.digest}`\n"
                 f"- SBOM `{release.sbom.reference}`\n") if release else "- nothing\n"
    timing_rows = "".join(f"| {name} | {seconds} |\n" for name, seconds in timings.items())
    (report_dir / "report.md").write_text(
        f"# inferkiln demo\n\n{'**Failed:** ' + str(failure) + chr(10) * 2 if failure else ''}"
        f"## Images\n- runtime `{summary['runtime_image']}`\n- model `{summary['model_image']}`\n"
        f"- chart package `{chart.path if chart else None}` ({chart.digest if chart else '-'})\n\n"
        f"## Tests ({tests.summary if tests else 'not run'})\n\n| gate | result | detail |\n|---|---|---|\n{rows}\n"
        f"Full report: `{tests.report_dir / 'summary.md' if tests else '-'}` (and `index.html`, plots, "
        f"AIPerf exports per load level in `concurrency_N/`)\n\n## Published\n{published}\n"
        f"## Timings\n\n| step | seconds |\n|---|---|\n{timing_rows}")
