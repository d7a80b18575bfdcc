"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo`) and the logprob entries'
bytes, through the live stack (the session's float32 SmolLM2, prefix caching on), against
transformers' teacher-forced float32 log_softmax of the prompt."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from sluiceway.client import Client
from tests.integration.conftest import Stack, http_base_url

MODEL = "SmolLM2-135M-Instruct"
# 2 full blocks of 16 and more: a prefix-cache hit could give them
PROMPT = (
    "The river left the mountains in spring, carried the melted snow past seven villages, "
    "and reached the sea a week later, where the fishermen were already waiting for it."
)
EMOJI = "Reply with exactly these emoji: 🍎 🚀 😀 💚"


@pytest.fixture(scope="module")
def api(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_base_url(stack), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(oracle, tokenizer) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    """PROMPT's ids and transformers' float32 log_softmax at each position but the last."""
    ids = [int(i) for i in tokenizer.encode(PROMPT)]
    assert len(ids) > 2 * 16
    with torch.inference_mode():
        logits = oracle(torch.tensor([ids])).logits[0, :-1].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _check(entries: list[tuple[int, float | None]], ref: tuple[list[int], torch.Tensor]) -> None:
    """``(token id, logprob)`` of every prompt token equal the reference's, to 1e-4."""
    ids, log_probs = ref
    assert [t for t, _ in entries] == ids
    assert entries[0][1] is None
    expected = log_probs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor([lp for _, lp in entries[1:]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _grpc_prompt_logprobs(stack: Stack, n: int, samples: int = 1) -> list[tuple[int, float | None]]:
    """The prompt logprobs of PROMPT over gRPC, the same on each sample's first message."""
    request = Client.request(PROMPT, temperature=0, max_tokens=1, prompt_logprobs=n, n=samples)
    with stack.client() as client:
        responses = list(client.generate_stream(request, timeout=120))
    firsts = [next(r for r in responses if r.index == i) for i in range(samples)]
    entries = list(firsts[0].prompt_logprobs)
    assert all(list(f.prompt_logprobs) == entries for f in firsts)
    assert not entries[0].HasField("rank") and not entries[0].top_logprobs
    for e in entries[1:]:
        assert len(e.top_logprobs) == n and e.HasField("rank")
        assert (e.rank == 1) == (e.top_logprobs[0].token_id == e.token_id)
    return [(e.token_id, e.logprob if i else None) for i, e in enumerate(entries)]


def test_prompt_logprobs_equal_transformers_alone_after_a_cache_hit_and_amid_traffic(
    stack: Stack, api: openai.OpenAI, reference: tuple[list[int], torch.Tensor]
) -> None:
    _check(_grpc_prompt_logprobs(stack, 2), reference)  # alone
    with stack.client() as client:  # the prompt's blocks are in the prefix cache now, twice
        client.generate(Client.request(PROMPT, temperature=0, max_tokens=1), timeout=120)
    # after a hit was there to take; each of 2 samples (parallel sampling) has them
    _check(_grpc_prompt_logprobs(stack, 2, samples=2), reference)
    stop = threading.Event()

    def traffic(i: int) -> None:
        with stack.client() as client:
            while not stop.is_set():
                client.generate(Client.request(f"Story {i}: once upon a time", max_tokens=24,
                                               ignore_eos=True), timeout=120)  # fmt: skip

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:  # amid traffic, through HTTP: echo with max_tokens 0 (lm-eval's loglikelihood)
        out = api.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0,
                                     logprobs=1, temperature=0)  # fmt: skip
    finally:
        stop.set()
        for t in threads:
            t.join()
    (choice,) = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lps = choice.logprobs
    assert lps is not None and lps.tokens is not None and lps.token_logprobs is not None
    ids = reference[0]
    assert len(lps.tokens) == len(ids) and lps.top_logprobs is not None
    assert lps.top_logprobs[0] is None
    # each position's top_logprobs: the most likely token and the prompt's own
    assert all(tok in top and 1 <= len(top) <= 2
               for tok, top in zip(lps.tokens[1:], lps.top_logprobs[1:], strict=True))  # fmt: skip
    _check(list(zip(ids, lps.token_logprobs, strict=True)), reference)


def test_echo_with_output_and_vllm_prompt_logprobs_field(
    stack: Stack, api: openai.OpenAI, reference: tuple[list[int], torch.Tensor]
) -> None:
    ids, log_probs = reference
    plain = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                   logprobs=0)  # fmt: skip
    echoed = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=0, echo=True)  # fmt: skip
    out, base = echoed.choices[0], plain.choices[0]
    assert out.text == PROMPT + base.text
    assert out.logprobs is not None and base.logprobs is not None
    assert out.logprobs.tokens is not None and base.logprobs.tokens is not None
    assert out.logprobs.tokens[len(ids) :] == base.logprobs.tokens
    assert out.logprobs.text_offset is not None and base.logprobs.text_offset is not None
    assert out.logprobs.text_offset[len(ids):] == [o + len(PROMPT)
                                                   for o in base.logprobs.text_offset]  # fmt: skip
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                         temperature=0, logprobs=0, echo=True, stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == out.text
    streamed_tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert streamed_tokens == out.logprobs.tokens
    base_url = http_base_url(stack)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "prompt_logprobs": 1}  # fmt: skip
    chat = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120).json()
    first, *rest = chat["prompt_logprobs"]
    assert first is None and rest and all(1 <= len(p) <= 2 for p in rest)
    assert all(any(e["rank"] == 1 for e in p.values()) for p in rest)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}
    comp = httpx.post(f"{base_url}/completions", json=body, timeout=120).json()
    positions = comp["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(ids)
    got = [positions[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    expected = log_probs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=0)
    streamed = httpx.post(f"{base_url}/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


def _offsets_in_context(text: str, pieces: list[bytes]) -> list[int]:
    """Where each token starts in ``text``, in characters: the characters whole in the bytes
    of the tokens before it."""
    out, done = [], 0
    for piece in pieces:
        out.append(max(c for c in range(len(text) + 1) if len(text[:c].encode()) <= done))
        done += len(piece)
    return out


def test_logprob_bytes_rebuild_the_text_of_split_emoji(stack: Stack, api: openai.OpenAI) -> None:
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": EMOJI}], temperature=0,
        max_tokens=12, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].message.content
    entries = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and entries
    assert b"".join(bytes(e.bytes or []) for e in entries) == content.encode()
    for e in entries:
        for top in e.top_logprobs:
            assert top.token == bytes(top.bytes or []).decode("utf-8", "backslashreplace")
    # the prompt's emoji are split over tokens: echo gives their entries, deterministically
    out = api.completions.create(model=MODEL, prompt=EMOJI, echo=True, max_tokens=0, logprobs=0)
    lps = out.choices[0].logprobs
    assert out.choices[0].text == EMOJI and lps is not None and lps.tokens is not None
    assert lps.tokens[-3:] == [" \\xf0\\x9f", "\\x92", "\\x9a"]  # " 💚": F0 9F | 92 | 9A
    with stack.client() as client:
        (first, *_) = list(client.generate_stream(
            Client.request(EMOJI, max_tokens=1, prompt_logprobs=0), timeout=60))  # fmt: skip
    grpc_bytes = [e.bytes for e in first.prompt_logprobs]
    assert b"".join(grpc_bytes) == EMOJI.encode()
    assert lps.text_offset == _offsets_in_context(EMOJI, grpc_bytes)
    # a token holding the start of an emoji adds its space only; the one completing it adds
    # the emoji (1 character): 39 characters in all, not the tokens' lengths decoded alone
    assert lps.text_offset == [0, 3, 5, 10, 18, 24, 27, 30, 31, 32, 32, 33, 34, 34, 35, 36, 37,
                               38, 38]  # fmt: skip
