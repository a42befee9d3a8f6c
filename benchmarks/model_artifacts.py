"""Models as signed OCI artifacts, on a random-weights Llama of about 1.3 GB (fp32, in three
safetensors shards, the tiny model's tokenizer), against the local registry. Writes
results/model_artifacts.json. Each figure is the median of `--rounds` runs, timed as whole
processes where a user runs a command (`inferkiln model push`, `python -m service download-to-cache`):

- push (cold: the repository holds none of the blobs), and sign;
- pull into an empty cache with verification off, then with it on (pull + verify);
- against that, `docker pull` of a model image holding the same weights in a layer (what a baked
  model costs a node: the layer is gzip-compressed on push and decompressed on pull);
- verification alone (model-signing re-hashing every file, in-process), the weights' load (the
  torch engine's start-to-ready from a local directory) and verification as a fraction of it;
- a second start from the warm cache (start-to-ready of `serve` on the oci:// source: no pull,
  verification again);
- bytes pushed for a second version that changes one shard.

    python -m benchmarks.model_artifacts [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import write_result
from factory.model.push import push_model
from factory.stack import docker_client, ensure_registry
from factory.tinymodel import ensure_tiny_model
from service.launcher import ServerProcess
from service.model_signature import verify_model
from service.oci import Ref

SHARD = "500MB"


def make_big_llama(out: Path) -> Path:
    """~336M parameters in fp32 (about 1.3 GB), saved in three shards."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=640, hidden_size=1024, intermediate_size=4096, num_hidden_layers=20,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(out, max_shard_size=SHARD)
    AutoTokenizer.from_pretrained(ensure_tiny_model()).save_pretrained(out)
    return out


def timed(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
    elapsed = time.perf_counter() - start
    if result.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])} failed: {result.stderr[-1500:]}")
    return elapsed, result.stdout


def inferkiln(*args: str) -> tuple[float, str]:
    return timed([sys.executable, "-m", "factory.cli", *args])


def fetch(source: str, cache: Path, key: Path, verify: bool) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    env = {"NIM_CACHE_PATH": str(cache), "NIM_MODEL_VERIFY_KEY": str(key), "NIM_MODEL_VERIFY": "1" if verify else "0",
           "NIM_MANIFEST_PATH": str(cache.parent / "none.yaml")}
    return timed([sys.executable, "-m", "service", "download-to-cache", "--model", source], env)[0]


def start_to_ready(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    with ServerProcess(args, env=env, timeout=900):
        return time.perf_counter() - start


def baked_pull(client, model: Path, registry: str, scratch: Path) -> float:
    """Build an image of the weights in one layer, push it, drop it locally, time `docker pull`."""
    context = scratch / "baked"
    shutil.copytree(model, context / "model")
    (context / "Dockerfile").write_text("FROM scratch\nCOPY model/ /model/\n")
    reference = f"{registry}/bench/baked-model"
    image, _ = client.images.build(path=str(context), tag=f"{reference}:1", rm=True)
    for line in client.api.push(reference, tag="1", stream=True, decode=True):
        if "error" in line:
            raise RuntimeError(line["error"])
    client.images.remove(image.id, force=True)
    start = time.perf_counter()
    client.images.pull(reference, tag="1")
    elapsed = time.perf_counter() - start
    client.images.remove(f"{reference}:1", force=True)
    shutil.rmtree(context)
    return elapsed


def key_pair(directory: Path) -> tuple[Path, Path]:
    subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out",
                    str(directory / "key.pem")], check=True)
    subprocess.run(["openssl", "ec", "-in", str(directory / "key.pem"), "-pubout", "-out",
                    str(directory / "pub.pem")], check=True, capture_output=True)
    return directory / "key.pem", directory / "pub.pem"


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    registry = ensure_registry()
    client = docker_client()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = make_big_llama(scratch / "model")
        size = sum(p.stat().st_size for p in model.iterdir())
        private, public = key_pair(scratch)
        times: dict[str, list[float]] = {k: [] for k in ("push", "sign", "pull", "pull_verify", "docker_pull_baked",
                                                         "verify", "load", "warm_start")}
        for _ in range(args.rounds):
            repo = f"{registry}/bench/model-{uuid.uuid4().hex[:8]}:v1"  # cold: a repository of its own
            elapsed, out = inferkiln("model", "push", str(model), "--to", repo)
            times["push"].append(elapsed)
            pinned = out.strip().splitlines()[-1]
            times["sign"].append(inferkiln("model", "sign", pinned, "--key", str(private))[0])
            source = f"oci://{pinned}"
            times["pull"].append(fetch(source, scratch / "cache", public, verify=False))
            times["pull_verify"].append(fetch(source, scratch / "cache", public, verify=True))
            entry = next((scratch / "cache" / "oci").rglob("model.sig")).parent
            start = time.perf_counter()
            verify_model(entry / "model", entry / "model.sig", public)
            times["verify"].append(time.perf_counter() - start)
            times["docker_pull_baked"].append(baked_pull(client, model, registry, scratch))
            env = {"NIM_CACHE_PATH": str(scratch / "cache"), "NIM_MODEL_VERIFY_KEY": str(public),
                   "NIM_MANIFEST_PATH": str(scratch / "none.yaml")}
            times["load"].append(start_to_ready(["--model", str(model)], env))
            times["warm_start"].append(start_to_ready(["--model", source], {**env, "NIM_DISABLE_MODEL_DOWNLOAD": "1"}))
        second = scratch / "v2"
        shutil.copytree(model, second)
        shard = sorted(second.glob("model-*.safetensors"))[-1]
        with shard.open("r+b") as f:  # one changed byte in the last shard
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0x01]))
        pushed = push_model(second, Ref.parse(repo).tagged("v2"), "bench")
        changed, files = shard.stat().st_size, len(list(model.iterdir()))
    medians = {k: median(v) for k, v in times.items()}
    result = {
        "model": {"bytes": size, "files": files, "parameters": "336M fp32"},
        "rounds": args.rounds,
        "seconds": {k: {"median": medians[k], "all": [round(x, 2) for x in v]} for k, v in times.items()},
        "ratios": {
            "pull_verify_over_docker_pull_baked": round(medians["pull_verify"] / medians["docker_pull_baked"], 3),
            "verify_over_load": round(medians["verify"] / medians["load"], 3),
            "warm_start_over_load": round(medians["warm_start"] / medians["load"], 3),
        },
        "second_version": {"changed_file_bytes": changed,
                           "bytes_sent": pushed.bytes_sent, "bytes_total": pushed.bytes_total},
        "notes": "push: `inferkiln model push` to a repository holding none of the blobs; pull / pull_verify: "
                 "`python -m service download-to-cache` into an empty cache, NIM_MODEL_VERIFY=0 / 1; verify: "
                 "model-signing over the cached files, in-process; load: start-to-ready of `serve` from the "
                 "local directory (torch engine); warm_start: start-to-ready of `serve` on the oci:// source "
                 "with the cache filled and downloads off (verification included); docker_pull_baked: "
                 "`docker pull` of a FROM-scratch image holding the same files in one layer, from the same "
                 "registry.",
    }
    print(write_result("model_artifacts", result, args.out))


if __name__ == "__main__":
    main()
