"""A batched forward pass for Llama-family models over a paged KV cache.

Transformers' caches share one write position across a batch, so sequences at different positions
cannot decode together through `model.forward`. This runner reuses the loaded model's own modules
(projections, norms, MLPs, rotary embedding, LM head) and does only the attention itself, over a
cache of fixed-size blocks: `[layers, blocks * block_size, kv_heads, head_dim]`. Each sequence
names its blocks in a block table (`service.engine.kv_blocks`), so one step handles every running
sequence at its own position, and memory follows the tokens held rather than the longest possible.

The cache is allocated untouched (`torch.empty`) and a block is zeroed the first time it is handed
out: the process's resident memory grows with the most tokens ever held, not with the pool's size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.profiles import Hardware, cpu_flags

# Architectures whose decoder layers have exactly Llama's structure (q/k/v/o projections, RMSNorm
# before attention and MLP, rotary positions); biases on the projections (Qwen2) are in the modules.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
PACK_BATCH_HINT = 16  # the rows oneDNN lays a packed weight out for; any count works
# Below this many elements a weight stays unpacked: oneDNN's packed call costs about 50 us more
# than F.linear whatever the shape, which a small GEMM never wins back (fp32, one thread, 1-16
# rows: 128x384 and 256x768 ran 1.1-4x slower packed, 384x1152 broke even, 512x1536 ran 1.4-1.9x
# faster from 8 rows).
PACK_MIN_ELEMENTS = 2**19


class UnsupportedModel(ValueError):
    """The torch engine's batched runner cannot run this architecture."""


