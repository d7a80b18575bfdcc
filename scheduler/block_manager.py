"""The KV block pool: free list and per-sequence block tables.

The scheduler owns every block id; workers only read and write the blocks a
step names. A sequence holding `n` tokens owns `ceil(n / block_size)` blocks,
a new one every `block_size` tokens. Blocks go back to the free list the
moment the sequence finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque

from scheduler.sequence import Sequence


class BlockManager:
    """Allocates fixed-size KV blocks to sequences.

    Two-phase API as in nano-vllm / vLLM: `can_allocate` then `allocate`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to store its computed tokens plus `num_new_tokens`."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Appends the missing blocks to `seq.block_table` and returns them.

        Raises RuntimeError if there are not enough free blocks (call
        `can_allocate` first).
        """
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"need {missing} blocks, {len(self._free)} free")
        new_blocks = [self._free.popleft() for _ in range(missing)]
        seq.block_table.extend(new_blocks)
        return new_blocks

    def free(self, seq: Sequence) -> None:
        """Returns every block of `seq` to the free list and empties its table."""
        self._free.extend(seq.block_table)
        seq.block_table = []
