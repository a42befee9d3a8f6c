"""Runtime flavors: the base image, Python and locked dependencies of each kind of runtime image.

A flavor's lock is made from the project's runtime dependencies plus the flavor's extra in
pyproject.toml, for one target platform, so nothing on the build host changes an image.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from factory.paths import repo_root

FlavorName = Literal["cpu", "vllm-cpu", "cuda"]
# The base every flavor shares, bootstrapped from Debian's archive (build.py) and tagged by its
# package list, so its layers are pulled once per node. vLLM's CPU kernels link libnuma, and its
# CPU install docs preload TCMalloc (service.engine.vllm_server.cpu_preload); torch.compile (vLLM's
# sampler even with enforce_eager; the torch engine's `compile_decode`) and Triton, which builds its
# CUDA launcher at first use, need a C++ compiler and Python's headers.
DEBIAN_RUNTIME = ("python3", "python3-venv", "libnuma1", "libtcmalloc-minimal4", "g++", "python3-dev")


def debian_base(packages: tuple[str, ...]) -> str:
    return "inferkiln/base:bookworm-py311-" + hashlib.sha256(",".join(packages).encode()).hexdigest()[:8]


DEBIAN_BASE_IMAGE = debian_base(DEBIAN_RUNTIME)
DEBIAN_BASES = {DEBIAN_BASE_IMAGE: DEBIAN_RUNTIME}


@dataclass(frozen=True)
class Flavor:
    name: FlavorName
    base_image: str
    python_version: str  # the base image's Python, which the lock targets
    platform: str  # uv's --python-platform for the lock
    no_emit: tuple[str, ...] = ()  # packages a dependency declares that must stay out of the image
    prune: tuple[str, ...] = ()  # paths (shell globs) under site-packages that serving never loads
    links: tuple[tuple[str, str], ...] = ()  # (link, target) under site-packages, made after install
    driver_stub: str | None = None  # under site-packages: an empty libcuda.so to link JIT-built kernels with
    # packages whose files other wheels of the lock also carry, installed again after the rest so that
    # theirs are the files left (uv installs wheels side by side: which copy lands first is not fixed);
    # the build checks that this and `prune` settle every such file (factory.image.overlaps)
    install_last: tuple[str, ...] = ()
    local_wheels: bool = False  # resolve with the find-links that hold builds outside the index (CPU torch)
    engines: tuple[str, ...] = ("torch",)  # the profile engines its image can run
    cpu_kernels: bool = True  # the torch engine's C++ CPU kernels compiled into the image (service.engine.cpu_gemm)

    @property
    def lock_path(self) -> Path:
        return lock_file(self.name)

    @property
    def pip_platforms(self) -> tuple[str, ...]:
        """pip download's --platform tags for the lock's platform: pip matches each exactly, so every
        older manylinux tag the platform runs is named too."""
        glibc_minor = int(self.platform.rsplit("_", 1)[1])
        return (*(f"manylinux_2_{minor}_x86_64" for minor in range(glibc_minor, 4, -1)),
                "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")


# Packages vLLM's CUDA build declares that a text LLM on H100, A100 or L40S never loads.
CUDA_LEFT_OUT = {
    "torchvision": "image models only; its builds must match torch's exactly",
    "torchaudio": "audio models only",
    "torchcodec": "video and audio decoding for multimodal inputs",
    "opencv-python-headless": "image and video decoding for multimodal inputs",
    "pynvvideocodec": "GPU video decoding for multimodal inputs",
    "tokenspeed-mla": "MLA attention kernels (DeepSeek-V2/V3-style models)",
    "tokenspeed-triton": "the Triton fork the MLA kernels above compile with",
    "tilelang": "manifold hyper-connection kernels (DeepSeek-V4.1)",
    "z3-solver": "a dependency of tilelang only",
    "nvidia-cutlass-dsl-libs-cu12": "the CuTe DSL's CUDA 12 libraries; this image is CUDA 13",
    "nccl-extensions": "FlashInfer's expert-parallel MoE communication; tensor parallelism uses NCCL itself",
}
# Files inside installed wheels that nothing in the image names or can load.
CUDA_PRUNED = (
    "nvidia/cu13/lib/libnvrtc.alt.so.*",  # an alternative NVRTC build; torch links libnvrtc.so
    "nvidia/cu13/lib/libnvrtc-builtins.alt.so.*",
    "nvidia/cu13/lib/libcusolverMg.so.*",  # multi-GPU cuSOLVER; torch links libcusolver only
    "nvidia/cu13/lib/libcufile_rdma.so.*",  # GPUDirect Storage over RDMA: needs rdma-core's libraries
    # NVSHMEM's InfiniBand, libfabric and UCX transports and MPI, OpenSHMEM and PMIx bootstraps: each
    # needs a fabric library the image does not carry (NVLink within a node needs none of them).
    "nvidia/nvshmem/lib/nvshmem_transport_ibgda.so.*",
    "nvidia/nvshmem/lib/nvshmem_transport_ibdevx.so.*",
    "nvidia/nvshmem/lib/nvshmem_transport_libfabric.so.*",
    "nvidia/nvshmem/lib/nvshmem_transport_ucx.so.*",
    "nvidia/nvshmem/lib/nvshmem_bootstrap_mpi.so.*",
    "nvidia/nvshmem/lib/nvshmem_bootstrap_shmem.so.*",
    "nvidia/nvshmem/lib/nvshmem_bootstrap_pmix.so.*",
    "numba/np/ufunc/tbbpool.*.so",  # numba's TBB threading layer (no libtbb); it falls back to OpenMP
    "triton/backends/nvidia/lib/cupti",  # CUPTI for Triton's Proton profiler (torch links nvidia/cu13's)
    # a build backend that FlashInfer's and torch-c-dlpack-ext's wheels each put at site-packages' top,
    # each its own (factory.image.overlaps): nothing imports it
    "build_backend.py",
)
# The CUDA wheels' directory as a CUDA_HOME for FlashInfer's JIT, which links `-L$CUDA_HOME/lib64 -lcudart`.
CUDA_HOME = "nvidia/cu13"
CUDA_HOME_LINKS = ((f"{CUDA_HOME}/lib64", "lib"), (f"{CUDA_HOME}/lib/libcudart.so", "libcudart.so.13"))
# ...and `-L$CUDA_HOME/lib64/stubs -lcuda`, which needs a libcuda.so at link time: the driver's comes from
# the toolkit as libcuda.so.1 only. As CUDA's own lib64/stubs, an object to link against whose soname
# makes the kernels load the real driver; it holds no code (a shared object may leave symbols undefined).
CUDA_DRIVER_STUB = f"{CUDA_HOME}/lib/stubs/libcuda.so"
# Libraries the NVIDIA container toolkit mounts from the host's driver at run time: the image's
# shared objects may name them, and the image must not carry them.
DRIVER_LIBRARIES = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})


def lock_file(name: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / "dockerfiles" / "locks" / f"{name}.txt"


FLAVORS: dict[str, Flavor] = {
    # xgrammar declares Triton for its CUDA mask kernel; on CPU it masks with its own C++ kernel.
    "cpu": Flavor("cpu", DEBIAN_BASE_IMAGE, "3.11", "x86_64-manylinux_2_28", no_emit=("triton",), local_wheels=True),
    # vLLM's CPU build: the same vllm package and OpenAI server as the CUDA build. Its declared
    # torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import transformers` on CPU.
    # Triton from PyPI has GPU backends only, which vLLM disables on CPU ("Triton is installed, but
    # doesn't include CPU backend") for its C++ kernels: 1 GB installed for nothing. OpenCV decodes
    # images and video for multimodal inputs, as in the cuda flavor (CUDA_LEFT_OUT).
    # Platform: Debian bookworm's glibc 2.36 (vLLM's dependencies need newer than manylinux_2_28).
    "vllm-cpu": Flavor("vllm-cpu", DEBIAN_BASE_IMAGE, "3.11", "x86_64-manylinux_2_36",
                       no_emit=("torchvision", "torchaudio", "torchcodec", "triton", "opencv-python-headless"),
                       local_wheels=True, engines=("vllm", "torch")),
    # vLLM's CUDA build with torch's CUDA build and the CUDA libraries as wheels, on the same Debian
    # base: no NVIDIA base image (the driver's libraries come from the container toolkit at run time).
    # What is left out, and why, is CUDA_LEFT_OUT below and in the README.
    "cuda": Flavor("cuda", DEBIAN_BASE_IMAGE, "3.11", "x86_64-manylinux_2_36",
                   no_emit=tuple(CUDA_LEFT_OUT), prune=tuple(CUDA_PRUNED), links=CUDA_HOME_LINKS,
                   driver_stub=CUDA_DRIVER_STUB, engines=("vllm", "torch"), cpu_kernels=False,  # GPU-bound
                   # FlashInfer pins cuda-python 12.6, which carries its own cuda.bindings in the same
                   # files as cuda-bindings 13.5 (torch's): 13.5's must win (vLLM's sampler needs it)
                   install_last=("cuda-bindings",)),
}


def flavor(name: str, base_image: str | None = None) -> Flavor:
    """The named flavor, with the spec's base image override if it gives one."""
    chosen = FLAVORS[name]
    if base_image:
        chosen = replace(chosen, base_image=base_image)
    return chosen
