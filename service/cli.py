"""`python -m service serve | list-model-profiles | download-to-cache` (NIM's commands)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
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

    from service.app import build_app
    from service.runtime import build_runtime

    log.info("starting with settings %s", settings.public_dict())
    runtime = build_runtime(settings)
    server: uvicorn.Server | None = None

    class DrainingServer(uvicorn.Server):
        """SIGTERM: readiness turns 503 and new requests are refused while in-flight ones finish.

        uvicorn's own handler would stop listening at once and re-raise the signal after shutdown
        (exit -15); this one drains first and exits 0. A second signal exits at once.
        """

        def handle_exit(self, sig: int, frame) -> None:
            if runtime.admission.draining:
                self.should_exit = self.force_exit = True
                return
            runtime.admission.draining = True
            log.info("received %s: draining for up to %ss", signal.Signals(sig).name, settings.shutdown_grace_seconds)
            threading.Thread(target=self._drain, name="drain", daemon=True).start()

        def _drain(self) -> None:
            deadline = time.monotonic() + settings.shutdown_grace_seconds
            while runtime.admission.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
            log.info("drained; %d request(s) still in flight", runtime.admission.in_flight)
            self.should_exit = True

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
    from service.model_store import download_to_cache as fetch
    from service.runtime import load_model_manifest

    manifest, base_dir = load_model_manifest(settings)
    source = settings.model_path or manifest.model.source
    path = fetch(source, cache_path=Path(settings.cache_path), base_dir=base_dir, name=manifest.model.name,
                 allow_download=not settings.disable_model_download)
    print(path)
    return 0
