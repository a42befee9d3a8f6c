"""The `inferkiln` command line: thin Typer commands over the stage functions.

Exit codes: 0 success, 1 a check failed (tests, lint, build, push), 2 bad input (spec, flags).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer


app = typer.Typer(help="inferkiln: a factory for OpenAI-compatible LLM inference microservices.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

Spec = Annotated[Path, typer.Argument(help="A model spec (pipelines/models/*.yaml).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def say(message: str) -> None:
    typer.echo(message, err=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load(path: Path):
    from factory.spec import SpecError, load_spec

    try:
        return load_spec(path)
    except SpecError as exc:
        for line in exc.lines:
            typer.echo(line, err=True)
        raise typer.Exit(2) from None


def checked(work):
    """Run a stage, turning the factory's domain errors into one line and exit code 1."""
    from factory.chart import ChartError
    from factory.container import ContainerError
    from factory.images import BuildError
    from factory.publish import PublishError
    from factory.stack import StackError

    try:
        return work()
    except (BuildError, ChartError, ContainerError, PublishError, StackError) as exc:
        raise fail(str(exc)) from None


def emit(result: dict, as_json: bool, text: str) -> None:
    typer.echo(json.dumps(result, indent=2) if as_json else text)


@app.command()
def validate(specs: Annotated[list[Path], typer.Argument(help="Model specs to check.")]) -> None:
    """Check model specs; errors name the file, the field and the allowed values."""
    for path in specs:
        loaded = load(path)
        typer.echo(f"{path}: ok ({loaded.spec.metadata.name} {loaded.spec.metadata.version})")


@app.command()
def render(spec: Spec, out: Annotated[Path, typer.Option("-o", "--out", help="Directory to write.")] = Path("build/render")) -> None:
    """Write the build contexts (Dockerfiles, manifest, wheel list) and the chart; build nothing."""
    from factory.stages import render as render_stage

    paths = checked(lambda: render_stage(load(spec), out))
    for kind, path in paths.items():
        typer.echo(f"{kind}: {path}")


@app.command()
def build(spec: Spec, as_json: JsonFlag = False) -> None:
    """Build the runtime and model images through the Docker Engine API."""
    from factory.stages import build as build_stage, built_summary

    runtime, model = checked(lambda: build_stage(load(spec), say))
    result = {"runtime": built_summary(runtime), "model": built_summary(model)}
    emit(result, as_json, f"{model.reference} {model.image_id}" + ("" if model.built else " (unchanged)"))


@app.command("base-image")
def base_image() -> None:
    """Bootstrap the Debian bookworm + Python base image from Debian packages (cached by tag)."""
    from factory.images import ensure_base_image
    from factory.stack import docker_client

    typer.echo(checked(lambda: ensure_base_image(docker_client(), say)))


def parse_sets(sets: list[str]) -> dict:
    """`a.b=value` pairs (values as YAML) into nested values, like helm's --set."""
    import yaml

    from factory.chart import deep_merge

    values: dict = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise fail(f"--set {item!r}: expected key.path=value", 2)
        node: dict = {}
        leaf = node
        *parents, last = key.split(".")
        for part in parents:
            leaf = leaf.setdefault(part, {})
        leaf[last] = yaml.safe_load(raw)
        values = deep_merge(values, node)
    return values


@app.command()
def chart(target: Annotated[str, typer.Argument(help="A model spec, or `run` followed by a spec.")],
          spec: Annotated[Path | None, typer.Argument(help="With `run`: the model spec.")] = None,
          out: Annotated[Path, typer.Option("-o", "--out", help="Where the package goes.")] = Path("build/charts"),
          sets: Annotated[list[str], typer.Option("--set", help="With `run`: override a value (key.path=value).")] = [],
          as_json: JsonFlag = False) -> None:
    """`chart SPEC`: render, lint, check and package the chart (the package path last).
    `chart run SPEC`: run the pod spec it renders in Docker and ask its probes as the kubelet would."""
    from factory import stages

    if target != "run":
        typer.echo(str(checked(lambda: stages.chart(load(Path(target)), out))))
        return
    if spec is None:
        raise fail("give a spec: inferkiln chart run SPEC", 2)
    values = parse_sets(sets)
    result = checked(lambda: stages.chart_run(load(spec), values))
    emit(result, as_json, "\n".join(f"{key}: {value}" for key, value in result.items()))


@app.command()
def deploy(spec: Spec, kubeconfig: Annotated[Path, typer.Option(help="kubeconfig of the target cluster.")],
           namespace: Annotated[str, typer.Option(help="Namespace of the release.")] = "default",
           registry: Annotated[str | None, typer.Option(help="Deploy the image from this registry.")] = None) -> None:
    """Install or upgrade the release on a real cluster and wait for the rollout."""
    import tempfile

    from factory.deploy import DeployError, deploy as deploy_release
    from factory.stages import build as build_stage

    loaded = load(spec)
    _, model = checked(lambda: build_stage(loaded, say))
    reference = f"{registry}/{model.reference}" if registry else model.reference
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = deploy_release(loaded, reference, kubeconfig, namespace, Path(tmp))
    except DeployError as exc:
        raise fail(str(exc)) from None
    typer.echo(f"{result['release']} rolled out in {result['namespace']} (revision {result['revision']})")


