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
    .venv/bin/python scripts/step_attribution.py RUN.json LOGS   # A: continuous, B: ... + spec

scripts/bench_spec.sh runs it after each pair.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from dataclasses import dataclass, field

from sluiceway.argtypes import positive_int
from sluiceway.bench.compare import match_label, server_log_path

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
        try:
            event = json.loads(line) if line.startswith("{") else None
        except ValueError:
            event = None  # (a console line, or one cut short)
        if not isinstance(event, dict):
            continue
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


def read_result(path: pathlib.Path) -> dict[str, list[dict]]:
    """Each configuration's per-request records of a `bench compare --save-result` JSON, by
    label. Raises SystemExit (a message) for a file that is not one."""
    try:
        configurations = json.loads(path.read_text())["configurations"]
        return {c["label"]: c["requests"] for c in configurations}
    except OSError as e:
        sys.exit(f"{path}: {e.strerror}")
    except (ValueError, KeyError, TypeError):
        sys.exit(f"{path}: not a `bench compare --save-result` JSON (configurations, requests)")


def per_request(records: list[dict], log: pathlib.Path) -> tuple[list[Decoding | None], int]:
    """Each request's decoding from the server's log (None: failed, or one token), and how
    many of the records the log names. Raises SystemExit when it names none."""
    try:
        seq_of, steps = read_log(log)
    except OSError as e:
        sys.exit(f"{log}: {e.strerror} (bench compare --server-log-dir's directory?)")
    by_seq = decodings(steps)
    named = [seq_of.get(r.get("request_id", "")) for r in records]
    if not any(seq_id is not None for seq_id in named):
        sys.exit(
            f"{log}: names none of the result's requests (a result saved before requests "
            "carried their request_id, or the logs of another run)"
        )
    out = [
        by_seq.get(seq_id) if seq_id is not None and r.get("ok") else None
        for r, seq_id in zip(records, named, strict=True)
    ]
    return out, sum(seq_id is not None for seq_id in named)


def pick(labels: list[str], wanted: str, flag: str) -> str:
    label = match_label(labels, wanted)
    if label is None:
        sys.exit(f"{flag} {wanted!r}: not one of the result's configurations {labels}")
    return label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=pathlib.Path, help="bench compare --save-result JSON")
    parser.add_argument("log_dir", type=pathlib.Path, help="bench compare --server-log-dir")
    parser.add_argument(
        "--a", default="continuous", help="the reference configuration (a label or its start)"
    )
    parser.add_argument("--b", default="continuous + spec", help="the configuration compared")
    parser.add_argument("--worst", type=positive_int, default=8, help="requests listed (8)")
    args = parser.parse_args(argv)
    runs = read_result(args.result)
    a_label, b_label = (pick(list(runs), w, f) for w, f in ((args.a, "--a"), (args.b, "--b")))
    if a_label == b_label:
        sys.exit(f"--a and --b name the same configuration, {a_label!r}")
    if len(runs[a_label]) != len(runs[b_label]):
        sys.exit(f"{a_label!r} and {b_label!r} ran different requests (not one bench compare)")
    (a_runs, a_named), (b_runs, b_named) = (
        per_request(runs[label], server_log_path(args.log_dir, label))
        for label in (a_label, b_label)
    )
    rows = [
        (i, a, b)
        for i, (a, b) in enumerate(zip(a_runs, b_runs, strict=True))
        if a is not None and b is not None and a.total_ms > 0 and b.total_ms > 0
    ]
    if len(rows) < 2:
        sys.exit("fewer than 2 requests decoded more than one token in both runs")
    report(rows, runs[a_label], a_label, b_label, args.worst)
    print(
        f"({len(runs[a_label]) - len(rows)} of {len(runs[a_label])} requests left out: failed, "
        f"one token, or not named in a log ({a_named} and {b_named} named))"
    )
    return 0


def report(
    rows: list[tuple[int, Decoding, Decoding]],
    records: list[dict],
    a_label: str,
    b_label: str,
    worst: int,
) -> None:
    """Prints the quantiles, the totals and the `worst` requests B slowed most."""
    own = [b.own_ms / a.own_ms for _, a, b in rows if a.own_ms > 0]
    stall = [b.ms["prompt"] - a.ms["prompt"] for _, a, b in rows]
    deciles = statistics.quantiles(stall, n=10, method="inclusive")
    print(f"{len(rows)} requests with 2+ tokens; {b_label} over {a_label}, per request:")
    print(f"  decoding steps' time: {quantiles([b.total_ms / a.total_ms for _, a, b in rows])}")
    print(f"  without other prompts' steps: {quantiles(own)}")
    print(
        "  other prompts' steps waited out, ms more: "
        + ", ".join(f"P{10 * (i + 1)} {deciles[i]:.0f}" for i in (0, 4, 8))
    )
    print("  totals (a step counted once per request that waited on it):")
    for label, side in ((a_label, [a for _, a, _ in rows]), (b_label, [b for _, _, b in rows])):
        totals = {k: sum(d.ms[k] for d in side) / 1e3 for k in KINDS}
        print(f"    {label}: " + ", ".join(f"{k} steps {v:.1f} s" for k, v in totals.items()))
    print(f"slowest in {b_label} (ms (steps) of prompt / spec / plain steps, A -> B):")
    for i, a, b in sorted(rows, key=lambda r: r[1].total_ms / r[2].total_ms)[:worst]:
        cells = " / ".join(
            f"{a.ms[k]:.0f} ({a.steps[k]}) -> {b.ms[k]:.0f} ({b.steps[k]})" for k in KINDS
        )
        print(
            f"  request {i} ({records[i]['output_len']} tokens) "
            f"{b.total_ms / a.total_ms:.2f}x: {cells}"
        )


if __name__ == "__main__":
    sys.exit(main())
