"""ShareGPT reading and sampling on a small fixture: exact kept and dropped counts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sluiceway.sharegpt import load_conversations, sample_requests


class WordTokenizer:
    """One token per word: lengths are easy to reason about."""

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=text.split())


def turn(who: str, words: int) -> dict[str, str]:
    return {"from": who, "value": " ".join(["w"] * words)}


def write_truncated(path: Path, records: list[dict]) -> None:
    text = json.dumps(records, indent=2)
    cut = text.rindex('"id"')  # end mid-record, as the packaged file does
    path.write_text(text[:cut])


def test_reading_stops_at_the_cut_and_sampling_filters_like_vllm(tmp_path: Path) -> None:
    convs = [
        [turn("human", 10), turn("gpt", 20)],  # kept
        [turn("human", 10)],  # one turn: not a conversation
        [turn("human", 3), turn("gpt", 20)],  # prompt under 4 tokens
        [turn("human", 10), turn("gpt", 3)],  # output under 4 tokens
        [turn("human", 1025), turn("gpt", 5)],  # prompt over 1024
        [turn("human", 1000), turn("gpt", 1049)],  # sum over 2048
        [turn("human", 50), turn("gpt", 300), turn("human", 9)],  # kept
        [turn("human", 7), turn("gpt", 7)],  # cut off by the truncation
    ]
    path = tmp_path / "sharegpt.json"
    write_truncated(path, [{"id": str(i), "conversations": c} for i, c in enumerate(convs)])
    num_records, read = load_conversations(path)
    assert num_records == 7 and len(read) == 6
    kept = sample_requests(WordTokenizer(), 2, path=path, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in kept) == [(10, 20), (50, 300)]
    capped = sample_requests(WordTokenizer(), 2, conversations=read, max_output_len=128)
    assert sorted(r.output_len for r in capped) == [20, 128]
    # a fixed output length skips the output-length filters (vLLM's rule)
    fixed = sample_requests(WordTokenizer(), 4, conversations=read, output_len=8)
    assert sorted(r.prompt_len for r in fixed) == [10, 10, 50, 1000]
    with pytest.raises(ValueError, match="only 4"):
        sample_requests(WordTokenizer(), 5, conversations=read, output_len=8)
