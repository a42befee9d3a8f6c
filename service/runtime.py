"""The runtime: settings + manifest + selected profile + engine + serving, built once at start-up."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from service import __version__
from service.adapters import AdapterRegistry, ModelShape
from service.admission import Admission
from service.api.serving import OpenAIServing
from service.engine.base import Engine, EngineBase, PassthroughEngine
from service.engine.lora import LoraLimits
from service.engine.ngram import NgramConfig
from service.generation_defaults import sampling_defaults
from service.manifest import Manifest, Profile, default_manifest, load_manifest
from service.metrics import ServiceMetrics
from service.model_signature import Verification
from service.model_store import Trust, locate_model
from service.profiles import Hardware, available_engines, detect_hardware, select_profile
from service.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = 32
DEFAULT_MAX_QUEUE = 256
API_VERSION = "1.0.0"


def load_model_manifest(settings: Settings) -> tuple[Manifest, Path | None]:
    """The manifest and the directory relative `local://` sources resolve against.

    A `--model` directory without a manifest at NIM_MANIFEST_PATH gets a default manifest.
    """
    manifest_path = Path(settings.manifest_path)
    if manifest_path.is_file() or not settings.model_path:
        return load_manifest(manifest_path), manifest_path.parent
    local = Path(settings.model_path.removeprefix("local://"))
    if settings.model_path.startswith("hf://"):
        name = settings.model_path.removeprefix("hf://").partition("@")[0].split("/")[-1]
        return default_manifest(Path(name), name=name, source=settings.model_path), None
    return default_manifest(local), None


def engine_setting(settings: Settings, profile: Profile, name: str, default: int | None) -> int | None:
    """CLI/env value, else the profile's engine_args value, else the default."""
    value = getattr(settings, name)
    return value if value is not None else profile.engine_args.get(name, default)


@dataclass
class Runtime:
    settings: Settings
    manifest: Manifest
    profile: Profile
    hardware: Hardware
    model_dir: Path
    engine: EngineBase
    served_model_name: str
    admission: Admission
    verification: Verification | None = None
    adapters: AdapterRegistry | None = None  # NIM_PEFT_SOURCE's LoRA adapters
    started: int = field(default_factory=lambda: int(time.time()))
    failure: str | None = None
    metrics: ServiceMetrics = field(init=False)
    serving: OpenAIServing | None = field(init=False)  # None: the engine's own app serves inference

    def __post_init__(self) -> None:
        self.metrics = ServiceMetrics(self.served_model_name, self.engine.max_model_len, self.engine.stats,
                                      shared=isinstance(self.engine, PassthroughEngine))
        self.serving = (OpenAIServing(self.engine, self.engine.tokenizer, self.served_model_name, self.metrics,
                                      self.admission, self.adapters, self.settings.tool_call_parser,
                                      sampling_defaults(self.model_dir), self.settings.max_stop_strings)
                        if isinstance(self.engine, Engine) else None)

    @property
    def model_source(self) -> str:
        return self.settings.model_path or self.manifest.model.source

    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.admission.draining and self.failure is None

    def not_ready_reason(self) -> str:
        if self.failure:
            return f"Service failed: {self.failure}"
        if self.admission.draining:
            return "Service is shutting down."
        return "Service is not ready: the engine is loading."

    def metadata(self) -> dict:
        assets = sorted(p.name for p in self.model_dir.iterdir() if p.is_file()) if self.model_dir.is_dir() else []
        return {
            "version": __version__,
            "modelInfo": [{"shortName": self.served_model_name, "modelUrl": self.model_source}],
            "selectedModelProfileId": self.profile.id,
            "assetInfo": assets,
            "licenseInfo": {"name": self.manifest.model.license or "unknown"},
        } | ({"modelVerification": self.verification.report()} if self.verification else {})

    def version(self) -> dict:
        return {"release": __version__, "api": API_VERSION}


@dataclass(frozen=True)
class Selection:
    """What start-up resolved: the manifest, the hardware, the profile chosen for it, the weights."""

    manifest: Manifest
    hardware: Hardware
    profile: Profile
    model_dir: Path
    verification: Verification | None = None

    def served_name(self, settings: Settings) -> str:
        return settings.served_model_name or self.manifest.model.name


def select(settings: Settings) -> Selection:
    """Fails fast on a bad manifest, profile or source; places the weights in the cache."""
    manifest, base_dir = load_model_manifest(settings)
    hardware = detect_hardware()
    profile = select_profile(manifest, hardware, available_engines(), settings.model_profile,
                             settings.tensor_parallel_size)
    log.info("selected profile %s (%s) on %s", profile.name, profile.id, hardware.describe())
    source = settings.model_path or manifest.model.source
    located = locate_model(source, cache_path=Path(settings.cache_path), base_dir=base_dir, name=manifest.model.name,
                           allow_download=not settings.disable_model_download, trust=trust(settings))
    return Selection(manifest, hardware, profile, located.path, located.verification)


