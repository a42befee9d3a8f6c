"""Batched multi-LoRA for the torch engine, as S-LoRA and Punica do it: one pool, every slot at once.

Every adapter held sits in a slot of one pool per fused projection (`LlamaRunner`'s qkv, o,
gate_up and down); slot 0 is the base model, which holds nothing. A step gives each row of the
batch its slot, and each projection adds to the base output

    ((x @ A) * mask[slot]) @ B

where A is every slot's A side by side ([in, slots*k*R]), B every slot's B stacked ([slots*k*R,
out], block-diagonal within a slot for a fused projection of k modules), and the mask keeps each
row's own slot's columns. Sequences with different adapters and the base model thus decode in the
same forward pass with two GEMMs a projection and no per-row gather. Gathering A[slot] and B[slot]
per row (batched matmuls) copies batch x (in + out) x k*R values a projection instead: at batch 16,
one thread, a qkv projection of a 2048-wide model (8 slots, rank 16) took 7.1 ms this way against
7.5 ms gathered (5.3 ms without LoRA); at the tiny model's width the two were equal. R is
NIM_MAX_LORA_RANK; a smaller adapter fills the first r columns of its block, the rest stay zero.
peft's scaling (alpha / r) is folded into B at load.

Slots are handed out least recently used first among those no running request holds; a request
whose adapter finds no slot waits until one frees. Loaded weights are kept in host memory for up
to NIM_MAX_CPU_LORAS adapters, so a slot evicted and needed again is not read from disk.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from service.adapters import Adapter, ModelShape

log = logging.getLogger(__name__)

# LlamaRunner's fused projections, in LlamaGraph's weight order, and the modules in each.
FUSED = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
         ("down", ("down_proj",)))


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int  # slots in the pool (NIM_MAX_GPU_LORAS)
    max_cpu_loras: int  # adapters' weights kept in host memory (NIM_MAX_CPU_LORAS)
    max_rank: int  # NIM_MAX_LORA_RANK


class LoraPool:
    def __init__(self, shape: ModelShape, limits: LoraLimits, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.limits = shape, limits
        slots, rank = limits.max_loras + 1, limits.max_rank
        held = limits.max_loras  # slot s (1..max_loras) owns columns (s-1)*k*R .. s*k*R
        self.a: list[torch.Tensor] = []  # per layer, per fused projection: [in, held*k*R]
        self.b: list[torch.Tensor] = []  # [held*k*R, out]
        for _ in range(shape.layers):
            for _, modules in FUSED:
                features_in = shape.features[modules[0]][0]
                out = sum(shape.features[m][1] for m in modules)
                self.a.append(torch.zeros(features_in, held * len(modules) * rank, dtype=dtype, device=device))
                self.b.append(torch.zeros(held * len(modules) * rank, out, dtype=dtype, device=device))
        # per fused projection: the slot each column of A belongs to, for the step's masks
        self.columns = [torch.arange(1, slots, device=device).repeat_interleave(len(modules) * rank)
                        for _, modules in FUSED]
        self._slot_of: dict[Adapter, int] = {}
        self._refs = [0] * slots
        self._unheld: OrderedDict[int, Adapter] = OrderedDict()  # loaded, held by no request: LRU first
        self._never_used = list(range(slots - 1, 0, -1))
        self._host: OrderedDict[Adapter, dict] = OrderedDict()  # loaded weights, LRU first

    @property
    def bytes_per_slot(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a, *self.b)) // self.limits.max_loras

    def _block(self, index: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slot's A columns and B rows in fused projection `index` (layer * 4 + kind)."""
        width = len(FUSED[index % 4][1]) * self.limits.max_rank
        start = (slot - 1) * width
        return self.a[index][:, start:start + width], self.b[index][start:start + width]

    def acquire(self, adapter: Adapter) -> int | None:
        """The adapter's slot, loading it there if needed; None while every slot is held."""
        slot = self._slot_of.get(adapter)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._write(slot, self._weights(adapter))
            self._slot_of[adapter] = slot
        self._unheld.pop(slot, None)
        self._refs[slot] += 1
        return slot

    def release(self, adapter: Adapter) -> None:
        slot = self._slot_of[adapter]
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._unheld[slot] = adapter

    def _free_slot(self) -> int | None:
        if self._never_used:
            return self._never_used.pop()
        if not self._unheld:
            return None
        slot, evicted = self._unheld.popitem(last=False)
        del self._slot_of[evicted]
        return slot

    def _weights(self, adapter: Adapter) -> dict:
        weights = self._host.pop(adapter, None)
        if weights is None:
            weights = adapter.load()
        self._host[adapter] = weights
        while len(self._host) > self.limits.max_cpu_loras:
            self._host.popitem(last=False)
        return weights

    def _write(self, slot: int, weights: dict) -> None:
        """Lay the adapter's A and B into the slot's blocks; what it does not adapt stays zero."""
        rank = self.limits.max_rank
        for layer in range(self.shape.layers):
            for index, (_, modules) in enumerate(FUSED):
                a, b = self._block(4 * layer + index, slot)
                a.zero_()
                b.zero_()
                offset = 0
                for position, module in enumerate(modules):
                    out = self.shape.features[module][1]
                    pair = weights.get((layer, module))
                    if pair is not None:
                        lora_a, lora_b = pair
                        r = lora_a.shape[0]
                        a[:, position * rank:position * rank + r] = lora_a.T.to(a.dtype)
                        b[position * rank:position * rank + r, offset:offset + out] = lora_b.T.to(b.dtype)
                    offset += out
