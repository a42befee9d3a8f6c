from pathlib import Path

import pytest
import yaml

from service.manifest import Manifest, ManifestError, ModelInfo, Profile, ProfileTags, load_manifest, profile_id
from service.profiles import (Gpu, Hardware, NoCompatibleProfile, check_profiles, detect_hardware,
                              format_profile_table, gpu_kind, select_profile, visible_gpus)

CPU = Hardware()
H100x2 = Hardware((Gpu(0, "NVIDIA H100 80GB HBM3", "h100", 80 * 2**30), Gpu(1, "NVIDIA H100 80GB HBM3", "h100", 80 * 2**30)))
L4 = Hardware((Gpu(0, "NVIDIA L4", "l4", 24 * 2**30),))
ALL_ENGINES = {"torch", "vllm", "sglang", "tensorrt_llm"}


def profile(engine="torch", precision="fp32", tp=1, gpu="cpu", kind="latency") -> Profile:
    return Profile(tags=ProfileTags(engine=engine, precision=precision, tp=tp, gpu=gpu, profile=kind))


def manifest(*profiles: Profile) -> Manifest:
    return Manifest(model=ModelInfo(name="m", source="local://model"), profiles=list(profiles))


def test_profile_id_is_sha256_of_canonical_tags():
    p = profile()
    assert p.id == profile_id(p.tags) and len(p.id) == 64
    assert profile(gpu="h100").id != p.id
    assert p.name == "torch-fp32-tp1-cpu-latency"


@pytest.mark.parametrize("name,kind", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("Tesla T4", "t4"), ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada-generation"),
])
def test_gpu_kind(name, kind):
    assert gpu_kind(name) == kind


def test_cpu_only_machine_picks_cpu_profile():
    chosen = select_profile(manifest(profile(gpu="any", precision="bf16"), profile()), CPU, {"torch"})
    assert chosen.tags.gpu == "cpu"


def test_exact_gpu_beats_any_then_engine_then_precision_then_throughput():
    m = manifest(
        profile(gpu="any", precision="bf16"),
        profile(gpu="h100", precision="bf16"),
        profile(engine="vllm", gpu="h100", precision="bf16"),
        profile(engine="vllm", gpu="h100", precision="fp8"),
        profile(engine="vllm", gpu="h100", precision="fp8", kind="throughput"),
    )
    chosen = select_profile(m, H100x2, ALL_ENGINES)
    assert (chosen.tags.engine, chosen.tags.precision, chosen.tags.profile) == ("vllm", "fp8", "throughput")
    assert select_profile(m, H100x2, {"torch"}).tags.gpu == "h100"


def test_tp_needs_enough_gpus_of_the_kind():
    m = manifest(profile(engine="vllm", gpu="h100", tp=4, precision="bf16"), profile(engine="vllm", gpu="h100", tp=2, precision="bf16"))
    assert select_profile(m, H100x2, ALL_ENGINES).tags.tp == 2
    with pytest.raises(NoCompatibleProfile) as err:
        select_profile(m, L4, ALL_ENGINES)
    assert "found 0" in str(err.value) and "NVIDIA L4" in str(err.value)


def test_cpu_profile_is_incompatible_when_gpus_are_present():
    checks = check_profiles(manifest(profile()), L4, {"torch"})
    assert not checks[0].compatible and "GPUs are present" in checks[0].reasons[0]


def test_missing_engine_and_precision_are_reasons():
    checks = check_profiles(manifest(profile(engine="vllm", gpu="any", precision="bf16"),
                                     profile(precision="int4")), CPU, {"torch"})
    assert "not available" in checks[0].reasons[0]
    assert "cannot run precision" in checks[1].reasons[0]


def test_requested_profile_by_name_or_id():
    cpu, gpu = profile(), profile(gpu="any", precision="bf16")
    m = manifest(cpu, gpu)
    assert select_profile(m, CPU, {"torch"}, requested=cpu.name) == cpu
    assert select_profile(m, CPU, {"torch"}, requested=cpu.id) == cpu
    with pytest.raises(NoCompatibleProfile, match="cannot run"):
        select_profile(m, CPU, {"torch"}, requested=gpu.name)
    with pytest.raises(NoCompatibleProfile, match="matches no profile"):
        select_profile(m, CPU, {"torch"}, requested="nope")


def test_table_lists_compatible_and_incompatible_with_reasons():
    table = format_profile_table(manifest(profile(), profile(gpu="h100", precision="bf16")), CPU, {"torch"})
    compatible, incompatible = table.split("- Incompatible with system:")
    assert "torch-fp32-tp1-cpu-latency" in compatible
    assert "torch-bf16-tp1-h100-latency" in incompatible and "none detected" in incompatible


