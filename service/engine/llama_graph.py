"""The Llama decoder's forward pass as one TorchScript graph: one call from Python per step.

Run op by op from Python, every aten call releases the GIL and takes it back. The engine thread
shares the GIL with the event loop that streams the tokens, so each of the pass's ~100 small ops
could wait for the loop's next burst of Python: on 2 cores a batch-16 decode of the tiny model took
4-5 ms in the server against 1.7 ms alone. The graph runs in TorchScript's interpreter, which
holds no GIL between its ops, and its per-op overhead is lower than Python's: alone, a batch-16
decode took 1.27 against 1.65 ms; against a thread holding the GIL in 0.2 ms bursts, 1.80 against
5.17 ms. The ops are the same aten calls in the same order, so the logits are bitwise the same.
Where the matmuls run in cpu_gemm's panels, the layer's small ops run fused instead
(cpu_decoder.cpp, `LlamaGraph.fused`): the same arithmetic in fewer calls, equal to the aten ops
within float rounding.

The graph is run without the JIT's profiling and specialisation (`optimized_execution(False)`):
every step has new shapes, and re-specialising for them would cost time at random steps.

`torch.jit.script` is deprecated (torch 2.13 warns) in favour of `torch.compile`/`torch.export`,
which on CPU compile C++ at run time, for minutes on a small machine. A profile's `compile_decode`
runs one sequence's decode steps compiled (service.engine.compiled_decode); everything else stays
here: it is ready in seconds, and its packed matmuls (cpu_gemm's on AVX2 CPUs, else oneDNN's) are
the faster for batches.
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from service import profiles
from service.engine import cpu_gemm  # noqa: F401  (defines the inferkiln ops the graph may call)

# TorchScript's annotations cannot name `Scalar?[]`, the type of oneDNN's `scalars` argument,
# except in TorchScript source ("number").
_ONEDNN = torch.jit.CompilationUnit('''
def packed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    scalars: List[Optional[number]] = [None]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", scalars, "")
''')
packed_linear = _ONEDNN.packed_linear

# transformers' hidden_act names this graph computes, as transformers' ACT2FN defines them
ACTIVATIONS = frozenset({"silu", "gelu", "gelu_pytorch_tanh", "relu"})


# How a weight is laid out (llama_runner.Linear): as loaded, packed for oneDNN, in cpu_gemm's fp32
# panels, or in its bf16 panels.
PLAIN, ONEDNN, PANELS, PANELS_BF16 = 0, 1, 2, 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], layout: int,
           columns: int) -> torch.Tensor:
    """x @ W.T + b for W [columns, in] laid out as `layout` says (literals: TorchScript reads no globals)."""
    if layout == 2:  # PANELS
        return torch.ops.inferkiln.linear_fp32(x, weight, columns, bias)
    if layout == 3:  # PANELS_BF16
        return torch.ops.inferkiln.linear_bf16(x, weight, columns, bias)
    if layout == 1:  # ONEDNN
        return packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm, computed in float32 as transformers does (fp32: one fused call)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, [x.shape[-1]], weight, eps)
    return weight * F.rms_norm(x.float(), [x.shape[-1]], None, eps).to(x.dtype)


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_pytorch_tanh":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (transformers' apply_rotary_pos_emb) on [tokens, heads, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def in_order(linears: list[dict]) -> list:
    """Each layer's fused projections in the order the forward passes index them: qkv, o, gate_up, down."""
    return [linear_ for layer in linears for linear_ in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])]


def layer_norms(model) -> list[torch.Tensor]:
    """Each layer's input and post-attention norm weights, in that order."""
    return [w for layer in model.model.layers for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]


AMX_FLAGS = {torch.bfloat16: "amx_bf16", torch.float16: "amx_fp16"}


