"""fp32 and bf16 matmuls for the torch engine on x86 CPUs: `inferkiln::linear_fp32` (cpu_gemm.cpp), `linear_bf16`.

On a 2-core AMD EPYC (AVX2, no AVX-512) oneDNN's packed fp32 GEMM, which the engine used for every
weight, read a decode step's 307 MB of weights at about 0.7 of the rate torch's sum reads memory
with one row, and at half of it with 8. A 4x24 AVX2 tile over weights packed in 24-column panels
(cpu_gemm.cpp) read them at that full rate with one row and with 8 (medians of 3 rounds of the 76M
shape's 40 matmuls, `python -m benchmarks.decode_matmuls --rows 1,8,16`: 11.8 against 16.1 ms at
one row, 12.6 against 24.9 at 8, 23.1 against 32.8 at 16). On a 2-core AMD EPYC with AVX-512
(AVX512-BF16: Zen 4), where oneDNN runs its AVX-512 kernels, it was faster too (in one process,
alternating: 9.1 against 14.0 ms at one row, 13.2 against 15.0 at 8). It is used where it was
measured: fp32 on x86 CPUs with AVX2 and FMA. On a 2-core Intel Xeon with AVX-512 and AMX
(2026-12-06, in process, 4 alternating rounds) the torch engine decoded the 76M shape at c=1 1.40x
as fast as on oneDNN's AVX-512 kernels (76.7 against 54.6 tok/s) and at c=8 1.36x (404 against 298
tok/s), and its greedy outputs were the same; a 480-token prompt's prefill took 1.29x as long (383
against 298 ms: with many rows oneDNN's GEMM computes faster than the panels' tiles). One row (a
c=1 decode step) is a panel at a time, each thread reading a contiguous share of the panels as one
stream (cpu_shares.h), with zmm registers where the CPU has AVX-512 (cpu_gemm.cpp's
row_tiles_avx512, which off AMD's CPUs reads 4 adjacent panels at once, 4 streams a thread, and
says why). Until 2026-12 threads took 4 adjacent panels at a time from one shared counter,
prefetching each ahead: on a 2-core Zen 5 EPYC whose memory moves between about 35 and 60-70 GB/s,
the shares read the 76M shape's 40 one-row matmuls 1.15-1.17x as fast in the fast state and
0.97-1.00x in the slow one (medians of 18-26 rounds, alternating processes; docs/engine-speed.md).

bf16 has panels of its own, `inferkiln::linear_bf16` (cpu_gemm_bf16.cpp), computed with AVX512-BF16's
vdpbf16ps, or on AMX's tiles where the CPU has them, chosen on AMD's CPUs with AVX512-BF16 and on
CPUs with AMX (`suits_bf16`): on a Zen 4 EPYC the 40 matmuls took 5.5 against oneDNN's 8.1 ms at one
row and 6.3 against 9.1 at 8. On the 2-core Xeon above (2026-12-06, in process, alternating
processes), where oneDNN computes bf16 with AMX: with AMX's tiles 7.6-8.3 ms against oneDNN's
11.6-12.7 at one row, 5.8-7.8 against 12.8-13.0 at 8 and 48-53 against 59 at 480 (a prompt's
prefill). The panels on AVX-512 alone there had decoded at c=1 1.88x as fast as oneDNN (162 against
86 tok/s) but had taken 4.5x as long over a 480-token prompt (419 against 92 ms).

The same library holds the decoder layer's small ops, fused, for fp32 and bf16 (cpu_decoder.cpp:
the norms, the residual adds, rotary positions with the cache writes, decode attention over the
paged cache). The graph runs them where its matmuls run in panels (llama_graph.LlamaGraph.fused).
And a sampled token's draw at a temperature alone (cpu_sampling.cpp; sampling.native_draw), on any
x86 CPU with AVX2 and FMA whatever the matmuls run on.

The library is C++ compiled with the image (INFERKILN_KERNEL_DIR, made by `python -m
service.engine.cpu_gemm`), or on first use where a compiler is at hand (the cache below); with
neither, the engine runs oneDNN and says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from service import profiles
from service.engine import huge_pages

log = logging.getLogger(__name__)

# the fp32 matmul, the decoder layer's small ops fused (cpu_decoder.cpp), the bf16 matmul and the sampled
# token's draw (cpu_sampling.cpp), in one library
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("cpu_gemm.cpp", "cpu_decoder.cpp", "cpu_gemm_bf16.cpp", "cpu_sampling.cpp"))
HEADERS = (Path(__file__).with_name("cpu_shares.h"),  # how the matmuls split their panels between threads
           Path(__file__).with_name("cpu_math.h"))  # exp8 and row_max, for the draw and for attention
PANEL = 24  # output columns per packed panel (cpu_gemm.cpp's kPanel)
PANEL_BF16 = 16  # output columns per bf16 panel (cpu_gemm_bf16.cpp's kColumns)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17", "-shared", "-fPIC")

# The schema lives here, not in the C++ library, so that TorchScript graphs that may call the op
# compile where the library is absent (they then never call it).
_LIBRARY = torch.library.Library("inferkiln", "DEF")
_LIBRARY.define("linear_fp32(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor")
_LIBRARY.define("linear_bf16(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor")
_LIBRARY.define("bf16_amx() -> bool")
_LIBRARY.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIBRARY.define("add_rms_norm(Tensor(a!) hidden, Tensor y, Tensor weight, float eps) -> Tensor")
_LIBRARY.define("silu_mul(Tensor gate_up) -> Tensor")
_LIBRARY.define("rope_store(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor(b!) keys, "
                "Tensor(c!) values, Tensor rows) -> ()")
_LIBRARY.define("decode_attention(Tensor qkv, int first, int heads, Tensor keys, Tensor values, Tensor rows, "
                "Tensor positions, float scale) -> Tensor")
_LIBRARY.define("decode_layers(Tensor(a!) hidden, Tensor[] weights, int[] columns, Tensor?[] biases, Tensor[] norms, "
                "Tensor final_norm, float eps, Tensor(b!) keys, Tensor(c!) values, Tensor cos, Tensor sin, "
                "Tensor written, Tensor rows, Tensor positions, int heads, float scale) -> Tensor")
_LIBRARY.define("decode_inputs(int[] token_ids, int[] positions, int[] tables, int blocks, int block_size, "
                "Tensor embed, Tensor cos_table, Tensor sin_table) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIBRARY.define("sample_row(Tensor logits, float temperature, Generator? generator) -> int")
_loaded: bool | None = None


def kernel_dir() -> Path:
    """Where the compiled library is kept: INFERKILN_KERNEL_DIR (the image's, built with it), else
    the user's cache."""
    configured = os.environ.get("INFERKILN_KERNEL_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "inferkiln" / "kernels"


def library_path(directory: Path | None = None) -> Path:
    """The library for these sources, torch version and compiler flags: a change to any builds anew."""
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS) + torch.__version__.encode()
                         + " ".join(FLAGS).encode())
    return (directory or kernel_dir()) / f"cpu_gemm-{key.hexdigest()[:16]}.so"


