"""A batched forward pass for Llama-family models over a paged KV cache.

Transformers' caches share one write position across a batch, so sequences at different positions
cannot decode together through `model.forward`. This runner reuses the loaded model's own weights
(projections, norms, MLPs, rotary embedding, LM head) in its own forward pass (`LlamaGraph`, one
TorchScript call a step), with the attention over a cache of fixed-size blocks:
`[layers, blocks * block_size, kv_heads, head_dim]`. Each sequence
names its blocks in a block table (`service.engine.kv_blocks`), so one step handles every running
sequence at its own position, and memory follows the tokens held rather than the longest possible.

The cache is allocated untouched (`torch.empty`) and a block is zeroed the first time it is handed
out: the process's resident memory grows with the most tokens ever held, not with the pool's size.
"""

from __future__ import annotations

import contextlib
import itertools
import logging

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from service.engine.compiled_decode import CompiledDecode, check_can_compile
from service.engine import cpu_gemm, huge_pages
from service.engine.llama_graph import ACTIVATIONS, ONEDNN, PANELS, PANELS_BF16, PLAIN, LlamaGraph
from service.engine.lora import LoraPool
from service.profiles import cpu_computes

log = logging.getLogger(__name__)
# Architectures whose decoder layers have exactly Llama's structure (q/k/v/o projections, RMSNorm
# before attention and MLP, rotary positions); biases on the projections (Qwen2) are in the modules.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
PACK_BATCH_HINT = 16  # the rows oneDNN lays a packed weight out for; any count works
# Below this many elements a weight stays unpacked: oneDNN's packed call costs about 50 us more
# than F.linear whatever the shape, which a small GEMM never wins back (fp32, one thread, 1-16
# rows: 128x384 and 256x768 ran 1.1-4x slower packed, 384x1152 broke even, 512x1536 ran 1.4-1.9x
# faster from 8 rows).
PACK_MIN_ELEMENTS = 2**19
# Attention on CUDA without cuDNN's: torch prefers it on Hopper and Blackwell (sm90/sm100, recent
# cuDNN), and it builds an execution graph for each new problem (batch, key length) on each thread
# before running it, while almost every decode step brings a new key length. On an H100 the tiny
# model's bf16 generate() at batch 16 took 57-82 ms a step while its shapes were new and 2.7-4.5 ms
# once seen (README). Flash and memory-efficient attention run any shape without building anything.
SPLIT_WIDTH = 8  # the widest chunk the fused graph takes as rows of one token (LlamaRunner._pieces)
CUDA_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class UnsupportedModel(ValueError):
    """The torch engine's batched runner cannot run this architecture."""