def test_load_manifest_errors_name_file_and_field(tmp_path):
    path = tmp_path / "model_manifest.yaml"
    path.write_text("schema_version: '1'\nmodel: {name: m, source: local://x}\nprofiles:\n"
                    "  - tags: {engine: torch, precision: fp7}\n")
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    assert str(path) in str(err.value) and "profiles.0.tags.precision" in str(err.value)
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(tmp_path / "missing.yaml")


def test_manifest_round_trips_through_yaml(tmp_path):
    m = manifest(profile(), profile(gpu="any", precision="bf16"))
    path = tmp_path / "m.yaml"
    path.write_text(m.to_yaml())
    assert load_manifest(path) == m


def test_a_16_bit_cpu_profile_needs_the_cpus_native_support():
    bf16_cpu = profile(precision="bf16")
    assert bf16_cpu.tags.gpu == "cpu"
    (check,) = check_profiles(manifest(bf16_cpu), Hardware(cpu_flags=frozenset({"avx512f"})), {"torch"})
    assert not check.compatible and "avx512_bf16 or amx_bf16" in check.reasons[0]
    for flags in ({"avx512_bf16"}, {"amx_bf16", "amx_tile"}):
        (check,) = check_profiles(manifest(bf16_cpu), Hardware(cpu_flags=frozenset(flags)), {"torch"})
        assert check.compatible, check.reasons
    (check,) = check_profiles(manifest(profile()), CPU, {"torch"})
    assert check.compatible, "fp32 needs nothing"


# -- GPU detection (NVML) and the cuda sample spec's profiles, on described hardware ------------
@pytest.mark.parametrize("visible,expected", [
    (None, [0, 1, 2, 3]), ("", []), ("2", [2]), ("3,1", [3, 1]), ("GPU-2a2", [2]),
    ("1,9,2", [1]),  # CUDA stops at the first entry that names no device
    ("1,1", [1]),  # and at a repeated one
    ("-1", []),
])
def test_cuda_visible_devices_over_nvml_order(visible, expected):
    found = [(Gpu(i, f"NVIDIA H100 #{i}", "h100", 80 * 2**30), f"GPU-{i}a{i}b-{i}") for i in range(4)]
    chosen = visible_gpus(found, visible)
    assert [g.name for g in chosen] == [f"NVIDIA H100 #{i}" for i in expected]
    assert [g.index for g in chosen] == list(range(len(expected)))  # renumbered from 0, as CUDA does


def test_no_nvml_library_names_the_missing_driver():
    """On this machine there is no NVIDIA driver: NVML's library is missing, and the reason says so."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present here")
    except pynvml.NVMLError_LibraryNotFound:
        pass
    hardware = detect_hardware()
    assert not hardware.gpus and "libnvidia-ml.so.1" in hardware.describe()


CUDA_SPEC = Path(__file__).parents[2] / "pipelines" / "models" / "tiny-llama-cuda.yaml"


def cuda_manifest() -> Manifest:
    spec = yaml.safe_load(CUDA_SPEC.read_text())
    return manifest(*(profile(p["engine"], p["precision"], p["tp"], p["gpu"], p["profile"]) for p in spec["profiles"]))


def gpus(name: str, count: int) -> Hardware:
    return Hardware(tuple(Gpu(i, name, gpu_kind(name), 80 * 2**30) for i in range(count)))


@pytest.mark.parametrize("hardware,expected", [
    (gpus("NVIDIA H100 80GB HBM3", 1), "vllm-fp8-tp1-h100-latency"),
    (gpus("NVIDIA H100 80GB HBM3", 8), "vllm-fp8-tp8-h100-latency"),
    (gpus("NVIDIA A100-SXM4-80GB", 4), "vllm-fp8-tp4-a100-latency"),
    (gpus("NVIDIA L40S", 2), "vllm-fp8-tp2-l40s-latency"),
    (gpus("NVIDIA L40S", 3), "vllm-fp8-tp2-l40s-latency"),  # the largest tp that fits: there is no tp 3
    (gpus("NVIDIA L4", 1), "torch-bf16-tp1-any-latency"),  # no vLLM profile for it: the torch engine
])
def test_cuda_spec_picks_the_profile_that_uses_the_pods_gpus(hardware, expected):
    assert select_profile(cuda_manifest(), hardware, {"torch", "vllm"}).name == expected


def test_cuda_spec_without_a_gpu_fails_in_one_line_naming_the_gpus():
    hardware = Hardware(no_gpu_reason="NVML's libnvidia-ml.so.1 is missing")
    checks = check_profiles(cuda_manifest(), hardware, {"torch", "vllm"})
    assert checks and not any(c.compatible for c in checks)
    assert all("none detected" in "; ".join(c.reasons) for c in checks)
    with pytest.raises(NoCompatibleProfile) as err:
        select_profile(cuda_manifest(), hardware, {"torch", "vllm"})
    message = str(err.value)
    assert "\n" not in message and "libnvidia-ml.so.1" in message and "'h100'" in message
    assert "and 22 more (list-model-profiles" in message
