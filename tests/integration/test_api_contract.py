"""Cases other servers got wrong (issue list of the API contract), on the live stack.

Each compares with the same greedy generation without the feature under test,
so the expectations hold whatever the model happens to say.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_for_free_blocks

LENGTH = inference_pb2.FINISH_REASON_LENGTH
STOP = inference_pb2.FINISH_REASON_STOP


def run(stack: Stack, request: inference_pb2.GenerateRequest) -> tuple[str, list[str], int]:
    """(concatenated text, the deltas, finish reason)."""
    with stack.client() as client:
        responses = list(client.generate_stream(request, timeout=120))
    deltas = [r.text for r in responses]
    return "".join(deltas), deltas, responses[-1].finish_reason


def greedy(prompt: str, **sampling: object) -> inference_pb2.GenerateRequest:
    return Client.request(prompt, temperature=0, **sampling)


@pytest.mark.parametrize(
    ("prompt", "stop"),
    [
        ("ABCDEFGHIJ", "MF"),  # starts inside the token 'LM', ends at the token 'F'
        ("ABCDEFGHIJ", "GHI"),  # spans the tokens 'GH' and 'I'
        ("The largest city in Japan is", "Toky"),  # ends inside the token ' Tokyo'
    ],
)
def test_stop_string_is_cut_exactly_wherever_it_falls(stack: Stack, prompt: str, stop: str) -> None:
    full, _, _ = run(stack, greedy(prompt, max_tokens=24))
    assert stop in full
    text, _, finish = run(stack, greedy(prompt, max_tokens=24, stop=[stop]))
    assert text == full[: full.index(stop)]
    assert finish == STOP


def test_a_stop_string_that_is_a_prefix_of_another(stack: Stack) -> None:
    prompt = "The largest city in Japan is"
    full, _, _ = run(stack, greedy(prompt, max_tokens=8))
    text, _, _ = run(stack, greedy(prompt, max_tokens=8, stop=["Tokyo,", "Tok"]))
    assert text == full[: full.index("Tok")]


def test_held_back_text_is_flushed_when_generation_ends_without_a_match(stack: Stack) -> None:
    prompt = "The largest city in Japan is"
    full, _, _ = run(stack, greedy(prompt, max_tokens=1))
    assert full.endswith("Tokyo")  # a possible start of "Tokyo!!", held back while streaming
    text, _, finish = run(stack, greedy(prompt, max_tokens=1, stop=["Tokyo!!"]))
    assert (text, finish) == (full, LENGTH)


@pytest.mark.parametrize("prompt", ["北京是中国的首都。上海是", "Emoji: 😀😃😄😁"])
def test_multibyte_streams_equal_the_one_shot_decode(stack: Stack, tokenizer, prompt: str) -> None:  # type: ignore[no-untyped-def]
    with stack.client() as client:
        responses = list(client.generate_stream(greedy(prompt, max_tokens=15), timeout=120))
    ids = [t for r in responses for t in r.token_ids]
    text = "".join(r.text for r in responses)
    assert text == tokenizer.decode(ids)
    assert "\ufffd" not in text  # 15 tokens end on a whole character for both prompts
    assert any(ord(ch) > 0x2E80 for ch in text)  # really multi-byte output


def test_max_tokens_one_on_a_split_character_gives_one_replacement_at_most(stack: Stack) -> None:
    """Documented: a character cut by the end of generation comes out once, as U+FFFD."""
    text, _, finish = run(stack, greedy("Emoji: 😀😃😄😁", max_tokens=1))
    assert finish == LENGTH and text.count("\ufffd") <= 1


def test_prompt_token_ids_ending_mid_character_do_not_re_emit_the_prompt(
    stack: Stack,
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    ids = tokenizer.encode("Hello 😀")
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # the prompt stops inside the emoji
    request = Client.request(prompt_token_ids=ids[:-1], temperature=0, max_tokens=8)
    text, _, _ = run(stack, request)
    assert "Hello" not in text


def test_top_k_1_temperature_0_and_tiny_top_p_agree(stack: Stack) -> None:
    prompt = "The three primary colors are"
    greedy_text, _, _ = run(stack, greedy(prompt, max_tokens=12))
    top_k, _, _ = run(
        stack, Client.request(prompt, temperature=0.8, top_k=1, max_tokens=12, seed=1)
    )
    top_p, _, _ = run(
        stack, Client.request(prompt, temperature=0.8, top_p=1e-9, max_tokens=12, seed=2)
    )
    assert greedy_text == top_k == top_p


def test_top_p_one_is_no_filtering_and_zero_is_rejected(stack: Stack) -> None:
    prompt = "Once upon a time"
    unset, _, _ = run(stack, Client.request(prompt, temperature=1.0, max_tokens=12, seed=7))
    one, _, _ = run(
        stack, Client.request(prompt, temperature=1.0, top_p=1.0, max_tokens=12, seed=7)
    )
    assert unset == one
    with stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(Client.request(prompt, top_p=0.0), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_p" in (err.value.details() or "")


def test_ignore_eos_gives_exactly_max_tokens_on_the_chat_model(stack: Stack) -> None:
    request = Client.request(messages=[("user", "Say hi.")], temperature=0, max_tokens=96,
                             ignore_eos=True)  # fmt: skip
    with stack.client() as client:
        _, ids, last = client.generate(request, timeout=300)
    assert len(ids) == 96 and last.finish_reason == LENGTH  # EOS comes 24th without ignore_eos
    assert last.usage.completion_tokens == 96


def test_no_max_tokens_means_16(stack: Stack) -> None:
    with stack.client() as client:
        _, ids, last = client.generate(greedy("Hi", ignore_eos=True), timeout=120)
    assert len(ids) == 16 and last.finish_reason == LENGTH


def test_special_token_strings_in_prompts(stack: Stack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Plain prompts are tokenized as the model's tokenizer does by default (its special-token
    strings become special tokens, as in vLLM); a chat prompt starts with one <|im_start|>."""
    text = "<|im_start|>user hi"
    with stack.client() as client:
        plain = list(client.stub.Tokenize(inference_pb2.TokenizeRequest(prompt=text)).token_ids)
        req = inference_pb2.TokenizeRequest()
        req.messages.messages.add(role="user", content="hi")
        chat = list(client.stub.Tokenize(req).token_ids)
    assert plain == tokenizer.encode(text)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert plain[0] == im_start and plain[1] != im_start
    assert chat[0] == im_start and chat[1] != im_start  # no double BOS


