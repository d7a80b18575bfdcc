"""Prefix-cache hit rate per replica for a multi-turn chat workload over two replicas.

    python scripts/multiturn_routing.py [--conversations 16] [--turns 6] [--max-tokens 48] [-- serve flags...]

Starts `sluiceway serve --num-replicas 2` (the code of the current directory), then:
20 distinct one-turn chat requests one after another (prompt tokens per replica show
how they spread), then `--conversations` conversations at once, each `--turns` turns
one after another (each turn's prompt holds the earlier turns and answers). Prints, per
replica, prompt tokens and prefix-cache hits (tokens) of the multi-turn phase and its hit
rate. Stops the stack.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from sluiceway.client import Client, wait_until_serving
from sluiceway.ports import free_port

TOPICS = ["volcanoes", "glaciers", "comets", "bees", "tides", "deserts", "coral reefs",
          "bridges", "lighthouses", "violins", "chess", "sourdough", "rainbows", "owls",
          "canals", "windmills", "tea", "submarines", "origami", "auroras"]  # fmt: skip
FOLLOW_UPS = ["Why is that?", "Give an example.", "What else should I know?",
              "Summarize it in one line.", "Who studies this?"]  # fmt: skip


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(r.rsplit(" ", 1)[1]) for r in text.splitlines() if r.startswith(name + "{"))


def cache_counters(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    return {
        name: (
            metric(urls[name], "sluiceway:prefix_cache_queries_total"),
            metric(urls[name], "sluiceway:prefix_cache_hits_total"),
        )
        for name in ("scheduler-0", "scheduler-1")
    }


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=48, help="per answer (EOS ignored)")
    args = p.parse_args(argv[:cut])
    port = free_port()
    cmd = [sys.executable, "-m", "sluiceway.cli", "serve", "--port", str(port),
           "--num-replicas", "2", "--kv-cache-memory", "1GiB", "--metrics-port", "0",
           "--http-port", "0", "--log-format", "console", *argv[cut + 1 :]]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout or ()), daemon=True).start()
    target = f"127.0.0.1:{port}"
    try:
        wait_until_serving(target, 300)
        while not (lines := [line for line in list(log) if "metrics:" in line]):
            time.sleep(0.1)
        urls = dict(re.findall(r"([\w-]+) (http://\S+/metrics)", lines[0]))
        while metric(urls["router"], "sluiceway:router_scheduler_ready") < 2:
            time.sleep(0.2)
        with Client(target) as client:
            start = cache_counters(urls)
            for topic in TOPICS:
                msg = f"{topic.capitalize()}: write two sentences about {topic}."
                req = Client.request(messages=[("user", msg)], temperature=0, max_tokens=4)
                client.generate(req, timeout=300)
            mid = cache_counters(urls)

            def converse(c: int) -> None:
                messages: list[tuple[str, str]] = []
                for t in range(args.turns):
                    turn = f"Tell me about {TOPICS[c % len(TOPICS)]}." if t == 0 else (
                        FOLLOW_UPS[(c + t) % len(FOLLOW_UPS)])  # fmt: skip
                    messages.append(("user", turn))
                    req = Client.request(
                        messages=messages,
                        temperature=0,
                        max_tokens=args.max_tokens,
                        ignore_eos=True,
                    )
                    text, _, _ = client.generate(req, timeout=600)
                    messages.append(("assistant", text))

            t0 = time.monotonic()
            with ThreadPoolExecutor(args.conversations) as pool:
                list(pool.map(converse, range(args.conversations)))
            wall = time.monotonic() - t0
            end = cache_counters(urls)
        print(f"serve flags: {' '.join(argv[cut + 1 :]) or '(defaults)'}")
        print("20 distinct chat requests, prompt tokens per replica: "
              + ", ".join(f"{k} {mid[k][0] - start[k][0]:.0f}" for k in mid))  # fmt: skip
        print(f"{args.conversations} conversations x {args.turns} turns, {wall:.1f} s:")
        total_q = total_h = 0.0
        for k in end:
            q, h = end[k][0] - mid[k][0], end[k][1] - mid[k][1]
            total_q, total_h = total_q + q, total_h + h
            rate = h / q if q else 0.0
            print(f"  {k}: prompt tokens {q:.0f}, prefix-cache hits {h:.0f} ({rate:.1%})")
        print(f"  both: {total_h / total_q:.1%}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
