"""Chained KV block hashes: the names of prompt prefixes, shared by scheduler and router.

The scheduler's prefix cache (scheduler/block_manager.py) keys every full block by
`hash_block(parent_hash, token_ids)`, starting from `ROOT_HASH`, as vLLM's automatic prefix
caching does: a hash names the whole prefix up to and including its block. Schedulers
publish these hashes (KV events) and routers hash prompts with the same function
(`prompt_block_hashes`) to find which replica holds the longest prefix of a prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 (32 bytes) of the parent block's hash and this block's token ids (uint32,
    native byte order: every process of a stack runs on the same kind of host)."""
    return hashlib.sha256(parent_hash + array("I", token_ids).tobytes()).digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of `token_ids`, in order:
    ``len(token_ids) // block_size`` of them (a partial last block has none).
    Raises ValueError for a `block_size` below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
