"""Splits each request's decoding time into the steps it waited on, for two configurations of
one `bench compare` run, request by request (the same prompt, the same tokens in both).

A request's decoding is the steps from the one after its first token to the one that emitted
its last (its E2E less TTFT, as the server saw it: client and router time not counted). Each
such step is one of three kinds: a step with prompt rows (another request's prefill chunk: a
stall the request waits out), a speculating step, or a plain decode step. For each request the
script adds the steps' worker time per kind, then prints, over the requests, the quantiles of
configuration B's time over A's (all steps, and without the prompt steps: the request's own
decoding), the quantiles of B's prompt-step time less A's, the totals, and the requests B
slowed most, kind by kind.

Needs the servers' logs of the run, JSON lines at debug level (the scheduler's `request_added`
and `step` events):

    sluiceway bench compare ... --speculative-config JSON --server-log-dir LOGS \\
        --serve-args "--log-level debug --log-format json" --save-result RUN.json
    python scripts/step_attribution.py RUN.json LOGS     # A: continuous, B: continuous + spec

scripts/bench_spec.sh runs it after each pair.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from dataclasses import dataclass, field

from sluiceway.bench.compare import server_log_path

KINDS = ("prompt", "spec", "plain")


@dataclass
class Decoding:
    """One request's decoding steps: worker ms and step count per kind."""

    ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    @property
    def own_ms(self) -> float:
        """Without the steps that computed another request's prompt."""
        return self.ms["spec"] + self.ms["plain"]


def read_log(path: pathlib.Path) -> tuple[dict[str, int], list[dict]]:
    """The scheduler's request_id -> seq_id and its `step` events in step order, from a
    server's JSON-lines log (other lines skipped). Raises SystemExit when it has no step."""
    seq_of: dict[str, int] = {}
    steps = []
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        event = json.loads(line)
        if event.get("event") == "request_added" and "seq_id" in event:
            seq_of[event["request_id"]] = event["seq_id"]
        elif event.get("event") == "step" and "step_id" in event:
            steps.append(event)
    if not steps:
        sys.exit(
            f"{path}: no `step` events (run the server with --log-level debug --log-format json)"
        )
    return seq_of, sorted(steps, key=lambda e: e["step_id"])


def decodings(steps: list[dict]) -> dict[int, Decoding]:
    """Each sequence's decoding (see the module docstring), by seq_id."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, step in enumerate(steps):
        for seq_id, emitted in zip(step["seq_ids"], step["emitted"], strict=True):
            if emitted:
                first.setdefault(seq_id, i)
                last[seq_id] = i
    out = {}
    for seq_id, start in first.items():
        d = Decoding()
        for step in steps[start + 1 : last[seq_id] + 1]:
            kind = "prompt" if step["prompt_rows"] else "spec" if step["speculating"] else "plain"
            d.ms[kind] += step["ms"]
            d.steps[kind] += 1
        out[seq_id] = d
    return out


def quantiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return f"P10 {q[9]:.2f}, P50 {q[49]:.2f}, P90 {q[89]:.2f}, P99 {q[98]:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=pathlib.Path, help="bench compare --save-result JSON")
    parser.add_argument("log_dir", type=pathlib.Path, help="bench compare --server-log-dir")
    parser.add_argument("--a", default="continuous", help="the reference configuration")
    parser.add_argument("--b", default="continuous + spec", help="the configuration compared")
    parser.add_argument("--worst", type=int, default=8, help="requests listed (default 8)")
    args = parser.parse_args(argv)
    runs = {
        c["label"]: c["requests"] for c in json.loads(args.result.read_text())["configurations"]
    }
    per_config = {}
    for label in (args.a, args.b):
        seq_of, steps = read_log(server_log_path(args.log_dir, label))
        by_seq = decodings(steps)
        per_config[label] = [
            by_seq.get(seq_of.get(r.get("request_id", ""), -1)) if r["ok"] else None
            for r in runs[label]
        ]
    rows = [
        (i, a, b)
        for i, (a, b) in enumerate(zip(per_config[args.a], per_config[args.b], strict=True))
        if a is not None and b is not None and a.total_ms > 0 and b.total_ms > 0
    ]
    if len(rows) < 2:
        sys.exit("fewer than 2 requests decoded more than one token in both runs")
    own = [b.own_ms / a.own_ms for _, a, b in rows if a.own_ms > 0]
    stall = [b.ms["prompt"] - a.ms["prompt"] for _, a, b in rows]
    deciles = statistics.quantiles(stall, n=10, method="inclusive")
    print(f"{len(rows)} requests with 2+ tokens; {args.b} over {args.a}, per request:")
    print(f"  decoding steps' time: {quantiles([b.total_ms / a.total_ms for _, a, b in rows])}")
    print(f"  without other prompts' steps: {quantiles(own)}")
    print(
        "  other prompts' steps waited out, ms more: "
        + ", ".join(f"P{10 * (i + 1)} {deciles[i]:.0f}" for i in (0, 4, 8))
    )
    for label, side in ((args.a, [a for _, a, _ in rows]), (args.b, [b for _, _, b in rows])):
        totals = {k: sum(d.ms[k] for d in side) / 1e3 for k in KINDS}
        print(f"  {label}: " + ", ".join(f"{k} steps {v:.1f} s" for k, v in totals.items()))
    print(f"slowest in {args.b} (ms (steps) of prompt / spec / plain steps, A -> B):")
    rows.sort(key=lambda r: r[1].total_ms / r[2].total_ms)
    for i, a, b in rows[: args.worst]:
        cells = " / ".join(
            f"{a.ms[k]:.0f} ({a.steps[k]}) -> {b.ms[k]:.0f} ({b.steps[k]})" for k in KINDS
        )
        print(
            f"  request {i} ({runs[args.a][i]['output_len']} tokens) {b.total_ms / a.total_ms:.2f}x: {cells}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