def runs_here() -> bool:
    """Whether this CPU can run the kernel at all: x86 with AVX2 and FMA."""
    return {"avx2", "fma"} <= profiles.cpu_flags()


def suits(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this machine is one the kernel was measured faster on (see the module docstring)."""
    return device.type == "cpu" and dtype == torch.float32 and runs_here()


def fp32_isa() -> str:
    """The instruction set linear_fp32 runs with here: AVX-512 where the CPU has AVX-512F and VL,
    unless INFERKILN_GEMM_AVX2=1 keeps AVX2 (cpu_gemm.cpp's has_avx512, read once a process)."""
    wide = {"avx512f", "avx512vl"} <= profiles.cpu_flags() and os.environ.get("INFERKILN_GEMM_AVX2") != "1"
    return "AVX-512" if wide else "AVX2"


def suits_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the bf16 panels (cpu_gemm_bf16.cpp) run here and were measured faster than oneDNN on
    such a CPU: AMD's with AVX512-BF16 (see docs/engine-speed.md, "AVX-512 EPYCs") and those with
    AMX, where they run on its tiles (the module docstring). Intel's with AVX512-BF16 and no AMX
    were not measured and keep oneDNN."""
    flags = profiles.cpu_flags()
    return (device.type == "cpu" and dtype == torch.bfloat16 and "avx512_bf16" in flags
            and (profiles.cpu_vendor() == "AuthenticAMD" or {"amx_tile", "amx_bf16"} <= flags))


def bf16_isa() -> str:
    """What linear_bf16 runs with here (the library loaded): AMX where the CPU has it, Linux lets
    this process use it and INFERKILN_GEMM_AMX is not 0 (AVX512-BF16 still for a K that is not whole
    tiles of 32), else AVX512-BF16."""
    return "AMX" if torch.ops.inferkiln.bf16_amx() else "AVX512-BF16"


def build(out: Path) -> Path:
    """Compile the sources against this torch into `out`, written whole or not at all."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler on PATH")
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as partial:
        try:
            subprocess.run([compiler, *FLAGS, abi, *(f"-I{p}" for p in include_paths()), *map(str, SOURCES),
                            "-o", partial.name, *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu"],
                           check=True, capture_output=True, text=True)
            os.chmod(partial.name, 0o755)
            os.replace(partial.name, out)
        except BaseException:
            Path(partial.name).unlink(missing_ok=True)
            raise
    return out


def load() -> bool:
    """Load the kernel, building it first where it is missing and a compiler is at hand; False (once
    logged) where it cannot be had."""
    global _loaded
    if _loaded is None:
        path = library_path()
        try:
            if not path.exists():
                log.info("compiling the C++ CPU kernels into %s (once per torch version)", path.parent)
                build(path)
            torch.ops.load_library(str(path))
            _loaded = True
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or error
            log.warning("the C++ CPU kernels are unavailable (%s); matmuls run on oneDNN, the rest on aten ops", detail)
            _loaded = False
    return _loaded


def panels(weight: torch.Tensor, width: int, group: int, arena: huge_pages.Arena | None = None) -> torch.Tensor:
    """W [N, K] as [ceil(N/width), ceil(K/group), width, group]: each panel's `width` columns side by
    side for every group of k, on 2 MB pages where Linux offers them (service.engine.huge_pages; in
    `arena` beside the tensors before it); zeros pad the last panel and the last group."""
    rows, columns = weight.shape
    padded = F.pad(weight, (0, -columns % group, 0, -rows % width))
    count, groups = padded.shape[0] // width, padded.shape[1] // group
    out = (arena or huge_pages).empty((count, groups, width, group), weight.dtype)
    return out.copy_(padded.view(count, width, groups, group).transpose(1, 2))


def pack(weight: torch.Tensor, arena: huge_pages.Arena | None = None) -> torch.Tensor:
    """fp32 W [N, K] as [ceil(N/24), K, 24], the panels linear_fp32 reads."""
    return panels(weight, PANEL, 1, arena).squeeze(3)


def pack_bf16(weight: torch.Tensor, arena: huge_pages.Arena | None = None) -> torch.Tensor:
    """bf16 W [N, K] as [ceil(N/16), ceil(K/2), 16, 2], the panels linear_bf16 reads: each pair of k
    of a panel one 64-byte line."""
    return panels(weight, PANEL_BF16, 2, arena)


def main() -> None:
    """Build the library into INFERKILN_KERNEL_DIR (an image's build step) and check it loads."""
    path = build(library_path())
    torch.ops.load_library(str(path))
    print(path)


if __name__ == "__main__":
    sys.exit(main())
