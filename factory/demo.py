"""`inferkiln demo`: the whole path on the embedded default model.

The bundled tiny model, the local stack (dockerd, registry, helm), the runtime and model images,
the chart, the tests against the running container, publication to the local registry, and a
report; then the model keeps running so the printed curl line works.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from factory.paths import repo_root

SPEC = "pipelines/models/tiny-llama.yaml"
DEMO_CONTAINER = "inferkiln-demo"


def run_demo(*, registry: str, keep: bool, echo: Callable[[str], None], progress: Callable[[str], None]) -> int:
    from factory.publish import publish
    from factory.spec import load_spec
    from factory.stack import docker_client, stack_up
    from factory.stages import build, chart, run_tests
    from factory.tinymodel import ensure_tiny_model

    root = repo_root()
    report_dir = root / "results" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    timings: dict[str, float] = {}

    def step(name: str, work):
        echo(f"==> {name}")
        start = time.perf_counter()
        result = work()
        timings[name] = round(time.perf_counter() - start, 2)
        return result

    step("tiny model", lambda: ensure_tiny_model(root / "build" / "tiny-llama"))
    parts = step("local stack", lambda: stack_up(registry))
    loaded = load_spec(root / SPEC)
    runtime, model = step("build images", lambda: build(loaded, progress))
    package = step("chart", lambda: chart(loaded, root / "build" / "charts", model.reference))
    tests, test_dir = step("test", lambda: run_tests(loaded, report_dir / "tests", progress))
    release = None
    if tests["passed"]:
        release = step("publish", lambda: publish(docker_client(), loaded, model.reference, registry, tests, progress))
    summary = {"stack": parts, "runtime_image": runtime.reference, "model_image": model.reference,
               "chart_package": str(package), "tests": tests, "timings_s": timings,
               "release": release.model_dump() if release else None}
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "report.json").write_text(json.dumps(summary, indent=2, default=str))
    (report_dir / "report.md").write_text(_markdown(summary, test_dir))
    echo(f"report: {report_dir / 'report.md'}")
    if not tests["passed"]:
        echo(f"tests failed ({tests['summary']}); nothing was published")
        return 1
    echo(f"published: {release.image.reference}@{release.image.digest}")
    echo(f"           {release.chart.reference}@{release.chart.digest}")
    if keep:
        url = _serve(model.reference)
        echo(f"the model is running at {url} (stop it: docker rm -f {DEMO_CONTAINER}); try:")
        echo(f"  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' "
             "-d '{\"model\": \"tiny-llama\", \"messages\": [{\"role\": \"user\", \"content\": "
             "\"The capital of France is Paris,\"}], \"temperature\": 0}'")
    return 0


def _serve(reference: str) -> str:
    from factory.container import start_model
    from factory.stack import docker_client

    client = docker_client()
    for old in client.containers.list(all=True, filters={"name": DEMO_CONTAINER}):
        old.remove(force=True)
    running = start_model(client, reference)
    running.container.rename(DEMO_CONTAINER)
    return running.url


def _markdown(summary: dict, test_dir: Path) -> str:
    from factory.harness.report import gate_rows

    tests = summary["tests"]
    rows = ("".join(f"| {gate} | {'pass' if ok else 'FAIL'} | {detail[:100]} |\n" for gate, ok, detail in gate_rows(tests))
            if "conformance" in tests else "".join(f"| {c['id']} | FAIL | {c['detail'][:100]} |\n" for c in tests["checks"]))
    timings = "".join(f"| {name} | {seconds} |\n" for name, seconds in summary["timings_s"].items())
    release = summary["release"]
    published = (f"- image `{release['image']['reference']}@{release['image']['digest']}`\n"
                 f"- chart `{release['chart']['reference']}@{release['chart']['digest']}`\n") if release else "- nothing\n"
    return (f"# inferkiln demo\n\n## Images\n- runtime `{summary['runtime_image']}`\n- model `{summary['model_image']}`\n"
            f"- chart package `{summary['chart_package']}`\n\n## Tests ({summary['tests']['summary']})\n\n"
            f"| gate | result | detail |\n|---|---|---|\n{rows}\nFull report: `{test_dir / 'summary.md'}` "
            f"(and `index.html`, plots, `profile_export_aiperf.json`)\n\n"
            f"## Published\n{published}\n## Timings\n\n| step | seconds |\n|---|---|\n{timings}")
