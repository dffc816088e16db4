"""BlockManager: hands out KV-cache blocks to sequences as block tables (pure bookkeeping, no tensors).

A sequence of ``n`` tokens needs ``ceil(n / block_size)`` blocks; token ``t`` of it lives in slot
``table[t // block_size] * block_size + t % block_size`` of the flattened cache (vLLM's slot mapping).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from hybridmem.errors import HybridMemError

__all__ = ["BlockManager", "KVBlocksExhaustedError", "blocks_needed"]


class KVBlocksExhaustedError(HybridMemError, MemoryError):
    """A sequence needs more KV blocks than are free.

    Attributes:
        needed_blocks: Blocks the request needs.
        free_blocks: Blocks free at the time.
        num_blocks: Blocks in the whole cache.
    """

    def __init__(self, message: str, *, needed_blocks: int, free_blocks: int, num_blocks: int):
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        self.num_blocks = num_blocks
        super().__init__(message)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Free list of ``num_blocks`` blocks of ``block_size`` tokens and the block table of each sequence.

    Args:
        num_blocks: Blocks in the cache.
        block_size: Tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Low ids first, so allocation order is deterministic.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks not in any table."""
        return len(self._free)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` fits now."""
        return blocks_needed(num_tokens, self.block_size) <= len(self._free)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow (or create) ``seq_id``'s table to hold ``num_tokens`` tokens; returns the table.

        Raises:
            KVBlocksExhaustedError: Not enough free blocks (nothing is taken then).
        """
        table = self._tables.get(seq_id, [])
        extra = blocks_needed(num_tokens, self.block_size) - len(table)
        if extra > len(self._free):
            raise KVBlocksExhaustedError(
                f"sequence {seq_id!r} needs {extra} more KV blocks for {num_tokens} tokens "
                f"(block_size={self.block_size}) but only {len(self._free)} of {self.num_blocks} are free",
                needed_blocks=extra, free_blocks=len(self._free), num_blocks=self.num_blocks,
            )
        for _ in range(max(0, extra)):
            table.append(self._free.pop())
        self._tables[seq_id] = table
        return table

    def table(self, seq_id: Hashable) -> list[int]:
        """The block table of ``seq_id``."""
        return self._tables[seq_id]

    def free(self, seq_id: Hashable) -> None:
        """Return ``seq_id``'s blocks to the free list (unknown ids are ignored)."""
        for block in reversed(self._tables.pop(seq_id, [])):
            self._free.append(block)

    def free_all(self) -> None:
        """Forget every table."""
        for seq_id in list(self._tables):
            self.free(seq_id)

    def slots(self, seq_id: Hashable, positions: Sequence[int] | range) -> torch.Tensor:
        """Flat cache slots of tokens at ``positions`` of ``seq_id`` (int64 tensor, on CPU)."""
        table, bs = self._tables[seq_id], self.block_size
        return torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)
