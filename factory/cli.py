"""The `inferkiln` command line: thin Typer commands over the pipeline runner.

Exit codes: 0 success, 1 a check failed (tests, lint, build, push), 2 bad input (spec, flags).
An expected failure prints `error: STAGE: message` and exits with its code; only a bug shows a
traceback.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperGroup

T = TypeVar("T")

app = typer.Typer(help="inferkiln: a factory for OpenAI-compatible LLM inference microservices.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

Spec = Annotated[Path, typer.Argument(help="A model spec (pipelines/models/*.yaml).")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
Registry = Annotated[str | None, typer.Option(help="HOST[:PORT] of the OCI registry the image and chart are named for.")]


def say(message: str) -> None:
    typer.echo(message, err=True)


def exit_with(failure) -> NoReturn:
    """The one way a command fails: `error: STAGE: message` and the contract's exit code."""
    typer.echo(f"error: {failure}", err=True)
    raise typer.Exit(failure.exit_code)


def guarded(command: str, work: Callable[[], T]) -> T:
    """Run `work`; the factory's expected failures (StageFailed and its errors) end the command."""
    from factory.pipeline.runner import StageFailed, stage_errors

    try:
        with stage_errors(command):
            return work()
    except StageFailed as failure:
        exit_with(failure)


def runner(spec: Path, registry: str | None = None, **settings: Any):
    from factory.pipeline.runner import RunSettings, Runner

    return Runner(spec, RunSettings(registry=registry, **settings), say)


def emit(result: Any, as_json: bool, text: str) -> None:
    typer.echo(json.dumps(result, indent=2, default=str) if as_json else text)


@app.command()
def validate(specs: Annotated[list[Path], typer.Argument(help="Model specs to check.")]) -> None:
    """Check model specs; errors name the file, the field and the allowed values."""
    for path in specs:
        loaded = guarded("validate", runner(path).validate)
        typer.echo(f"{path}: ok ({loaded.spec.metadata.name} {loaded.spec.metadata.version})")


@app.command()
def render(spec: Spec, out: Annotated[Path, typer.Option("-o", "--out", help="Directory to write.")] = Path("build/render"),
           wheels: Annotated[bool, typer.Option("--wheels", help="Fetch the wheelhouse if it is not cached (network).")] = False,
           registry: Registry = None) -> None:
    """Write the build contexts `build` builds (docker build works on them) and the chart; build nothing."""
    contexts, chart_dir = guarded("render", lambda: runner(spec, registry).render(out, fetch_wheels=wheels))
    typer.echo(f"runtime: {contexts.runtime_dir} ({contexts.plan.runtime_reference})")
    typer.echo(f"model: {contexts.model_dir} ({contexts.plan.model_reference})")
    typer.echo(f"chart: {chart_dir}")
    if contexts.wheels_included:
        from factory.image.build import WHEELS_PORT as port

        typer.echo(f"wheels: {out / 'wheels'} (by hand: python3 -m http.server {port} --bind 127.0.0.1 -d {out / 'wheels'} & "
                   f"docker build --network host --build-arg WHEELS=http://127.0.0.1:{port}/ {contexts.runtime_dir})")
    else:
        say("note: the wheelhouse is not cached, so there is no wheels/ to build from: `inferkiln build` or "
            "`inferkiln render --wheels` fetches it")


@app.command()
def build(spec: Spec, as_json: JsonFlag = False) -> None:
    """Build the runtime and model images through the Docker Engine API."""
    images = guarded("build", runner(spec).build)
    emit(asdict(images), as_json, f"{images.model.reference} {images.model.image_id}"
                                  + ("" if images.model.built else " (unchanged)"))


Flavors = Annotated[list[str] | None, typer.Argument(help="Runtime flavors; default: every flavor.")]


def flavor_names(flavors: list[str] | None) -> list[str]:
    """The flavors named (every flavor when none is), or InputError for a name that is none."""
    from factory.errors import InputError
    from factory.image.flavors import FLAVORS

    if unknown := [name for name in flavors or [] if name not in FLAVORS]:
        raise InputError(f"unknown flavor {unknown[0]!r}; one of {', '.join(FLAVORS)}")
    return flavors or list(FLAVORS)


