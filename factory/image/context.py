"""Build contexts a person can read and `docker build` by hand, and the image references, which are
digests of exactly what goes into those contexts (so no Docker is needed to know them).

    runtime/  Dockerfile, requirements.lock, bin/ (NIM wrappers), service/ (the runtime)
    wheels/   the flavor's wheelhouse, which the runtime's build installs from over loopback
    model/    Dockerfile, model_manifest.yaml, model/ (the weights, when baked)

The runtime's identity is its lock, the runtime's code and the templates: the factory's own code
and whatever is installed on the build host are not part of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import jinja2

from factory.image.flavors import CUDA_HOME, Flavor, flavor as flavor_named
from factory.image.lock import lock_digest, locked_versions
from factory.image.wheelhouse import INSTALLER
from factory.paths import repo_root
from factory.spec import LoadedSpec, check_adapter
from service import image_contract as contract
from service.manifest import Manifest, ModelInfo, Profile, ProfileTags

IGNORED = {"__pycache__", ".pytest_cache"}


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(repo_root() / "dockerfiles"),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["quoted"] = json.dumps  # a Dockerfile's double-quoted string (tojson escapes < > & for HTML)
    return env


def tree_files(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> Iterator[Path]:
    """The files under `root` that go into an image, in a stable order."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if not (IGNORED & set(relative.parts) or relative.suffix == ".pyc" or skip(relative)):
            yield path


def tree_digest(root: Path, skip: Callable[[Path], bool] = lambda p: False) -> str:
    digest = hashlib.sha256()
    for path in tree_files(root, skip):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


# -- the runtime image -------------------------------------------------------------------------
def runtime_flavor(loaded: LoadedSpec) -> Flavor:
    return flavor_named(loaded.spec.runtime.flavor, loaded.spec.runtime.base_image)


def runtime_dockerfile(flavor: Flavor) -> str:
    return templates().get_template("runtime.Dockerfile.j2").render(
        base_image=flavor.base_image, uid=contract.UID, port=contract.PORT, home=contract.HOME, venv=contract.VENV,
        site_packages=site_packages(flavor), prune=flavor.prune, links=flavor.links,
        driver_stub=flavor.driver_stub, installer=INSTALLER, install_last=flavor.install_last, vllm="vllm" in flavor.engines,
        app_dir=contract.APP_DIR, cache_path=contract.CACHE_PATH, cpu_kernels=flavor.cpu_kernels,
        kernel_dir=contract.CPU_KERNEL_DIR,
        manifest_dir=str(Path(contract.MANIFEST_PATH).parent), model_dir=contract.MODEL_DIR,
        env=contract.image_env() | kernel_env(flavor) | gpu_env(flavor))


def kernel_env(flavor: Flavor) -> dict[str, str]:
    """Where the torch engine finds the C++ kernels the image was built with."""
    return {"INFERKILN_KERNEL_DIR": contract.CPU_KERNEL_DIR} if flavor.cpu_kernels else {}


def gpu_env(flavor: Flavor) -> dict[str, str]:
    """For a flavor that locks the CUDA runtime, what NVIDIA's CUDA images set for the container
    toolkit (which mounts the driver's libraries for these capabilities and refuses to start the
    container on a driver older than the CUDA version the lock installs), and where kernels go."""
    runtime = locked_versions(flavor.lock_path).get("nvidia-cuda-runtime")
    if runtime is None:
        return {}
    major, minor = runtime.split(".")[:2]
    return {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            "NVIDIA_REQUIRE_CUDA": f"cuda>={major}.{minor}",
            # NVML's order, which detection reads (CUDA's own default puts the fastest GPU first)
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            # Triton writes compiled kernels under $HOME, which is read-only in a pod: keep them in the
            # cache volume with vLLM's and FlashInfer's, so a restart reuses them.
            "TRITON_CACHE_DIR": f"{contract.CACHE_PATH}/triton",
            # the CUDA compiler and headers FlashInfer's JIT uses (from the wheels; see CUDA_HOME_LINKS)
            "CUDA_HOME": f"{site_packages(flavor)}/{CUDA_HOME}"}


def site_packages(flavor: Flavor) -> str:
    return f"{contract.VENV}/lib/python{flavor.python_version}/site-packages"


