"""`python -m service serve | list-model-profiles | download-to-cache` (NIM's commands)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from service.logs import configure_logging
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


def serve(settings: Settings) -> int:
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
