"""What the matmul kernels at hand reach on a decode step's weights, against the machine's read
bandwidth (writes results/decode_matmuls.json).

A decode step of the ~76M Llama shape (benchmarks.common.LLAMA_76M) is mostly its 40 fused matmuls
(qkv, o, gate_up and down in each of 10 layers; 307 MB of fp32 weights). With one row (c=1) they
can go no faster than memory gives up those bytes, so the kernel's read rate bounds how close an
engine can come to the bandwidth limit; with 8 rows (c=8) it is what one step's matmuls cost.
Timed for each kernel, in a process of its own (one OpenMP team, its own compiler settings):
- `avx2_panels`: the torch engine's where it suits the CPU, service.engine.cpu_gemm's kernel on
  weights packed in 24-column panels at load (AVX2; one row with AVX-512 where the CPU has it);
  skipped, with the reason, elsewhere;
- `onednn_packed`: the torch engine's on other CPUs, oneDNN's GEMM on weights packed at load
  (service.engine.llama_runner.Linear, llama_graph.linear);
- `aten_linear`: torch's F.linear on plain weights (MKL on x86 builds of torch);
- `openblas`: numpy's matmul (OpenBLAS in numpy's wheels);
- `inductor_cpp_gemm`: torch.compile with max-autotune and its C++ GEMM template, weights frozen
  into the graph. It compiles C++ at run time: skipped, with the reason, where no compiler is found.
Beside each, in the same process and with the same threads, torch's sum over the same weights on
2 MB pages (service.engine.huge_pages): the read rate a kernel would have to match. Kernels
alternate for `--rounds` rounds; medians.

    python -m benchmarks.decode_matmuls [--rounds 3] [--threads N] [--rows 1,8]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import LLAMA_76M, write_result
from service.profiles import cpu_cores

KERNELS = ("avx2_panels", "onednn_packed", "aten_linear", "openblas", "inductor_cpp_gemm")


def fused_weights(config: dict) -> list:
    """The fused weights of a decode step's matmuls, layer by layer (qkv, o, gate_up, down), fused by
    the torch engine's own code from a random-weights Llama of `config`'s shape."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from service.engine.llama_graph import PLAIN
    from service.engine.llama_runner import LlamaRunner

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    return [linear.weight.detach() for layer in model.model.layers
            for linear in LlamaRunner._linears(layer, PLAIN).values()]


def skipped(kernel: str) -> str | None:
    """Why `kernel` cannot run here, or None."""
    if kernel == "inductor_cpp_gemm" and not (shutil.which("g++") or shutil.which("c++")):
        return "no C++ compiler on PATH: inductor compiles its CPU kernels at run time"
    if kernel == "avx2_panels":
        import torch

        from service.engine import cpu_gemm

        if not cpu_gemm.suits(torch.device("cpu"), torch.float32):
            return "the CPU is not one the AVX2 kernel is chosen on (cpu_gemm.suits: x86 with AVX2 and FMA, AMD's or without AVX-512)"
        if not cpu_gemm.load():
            return "the AVX2 kernel could not be built here (no C++ compiler?)"
    return None


def step_function(kernel: str, weights: list):
    """A callable running every matmul of the step on its inputs, as `kernel` does."""
    import torch

    if kernel in ("avx2_panels", "onednn_packed"):
        from service.engine import cpu_gemm
        from service.engine.llama_graph import ONEDNN, PANELS, linear
        from service.engine.llama_runner import Linear

        layout = PANELS if kernel == "avx2_panels" and cpu_gemm.load() else ONEDNN
        linears = [Linear(w, None, layout) for w in weights]
        return lambda xs: [linear(x, m.weight, None, m.layout, m.columns) for x, m in zip(xs, linears)]
    if kernel == "aten_linear":
        return lambda xs: [torch.nn.functional.linear(x, w) for x, w in zip(xs, weights)]
    if kernel == "openblas":
        transposed = [w.numpy().T for w in weights]
        return lambda xs: [x.numpy() @ w for x, w in zip(xs, transposed)]
    if kernel == "inductor_cpp_gemm":
        import torch._inductor.config as inductor

        inductor.freezing, inductor.max_autotune, inductor.max_autotune_gemm_backends = True, True, "CPP"
        module = torch.nn.Module()
        module.ws = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False) for w in weights])
        module.forward = lambda xs: [torch.nn.functional.linear(x, w) for x, w in zip(xs, module.ws)]
        return torch.compile(module.eval())
    raise ValueError(kernel)


