"""Throughput and TTFT of parallel sampling (`n` > 1) on a `sluiceway serve` stack.

    python scripts/parallel_sampling_probe.py [--n 4] [--num-requests 32] [--max-tokens 64]
        [--label NAME] [--out RESULTS.jsonl] [-- serve flags...]

Starts `sluiceway serve` with the flags after `--` from the code on PYTHONPATH (so two
checkouts compare by running it with each on PYTHONPATH, alternating), takes the first
`--num-requests` ShareGPT first turns of 200-600 tokens, sends them all at once as seeded
requests of `--n` samples (temperature 1, `--max-tokens` each, EOS ignored), and prints one
JSON line (appended to `--out` when given): output tokens/s over the run; TTFT of a request
(its first sample's first token: req_ttft_*) and of each sample (sample_ttft_*), seconds
from the send; the scheduler's prefix-cache counters over the run (tokens); the CPU seconds
each process of the stack used (worker_cpu_s, ...), which a busy shared machine disturbs
less than the wall-clock figures; and the 1-minute load average at the end. Stops the stack.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from sluiceway.client import Client, wait_until_serving
from sluiceway.launcher import free_port
from sluiceway.sharegpt import load_conversations
from sluiceway.v1 import inference_pb2

COUNTERS = ("sluiceway:prefix_cache_queries_total", "sluiceway:prefix_cache_hits_total")


def child_cpu_s(parent: int) -> dict[str, float]:
    """CPU seconds (user + system) of each `sluiceway.cli` child of `parent`, by its command
    (worker, scheduler, router); Linux /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as f:
                argv = f.read().split("\0")
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == parent and "sluiceway.cli" in argv:
            role = argv[argv.index("sluiceway.cli") + 1]
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def scheduler_counter(url: str, name: str) -> float:
    """The sum of every sample of counter `name` at the /metrics `url`."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M))


def sharegpt_prompts(client: Client, count: int) -> list[list[int]]:
    """Token ids of the first `count` ShareGPT first human turns of 200-600 tokens."""
    prompts: list[list[int]] = []
    for conv in load_conversations()[1]:
        if conv[0].get("from") != "human":
            continue
        reply = client.stub.Tokenize(inference_pb2.TokenizeRequest(prompt=conv[0]["value"]))
        if 200 <= len(reply.token_ids) <= 600:
            prompts.append(list(reply.token_ids))
            if len(prompts) == count:
                break
    return prompts


def one_request(
    client: Client, ids: list[int], seed: int, n: int, max_tokens: int
) -> tuple[float, list[float], int]:
    """(request TTFT, every sample's TTFT, tokens received), seconds from the send."""
    req = Client.request(prompt_token_ids=ids, temperature=1.0, seed=seed,
                         max_tokens=max_tokens, ignore_eos=True, n=n)  # fmt: skip
    t0 = time.perf_counter()
    first: dict[int, float] = {}
    tokens = 0
    for response in client.generate_stream(req, timeout=1800):
        if response.token_ids and response.index not in first:
            first[response.index] = time.perf_counter() - t0
        tokens += len(response.token_ids)
    return min(first.values()), list(first.values()), tokens


def main() -> int:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "sluiceway.cli", "serve", "--port", str(port),
           "--metrics-port", str(metrics_port), "--http-port", "-1", "--log-level", "warning",
           *serve_flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    metrics_url = f"http://127.0.0.1:{metrics_port + 1}/metrics"  # the scheduler's
    try:
        wait_until_serving(f"127.0.0.1:{port}", 300, "sluiceway.v1.Inference")
        with Client(f"127.0.0.1:{port}") as client:
            prompts = sharegpt_prompts(client, args.num_requests)
            warm = Client.request(prompt_token_ids=list(range(1000, 1100)), max_tokens=4, n=2)
            client.generate_samples(warm, timeout=600)
            before = {m: scheduler_counter(metrics_url, m) for m in COUNTERS}
            cpu0 = child_cpu_s(proc.pid)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                results = list(pool.map(
                    lambda i: one_request(client, prompts[i], 100 + i, args.n, args.max_tokens),
                    range(len(prompts)),
                ))  # fmt: skip
            wall = time.perf_counter() - t0
            cpu1 = child_cpu_s(proc.pid)
            after = {m: scheduler_counter(metrics_url, m) for m in COUNTERS}
        request_ttft = [r[0] for r in results]
        sample_ttft = sorted(t for r in results for t in r[1])
        output_tokens = sum(r[2] for r in results)
        row = {
            "label": args.label, "n": args.n, "num_requests": len(prompts),
            "max_tokens": args.max_tokens, "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": output_tokens, "wall_s": wall, "output_tok_s": output_tokens / wall,
            "req_ttft_mean": statistics.mean(request_ttft),
            "req_ttft_p50": statistics.median(request_ttft),
            "sample_ttft_mean": statistics.mean(sample_ttft),
            "sample_ttft_p50": statistics.median(sample_ttft),
            "sample_ttft_p99": sample_ttft[int(0.99 * (len(sample_ttft) - 1))],
            **{m.split(":")[1]: after[m] - before[m] for m in COUNTERS},
            **{f"{role}_cpu_s": cpu1[role] - cpu0.get(role, 0.0) for role in cpu1},
            "loadavg": os.getloadavg()[0],
        }  # fmt: skip
        print(json.dumps(row))
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