@app.command()
def lock(flavors: Flavors = None,
         check: Annotated[bool, typer.Option("--check", help="Exit 1 when a lock is stale against pyproject.toml.")] = False) -> None:
    """(Re)write each runtime flavor's dependency lock (versions and hashes) with uv."""
    from factory.errors import CheckFailed
    from factory.image.flavors import FLAVORS
    from factory.image.lock import compile_lock, stale_flavors

    def work() -> None:
        names = flavor_names(flavors)
        if check:
            if stale := stale_flavors(names):
                raise CheckFailed(f"stale lock(s): {', '.join(stale)}; run `inferkiln lock {' '.join(stale)}`")
            typer.echo(f"locks are current: {', '.join(names)}")
            return
        for name in names:
            say(f"locking {name}...")
            typer.echo(str(compile_lock(FLAVORS[name])))

    guarded("lock", work)


@app.command()
def fetch(flavors: Flavors = None) -> None:
    """Fetch what each runtime flavor's build needs from the network (its base image and its
    wheelhouse, cached: a no-op once there), e.g. before building offline; prints the wheelhouses."""
    from factory.image.build import fetch_for_runtime
    from factory.image.flavors import FLAVORS
    from factory.stack import docker_client

    def work() -> None:
        names, client = flavor_names(flavors), docker_client()
        for name in names:
            typer.echo(str(fetch_for_runtime(client, FLAVORS[name], say)))

    guarded("fetch", work)


@app.command("base-image")
def base_image() -> None:
    """Bootstrap the Debian bookworm + Python base image from Debian packages (cached by tag)."""
    from factory.image.build import ensure_base_image
    from factory.stack import docker_client

    typer.echo(guarded("base-image", lambda: ensure_base_image(docker_client(), say)))


def parse_sets(sets: list[str]) -> dict:
    """`a.b=value` pairs (values as YAML) into nested values, like helm's --set."""
    import yaml

    from factory.chart.render import deep_merge
    from factory.errors import InputError

    values: dict = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set {item!r}: expected key.path=value")
        node: dict = {}
        leaf = node
        *parents, last = key.split(".")
        for part in parents:
            leaf = leaf.setdefault(part, {})
        leaf[last] = yaml.safe_load(raw)
        values = deep_merge(values, node)
    return values


class ChartGroup(TyperGroup):
    """`inferkiln chart SPEC` means `inferkiln chart package SPEC`; `chart run SPEC` is its own command."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["package", *args]
        return super().parse_args(ctx, args)


chart_app = typer.Typer(cls=ChartGroup, no_args_is_help=True,
                        help="The per-model Helm chart: `chart SPEC` packages it, `chart run SPEC` runs its pod.")
app.add_typer(chart_app, name="chart")


@chart_app.command("package")
def chart_package(spec: Spec,
                  out: Annotated[Path, typer.Option("-o", "--out", help="Where the package goes.")] = Path("build/charts"),
                  registry: Registry = None, as_json: JsonFlag = False) -> None:
    """Render, lint and check (value matrix, API schemas, policy) the chart; package it (the path last)."""
    package = guarded("chart", runner(spec, registry, chart_dir=out).chart)
    if as_json:
        emit(asdict(package), True, "")
        return
    typer.echo(f"checked with Kubernetes {', '.join(package.checks.kubernetes_versions)}: "
               f"{len(package.checks.value_sets)} value sets; digest {package.digest}")
    typer.echo(str(package.path))


@chart_app.command("run")
def chart_run(spec: Spec,
              sets: Annotated[list[str], typer.Option("--set", help="Override a value (key.path=value).")] = [],
              as_json: JsonFlag = False) -> None:
    """Run the pod spec the chart renders in Docker and ask its probes as the kubelet would."""
    result = guarded("chart run", lambda: runner(spec).chart_run(parse_sets(sets)))
    emit(result, as_json, "\n".join(f"{key}: {value}" for key, value in result.items()))


@app.command()
def deploy(spec: Spec, kubeconfig: Annotated[Path, typer.Option(help="kubeconfig of the target cluster.")],
           namespace: Annotated[str, typer.Option(help="Namespace of the release.")] = "default",
           registry: Registry = None) -> None:
    """Install or upgrade the release on a real cluster from the validated chart; wait for the rollout."""
    from factory.chart.deploy import deploy as deploy_release

    def work():
        run = runner(spec, registry)
        run.build()
        return deploy_release(run.chart(), run.validate().spec.metadata.name, kubeconfig, namespace)

    result = guarded("deploy", work)
    typer.echo(f"{result['release']} rolled out in {result['namespace']} (revision {result['revision']})")


def task_option(value: str):
    """`gsm8k:0.75:250` -> the spec's AccuracyTask."""
    from factory.errors import InputError
    from factory.spec import AccuracyTask

    name, _, rest = value.partition(":")
    minimum, _, limit = rest.partition(":")
    try:  # pydantic's ValidationError is a ValueError
        return AccuracyTask(name=name, min=float(minimum), limit=int(limit) if limit else None)
    except ValueError:
        raise InputError(f"--task {value}: expected NAME:MIN[:LIMIT] with MIN in [0, 1], e.g. gsm8k:0.75:250") from None


