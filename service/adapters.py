"""LoRA adapters from NIM_PEFT_SOURCE: scan, validate, refresh, list. Both engines read this registry.

The layout is NIM's: one PEFT adapter per subdirectory (`adapter_config.json` and
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them); the directory's name is
the adapter's model id. An adapter is checked against the base model before it is listed: its rank
within NIM_MAX_LORA_RANK, only the projections the engines adapt (q, k, v, o, gate, up, down), every
tensor of the shape the base model's layer has, and weights that load. A bad one is logged with its
reason and left out; it never stops the server or the other adapters.

A changed adapter (its files' sizes or times) is a new version: requests from then on get the new
weights, and the engines key what they hold (pool slots, prefix cache) by version, never by name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections LoRA may adapt, by the module names transformers' Llama-family models use.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES
# peft's saved names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")


# adapter_config.json keys that, when set, change what the adapter computes beyond plain LoRA
UNSUPPORTED = (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (fully trained layers)"),
               ("rank_pattern", "rank_pattern"), ("alpha_pattern", "alpha_pattern"), ("lora_bias", "lora_bias"),
               ("fan_in_fan_out", "fan_in_fan_out"), ("layer_replication", "layer_replication"),
               ("alora_invocation_tokens", "aLoRA"), ("target_parameters", "target_parameters"),
               ("trainable_token_indices", "trainable_token_indices"), ("use_qalora", "QA-LoRA"))


class AdapterError(ValueError):
    """This adapter cannot be served; the message says why, in one line."""


@dataclass(frozen=True)
class ModelShape:
    """What an adapter must fit: the layer count and each projection's (in, out) features."""

    layers: int
    features: dict[str, tuple[int, int]]

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or hidden // heads
        q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
        inter = config["intermediate_size"]
        return cls(config["num_hidden_layers"], {
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)})

    @classmethod
    def of_model(cls, model_dir: Path) -> ModelShape:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    scaling: float  # peft's lora_alpha / r (or / sqrt(r) with use_rslora)
    modules: frozenset[str]
    version: tuple  # the files' sizes and times: a change is a new adapter

    def load(self) -> dict[tuple[int, str], tuple[object, object]]:
        """(layer, module) -> (A [r, in], B [out, r] with the scaling folded in), as float32."""
        from safetensors.torch import load_file

        return {key: (ab["A"].float(), ab["B"].float() * self.scaling)
                for key, ab in _lora_pairs(load_file(self.path / WEIGHTS_FILE)).items()}


def _lora_pairs(tensors: dict) -> dict[tuple[int, str], dict[str, object]]:
    """peft's saved tensors by (layer, module): {"A": ..., "B": ...}; a name that is not a LoRA
    weight of a projection the engines adapt is an AdapterError."""
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for name, tensor in tensors.items():
        match = TENSOR_NAME.search(name)
        if not match:
            raise AdapterError(f"tensor {name!r} is not a LoRA weight of a decoder layer's projection")
        module = match[3]
        if module not in LORA_MODULES:
            raise AdapterError(f"targets {module!r}, which the engines do not adapt ({', '.join(LORA_MODULES)})")
        pairs.setdefault((int(match[1]), module), {})[match[4]] = tensor
    return pairs


def _version(path: Path) -> tuple:
    """The files' sizes and times; for files that cannot be stat'ed (permissions), why not: a
    refusal is then logged once, until that changes."""
    version: list = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (path / name).stat()
            version += [st.st_size, st.st_mtime_ns]
        except FileNotFoundError:
            version.append(None)
        except OSError as exc:
            version.append(f"{type(exc).__name__}: {exc.strerror}")
    return tuple(version)


def read_adapter(path: Path, shape: ModelShape, max_rank: int) -> Adapter:
    """Check one adapter directory against the base model; AdapterError says what is wrong."""
    config = _read_config(path)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is above NIM_MAX_LORA_RANK={max_rank}")
    for key, why in UNSUPPORTED:
        if config.get(key):
            raise AdapterError(f"{CONFIG_FILE}: {why} is not supported; the engines apply plain LoRA")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{CONFIG_FILE}: bias={config['bias']!r} is not supported (only 'none')")
    modules = _check_tensors(path, shape, rank)
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Adapter(path.name, path, rank, float(scaling), modules, _version(path))


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config['peft_type']!r} is not LoRA")
    return config