def median_seconds(run, repeats: int) -> float:
    for _ in range(5):
        run()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def worker(kernel: str, threads: int, rows: list[int], repeats: int) -> dict:
    """In this process: each row count's median time for `kernel`, its read rate and the sum's."""
    import torch

    from service.engine import huge_pages

    torch.set_num_threads(threads)
    weights = fused_weights(LLAMA_76M)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    run = step_function(kernel, weights)
    on_huge_pages = [huge_pages.empty(w.shape, w.dtype).copy_(w) for w in weights]  # the best read rate
    result = {}
    with torch.no_grad():
        for count in rows:
            xs = [torch.randn(count, w.shape[1]) for w in weights]
            began = time.perf_counter()
            out = run(xs)  # compiles, for inductor
            first_s = time.perf_counter() - began
            error = max(float((torch.as_tensor(o) - x @ w.T).abs().max()) for o, x, w in zip(out, xs, weights))
            seconds = median_seconds(lambda: run(xs), repeats)
            sum_s = median_seconds(lambda: [w.sum() for w in on_huge_pages], repeats // 2)
            result[count] = {"ms": seconds * 1e3, "read_gb_s": nbytes / seconds / 1e9, "sum_gb_s": nbytes / sum_s / 1e9,
                             "first_call_s": first_s, "max_abs_error": error}
    return {"weight_bytes": nbytes, **result}


def measure(kernel: str, threads: int, rows: list[int], repeats: int) -> dict:
    command = [sys.executable, "-m", "benchmarks.decode_matmuls", "--worker", kernel, "--threads", str(threads),
               "--rows", ",".join(map(str, rows)), "--repeats", str(repeats)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{kernel} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict], rows: list[int]) -> dict:
    """Medians over the rounds (the error: the largest); a kernel's read rate also as a share of the
    sum's in the same runs."""
    out = {"weight_mb": round(runs[0]["weight_bytes"] / 1e6, 1)}
    for count in rows:
        values = {key: statistics.median(run[str(count)][key] for run in runs) for key in runs[0][str(count)]}
        out[f"rows_{count}"] = {"ms": round(values["ms"], 2), "read_gb_s": round(values["read_gb_s"], 1),
                                "sum_gb_s": round(values["sum_gb_s"], 1),
                                "share_of_sum": round(values["read_gb_s"] / values["sum_gb_s"], 2),
                                "ms_range": [round(min(run[str(count)]["ms"] for run in runs), 2),
                                             round(max(run[str(count)]["ms"] for run in runs), 2)],
                                "first_call_s": round(values["first_call_s"], 1),
                                "max_abs_error": max(run[str(count)]["max_abs_error"] for run in runs)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=cpu_cores())
    parser.add_argument("--rows", default="1,8", help="rows of each matmul (decode batch sizes)")
    parser.add_argument("--repeats", type=int, default=60, help="timed steps a measure")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--worker", choices=KERNELS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, rows, args.repeats)))
        return
    kernels = args.kernels.split(",")
    reasons = {k: why for k in kernels if (why := skipped(k))}
    runs: dict[str, list[dict]] = {k: [] for k in kernels if k not in reasons}
    for round_ in range(args.rounds):
        for kernel in runs if round_ % 2 == 0 else list(runs)[::-1]:
            runs[kernel].append(measure(kernel, args.threads, rows, args.repeats))
            print(f"round {round_ + 1} {kernel}: " + ", ".join(
                f"{c} rows {runs[kernel][-1][str(c)]['ms']:.1f} ms" for c in rows), flush=True)
    result = {"shape": "llama-76m, fp32, the 40 fused matmuls of a decode step", "threads": args.threads,
              "rounds": args.rounds, "kernels": {k: summary(r, rows) for k, r in runs.items()},
              "skipped": reasons}
    for kernel, numbers in result["kernels"].items():
        print(kernel, "; ".join(f"{key}: {n['ms']} ms {n['read_gb_s']} GB/s, {n['share_of_sum']} of the sum's"
                                for key, n in numbers.items() if key.startswith("rows_")))
    for kernel, why in reasons.items():
        print(f"{kernel}: skipped, {why}")
    print(write_result("decode_matmuls", result, args.out))


if __name__ == "__main__":
    main()
