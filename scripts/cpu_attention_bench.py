"""Time the C++ paged attention (kernels/csrc/paged_attention.cpp) at Gemma 3 270M's shapes.

4 query heads on 1 KV head of dim 256 (``--shape smollm2``: SmolLM2-135M's 9 on 3 of dim 64),
block 16, bfloat16 queries: decodes of batch
1/32/128/200 at contexts 320 and 2,000, and a 512-token prefill chunk, full attention and, with
``--window``, a sliding window; the KV pool in bfloat16 or, with ``--kv-cache-dtype int8`` (or
``fp8_e4m3``), in int8 (e4m3) with per-token scales (kernels/kv_quant.py). Prints one JSON line: microseconds per call, the minimum and the median of
the calls made in ``--seconds`` per case (on a shared machine quote the minimum; with another job on
the cores, a 2-thread call waits for its second thread: time with ``OMP_NUM_THREADS=1`` there).

``--forward`` times instead what a decode step's forward asks of it (issue 33): one call per
layer over as many layers' pools (30 for SmolLM2), each from memory as between the GEMMs of a
forward, at ``--forward-batch`` sequences of ``--forward-context`` tokens, full attention (``--window``
is refused) in ``--kv-cache-dtype``; the same calls with
every sequence on the same blocks (cache-resident: the kernel's arithmetic alone); and B, the
streaming read rate of ``bench roofline`` measured before and after. It prints the K/V bytes,
their floor (bytes / B) and the attention time as a multiple of it.

Before/after: run it with ``PYTHONPATH`` on each tree in turn (each builds its own kernels);
``--window`` needs a tree whose kernel takes one. Threads: ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sluiceway.kernels import cpu_ops

HQ, HKV, D, BLOCK = 4, 1, 256, 16
SHAPES = {"gemma3": (4, 1, 256), "smollm2": (9, 3, 64)}
CASES = [(1, 320, 1), (32, 320, 1), (128, 320, 1), (200, 320, 1), (1, 2000, 1), (32, 2000, 1),
         (128, 2000, 1), (1, 512, 512)]  # fmt: skip


def make_pool(num_blocks: int, kv_cache_dtype: str) -> torch.Tensor:
    """One layer's pool of random K/V: bfloat16, or int8 (fp8: finite e4m3 bytes) values
    with scales of 0.01."""
    if kv_cache_dtype == "auto":
        return torch.randn(2, num_blocks, HKV, BLOCK * D).to(torch.bfloat16)
    from sluiceway.kernels.kv_quant import split_blocks

    shape = (2, num_blocks, HKV, BLOCK * (D + 4))
    if kv_cache_dtype == "int8":
        pool = torch.randint(-127, 128, shape, dtype=torch.int8)
    else:
        pool = torch.randint(0, 0x7F, shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
    for scales in split_blocks(pool, D)[2:]:
        scales.fill_(0.01)
    return pool


def time_case(
    batch: int, context: int, rows: int, window: int, seconds: float, kv_cache_dtype: str = "auto"
) -> list[float]:
    """Seconds per call of a step of ``batch`` sequences of ``context`` tokens whose last
    ``rows`` are the step's queries (shuffled block ids)."""
    blocks = -(-context // BLOCK)
    pool = make_pool(batch * blocks, kv_cache_dtype)
    tables = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32) * rows
    query = torch.randn(batch * rows, HQ, D).to(torch.bfloat16)
    kw = {"sliding_window": window} if window else {}

    def call() -> None:
        cpu_ops.paged_attention(query, pool, tables, context_lens, starts, D**-0.5, **kw)

    for _ in range(3):
        call()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 10:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def forward_case(
    batch: int, context: int, layers: int, reps: int, kv_cache_dtype: str
) -> dict[str, float]:
    """Decode attention of ``batch`` sequences of ``context`` tokens over ``layers`` pools
    (shuffled block ids) in ``kv_cache_dtype``, seconds per pass over all layers: scattered
    blocks from memory, and the same calls on one sequence's blocks shared by all
    (cache-resident); with B (bytes/s) measured before and after them (the higher counts)."""
    from sluiceway.bench.machine_rates import l3_cache_bytes, measure_bandwidth

    blocks = -(-context // BLOCK)
    pools = [make_pool(batch * blocks, kv_cache_dtype) for _ in range(layers)]
    scattered = torch.randperm(batch * blocks).view(batch, blocks).to(torch.int32)
    shared = torch.arange(blocks, dtype=torch.int32).repeat(batch, 1)
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    query = torch.randn(batch, HQ, D).to(torch.bfloat16)
    out = torch.empty_like(query)

    def one_pass(tables: torch.Tensor) -> float:
        t0 = time.perf_counter()
        for pool in pools:
            torch.ops.sluiceway.paged_attention(
                out, query, pool, tables, context_lens, starts, D**-0.5, 0
            )
        return time.perf_counter() - t0

    one_pass(scattered)
    bandwidth = measure_bandwidth(8 * l3_cache_bytes())
    memory, cached = [], []
    for _ in range(reps):
        memory.append(one_pass(scattered))
        cached.append(one_pass(shared))
    bandwidth = max(bandwidth, measure_bandwidth(8 * l3_cache_bytes()))
    token_bytes = D * 2 if kv_cache_dtype == "auto" else D + 4  # bfloat16, or 1-byte + scale
    kv_bytes = 2 * batch * context * HKV * token_bytes * layers  # K and V
    return {
        "attention_ms": round(min(memory) * 1e3, 2),
        "attention_median_ms": round(statistics.median(memory) * 1e3, 2),
        "cache_resident_ms": round(min(cached) * 1e3, 2),
        "kv_gb": round(kv_bytes / 1e9, 4),
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "floor_ms": round(kv_bytes / bandwidth * 1e3, 2),
        "of_floor": round(min(memory) / (kv_bytes / bandwidth), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    parser.add_argument("--seconds", type=float, default=1.5, help="timing per case")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8_e4m3"), default="auto")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gemma3", help="heads, dim")
    parser.add_argument("--forward", action="store_true", help="a decode forward's attention")
    parser.add_argument("--forward-batch", type=int, default=200, help="sequences (--forward)")
    parser.add_argument("--forward-context", type=int, default=320, help="tokens (--forward)")
    parser.add_argument("--forward-layers", type=int, default=30, help="pools (--forward)")
    parser.add_argument("--forward-reps", type=int, default=7, help="passes (--forward)")
    args = parser.parse_args()
    if args.forward and args.window:
        parser.error("--window: --forward times full attention only")
    global HQ, HKV, D
    HQ, HKV, D = SHAPES[args.shape]
    cpu_ops.load()
    torch.manual_seed(0)
    result = {
        "threads": torch.get_num_threads(),
        "window": args.window,
        "kv_cache_dtype": args.kv_cache_dtype,
        "shape": args.shape,
    }
    if args.forward:
        case = (args.forward_batch, args.forward_context, args.forward_layers, args.forward_reps)
        result["forward"] = {"batch": case[0], "context": case[1], "layers": case[2]}
        result["forward"].update(forward_case(*case, args.kv_cache_dtype))
        print(json.dumps(result))
        return
    for batch, context, rows in CASES:
        times = time_case(batch, context, rows, args.window, args.seconds, args.kv_cache_dtype)
        result[f"b{batch}_ctx{context}_q{rows}"] = {
            "min_us": round(min(times) * 1e6, 1),
            "median_us": round(statistics.median(times) * 1e6, 1),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