@app.command()
def test(spec: Annotated[Path | None, typer.Argument(help="A model spec: build, start and test its image.")] = None,
         url: Annotated[str | None, typer.Option(help="Test any OpenAI-compatible server instead.")] = None,
         model: Annotated[str | None, typer.Option(help="With --url: the model name to send.")] = None,
         output: Annotated[Path | None, typer.Option("--output", help="Report directory.")] = None,
         model_dir: Annotated[Path | None, typer.Option(help="With --url: local weights for the parity check.")] = None,
         dataset: Annotated[Path | None, typer.Option(help="JSONL of {prompt, completion} for exact match.")] = None,
         task: Annotated[list[str] | None, typer.Option(
             help="With --url: an lm-eval task and its minimum score, NAME:MIN[:LIMIT]; repeatable.")] = None,
         suite: Annotated[str, typer.Option(help="openai, or nim (adds health, metadata, manifest, metrics).")] = "nim",
         tools: Annotated[bool, typer.Option("--tools", help="With --url: check tool calls too (the server parses "
                                             "them: NIM_TOOL_CALL_PARSER, or vLLM's --tool-call-parser).")] = False,
         reference_url: Annotated[str | None, typer.Option(
             help="With --url: a server on the same weights (another engine's image); greedy outputs must match "
                  "it token for token.")] = None,
         as_json: JsonFlag = False) -> None:
    """Run the harness (conformance, accuracy, performance, metrics); write a report. Exit 1 when a gate fails."""
    from factory.errors import InputError
    from factory.pipeline.runner import StageFailed

    def work():
        if (spec is None) == (url is None) or (url is not None and not model):
            raise InputError("give a SPEC, or --url URL --model NAME")
        if reference_url and url is None:
            raise InputError("--reference-url goes with --url")
        if spec is not None:
            return runner(spec, report_dir=output).test_report()
        from factory.spec import Tests
        from factory.verify.harness import HarnessConfig, load_pairs, run_harness

        report_dir = output or Path("results") / f"test-{time.strftime('%Y%m%d-%H%M%S')}"
        groups = (("openai", "nim") if suite == "nim" else ("openai",)) + (("tools",) if tools else ())
        tests = Tests(accuracy={"tasks": [task_option(t) for t in task or []]})
        config = HarnessConfig.from_tests(tests, groups=groups,
                                          reference_url=reference_url.rstrip("/") if reference_url else None)
        return run_harness(url.rstrip("/"), model, config, report_dir, pairs=load_pairs(dataset),
                           model_dir=model_dir, progress=say)

    report = guarded("test", work)
    emit(report.model_dump(mode="json"), as_json, f"{report.summary}\nreport: {report.report_dir / 'summary.md'}")
    if not report.passed:
        exit_with(StageFailed("test", report.summary, 1))


@app.command()
def publish(spec: Spec, registry: Annotated[str, typer.Option(help="HOST[:PORT] of an OCI registry.")] = "127.0.0.1:5000",
            force: Annotated[bool, typer.Option("--force", help="Publish although the tests failed (recorded).")] = False,
            as_json: JsonFlag = False) -> None:
    """Push image, SBOM and the validated chart to the registry and record the release; all or nothing."""
    release = guarded("publish", runner(spec, registry, force=force).publish)
    emit(release.model_dump(), as_json, f"{release.image.reference}@{release.image.digest}\n"
                                        f"{release.chart.reference}@{release.chart.digest}\n"
                                        f"{release.sbom.reference if release.sbom else ''}"
                                        + (f"\nmodel {release.model.reference} signed by key {release.model.key}"
                                           if release.model else ""))


