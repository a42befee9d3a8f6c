"""Runtime settings: one typed model from which the NIM_* variables and the CLI flags both come.

Precedence is CLI flag > environment > selected profile > default. Fields left `None` here are
filled from the selected profile's `engine_args` or the engine's own default once a profile is
chosen (see `service.runtime`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.image_contract import CACHE_PATH, MANIFEST_PATH, PORT

SECRET_FIELDS = frozenset({"api_key"})
SECRET_ENV = frozenset({"NIM_API_KEY"})  # the runtime's own secrets: an engine child process never gets them


def _opt(env: str, flag: str, description: str, **kwargs: Any) -> Any:
    return Field(description=description, json_schema_extra={"env": env, "flag": flag}, **kwargs)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str | None = _opt(
        "NIM_MODEL_PATH", "--model", "Local model directory, hf://org/name[@revision] or oci://REGISTRY/REPO[:TAG|@sha256:...] "
        "(a ModelPack artifact); default: the manifest's source.", default=None)
    served_model_name: str | None = _opt(
        "NIM_SERVED_MODEL_NAME", "--served-model-name", "The id clients send as `model`; default: the manifest's model name.", default=None)
    model_profile: str | None = _opt(
        "NIM_MODEL_PROFILE", "--profile", "Profile id or name; unset selects one automatically from the hardware.", default=None)
    manifest_path: str = _opt(
        "NIM_MANIFEST_PATH", "--manifest", "The model manifest (YAML).", default=MANIFEST_PATH)
    cache_path: str = _opt("NIM_CACHE_PATH", "--cache-path", "The weights cache directory.", default=CACHE_PATH)
    host: str = _opt("NIM_SERVER_HOST", "--host", "Address the HTTP server binds.", default="0.0.0.0")
    server_port: int = _opt("NIM_SERVER_PORT", "--port", "HTTP port.", default=PORT, ge=0, le=65535)
    max_model_len: int | None = _opt(
        "NIM_MAX_MODEL_LEN", "--max-model-len", "Context limit (prompt + output); default: the model config.", default=None, ge=1)
    max_num_seqs: int | None = _opt(
        "NIM_MAX_NUM_SEQS", "--max-num-seqs", "Sequences decoded together; default: profile, then engine.", default=None, ge=1)
    max_queue: int | None = _opt(
        "NIM_MAX_QUEUE", "--max-queue", "Waiting requests before new ones get 503 + Retry-After.", default=None, ge=0)
    max_seqs_per_request: int | None = _opt(
        "NIM_MAX_SEQS_PER_REQUEST", "--max-seqs-per-request", "Sequences one request may make (prompts x n); above it "
        "a 400. Default: max_num_seqs + NIM_MAX_QUEUE, what the server holds at once.", default=None, ge=1)
    max_stop_strings: int = _opt(
        "NIM_MAX_STOP_STRINGS", "--max-stop-strings", "Stop strings one request may give (each is looked for after "
        "every token of every choice); above it a 400. vLLM's VLLM_MAX_STOP_STRINGS in a vLLM profile. Default 4, as "
        "OpenAI's API and vLLM.", default=4, ge=1)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _opt(
        "NIM_LOG_LEVEL", "--log-level", "Log level.", default="INFO")
    jsonl_logging: bool = _opt("NIM_JSONL_LOGGING", "--jsonl-logging", "1 = one JSON object per log line.", default=False)
    tensor_parallel_size: int | None = _opt(
        "NIM_TENSOR_PARALLEL_SIZE", "--tensor-parallel-size", "Overrides the profile's tp.", default=None, ge=1)
    disable_model_download: bool = _opt(
        "NIM_DISABLE_MODEL_DOWNLOAD", "--disable-model-download", "1 = never fetch weights; fail if absent.", default=False)
    model_mount: str | None = _opt(
        "NIM_MODEL_MOUNT", "--model-mount", "Where the oci:// model of NIM_MODEL_PATH is mounted (a Kubernetes image "
        "volume): served from there and verified against its signature, not pulled.", default=None)
    model_verify: bool = _opt(
        "NIM_MODEL_VERIFY", "--model-verify", "0 = serve a model that is unsigned or does not verify (reported in "
        "/v1/metadata and the logs); 1 = a model from an oci:// source must verify against NIM_MODEL_VERIFY_KEY.",
        default=True)
    model_verify_key: str | None = _opt(
        "NIM_MODEL_VERIFY_KEY", "--model-verify-key", "Public key (PEM file) model signatures must verify against.",
        default=None)
    passthrough_args: str = _opt(
        "NIM_PASSTHROUGH_ARGS", "--passthrough-args", "Extra arguments for an upstream engine process.", default="")
    enable_kv_cache_reuse: bool = _opt(
        "NIM_ENABLE_KV_CACHE_REUSE", "--enable-kv-cache-reuse", "1 = reuse the KV cache of shared prompt prefixes "
        "(prefix caching) where the engine has it.", default=True)
    kv_cache_tokens: int | None = _opt(
        "NIM_KV_CACHE_TOKENS", "--kv-cache-tokens", "Tokens the torch engine's paged KV cache holds, all sequences "
        "together; default: max_num_seqs x max_model_len, of which only the blocks used take memory.",
        default=None, ge=1)
    cpu_threads: int | None = _opt(
        "NIM_CPU_THREADS", "--cpu-threads", "Threads of the torch engine's forward pass on CPU; default: the profile's "
        "engine_args, else every core for models of 10M parameters and more, every core but one (left to the HTTP "
        "side) below.", default=None, ge=1)
    peft_source: str | None = _opt(
        "NIM_PEFT_SOURCE", "--peft-source", "Directory of LoRA adapters, one PEFT adapter per subdirectory (its name is "
        "the adapter's model id); unset: no adapters.", default=None)
    peft_refresh_interval: float | None = _opt(
        "NIM_PEFT_REFRESH_INTERVAL", "--peft-refresh-interval", "Seconds between rescans of NIM_PEFT_SOURCE (new "
        "adapters served, removed ones refused); unset: adapters are read once at start.", default=None, gt=0)
    max_lora_rank: int = _opt(
        "NIM_MAX_LORA_RANK", "--max-lora-rank", "Largest adapter rank accepted.", default=64, ge=1)
    max_gpu_loras: int = _opt(
        "NIM_MAX_GPU_LORAS", "--max-gpu-loras", "Adapters held in the engine's pool at once (a batch mixes these).",
        default=8, ge=1)
    max_cpu_loras: int = _opt(
        "NIM_MAX_CPU_LORAS", "--max-cpu-loras", "Adapters whose weights are kept in host memory.", default=16, ge=1)
    tool_call_parser: Literal["hermes"] | None = _opt(
        "NIM_TOOL_CALL_PARSER", "--tool-call-parser", "How the model writes tool calls (vLLM's parser names: hermes); "
        "unset: requests with tools get a 400 unless tool_choice is none.", default=None)
    api_key: str | None = _opt(
        "NIM_API_KEY", "--api-key", "When set, /v1 inference routes need `Authorization: Bearer <key>`.", default=None)
    max_request_bytes: int = _opt(
        "NIM_MAX_REQUEST_BYTES", "--max-request-bytes", "Largest request body accepted (413 above).", default=2 * 1024 * 1024, ge=1024)
    shutdown_grace_seconds: float = _opt(
        "NIM_SHUTDOWN_GRACE_SECONDS", "--shutdown-grace-seconds", "After SIGTERM, how long in-flight requests may finish.", default=30.0, ge=0)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    def public_dict(self) -> dict[str, Any]:
        """The settings with secrets masked, for logs and diagnostics."""
        data = self.model_dump()
        for name in SECRET_FIELDS:
            if data.get(name):
                data[name] = "***"
        return data


class SettingsError(ValueError):
    """A setting has a bad value; the message is one line naming the variable or flag."""


def _field_meta(name: str) -> dict[str, str]:
    return Settings.model_fields[name].json_schema_extra  # type: ignore[return-value]


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per settings field; unset flags are absent so they never mask the environment."""
    for name, field in Settings.model_fields.items():
        meta = _field_meta(name)
        parser.add_argument(meta["flag"], dest=name, default=argparse.SUPPRESS,
                            help=f"{field.description} [env {meta['env']}]")


def load_settings(cli: Mapping[str, Any], environ: Mapping[str, str]) -> Settings:
    """Merge CLI values over environment values and validate them, naming the source on error."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in Settings.model_fields:
        meta = _field_meta(name)
        if name in cli and cli[name] is not None:
            values[name], sources[name] = cli[name], meta["flag"]
        elif environ.get(meta["env"], "") != "":
            values[name], sources[name] = environ[meta["env"]], meta["env"]
    try:
        return Settings(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0])
        raise SettingsError(f"{sources.get(name, name)}={values.get(name)!r}: {error['msg']}") from None
