"""The test stage: start the model image as the chart's pod would and run the harness against it.

Each result is kept under the state directory by image id, so `publish` gates on the tests of
exactly the image it pushes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from factory.paths import state_dir
from factory.spec import LoadedSpec
from factory.chart.helm import ChartError
from factory.chart.run import PodRun, init_containers_run
from factory.verify.container import POD_LIKE, ContainerError, start_model
from factory.verify.harness import AdapterCheck, HarnessConfig, load_pairs, run_harness
from factory.verify.result import Gate, TestReport

Progress = Callable[[str], None]


def test_image(client, loaded: LoadedSpec, image_reference: str, report_dir: Path, progress: Progress,
               pod: PodRun | None = None) -> TestReport:
    """Start the image as the chart's pod (its init containers first) and run the whole harness."""
    pod = pod or PodRun(POD_LIKE)
    report_dir.mkdir(parents=True, exist_ok=True)
    try:
        with init_containers_run(client, pod):
            return _test_running(client, loaded, image_reference, report_dir, progress, pod)
    except ChartError as exc:  # an init container failed (a model that does not verify): no pod started
        return _not_started(report_dir, image_reference, str(exc))


def _not_started(report_dir: Path, image_reference: str, why: str) -> TestReport:
    report = TestReport.from_gates([Gate(id="container.ready", passed=False, detail=why[-2000:])],
                                   report_dir, image=image_reference)
    (report_dir / "summary.json").write_text(report.model_dump_json(indent=2))
    return report


def _test_running(client, loaded: LoadedSpec, image_reference: str, report_dir: Path, progress: Progress,
                  pod: PodRun) -> TestReport:
    dataset = loaded.spec.tests.accuracy.dataset
    pairs = load_pairs((loaded.path.parent / dataset) if dataset else None)
    adapters = [AdapterCheck(a.name, load_pairs(loaded.relative(a.dataset)) if a.dataset else None, a.min_exact_match)
                for a in loaded.spec.adapters]
    tools = loaded.spec.tests.tool_calls
    tools = bool(loaded.spec.model.tool_call_parser) if tools is None else tools
    groups = ("openai", "nim", "tools") if tools else ("openai", "nim")
    config = HarnessConfig.from_tests(loaded.spec.tests, base=loaded.path.parent, adapters=adapters, groups=groups)
    progress(f"starting {image_reference}...")
    start = time.perf_counter()
    try:
        running = start_model(client, image_reference, pod=pod.main)
    except ContainerError as exc:
        return _not_started(report_dir, image_reference, str(exc))
    try:
        ready = time.perf_counter() - start
        report = run_harness(running.url, loaded.spec.served_name, config, report_dir, pairs=pairs,
                             model_dir=harness_weights(loaded, progress), progress=progress)
    finally:
        (report_dir / "container.log").write_text(running.logs(500))
        running.stop()
    return report.model_copy(update={"image": image_reference, "start_to_ready_s": round(ready, 2),
                                     "hardware": host_hardware()})


def harness_weights(loaded: LoadedSpec, progress: Progress) -> Path | None:
    """The weights the harness compares the server with (transformers parity, lm-eval's tokenizer):
    the spec's local source, or its oci:// model pulled and verified into the factory's cache."""
    from factory.paths import cache_dir
    from service.model_store import ModelSourceError, Trust, locate_model

    source = loaded.spec.model.source
    if not source.startswith("oci://"):
        return loaded.local_source()
    try:
        return locate_model(source, cache_path=cache_dir() / "models", base_dir=None, name=loaded.spec.metadata.name,
                            allow_download=True, trust=Trust(True, loaded.verify_key())).path
    except ModelSourceError as exc:
        progress(f"no local copy of the weights for the parity check: {exc}")
        return None


def host_hardware() -> str:
    """The machine the image ran on, as releases are compared: its CPU, core count and GPUs."""
    import os
    import platform

    from service.profiles import detect_hardware

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    return f"{names[0] if names else platform.processor() or platform.machine()} x{os.cpu_count()}; " \
           f"{detect_hardware().describe()}"


def _recorded_path(image_id: str) -> Path:
    return state_dir() / "tests" / f"{image_id.replace(':', '-')}.json"


def record_tests(image_id: str, report: TestReport) -> None:
    path = _recorded_path(image_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json())


def recorded_tests(image_id: str) -> TestReport | None:
    path = _recorded_path(image_id)
    return TestReport.model_validate_json(path.read_text()) if path.is_file() else None