def _check_tensors(path: Path, shape: ModelShape, rank: int) -> frozenset[str]:
    """Every tensor a LoRA A or B of a projection the model has, of its layer's shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"no {WEIGHTS_FILE}")
    try:
        tensors = load_file(weights)  # every byte read: a truncated or corrupt file fails here
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is corrupt or unreadable: {exc}") from None
    if not tensors:
        raise AdapterError(f"{WEIGHTS_FILE} holds no tensors")
    pairs = _lora_pairs(tensors)
    for (layer, module), ab in sorted(pairs.items()):
        if layer >= shape.layers:
            raise AdapterError(f"adapts layer {layer}; the base model has {shape.layers} (a different base model)")
        features_in, features_out = shape.features[module]
        for kind, tensor in sorted(ab.items()):
            expected = (rank, features_in) if kind == "A" else (features_out, rank)
            if tuple(tensor.shape) != expected:
                raise AdapterError(f"{module} lora_{kind} of layer {layer} is {tuple(tensor.shape)}, the base model "
                                   f"needs {expected} (a different base model, or r does not match the weights)")
    half = next((key for key, ab in pairs.items() if set(ab) != {"A", "B"}), None)
    if half:
        raise AdapterError(f"layer {half[0]} {half[1]} has lora_{''.join(pairs[half])} without its pair")
    return frozenset(module for _, module in pairs)


class AdapterRegistry:
    """The adapters servable now, rescanned every NIM_PEFT_REFRESH_INTERVAL seconds."""

    def __init__(self, source: Path, shape: ModelShape, max_rank: int, base_name: str) -> None:
        self.source, self.shape, self.max_rank, self.base_name = Path(source), shape, max_rank, base_name
        self.adapters: dict[str, Adapter] = {}
        self._refused: dict[str, tuple] = {}  # name -> the version last refused (logged once)

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def scan(self) -> tuple[list[Adapter], list[Adapter]]:
        """Read the source again: (added or changed, removed or now refused)."""
        found = {path.name: path for path in self._subdirectories()}
        added, removed = [], [a for name, a in self.adapters.items() if name not in found]
        for name, path in sorted(found.items()):
            version, held = _version(path), self.adapters.get(name)
            if held and held.version == version or self._refused.get(name) == version:
                continue
            try:
                if name == self.base_name:
                    raise AdapterError(f"its name is the base model's, {self.base_name!r}")
                adapter = read_adapter(path, self.shape, self.max_rank)
            except AdapterError as exc:
                log.warning("LoRA adapter %s not served: %s", name, exc)
                self._refused[name] = version
                if held:
                    removed.append(held)
                continue
            self._refused.pop(name, None)
            if held:
                removed.append(held)
            added.append(adapter)
        for adapter in removed:
            self.adapters.pop(adapter.name, None)
        for adapter in added:
            self.adapters[adapter.name] = adapter
            log.info("LoRA adapter %s served (rank %d, %s)", adapter.name, adapter.rank, ", ".join(sorted(adapter.modules)))
        for adapter in removed:
            if adapter.name not in self.adapters:
                log.info("LoRA adapter %s removed", adapter.name)
        return added, removed

    def refuse(self, adapter: Adapter, reason: str) -> None:
        """An engine could not take an adapter the checks passed: no longer listed, until it changes."""
        log.warning("LoRA adapter %s not served: %s", adapter.name, reason)
        self._refused[adapter.name] = adapter.version
        if self.adapters.get(adapter.name) == adapter:
            del self.adapters[adapter.name]

    def _subdirectories(self) -> list[Path]:
        try:
            return [path for path in self.source.iterdir() if path.is_dir() and not path.name.startswith(".")]
        except OSError as exc:
            log.warning("NIM_PEFT_SOURCE %s cannot be read: %s", self.source, exc)
            return []

    async def refresh_every(self, interval: float, on_change: Callable[[], Awaitable[None]] | None = None) -> None:
        """Rescan forever (a task the app cancels); the scan's file reads run off the event loop.
        `on_change`: what an engine that holds its own list of adapters (vLLM) does after a change."""
        while True:
            await asyncio.sleep(interval)
            try:
                added, removed = await asyncio.to_thread(self.scan)
                if on_change and (added or removed):
                    await on_change()
            except Exception:  # one failed scan must not end refreshing
                log.exception("rescanning NIM_PEFT_SOURCE failed")