@app.command("catalog")
def catalog_command(as_json: JsonFlag = False) -> None:
    """List the published releases."""
    from factory.release.catalog import releases

    entries = releases()
    if as_json:
        typer.echo(json.dumps([r.model_dump() for r in entries], indent=2))
        return
    for r in entries:
        flag = " (forced)" if r.forced else ""
        model = f"  model {r.model.reference} (key {r.model.key[:19]})" if r.model else ""
        typer.echo(f"{r.time}  {r.name} {r.version}  {r.image.reference}@{r.image.digest[:19]}  "
                   f"chart {r.chart.reference}{model}  tests: {r.tests.summary}{flag}")


@app.command("stack")
def stack_command(registry: Annotated[str, typer.Option(help="Address of the local registry.")] = "127.0.0.1:5000") -> None:
    """Start (or find) dockerd, the local registry and helm; idempotent."""
    from factory.stack import stack_up

    for part, value in guarded("stack", lambda: stack_up(registry)).items():
        typer.echo(f"{part}: {value}")


@app.command("run")
def run_pipeline(pipeline: Annotated[Path, typer.Argument(help="A pipeline file (pipelines/*.yaml).")]) -> None:
    """Run a pipeline file's stages for each of its specs; one line per stage."""
    from factory.pipeline.files import load_pipeline, run_pipeline as run_stages
    from factory.pipeline.runner import StageFailed

    def report(spec_path: Path, outcome) -> None:
        if isinstance(outcome, StageFailed):
            typer.echo(f"FAIL {spec_path.name} {outcome.stage}: {outcome.message}")
            typer.echo(f"error: {outcome}", err=True)  # as any other command reports a failure
        else:
            typer.echo(f"PASS {spec_path.name} {outcome.stage} ({outcome.seconds}s): {outcome.detail}")

    loaded = guarded("run", lambda: load_pipeline(pipeline))
    failures = run_stages(loaded, say, report)
    if failures:
        raise typer.Exit(max(f.exit_code for f in failures))


model_app = typer.Typer(no_args_is_help=True, help="Model weights as signed OCI artifacts (CNCF ModelPack, "
                        "OpenSSF model-signing).")
app.add_typer(model_app, name="model")
KeyFile = Annotated[Path, typer.Option("--key", help="PEM: the private key to sign; to verify, the public key "
                                                    "or the CA certificate(s) trusted.")]


def model_ref(text: str):
    """`REF` as the registry sees it; a malformed one is bad input (exit 2), a failing registry a failed check."""
    from factory.errors import InputError
    from service.oci import OciError, Ref

    try:
        return Ref.parse(text)
    except OciError as exc:
        raise InputError(str(exc)) from None


def with_registry(work: Callable[[], T]) -> Callable[[], T]:
    def wrapped() -> T:
        from factory.errors import CheckFailed
        from service.oci import OciError

        try:
            return work()
        except OciError as exc:
            raise CheckFailed(str(exc)) from None

    return wrapped


@model_app.command("push")
def model_push(source: Annotated[Path, typer.Argument(help="A model directory, or a spec whose model.source is one.")],
               to: Annotated[str, typer.Option("--to", help="REGISTRY/REPO[:TAG]; the tag defaults to the spec's "
                                                            "version, else latest.")],
               as_json: JsonFlag = False) -> None:
    """Push the weights as a ModelPack artifact, one layer per file; print REF@sha256:... last."""
    from factory.model.push import push_model
    from factory.model.source import model_to_push

    def work():
        directory, name, version = model_to_push(source)
        return push_model(directory, model_ref(to), name, version)

    pushed = guarded("model push", with_registry(work))
    emit({**asdict(pushed), "ref": str(pushed.ref)}, as_json,
         f"{pushed.files} files, {pushed.bytes_total} bytes; {pushed.bytes_sent} bytes sent (the rest the registry "
         f"held)\n{pushed.ref}")


@model_app.command("sign")
def model_sign(ref: Annotated[str, typer.Argument(help="REGISTRY/REPO[:TAG|@sha256:...] of a model artifact.")],
               key: KeyFile,
               cert: Annotated[Path | None, typer.Option("--cert", help="Sign as this certificate (PEM) of the key.")] = None,
               chain: Annotated[list[Path], typer.Option("--chain", help="The certificates up to the CA (PEM), "
                                                                        "issuer first; repeat for more.")] = [],
               as_json: JsonFlag = False) -> None:
    """Sign the artifact's files with OpenSSF model-signing; store the signature as its referrer."""
    from factory.model.signing import sign_artifact

    signed = guarded("model sign", with_registry(lambda: sign_artifact(model_ref(ref), key, cert, tuple(chain))))
    emit({k: str(v) for k, v in vars(signed).items()}, as_json,
         f"signed {signed.artifact} with key {signed.key}\nsignature {signed.signature}")


