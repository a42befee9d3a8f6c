"""vLLM's own OpenAI server, run in this process, with the NIM contract added in every API server.

There is no second server on the token path: `python -m service serve` resolves the profile and
the NIM_* settings into vLLM's arguments, then hands over to vLLM's `serve` command in-process.
vLLM builds its FastAPI app in each API server process it runs (`--api-server-count`), and its
`--middleware` option adds `service.vllm_contract.NimContract` to each: management routes, auth,
request ids, the body limit, metrics with NIM's names and the drain, in front of vLLM's routes.

Why `--middleware` (rather than vLLM's endpoint plugins or building its app ourselves): it has been
in vLLM's server since 0.4, is applied by vLLM in every API server process, and wraps every route,
vLLM's own included; endpoint plugins (new in 0.2x) add routes but cannot guard vLLM's, and building
the app ourselves would copy vLLM's start-up, which changes between releases.

The engine's side here (`VllmServer`) is what the contract needs of vLLM from inside its process:
ready once vLLM's health check and a one-token warm-up pass, dead once its engine has failed, and
its own metrics, all through the app vLLM built, in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import logging
import math
import os
import shlex
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.adapters import Adapter, AdapterRegistry
from service.engine.base import EngineError, EngineStats, PassthroughEngine
from service.engine.vllm_http_metrics import unlinked
from service.logs import json_lines_for_raw_output
from service.manifest import Profile
from service.model_signature import Verification
from service.profiles import vllm_build
from service.settings import SECRET_ENV, Settings

if TYPE_CHECKING:
    from service.runtime import Selection

log = logging.getLogger("service.engine.vllm")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
QUANTIZATION = {"fp8": "fp8"}  # int8 / int4 checkpoints carry their own quantization config
# engine_args the runtime itself consumes rather than passing to vLLM
RUNTIME_ARGS = frozenset({"max_queue", "max_seqs_per_request", "cpu_threads", "kv_cache_tokens"})
MIDDLEWARE = "service.vllm_contract.NimContract"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
RUNTIME_FILE_ENV = "INFERKILN_RUNTIME_FILE"  # where each API server process reads what the launcher resolved
WATCH_S = 0.5
PR_SET_CHILD_SUBREAPER = 36


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def vllm_lora_rank(rank: int) -> int:
    """vLLM takes only some values for --max-lora-rank: the smallest that holds NIM_MAX_LORA_RANK."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)  # above the last: vLLM says so itself


def vllm_arguments(model_dir: Path, served_name: str, profile: Profile, settings: Settings,
                   max_model_len: int, max_num_seqs: int, max_queue: int,
                   adapters: Iterable[Adapter] = ()) -> list[str]:
    """vLLM's arguments: profile, then NIM_* settings, then NIM_PASSTHROUGH_ARGS (last wins).

    The queue bound is vLLM's own (`--max-num-queued-reqs`, a 503 counted across its API servers),
    the drain after SIGTERM ours: `--shutdown-timeout` lets vLLM wait that long for its API servers.
    vLLM's access log is off: the contract logs one line per request, with its id. With
    NIM_PEFT_SOURCE, LoRA is on and the adapters the registry accepted are vLLM's `--lora-modules`; with
    NIM_TOOL_CALL_PARSER, vLLM parses tool calls with its parser of that name."""
    tags = profile.tags
    args: dict[str, Any] = {"model": str(model_dir), "served_model_name": served_name, "host": settings.host,
                            "port": settings.server_port, "tensor_parallel_size": tags.tp,
                            "pipeline_parallel_size": tags.pp}
    if tags.precision in DTYPES:
        args["dtype"] = DTYPES[tags.precision]
    if tags.precision in QUANTIZATION:
        args["quantization"] = QUANTIZATION[tags.precision]
    args.update({k: v for k, v in profile.engine_args.items() if k not in RUNTIME_ARGS})
    args.update(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_queued_reqs=max_num_seqs + max_queue,
                shutdown_timeout=math.ceil(settings.shutdown_grace_seconds), disable_uvicorn_access_log=True)
    if settings.tensor_parallel_size:
        args["tensor_parallel_size"] = settings.tensor_parallel_size
    args["enable_prefix_caching"] = settings.enable_kv_cache_reuse
    if settings.tool_call_parser:
        args.update(enable_auto_tool_choice=True, tool_call_parser=settings.tool_call_parser)
    if settings.peft_source:
        args.update(enable_lora=True, max_lora_rank=vllm_lora_rank(settings.max_lora_rank),
                    max_loras=settings.max_gpu_loras, max_cpu_loras=max(settings.max_cpu_loras, settings.max_gpu_loras))
    out: list[str] = []
    for name, value in args.items():
        if value is True:
            out.append(_flag(name))
        elif value is False:
            out.append("--no-" + name.replace("_", "-"))
        elif value is not None:
            out += [_flag(name), json.dumps(value) if isinstance(value, dict | list) else str(value)]
    modules = [f"{adapter.name}={adapter.path}" for adapter in adapters]
    out += ["--lora-modules", *modules] if modules else []
    return out + ["--middleware", MIDDLEWARE] + shlex.split(settings.passthrough_args)


