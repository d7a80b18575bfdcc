"""The batch-invariant Triton kernels on one device: bitwise invariance and cost against the
kernels they replace (run by scripts/gpu_check.sh, step ``invariance``).

For 7B-shaped layers (Llama-2-7B: hidden 4096, intermediate 11008, 32 heads of 128,
vocabulary 32000), bfloat16:

- matmul: :func:`kernels.triton_matmul.triton_linear` against cuBLAS (``F.linear``) at
  M 1, 32 and 256 for qkv, o, gate_up, down and the logits (float32 out); milliseconds per
  call and the ratio; and whether a row's output is bitwise the same at M 1 and inside M 256
  (for both: cuBLAS is expected not to be);
- attention: a decode step (contexts of 1,024) at batch 1, 32 and 256, and a 2,048-token
  prefill, with the unified kernel against the old decode / prefill kernels; and whether a
  token's output is bitwise the same as a decode and inside the prefill.

Prints one line ``INVARIANCE-RESULT {json}`` (and writes it to ``--json``). ``--device cpu``
is a dry run of the code path in Triton's interpreter on tiny shapes (timings meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    result = run(torch.device(args.device), args.warmup, args.iters)
    line = json.dumps(result)
    print("INVARIANCE-RESULT " + line)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    ok = result["matmul_invariant"] and result["attention_invariant"]
    return 0 if ok else 1


def _timer(device: Any, warmup: int, iters: int) -> Callable[[Callable[[], object]], float]:
    import torch

    def ms(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(stop) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters

    return ms


def run(device: Any, warmup: int, iters: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from sluiceway.kernels.triton_matmul import CONFIG, triton_linear

    cuda = device.type == "cuda"
    if not cuda:
        warmup, iters = 0, 1
    ms = _timer(device, warmup, iters)
    hidden, inter, vocab = (4096, 11008, 32000) if cuda else (64, 96, 200)
    batches = (1, 32, 256) if cuda else (1, 4, 33)
    layers = {
        "qkv": (3 * hidden, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "logits": (vocab, hidden),
    }
    g = torch.Generator(device=device).manual_seed(0)
    matmul = []
    invariant = True
    cublas_invariant = True
    for name, (n, k) in layers.items():
        w = torch.randn(n, k, device=device, generator=g).to(torch.bfloat16) / k**0.5
        x_all = torch.randn(max(batches), k, device=device, generator=g).to(torch.bfloat16)
        out_dtype = torch.float32 if name == "logits" else None
        for m in batches:
            x = x_all[:m]
            mine = ms(lambda x=x, w=w, od=out_dtype: triton_linear(x, w, out_dtype=od))
            theirs = ms(lambda x=x, w=w: F.linear(x, w)) if cuda else None
            matmul.append(
                {"layer": name, "m": m, "n": n, "k": k, "triton_ms": round(mine, 4),
                 "cublas_ms": None if theirs is None else round(theirs, 4),
                 "triton_over_cublas": None if not theirs else round(mine / theirs, 3)}
            )  # fmt: skip
        big = triton_linear(x_all, w, out_dtype=out_dtype)
        one = triton_linear(x_all[5:6], w, out_dtype=out_dtype)
        invariant &= bool(torch.equal(one, big[5:6]))
        if cuda:
            cublas_invariant &= bool(torch.equal(F.linear(x_all[5:6], w), F.linear(x_all, w)[5:6]))
    attention = _attention(device, ms, cuda)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (interpreter dry run)",
        "matmul_config": CONFIG,
        "matmul": matmul,
        "matmul_invariant": invariant,
        "cublas_invariant": cublas_invariant if cuda else None,
        **attention,
    }


def _attention(device: Any, ms: Callable[[Callable[[], object]], float], cuda: bool) -> dict:
    import torch

    from sluiceway.kernels.paged_attention import kv_pool_shape
    from sluiceway.kernels.triton_backend import TritonAttentionBackend
    from sluiceway.kernels.varlen_metadata import build_varlen_metadata

    hq, hkv, d, bs = (32, 32, 128, 16) if cuda else (4, 2, 16, 16)
    ctx, prefill = (1024, 2048) if cuda else (40, 48)
    batches = (1, 32, 256) if cuda else (1, 3)
    max_batch = max(batches)
    blocks_per_seq = -(-max(ctx, prefill) // bs)
    num_blocks = max_batch * blocks_per_seq + blocks_per_seq
    cache = torch.randn(kv_pool_shape(1, num_blocks, bs, hkv, d)[1:], device=device)
    cache = cache.to(torch.bfloat16)
    geometry = {"block_size": bs, "num_heads": hq, "num_kv_heads": hkv, "head_dim": d}
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(max_batch)]
    q_all = torch.randn(max(max_batch, prefill), hq, d, device=device).to(torch.bfloat16)
    new, old = TritonAttentionBackend(batch_invariant=True), TritonAttentionBackend(False)
    decode = []
    for b in batches:
        md = build_varlen_metadata([1] * b, [ctx] * b, tables[:b], device=device, **geometry)
        q = q_all[:b]
        decode.append(
            {"batch": b, "context": ctx, "num_splits": md.num_splits,
             "unified_ms": round(ms(lambda q=q, md=md: new.attention(q, cache, md)), 4),
             "old_ms": round(ms(lambda q=q, md=md: old.attention(q, cache, md)), 4)}
        )  # fmt: skip
    # a prefill of `prefill` tokens in sequence 0's blocks; its token at `ctx - 1` again as a
    # decode (its context is the prefill's first `ctx` keys: the same K/V)
    md = build_varlen_metadata([prefill], [prefill], tables[:1], device=device, **geometry)
    q = q_all[:prefill]
    full = new.attention(q, cache, md)
    pre = {"tokens": prefill,
           "unified_ms": round(ms(lambda: new.attention(q, cache, md)), 4),
           "old_ms": round(ms(lambda: old.attention(q, cache, md)), 4)}  # fmt: skip
    invariant = True
    for b in (1, min(4, max_batch)):  # the token alone, and beside other decodes
        tb = tables[:1] + tables[1:b]
        mdd = build_varlen_metadata([1] * b, [ctx] * b, tb, device=device, **geometry)
        rows = torch.cat([q_all[ctx - 1 : ctx], q_all[:b][1:]])
        got = new.attention(rows, cache, mdd)[:1]
        invariant &= bool(torch.equal(got, full[ctx - 1 : ctx]))
    return {"decode": decode, "prefill": pre, "attention_invariant": invariant}


if __name__ == "__main__":
    raise SystemExit(main())
