"""The OpenAI-compatible HTTP API through the official `openai` SDK (and plain HTTP for the
vLLM extras), against the live stack: the same tokens as the gRPC API, streamed and not, chat
and completions, n samples, logprobs, errors naming the field, a disconnect freeing blocks."""

from __future__ import annotations

import httpx
import openai
import pytest

from sluiceway.client import Client
from tests.integration.conftest import Stack, http_base_url, wait_for_free_blocks

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def api(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_base_url(stack), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def base(stack: Stack) -> str:
    return http_base_url(stack).removesuffix("/v1")


def test_models_health_version(api: openai.OpenAI, base: str) -> None:
    models = api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/version").json()["version"] == "0.1.0"


def test_chat_gives_the_grpc_tokens_streamed_or_not(api: openai.OpenAI, stack: Stack) -> None:
    with stack.client() as client:
        text, ids, last = client.generate(
            Client.request(messages=[("user", CHAT[0]["content"])], temperature=0, max_tokens=12)
        )
    whole = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("length" if len(ids) == 12 else "stop")
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        last.usage.prompt_tokens, len(ids))  # fmt: skip
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"

    chunks = list(api.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_completions_with_logprobs_match_grpc(api: openai.OpenAI, stack: Stack) -> None:
    prompt = "The capital of France is"
    with stack.client() as client:
        rs = list(client.generate_stream(
            Client.request(prompt, temperature=0, max_tokens=5, logprobs=2), timeout=60))  # fmt: skip
    grpc_lps = [lp for r in rs for lp in r.logprobs]
    out = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5,
                                 logprobs=2)  # fmt: skip
    (choice,) = out.choices
    assert choice.text == "".join(r.text for r in rs)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in grpc_lps])
    assert choice.logprobs.tokens == [lp.token for lp in grpc_lps]  # the router's text, both
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.top_logprobs is not None
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)  # greedy: in the top 2
    # each position's alternatives hold the chosen token (OpenAI's, vLLM's)
    tops = choice.logprobs.top_logprobs
    assert all(top[t] == lp for t, lp, top in zip(choice.logprobs.tokens,
                                                  choice.logprobs.token_logprobs, tops, strict=True))  # fmt: skip
    streamed = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=5,
                                      stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_chat_logprobs(api: openai.OpenAI) -> None:
    out = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4,
                                      logprobs=True, top_logprobs=3)  # fmt: skip
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the top one
        assert entry.top_logprobs[0].token == entry.token


def test_logprobs_without_alternatives_give_each_tokens_logprob(
    api: openai.OpenAI, stack: Stack
) -> None:
    """OpenAI's chat `logprobs: true` alone and completions' `logprobs: 0`: every generated
    token's logprob, no alternatives (the gRPC API's logprobs 0; completions' top_logprobs
    hold the chosen token, as OpenAI's legacy API)."""
    with stack.client() as client:
        rs = list(client.generate_stream(
            Client.request(messages=[("user", CHAT[0]["content"])], temperature=0, max_tokens=4,
                           logprobs=0), timeout=60))  # fmt: skip
    expected = [lp.logprob for r in rs for lp in r.logprobs]
    assert len(expected) == 4 and all(lp <= 0 for lp in expected)
    chat = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=4,
                                       logprobs=True)  # fmt: skip
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [e.logprob for e in content] == pytest.approx(expected)
    assert all(e.top_logprobs == [] for e in content)
    text = api.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                  max_tokens=3, logprobs=0)  # fmt: skip
    lps = text.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None and len(lps.token_logprobs) == 3
    assert lps.tokens is not None  # logprobs 0: the chosen token alone (OpenAI's, vLLM's)
    pairs = zip(lps.tokens, lps.token_logprobs, strict=True)
    assert lps.top_logprobs == [{t: lp} for t, lp in pairs]


