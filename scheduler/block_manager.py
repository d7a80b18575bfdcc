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

Every block question is asked here, in one call, as vLLM v1's
`KVCacheManager.allocate_slots`: `allocate_slots` (a step's sequence, its
cached prefix taken first when it is admitted) and `allocate_for_transfer`
(a sequence moving in from another pool) either reserve everything asked or
return None and change nothing. No other code counts blocks or reads
reference counts.

Parallel sampling shares the prompt through the prefix cache, as vLLM v1
does: a sample takes its siblings' full prompt blocks as a cache hit and
computes the partial last block itself (see scheduler.py).

KV events (for cache-aware routing, scheduler/kv_events.py): while
`kv_event_log` is a list, every hash entering the cache appends
``(hash, True)`` and every hash leaving it (an eviction) ``(hash, False)``,
in order; its reader empties it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from sluiceway.prefix_hash import ROOT_HASH, hash_block
from sluiceway.scheduler.sequence import Sequence

__all__ = ["ROOT_HASH", "Block", "BlockManager", "CachedPrefix", "hash_block"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache


@dataclass(slots=True, frozen=True)
class CachedPrefix:
    """The longest cached prefix of a sequence's tokens (`BlockManager.find_cached_prefix`),
    for `BlockManager.allocate_slots` in the same step."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # tokens those blocks hold: every slot of each (full blocks)


class BlockManager:
    """Allocates fixed-size KV blocks to sequences, sharing cached prefixes.

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
        # (block hash, stored) in order, while someone reads them (None: not recorded)
        self.kv_event_log: list[tuple[bytes, bool]] | None = None

    # -- counts -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any sequence (free or cached-evictable)."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # -- the door: every allocation ----------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest cached prefix of `seq`'s tokens; no side effects.

        At most `max_cached_prefix_tokens(seq.num_tokens)`, so that at least one
        token is left to compute (its logits give the next token). Valid until
        the pool changes: pass it to `allocate_slots` in the same step.
        """
        if seq.wants_prompt_logprobs:  # its prompt's logits are wanted: computed, not read
            return CachedPrefix((), 0)
        max_tokens = self.max_cached_prefix_tokens(seq.num_tokens)
        blocks = self._cached_blocks(seq, max_tokens // self.block_size)
        return CachedPrefix(tuple(blocks), len(blocks) * self.block_size)

    def max_cached_prefix_tokens(self, num_tokens: int) -> int:
        """The most tokens a prefix-cache hit can give a sequence of `num_tokens` tokens:
        its full blocks but the one of its last token; 0 with prefix caching off."""
        if not self.enable_prefix_caching:
            return 0
        return (num_tokens - 1) // self.block_size * self.block_size

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, cached: CachedPrefix | None = None
    ) -> list[int] | None:
        """Gives `seq` the blocks for its computed tokens plus `num_new_tokens`, or returns
        None and changes nothing when the free blocks do not suffice.

        A sequence that holds no block (waiting: new or preempted, `num_computed_tokens`
        0) first takes `cached`, its `find_cached_prefix` of this step (none: compute
        everything): one more reference to each of those blocks (an evictable one is
        revived, so it counts against the free blocks), and `seq.num_computed_tokens`
        becomes `cached.num_tokens`; with prefix caching on the lookup is counted
        (`prefix_cache_queries` += its tokens, `prefix_cache_hits` += `cached.num_tokens`).

        Returns the fresh blocks (reference count 1) appended to `seq.block_table`, past
        any cached ones; the least recently freed cached blocks are evicted when no plain
        free block is left. Raises ValueError if `cached` is given for a sequence that holds
        blocks.
        """
        table = seq.block_table
        if table:  # the step loop's case: keep it short
            if cached is not None:
                raise ValueError(f"sequence {seq.seq_id} holds blocks: no cached prefix to take")
            missing = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(table)
            if missing > len(self._free):
                return None
            new_blocks = self._allocate_blocks(missing)
            table.extend(new_blocks)
            return new_blocks
        assert seq.num_computed_tokens == 0, seq
        prefix = cached if cached is not None else CachedPrefix()
        missing = self.blocks_for(prefix.num_tokens + num_new_tokens) - len(prefix.block_ids)
        revived = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
        if max(0, missing) + revived > len(self._free):
            return None
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += prefix.num_tokens
        for block_id in prefix.block_ids:  # before allocating: allocation must not evict them
            self._ref(block_id)
        new_blocks = self._allocate_blocks(missing)
        seq.block_table = [*prefix.block_ids, *new_blocks]
        seq.num_computed_tokens = prefix.num_tokens
        return new_blocks

    def allocate_for_transfer(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int] | None:
        """Reserves the blocks of this pool that will hold the K/V of `seq`'s first
        `num_tokens` tokens, copied in from another pool (disaggregated prefill), or returns
        None and changes nothing when the free blocks do not suffice.

        The first blocks are those of its longest cached prefix here (a shared system
        prompt: not to be copied), revived if evictable; fresh ones follow. Returns
        (block ids, how many of them were cached), each block holding one reference for
        the transfer: give them to the sequence (`Scheduler.admit_prefilled`) or back
        (`release_blocks`). Not counted as a prefix-cache lookup.
        """
        cached = self._cached_blocks(seq, num_tokens // self.block_size)
        missing = self.blocks_for(num_tokens) - len(cached)
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        if missing + revived > len(self._free):
            return None
        for block_id in cached:  # before allocating: allocation must not evict them
            self._ref(block_id)
        return cached + self._allocate_blocks(missing), len(cached)

    def _cached_blocks(self, seq: Sequence, max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of `seq`'s tokens, at most `max_blocks`."""
        if not self.enable_prefix_caching:
            return []
        tokens = seq.token_ids
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range(max_blocks):
            h = seq.block_hashes[i] if i < len(seq.block_hashes) else None
            if h is None:
                h = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
            parent = h
        return hits

    def _allocate_blocks(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` (none if <= 0) free blocks, reference count 1, evicting the
        least recently freed cached ones when no plain free one is left. The callers have
        counted them: too few free is a bug (RuntimeError)."""
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

    # -- the cache and the way back -----------------------------------------------

    def cache_full_blocks(self, seq: Sequence, num_computed: int) -> None:
        """Registers the hashes of `seq`'s blocks that its first `num_computed` tokens have
        filled.

        Call after the step that computed them succeeded, with the tokens computed through
        it (with async scheduling `seq.num_computed_tokens` also counts a step still
        running). A block whose prefix is already cached under another block id stays
        unhashed.
        """
        bs = self.block_size
        num_full = num_computed // bs
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
