"""Every Python example of docs/client.md runs against a real stack and prints what the page
shows, in shape: each fenced ``python`` block is executed in a fresh namespace with the
page's target (127.0.0.1:50051) replaced by the stack's, and its output, like the ``text``
block the page shows under it, must match the block's pattern below; after each, every KV
block is free again (the cancelled and the timed-out requests' too)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, wait_for_free_blocks

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"
DOC_TARGET = "127.0.0.1:50051"

# One pattern per python block, in page order: the whole output must match it.
EXPECTED_OUTPUT = [
    # connecting: model_id max_model_len
    r"\S+ \d+\n",
    # Client.request: no server involved
    r"messages 64\nprompt 8\nprompt_token_ids 8\n",
    # generate: text, finish reason, prompt tokens / completion tokens / token ids
    r".+\nFINISH_REASON_(STOP|LENGTH)\n\d+ (?P<n>\d+) (?P=n)\n",
    # generate_stream with logprobs: one line per token (greedy, 6 tokens), then the finish
    r"(.+ \d+ p=\d\.\d\d top=\[\(\d+, [\d.e-]+\), \(\d+, [\d.e-]+\)\]\n){6}"
    r"FINISH_REASON_LENGTH \d+ 6\n",
    # generate_samples: three samples in index order, then sample 2 equals its seed alone
    r"0 \d+ .+\n1 \d+ .+\n2 \d+ .+\nTrue\n",
    # model info and Tokenize
    r"\d+ \[\d+(, \d+)*\] 16\nTrue True\nprefix cache hit rate \d+%\n\[\d+, \d+\]\n\d+\n",
    # health
    r"'' SERVING\n'sluiceway\.v1\.Inference' SERVING\n",
    # deadline
    r"DEADLINE_EXCEEDED True\n",
    # cancellation
    r"CANCELLED\nCANCELLED\n",
    # errors: each with the field named
    r"INVALID_ARGUMENT \| sampling\.top_p: must be in \(0, 1\]; got 3\.0\n"
    r"INVALID_ARGUMENT \| sampling\.stop\[0\]: .+\n"
    r"INVALID_ARGUMENT \| messages\[0\]\.role: .+\n"
    r"INVALID_ARGUMENT \| prompt_token_ids\.ids\[1\]: must be < vocab_size \(\d+\); got 1000000\n"
    r"INVALID_ARGUMENT \| input: set one of prompt, messages, prompt_token_ids\n"
    r"RESOURCE_EXHAUSTED \| .+\n"
    r"UNAVAILABLE\n",
    # the retry loop
    r"True\n",
    # asyncio stubs: four text pieces
    r"\[.+, .+, .+, .+\]\n",
]

_BLOCK = re.compile(r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```\n)?", re.S | re.M)


def examples() -> list[tuple[str, str | None]]:
    """(code, the output the page shows under it or None) of each python block."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(DOC.read_text())]


def test_each_example_has_a_pattern_and_its_shown_output_matches() -> None:
    blocks = examples()
    assert len(blocks) == len(EXPECTED_OUTPUT), "a python block added or removed: update here"
    for i, ((_code, shown), pattern) in enumerate(zip(blocks, EXPECTED_OUTPUT, strict=True)):
        assert shown is not None, f"block {i}: show its output in a text block under it"
        assert re.fullmatch(pattern, shown), (i, shown)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXPECTED_OUTPUT)))
def test_example_runs_against_the_stack(stack: Stack, index: int) -> None:
    code, _shown = examples()[index]
    assert DOC_TARGET in code or index == 1  # Client.request sends nothing
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(DOC_TARGET, stack.target), f"client.md:{index}", "exec"), {})
    assert re.fullmatch(EXPECTED_OUTPUT[index], out.getvalue()), out.getvalue()
    # nothing left behind, the cancelled and the timed-out requests included
    with stack.client() as client:
        info = wait_for_free_blocks(client, timeout_s=10)
    assert info.num_free_kv_blocks == info.num_kv_blocks