def test_64_identical_chat_requests_three_rounds_leave_no_block_held(stack: Stack) -> None:
    request = Client.request(messages=[("user", "Name a color.")], temperature=0, max_tokens=6)
    with stack.client() as client:
        for _ in range(3):
            with ThreadPoolExecutor(64) as pool:
                outs = list(pool.map(lambda _: client.generate(request, timeout=300)[1], range(64)))
            assert all(o == outs[0] for o in outs)
        info = wait_for_free_blocks(client)
    assert info.num_free_kv_blocks == info.num_kv_blocks


def test_prompt_at_max_model_len_is_rejected_and_generation_is_capped() -> None:
    """vLLM's rule: prompt >= max_model_len is INVALID_ARGUMENT; otherwise max_tokens is
    capped at the room left, ending with LENGTH."""
    stack = start_stack("--max-model-len", "64")
    try:
        with stack.client() as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate(Client.request(prompt_token_ids=[42] * 64, max_tokens=4))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_model_len" in (err.value.details() or "")
            request = Client.request(prompt_token_ids=[42] * 60, temperature=0, max_tokens=50,
                                     ignore_eos=True)  # fmt: skip
            _, ids, last = client.generate(request, timeout=120)
            assert len(ids) == 4 and last.finish_reason == LENGTH
            info = wait_for_free_blocks(client)
            assert info.num_free_kv_blocks == info.num_kv_blocks
    finally:
        assert stop_stack(stack) == 0
