import pytest

from service.manifest import Manifest, ManifestError, ModelInfo, Profile, ProfileTags, load_manifest, profile_id
from service.profiles import (Gpu, Hardware, NoCompatibleProfile, check_profiles, format_profile_table, gpu_kind,
                              select_profile)

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