def test_n_samples_are_reproducible_with_a_seed(api: openai.OpenAI) -> None:
    def run() -> list[str]:
        out = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0, n=3,
                                          seed=5, max_tokens=16)  # fmt: skip
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage is not None and out.usage.completion_tokens >= 3
        return [c.message.content or "" for c in out.choices]

    first = run()
    assert run() == first
    assert len(set(first)) > 1  # three different seeds
    streamed = api.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0, n=3,
                                           seed=5, max_tokens=16, stream=True)  # fmt: skip
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == first


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"extra_body": {"repetition_penalty": 0.0}}, "repetition_penalty"),
        ({"max_completion_tokens": 0, "max_tokens": 3}, "max_completion_tokens"),  # not "unset"
        # the schema nests too deep: named as the body's field, not as structured_outputs
        ({"extra_body": {"guided_json": '{"items":' * 100 + "{}" + "}" * 100}}, "guided_json"),
        ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_regex": "("}}, "guided_regex"),
    ],
)
def test_errors_name_the_field(api: openai.OpenAI, kwargs: dict, param: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
    assert info.value.status_code == 400
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert param in error["message"]


def test_request_id_is_bounded_as_the_grpc_apis(base: str) -> None:
    """vLLM's `request_id` body field travels as the client wrote it: the same 256-character
    bound as gRPC's, not counting the `chatcmpl-` of the response's id."""
    body = {"messages": CHAT, "max_tokens": 1, "request_id": "r" * 256}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-" + "r" * 256
    r = httpx.post(f"{base}/v1/chat/completions", json=body | {"request_id": "r" * 257})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "request_id: at most 256 characters; got 257"


def test_unknown_model_and_bad_bodies(api: openai.OpenAI, base: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert info.value.status_code == 404
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "n": -1})
    assert r.status_code == 400 and r.json()["error"]["message"] == "n: must be in [1, 16]; got -1"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "n": None, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_tokenize_detokenize(base: str, stack: Stack) -> None:
    r = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}).json()
    from sluiceway.v1 import inference_pb2

    with stack.client() as client:
        ids = list(
            client.stub.Tokenize(inference_pb2.TokenizeRequest(prompt="Hello world")).token_ids
        )
    assert r["tokens"] == ids and r["count"] == len(ids)
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(
    api: openai.OpenAI, stack: Stack
) -> None:
    stream = api.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=4000,
                                    temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    for got, _chunk in enumerate(stream, 1):
        if got == 3:
            break
    stream.close()
    with stack.client() as client:
        info = wait_for_free_blocks(client, timeout_s=10)
    assert info.num_free_kv_blocks == info.num_kv_blocks


def test_bench_serve_through_the_http_api(stack: Stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`bench serve --backend openai`: the same workload through /v1/completions (what it
    sends to vLLM too): every request done, the exact token counts."""
    import json
    import subprocess
    import sys

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    subprocess.run(
        [
            sys.executable, "-m", "sluiceway.cli", "bench", "serve", "--backend", "openai",
            "--base-url", http_base_url(stack).removesuffix("/v1"),
            "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "32",
            "--random-output-len", "8", "--ignore-eos", "--save-result", str(out),
            "--plot", str(png),
        ],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["successful_requests"] == 6 and result["failed_requests"] == 0
    assert result["total_output_tokens"] == 48 and result["total_input_tokens"] == 6 * 32
    assert result["median_ttft_ms"] > 0 and result["median_itl_ms"] > 0
    assert [r["output_len"] for r in result["requests"]] == [8] * 6
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in result["requests"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_http_requests_are_counted_by_protocol(api: openai.OpenAI, stack: Stack) -> None:
    from tests.integration.conftest import metrics_urls

    url = metrics_urls(stack.log)["router"]

    def count(protocol: str) -> float:
        text = httpx.get(url).text
        return sum(
            float(row.rsplit(" ", 1)[1]) for row in text.splitlines()
            if row.startswith("sluiceway:request_success_total{")
            and f'protocol="{protocol}"' in row
        )  # fmt: skip

    http, grpc_before = count("http"), count("grpc")
    api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    with stack.client() as client:
        client.generate(Client.request("Hi", temperature=0, max_tokens=2))
    assert count("http") == http + 1 and count("grpc") == grpc_before + 1


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"max_tokens": 99999999999999999999}, "max_tokens"),
        ("/v1/completions", {"seed": -1}, "seed"),
        ("/v1/completions", {"top_k": 99999999999999}, "top_k"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"max_completion_tokens": 5000000000}, "max_completion_tokens"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 99999999999}, "top_logprobs"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ],
)
def test_out_of_range_and_mistyped_fields_are_400_naming_them(
    base: str,
    path: str,
    extra: dict,
    param: str,  # type: ignore[type-arg]
) -> None:
    """Integers outside their proto type (found by a reviewer: they were HTTP 500) and
    pydantic's type errors name the body field, not a union member."""
    body = (
        {"prompt": "hi"}
        if "chat" not in path
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    r = httpx.post(f"{base}{path}", json={**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_malformed_json_and_unknown_token_ids(base: str) -> None:
    r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": [}',
                   headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert r.json()["error"]["message"].startswith("body: invalid JSON")
    r = httpx.post(f"{base}/detokenize", json={"tokens": [999999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[0]"


def test_logit_bias_forces_and_bans_tokens_under_greedy(
    api: openai.OpenAI, base: str, stack: Stack
) -> None:
    """OpenAI's logit_bias through the SDK (its keys are strings on the wire): +100 on a token
    makes greedy emit it at every step; -100 on the greedy first token changes the first (to
    what the gRPC API gives with the same bias)."""
    prompt = "The sky is"
    with stack.client() as client:
        _, greedy, _ = client.generate(Client.request(prompt=prompt, temperature=0, max_tokens=3))
        banned_text, banned, _ = client.generate(Client.request(
            prompt=prompt, temperature=0, max_tokens=3, logit_bias={greedy[0]: -100.0}))  # fmt: skip
    assert banned[0] != greedy[0]
    forced = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3,
                                    logit_bias={"28": 100})  # fmt: skip
    three = httpx.post(f"{base}/detokenize", json={"tokens": [28, 28, 28]}).json()["prompt"]
    assert forced.choices[0].text == three
    other = api.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3,
                                   logit_bias={str(greedy[0]): -100})  # fmt: skip
    assert other.choices[0].text == banned_text
