"""A batched forward pass for Llama-family models over a per-slot KV cache.

Transformers' caches share one write position across a batch, so sequences at different positions
cannot decode together through `model.forward`. This runner reuses the loaded model's own modules
(projections, norms, MLPs, rotary embedding, LM head) and does only the attention itself, over a
preallocated cache with one slot per running sequence: `[layers, slots, kv_heads, max_len, head_dim]`.
Each decode step then handles every running sequence at its own position in one batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

# Architectures whose decoder layers have exactly Llama's structure (q/k/v/o projections, RMSNorm
# before attention and MLP, rotary positions); biases on the projections (Qwen2) are in the modules.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


class UnsupportedModel(ValueError):
    """The torch engine's batched runner cannot run this architecture."""


class LlamaRunner:
    def __init__(self, model, num_slots: int, max_len: int) -> None:
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
        self.max_len = max_len
        device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
        shape = (len(self.layers), num_slots, self.num_kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.fused = [self._fuse(layer) for layer in self.layers]
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
    def _fuse(layer) -> tuple:
        """One matmul for q/k/v and one for gate/up (as vLLM does), fewer ops for every step.

        The original modules' weights become views into the fused tensors, so no memory is doubled
        and the model itself still works.
        """
        def fuse(modules):
            weight = torch.nn.Parameter(torch.cat([m.weight for m in modules]), requires_grad=False)
            biases = [m.bias for m in modules]
            bias = (torch.nn.Parameter(torch.cat(biases), requires_grad=False)
                    if all(b is not None for b in biases) else None)
            start = 0
            for m in modules:
                rows = m.weight.shape[0]
                m.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
                if bias is not None:
                    m.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
                start += rows
            return weight, bias

        attention, mlp = layer.self_attn, layer.mlp
        qkv_weight, qkv_bias = fuse([attention.q_proj, attention.k_proj, attention.v_proj])
        gate_up_weight, gate_up_bias = fuse([mlp.gate_proj, mlp.up_proj])
        return qkv_weight, qkv_bias, gate_up_weight, gate_up_bias

    @property
    def cache_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def forward(self, chunks: list[tuple[list[int], int, int]]) -> torch.Tensor:
        """Run `(tokens, slot, start)` chunks together: prompt chunks, or one token each to decode.

        Each chunk's tokens are written to its slot at positions start.. and attend to everything
        before them in that slot. Chunks of different lengths are right-padded; padded queries are
        computed but never written to the cache or returned. Returns the logits after each chunk's
        last token: [chunks, vocab].
        """
        batch, width = len(chunks), max(len(tokens) for tokens, _, _ in chunks)
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens, _, _ in chunks], device=self.device)
        lengths = torch.tensor([len(tokens) for tokens, _, _ in chunks], device=self.device)
        starts = torch.tensor([start for _, _, start in chunks], device=self.device)
        slots = torch.tensor([slot for _, slot, _ in chunks], device=self.device)
        positions = starts.unsqueeze(1) + torch.arange(width, device=self.device).unsqueeze(0)  # [batch, width]
        length = int((starts + lengths).max())
        # Query i of a chunk (at position start+i) sees the keys at positions 0..start+i of its slot.
        mask = (torch.arange(length, device=self.device).view(1, 1, length) <= positions.unsqueeze(2)).unsqueeze(1)
        if width == 1:
            rows = cols = None
        else:
            rows, cols = (torch.arange(width, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)).nonzero(as_tuple=True)

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            if rows is None:
                cache[slots, :, positions[:, 0]] = new[:, :, 0]
            else:
                cache[slots[rows], :, positions[rows, cols]] = new.transpose(1, 2)[rows, cols]

        slot_list = [slot for _, slot, _ in chunks]
        first = slot_list[0]
        # Sequences in consecutive slots (the usual case: slots are handed out lowest first) read
        # their keys through a view; others are gathered.
        span = slice(first, first + batch) if slot_list == list(range(first, first + batch)) else None
        hidden = self._layers(ids, positions, slots, span, mask, length, write)
        last = hidden[:, 0] if width == 1 else hidden[torch.arange(batch, device=self.device), lengths - 1]
        return self._logits(last)

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Share a prompt: the n choices of a request start from one prefill."""
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]

    def _layers(self, ids, positions, slots, span, mask, length, write) -> torch.Tensor:
        hidden = self.model.model.embed_tokens(ids)
        if self.rope_table is None:
            cos, sin = self.model.model.rotary_emb(hidden, positions)
        else:
            cos, sin = self.rope_table[0][positions], self.rope_table[1][positions]
        batch, count = ids.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            attention, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias, gate_up_weight, gate_up_bias = self.fused[index]
            x = _rms_norm(layer.input_layernorm, hidden)
            q, k, v = F.linear(x, qkv_weight, qkv_bias).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(batch, count, self.num_heads, self.head_dim).transpose(1, 2)
            k = k.view(batch, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(batch, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            write(self.keys[index], k)
            write(self.values[index], v)
            if span is not None:
                keys, values = self.keys[index][span, :, :length], self.values[index][span, :, :length]
            else:  # narrow (a view) before index_select: only the live part of each slot is copied
                keys = self.keys[index].narrow(2, 0, length).index_select(0, slots)
                values = self.values[index].narrow(2, 0, length).index_select(0, slots)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            hidden = hidden + attention.o_proj(out.transpose(1, 2).reshape(batch, count, -1))
            gate, up = F.linear(_rms_norm(layer.post_attention_layernorm, hidden), gate_up_weight, gate_up_bias).chunk(2, dim=-1)
            hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_rms_norm(self.model.model.norm, hidden)).float()


def _rms_norm(norm, hidden: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm as one fused op, computed in float32 as transformers does."""
    out = F.rms_norm(hidden.float(), norm.weight.shape, eps=norm.variance_epsilon)
    return norm.weight * out.to(hidden.dtype)
