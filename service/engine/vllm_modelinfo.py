"""vLLM's model-class inspection, done once when the image is built rather than at every start.

Before it serves, vLLM asks what the model's class supports (pipeline parallelism, LoRA, ...) by
importing it in a fresh Python process (`vllm.model_executor.models.registry._run_in_subprocess`),
so that the API server process never initialises CUDA. That process imports torch and vLLM again:
about 15 s of every start on a 2-core CPU, more than the engine's own set-up for a small model.
vLLM keeps the answers in `VLLM_CACHE_ROOT/modelinfos/`, one JSON file per class, keyed by a hash
of the class's source, but that cache lives in the pod's cache volume, which starts empty.

So the image build inspects every class vLLM registers, in one process (a build has no GPU to
initialise), with vLLM's own code writing vLLM's own files into the image, and the runtime copies
them into the cache before it hands over to vLLM. vLLM checks each file's hash as it reads it: a
stale or foreign file is inspected afresh, as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from service.image_contract import VLLM_MODELINFO_DIR

log = logging.getLogger("service.engine.vllm")


def bake(directory: Path) -> int:
    """Inspect every lazily registered model class in this process, writing vLLM's cache files
    under `directory`; the number of classes written. A class that cannot be inspected here (one
    that needs a GPU library at import) is left to vLLM's subprocess at start-up."""
    os.environ["VLLM_CACHE_ROOT"] = str(directory.parent)  # read by vllm.envs on each access
    from unittest import mock

    from vllm.model_executor.models import registry

    written = 0
    with mock.patch.object(registry, "_run_in_subprocess", lambda fn: fn()):
        for model in registry.ModelRegistry.models.values():
            if not isinstance(model, registry._LazyRegisteredModel):
                continue
            try:
                model.inspect_model_cls()
            except Exception:  # noqa: BLE001 - any class vLLM itself cannot load here
                continue
            written += (directory / model._get_cache_filename()).is_file()
    for path in directory.glob("*.json"):
        path.chmod(0o644)  # vLLM writes them 0600, for the user who runs the image to read
    return written


def seed(baked: Path = Path(VLLM_MODELINFO_DIR)) -> int:
    """Copy the image's inspected classes into vLLM's cache; how many. A cache that cannot be
    written (no volume, read-only) costs vLLM its subprocess, as without this."""
    from vllm import envs

    target = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    files = sorted(baked.glob("*.json"))
    try:
        target.mkdir(parents=True, exist_ok=True)
        for path in files:
            shutil.copyfile(path, target / path.name)
    except OSError as exc:
        log.warning("vLLM's model-info cache %s cannot be written (%s): it inspects the model at start-up", target, exc)
        return 0
    return len(files)


def main() -> int:
    """`python -m service.engine.vllm_modelinfo`: the image build's step."""
    directory = Path(VLLM_MODELINFO_DIR)
    written = bake(directory)
    print(f"vLLM model classes inspected into {directory}: {written}")
    if not any(directory.glob("*-llama-LlamaForCausalLM.json")):
        print("vLLM's LlamaForCausalLM was not inspected: has vLLM's registry changed?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
