"""The KV block pool: free list, reference counts, block tables and the prefix cache.

The scheduler owns every block id; workers only read and write the blocks a
step names. A sequence holding `n` tokens owns `ceil(n / block_size)` blocks,
a new one every `block_size` tokens.

Automatic prefix caching, as in vLLM (Kwon et al., SOSP '23, and vLLM v1's
`BlockPool`): every full block gets a hash chained from its parent block's
hash and its own token ids, so a hash names the whole prefix up to that
block. A new sequence reuses the cached blocks of its longest cached prefix
(reference counted, shared read-only: a sequence only ever writes past its
cached prefix). A block whose last reference goes keeps its contents and
its hash in an LRU free queue; it is evicted only when a fresh block is
needed. So `num_free_blocks` counts evictable cached blocks as free.

Parallel sampling, as in PagedAttention (Kwon et al., SOSP '23, section
4.4): the n samples of one request share the prompt's blocks, its last
partial block included (`fork`, reference counts). A sequence about to write
into a block that others still hold gets a copy of it first
(`copy_on_write`): with n sharers that is n - 1 copies, the last writer keeps
the original.

KV events (for cache-aware routing, scheduler/kv_events.py): while
`kv_event_log` is a list, every hash entering the cache appends
``(hash, True)`` and every hash leaving it (eviction, reset) ``(hash, False)``,
in order; its reader empties it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from sluiceway.prefix_hash import ROOT_HASH, hash_block
from sluiceway.scheduler.sequence import Sequence

__all__ = ["ROOT_HASH", "Block", "BlockManager", "hash_block"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache


class BlockManager:
    """Allocates fixed-size KV blocks to sequences, sharing cached prefixes.

    Two-phase API as in nano-vllm / vLLM: `can_allocate` then `allocate`.
    Every block is in exactly one state: owned (ref_count > 0, in some
    block tables), cached-evictable (ref_count 0, hashed, in the free
    queue) or free (ref_count 0, no hash, in the free queue).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref_count == 0 blocks; evicted from the front (least recently freed first)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.prefix_cache_queries = 0  # prompt tokens looked up, tokens
        self.prefix_cache_hits = 0  # of those, found in the cache, tokens
        self.forked_tokens = 0  # prompt tokens a sample took from a sibling (`fork`)
        self.blocks_copied_on_write = 0
        # (block hash, stored) in order, while someone reads them (None: not recorded)
        self.kv_event_log: list[tuple[bytes, bool]] | None = None

    # -- counts -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence (free or cached-evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash (owned or evictable)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`'s tokens; no side effects.

        At most `(num_tokens - 1) // block_size` blocks, so that at least one
        token is left to compute (its logits give the next token).
        """
        if not self.enable_prefix_caching:
            return []
        tokens = seq.token_ids
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range((len(tokens) - 1) // bs):
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else None
            if h is None:
                h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: Seq[int] = (),
        num_prefix_tokens: int | None = None,
    ) -> bool:
        """Whether `seq` (after taking `cached_prefix`, if its table is empty) can get the
        blocks for its computed tokens plus `num_new_tokens`, a copy on write included.

        `num_prefix_tokens` is how many tokens `cached_prefix` holds: every slot of its
        blocks (a prefix-cache hit) unless given (a fork, see `fork`).
        """
        bs = self.block_size
        table = seq.block_table
        if table or not cached_prefix:  # the step loop's case: keep it short
            num_computed = seq.num_computed_tokens
            missing = -(-(num_computed + num_new_tokens) // bs) - len(table)
            if (
                num_computed % bs
                and num_new_tokens
                and table
                and self.blocks[table[-1]].ref_count > 1
            ):
                missing += 1  # a copy on write
            return missing <= len(self._free)
        num_computed = len(cached_prefix) * bs if num_prefix_tokens is None else num_prefix_tokens
        missing = max(0, self.blocks_for(num_computed + num_new_tokens) - len(cached_prefix))
        # taking a block someone holds makes two holders: writing into it copies it
        cow = int(
            num_computed % bs != 0
            and num_new_tokens > 0
            and self.blocks[cached_prefix[-1]].ref_count > 0
        )
        revived = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        return missing + cow + revived <= len(self._free)

    def take_cached_prefix(self, seq: Sequence, cached_prefix: Seq[int]) -> None:
        """Gives `seq` (with an empty table) the blocks of its cached prefix and counts
        the lookup: `prefix_cache_queries` += its tokens, `prefix_cache_hits` += cached tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(cached_prefix) * self.block_size
        for block_id in cached_prefix:
            self._ref(block_id)
        seq.block_table = list(cached_prefix)
        seq.num_computed_tokens = len(cached_prefix) * self.block_size

    def fork(self, seq: Sequence, source_blocks: Seq[int], num_tokens: int) -> None:
        """Gives `seq` (with an empty table) the first `num_tokens` tokens' blocks of a
        sibling with the same prompt: `source_blocks` is that sibling's table, of which
        `blocks_for(num_tokens)` blocks are taken (one more reference each; the last may be
        partial, and is copied on write when `seq` writes into it). Not counted as a
        prefix-cache lookup (`forked_tokens` counts them). Raises ValueError if
        `source_blocks` is too short."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        num_blocks = self.blocks_for(num_tokens)
        if len(source_blocks) < num_blocks:
            raise ValueError(
                f"{num_tokens} tokens need {num_blocks} blocks, got {len(source_blocks)}"
            )
        shared = list(source_blocks[:num_blocks])
        for block_id in shared:
            self._ref(block_id)
        seq.block_table = shared
        seq.num_computed_tokens = num_tokens
        self.forked_tokens += num_tokens

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """Before `seq` writes the K/V of position `seq.num_computed_tokens`: if that
        position falls inside its last block and another sequence holds that block too,
        replaces it in `seq`'s table by a fresh block and returns (source, destination) for
        the worker to copy; else None. Raises RuntimeError if no block is free (`can_allocate`
        counts this one)."""
        if seq.num_computed_tokens % self.block_size == 0:
            return None
        table = seq.block_table  # its last block holds position num_computed_tokens
        last = table[-1]
        if self.blocks[last].ref_count <= 1:
            return None
        (copy,) = self.allocate_blocks(1)
        self.release_blocks([last])
        table[-1] = copy
        self.blocks_copied_on_write += 1
        return last, copy

    # -- allocation -------------------------------------------------------------

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` lacks to store its computed tokens plus `num_new_tokens`."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Appends the missing blocks to `seq.block_table` and returns them.

        Evicts the least recently freed cached blocks when no plain free one
        is left. Raises RuntimeError if there are not enough free blocks
        (call `can_allocate` first).
        """
        new_blocks = self.allocate_blocks(self.num_missing_blocks(seq, num_new_tokens))
        seq.block_table.extend(new_blocks)
        return new_blocks

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` blocks (reference count 1) that belong to no sequence yet, e.g. the
        destination of a block copy; give them to a sequence's table or back with
        `release_blocks`. Evicts as `allocate` does. Raises RuntimeError if too few are free."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"need {num_blocks} blocks, {len(self._free)} free")
        new_blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict
                del self._cached[block.block_hash]
                if self.kv_event_log is not None:
                    self.kv_event_log.append((block.block_hash, False))
                block.block_hash = None
            block.ref_count = 1
            new_blocks.append(block_id)
        return new_blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Registers the hashes of `seq`'s blocks that its computed tokens have filled.

        Call after the step that computed them succeeded. A block whose
        prefix is already cached under another block id stays unhashed.
        """
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        tokens = seq.token_ids
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            seq.block_hashes.append(h)
            if not self.enable_prefix_caching or h in self._cached:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                self._enter(block, h)

    def free(self, seq: Sequence) -> None:
        """Drops `seq`'s reference to each of its blocks and empties its table.

        Blocks whose last reference goes join the free queue: hashed ones at
        the back (evicted last, tail blocks of a sequence before its head),
        unhashed ones at the front (reused first).
        """
        self.release_blocks(seq.block_table)
        seq.block_table = []

    def release_blocks(self, block_ids: Seq[int]) -> None:
        """Drops one reference to each of `block_ids` (released last to first), as `free`."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def register_hashes(self, seq: Sequence) -> None:
        """Enters the already-computed hashes of `seq`'s full blocks into this pool's cache
        (for a sequence whose blocks were copied in from another pool)."""
        if not self.enable_prefix_caching:
            return
        for h, block_id in zip(seq.block_hashes, seq.block_table, strict=False):
            block = self.blocks[block_id]
            if h not in self._cached and block.block_hash is None:
                self._enter(block, h)

    def ref_blocks(self, block_ids: Seq[int]) -> None:
        """Takes one more reference to each of `block_ids` (cached blocks found with
        `find_cached_prefix`, revived from the free queue if evictable); give them back with
        `release_blocks` or through a sequence's table."""
        for block_id in block_ids:
            self._ref(block_id)

    def _enter(self, block: Block, h: bytes) -> None:
        block.block_hash = h
        self._cached[h] = block.block_id
        if self.kv_event_log is not None:
            self.kv_event_log.append((h, True))

    @property
    def cached_hashes(self) -> list[bytes]:
        """The hashes of every cached block (owned or evictable), in no particular order."""
        return list(self._cached)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (e.g. when the worker's KV pool is new)."""
        if self.kv_event_log is not None:
            self.kv_event_log.extend((h, False) for h in self._cached)
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
