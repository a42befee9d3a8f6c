"""Decode steps compiled by inductor, torch.compile's CPU backend: a profile's `compile_decode`.

A decode step reads every weight for a few rows of activations, so its time is the memory's. On the
76M shape at one sequence, the TorchScript graph (llama_graph) reaches about 55% of the rate at which
torch reads the weights: its packed oneDNN matmuls read them at ~0.68 of that rate at one row
(`benchmarks.decode_matmuls`), and its ~100 other ops add ~5 ms. Inductor's C++ GEMM template, with
the weights frozen into the compiled code, read them at 0.9-1.0 of it, and inductor fuses the norms,
rotary positions, attention and activation around the matmuls into a few loops.

It runs one sequence's decode steps; batches stay on the TorchScript graph (see CompiledDecode).
What it costs: a C++ compiler in the image; C++ compiled at start-up, 70-100 s for the 76M model
on 2 cores when inductor's cache (TORCHINDUCTOR_CACHE_DIR) is cold, 10-30 s when warm; and
inductor's copy of the weights (frozen, repacked) beside the packed one the graph runs. On AVX2 CPUs
the graph's matmuls now run cpu_gemm's kernel, which reads one row nearly as fast as inductor's
template: there the compiled step gains less (see docs/engine-speed.md).

The compiled step reads the KV cache and never writes it: written inside, inductor's functionalised
in-place write copied the whole cache each step. The current token's key and value join the
attention from registers, and the runner writes them to the cache after the step.

Attention is torch's SDPA in fp32, whatever the weights: written out (einsum, softmax), inductor
fused it into loops that took 250 us a layer at 70 tokens of context (76M shape, 2 cores; 2.5 ms
of a 14 ms step). SDPA with its gather takes about 120 us a layer in fp32; in bf16 SDPA alone took
195 us a layer, upcast to fp32 47 us.
"""

from __future__ import annotations

import shutil

import torch
import torch.nn.functional as F

from service.engine.llama_graph import activation, in_order, layer_norms, rms_norm, rotate
from service.profiles import cpu_computes

# Inductor's options for the step: weights frozen as constants, which lets max-autotune choose its
# C++ GEMM template (it packs the weights at compile time) where it times faster than aten's matmul
# (which stays a choice: the template has none for some shapes, the tiny model's). Set around each call
# (compiling happens in the call): given to torch.compile as `options`, freezing was not applied.
INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
MIN_BLOCKS = 2  # block tables are padded to this: one block would be another specialisation


class CompileUnavailable(ValueError):
    """`compile_decode` cannot run here (a profile's error: the model or device it names)."""


def check_can_compile(device: torch.device, dtype: torch.dtype, dynamic_rope: bool) -> None:
    """bf16 only where the CPU computes it natively: inductor's bf16 GEMM template needs AVX512-BF16 or
    AMX (elsewhere bf16 is not a CPU profile at all)."""
    bf16 = dtype == torch.bfloat16 and cpu_computes("bf16")
    if device.type != "cpu" or not (dtype == torch.float32 or bf16):
        raise CompileUnavailable(f"compile_decode runs fp32 on CPU, and bf16 on CPUs that compute it natively "
                                 f"(AVX512-BF16 or AMX); this profile runs {dtype} on {device.type}")
    if dynamic_rope:
        raise CompileUnavailable("compile_decode needs fixed rotary tables; this model's change with length")
    if not (shutil.which("c++") or shutil.which("g++")):
        raise CompileUnavailable("compile_decode needs a C++ compiler on PATH: inductor compiles its CPU kernels "
                                 "at start-up")


