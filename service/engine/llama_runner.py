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

    @property
    def cache_bytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def prefill(self, tokens: list[int], slot: int, start: int) -> torch.Tensor:
        """Write `tokens` (positions start..) into `slot`; return the logits after the last one [vocab]."""
        count = len(tokens)
        ids = torch.tensor([tokens], device=self.device)
        positions = torch.arange(start, start + count, device=self.device).unsqueeze(0)
        # Query i (at position start+i) sees keys 0..start+i.
        mask = (torch.arange(start + count, device=self.device).unsqueeze(0) <= positions.T).view(1, 1, count, -1)
        slots = torch.tensor([slot], device=self.device)
        hidden = self._layers(ids, positions, slots, mask, start + count,
                              lambda cache, new: cache.__setitem__((slot, slice(None), slice(start, start + count)), new[0]))
        return self._logits(hidden[:, -1])[0]

    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One token for each sequence, each at its own position in its own slot: logits [batch, vocab]."""
        ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, device=self.device)
        slot_index = torch.tensor(slots, device=self.device)
        length = max(positions) + 1
        mask = (torch.arange(length, device=self.device).unsqueeze(0) <= pos.unsqueeze(1)).view(len(tokens), 1, 1, length)

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[slot_index, :, pos] = new[:, :, 0]

        hidden = self._layers(ids, pos.unsqueeze(1), slot_index, mask, length, write)
        return self._logits(hidden[:, -1])

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """Share a prompt: the n choices of a request start from one prefill."""
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]

    def _layers(self, ids, positions, slots, mask, length, write) -> torch.Tensor:
        hidden = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(hidden, positions)
        batch, count = ids.shape
        for index, layer in enumerate(self.layers):
            attention = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attention.q_proj(x).view(batch, count, self.num_heads, self.head_dim).transpose(1, 2)
            k = attention.k_proj(x).view(batch, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attention.v_proj(x).view(batch, count, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            write(self.keys[index], k)
            write(self.values[index], v)
            keys = self.keys[index][slots, :, :length]
            values = self.values[index][slots, :, :length]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling, enable_gqa=True)
            hidden = hidden + attention.o_proj(out.transpose(1, 2).reshape(batch, count, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden)).float()
