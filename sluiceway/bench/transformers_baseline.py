"""The baseline users would write themselves: `transformers` batched `generate`.

Static batching as an HF-based server does it: requests queue in arrival
order; whenever the model is idle, up to `batch_size` queued requests are
left-padded into one batch and run to the longest output of the batch, then
all of them return together. Same weights (the model folder the server
loads), same dtype resolution, same prompts and output lengths, greedy.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from typing import Any

from sluiceway.bench.metrics import RequestResult, summarize
from sluiceway.bench.serve import BenchRun
from sluiceway.sharegpt import SampledRequest


class _StepClock:
    """A `generate` streamer that only timestamps each decoding step.

    `generate` hands the prompt to `put` first, then each step's new tokens.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: object) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def kv_slots(prompt_lens: list[int], output_lens: list[int]) -> tuple[int, int]:
    """(tokens stored, slots allocated) of one static batch, summed over its forwards.

    `generate`'s cache holds `max(prompt_lens) + s` positions per row after
    forward s (s = 0 is the prefill; the batch runs `max(output_lens)`
    forwards). A row stores useful tokens (its own prompt plus the `s` tokens
    generated so far) only while it is live (`s < output_len`); padding and
    the rows already done are waste. The same measure as the scheduler's
    `kv_cache_utilization`.
    """
    width = max(prompt_lens)
    stored = slots = 0
    for s in range(max(output_lens)):
        slots += len(prompt_lens) * (width + s)
        stored += sum(p + s for p, o in zip(prompt_lens, output_lens, strict=True) if s < o)
    return stored, slots


def run_transformers(
    requests: list[SampledRequest],
    intervals: list[float],
    *,
    model: str | None,
    batch_size: int,
    ignore_eos: bool,
    dtype: str = "auto",
    num_threads: int | None = None,
) -> BenchRun:
    """Runs the workload through `AutoModelForCausalLM.generate` in static batches.

    Timings of request i count from its arrival (the cumulative sum of
    `intervals`): TTFT and ITL from the step timestamps of its batch (what a
    streaming HF server would give), E2E when `generate` returns the batch.
    KV memory utilization follows :func:`kv_slots`.

    Raises:
        sluiceway.model_files.ModelFilesError: `model` is not a model.
        ValueError: batch_size < 1.
    """
    import torch
    from tqdm import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    torch.set_num_threads(num_threads or os.cpu_count() or 1)
    hf_model, prompts, eos_ids, pad_id = _load(requests, model, dtype, ignore_eos)
    results: list[RequestResult | None] = [None] * len(requests)
    arrivals, at = [], 0.0
    for wait_s in intervals:
        at += wait_s
        arrivals.append(at)
    queue: deque[int] = deque()
    next_arrival = 0
    stored_total = slots_total = 0
    progress = tqdm(total=len(requests), desc="transformers", unit="req")
    t0 = time.perf_counter()
    while next_arrival < len(requests) or queue:
        now = time.perf_counter() - t0
        while next_arrival < len(requests) and arrivals[next_arrival] <= now:
            queue.append(next_arrival)
            next_arrival += 1
        if not queue:
            time.sleep(arrivals[next_arrival] - now)
            continue
        batch = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        done = _run_batch(
            hf_model,
            [requests[i] for i in batch],
            [prompts[i] for i in batch],
            [t0 + arrivals[i] for i in batch],
            pad_id=pad_id,
            eos_ids=eos_ids,
            ignore_eos=ignore_eos,
        )
        for i, result in zip(batch, done, strict=True):
            results[i] = result
        stored, slots = kv_slots([r.prompt_len for r in done], [r.output_len for r in done])
        stored_total, slots_total = stored_total + stored, slots_total + slots
        progress.update(len(batch))
    duration = time.perf_counter() - t0
    progress.close()
    finished = [r for r in results if r is not None]
    figures = summarize(finished, duration)
    figures["kv_cache_utilization_pct"] = 100 * stored_total / slots_total if slots_total else 0.0
    figures["prefix_cache_hit_rate_pct"] = 0.0
    figures["num_preemptions"] = 0
    figures["spec_decode_acceptance_rate_pct"] = 0.0
    figures["spec_decode_mean_acceptance_length"] = 0.0
    return BenchRun(finished, figures, [])


def _load(
    requests: list[SampledRequest], model: str | None, dtype: str, ignore_eos: bool
) -> tuple[Any, list[list[int]], set[int], int]:
    """The HF model (after one warm-up `generate`, as the server's first request), each
    request's prompt token ids, the EOS ids that end an output (none with `ignore_eos`) and
    the padding id.

    Raises:
        sluiceway.model_files.ModelFilesError: `model` is not a model.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from sluiceway.model_files import resolve_model
    from sluiceway.router.request_path import eos_token_ids
    from sluiceway.router.tokenizer import encode_prompt, load_tokenizer
    from sluiceway.worker.model_setup import resolve_dtype

    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    eos_ids = set() if ignore_eos else set(eos_token_ids(tokenizer, model_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [
        list(r.prompt_token_ids) if r.prompt_token_ids else encode_prompt(tokenizer, r.prompt)
        for r in requests
    ]

    with torch.inference_mode():  # warm-up, as the server's first request
        hf_model.generate(
            input_ids=torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
        )  # fmt: skip
    return hf_model, prompts, eos_ids, pad_id


def _run_batch(
    hf_model: Any,
    requests: list[SampledRequest],
    prompts: list[list[int]],
    arrived: list[float],
    *,
    pad_id: int,
    eos_ids: set[int],
    ignore_eos: bool,
) -> list[RequestResult]:
    """One static batch: the prompts left-padded into one greedy `generate` to the longest
    output of the batch; each request's result, its times from its arrival (`arrived`,
    `time.perf_counter()` seconds) and its output cut at its length or its first EOS."""
    import torch

    lens = [len(p) for p in prompts]
    width = max(lens)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lens])
    max_new = max(r.output_len for r in requests)
    clock = _StepClock()
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new if ignore_eos else None,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
            streamer=clock,
        )
    end = time.perf_counter()
    generated = out[:, width:].tolist()
    results = []
    for row, request in enumerate(requests):
        tokens = generated[row][: request.output_len]
        n = next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), len(tokens))
        step_times = clock.times[:n]
        results.append(
            RequestResult(
                ok=True,
                prompt_len=lens[row],
                output_len=n,
                ttft=step_times[0] - arrived[row],
                e2e=end - arrived[row],
                itl=[b - a for a, b in itertools.pairwise(step_times)],
            )
        )
    return results
