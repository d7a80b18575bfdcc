"""`sluiceway bench step`: times the worker's model step on a synthetic decode batch.

The hot path behind every serving figure, measured alone: `--num-seqs`
sequences decoding one token each, their context lengths drawn like the
ShareGPT benchmark's (prompt length + a uniform share of a 128-token output)
or fixed, through `ModelRunner.execute` (input tensors, forward, sampling).
`--profile` adds torch's operator table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time


def context_lengths(num_seqs: int, fixed: int | None, seed: int) -> list[int]:
    """Context length (tokens) of each decoding sequence: `fixed`, or a ShareGPT
    prompt length (vLLM's sampling) plus a uniform 1..128 tokens generated so far."""
    if fixed is not None:
        return [fixed] * num_seqs
    from router.tokenizer import load_tokenizer
    from sluiceway.model_files import resolve_model
    from sluiceway.sharegpt import sample_requests

    requests = sample_requests(load_tokenizer(resolve_model(None)), num_seqs, seed=seed)
    rng = random.Random(seed)
    return [r.prompt_len + rng.randint(1, 128) for r in requests]


def step_command(args: argparse.Namespace) -> int:
    """Prints the mean and median step time and decode throughput (tokens/s)."""
    import torch

    from sluiceway.model_files import resolve_model
    from worker.model_runner import ModelRunner, ScheduledChunk
    from worker.sampler import SamplingOptions

    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    lens = context_lengths(args.num_seqs, args.context_len, args.seed)
    runner = ModelRunner(
        resolve_model(args.model),
        device=args.device,
        dtype=args.dtype,
        kv_cache_memory=None,
        max_model_len=max(lens),
    )
    bs = runner.block_size
    needed = sum(-(-n // bs) for n in lens)
    if needed > runner.num_kv_blocks:
        raise SystemExit(f"{needed} KV blocks needed, the pool has {runner.num_kv_blocks}")
    runner.kv_pool.zero_()  # no NaN or denormals from uninitialized memory in the timings
    rng = random.Random(args.seed)
    chunks, next_block = [], 0
    greedy = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    for i, n in enumerate(lens):
        seq = runner.make_sequence(i, [rng.randrange(runner.vocab_size) for _ in range(n)], greedy)
        nb = -(-n // bs)
        seq.block_table.extend(range(next_block, next_block + nb))
        next_block += nb
        chunks.append(ScheduledChunk(seq, n - 1, 1))
    for _ in range(args.warmup):
        runner.execute(chunks)
    times, forward = [], []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t0)
        forward.append(runner.last_timings.forward_s)
    mean = statistics.fmean(times)
    print(
        f"{args.num_seqs} decoding sequences, context {min(lens)}..{max(lens)} tokens "
        f"(mean {statistics.fmean(lens):.0f}), {runner.dtype}, {torch.get_num_threads()} threads"
    )
    print(f"step mean {1e3 * mean:.1f} ms, median {1e3 * statistics.median(times):.1f} ms")
    print(f"forward mean {1e3 * statistics.fmean(forward):.1f} ms")
    print(f"decode throughput {args.num_seqs / mean:.1f} tokens/s")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                runner.execute(chunks)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


def add_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or GGUF (default: embedded)")
    p.add_argument("--num-seqs", type=int, default=200)
    p.add_argument(
        "--context-len", type=int, default=None, help="fixed context (default: ShareGPT-like)"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print torch's operator table")