@app.command()
def test(spec: Annotated[Path | None, typer.Argument(help="A model spec: build, start and test its image.")] = None,
         url: Annotated[str | None, typer.Option(help="Test any OpenAI-compatible server instead.")] = None,
         model: Annotated[str | None, typer.Option(help="With --url: the model name to send.")] = None,
         output: Annotated[Path | None, typer.Option("--output", help="Report directory.")] = None,
         model_dir: Annotated[Path | None, typer.Option(help="With --url: local weights for the parity check.")] = None,
         dataset: Annotated[Path | None, typer.Option(help="JSONL of {prompt, completion} for exact match.")] = None,
         suite: Annotated[str, typer.Option(help="openai, or nim (adds health, metadata, manifest, metrics).")] = "nim",
         as_json: JsonFlag = False) -> None:
    """Run the harness (conformance, accuracy, performance, metrics); write a report. Exit 1 when a gate fails."""
    if (spec is None) == (url is None) or (url is not None and not model):
        raise fail("give a SPEC, or --url URL --model NAME", 2)
    if spec is not None:
        from factory.stages import run_tests

        result, report_dir = checked(lambda: run_tests(load(spec), output, say))
    else:
        from factory.harness.run import HarnessConfig, load_pairs, run_harness

        report_dir = output or Path("results") / f"test-{time.strftime('%Y%m%d-%H%M%S')}"
        groups = ("openai", "nim") if suite == "nim" else ("openai",)
        result = run_harness(url.rstrip("/"), model, HarnessConfig(groups=groups), report_dir,
                             pairs=load_pairs(dataset), model_dir=model_dir, progress=say)
    emit(result, as_json, f"{result['summary']}\nreport: {report_dir / 'summary.md'}")
    if not result["passed"]:
        raise typer.Exit(1)


@app.command()
def publish(spec: Spec, registry: Annotated[str, typer.Option(help="HOST[:PORT] of an OCI registry.")] = "127.0.0.1:5000",
            force: Annotated[bool, typer.Option("--force", help="Publish although the tests failed (recorded).")] = False,
            as_json: JsonFlag = False) -> None:
    """Push image and chart to the registry and record the release; all or nothing."""
    from factory.publish import publish as publish_stage
    from factory.stack import docker_client
    from factory.stages import build as build_stage, tests_for

    loaded = load(spec)

    def work():
        client = docker_client()
        _, model = build_stage(loaded, say)
        tests = tests_for(loaded, model, say)
        return publish_stage(client, loaded, model.reference, registry, tests, say, force=force)

    release = checked(work)
    emit(release.model_dump(), as_json, f"{release.image.reference}@{release.image.digest}\n"
                                        f"{release.chart.reference}@{release.chart.digest}")


@app.command("catalog")
def catalog_command(as_json: JsonFlag = False) -> None:
    """List the published releases."""
    from factory.catalog import releases

    entries = releases()
    if as_json:
        typer.echo(json.dumps([r.model_dump() for r in entries], indent=2))
        return
    for r in entries:
        flag = " (forced)" if r.forced else ""
        typer.echo(f"{r.time}  {r.name} {r.version}  {r.image.reference}@{r.image.digest[:19]}  "
                   f"chart {r.chart.reference}  tests: {r.tests.get('summary', '?')}{flag}")


@app.command("stack")
def stack_command(registry: Annotated[str, typer.Option(help="Address of the local registry.")] = "127.0.0.1:5000") -> None:
    """Start (or find) dockerd, the local registry and helm; idempotent."""
    from factory.stack import stack_up

    for part, value in checked(lambda: stack_up(registry)).items():
        typer.echo(f"{part}: {value}")


@app.command("run")
def run_pipeline(pipeline: Annotated[Path, typer.Argument(help="A pipeline file (pipelines/*.yaml).")]) -> None:
    """Run a pipeline file's stages for each of its specs."""
    from factory.pipeline import PipelineError, load_pipeline, run

    try:
        loaded = load_pipeline(pipeline)
    except PipelineError as exc:
        raise fail(str(exc), 2) from None
    results = checked(lambda: run(loaded, say))
    for line in results:
        typer.echo(line)
    if any(line.startswith("FAIL") for line in results):
        raise typer.Exit(1)


@app.command("tiny-model")
def tiny_model(out: Annotated[Path | None, typer.Option("--out", help="Directory to write; default: the cache.")] = None) -> None:
    """Make (or reuse from its cache) the bundled tiny model; print its directory last."""
    from factory.tinymodel import ensure_tiny_model

    say("making the tiny model (cached after the first run)...")
    typer.echo(str(ensure_tiny_model(out)))


@app.command()
def demo(registry: Annotated[str, typer.Option(help="The local registry to publish to.")] = "127.0.0.1:5000",
         keep: Annotated[bool, typer.Option("--keep/--no-keep", help="Leave the model running and print a curl line.")] = True) -> None:
    """The whole path on the bundled tiny model: stack, build, chart, test, publish; prints the report."""
    from factory.demo import run_demo

    raise typer.Exit(checked(lambda: run_demo(registry=registry, keep=keep, echo=typer.echo, progress=say)))


def main() -> None:
    app(prog_name="inferkiln")


if __name__ == "__main__":
    sys.exit(main())
