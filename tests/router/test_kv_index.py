"""Cache-aware routing: the router's index of KV events and the pick policy over it."""

from __future__ import annotations

import asyncio
from typing import Any

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.prefix_hash import prompt_block_hashes
from sluiceway.router.balancer import (
    DEFAULT_BALANCE_ABS_THRESHOLD,
    DEFAULT_CACHE_THRESHOLD,
    SchedulerPool,
)
from sluiceway.router.kv_index import KvIndex

BS = 16
SYSTEM = list(range(1, 17))  # one block every prompt shares (a chat template's system prompt)


def events(stored: list[bytes] = (), removed: list[bytes] = (), reset: bool = False):  # type: ignore[assignment,no-untyped-def]
    return scheduler_pb2.KvEvents(stored=stored, removed=removed, reset=reset, block_size=BS)


def test_the_index_follows_stores_removals_and_snapshots() -> None:
    index = KvIndex()
    h = prompt_block_hashes(list(range(64)), BS)  # 4 chained hashes
    index.apply("a", events(stored=h[:3]))
    index.apply("b", events(stored=h[:1]))
    assert index.longest_prefix(h) == {"a": 3, "b": 1}
    index.apply("a", events(removed=[h[1]]))
    assert index.longest_prefix(h) == {"a": 1, "b": 1}  # a run stops at a gap
    assert index.num_blocks("a") == 2
    index.apply("a", events(stored=[h[0]], reset=True))  # a snapshot replaces all
    assert index.num_blocks("a") == 1 and index.longest_prefix(h) == {"a": 1, "b": 1}
    index.clear("b")
    assert index.longest_prefix(h) == {"a": 1} and index.num_blocks("b") == 0
    index.remove("nobody", h)  # unknown replica: nothing to do


def conversation(turn: int) -> list[int]:
    """Turn `turn`'s prompt: the system prompt, then 2 blocks per earlier turn and the new
    message (2 blocks): each turn's prompt extends the last."""
    return SYSTEM + [1000 + k for k in range(32 * (turn + 1))]


def distinct(i: int) -> list[int]:
    """The system prompt, then a message of 3 blocks of its own."""
    return SYSTEM + [5000 + 100 * i + k for k in range(48)]


def pick(pool: SchedulerPool, tokens: list[int]) -> str:
    replica = pool.pick(tokens)
    assert replica is not None
    return replica.address


def with_pool(test: Any, **kwargs: Any) -> None:
    async def main() -> None:
        pool = SchedulerPool(["127.0.0.1:1", "127.0.0.1:2"], **kwargs)
        for r in pool.replicas:
            r.ready = True
        try:
            test(pool)
        finally:
            await pool.close()

    asyncio.run(main())


def test_a_conversation_sticks_to_the_replica_that_caches_it() -> None:
    def test(pool: SchedulerPool) -> None:
        a, b = pool.addresses
        # b served turn 0 (3 blocks, the system prompt included) and cached it
        pool.kv_index.apply(b, events(stored=prompt_block_hashes(conversation(0), BS)))
        pool.kv_index.apply(a, events(stored=prompt_block_hashes(distinct(0), BS) * 1))
        # turn 1: 5 blocks, 3 cached on b (60% > 50%); a holds only the system prompt
        assert pick(pool, conversation(1)) == b
        pool.replicas[1].outstanding = 8  # b is 8 past a (the threshold): still b
        assert pick(pool, conversation(1)) == b
        pool.replicas[1].outstanding = 9  # past it: by load
        assert pick(pool, conversation(1)) == a

    with_pool(test)


def test_a_shared_system_prompt_alone_does_not_draw_requests() -> None:
    def test(pool: SchedulerPool) -> None:
        a, b = pool.addresses
        pool.kv_index.apply(a, events(stored=prompt_block_hashes(distinct(0), BS)))
        # distinct(1): 4 blocks, 1 (the system prompt) cached on a: 25%, not a hit; the
        # replica with fewer cached blocks (b: none) gets it
        assert pick(pool, distinct(1)) == b
        pool.kv_index.apply(b, events(stored=prompt_block_hashes(distinct(1), BS)))
        pool.kv_index.apply(b, events(stored=prompt_block_hashes(distinct(2), BS)))
        assert pick(pool, distinct(3)) == a  # b now caches more: a
        # exactly half cached is not more than half: no hit
        half = SYSTEM + [7000 + k for k in range(16)]
        pool.kv_index.apply(b, events(stored=prompt_block_hashes(half, BS)))
        assert pick(pool, half + [1] * 32) == a
        assert pick(pool, half + [1] * 15) == b  # 2 of 2 full blocks: a hit

    with_pool(test)


def test_ties_on_the_cached_prefix_go_by_load_then_cache_size() -> None:
    def test(pool: SchedulerPool) -> None:
        a, b = pool.addresses
        h = prompt_block_hashes(conversation(1), BS)
        pool.kv_index.apply(a, events(stored=h[:4]))
        pool.kv_index.apply(b, events(stored=h[:4]))
        pool.replicas[0].outstanding = 1
        assert pick(pool, conversation(1)) == b
        pool.replicas[0].outstanding = 0
        pool.kv_index.apply(a, events(stored=prompt_block_hashes(distinct(9), BS)))
        assert pick(pool, conversation(1)) == b  # same load, b caches less

    with_pool(test)


def test_a_cache_threshold_of_zero_follows_any_hit() -> None:
    def test(pool: SchedulerPool) -> None:
        a, b = pool.addresses
        pool.kv_index.apply(b, events(stored=prompt_block_hashes(distinct(0), BS)))
        pool.kv_index.apply(b, events(stored=prompt_block_hashes(distinct(1), BS)))
        assert pick(pool, distinct(2)) == b  # the system prompt block is enough
        pool.replicas[1].outstanding = 1  # balance_abs_threshold 0: any extra load wins
        assert pick(pool, distinct(2)) == a

    with_pool(test, cache_threshold=0.0, balance_abs_threshold=0)


def test_the_cli_defaults_are_the_pools() -> None:
    from sluiceway.cli import build_parser

    for argv in (["router"], ["serve"]):
        args = build_parser().parse_args(argv)
        assert args.cache_threshold == DEFAULT_CACHE_THRESHOLD
        assert args.balance_abs_threshold == DEFAULT_BALANCE_ABS_THRESHOLD
