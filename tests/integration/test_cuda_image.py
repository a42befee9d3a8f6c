"""The cuda runtime flavor, proven without a GPU: `inferkiln build` of the cuda sample spec, offline on
the project's Debian base from the lock (no image pulled); every shared object it carries resolves its
libraries inside the image except the driver's; torch and vLLM import, with the CUDA the lock
promises; and, with no GPU, the image names what is missing and stops in one line.

Slow: the first run downloads 3.3 GB of wheels and builds a 7.7 GB image. CI runs it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from factory.image.context import site_packages
from factory.image.flavors import CUDA_DRIVER_STUB, DRIVER_LIBRARIES, FLAVORS
from factory.image.lock import locked_versions
from factory.pipeline.runner import Runner
from factory.stack import docker_client
from service.image_contract import VENV

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
SAMPLE = ROOT / "pipelines" / "models" / "tiny-llama-cuda.yaml"
LOCK = locked_versions(FLAVORS["cuda"].lock_path)
# Lists each ELF file's needed libraries, and every library file or soname the image holds (the venv's
# and the system's): what a needed name matches nowhere is missing from the image. readelf comes with
# the base's compiler (binutils), which Triton needs anyway. A `stubs` directory holds link-time
# stand-ins that no loader searches (the image's libcuda.so for FlashInfer's JIT): it provides nothing.
ELF_CHECK = r"""
import json, os, re, subprocess, sys
provided, needed = set(), {}
for root in sys.argv[1:]:
    for d, _, files in os.walk(root):
        if "stubs" in d.split(os.sep):
            continue
        for f in files:
            p = os.path.join(d, f)
            if ".so" not in f or os.path.islink(p) and not os.path.exists(p):
                continue
            provided.add(f)
            if os.path.islink(p):
                continue
            with open(p, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            out = subprocess.run(["readelf", "-dW", p], capture_output=True, text=True).stdout
            provided.update(re.findall(r"\(SONAME\)\s+Library soname: \[(.+?)\]", out))
            needed[p] = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
missing = {}
for p, libs in needed.items():
    for lib in libs:
        if lib not in provided:
            missing.setdefault(lib, []).append(p)
print(json.dumps({"objects": len(needed), "missing": missing}))
"""


@pytest.fixture(scope="module")
def client():
    return docker_client()


@pytest.fixture(scope="module")
def built(client, tiny_model_dir, tmp_path_factory):
    data = yaml.safe_load(SAMPLE.read_text())
    data["model"]["source"] = f"local://{tiny_model_dir}"
    spec = tmp_path_factory.mktemp("cuda") / SAMPLE.name
    spec.write_text(yaml.safe_dump(data))
    pulls_before = _pulls(client)
    images = Runner(spec).build()
    assert _pulls(client) == pulls_before, "the build pulled an image"
    return images


def _pulls(client) -> int:
    """Images with a registry digest: what `docker pull` leaves behind (a local build has none)."""
    return sum(1 for image in client.images.list() if image.attrs.get("RepoDigests"))


def run(client, image: str, *command: str, entrypoint: str | None = None, timeout: float = 300,
        user: str | None = None, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """The exit code, output and seconds of one container, with no GPU and no restart policy, logging
    JSON as the chart has it do."""
    start = time.perf_counter()
    container = client.containers.run(image, list(command), entrypoint=entrypoint, detach=True,
                                      environment={"NIM_JSONL_LOGGING": "1", **(env or {})}, user=user)
    try:
        code = container.wait(timeout=timeout)["StatusCode"]
        return code, container.logs().decode(), time.perf_counter() - start
    finally:
        container.remove(force=True)


def test_image_is_built_on_our_base_with_the_toolkits_settings_and_no_driver(client, built):
    image = client.images.get(built.model.reference)
    env = dict(item.split("=", 1) for item in image.attrs["Config"]["Env"])
    cuda = ".".join(LOCK["nvidia-cuda-runtime"].split(".")[:2])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["NVIDIA_REQUIRE_CUDA"] == f"cuda>={cuda}"
    assert client.images.get(FLAVORS["cuda"].base_image).id in {image.id, *_parents(client, image)}
    # root reads every directory; the link-time stub (CUDA_DRIVER_STUB) holds no code and is checked apart
    code, out, _ = run(client, built.model.reference, "-c", "find / -xdev \\( -name 'libcuda.so*' -o -name "
                       "'libnvidia-ml.so*' \\) -print", entrypoint="sh", user="0")
    stub = f"{site_packages(FLAVORS['cuda'])}/{CUDA_DRIVER_STUB}"
    assert code == 0 and out.split() == [stub], f"driver libraries in the image:\n{out}"
    code, out, _ = run(client, built.model.reference, "-c", f"readelf -dW --dyn-syms {stub}", entrypoint="sh")
    assert "Library soname: [libcuda.so.1]" in out and " cu" not in out, out  # a soname, no CUDA symbols


def _parents(client, image) -> set[str]:
    return {layer["Id"] for layer in client.api.history(image.id) if layer["Id"] != "<missing>"}


def test_every_shared_object_resolves_inside_the_image_but_the_drivers(client, built):
    code, out, _ = run(client, built.model.reference, "-c", ELF_CHECK, VENV, "/lib", "/usr/lib", entrypoint="python")
    assert code == 0, out[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["objects"] > 300, report["objects"]
    missing = report["missing"]
    unexpected = {lib: users[:3] for lib, users in missing.items() if lib not in DRIVER_LIBRARIES}
    assert not unexpected, f"libraries named but not in the image: {unexpected}"
    assert "libcuda.so.1" in missing, "nothing names the driver: the check is not reading the CUDA libraries"


def test_torch_and_vllm_import_with_the_locked_cuda(client, built):
    # The modules a dense model's request passes through on a GPU: vLLM's server, engine core, GPU
    # worker and model runner, the FlashAttention backend, the sampler (FlashInfer's), fp8 linear
    # layers, NCCL for tp > 1, the llama model. vLLM and torch import Triton, FlashInfer and the CuTe
    # DSL softly (a failed import only turns their kernels off), so each is imported and asked here.
    code = ("import json, torch, vllm, triton, triton.language, flashinfer, cutlass.cute, cuda.bindings\n"
            "import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.gpu_model_runner\n"
            "import vllm.v1.attention.backends.flash_attn, vllm.v1.sample.ops.topk_topp_sampler\n"
            "import vllm.model_executor.layers.quantization.fp8, vllm.model_executor.models.llama\n"
            "from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary\n"
            "from vllm.model_executor.kernels.linear.cute_dsl import ll_bf16\n"
            "from vllm.triton_utils import HAS_TRITON\n"
            "from vllm.utils.flashinfer import has_flashinfer\n"
            "from vllm.utils.import_utils import has_cutedsl, has_humming\n"
            "from torch.utils._triton import has_triton_package\n"
            "NCCLLibrary()  # dlopens libnccl.so.2 as tp > 1 does\n"
            "print(json.dumps({'cuda': torch.version.cuda, 'torch': torch.__version__, 'vllm': vllm.__version__,\n"
            "                  'bindings': cuda.bindings.__version__,  # two wheels carry its files (install_last)\n"
            "                  'available': torch.cuda.is_available(), 'triton_backends': sorted(triton.backends.backends),\n"
            "                  'soft': [HAS_TRITON, has_triton_package(), has_flashinfer(), ll_bf16.is_available(),\n"
            "                           has_cutedsl(), has_humming()]}))")
    # vLLM's HAS_TRITON also wants one active GPU driver, unless CUDA_VISIBLE_DEVICES is empty (as Ray
    # leaves it while a worker starts): then it asks only that Triton and its backends import.
    status, out, _ = run(client, built.model.reference, "-c", code, entrypoint="python", env={"CUDA_VISIBLE_DEVICES": ""})
    assert status == 0, out[-3000:]
    found = json.loads(out.strip().splitlines()[-1])
    assert found["cuda"] == ".".join(LOCK["nvidia-cuda-runtime"].split(".")[:2])
    assert found["torch"].split("+")[0] == LOCK["torch"] and found["vllm"] == LOCK["vllm"]
    assert found["bindings"] == LOCK["cuda-bindings"]
    assert found["available"] is False
    assert "nvidia" in found["triton_backends"] and found["soft"] == [True] * 6, found


def test_flashinfer_compiles_vllms_sampler_for_h100_without_a_gpu(client, built):
    """vLLM 0.32 samples with FlashInfer's kernels, which FlashInfer compiles on first use with the
    image's nvcc and headers (CUDA_HOME): compiling them for H100 (sm_90a) needs no GPU. A compiler
    of another CUDA release than the headers, or no libcudart.so to link, fails here."""
    code = ("from flashinfer.jit.sampling import gen_sampling_module\n"
            "spec = gen_sampling_module()\n"
            "spec.build()\n"
            "print(spec.get_library_path())")
    status, out, seconds = run(client, built.model.reference, "-c", code, entrypoint="python", timeout=900,
                               env={"FLASHINFER_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "2"})
    assert status == 0, out[-4000:]
    assert out.strip().splitlines()[-1].endswith(".so"), out[-2000:]


def test_list_model_profiles_marks_every_gpu_profile_incompatible(client, built):
    status, out, _ = run(client, built.model.reference, entrypoint="list-model-profiles")
    assert status == 0, out
    compatible, incompatible = out.split("Incompatible with system:")
    assert "<None>" in compatible.split("Compatible with system and runnable:")[1]
    rows = [line for line in incompatible.splitlines() if line.strip().startswith("- ")]
    assert len(rows) == 25 and all("none detected" in row for row in rows), incompatible
    assert "libnvidia-ml.so.1" in out


def test_serve_without_a_gpu_stops_within_a_minute_in_one_line(client, built):
    status, out, seconds = run(client, built.model.reference, timeout=120)
    errors = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"ERROR"' in line]
    assert status == 1 and seconds < 60, (status, seconds, out[-2000:])
    assert "Traceback" not in out and len(errors) == 1, out[-2000:]
    assert "no GPU" in errors[0]["message"] and "libnvidia-ml.so.1" in errors[0]["message"]
    assert "'h100'" in errors[0]["message"], "the line names the GPU the profiles need"