class LlamaRunner:
    def __init__(self, model, num_blocks: int, block_size: int, max_len: int, pack_weights: bool = False,
                 lora: LoraPool | None = None, compile_decode: bool = False) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"the torch engine runs {', '.join(sorted(SUPPORTED_MODEL_TYPES))} models, "
                                   f"not {config.model_type!r}; use a vLLM profile for it")
        if getattr(config, "sliding_window", None) and config.sliding_window < max_len:
            raise UnsupportedModel(f"sliding-window attention ({config.sliding_window}) is not supported")
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModel(f"the torch engine's MLP computes {', '.join(sorted(ACTIVATIONS))}, "
                                   f"not {config.hidden_act!r}; use a vLLM profile for it")
        self.model = model
        self.layers = model.model.layers
        attention = self.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.block_size = block_size
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        shape = (len(self.layers), num_blocks * block_size, self.num_kv_heads, self.head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.zeroed = 0  # blocks below this id have been zeroed (masked keys must be finite: 0 * NaN)
        self.device = device
        # cos/sin for every position, computed once; None for rope types that change with length
        dynamic = getattr(model.model.rotary_emb, "rope_type", "default") == "dynamic"
        if compile_decode:
            check_can_compile(device, dtype, dynamic)
        plain = [self._linears(layer, PLAIN) for layer in self.layers] if compile_decode else []
        pack = packed_layout(device, dtype) if pack_weights else PLAIN
        arena = huge_pages.Arena()  # the packed weights side by side on 2 MB pages
        self.linears = [self._linears(layer, pack, arena) for layer in self.layers]
        self.head = self._head(model, pack, keep=compile_decode, arena=arena)
        self.rope_table = None if dynamic else self._rope_for(max_len)
        empty = torch.empty(0, device=device)
        self.graph = torch.jit.script(LlamaGraph(model, self.linears, self.keys, self.values, block_size,
                                                 self.num_heads, self.num_kv_heads, self.head_dim, self.scaling,
                                                 self.rope_table or (empty, empty), self.head,
                                                 (lora.a, lora.b, lora.columns) if lora else ([], [], [])))
        self.compiled = CompiledDecode(self, plain) if compile_decode else None

    @staticmethod
    def _linears(layer, pack: int, arena: huge_pages.Arena | None = None) -> dict[str, Linear]:
        """One matmul for q/k/v and one for gate/up (as vLLM does): fewer ops in every step.

        Unpacked, the original modules' weights become views into the fused tensors, so no memory
        is doubled and the model itself still works. Packed, the originals are released: the model
        is the runner's from then on.
        """
        def fuse(modules) -> Linear:
            weight = torch.cat([m.weight for m in modules])
            biases = [m.bias for m in modules]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            start = 0
            for m in modules:
                rows = m.weight.shape[0]
                m.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
                if bias is not None:
                    m.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
                start += rows
            return Linear(weight, bias, pack, modules, arena)

        attention, mlp = layer.self_attn, layer.mlp
        return {"qkv": fuse([attention.q_proj, attention.k_proj, attention.v_proj]),
                "o": fuse([attention.o_proj]), "gate_up": fuse([mlp.gate_proj, mlp.up_proj]),
                "down": fuse([mlp.down_proj])}

    @staticmethod
    def _head(model, pack: int, keep: bool, arena: huge_pages.Arena | None = None) -> Linear:
        """The LM head in panels where the layers are: F.linear runs MKL's GEMV, which read a 32000 x
        2048 fp32 head at 0.58x the panels' rate on the 2-core EPYC (17.2 against 9.9 ms a row); in
        bf16 F.linear read the 76M shape's weights at 0.51x the bf16 panels' rate (Zen 4). As
        loaded where it is also the embedding table (panels would be a second copy of the largest
        weight) or where the layers are not in panels (unmeasured). `keep`: the compiled decode step
        reads the original, so it stays."""
        head = model.lm_head
        if pack not in (PANELS, PANELS_BF16) or head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
            return Linear(head.weight, head.bias, PLAIN)
        return Linear(head.weight, head.bias, pack, () if keep else (head,), arena)

    def matmul_kernels(self) -> str:
        """What runs the layers' matmuls, and where Linux offers 2 MB pages how much of the weights lie on
        them (cpu_gemm.pack's; service.engine.huge_pages), for the engine's start-up log. oneDNN's
        packed weights are opaque tensors whose memory oneDNN holds: they are left out of the count."""
        names = {PLAIN: lambda: "torch's F.linear", ONEDNN: lambda: "oneDNN (packed)",
                 PANELS: lambda: f"cpu_gemm's fp32 panels ({cpu_gemm.fp32_isa()})",
                 PANELS_BF16: lambda: f"cpu_gemm's bf16 panels ({cpu_gemm.bf16_isa()})"}
        linears = [linear for layer in self.linears for linear in layer.values()]
        kernels = ", ".join(sorted(names[layout]() for layout in {linear.layout for linear in linears}))
        weights = [linear.weight for linear in linears + [self.head] if not linear.weight.is_mkldnn]
        if self.device.type != "cpu" or not huge_pages.offered() or not weights:
            return kernels
        size = sum(weight.numel() * weight.element_size() for weight in weights)
        return f"{kernels}; {huge_pages.huge_bytes(weights) / 2**20:.0f} of {size / 2**20:.0f} MiB on 2 MB pages"

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.keys[:, :self.block_size].numel() * self.keys.element_size()

    def forward(self, chunks: list[tuple[list[int], list[int], int]], adapter_slots: list[int] | None = None,
                every_position: bool | list[bool] = False) -> torch.Tensor:
        """Run `(tokens, block_table, start)` chunks together in one pass: prompt chunks and decodes
        alike; `adapter_slots` gives each chunk's LoRA slot in the pool (None or all 0: the base
        model).

        Each chunk's tokens are written at positions start.. of its sequence and attend to
        everything before them. Returns logits chunk after chunk: after each token of a chunk whose
        `every_position` is true (one flag for all, or one per chunk), else after its last token
        alone; with no flag set, [chunks, vocab].
        """
        self._zero_new_blocks(max(max(table) for _, table, _ in chunks) + 1)
        if self.compiled and self.compiled.handles(chunks) and not (adapter_slots and any(adapter_slots)):
            try:
                return self.compiled(chunks)
            except RuntimeError:  # it would have compiled again (CompiledDecode): the graph runs it, and the rest
                self.compiled.ready = False
                log.warning("compiled decode failed; decode steps run on the TorchScript graph from now on",
                            exc_info=True)
        flags = every_position if isinstance(every_position, list) else [every_position] * len(chunks)
        pieces = self._pieces(chunks)
        order = sorted(range(len(pieces)), key=lambda p: len(pieces[p][1]))  # equal widths side by side
        ids, positions, rows = [], [], [[] for _ in chunks]  # rows: each chunk's tokens' rows in ids
        for p in order:
            i, tokens, _, start = pieces[p]
            rows[i] += range(len(ids), len(ids) + len(tokens))
            ids += tokens
            positions += range(start, start + len(tokens))
        groups = [(len(list(run)), width) for width, run in itertools.groupby(len(pieces[p][1]) for p in order)]
        blocks = max(len(table) for _, table, _ in chunks)
        tables = [pieces[p][2] + [0] * (blocks - len(pieces[p][2])) for p in order]
        starts = [pieces[p][3] for p in order]
        outputs = [row for i in range(len(chunks)) for row in (rows[i] if flags[i] else rows[i][-1:])]
        length = max(start + len(tokens) for tokens, _, start in chunks)
        rope = None if self.rope_table else self._rope_for(length)
        if adapter_slots is not None and any(adapter_slots):
            adapter_slots = [adapter_slots[pieces[p][0]] for p in order for _ in pieces[p][1]]  # each token's
        else:
            adapter_slots = None  # the base model alone skips the LoRA matmuls
        attention = sdpa_kernel(CUDA_ATTENTION) if self.device.type == "cuda" else contextlib.nullcontext()
        with attention, torch.jit.optimized_execution(False):
            return self.graph(ids, positions, groups, starts, tables, outputs, rope, adapter_slots)

    def _pieces(self, chunks: list[tuple[list[int], list[int], int]]) -> list[tuple[int, list[int], list[int], int]]:
        """The chunks as the graph takes them, (chunk, tokens, block_table, start): where its layer ops
        are fused, a chunk of 2 to SPLIT_WIDTH tokens (an n-gram draft's verify, a short prompt) goes
        in as that many chunks of one token, each at its own position over the same block table.
        Beside the step's decodes they are one group of width 1, which the fused decode attention
        takes (each row attends up to its own position: causal, after every row's key and value are
        written), and a step of decodes and drafts alone is then one decode_layers call; each token's
        logits are the floats a decode step at its position gives. Wider chunks keep SDPA, which
        reads the keys once for all their rows."""
        if not self.graph.fused:
            return [(i, tokens, table, start) for i, (tokens, table, start) in enumerate(chunks)]
        return [piece for i, (tokens, table, start) in enumerate(chunks)
                for piece in ([(i, [token], table, start + j) for j, token in enumerate(tokens)]
                              if 1 < len(tokens) <= SPLIT_WIDTH else [(i, tokens, table, start)])]

    def _rope_for(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions 0..length-1, from the model's rotary module."""
        probe = self.model.model.embed_tokens.weight[:1]  # the device and dtype (the head may be released)
        cos, sin = self.model.model.rotary_emb(probe, torch.arange(length, device=self.device).unsqueeze(0))
        return cos[0], sin[0]

    def _zero_new_blocks(self, upto: int) -> None:
        if upto > self.zeroed:
            first, end = self.zeroed * self.block_size, upto * self.block_size
            self.keys[:, first:end].zero_()
            self.values[:, first:end].zero_()
            self.zeroed = upto

    def rezero(self, upto: int = 0) -> None:
        """Zero the blocks below `upto` again and treat the rest as never handed out: for a warm-up
        that wrote into blocks no sequence holds yet."""
        self.zeroed = 0
        self._zero_new_blocks(upto)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, target): a choice forked off a prompt gets its last block."""
        if not pairs:
            return
        self._zero_new_blocks(max(max(pair) for pair in pairs) + 1)
        size = self.block_size
        for source, target in pairs:
            self.keys[:, target * size:(target + 1) * size] = self.keys[:, source * size:(source + 1) * size]
            self.values[:, target * size:(target + 1) * size] = self.values[:, source * size:(source + 1) * size]


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed GEMM: on CPU where torch was built with it, for fp32, and for bf16 where the
    CPU computes bf16 natively (emulated, packed bf16 was 4x slower than unpacked here)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_computes("bf16"))


def packed_layout(device: torch.device, dtype: torch.dtype) -> int:
    """The layout packed weights take here, decided once a model: cpu_gemm's fp32 or bf16 panels where
    that kernel suits the CPU and loads, else oneDNN's where it can pack, else none."""
    if cpu_gemm.suits(device, dtype) and cpu_gemm.load():
        return PANELS
    if cpu_gemm.suits_bf16(device, dtype) and cpu_gemm.load():
        return PANELS_BF16
    return ONEDNN if can_pack(device, dtype) else PLAIN


class Linear:
    """W and b of x @ W.T + b, with a large W laid out once at load for the kernel that runs it
    (llama_graph.linear): in cpu_gemm's panels where that kernel suits the CPU, else packed for oneDNN.

    With few rows (a decode batch), oneDNN's kernels on a weight already in their blocked layout run
    about 1.8x faster than F.linear, which lays the weight out again on every call (measured for
    the 76M benchmark model's shapes at batch 8 and 16 on 2 cores); vLLM's CPU build packs its
    weights the same way. For oneDNN a small weight (the tiny model's) is faster as loaded: see
    PACK_MIN_ELEMENTS.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: int, modules=(),
                 arena: huge_pages.Arena | None = None) -> None:
        """`pack`: the layout to pack into (packed_layout), or PLAIN. Panels take any size (the tiny
        model's 8 matmuls ran 1.02-1.36x as fast as F.linear); oneDNN only PACK_MIN_ELEMENTS or more.
        `arena`: where panels go, beside the model's other weights (huge_pages.Arena)."""
        self.bias = bias
        self.columns = weight.shape[0]
        self.layout = PLAIN if pack == ONEDNN and weight.numel() < PACK_MIN_ELEMENTS else pack
        if self.layout == PANELS:
            self.weight = cpu_gemm.pack(weight, arena)
        elif self.layout == PANELS_BF16:
            self.weight = cpu_gemm.pack_bf16(weight, arena)
        elif self.layout == ONEDNN:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        else:
            self.weight = weight
        if self.layout != PLAIN:
            for module in modules:  # the laid-out copy is the only one kept
                module.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
