"""The sampling parameters beyond the basics, through the live stack (vLLM's semantics)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack

STOP = inference_pb2.FINISH_REASON_STOP
LENGTH = inference_pb2.FINISH_REASON_LENGTH


def responses(
    stack: Stack, request: inference_pb2.GenerateRequest
) -> list[inference_pb2.GenerateResponse]:
    with stack.client() as client:
        return list(client.generate_stream(request, timeout=120))


def text_and_ids(stack: Stack, request: inference_pb2.GenerateRequest) -> tuple[str, list[int]]:
    rs = responses(stack, request)
    return "".join(r.text for r in rs), [t for r in rs for t in r.token_ids]


def test_min_tokens_holds_off_stop_strings(stack: Stack) -> None:
    prompt = "List fruits, one per line:\n"
    text, ids = text_and_ids(stack, Client.request(prompt, temperature=0, max_tokens=60,
                                                    stop=["\n"]))  # fmt: skip
    assert (text, len(ids)) == ("", 1)  # the first token is a newline
    rs = responses(stack, Client.request(prompt, temperature=0, max_tokens=60, stop=["\n"],
                                         min_tokens=30))  # fmt: skip
    n = sum(len(r.token_ids) for r in rs)
    assert 30 <= n < 60 and rs[-1].finish_reason == STOP


def test_each_penalty_changes_greedy_output_on_its_own_token_set(stack: Stack) -> None:
    prompt = "Repeat the word echo many times: echo echo echo"
    _, base = text_and_ids(stack, Client.request(prompt, temperature=0, max_tokens=12))
    outs = {
        name: text_and_ids(stack, Client.request(prompt, temperature=0, max_tokens=12,
                                                 **{name: value}))[1]  # type: ignore[arg-type]
        for name, value in (("repetition_penalty", 1.5), ("presence_penalty", 1.5),
                            ("frequency_penalty", 1.5))
    }  # fmt: skip
    for name, ids in outs.items():
        assert ids != base, name
    # presence and frequency look at the output only: nothing is generated before the first
    # token, so it stays; the repetition penalty covers the prompt and changes it here
    assert outs["presence_penalty"][0] == base[0] == outs["frequency_penalty"][0]
    assert outs["repetition_penalty"][0] != base[0]


def test_logprobs_match_the_oracle(stack: Stack, oracle, tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = "The capital of France is"
    rs = responses(stack, Client.request(prompt, temperature=0, max_tokens=3, logprobs=5))
    entries = [lp for r in rs for lp in r.logprobs]
    ids = [t for r in rs for t in r.token_ids]
    assert [e.token_id for e in entries] == ids
    for e in entries:
        assert len(e.top_logprobs) == 5
        assert e.top_logprobs[0].token_id == e.token_id  # greedy picks the top
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-6)
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and lps[0] <= 0
    with torch.inference_mode():
        logits = oracle(torch.tensor([tokenizer.encode(prompt)])).logits[0, -1]
    ref_lp, ref_ids = torch.topk(torch.log_softmax(logits.float(), -1), 5)
    assert [t.token_id for t in entries[0].top_logprobs] == ref_ids.tolist()
    for got, want in zip(entries[0].top_logprobs, ref_lp.tolist(), strict=True):
        assert math.isclose(got.logprob, want, abs_tol=2e-3)
    zero = responses(stack, Client.request(prompt, temperature=0, max_tokens=2, logprobs=0))
    assert [len(lp.top_logprobs) for r in zero for lp in r.logprobs] == [0, 0]
    plain = responses(stack, Client.request(prompt, temperature=0, max_tokens=2))
    assert all(not r.logprobs for r in plain)


def test_include_stop_str_in_output(stack: Stack) -> None:
    prompt = "The largest city in Japan is"
    full, _ = text_and_ids(stack, Client.request(prompt, temperature=0, max_tokens=8))
    text, _ = text_and_ids(stack, Client.request(prompt, temperature=0, max_tokens=8,
                                                 stop=["Toky"], include_stop_str_in_output=True))  # fmt: skip
    assert text == full[: full.index("Toky") + 4]


def test_special_tokens_and_the_eos_text(stack: Stack) -> None:
    chat = [("user", "Say hi.")]
    # with ignore_eos the model goes past <|im_end|>: its text shows only when not skipped
    skipped, ids = text_and_ids(stack, Client.request(messages=chat, temperature=0,
                                                      max_tokens=40, ignore_eos=True))  # fmt: skip
    kept, ids2 = text_and_ids(stack, Client.request(messages=chat, temperature=0, max_tokens=40,
                                                    ignore_eos=True, skip_special_tokens=False))  # fmt: skip
    assert ids == ids2 and "<|im_end|>" in kept and "<|im_end|>" not in skipped
    # stopping on EOS: the EOS token's text is not output unless include_stop_str_in_output
    rs = responses(stack, Client.request(messages=chat, temperature=0, max_tokens=40,
                                         skip_special_tokens=False))  # fmt: skip
    assert rs[-1].finish_reason == STOP
    assert "<|im_end|>" not in "".join(r.text for r in rs)
    rs = responses(stack, Client.request(messages=chat, temperature=0, max_tokens=40,
                                         skip_special_tokens=False,
                                         include_stop_str_in_output=True))  # fmt: skip
    assert "".join(r.text for r in rs).endswith("<|im_end|>")


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(stack: Stack) -> None:
    seeded = Client.request("Write a short poem about rivers.", temperature=0.8, seed=1234,
                            max_tokens=24, ignore_eos=True)  # fmt: skip
    _, alone = text_and_ids(stack, seeded)
    # A few seeded neighbours (each its own generator), the rest unseeded.
    others = [
        Client.request(f"Tell me fact number {i} about space.", temperature=0.8,
                       seed=i if i % 4 == 0 else None, max_tokens=24 + i, ignore_eos=True)
        for i in range(16)
    ]  # fmt: skip
    with ThreadPoolExecutor(17) as pool:
        futures = [pool.submit(text_and_ids, stack, r) for r in others[:8]]
        mine = pool.submit(text_and_ids, stack, seeded)
        futures += [pool.submit(text_and_ids, stack, r) for r in others[8:]]
        in_batch = mine.result()[1]
        for f in futures:
            f.result()
    assert in_batch == alone


def test_seeded_request_is_batch_invariant_in_bfloat16_too() -> None:
    """In bfloat16 every reduction of the forward has an order fixed per row (README,
    Reproducibility): a seeded sampled sequence shares the batch's forward and its tokens do
    not depend on the batch."""
    from tests.integration.conftest import start_stack, stop_stack

    stack = start_stack("--dtype", "bfloat16")
    try:
        seeded = Client.request("Once upon a time, in a land far away,", temperature=1.0,
                                seed=7, max_tokens=40, ignore_eos=True, top_p=0.95)  # fmt: skip
        _, alone = text_and_ids(stack, seeded)
        noise = [Client.request(f"Story {i}:", temperature=0.9, max_tokens=45, ignore_eos=True)
                 for i in range(18)]  # fmt: skip
        with ThreadPoolExecutor(19) as pool:
            busy = [pool.submit(text_and_ids, stack, r) for r in noise[:9]]
            mine = pool.submit(text_and_ids, stack, seeded)
            busy += [pool.submit(text_and_ids, stack, r) for r in noise[9:]]
            assert mine.result()[1] == alone
            for f in busy:
                f.result()
    finally:
        assert stop_stack(stack) == 0
