"""Factory build costs: a no-op `inferkiln build` as a whole process (what a user waits for), a cold
runtime and model build from a warm wheelhouse, a second model on the same runtime, image sizes,
and container start-to-ready time; then, for each runtime flavor, its wheels' download size, its
cold build time and its image's size, uncompressed and as pushed to a registry (the compressed
layers a node pulls). Writes results/factory_build.json.

"Cold" rebuilds the runtime and model images without Docker's layer cache; the base image and the
wheelhouse stay cached (their one-time costs are reported when they had to be made).

    python -m benchmarks.factory_build [--flavors cpu,vllm-cpu,cuda]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import write_result
from factory.image.build import build_images, build_runtime, ensure_base_image
from factory.image.context import runtime_reference
from factory.image.flavors import FLAVORS
from factory.image.wheelhouse import cached_wheelhouse, ensure_wheelhouse
from factory.pipeline.runner import Runner
from factory.release.publish import push_image
from factory.stack import docker_client, ensure_registry
from factory.tinymodel import ensure_tiny_model
from factory.verify.container import start_model

SAMPLE = Path(__file__).parents[1] / "pipelines" / "models" / "tiny-llama.yaml"


def spec_for(directory: Path, model_dir: Path, name: str) -> Path:
    data = yaml.safe_load(SAMPLE.read_text())
    data["metadata"]["name"] = name
    data["model"]["source"] = f"local://{model_dir}"
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def size_mb(client, reference: str) -> float:
    return client.images.get(reference).attrs["Size"] / 2**20


def pushed_bytes(client, reference: str, registry: str) -> int:
    """Push to the registry and add up what it stores: the config and the compressed layers."""
    import oras.container
    import oras.provider

    pushed = push_image(client, reference, registry, lambda _: None)
    manifest = oras.provider.Registry(hostname=registry, insecure=True).get_manifest(
        oras.container.Container(f"{pushed.reference.rsplit(':', 1)[0]}@{pushed.digest}"))
    return manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])


def flavor_costs(client, name: str, registry: str) -> dict:
    """One runtime flavor: wheels (download size and time, if not cached), cold build, image sizes."""
    flavor = FLAVORS[name]
    ensure_base_image(client, print, flavor.base_image)
    cached = cached_wheelhouse(flavor) is not None
    start = time.perf_counter()
    wheels = ensure_wheelhouse(flavor, print)
    download_seconds = None if cached else round(time.perf_counter() - start, 1)
    built = build_runtime(client, flavor, runtime_reference(flavor), lambda _: None, cold=True)
    size = client.images.get(built.reference).attrs["Size"]
    return {"wheel_download_bytes": sum(w.stat().st_size for w in wheels.glob("*.whl")),
            "wheel_download_seconds": download_seconds,  # None: the wheelhouse was cached
            "cold_build_seconds_warm_wheelhouse": round(built.seconds, 1),
            "image_bytes_uncompressed": size, "image_bytes_pushed": pushed_bytes(client, built.reference, registry),
            "image_gb_uncompressed": round(size / 1e9, 2)}


def timed_cli(*args: str) -> float:
    """One whole `inferkiln` process, from exec to exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "factory.cli", *args], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3, help="container starts to time")
    parser.add_argument("--noop-runs", type=int, default=5, help="no-op `inferkiln build` processes to time")
    parser.add_argument("--flavors", default=",".join(FLAVORS), help="runtime flavors to build, size and push")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    client = docker_client()
    quiet = lambda _: None  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        first = Runner(spec_for(Path(tmp), ensure_tiny_model(), "bench-first"))
        second = Runner(spec_for(Path(tmp), ensure_tiny_model(), "bench-second"))
        plan = first.plan()
        start = time.perf_counter()
        ensure_base_image(client, print, plan.flavor.base_image)
        base_seconds = time.perf_counter() - start
        start = time.perf_counter()
        ensure_wheelhouse(plan.flavor, print)
        wheelhouse_seconds = time.perf_counter() - start
        cold = build_images(client, first.validate(), plan, quiet, cold=True)
        first.build()
        noop = [timed_cli("build", str(first.spec_path)) for _ in range(args.noop_runs)]
        other = second.build()
        starts = []
        for _ in range(args.starts):
            t = time.perf_counter()
            running = start_model(client, cold.model.reference)
            starts.append(time.perf_counter() - t)
            running.stop()
    runtime_mb, model_mb = size_mb(client, cold.runtime.reference), size_mb(client, cold.model.reference)
    result = {
        "base_image_seconds_if_made": round(base_seconds, 2),
        "wheelhouse_seconds_if_filled": round(wheelhouse_seconds, 2),
        "cold_build_seconds_warm_wheelhouse": {"runtime": round(cold.runtime.seconds, 2),
                                               "model": round(cold.model.seconds, 2),
                                               "total": round(cold.runtime.seconds + cold.model.seconds, 2)},
        "noop_build_process_seconds": {"median": round(statistics.median(noop), 3), "all": [round(s, 3) for s in noop],
                                       "target": 1.0},
        "second_model_same_runtime_seconds": round(other.model.seconds, 2),
        "second_model_reused_runtime": not other.runtime.built,
        "image_size_mb": {"runtime": round(runtime_mb, 1), "model": round(model_mb, 1),
                          "per_model_delta": round(model_mb - runtime_mb, 2)},
        "start_to_ready_seconds": {"median": round(statistics.median(starts), 2),
                                   "all": [round(s, 2) for s in starts]},
    }
    registry = ensure_registry()
    result["flavors"] = {name: flavor_costs(client, name, registry) for name in args.flavors.split(",") if name}
    for key, value in result.items():
        print(f"{key}: {value}")
    print(write_result("factory_build", result, args.out))


if __name__ == "__main__":
    main()