def upcasts_decode_attention(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode attention runs in fp32 for reduced-precision weights on this CPU.

    Without AMX, torch's CPU SDPA of one query row in bf16 took about 3x as long as converting its
    inputs and running it in fp32 (8 sequences of 80 tokens, a 2-core EPYC with AVX512-BF16); with
    AMX (a 16-core Xeon, 15 threads) the upcast engine decoded the 76M shape at 0.84x (c=1) and 0.73x
    (c=8) the tok/s of the one left in bf16. Prompt chunks stay in bf16 everywhere: as fast or
    faster. fp16 follows bf16 unmeasured (upcasting loses nothing)."""
    return device.type == "cpu" and dtype in AMX_FLAGS and AMX_FLAGS[dtype] not in profiles.cpu_flags()


class LlamaGraph(torch.nn.Module):
    """The decoder over a paged KV cache; `torch.jit.script` it (see LlamaRunner)."""

    weights: List[torch.Tensor]  # per layer: qkv, o, gate_up, down
    biases: List[Optional[torch.Tensor]]
    layouts: List[int]  # PLAIN, ONEDNN, PANELS or PANELS_BF16
    columns: List[int]  # each weight's output features
    norms: List[torch.Tensor]  # per layer: input, post-attention
    lm_bias: Optional[torch.Tensor]
    lm_layout: int
    lm_columns: int
    lora_a: List[torch.Tensor]  # per layer: qkv, o, gate_up, down; [in, slots*k*R] (service.engine.lora)
    lora_b: List[torch.Tensor]  # [slots*k*R, out]; empty lists: no adapters
    lora_columns: List[torch.Tensor]  # per fused projection kind: the slot of each column of A
    # Decode attention (one query a sequence) in fp32 for bf16/fp16 weights on a CPU without AMX for
    # that type (`upcasts_decode_attention`).
    upcast_decodes: bool
    # The layer's small ops as cpu_decoder.cpp's fused kernels: where the matmuls run in panels (fp32's
    # or bf16's, on a CPU the library suits, and loaded).
    fused: bool

    def __init__(self, model, linears: list[dict], keys: torch.Tensor, values: torch.Tensor, block_size: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 rope_table: tuple[torch.Tensor, torch.Tensor], head,
                 lora: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])) -> None:
        super().__init__()
        self.lora_a, self.lora_b, self.lora_columns = lora
        order = in_order(linears)
        self.weights = [linear_.weight for linear_ in order]
        self.biases = [linear_.bias for linear_ in order]
        self.layouts = [linear_.layout for linear_ in order]
        self.columns = [linear_.columns for linear_ in order]
        layers = model.model.layers
        self.norms = layer_norms(model)
        self.eps = float(layers[0].input_layernorm.variance_epsilon)
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        self.lm_weight, self.lm_bias, self.lm_layout, self.lm_columns = head.weight, head.bias, head.layout, head.columns
        self.keys, self.values = keys, values
        self.cos_table, self.sin_table = rope_table
        self.act = model.config.hidden_act
        self.upcast_decodes = upcasts_decode_attention(self.embed.device, self.embed.dtype)
        self.fused = len(set(self.layouts)) == 1 and self.layouts[0] in (PANELS, PANELS_BF16)
        self.block_size, self.num_layers = block_size, len(layers)
        self.num_heads, self.num_kv_heads, self.head_dim, self.scaling = num_heads, num_kv_heads, head_dim, scaling

    def forward(self, token_ids: List[int], positions: List[int], groups: List[Tuple[int, int]],
                chunk_starts: List[int], block_tables: List[List[int]], outputs: List[int],
                rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                adapter_slots: Optional[List[int]] = None) -> torch.Tensor:
        """Chunks' `token_ids` chunk after chunk, each token at its `positions` in its sequence;
        chunks of one width are adjacent, and `groups` gives each run of them as (chunks, width).
        `chunk_starts` and right-padded `block_tables` are per chunk. Returns the logits after the
        tokens at `outputs`, indices into `token_ids`: [len(outputs), vocab]. `rope`: cos/sin of
        positions 0..max(start + width)-1 where they change with length (else the graph's own
        tables). `adapter_slots`: each token's LoRA slot (0: the base model), None when no chunk
        has an adapter.

        The projections and MLPs run on the tokens alone, so prompt chunks and decodes share one pass
        at the cost of their tokens (vLLM's flattened batch): a step that starts a prompt while
        others decode reads the weights once. Attention runs per group, a batch of equal widths
        that nothing pads: CPU attention's time follows batch x width, and one decode batch padded
        to a 32-token prompt's width took 5x as long as the two apart.

        Inputs are lists, not tensors: a tensor made in Python and released inside the graph would
        take the GIL back to drop its Python object.

        Fused, a step of decodes alone (one group of width 1, no adapters, SiLU) runs every layer in one
        call (cpu_decoder.cpp's decode_layers: the same kernels in the same order, without the
        interpreter between them), its inputs made in one call too (decode_inputs)."""
        cos_table, sin_table = rope if rope is not None else (self.cos_table, self.sin_table)
        if self.fused and adapter_slots is None and self.act == "silu" and len(groups) == 1 and groups[0][1] == 1:
            flat_tables: List[int] = []
            for table in block_tables:
                flat_tables.extend(table)
            hidden, cos, sin, written, rows, where = torch.ops.inferkiln.decode_inputs(
                token_ids, positions, flat_tables, len(block_tables[0]), self.block_size, self.embed, cos_table, sin_table)
            x = torch.ops.inferkiln.decode_layers(hidden, self.weights, self.columns, self.biases, self.norms,
                                                  self.final_norm, self.eps, self.keys, self.values, cos, sin,
                                                  written, rows, where, self.num_heads, self.scaling)
            return self._head(x, token_ids, outputs)
        device = self.embed.device
        ids = torch.tensor(token_ids, device=device)
        where = torch.tensor(positions, device=device)
        tables = torch.tensor(block_tables, device=device)
        attention: List[Tuple[int, int, int, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool]] = []
        written: List[torch.Tensor] = []
        first_chunk, first_token = 0, 0
        for count, width in groups:
            end = max(chunk_starts[first_chunk:first_chunk + count]) + width
            span = torch.arange(end, device=device)
            # cache rows of each sequence's positions 0..end-1 (rows past its own end are masked)
            rows = (tables[first_chunk:first_chunk + count].index_select(1, span // self.block_size) * self.block_size
                    + span % self.block_size)
            queries = where[first_token:first_token + count * width].view(count, width)
            written.append(rows.gather(1, queries).flatten())
            mask: Optional[torch.Tensor] = None  # one query sees every key
            causal = count == 1 and width > 1 and chunk_starts[first_chunk] == 0  # a prompt from its start
            fused_decode = self.fused and width == 1  # its kernel reads each sequence's own length
            if not causal and not fused_decode and (count > 1 or width > 1):  # query i sees positions 0..start+i
                mask = (span.view(1, 1, end) <= queries.unsqueeze(2)).unsqueeze(1)
            attention.append((first_token, count, width, rows, queries, mask, causal))
            first_chunk, first_token = first_chunk + count, first_token + count * width
        cos, sin = cos_table[where].unsqueeze(1), sin_table[where].unsqueeze(1)  # every head
        masks: List[torch.Tensor] = []  # per projection kind: which columns of A each token keeps
        if adapter_slots is not None:
            slots = torch.tensor(adapter_slots, device=device).view(-1, 1)
            masks = [(slots == columns.view(1, -1)).to(self.embed.dtype) for columns in self.lora_columns]
        return self._head(self._layers(F.embedding(ids, self.embed), cos, sin, torch.cat(written), attention, masks),
                          token_ids, outputs)

    def _head(self, x: torch.Tensor, token_ids: List[int], outputs: List[int]) -> torch.Tensor:
        """The logits after the tokens at `outputs` of the final hidden states `x`."""
        if len(outputs) < len(token_ids) or outputs != list(range(len(token_ids))):
            x = x.index_select(0, torch.tensor(outputs, device=x.device))
        return linear(x, self.lm_weight, self.lm_bias, self.lm_layout, self.lm_columns).float()

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, written: torch.Tensor,
                attention: List[Tuple[int, int, int, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool]],
                masks: List[torch.Tensor]) -> torch.Tensor:
        """The decoder layers on `hidden` [tokens, hidden], then the final norm; `attention` as built by
        forward. Each residual add is fused with the norm after it (`_residual`)."""
        x = self._norm(hidden, self.norms[0])
        for index in range(self.num_layers):
            w = 4 * index
            attended = self._attend(self._project(x, w, masks), index, cos, sin, written, attention)
            hidden, x = self._residual(hidden, self._project(attended, w + 1, masks), self.norms[2 * index + 1])
            mixed = self._activate(self._project(x, w + 2, masks))
            after = self.norms[2 * index + 2] if index + 1 < self.num_layers else self.final_norm
            hidden, x = self._residual(hidden, self._project(mixed, w + 3, masks), after)
        return x

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.inferkiln.rms_norm(x, weight, self.eps)
        return rms_norm(x, weight, self.eps)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP's act(gate) * up from the fused gate_up projection (fused with SiLU: decode_layers' op)."""
        if self.fused and self.act == "silu":
            return torch.ops.inferkiln.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return activation(gate, self.act) * up

    def _residual(self, hidden: torch.Tensor, y: torch.Tensor,
                  weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """hidden + y, and its norm by `weight` (fused: hidden is added to in place)."""
        if self.fused:
            return hidden, torch.ops.inferkiln.add_rms_norm(hidden, y, weight, self.eps)
        hidden = hidden + y
        return hidden, rms_norm(hidden, weight, self.eps)

    def _attend(self, qkv: torch.Tensor, index: int, cos: torch.Tensor, sin: torch.Tensor, written: torch.Tensor,
                attention: List[Tuple[int, int, int, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool]]
                ) -> torch.Tensor:
        """Layer `index`'s attention for the tokens' projected `qkv`: rotary positions, the new keys
        and values into the cache at the `written` rows, then each group's queries over its rows.

        Fused, a decode group's attention reads each sequence's keys and values where they lie in
        the cache; SDPA needs them gathered into one tensor first (two copies of the cache a layer)."""
        tokens = qkv.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        keys, values = self.keys[index], self.values[index]
        if self.fused:
            torch.ops.inferkiln.rope_store(qkv, cos, sin, heads, kv_heads, keys, values, written)
            qk = qkv[:, :q_size + kv_size].view(tokens, -1, head_dim)
        else:
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
            qk = rotate(qk.view(tokens, -1, head_dim), cos, sin)  # q's and k's heads at once
            keys.index_copy_(0, written, qk[:, heads:])
            values.index_copy_(0, written, v.view(tokens, kv_heads, head_dim))
        outs: List[torch.Tensor] = []
        for first, count, width, rows, queries, mask, causal in attention:
            if width == 1 and self.fused:
                outs.append(torch.ops.inferkiln.decode_attention(qkv, first, heads, keys, values, rows, queries,
                                                                 self.scaling))
                continue
            q = qk[first:first + count * width, :heads].view(count, width, heads, head_dim).transpose(1, 2)
            # [count, kv_heads, end, head_dim], gathered through the block tables
            k = keys.index_select(0, rows.flatten()).view(count, -1, kv_heads, head_dim).transpose(1, 2)
            v = values.index_select(0, rows.flatten()).view(count, -1, kv_heads, head_dim).transpose(1, 2)
            if width == 1 and self.upcast_decodes:
                q, k, v = q.float(), k.float(), v.float()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling,
                                                 enable_gqa=True)
            outs.append(out.transpose(1, 2).reshape(count * width, q_size).to(qkv.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _project(self, x: torch.Tensor, w: int, masks: List[torch.Tensor]) -> torch.Tensor:
        """Fused projection w on x [tokens, in], plus each token's LoRA: ((x @ A) * mask) @ B."""
        y = linear(x, self.weights[w], self.biases[w], self.layouts[w], self.columns[w])
        if len(masks) == 0:
            return y
        return y + torch.matmul(torch.matmul(x, self.lora_a[w]) * masks[w % 4], self.lora_b[w])