def runtime_digest(flavor: Flavor, root: Path | None = None) -> str:
    """The rendered Dockerfile, the lock, the wrappers and the `service` package; nothing else."""
    root = root or repo_root()
    parts = [runtime_dockerfile(flavor), lock_digest(flavor, root), tree_digest(root / "dockerfiles" / "bin"),
             tree_digest(root / "service")]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def runtime_reference(flavor: Flavor) -> str:
    return f"inferkiln/runtime-{flavor.name}:{runtime_digest(flavor)[:12]}"


def write_runtime_context(flavor: Flavor, out: Path) -> Path:
    """The runtime context: no wheels, which the build fetches from the WHEELS location."""
    root = repo_root()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "Dockerfile").write_text(runtime_dockerfile(flavor))
    shutil.copyfile(flavor.lock_path, out / "requirements.lock")
    for name, source in (("bin", root / "dockerfiles" / "bin"), ("service", root / "service")):
        for path in tree_files(source):
            target = out / name / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return out


def link_wheelhouse(wheels: Path, out: Path) -> Path:
    """The wheels and the installer the runtime's build fetches, as the factory serves them."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted([*wheels.glob("*.whl"), wheels / INSTALLER]):
        _link_or_copy(str(path), str(out / path.name))
    return out


# -- the model image ---------------------------------------------------------------------------
def model_manifest(loaded: LoadedSpec) -> Manifest:
    spec = loaded.spec
    source = f"local://{contract.MODEL_DIR}" if spec.model.bake else spec.model.source
    profiles = [Profile(tags=ProfileTags(**p.model_dump(exclude={"engine_args"})), engine_args=p.engine_args)
                for p in spec.profiles]
    return Manifest(model=ModelInfo(name=spec.served_name, source=source, license=spec.model.license),
                    profiles=profiles)


def weights_digest(loaded: LoadedSpec) -> str:
    """The weights the image carries (or names), with the key their signature must verify against."""
    source, key = loaded.local_source(), loaded.verify_key()
    named = loaded.spec.model.source.encode() + (key.read_bytes() if key else b"")
    if source is None or not loaded.spec.model.bake:
        return hashlib.sha256(named).hexdigest()
    return tree_digest(source, skip=_not_weights) + (hashlib.sha256(named).hexdigest() if key else "")


def _not_weights(relative: Path) -> bool:
    return relative.name.startswith(".") or relative.name == "inferkiln-tiny-model.json"


def adapters_digest(loaded: LoadedSpec) -> str:
    """The adapters the image carries: local ones by their files, oci:// ones by digest and key."""
    parts = []
    for adapter in loaded.spec.adapters:
        if (local := loaded.local_adapter(adapter)) is not None:
            parts.append(tree_digest(local, skip=_not_weights))
        else:
            key = loaded.adapter_key(adapter)
            parts.append(hashlib.sha256(adapter.source.encode() + (key.read_bytes() if key else b"")).hexdigest())
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def adapter_dirs(loaded: LoadedSpec) -> dict[str, Path]:
    """Each adapter's directory here: a local one as it is, an oci:// one pulled into the factory's
    cache and verified against its key, then checked against the model as the runtime will."""
    from factory.errors import InputError
    from factory.paths import cache_dir
    from service.adapters import AdapterError
    from service.model_store import ModelSourceError, Trust, locate_model

    dirs = {}
    for i, adapter in enumerate(loaded.spec.adapters):
        if (local := loaded.local_adapter(adapter)) is not None:
            dirs[adapter.name] = local  # checked when the spec was loaded
            continue
        try:
            path = locate_model(adapter.source, cache_path=cache_dir() / "adapters", base_dir=None, name=adapter.name,
                                allow_download=True, trust=Trust(True, loaded.adapter_key(adapter))).path
            check_adapter(path, loaded.local_source())
        except (ModelSourceError, AdapterError) as exc:
            raise InputError(f"{loaded.path}: adapters.{i}.source: {exc}") from None
        dirs[adapter.name] = path
    return dirs


def model_digest(loaded: LoadedSpec, runtime_ref: str) -> str:
    template = (repo_root() / "dockerfiles" / "model.Dockerfile.j2").read_text()
    return hashlib.sha256(json.dumps([runtime_ref, loaded.spec.digest(), template, weights_digest(loaded)]
                                     + ([adapters_digest(loaded)] if loaded.spec.adapters else [])).encode()).hexdigest()


def model_reference(loaded: LoadedSpec, digest: str) -> str:
    return f"inferkiln/{loaded.spec.metadata.name}:{loaded.spec.metadata.version}-{digest[:12]}"