class VllmServer(PassthroughEngine):
    """vLLM in this process, seen from the contract's side of its app."""

    def __init__(self, arguments: list[str], served_name: str, max_model_len: int, max_num_seqs: int,
                 settings_environment: Mapping[str, str] | None = None) -> None:
        """`settings_environment`: the NIM_* settings vLLM reads from its environment, under vLLM's names."""
        self.arguments, self.served_name = arguments, served_name
        self.settings_environment = dict(settings_environment or {})
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.app: Any = None  # vLLM's ASGI stack below the contract, set by `attach`
        self.root_app: Any = None  # vLLM's FastAPI app (its state holds the engine client)
        self._ready = False
        self._stats = EngineStats(0, 0, max_num_seqs, 0.0)
        self._watch: asyncio.Task | None = None
        self._loaded: dict[str, Adapter] = {}  # the adapters vLLM holds, as the registry had them

    def describe(self) -> str:
        """The command line vLLM's docs would give for this: the environment the runtime sets for
        vLLM's processes, then `vllm serve` and its arguments."""
        variables = "".join(f"{name}={shlex.quote(value)} " for name, value in self.environment(os.environ).items())
        return variables + "vllm serve " + shlex.join(self.arguments)

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What the runtime sets for vLLM's processes: the settings vLLM reads from its environment
        (a variable of vLLM's own already set wins, as NIM_PASSTHROUGH_ARGS does), then what its
        docs give (`vllm_environment`)."""
        own = {name: value for name, value in self.settings_environment.items() if name not in environ}
        return {**own, **vllm_environment(environ)}

    def attach(self, app: Any, root_app: Any) -> None:
        """vLLM's ASGI chain below the contract, its HTTP metrics' middleware taken out of it: the
        passthrough has them recorded after each request (service.engine.vllm_http_metrics)."""
        (self.app, self.http_metrics), self.root_app = unlinked(app), root_app

    @property
    def _client(self):
        return self.root_app.state.engine_client

    @property
    def ready(self) -> bool:
        return self._ready and not self._client.errored

    def stats(self) -> EngineStats:
        return self._stats

    async def start(self) -> None:
        """Ready once vLLM's own health check passes and one token went through its completions
        route, so that a model vLLM cannot run fails at start-up, not at the first client's request."""
        try:
            await self._client.check_health()
        except Exception as exc:
            raise EngineError(f"vLLM failed its health check: {exc}") from None
        body = {"model": self.served_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        status, text = await call(self.app, self.root_app, "POST", "/v1/completions", json.dumps(body).encode())
        if status != 200 or self._client.errored:
            raise EngineError(f"vLLM cannot run this model: warm-up answered {status} {text[:300]!r}")
        self._ready = True
        self._watch = asyncio.create_task(self._watch_engine())

    async def sync_adapters(self, registry: AdapterRegistry) -> None:
        """Make vLLM's adapters the registry's, through vLLM's own model registry in this process
        (what its /v1/load_lora_adapter and /v1/unload_lora_adapter routes call, without opening
        those routes to clients). A changed adapter is unloaded first, so vLLM gives it a new id and
        reuses none of its old KV. One vLLM cannot load is logged and no longer listed."""
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

        if not self._ready:
            return  # the contract syncs once vLLM has started
        models = self.root_app.state.openai_serving_models
        for name in list(models.lora_requests):
            wanted = registry.get(name)
            if name not in self._loaded and wanted is not None:
                self._loaded[name] = wanted  # one of --lora-modules, loaded at vLLM's start
            if wanted is None or self._loaded[name] != wanted:
                await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
                self._loaded.pop(name, None)
                log.info("LoRA adapter %s unloaded from vLLM", name)
        for name, adapter in sorted(registry.adapters.items()):
            if self._loaded.get(name) == adapter:
                continue
            answer = await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(adapter.path)))
            if isinstance(answer, str):
                self._loaded[name] = adapter
            else:
                registry.refuse(adapter, f"vLLM cannot load it: {answer.error.message}")

    async def _watch_engine(self) -> None:
        while not self._client.errored:
            await asyncio.sleep(WATCH_S)
        self._ready = False
        if self.on_death:
            self.on_death("vLLM's engine died")

    async def scrape(self) -> bytes:
        """vLLM's exposition as its /metrics serves it (every API server's share, where there are
        several), and the gauges it reports under the contract's names."""
        if self.app is None:
            return b""
        status, text = await call(self.app, self.root_app, "GET", "/metrics", b"")
        if status == 200:
            self._stats = gauges_from_vllm(text.decode(), self.max_num_seqs, self._stats)
        return text if status == 200 else b""

    async def shutdown(self) -> None:
        """vLLM stops its engine itself when its server stops."""
        self._ready = False
        if self._watch:
            self._watch.cancel()


