"""Deterministic inference by default, end to end in bfloat16 (the default dtype): the same
greedy and seeded requests give identical token ids alone, after a prefix-cache hit, amid two
dozen ShareGPT requests of mixed lengths (chunked), after preemptions, with static batching and
no chunking, long prefills capped and run side by side, disaggregated prefill/decode, two
replicas, and tensor parallelism; and the n samples of a parallel-sampling request (full
prompt blocks shared through the prefix cache) give the tokens of n single requests with seeds
seed + i, in every mode; so does a seeded request under a JSON-schema constraint (structured
outputs). No near-tie tolerance: the ids must be equal."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_for_free_blocks

pytestmark = pytest.mark.slow

BF16 = ("--dtype", "bfloat16")
BYTES_PER_BLOCK = 30 * 2 * 3 * 64 * 2 * 16  # SmolLM2, bfloat16, 16 tokens

# Every probe is at least one full block (16 tokens), so that a second send hits the cache.
PROBES = [
    # the example: bfloat16 logits of "The" and "1" tie exactly at its first token
    Client.request(messages=[("user", "Name three colors.")], temperature=0, max_tokens=24),
    Client.request("Here is a list of European capitals, one per line, with their countries:\n"
                   "France: Paris\nGermany:", temperature=0, max_tokens=16),
    Client.request("Once upon a time, in a land far away, there lived an old clockmaker who "
                   "could repair anything except", temperature=1.0, seed=7, top_p=0.95,
                   max_tokens=32, ignore_eos=True),
    Client.request(messages=[("user", "Write a short poem about rivers.")], temperature=0.8,
                   seed=1234, top_k=50, max_tokens=32, ignore_eos=True),
    # structured outputs: the grammar's token mask is applied per row
    Client.request(messages=[("user", "Describe a city as JSON.")], temperature=1.0, seed=5,
                   max_tokens=40, structured_outputs=inference_pb2.StructuredOutputs(
                       json='{"type": "object", "properties": {"name": {"type": "string"}, '
                            '"population": {"type": "integer"}}, "required": ["name"]}')),
]  # fmt: skip
# n = 3 samples of one prompt, amid the noise; PROBES' last three entries (made in `probes`)
# are its samples as single requests
PARALLEL = Client.request("In the middle of the old town square stood a fountain that every "
                          "child in the village knew, because", temperature=1.0, seed=99,
                          max_tokens=24, ignore_eos=True, n=3)  # fmt: skip


def parallel_singles() -> list[inference_pb2.GenerateRequest]:
    """PARALLEL's samples as single requests: seed + i, n unset."""
    singles = []
    for i in range(PARALLEL.sampling.n):
        single = inference_pb2.GenerateRequest()
        single.CopyFrom(PARALLEL)
        single.sampling.ClearField("n")
        single.sampling.seed = PARALLEL.sampling.seed + i
        singles.append(single)
    return singles


def _tokens(client: Client, request: inference_pb2.GenerateRequest) -> list[int]:
    return client.generate(request, timeout=600)[1]


def probes_alone(stack: Stack, probes: list[inference_pb2.GenerateRequest]) -> list[list[int]]:
    with stack.client() as client:
        return [_tokens(client, p) for p in probes]


def probes_amid(
    stack: Stack,
    probes: list[inference_pb2.GenerateRequest],
    noise: list[inference_pb2.GenerateRequest],
) -> list[list[int]]:
    """The probes sent in the middle of `noise`, all at once, with PARALLEL: its samples must
    be the tokens of its singles (the probes' last three) of this run."""
    with stack.client() as client, ThreadPoolExecutor(len(probes) + len(noise) + 1) as pool:
        half = len(noise) // 2
        busy = [pool.submit(_tokens, client, r) for r in noise[:half]]
        mine = [pool.submit(_tokens, client, p) for p in probes]
        parallel = pool.submit(client.generate_samples, PARALLEL, 600)
        busy += [pool.submit(_tokens, client, r) for r in noise[half:]]
        for f in busy:
            assert f.result()
        got = [f.result() for f in mine]
        assert [ids for _, ids, _ in parallel.result()] == got[-PARALLEL.sampling.n :]
        info = wait_for_free_blocks(client)
        assert info.num_free_kv_blocks == info.num_kv_blocks
        return got


@pytest.fixture(scope="module")
def probes(
    sharegpt_requests: list[inference_pb2.GenerateRequest],
) -> list[inference_pb2.GenerateRequest]:
    """PROBES plus a greedy ShareGPT prompt of over 300 tokens (chunked at 64-token budgets),
    then PARALLEL's singles."""
    longest = max(sharegpt_requests, key=lambda r: len(r.prompt))
    return [*PROBES, longest, *parallel_singles()]


