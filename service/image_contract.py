"""The image contract: where things are inside every inferkiln image, and who runs them.

The runtime's settings take their defaults from here; the factory renders Dockerfiles, chart
values and pod-like containers from the same names, so a path or port is written once.
"""

from __future__ import annotations

# The non-root user (and group) every image runs as: outside the range useradd gives host accounts
# (UID_MIN 1000 to UID_MAX 60000 in login.defs), as distroless's `nonroot`, so a process that left
# the container, or a hostPath mount, maps to no host user (checkov CKV_K8S_40 asks for >= 10000).
UID = 65532
PORT = 8000
HOME = "/opt/nim"
VENV = f"{HOME}/venv"
APP_DIR = f"{HOME}/app"  # holds the `service` package; on PYTHONPATH
MANIFEST_PATH = f"{HOME}/etc/default/model_manifest.yaml"
CACHE_PATH = f"{HOME}/.cache"
MODEL_DIR = f"{HOME}/model"
PEFT_DIR = f"{HOME}/loras"  # a model image's LoRA adapters (NIM_PEFT_SOURCE), one per subdirectory
# The public key a model image carries for its model's signature (NIM_MODEL_VERIFY_KEY); a chart may
# mount another one from a Secret or ConfigMap.
MODEL_VERIFY_KEY = f"{HOME}/etc/model-signing/key.pem"
# the torch engine's C++ CPU kernels, compiled when the image is built (service/engine/cpu_gemm.py)
CPU_KERNEL_DIR = f"{HOME}/lib/kernels"
# vLLM's model-class inspection, made when the image is built (service/engine/vllm_modelinfo.py)
VLLM_MODELINFO_DIR = f"{HOME}/etc/vllm/modelinfos"


def image_env() -> dict[str, str]:
    """The runtime image's environment."""
    return {
        "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": APP_DIR,
        "HOME": HOME,
        "NIM_CACHE_PATH": CACHE_PATH,
        "NIM_MANIFEST_PATH": MANIFEST_PATH,
        "NIM_SERVER_PORT": str(PORT),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "0",
    }