@model_app.command("verify")
def model_verify(ref: Annotated[str, typer.Argument(help="REGISTRY/REPO[:TAG|@sha256:...] of a model artifact.")],
                 key: KeyFile, as_json: JsonFlag = False) -> None:
    """Pull the artifact and check its signature as the runtime does; exit 1 on any mismatch."""
    from factory.model.signing import verify_artifact

    verified = guarded("model verify", with_registry(lambda: verify_artifact(model_ref(ref), key)))
    emit({k: str(v) for k, v in vars(verified).items()}, as_json,
         f"verified {verified.artifact} against key {verified.key}")


bundle_app = typer.Typer(no_args_is_help=True, help="A release carried into an air gap: one OCI image layout tar.")
app.add_typer(bundle_app, name="bundle")


@bundle_app.command("export")
def bundle_export(release: Annotated[str, typer.Argument(help="MODEL[:VERSION] from the catalog; newest by default.")],
                  out: Annotated[Path, typer.Option("-o", "--out", help="The tar to write.")]) -> None:
    """Write the release's image, SBOM, chart, model artifact and signature as one OCI image layout."""
    from factory.release.bundle import export_bundle, find_release

    def work():
        found = find_release(release)
        return found, export_bundle(found, out)

    found, blobs = guarded("bundle export", work)
    typer.echo(f"{found.name} {found.version}: {blobs} blobs, {out.stat().st_size} bytes\n{out}")


@bundle_app.command("import")
def bundle_import(bundle: Annotated[Path, typer.Argument(help="A tar written by `inferkiln bundle export`.")],
                  registry: Annotated[str, typer.Option(help="HOST[:PORT] of the registry to load it into.")],
                  charts: Annotated[Path, typer.Option(help="Where the rewritten chart package goes.")] = Path("build/charts"),
                  as_json: JsonFlag = False) -> None:
    """Load a bundle into a registry, point the chart at it, and record the release there."""
    from factory.release.bundle import import_bundle

    imported = guarded("bundle import", lambda: import_bundle(bundle, registry, charts))
    r = imported.release
    emit(r.model_dump(), as_json, f"{imported.manifests} manifests into {registry} ({imported.blobs} blobs sent)\n"
                                  f"{r.image.reference}@{r.image.digest}\n{r.chart.reference}@{r.chart.digest}")


@app.command("tiny-model")
def tiny_model(out: Annotated[Path | None, typer.Option("--out", help="Directory to write; default: the cache.")] = None) -> None:
    """Make (or reuse from its cache) the bundled tiny model; print its directory last."""
    from factory.tinymodel import ensure_tiny_model

    say("making the tiny model (cached after the first run)...")
    typer.echo(str(ensure_tiny_model(out)))


@app.command("tiny-adapter")
def tiny_adapter(out: Annotated[Path | None, typer.Option("--out", help="Directory to write; default: the cache.")] = None,
                 name: Annotated[str, typer.Option("--name", help="The adapter's name; it decides what it learns.")] = "tiny-lora") -> None:
    """Make (or reuse from its cache) a LoRA adapter for the tiny model with peft; print its directory last."""
    from factory.tinymodel.adapter import ensure_tiny_adapter

    say(f"training the LoRA adapter {name} for the tiny model (cached after the first run)...")
    typer.echo(str(ensure_tiny_adapter(name, out)))


@app.command()
def demo(registry: Annotated[str, typer.Option(help="The local registry to publish to.")] = "127.0.0.1:5000",
         keep: Annotated[bool, typer.Option("--keep/--no-keep", help="Leave the model running and print a curl line.")] = True,
         spec: Annotated[Path | None, typer.Option(help="Another spec than the bundled tiny model's.")] = None) -> None:
    """The whole path on the bundled tiny model: stack, build, chart, test, publish; prints the report."""
    from factory.pipeline.demo import run_demo

    guarded("demo", lambda: run_demo(registry=registry, keep=keep, echo=typer.echo, progress=say, spec=spec))


def main() -> None:
    app(prog_name="inferkiln")


if __name__ == "__main__":
    sys.exit(main())