@pytest.fixture(scope="module")
def noise(
    sharegpt_requests: list[inference_pb2.GenerateRequest],
) -> list[inference_pb2.GenerateRequest]:
    """24 ShareGPT requests of mixed lengths (up to 400 prompt tokens), some sampled, some
    with top_k over the sampler's candidate count or top_p, some asking top logprobs."""
    out = []
    for i, r in enumerate(sharegpt_requests[:24]):
        n = inference_pb2.GenerateRequest()
        n.CopyFrom(r)
        n.sampling.max_tokens = 8 + 2 * i
        if i % 3 == 0:
            n.sampling.temperature = 0.9
        if i % 5 == 1:
            n.sampling.temperature, n.sampling.top_k = 1.0, 1000
        if i % 7 == 2:
            n.sampling.temperature, n.sampling.top_p = 1.0, 0.9
        if i % 4 == 3:
            n.sampling.logprobs = 5
        out.append(n)
    return out


@pytest.fixture(scope="module")
def reference(probes: list[inference_pb2.GenerateRequest]) -> Iterator[list[list[int]]]:
    """Each probe alone on a bfloat16 stack without prefix caching."""
    stack = start_stack(*BF16, "--no-enable-prefix-caching")
    try:
        assert any("batch invariant" in line and "not batch" not in line for line in stack.log)
        yield probes_alone(stack, probes)
    finally:
        assert stop_stack(stack) == 0


def test_after_a_prefix_cache_hit_and_amid_chunked_traffic(
    probes: list[inference_pb2.GenerateRequest],
    noise: list[inference_pb2.GenerateRequest],
    reference: list[list[int]],
) -> None:
    stack = start_stack(*BF16, "--max-num-batched-tokens", "64", "--max-num-seqs", "64")
    try:
        with stack.client() as client:
            for probe, ref in zip(probes, reference, strict=True):
                assert _tokens(client, probe) == ref  # cold cache
                hits = client.model_info().prefix_cache_hits_total
                assert _tokens(client, probe) == ref  # its full blocks from the cache
                assert client.model_info().prefix_cache_hits_total - hits >= 16
        assert probes_amid(stack, probes, noise) == reference
    finally:
        assert stop_stack(stack) == 0


@pytest.mark.parametrize(
    "flags",
    [
        # 48 blocks for 29 requests of up to 400 tokens, 64-token steps: many preemptions
        [
            "--kv-cache-memory",
            str(48 * BYTES_PER_BLOCK),
            "--max-num-batched-tokens",
            "64",
            "--max-num-seqs",
            "64",
        ],
        ["--scheduling-policy", "static", "--no-enable-chunked-prefill"],
        ["--num-prefill-workers", "1", "--num-decode-workers", "1"],
        ["--num-replicas", "2"],
        # long prefills capped at 24 tokens a step, up to 3 partial prefills (2 long) at once
        [
            "--long-prefill-token-threshold",
            "24",
            "--max-num-partial-prefills",
            "3",
            "--max-long-partial-prefills",
            "2",
        ],
    ],
    ids=[
        "48-blocks-preempting",
        "static-unchunked",
        "disaggregated",
        "2-replicas",
        "long-prefill-capped",
    ],
)
def test_every_mode_gives_the_reference_tokens(
    flags: list[str],
    probes: list[inference_pb2.GenerateRequest],
    noise: list[inference_pb2.GenerateRequest],
    reference: list[list[int]],
) -> None:
    stack = start_stack(*BF16, *flags)
    try:
        assert probes_amid(stack, probes, noise) == reference
        with stack.client() as client:
            preemptions = client.model_info().num_preemptions_total
        if "--kv-cache-memory" in flags:
            assert preemptions >= 5
    finally:
        assert stop_stack(stack) == 0


def test_tensor_parallel_alone_and_amid_traffic(
    probes: list[inference_pb2.GenerateRequest], noise: list[inference_pb2.GenerateRequest]
) -> None:
    """-tp 3 (SmolLM2's 3 KV heads) sums each row-parallel GEMM in three parts, so its tokens
    may differ from one rank's; not with the batch: the all-reduce adds the ranks' partial
    sums in float32 in rank order (worker/parallel.py)."""
    stack = start_stack(*BF16, "--tensor-parallel-size", "3")
    try:
        alone = probes_alone(stack, probes)
        assert probes_amid(stack, probes, noise) == alone
    finally:
        assert stop_stack(stack) == 0