class LlamaRunner:
    def __init__(self, model, num_blocks: int, block_size: int, max_len: int, pack_weights: bool = False) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"the torch engine runs {', '.join(sorted(SUPPORTED_MODEL_TYPES))} models, "
                                   f"not {config.model_type!r}; use a vLLM profile for it")
        if getattr(config, "sliding_window", None) and config.sliding_window < max_len:
            raise UnsupportedModel(f"sliding-window attention ({config.sliding_window}) is not supported")
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
        pack = pack_weights and can_pack(device, dtype)
        self.linears = [self._linears(layer, pack) for layer in self.layers]
        self.rope_table = self._rope_table(model, max_len)

    @staticmethod
    def _rope_table(model, max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin for every position, computed once; None for rope types that change with length."""
        rotary = model.model.rotary_emb
        if getattr(rotary, "rope_type", "default") == "dynamic":
            return None
        probe = model.lm_head.weight[:1]
        cos, sin = rotary(probe, torch.arange(max_len, device=probe.device).unsqueeze(0))
        return cos[0], sin[0]

    @staticmethod
    def _linears(layer, pack: bool) -> dict[str, Linear]:
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
            return Linear(weight, bias, pack, modules)

        attention, mlp = layer.self_attn, layer.mlp
        return {"qkv": fuse([attention.q_proj, attention.k_proj, attention.v_proj]),
                "o": fuse([attention.o_proj]), "gate_up": fuse([mlp.gate_proj, mlp.up_proj]),
                "down": fuse([mlp.down_proj])}

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.keys[:, :self.block_size].numel() * self.keys.element_size()

    def forward(self, chunks: list[tuple[list[int], list[int], int]]) -> torch.Tensor:
        """Run `(tokens, block_table, start)` chunks together: prompt chunks, or one token each.

        Each chunk's tokens are written at positions start.. of its sequence and attend to
        everything before them. Chunks of different lengths are right-padded; padded queries are
        computed but never written or returned. Returns the logits after each chunk's last token:
        [chunks, vocab].
        """
        self._zero_new_blocks(max(max(table) for _, table, _ in chunks) + 1)
        batch, width = len(chunks), max(len(tokens) for tokens, _, _ in chunks)
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens, _, _ in chunks], device=self.device)
        lengths = torch.tensor([len(tokens) for tokens, _, _ in chunks], device=self.device)
        starts = torch.tensor([start for _, _, start in chunks], device=self.device)
        blocks = max(len(table) for _, table, _ in chunks)
        tables = torch.tensor([table + [0] * (blocks - len(table)) for _, table, _ in chunks], device=self.device)
        positions = starts.unsqueeze(1) + torch.arange(width, device=self.device).unsqueeze(0)  # [batch, width]
        length = int((starts + lengths).max())
        span = torch.arange(length, device=self.device)
        # Cache rows of each sequence's positions 0..length-1 (rows past its own end are masked).
        rows = tables[:, span // self.block_size] * self.block_size + span % self.block_size  # [batch, length]
        written = rows.gather(1, positions.clamp(max=length - 1)).flatten()  # where the new tokens go
        valid = None  # decodes: every query is a real token
        if width > 1:  # the real (unpadded) queries, as indices: index_select/index_copy_ are fast on CPU
            valid = (torch.arange(width, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)).flatten()
            valid = valid.nonzero().squeeze(1)
            written = written.index_select(0, valid)
        if batch == 1 and width == 1:
            mask, causal = None, False  # one query sees every key
        elif batch == 1 and int(starts[0]) == 0:
            mask, causal = None, True  # a prompt from its start: the fused causal kernel
        else:  # query i of a chunk (at position start+i) sees the keys at positions 0..start+i
            mask, causal = (span.view(1, 1, length) <= positions.unsqueeze(2)).unsqueeze(1), False
        hidden = self._layers(ids, positions, rows.flatten(), valid, written, mask, causal)
        last = hidden[:, 0] if width == 1 else hidden[torch.arange(batch, device=self.device), lengths - 1]
        return self._logits(last)

    def _zero_new_blocks(self, upto: int) -> None:
        if upto > self.zeroed:
            first, end = self.zeroed * self.block_size, upto * self.block_size
            self.keys[:, first:end].zero_()
            self.values[:, first:end].zero_()
            self.zeroed = upto

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, target): a choice forked off a prompt gets its last block."""
        if not pairs:
            return
        self._zero_new_blocks(max(max(pair) for pair in pairs) + 1)
        size = self.block_size
        for source, target in pairs:
            self.keys[:, target * size:(target + 1) * size] = self.keys[:, source * size:(source + 1) * size]
            self.values[:, target * size:(target + 1) * size] = self.values[:, source * size:(source + 1) * size]

    def _layers(self, ids, positions, rows, valid, written, mask, causal) -> torch.Tensor:
        hidden = self.model.model.embed_tokens(ids)
        if self.rope_table is None:
            cos, sin = self.model.model.rotary_emb(hidden, positions)
        else:
            cos, sin = self.rope_table[0][positions], self.rope_table[1][positions]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [batch, count, 1, head_dim]: every head
        batch, count = ids.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            mlp = layer.mlp
            linears = self.linears[index]
            x = _rms_norm(layer.input_layernorm, hidden)
            qk, v = linears["qkv"](x).split([q_size + kv_size, kv_size], dim=-1)
            qk = _rotate(qk.view(batch, count, -1, self.head_dim), cos, sin)  # q's and k's heads at once
            q = qk[:, :, :self.num_heads].transpose(1, 2)
            k = qk[:, :, self.num_heads:].reshape(batch * count, self.num_kv_heads, self.head_dim)
            v = v.reshape(batch * count, self.num_kv_heads, self.head_dim)
            if valid is not None:  # padded queries are never written
                k, v = k.index_select(0, valid), v.index_select(0, valid)
            keys, values = self.keys[index], self.values[index]
            keys.index_copy_(0, written, k)
            values.index_copy_(0, written, v)
            # [batch, kv_heads, length, head_dim], gathered through the block tables
            shape = (batch, -1, self.num_kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(
                q, keys.index_select(0, rows).view(shape).transpose(1, 2),
                values.index_select(0, rows).view(shape).transpose(1, 2),
                attn_mask=mask, is_causal=causal, scale=self.scaling, enable_gqa=True)
            hidden = hidden + linears["o"](out.transpose(1, 2).reshape(batch, count, -1))
            gate, up = linears["gate_up"](_rms_norm(layer.post_attention_layernorm, hidden)).chunk(2, dim=-1)
            hidden = hidden + linears["down"](mlp.act_fn(gate) * up)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_rms_norm(self.model.model.norm, hidden)).float()


def _rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as one fused op, computed in float32 as transformers does."""
    if hidden.dtype == torch.float32:  # the same arithmetic in one call: no casts, the weight inside
        return F.rms_norm(hidden, norm.weight.shape, norm.weight, eps=norm.variance_epsilon)
    out = F.rms_norm(hidden.float(), norm.weight.shape, eps=norm.variance_epsilon)
    return norm.weight * out.to(hidden.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (transformers' apply_rotary_pos_emb) on [batch, count, heads, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed GEMM: on CPU where torch was built with it, for fp32, and for bf16 where the
    CPU computes bf16 natively (emulated, packed bf16 was 4x slower than unpacked here)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and Hardware(cpu_flags=cpu_flags()).cpu_runs("bf16"))


class Linear:
    """x @ W.T + b, with a large W packed for oneDNN once at load.

    With few rows (a decode batch), oneDNN's kernels on a weight already in their blocked layout run
    about 1.8x faster than F.linear, which lays the weight out again on every call (measured for
    the 76M benchmark model's shapes at batch 8 and 16 on 2 cores); vLLM's CPU build packs its
    weights the same way. A small weight (the tiny model's) is faster unpacked: see PACK_MIN_ELEMENTS.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, modules=()) -> None:
        self.bias = bias
        self.packed = pack and weight.numel() >= PACK_MIN_ELEMENTS
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            for module in modules:  # the packed copy is the only one kept
                module.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        return F.linear(x, self.weight, self.bias)
