"""`sluiceway bench roofline`: a workload's measured duration as a fraction of what this machine
allows (issue 33).

The limit, as issue 33 counts it::

    limit_s = FLOP / P + KV bytes / B        fraction = limit_s / measured duration

- FLOP (:func:`count_work`, from the model's config): each prompt token goes through every
  layer's linear weights (2 FLOP a weight); the LM head runs for the last prompt token of each
  request only (the first output token comes out of the prefill); each later output token is a
  decode token that goes through every linear weight, the LM head included. Attention's own
  FLOPs, the norms and the weight bytes are not counted.
- KV bytes: each decode step, each sequence reads its context's K and V (its own token's
  included): ``layers x 2 x kv_heads x head_dim x dtype bytes`` a context token (23,040 B in
  bfloat16 for SmolLM2-135M); a sliding-window layer reads its window at most.
- P (:func:`bench.machine_rates.measure_gemm`): the worker's own CPU GEMM (:func:`kernels.cpu_ops.bf16_linear` on a
  CPU with AVX512-BF16, else oneDNN's, as ``LlamaForCausalLM.pack_linear_weights`` picks it) at
  the model's linear shapes (qkv, o, gate_up, down, lm_head) and 1, 200 and 2,048 rows, each
  shape's FLOPs at its own measured rate. Prefill's layer FLOPs count at the 2,048-row rates
  (``--max-num-batched-tokens``' default: a full prefill step), decode's FLOPs and every LM head
  FLOP at the 200-row rates (the LM head runs on the rows that sample, one per sequence).
- B (:func:`bench.machine_rates.measure_bandwidth`): a streaming read (a float32 sum) over 8x the L3 cache.

With a finite request rate (W3) no server finishes before its last request arrives: the
output adds that floor (the last arrival plus the last request's own limit alone, its decode
at the 1-row rates) and the duration as a fraction of ``max(limit, floor)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sluiceway.argtypes import positive_int
from sluiceway.bench.machine_rates import (
    ROWS,
    GemmFigures,
    Machine,
    linear_shapes,
    measure_machine,
)

if TYPE_CHECKING:
    import torch

    from sluiceway.bench.metrics import RequestResult
    from sluiceway.worker.model_config import ModelConfig

PREFILL_ROWS = 2048  # a full prefill step (the default --max-num-batched-tokens)
DECODE_ROWS = 200  # W1's decode batch

# The workloads of docs/performance.md (scripts/bench_vs_vllm.sh's flags), 200 requests each.
WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {"dataset_name": "random", "input_len": 256, "output_len": 128, "rate": math.inf, "seed": 0},
    "W2": {"dataset_name": "sharegpt", "output_len": 128, "rate": math.inf, "seed": 0},
    "W3": {"dataset_name": "random", "input_len": 256, "output_len": 128, "rate": 4.0, "seed": 1},
}  # fmt: skip
NUM_PROMPTS = 200
ROOFLINE_HELP = (
    "measure this machine's GEMM rate P and memory bandwidth B, count W1-W3's FLOPs and K/V "
    "bytes from the model's config, print each limit (FLOP / P + bytes / B) and a measured "
    "duration as a fraction of it"
)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one context token holds over all layers:
    ``layers x 2 x kv_heads x head_dim x dtype_bytes`` (23,040 for SmolLM2-135M in bfloat16)."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype_bytes


def _sum_min(lo: int, hi: int, window: int | None) -> int:
    """``sum(min(c, window) for c in range(lo, hi + 1))`` in closed form (0 when hi < lo)."""
    if hi < lo:
        return 0
    if window is None or window >= hi:
        return (lo + hi) * (hi - lo + 1) // 2
    if window <= lo:
        return window * (hi - lo + 1)
    return (lo + window) * (window - lo + 1) // 2 + window * (hi - window)


@dataclass(frozen=True, slots=True)
class Work:
    """What a workload makes the machine do (:func:`count_work`): token counts, FLOPs, bytes."""

    requests: int
    prompt_tokens: int
    decode_tokens: int  # output tokens after each request's first
    prefill_layer_flops: int  # prompt tokens through the layers' linears
    prefill_lm_head_flops: int  # the LM head of each request's last prompt token
    decode_layer_flops: int
    decode_lm_head_flops: int
    kv_bytes: int  # K/V read by the decode steps

    @property
    def prefill_flops(self) -> int:
        return self.prefill_layer_flops + self.prefill_lm_head_flops

    @property
    def decode_flops(self) -> int:
        return self.decode_layer_flops + self.decode_lm_head_flops

    @property
    def flops(self) -> int:
        return self.prefill_flops + self.decode_flops


def count_work(
    config: ModelConfig, lengths: Sequence[tuple[int, int]], dtype_bytes: int = 2
) -> Work:
    """The work of requests of ``(prompt tokens, output tokens)`` (issue 33's counting).

    A request of prompt ``P`` and output ``O`` (``O`` >= 1) costs
    ``2 x P x layer_weights + 2 x V x H`` FLOP of prefill (the LM head for its last prompt token
    only) and ``2 x (O - 1) x (layer_weights + V x H)`` of decode; its decode steps read the K/V
    of contexts ``P + 1 .. P + O - 1`` tokens (each step's input token included), each layer
    at most its sliding window. A request with ``O`` = 0 (failed) costs nothing.
    """
    shapes = linear_shapes(config)
    layer_w = sum(s.weights for s in shapes if s.name != "lm_head")
    head_w = next(s.weights for s in shapes if s.name == "lm_head")
    per_layer = kv_bytes_per_token(config, dtype_bytes) // config.num_layers
    windows = Counter(config.layer_window(i) for i in range(config.num_layers))
    prompt = decode = requests = kv_tokens = 0
    for p, o in lengths:
        if o < 1:
            continue
        requests += 1
        prompt += p
        decode += o - 1
        kv_tokens += sum(n * _sum_min(p + 1, p + o - 1, w) for w, n in windows.items())
    return Work(
        requests=requests,
        prompt_tokens=prompt,
        decode_tokens=decode,
        prefill_layer_flops=2 * prompt * layer_w,
        prefill_lm_head_flops=2 * requests * head_w,
        decode_layer_flops=2 * decode * layer_w,
        decode_lm_head_flops=2 * decode * head_w,
        kv_bytes=kv_tokens * per_layer,
    )


@dataclass(frozen=True, slots=True)
class Limit:
    """A workload's limit (issue 33): ``limit_s = gemm_s + kv_s``."""

    prefill_s: float  # prefill FLOPs at the GEMM's rates
    decode_s: float
    kv_s: float  # K/V bytes / B

    @property
    def gemm_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def limit_s(self) -> float:
        return self.prefill_s + self.decode_s + self.kv_s


def limit_of(
    work: Work,
    config: ModelConfig,
    gemm: GemmFigures,
    bandwidth: float,
    *,
    prefill_rows: int = PREFILL_ROWS,
    decode_rows: int = DECODE_ROWS,
) -> Limit:
    """``FLOP / P + KV bytes / B``, each shape's FLOPs at its own measured rate: prefill's layer
    FLOPs at ``prefill_rows`` rows, its LM head and every decode FLOP at ``decode_rows``."""
    shapes = linear_shapes(config)
    layer = [s for s in shapes if s.name != "lm_head"]
    head = [s for s in shapes if s.name == "lm_head"]
    prefill_s = work.prompt_tokens * gemm.seconds_per_token(prefill_rows, layer)
    prefill_s += work.requests * gemm.seconds_per_token(decode_rows, head)
    decode_s = work.decode_tokens * gemm.seconds_per_token(decode_rows, shapes)
    return Limit(prefill_s, decode_s, work.kv_bytes / bandwidth)


def fraction(limit_s: float, measured_s: float) -> float:
    """The measured duration as a fraction of the limit: ``limit_s / measured_s`` (1.0: at the
    limit); NaN without a measured duration."""
    return limit_s / measured_s if measured_s > 0 else math.nan


@dataclass(slots=True)
class Run:
    """A workload run to hold against its limit: its requests' (prompt, output) tokens, its
    measured duration (None: not measured), when its last request was sent (seconds after the
    start; None: unknown) and where the token counts come from."""

    label: str
    lengths: list[tuple[int, int]]
    duration_s: float | None
    last_arrival_s: float | None = 0.0
    note: str = ""


def last_arrival_s(num: int, rate: float, burstiness: float, seed: int) -> float:
    """When `bench serve` sends the last of ``num`` requests, seconds after its start: the sum
    of its arrival intervals (:func:`bench.workload.request_intervals`; 0.0 at rate inf)."""
    from sluiceway.bench.workload import request_intervals

    return sum(request_intervals(num, rate, burstiness, seed))


def workload_run(
    name: str, model: str | None, duration_s: float | None, dataset_path: str | None = None
) -> Run:
    """W1, W2 or W3 (:data:`WORKLOADS`) as `bench serve` sends them with ``--ignore-eos``
    (every output its full 128 tokens); W2's prompts sampled from ShareGPT with ``model``'s
    tokenizer. Raises ValueError where the dataset cannot be read."""
    spec = WORKLOADS[name]
    if spec["dataset_name"] == "random":
        lengths = [(spec["input_len"], spec["output_len"])] * NUM_PROMPTS
        note = f"{spec['input_len']} -> {spec['output_len']} tokens each"
    else:
        from sluiceway.bench.workload import load_requests

        requests = load_requests(
            argparse.Namespace(
                model=model, dataset_name="sharegpt", dataset_path=dataset_path,
                num_prompts=NUM_PROMPTS, seed=spec["seed"],
                sharegpt_output_len=spec["output_len"], sharegpt_max_output_len=None,
            )
        )  # fmt: skip
        lengths = [(r.prompt_len, r.output_len) for r in requests]
        note = f"ShareGPT prompts (seed {spec['seed']}), {spec['output_len']} tokens each"
    arrival = last_arrival_s(NUM_PROMPTS, spec["rate"], 1.0, spec["seed"])
    rate = "all at once" if math.isinf(spec["rate"]) else f"{spec['rate']:g} req/s"
    return Run(name, lengths, duration_s, arrival, f"{note}, {rate}")


def _spread(total: int, n: int) -> list[int]:
    """``total`` split into ``n`` integers that differ by at most one."""
    q, r = divmod(total, n)
    return [q + (i < r) for i in range(n)]


def _fixed_output(args: dict[str, Any]) -> bool:
    """Whether a `bench serve` run's arguments make every output the same length."""
    if not args.get("ignore_eos"):
        return False
    if args.get("dataset_name") == "random":
        return float(args.get("random_range_ratio") or 0) == 0
    return bool(args.get("sharegpt_output_len"))


def _run_of(label: str, figures: dict[str, Any], args: dict[str, Any]) -> Run:
    """One run of a saved result: its figures (with ``requests``, or vLLM's ``input_lens`` and
    ``output_lens``, or token totals alone) and the arguments it ran with."""
    duration = figures.get("duration_s", figures.get("duration"))  # ours, vLLM's
    if duration is None:
        raise ValueError(f"{label}: no duration_s (nor vLLM's duration)")
    if figures.get("requests"):
        reqs = [r for r in figures["requests"] if r.get("ok", True)]
        lengths = [(int(r["prompt_len"]), int(r["output_len"])) for r in reqs]
        note = "per-request token counts"
    elif figures.get("input_lens") and figures.get("output_lens"):
        pairs = zip(figures["input_lens"], figures["output_lens"], strict=True)
        lengths = [(int(p), int(o)) for p, o in pairs if o]
        note = "per-request token counts"
    else:
        n = int(figures.get("successful_requests", figures.get("completed", 0)))
        if not n:
            raise ValueError(f"{label}: no successful request")
        prompts = _spread(int(figures["total_input_tokens"]), n)
        lengths = list(zip(prompts, _spread(int(figures["total_output_tokens"]), n), strict=True))
        note = "token totals" + (
            "" if _fixed_output(args) else " (K/V bytes as if every output had the mean length)"
        )
    rate = float(args.get("request_rate", figures.get("request_rate", "inf")))
    arrival: float | None = 0.0
    if not math.isinf(rate):
        arrival = None  # vLLM's arrivals come from its own generator
        if "seed" in args:
            num = int(args.get("num_prompts") or len(lengths))
            arrival = last_arrival_s(
                num, rate, float(args.get("burstiness", 1.0)), int(args["seed"])
            )
    return Run(label, lengths, float(duration), arrival, note)


def runs_from_json(path: pathlib.Path) -> list[Run]:
    """The runs of a saved result: `bench serve --save-result` (one), `bench compare
    --save-result` (one per configuration) or `vllm bench serve --save-result` (one).

    Raises:
        ValueError: the file cannot be read, or holds none of these.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--from-json {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--from-json {path}: not a benchmark result")
    args = data.get("args") or {}
    try:
        if "configurations" in data:
            return [
                _run_of(f"{path.stem}: {c['label']}", {**c["figures"], **c}, args)
                for c in data["configurations"]
            ]
        return [_run_of(path.stem, data, args)]
    except (KeyError, TypeError) as e:
        raise ValueError(f"--from-json {path}: not a benchmark result (no {e})") from None


def parse_durations(text: str | None, workloads: Sequence[str]) -> dict[str, float]:
    """``--duration-s``: one number (a single workload) or ``W1=S,W3=S`` -> seconds by name.

    Raises:
        ValueError: not that shape, a name not in ``workloads``, or a duration <= 0.
    """
    if not text:
        return {}
    out: dict[str, float] = {}
    try:
        if "=" not in text:
            if len(workloads) != 1:
                raise ValueError("one number needs one --workload")
            out[workloads[0]] = float(text)
        else:
            for item in text.split(","):
                name, value = (part.strip() for part in item.split("="))
                out[name.upper()] = float(value)
    except ValueError as e:
        raise ValueError(f"--duration-s {text!r}: {e} (e.g. 40.5, or W1=40.5,W3=57.5)") from None
    unknown = sorted(set(out) - set(workloads))
    if unknown or min(out.values()) <= 0:
        raise ValueError(
            f"--duration-s {text!r}: positive seconds of {', '.join(workloads)}"
            + (f"; not a workload here: {', '.join(unknown)}" if unknown else "")
        )
    return out


def evaluate(run: Run, config: ModelConfig, machine: Machine) -> dict[str, Any]:
    """``run``'s work, limit and fraction (a row of the table and of the JSON). With a finite
    rate it adds the arrival floor: the last arrival plus the last request's own limit alone
    (its prefill at the measured row count nearest below its prompt, its decode at 1 row)."""
    dtype_bytes = 4 if machine.dtype == "float32" else 2
    work = count_work(config, run.lengths, dtype_bytes)
    limit = limit_of(work, config, machine.gemm, machine.bandwidth)
    measured = run.duration_s
    row: dict[str, Any] = {
        "workload": run.label,
        "note": run.note,
        **asdict(work),
        "prefill_flops": work.prefill_flops,
        "decode_flops": work.decode_flops,
        "flops": work.flops,
        "p_prefill_flops_per_s": work.prefill_flops / limit.prefill_s if limit.prefill_s else 0.0,
        "p_decode_flops_per_s": work.decode_flops / limit.decode_s if limit.decode_s else 0.0,
        "bandwidth_bytes_per_s": machine.bandwidth,
        "gemm_s": limit.gemm_s,
        "kv_s": limit.kv_s,
        "limit_s": limit.limit_s,
        "measured_s": measured,
        "fraction": fraction(limit.limit_s, measured) if measured else None,
    }
    if run.last_arrival_s and run.lengths:
        last = count_work(config, run.lengths[-1:], dtype_bytes)
        rows = max([m for m in ROWS if m <= max(1, run.lengths[-1][0])], default=ROWS[0])
        alone = limit_of(last, config, machine.gemm, machine.bandwidth, prefill_rows=rows,
                         decode_rows=ROWS[0])  # fmt: skip
        floor = run.last_arrival_s + alone.limit_s
        row["last_arrival_s"] = run.last_arrival_s
        row["arrival_floor_s"] = floor
        row["fraction_of_bound"] = (
            fraction(max(limit.limit_s, floor), measured) if measured else None
        )
    return row


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def print_machine(machine: Machine, config: ModelConfig, model_id: str) -> None:
    """The model, the GEMM's rate per shape and row count, B and how P is applied."""
    c, g = config, machine.gemm
    print(
        f"{model_id}: {c.num_layers} layers, hidden {c.hidden_size}, FFN {c.intermediate_size}, "
        f"{c.num_heads}/{c.num_kv_heads} heads of {c.head_dim}, vocabulary {c.vocab_size:,}; "
        f"{machine.dtype}, {machine.threads} threads, {machine.cpu}"
    )
    shapes = linear_shapes(config)
    layer = [s for s in shapes if s.name != "lm_head"]

    def gflops(x: float) -> str:
        return f"{x / 1e9:.0f}" if x >= 1e10 else f"{x / 1e9:.2f}"

    body = []
    for m, secs in g.seconds.items():
        cells = [gflops(g.flops_per_s(m, s)) if s.name in secs else "-" for s in shapes]
        for group, ok in ((layer, True), (shapes, "lm_head" in secs)):
            flops = sum(2 * s.weights for s in group)  # a token's
            cells.append(gflops(flops / g.seconds_per_token(m, group)) if ok else "-")
        body.append([f"{m:,}", *cells])
    print(
        f"P: {g.kernel}, GFLOPS (best of {machine.reps}; the layers' weights cycled over "
        f"{g.copies} copies, {g.copies_bytes / 1e6:.0f} MB; L3 {machine.l3_bytes / 2**20:.0f} MiB;"
        " the LM head only where it runs, on up to 200 rows)"
    )
    header = ["rows", *(s.name for s in shapes), "layers", "all (a token's mix)"]
    print(_table(header, body))
    print(
        f"B: streaming read of {machine.buffer_bytes / 2**20:.0f} MiB (8 x L3), best of "
        f"{max(5, machine.reps)}: {machine.bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"limit = FLOP / P + K/V bytes / B (issue 33): prefill's layer FLOPs at the "
        f"{PREFILL_ROWS:,}-row rates, decode's and the LM head's at the {DECODE_ROWS}-row "
        "rates, each shape at its own; weight bytes and attention FLOPs not counted"
    )


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    """The workloads' table, then a line per workload: its arrival floor and its note."""
    header = ["workload", "requests", "prompt tok", "decode tok", "prefill TFLOP",
              "decode TFLOP", "K/V GB", "P prefill TFLOPS", "P decode TFLOPS", "GEMM s",
              "K/V s", "limit s", "measured s", "limit / measured"]  # fmt: skip
    body = [
        [r["workload"], f"{r['requests']:,}", f"{r['prompt_tokens']:,}", f"{r['decode_tokens']:,}",
         f"{r['prefill_flops'] / 1e12:.2f}", f"{r['decode_flops'] / 1e12:.2f}",
         f"{r['kv_bytes'] / 1e9:.1f}", f"{r['p_prefill_flops_per_s'] / 1e12:.2f}",
         f"{r['p_decode_flops_per_s'] / 1e12:.2f}", f"{r['gemm_s']:.2f}", f"{r['kv_s']:.2f}",
         f"{r['limit_s']:.2f}", "-" if r["measured_s"] is None else f"{r['measured_s']:.2f}",
         "-" if r["fraction"] is None else f"{r['fraction']:.2f}"]
        for r in rows
    ]  # fmt: skip
    print(_table(header, body))
    for r in rows:
        line = f"{r['workload']}: {r['note']}"
        if "arrival_floor_s" in r:
            line += (
                f"; the last request is sent at {r['last_arrival_s']:.1f} s: no run ends before "
                f"{r['arrival_floor_s']:.1f} s (that plus its own limit alone)"
            )
            if r["fraction_of_bound"] is not None:
                line += f", max(limit, that) / measured = {r['fraction_of_bound']:.2f}"
        print(line)


def model_config(model: str | None) -> tuple[ModelConfig, str]:
    """The config of ``model`` (a folder or GGUF; None: the embedded one) and its name."""
    from sluiceway.model_files import resolve_model
    from sluiceway.worker.loader import load_config

    model_dir = resolve_model(model)
    return load_config(model_dir), model_dir.name


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return torch.float32 if name == "float32" else torch.bfloat16


def _write_json(path: str, machine: Machine, model_id: str, rows: list[dict[str, Any]]) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": model_id, "machine": asdict(machine), "workloads": rows}
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")


def roofline_command(args: argparse.Namespace) -> int:
    """`bench roofline`: measures P and B, counts each workload's work, prints its limit and
    the measured duration as a fraction of it (`--duration-s`, `--from-json`); `--json`
    writes every figure. Returns 2 (the reason on stderr) for arguments or files it cannot
    use."""
    import torch

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    try:
        config, model_id = model_config(args.model)
        if args.from_json:
            runs = [run for path in args.from_json for run in runs_from_json(pathlib.Path(path))]
        else:
            durations = parse_durations(args.duration_s, names)
            runs = [workload_run(n, args.model, durations.get(n), args.dataset_path) for n in names]
    except (ValueError, OSError) as e:
        print(f"sluiceway bench roofline: {e}", file=sys.stderr)
        return 2
    machine = measure_machine(config, _torch_dtype(args.dtype), args.reps)
    print_machine(machine, config, model_id)
    rows = [evaluate(run, config, machine) for run in runs]
    print_rows(rows)
    if args.json:
        _write_json(args.json, machine, model_id, rows)
    return 0


def roofline_of_results(
    args: argparse.Namespace, runs: Sequence[tuple[str, Sequence[RequestResult], float]]
) -> list[dict[str, Any]]:
    """`bench serve|compare --roofline`: after the runs of (label, results, duration seconds),
    measures P and B here in bfloat16 on every core (the worker's defaults; a few seconds:
    the server must be on this machine) and prints each run's duration as a fraction of the
    limit of its own successful requests' token counts; returns the rows."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    config, model_id = model_config(args.model)
    machine = measure_machine(config, torch.bfloat16)
    rows = []
    for label, results, duration_s in runs:
        arrival = last_arrival_s(len(results), args.request_rate, args.burstiness, args.seed)
        lengths = [(r.prompt_len, r.output_len) for r in results if r.ok]
        run = Run(label, lengths, duration_s, arrival, "per-request token counts")
        rows.append(evaluate(run, config, machine))
    print(f"{'=' * 22} Roofline {'=' * 22}")
    print_machine(machine, config, model_id)
    print_rows(rows)
    return rows


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="model folder or GGUF whose config counts (default: embedded)"
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the GEMM's dtype and the K/V's (the worker's kernel for it)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: every core, as the worker's --num-threads)",
    )
    p.add_argument(
        "--workload",
        choices=[*WORKLOADS, "all"],
        default="all",
        help="W1: 200 x random 256 -> 128 tokens all at once; W2: 200 ShareGPT prompts -> 128 "
        "tokens all at once; W3: W1 at 4 req/s (seed 1); all with --ignore-eos",
    )
    p.add_argument(
        "--duration-s",
        default=None,
        metavar="S|W1=S,...",
        help="measured durations, seconds: one number for one --workload, or W1=40.5,W3=57.5 "
        "(default: none, the limits alone)",
    )
    p.add_argument(
        "--from-json",
        action="append",
        default=[],
        metavar="PATH",
        help="a `bench serve`/`bench compare` --save-result JSON (or vLLM's): its durations "
        "and token counts instead of --workload (repeatable; default: none)",
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON of W2 (default: packaged)")
    p.add_argument("--reps", type=positive_int, default=3, help="timed passes of each GEMM")
    p.add_argument(
        "--json", default=None, metavar="PATH", help="write every figure as JSON (default: none)"
    )