def trust(settings: Settings) -> Trust:
    return Trust(settings.model_verify, Path(settings.model_verify_key) if settings.model_verify_key else None,
                 Path(settings.model_mount) if settings.model_mount else None)


def build_runtime(settings: Settings, selection: Selection | None = None) -> Runtime:
    """Everything short of loading weights."""
    chosen = selection or select(settings)
    profile, served_name = chosen.profile, chosen.served_name(settings)
    adapters = adapter_registry(settings, chosen.model_dir, served_name)
    engine = make_engine(settings, profile, chosen.model_dir, served_name, adapters)
    max_queue = engine_setting(settings, profile, "max_queue", DEFAULT_MAX_QUEUE)
    per_request = engine_setting(settings, profile, "max_seqs_per_request", engine.max_num_seqs + max_queue)
    if isinstance(engine, PassthroughEngine):  # vLLM counts each sequence against its queue bound: more never fit
        per_request = min(per_request, engine.max_num_seqs + max_queue)
    return Runtime(settings=settings, manifest=chosen.manifest, profile=profile, hardware=chosen.hardware,
                   model_dir=chosen.model_dir, engine=engine, served_model_name=served_name,
                   verification=chosen.verification, adapters=adapters,
                   admission=Admission(engine.max_num_seqs, max_queue, per_request))


def adapter_registry(settings: Settings, model_dir: Path, served_name: str) -> AdapterRegistry | None:
    """NIM_PEFT_SOURCE's adapters, scanned once now (NIM_PEFT_REFRESH_INTERVAL rescans, see service.app)."""
    if not settings.peft_source:
        return None
    registry = AdapterRegistry(Path(settings.peft_source), ModelShape.of_model(model_dir), settings.max_lora_rank,
                               served_name)
    registry.scan()
    return registry


def lora_limits(settings: Settings) -> LoraLimits | None:
    if not settings.peft_source:
        return None
    return LoraLimits(settings.max_gpu_loras, settings.max_cpu_loras, settings.max_lora_rank)


def model_context_length(model_dir: Path) -> int | None:
    """The context limit the model's config declares, if it can be read."""
    try:
        return json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None


def make_engine(settings: Settings, profile: Profile, model_dir: Path, served_name: str,
                adapters: AdapterRegistry | None = None) -> EngineBase:
    tags = profile.tags
    if tags.engine == "vllm":
        from service.engine.vllm_server import VllmServer, vllm_arguments

        max_model_len = engine_setting(settings, profile, "max_model_len", None) or model_context_length(model_dir)
        if max_model_len is None:
            raise ValueError(f"{model_dir}/config.json names no max_position_embeddings: set NIM_MAX_MODEL_LEN")
        max_num_seqs = engine_setting(settings, profile, "max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        max_queue = engine_setting(settings, profile, "max_queue", DEFAULT_MAX_QUEUE)
        arguments = vllm_arguments(model_dir, served_name, profile, settings, max_model_len, max_num_seqs, max_queue,
                                   adapters.adapters.values() if adapters else ())
        return VllmServer(arguments, served_name, max_model_len, max_num_seqs,
                          {"VLLM_MAX_STOP_STRINGS": str(settings.max_stop_strings)})
    if tags.engine != "torch":
        raise ValueError(f"engine {tags.engine!r} is not available in this runtime")
    compile_decode = bool(profile.engine_args.get("compile_decode", False))
    if compile_decode:  # kept with the weights, so a restarted pod compiles from inductor's cache; set
        # before the engine's imports, one of which sets inductor's default (/tmp) when none is set
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(settings.cache_path) / "torchinductor"))
    from service.engine.torch_engine import TorchEngine

    return TorchEngine(
        model_dir, device="cpu" if tags.gpu == "cpu" else "cuda", precision=tags.precision,
        max_model_len=engine_setting(settings, profile, "max_model_len", None),
        max_num_seqs=engine_setting(settings, profile, "max_num_seqs", DEFAULT_MAX_NUM_SEQS),
        cpu_threads=engine_setting(settings, profile, "cpu_threads", None),
        kv_cache_tokens=engine_setting(settings, profile, "kv_cache_tokens", None),
        enable_prefix_caching=settings.enable_kv_cache_reuse, lora=lora_limits(settings),
        speculation=speculation(profile), compile_decode=compile_decode,
    )


def speculation(profile: Profile) -> NgramConfig | None:
    """The profile's `speculative_config` (vLLM's key and format): n-gram speculation, off without it."""
    config = profile.engine_args.get("speculative_config")
    return None if config is None else NgramConfig.model_validate(config)