def model_labels(loaded: LoadedSpec, digest: str) -> dict[str, str]:
    spec = loaded.spec
    return {
        "org.opencontainers.image.title": spec.metadata.name,
        "org.opencontainers.image.version": spec.metadata.version,
        "org.opencontainers.image.revision": digest,
        "org.opencontainers.image.created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "org.opencontainers.image.source": spec.model.source,
        "org.opencontainers.image.licenses": spec.model.license,
        "io.inferkiln.spec-digest": spec.digest(),
        "io.inferkiln.profile-ids": ",".join(p.id for p in model_manifest(loaded).profiles),
        "io.inferkiln.model-source": spec.model.source,
    }


def model_dockerfile(loaded: LoadedSpec, runtime_ref: str, labels: dict[str, str]) -> str:
    spec = loaded.spec
    return templates().get_template("model.Dockerfile.j2").render(
        runtime_image=runtime_ref, manifest_path=contract.MANIFEST_PATH, bake=spec.model.bake,
        model_dir=contract.MODEL_DIR, verify_key=contract.MODEL_VERIFY_KEY if spec.model.verify_key else None,
        peft_dir=contract.PEFT_DIR if spec.adapters else None,
        env={"NIM_SERVED_MODEL_NAME": spec.served_name}
        | ({"NIM_MODEL_VERIFY_KEY": contract.MODEL_VERIFY_KEY} if spec.model.verify_key else {})
        | ({"NIM_PEFT_SOURCE": contract.PEFT_DIR} if spec.adapters else {})
        | ({"NIM_TOOL_CALL_PARSER": spec.model.tool_call_parser} if spec.model.tool_call_parser else {}), labels=labels)


def write_model_context(loaded: LoadedSpec, out: Path, runtime_ref: str, digest: str) -> Path:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "Dockerfile").write_text(model_dockerfile(loaded, runtime_ref, model_labels(loaded, digest)))
    (out / "model_manifest.yaml").write_text(model_manifest(loaded).to_yaml())
    if (key := loaded.verify_key()) is not None:
        shutil.copyfile(key, out / "verify-key.pem")
    if loaded.spec.model.bake:
        source = loaded.local_source()
        if source is None:
            from factory.errors import InputError

            raise InputError(f"{loaded.path}: model.bake needs the weights here; fetch hf:// sources first "
                             "(python -m service download-to-cache) and point model.source at them")
        shutil.copytree(source, out / "model", copy_function=_link_or_copy,
                        ignore=lambda _, names: [n for n in names if _not_weights(Path(n))])
    for name, path in adapter_dirs(loaded).items():
        target = out / "adapters" / name
        shutil.copytree(path, target, copy_function=_link_or_copy,
                        ignore=lambda _, names: [n for n in names if n.startswith(".") or n.startswith("inferkiln-")])
        for directory in (target.parent, target, *(p for p in target.rglob("*") if p.is_dir())):
            directory.chmod(0o755)  # COPY keeps the modes: the image's non-root user reads them
    return out


def _link_or_copy(src: str, dst: str) -> None:
    """Hard links keep big files from being copied into every build context; a file the image's
    non-root user could not read is copied instead and made readable (a link would share its mode)."""
    if os.stat(src).st_mode & stat.S_IROTH:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)


# -- both, as the render stage's result ---------------------------------------------------------
@dataclass(frozen=True)
class ImagePlan:
    """What the build stage will build: both references, known before any build."""

    flavor: Flavor
    runtime_reference: str
    model_reference: str
    model_digest: str

    @classmethod
    def for_spec(cls, loaded: LoadedSpec) -> ImagePlan:
        flavor = runtime_flavor(loaded)
        runtime_ref = runtime_reference(flavor)
        digest = model_digest(loaded, runtime_ref)
        return cls(flavor, runtime_ref, model_reference(loaded, digest), digest)


@dataclass(frozen=True)
class RenderedContexts:
    plan: ImagePlan
    runtime_dir: Path
    model_dir: Path
    wheels_included: bool


def write_contexts(loaded: LoadedSpec, plan: ImagePlan, out: Path, wheels: Path | None) -> RenderedContexts:
    runtime_dir = write_runtime_context(plan.flavor, out / "runtime")
    if wheels:
        link_wheelhouse(wheels, out / "wheels")
    model_dir = write_model_context(loaded, out / "model", plan.runtime_reference, plan.model_digest)
    return RenderedContexts(plan, runtime_dir, model_dir, wheels is not None)
