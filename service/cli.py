"""`python -m service serve | list-model-profiles | download-to-cache` (NIM's commands)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service.logs import configure_logging
from service.profiles import SPARE_CORE_FROM, cpu_cores
from service.settings import Settings, SettingsError, add_settings_arguments, load_settings

log = logging.getLogger("service")


def parse(argv: list[str] | None) -> tuple[str, Settings, bool]:
    parser = argparse.ArgumentParser(prog="python -m service", description="inferkiln NIM runtime")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("serve", "serve the OpenAI-compatible API"),
                            ("list-model-profiles", "show every profile as compatible or not, with reasons"),
                            ("download-to-cache", "place the model's weights in NIM_CACHE_PATH")):
        sub = commands.add_parser(name, help=help_text)
        add_settings_arguments(sub)
        if name == "serve":
            sub.add_argument("--dry-run", action="store_true",
                             help="print the selected profile and the resolved engine command line, then exit")
    args = vars(parser.parse_args(argv))
    command, dry_run = args.pop("command"), args.pop("dry_run", False)
    return command, load_settings(args, os.environ), dry_run


def main(argv: list[str] | None = None) -> int:
    try:
        command, settings, dry_run = parse(argv)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.jsonl_logging)
    from service.manifest import ManifestError
    from service.model_store import ModelSourceError
    from service.profiles import NoCompatibleProfile

    try:
        if command == "serve" and dry_run:
            return dry_run_serve(settings)
        return {"serve": serve, "list-model-profiles": list_model_profiles,
                "download-to-cache": download_to_cache}[command](settings)
    except (ManifestError, NoCompatibleProfile, ModelSourceError, ValueError) as exc:
        log.error("%s", exc)  # one line on stderr, as JSON where NIM_JSONL_LOGGING asks for it
        return 1


# OpenMP's threads wait for the next parallel region spinning this many rounds, then sleep. Where
# the forward pass takes every core (fewer than SPARE_CORE_FROM), libgomp's default (300000) has
# them spin through everything else between two forward passes, on the cores that the HTTP side
# and any co-located client (the factory's test stage, a benchmark's AIPerf) need. The 76M model on
# 2 cores under AIPerf (benchmarks.ngram_speculation, speculation off): c=1 57-60 against 31-33 ms
# a token, c=8 94 against 151-166 tok/s with 1000; to one light client it cost 2-8% (19.2-19.6
# against 18.9 ms). From SPARE_CORE_FROM cores on, the HTTP side has a core of its own and the
# default spin is the faster: sleeping and waking 15 threads each step cost the 76M model a third
# of its bf16 decode rate on a 16-core Xeon (5.8 against 3.8 ms a step).
OPENMP_SPIN_ROUNDS = "1000"


def openmp_spin(cores: int) -> str | None:
    """The spin serve sets for the forward pass's threads on `cores` cores; None: libgomp's default."""
    return OPENMP_SPIN_ROUNDS if cores < SPARE_CORE_FROM else None


@contextmanager
def openmp_spin_rounds(rounds: str | None) -> Iterator[None]:
    """GOMP_SPINCOUNT for the libgomp that torch loads in this block, unless the user set it (or
    `rounds` is None); the environment is as before afterwards, so child processes (vLLM's engine)
    get their own default."""
    if rounds is None or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["GOMP_SPINCOUNT"] = rounds
    try:
        yield
    finally:
        del os.environ["GOMP_SPINCOUNT"]


def serve(settings: Settings) -> int:
    with openmp_spin_rounds(openmp_spin(cpu_cores())):
        importlib.import_module("torch")  # libgomp reads GOMP_SPINCOUNT once, when torch loads it
    import uvicorn

    from service.admission import drain_then_stop
    from service.app import build_app
    from service.runtime import build_runtime, select

    log.info("starting with settings %s", settings.public_dict())
    selection = select(settings)
    if selection.profile.tags.engine == "vllm":  # vLLM's own server, the contract added in its processes
        from service.engine.vllm_server import serve as serve_with_vllm

        return serve_with_vllm(settings, selection)
    runtime = build_runtime(settings, selection)
    server: uvicorn.Server | None = None

    class DrainingServer(uvicorn.Server):
        """uvicorn's own handler would stop listening at once and re-raise the signal after shutdown
        (exit -15); this one drains first and exits 0."""

        def handle_exit(self, sig: int, frame) -> None:
            drain_then_stop(self, runtime.admission, settings.shutdown_grace_seconds, signal.Signals(sig).name)

    def on_fatal(reason: str) -> None:
        if server:
            server.should_exit = True

    app = build_app(runtime, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=settings.host, port=settings.server_port, log_config=None,
                            timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) or None,
                            log_level=settings.log_level.lower())
    server = DrainingServer(config)
    server.run()
    return 1 if runtime.failure else 0


def dry_run_serve(settings: Settings) -> int:
    """What `serve` would run, resolved (profile, settings, passthrough), without starting it."""
    from service.runtime import build_runtime

    runtime = build_runtime(settings)
    print(f"profile: {runtime.profile.name} ({runtime.profile.id})")
    print(f"engine: {runtime.engine.describe()}")
    return 0


def list_model_profiles(settings: Settings) -> int:
    from service.profiles import available_engines, detect_hardware, format_profile_table
    from service.runtime import load_model_manifest

    manifest, _ = load_model_manifest(settings)
    print(format_profile_table(manifest, detect_hardware(), available_engines()))
    return 0


def download_to_cache(settings: Settings) -> int:
    """The weights into NIM_CACHE_PATH, checked as serving checks them (a chart's init container)."""
    from service.model_store import locate_model
    from service.runtime import load_model_manifest, trust

    manifest, base_dir = load_model_manifest(settings)
    source = settings.model_path or manifest.model.source
    located = locate_model(source, cache_path=Path(settings.cache_path), base_dir=base_dir, name=manifest.model.name,
                           allow_download=not settings.disable_model_download, trust=trust(settings), into_cache=True)
    print(located.path)
    return 0
