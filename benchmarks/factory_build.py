"""Factory build costs: cold build, no-op rebuild, a second model on the same runtime, image sizes,
and container start-to-ready time. Writes results/factory_build.json.

"Cold" rebuilds the runtime and model images without Docker's layer cache; the base image and the
dependency wheelhouse stay cached (their one-time costs are reported when they had to be made).

    python -m benchmarks.factory_build
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import write_result
from factory.container import start_model
from factory.images import build_model, ensure_base_image
from factory.spec import load_spec
from factory.stack import docker_client
from factory.tinymodel import ensure_tiny_model

SAMPLE = Path(__file__).parents[1] / "pipelines" / "models" / "tiny-llama.yaml"


def spec_for(directory: Path, model_dir: Path, name: str):
    data = yaml.safe_load(SAMPLE.read_text())
    data["metadata"]["name"] = name
    data["model"]["source"] = f"local://{model_dir}"
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_spec(path)


def size_mb(client, reference: str) -> float:
    return client.images.get(reference).attrs["Size"] / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=3, help="container starts to time")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    client = docker_client()
    quiet = lambda _: None  # noqa: E731
    start = time.perf_counter()
    ensure_base_image(client, print)
    base_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        first = spec_for(Path(tmp), ensure_tiny_model(), "bench-first")
        second = spec_for(Path(tmp), ensure_tiny_model(), "bench-second")
        runtime, model = build_model(client, first, quiet, cold=True)
        cold = runtime.seconds + model.seconds
        again_runtime, again_model = build_model(client, first, quiet)
        noop = again_runtime.seconds + again_model.seconds
        other_runtime, other_model = build_model(client, second, quiet)
        starts = []
        for _ in range(args.starts):
            t = time.perf_counter()
            running = start_model(client, model.reference)
            starts.append(time.perf_counter() - t)
            running.stop()
    runtime_mb, model_mb = size_mb(client, runtime.reference), size_mb(client, model.reference)
    result = {
        "base_image_seconds_if_made": round(base_seconds, 2),
        "cold_build_seconds": {"runtime": round(runtime.seconds, 2), "model": round(model.seconds, 2),
                               "total": round(cold, 2)},
        "noop_rebuild_seconds": round(noop, 3),
        "second_model_same_runtime_seconds": round(other_model.seconds, 2),
        "second_model_reused_runtime": not other_runtime.built,
        "image_size_mb": {"runtime": round(runtime_mb, 1), "model": round(model_mb, 1),
                          "per_model_delta": round(model_mb - runtime_mb, 2)},
        "start_to_ready_seconds": {"median": round(statistics.median(starts), 2),
                                   "all": [round(s, 2) for s in starts]},
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(write_result("factory_build", result, args.out))


if __name__ == "__main__":
    main()