async def call(app, root_app, method: str, path: str, body: bytes) -> tuple[int, bytes]:
    """One request through an ASGI app in this process: its status and body."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "app": root_app, "state": {}}
    sent = False
    answer: dict[str, Any] = {"status": 500, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never disconnects

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return answer["status"], answer["body"]


def gauges_from_vllm(text: str, max_num_seqs: int, previous: EngineStats) -> EngineStats:
    """running, waiting, KV-cache fill and prefix-cache counters from vLLM's exposition (names of vLLM V1
    and before)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    kv = values.get("vllm:kv_cache_usage_perc", values.get("vllm:gpu_cache_usage_perc", previous.kv_cache_usage))
    return EngineStats(running=int(values.get("vllm:num_requests_running", previous.running)),
                       waiting=int(values.get("vllm:num_requests_waiting", previous.waiting)),
                       max_num_seqs=max_num_seqs, kv_cache_usage=float(kv),
                       prefix_cache_queries=int(values.get("vllm:prefix_cache_queries_total", previous.prefix_cache_queries)),
                       prefix_cache_hits=int(values.get("vllm:prefix_cache_hits_total", previous.prefix_cache_hits)))


# -- the hand-over: this process becomes vLLM's server ------------------------------------------
@dataclass(frozen=True)
class Resolved:
    """What the launcher resolved, in a file (0600, in a private directory) named in the environment:
    how it reaches the process the launcher execs into and every API server process vLLM starts."""

    settings: Settings
    profile_id: str
    model_dir: Path
    verification: Verification | None

    def write(self, path: Path) -> None:
        path.touch(mode=0o600)
        path.write_text(json.dumps({"settings": self.settings.model_dump(), "profile_id": self.profile_id,
                                    "model_dir": str(self.model_dir),
                                    "verification": self.verification and asdict(self.verification)}))
        os.environ[RUNTIME_FILE_ENV] = str(path)

    @classmethod
    def read(cls) -> Resolved:
        state = json.loads(Path(os.environ[RUNTIME_FILE_ENV]).read_text())
        verification = state["verification"]
        return cls(Settings(**state["settings"]), state["profile_id"], Path(state["model_dir"]),
                   Verification(**verification) if verification else None)


def serve(settings: Settings, selection: Selection) -> int:
    """Hand this process over to vLLM's `serve`: it execs into `serve_resolved`, which returns 1 if
    vLLM failed or its engine died, else 0 (a drained stop). Here 1 only if the exec itself failed.

    What the launcher resolved reaches the new process and every API server process through a file
    (0600, in a private directory) named in the environment; the runtime's secrets leave the
    environment, so vLLM's processes never hold them. The exec is what puts the environment vLLM's
    docs give its processes (`vllm_environment`: LD_PRELOAD on the CPU build) into this process too,
    the API server's, as into the engine processes it starts: a library preloads only at a
    process's start. Nothing resolved is resolved again (no second look at the weights)."""
    from service.runtime import adapter_registry, make_engine

    served_name = selection.served_name(settings)
    adapters = adapter_registry(settings, selection.model_dir, served_name)  # vLLM's --lora-modules
    engine = make_engine(settings, selection.profile, selection.model_dir, served_name, adapters)
    private = Path(tempfile.mkdtemp(prefix="inferkiln-"))
    Resolved(settings, selection.profile.id, selection.model_dir, selection.verification).write(private / "runtime.json")
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(write_logging_config(private, settings))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no phoning home, and no writes to ~/.config
    os.environ.update(engine.environment(os.environ))
    for name in SECRET_ENV:
        os.environ.pop(name, None)
    log.info("serving with vLLM: %s", engine.describe())
    logging.shutdown()  # what the log's writer thread holds is written before the exec ends it
    try:
        os.execv(sys.executable, [sys.executable, "-c", SERVE_RESOLVED, *engine.arguments])
    except OSError as exc:
        print(f"error: cannot start vLLM's server: {exc}", file=sys.stderr)
        return 1


