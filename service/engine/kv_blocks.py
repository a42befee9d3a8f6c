"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and the prefix cache.

Pure Python, no tensors: `LlamaRunner` owns the memory, indexed by block id. A sequence holds a
block table (its blocks in order); memory follows the tokens it holds, not its possible length.

Prefix caching follows vLLM's automatic prefix caching: a full block is keyed by its tokens and the
key of the block before it, so a key names a whole prefix. A new sequence takes the cached blocks
of its longest cached prefix instead of computing them. A block nobody holds stays cached (and
reusable) until its memory is needed; such blocks are evicted least recently freed first, and a
sequence's blocks are freed last block first, so a prefix outlives its tails.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the previous block's key, this block's tokens)


@dataclass(eq=False)
class Block:
    id: int
    refs: int = 0
    key: BlockKey | None = None  # set while the block is in the prefix cache


def chain_key(previous: BlockKey | None, tokens: list[int], root: int = 0) -> BlockKey:
    """A full block's key: its tokens, and (through the previous key's hash) every block before it;
    the first block's stands on `root` (a LoRA adapter's, so no KV is shared across adapters)."""
    return (root if previous is None else hash(previous), tuple(tokens))


def block_keys(tokens: list[int], block_size: int, count: int | None = None, root: int = 0) -> list[BlockKey]:
    """The chained keys of the first `count` full blocks of `tokens` (all full blocks when None)."""
    full = len(tokens) // block_size if count is None else min(count, len(tokens) // block_size)
    keys: list[BlockKey] = []
    for start in range(0, full * block_size, block_size):
        keys.append(chain_key(keys[-1] if keys else None, tokens[start:start + block_size], root))
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # never-cached blocks; pop() gives the lowest id
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # cached, unheld: oldest first
        self._cached: dict[BlockKey, Block] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: never cached, or cached and evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[Block]:
        if count > self.num_free:
            raise MemoryError(f"{count} KV blocks asked for, {self.num_free} free")
        taken = []
        for _ in range(count):
            if self._free:
                block = self.blocks[self._free.pop()]
            else:
                _, block = self._evictable.popitem(last=False)
                del self._cached[block.key]
                block.key = None
            block.refs = 1
            taken.append(block)
        return taken

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference to each block; the last block goes first, so it is evicted first."""
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs == 0:
                if block.key is not None:
                    self._evictable[block.id] = block
                else:
                    self._free.append(block.id)

    def cached_prefix(self, tokens: list[int], root: int = 0) -> list[Block]:
        """The cached blocks of the longest cached prefix of `tokens`, leaving at least one token to
        compute (its logits start the output). Nothing is taken: see `acquire`."""
        if not self.enable_caching:
            return []
        found = []
        for key in block_keys(tokens, self.block_size, (len(tokens) - 1) // self.block_size, root):
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, blocks: list[Block]) -> None:
        """Hold cached blocks found by `cached_prefix` (taking unheld ones off the eviction list)."""
        for block in blocks:
            if block.refs == 0:
                del self._evictable[block.id]
            block.refs += 1

    def cache(self, block: Block, key: BlockKey) -> None:
        """Offer a full, computed block to the prefix cache; a key cached already keeps its block."""
        if self.enable_caching and block.key is None and key not in self._cached:
            block.key = key
            self._cached[key] = block
