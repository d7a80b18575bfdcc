"""TTFT of a short request sent just after a long prompt, on a `sluiceway serve` stack.

    python scripts/long_prefill_ttft.py [--long-tokens 4000] [-- serve flags...]

Starts `sluiceway serve` with the flags after `--`, sends a prompt of `--long-tokens`
token ids (max_tokens 1), 0.5 s later a 20-token prompt (max_tokens 4), and prints the
time to first token of each, seconds from its own send. Stops the stack.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from sluiceway.client import Client, wait_until_serving
from sluiceway.ports import free_port


def first_token_s(client: Client, ids: list[int], max_tokens: int, out: dict[str, float],
                  name: str) -> None:  # fmt: skip
    t0 = time.monotonic()
    req = Client.request(prompt_token_ids=ids, temperature=0, max_tokens=max_tokens,
                         ignore_eos=True)  # fmt: skip
    for response in client.generate_stream(req, timeout=600):
        if response.token_ids and name not in out:
            out[name] = time.monotonic() - t0
    out[name + "_e2e"] = time.monotonic() - t0


def main() -> int:
    argv = sys.argv[1:]
    serve_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser()
    p.add_argument("--long-tokens", type=int, default=4000)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    port = free_port()
    cmd = [sys.executable, "-m", "sluiceway.cli", "serve", "--port", str(port),
           "--kv-cache-memory", "1GiB", "--metrics-port", "0", "--http-port", "0",
           *serve_flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        wait_until_serving(f"127.0.0.1:{port}", 300)
        out: dict[str, float] = {}
        with Client(f"127.0.0.1:{port}") as client:
            client.generate(Client.request(prompt_token_ids=[5, 6, 7], max_tokens=2), 60)
            long_ids = [100 + (i * 7919) % 40000 for i in range(args.long_tokens)]
            short_ids = [45000 + i for i in range(20)]
            t_long = threading.Thread(target=first_token_s, args=(client, long_ids, 1, out, "long"))
            t_long.start()
            time.sleep(0.5)
            first_token_s(client, short_ids, 4, out, "short")
            t_long.join()
        print(f"serve flags: {' '.join(serve_flags) or '(defaults)'}")
        print(f"long prompt {args.long_tokens} tokens: TTFT {out['long']:.1f} s")
        print(f"short prompt 20 tokens sent 0.5 s later: TTFT {out['short']:.1f} s, "
              f"E2E (4 tokens) {out['short_e2e']:.1f} s")  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
