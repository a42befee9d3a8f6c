"""Rendering a spec into build contexts a person can read and `docker build` by hand.

    out/runtime/  Dockerfile, bin/ wrappers, requirements.txt (the wheel set; wheels are added at build)
    out/model/    Dockerfile, model_manifest.yaml, model/ (the weights, when baked)
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import jinja2

from factory.paths import repo_root
from factory.spec import LoadedSpec
from service.manifest import Manifest, ModelInfo, Profile, ProfileTags

UID = 1000
PORT = 8000
MANIFEST_PATH = "/opt/nim/etc/default/model_manifest.yaml"
MODEL_DIR = "/opt/nim/model"
CPU_BASE_IMAGE = "inferkiln/base:bookworm-py311"
CUDA_BASE_IMAGE = os.environ.get("INFERKILN_CUDA_BASE_IMAGE", "nvcr.io/nvidia/cuda:12.8.1-runtime-ubuntu22.04")
RUNTIME_ENV = {
    "PATH": "/opt/nim/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/opt/nim",
    "NIM_CACHE_PATH": "/opt/nim/.cache",
    "NIM_MANIFEST_PATH": MANIFEST_PATH,
    "NIM_SERVER_PORT": str(PORT),
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "0",
}


def templates() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(repo_root() / "dockerfiles"),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


@dataclass(frozen=True)
class RuntimePlan:
    """Everything that decides a runtime image."""

    flavor: str
    base_image: str
    install_python: bool
    requirement: str

    @classmethod
    def for_spec(cls, loaded: LoadedSpec) -> RuntimePlan:
        runtime = loaded.spec.runtime
        if runtime.flavor == "cuda":
            return cls("cuda", runtime.base_image or CUDA_BASE_IMAGE, True, "inferkiln[vllm]")
        return cls("cpu", runtime.base_image or CPU_BASE_IMAGE, False, "inferkiln")

    def dockerfile(self) -> str:
        return templates().get_template("runtime.Dockerfile.j2").render(
            base_image=self.base_image, install_python=self.install_python, requirement=self.requirement,
            uid=UID, port=PORT, env=RUNTIME_ENV)


def model_manifest(loaded: LoadedSpec) -> Manifest:
    spec = loaded.spec
    source = f"local://{MODEL_DIR}" if spec.model.bake else spec.model.source
    profiles = [Profile(tags=ProfileTags(**p.model_dump(exclude={"engine_args"})), engine_args=p.engine_args)
                for p in spec.profiles]
    return Manifest(model=ModelInfo(name=spec.served_name, source=source, license=spec.model.license),
                    profiles=profiles)


def model_dockerfile(loaded: LoadedSpec, runtime_image: str, labels: dict[str, str]) -> str:
    spec = loaded.spec
    env = {"NIM_SERVED_MODEL_NAME": spec.served_name}
    return templates().get_template("model.Dockerfile.j2").render(
        runtime_image=runtime_image, manifest_path=MANIFEST_PATH, bake=spec.model.bake, model_dir=MODEL_DIR,
        env=env, labels=labels)


def write_runtime_context(plan: RuntimePlan, out: Path, requirements: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "Dockerfile").write_text(plan.dockerfile())
    shutil.copytree(repo_root() / "dockerfiles" / "bin", out / "bin", dirs_exist_ok=True)
    (out / "requirements.txt").write_text("".join(f"{line}\n" for line in requirements))
    return out


def write_model_context(loaded: LoadedSpec, out: Path, runtime_image: str, labels: dict[str, str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "Dockerfile").write_text(model_dockerfile(loaded, runtime_image, labels))
    (out / "model_manifest.yaml").write_text(model_manifest(loaded).to_yaml())
    weights = out / "model"
    if weights.exists():
        shutil.rmtree(weights)
    if loaded.spec.model.bake:
        source = loaded.local_source()
        if source is None:
            raise ValueError(f"{loaded.path}: model.bake needs the weights here; fetch hf:// sources first "
                             "(python -m service download-to-cache) and point model.source at them")
        shutil.copytree(source, weights, copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(".*", "inferkiln-tiny-model.json"))
    return out


def _link_or_copy(src: str, dst: str) -> None:
    """Hard links keep big weights from being copied into every build context; a file the image's
    non-root user could not read is copied instead and made readable (a link would share its mode)."""
    if os.stat(src).st_mode & stat.S_IROTH:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)