class DecodeStep(torch.nn.Module):
    """One decode token for each of B sequences: logits [B, vocab] and each layer's new key and value
    [layers, B, kv_heads, head_dim]; `linears` are plain (unpacked) fused weights."""

    def __init__(self, runner, linears: list[dict]) -> None:
        super().__init__()
        frozen = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
        order = in_order(linears)
        self.weights = torch.nn.ParameterList([frozen(lin.weight) for lin in order])
        self.biases = torch.nn.ParameterDict({str(i): frozen(lin.bias) for i, lin in enumerate(order)
                                              if lin.bias is not None})
        model = runner.model
        self.norms = torch.nn.ParameterList([frozen(w) for w in layer_norms(model)])
        self.embed, self.final_norm = frozen(model.model.embed_tokens.weight), frozen(model.model.norm.weight)
        self.lm_weight = frozen(model.lm_head.weight)
        if model.lm_head.bias is not None:
            self.biases["lm"] = frozen(model.lm_head.bias)
        self.register_buffer("cos_table", runner.rope_table[0])
        self.register_buffer("sin_table", runner.rope_table[1])
        self.eps = float(runner.layers[0].input_layernorm.variance_epsilon)
        self.act, self.num_layers, self.block_size = model.config.hidden_act, len(runner.layers), runner.block_size
        self.heads, self.kv_heads, self.head_dim = runner.num_heads, runner.num_kv_heads, runner.head_dim
        self.scaling = runner.scaling

    def _linear(self, x: torch.Tensor, key: str, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, self.biases[key] if key in self.biases else None)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, span: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`positions` [B] of the new tokens, `tables` [B, blocks] right-padded block tables, `span`
        arange(max(positions) + 1), `keys`/`values` the runner's cache, read only."""
        batch, length = ids.shape[0], span.shape[0]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        rows = (tables.index_select(1, span // self.block_size) * self.block_size + span % self.block_size).flatten()
        current = (span.view(1, length) == positions.view(batch, 1)).view(batch, length, 1, 1)
        visible = (span.view(1, length) <= positions.view(batch, 1)).view(batch, 1, 1, length)
        cos, sin = self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)
        hidden = F.embedding(ids, self.embed)
        new_keys, new_values = [], []
        for index in range(self.num_layers):
            w = 4 * index
            qkv = self._linear(rms_norm(hidden, self.norms[2 * index], self.eps), str(w), self.weights[w])
            qk, v = qkv.split([(heads + kv_heads) * head_dim, kv_heads * head_dim], dim=-1)
            qk = rotate(qk.view(batch, heads + kv_heads, head_dim), cos, sin)
            q, k, v = qk[:, :heads], qk[:, heads:], v.view(batch, kv_heads, head_dim)
            new_keys.append(k)
            new_values.append(v)
            cached_k = keys[index].index_select(0, rows).view(batch, length, kv_heads, head_dim)
            cached_v = values[index].index_select(0, rows).view(batch, length, kv_heads, head_dim)
            all_k = torch.where(current, k.unsqueeze(1), cached_k)
            all_v = torch.where(current, v.unsqueeze(1), cached_v)
            out = F.scaled_dot_product_attention(q.unsqueeze(2).float(), all_k.transpose(1, 2).float(),
                                                 all_v.transpose(1, 2).float(), attn_mask=visible, scale=self.scaling,
                                                 enable_gqa=heads != kv_heads)
            out = out.to(hidden.dtype).reshape(batch, heads * head_dim)
            hidden = hidden + self._linear(out, str(w + 1), self.weights[w + 1])
            gate, up = self._linear(rms_norm(hidden, self.norms[2 * index + 1], self.eps), str(w + 2),
                                    self.weights[w + 2]).chunk(2, dim=-1)
            hidden = hidden + self._linear(activation(gate, self.act) * up, str(w + 3), self.weights[w + 3])
        logits = self._linear(rms_norm(hidden, self.final_norm, self.eps), "lm", self.lm_weight)
        return logits.float(), torch.stack(new_keys), torch.stack(new_values)


class CompiledDecode:
    """Decode steps of one sequence alone (the latency that `compile_decode` is for) through
    DecodeStep compiled; batches of several stay on the TorchScript graph, whose packed matmuls
    read the weights faster from a few rows on (76M shape, 2 cores, oneDNN's: 26 against 40 ms at
    8 sequences, 22 against 15 ms at one, in one process; cpu_gemm's are faster still).

    DecodeStep gets plain copies of the fused weights; once compiled, inductor holds its own packed
    constants and the plain copies' memory is released (the tensors keep their shapes, which
    dynamo's guards check). From then on a step that would compile again raises instead (and runs
    on the TorchScript graph): compiling again would read the released weights."""

    def __init__(self, runner, linears: list[dict]) -> None:
        import torch._inductor.config  # here: importing it sets inductor's cache directory if none is set

        self.inductor_config = torch._inductor.config
        self.runner = runner
        self.module = DecodeStep(runner, linears).eval()
        self.step = torch.compile(self.module)
        self.steps = 0  # decode steps run compiled (tests read it)
        self.ready = False

    def handles(self, chunks: list[tuple[list[int], list[int], int]]) -> bool:
        """One sequence's next token; its first (start 0) would be a length-1 specialisation."""
        return self.ready and len(chunks) == 1 and len(chunks[0][0]) == 1 and chunks[0][2] > 0

    def __call__(self, chunks: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        runner = self.runner
        (token,), table, start = chunks[0]
        table = table + [0] * (MIN_BLOCKS - len(table))
        ids, positions, tables = torch.tensor([token]), torch.tensor([start]), torch.tensor([table])
        span = torch.arange(start + 1)
        torch._dynamo.mark_dynamic(span, 0)
        torch._dynamo.mark_dynamic(tables, 1)
        stance = "fail_on_recompile" if self.ready else "default"
        with self.inductor_config.patch(INDUCTOR_OPTIONS), torch.compiler.set_stance(stance):
            logits, new_keys, new_values = self.step(ids, positions, tables, span, runner.keys, runner.values)
        row = table[start // runner.block_size] * runner.block_size + start % runner.block_size
        runner.keys[:, row] = new_keys[:, 0]
        runner.values[:, row] = new_values[:, 0]
        self.steps += 1
        return logits

    def warm_up(self) -> None:
        """Compile under inference mode, as the engine's steps run, and after its thread count is
        set (inductor's kernels keep the count they were compiled with); then release the plain
        weights, once a step run with them overwritten by NaN gave the same logits (the compiled
        code holds its own copies). The writes go to block 0, zeroed again before it is handed out."""
        def probe() -> torch.Tensor:  # its position 20 shares a row with position 4: block 0 zeroed first
            self.runner.rezero(1)
            with torch.inference_mode():
                return self([([1], [0] * 4, 20)])

        compiled = probe()
        with torch.no_grad():
            for weight in self.module.weights:
                weight.fill_(float("nan"))
        again = probe()
        if not torch.equal(compiled, again):
            raise RuntimeError("compile_decode: inductor's compiled step reads the unpacked weights instead of its "
                               "own frozen copies; use a profile without compile_decode")
        for weight in self.module.weights:
            weight.untyped_storage().resize_(0)
        self.runner.rezero()
        self.steps, self.ready = 0, True