# What the launcher execs into (a `-c` program rather than `-m`: this module, run as __main__,
# would be imported a second time by the contract).
SERVE_RESOLVED = "import sys; from service.engine.vllm_server import serve_resolved; sys.exit(serve_resolved(sys.argv[1:]))"


def serve_resolved(arguments: list[str]) -> int:
    """vLLM's `serve ARGUMENTS` in this process, with the settings the launcher resolved; 1 if vLLM
    failed or its engine died, else 0."""
    from service import vllm_contract
    from service.engine import vllm_modelinfo
    from service.logs import configure_logging

    settings = Resolved.read().settings
    configure_logging(settings.log_level, settings.jsonl_logging)
    _adopt_orphans()
    vllm_modelinfo.seed()
    try:
        with json_lines_for_raw_output() if settings.jsonl_logging else contextlib.nullcontext():
            run_vllm_serve(arguments)
    except Exception as exc:  # vLLM could not start (weights, memory), or a process of its died
        log.error("vLLM stopped: %s: %s", type(exc).__name__, exc)
        return _failed()
    if vllm_contract.failure:
        log.error("exiting non-zero: %s", vllm_contract.failure)
        return _failed()
    return 0


def vllm_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """What the runtime sets for the processes vLLM starts: on the CPU build, the LD_PRELOAD its docs
    give (`cpu_preload`). `--dry-run` prints it before `vllm serve`, and the harness and the
    benchmarks start vLLM's own server with it (factory.verify.container.start_vllms_own_server)."""
    if vllm_build() != "cpu":
        return {}
    preload = cpu_preload(environ.get("LD_PRELOAD", ""))
    return {"LD_PRELOAD": preload} if preload else {}


def cpu_preload(current: str, prefix: Path = Path(sys.prefix)) -> str:
    """LD_PRELOAD for vLLM's CPU build (its API server, engine core and workers), as its CPU install
    docs set it ("set LD_PRELOAD"; its worker warns without): TCMalloc
    (Debian's libtcmalloc-minimal4, in the base image) and Intel OpenMP (its wheel's intel-openmp
    dependency), each unless `current` already names one. Not the image's environment: the torch
    engine, which the vllm-cpu image also runs, decoded 0.63-0.75x as fast with Intel OpenMP preloaded
    (76M fp32, 2-core EPYC). `prefix`: the Python environment vLLM is in."""
    iomp = prefix / "lib" / "libiomp5.so"
    wanted = {"libtcmalloc": ctypes.util.find_library("tcmalloc_minimal"),
              "libiomp": str(iomp) if iomp.is_file() else None}
    added = [library for name, library in wanted.items() if library and name not in current]
    return ":".join([*added, *([current] if current else [])])


def _adopt_orphans() -> None:
    """Become the subreaper of vLLM's processes: a worker whose engine process was killed is then
    re-parented to this process rather than to init, and `_failed` can stop it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    except OSError:
        pass


def _failed() -> int:
    """After a failure vLLM may not have stopped its processes (a killed engine leaves its workers):
    none may outlive the runtime."""
    import psutil  # a dependency of vLLM's

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    return 1


def run_vllm_serve(arguments: list[str]) -> None:
    """`vllm serve ARGS`, as vLLM's CLI runs it (one API server, several, or data-parallel), without
    the `vllm` script: it asks for a distribution named `vllm`, which the CPU build is not."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    command = ServeSubcommand()
    parser = FlexibleArgumentParser(prog="vllm")
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *arguments])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


def write_logging_config(directory: Path, settings: Settings) -> Path:
    """A logging config for vLLM's processes (`VLLM_LOGGING_CONFIG_PATH`, read by each of them, and by
    its uvicorn): the runtime's format, JSON lines with NIM_JSONL_LOGGING, the request id on each."""
    formatter = "service.logs.JsonFormatter" if settings.jsonl_logging else "service.logs.TextFormatter"
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"nim": {"()": formatter}},
        "filters": {"request_id": {"()": "service.logs.RequestIdFilter"}},
        "handlers": {"nim": {"class": "service.logs.ThreadedStreamHandler", "stream": "ext://sys.stderr", "formatter": "nim",
                             "filters": ["request_id"]}},
        "root": {"handlers": ["nim"], "level": settings.log_level},
        "loggers": {name: {"handlers": [], "propagate": True, "level": settings.log_level}
                    for name in ("vllm", "uvicorn", "uvicorn.error", "service")}
                   | {"uvicorn.access": {"handlers": [], "propagate": False, "level": "WARNING"}},
    }
    path = directory / "logging.json"
    path.write_text(json.dumps(config))
    return path
