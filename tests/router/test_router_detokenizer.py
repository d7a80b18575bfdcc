"""router.detokenizer: UTF-8-safe text deltas and stop strings, on the real SmolLM2 tokenizer.

The oracle is `tokenizer.decode(ids, skip_special_tokens=True)` of all the
generated ids; for stop strings, the text the oracle gives cut before the
first stop string to complete (see `expected_stop_cut`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sluiceway.router.detokenizer as detok_module
from sluiceway.router.detokenizer import IncrementalDetokenizer

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?",
    "chinese": "天气怎么样？我们今天去公园散步吧，顺便买一些水果。",
    "japanese": "東京は日本の首都です。ひらがなとカタカナ。",
    "emoji": "🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🫠",
    "mixed": "Hello 世界! Привет, мир. مرحبا بالعالم. नमस्ते दुनिया. Ünïcödé café 🎉 done.",
    "control": "a\x00b\x07c\td\ne\r\nf\x1b[31mred\x1b[0m\x7f\u200b\u2028g",
    "code": "def f(x):\n    return {'a': [1, 2]}  # 注释 ✓\n\n\tfin",
}

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def chunks(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """`ids` cut into consecutive chunks of `sizes` (cycled), the last one what is left."""
    out: list[list[int]] = []
    i = 0
    k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(list(ids[i : i + n]))
        i += n
        k += 1
    return out


def run(
    tokenizer: Any,
    ids: Sequence[int],
    *,
    sizes: Sequence[int] = (1,),
    prompt: Sequence[int] = (),
    stop: Sequence[str] = (),
    skip_special_tokens: bool = True,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feeds `ids` in chunks; returns the detokenizer and every delta (flush's last)."""
    d = IncrementalDetokenizer(tokenizer, list(prompt), list(stop), skip_special_tokens)
    deltas = [d.add_tokens(c) for c in chunks(ids, sizes)]
    deltas.append(d.flush())
    return d, deltas


def assert_deltas_match(full: str, deltas: Sequence[str]) -> None:
    """The deltas tile `full` in order: each is the slice of `full` at its place."""
    pos = 0
    for delta in deltas:
        assert full[pos : pos + len(delta)] == delta, (pos, delta, full)
        pos += len(delta)
    assert pos == len(full)


def expected_stop_cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` cut before the stop string completed first (ties: the longest); and which."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    return text[: best[1]], best[2]


def token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(tid, int) and tid != tokenizer.unk_token_id
    return tid


# -- deltas equal the full decode -------------------------------------------------


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time(tokenizer: Any, name: str) -> None:
    text = TEXTS[name]
    ids = tokenizer.encode(text)
    d, deltas = run(tokenizer, ids)
    assert decode(tokenizer, ids) == text
    assert "".join(deltas) == text == d.text
    assert_deltas_match(text, deltas)
    assert not d.stopped and d.stop_string is None
    assert d.num_tokens == len(ids)
    assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("sizes", [(2,), (3,), (5, 1, 2), (1000,)])
def test_fixed_chunks(tokenizer: Any, name: str, sizes: tuple[int, ...]) -> None:
    text = TEXTS[name]
    _, deltas = run(tokenizer, tokenizer.encode(text), sizes=sizes)
    assert_deltas_match(text, deltas)


def test_partial_character_yields_nothing_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("符🎉")
    pieces = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    assert len(ids) > 2, pieces  # both characters span several byte-level tokens
    d = IncrementalDetokenizer(tokenizer, [], [])
    deltas = [d.add_tokens([i]) for i in ids]
    assert [x for x in deltas if x] == ["符", "🎉"]
    assert deltas[0] == ""  # the first byte(s) of 符 alone


def test_prompt_context_does_not_leak(tokenizer: Any) -> None:
    prompt = tokenizer.encode("Question: 天气怎么样？")
    gen = tokenizer.encode(" Sunny, 晴天 🎉.")
    _, deltas = run(tokenizer, gen, prompt=prompt)
    assert_deltas_match(decode(tokenizer, gen), deltas)


def test_prompt_ending_mid_character_does_not_leak(tokenizer: Any) -> None:
    ids = tokenizer.encode("中文 🎉")
    prompt, gen = ids[:-1], tokenizer.encode(" world")  # prompt cut inside 🎉
    assert decode(tokenizer, prompt).endswith("\ufffd")
    _, deltas = run(tokenizer, gen, prompt=prompt)
    assert "".join(deltas) == " world"


def test_output_completes_a_character_cut_in_the_prompt(tokenizer: Any) -> None:
    ids = tokenizer.encode("中文 🎉 ok")
    cut = next(i for i in range(1, len(ids)) if decode(tokenizer, ids[:i]).endswith("\ufffd"))
    prompt, gen = ids[:cut], ids[cut:]
    _, deltas = run(tokenizer, gen, prompt=prompt)
    assert_deltas_match(decode(tokenizer, gen), deltas)  # lone continuation bytes: U+FFFD


def test_special_tokens_skipped_or_kept(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("Hi there"), eos]
    d, deltas = run(tokenizer, ids)
    assert deltas[-2:] == ["", ""] and d.text == "Hi there"
    d, deltas = run(tokenizer, ids, skip_special_tokens=False)
    assert d.text == "Hi there<|im_end|>" == tokenizer.decode(ids)


def test_invalid_utf8_at_the_end_comes_out_at_flush(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 符")
    ids = ids[:-1]  # the last character cut: its leading byte(s) only
    full = decode(tokenizer, ids)
    assert full.endswith("\ufffd")
    d = IncrementalDetokenizer(tokenizer, [], [])
    streamed = "".join(d.add_tokens([i]) for i in ids)
    assert streamed == "ok"  # " " rides on the token with the cut character's first byte
    tail = d.flush()
    assert tail.endswith("\ufffd") and streamed + tail == full == d.text
    assert d.flush() == ""  # idempotent
    with pytest.raises(RuntimeError):
        d.add_tokens([5])


def test_invalid_utf8_in_the_middle(tokenizer: Any) -> None:
    lead = token_id(tokenizer, "ä")  # byte 0xE4: starts a 3-byte character
    ids = [*tokenizer.encode("a"), lead, *tokenizer.encode("b c"), lead, lead]
    full = decode(tokenizer, ids)
    assert full.count("\ufffd") == 3
    _, deltas = run(tokenizer, ids)
    assert_deltas_match(full, deltas)


def test_empty_and_out_of_vocab_ids(tokenizer: Any) -> None:
    d = IncrementalDetokenizer(tokenizer, [], [])
    assert d.add_tokens([]) == ""
    assert d.add_tokens([len(tokenizer) + 10]) == ""  # a padded-vocab id decodes to nothing
    assert d.add_tokens(tokenizer.encode(" hi")) == " hi"


def test_accepts_a_tokenizers_tokenizer(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS["mixed"])
    d = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], [])
    assert "".join(d.add_tokens([i]) for i in ids) + d.flush() == TEXTS["mixed"]
    with pytest.raises(TypeError):
        IncrementalDetokenizer(object(), [], [])


@SETTINGS
@given(
    text=st.text(min_size=0, max_size=60),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=8),
    prompt_text=st.text(max_size=10),
)
def test_property_real_text(tokenizer: Any, text: str, sizes: list[int], prompt_text: str) -> None:
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode(prompt_text)
    full = decode(tokenizer, ids)
    d, deltas = run(tokenizer, ids, sizes=sizes, prompt=prompt)
    assert_deltas_match(full, deltas)
    assert d.text == full


@st.composite
def vocab_ids(draw: st.DrawFn, tokenizer: Any, byte_ids: list[int]) -> list[int]:
    """Random ids: any vocab entry, single-byte tokens (partial characters) and specials."""
    any_id = st.integers(0, len(tokenizer) - 1)
    specials = st.sampled_from(tokenizer.all_special_ids)
    one = st.one_of(any_id, st.sampled_from(byte_ids), st.sampled_from(byte_ids), specials)
    return draw(st.lists(one, max_size=40))


@pytest.fixture(scope="module")
def byte_ids(tokenizer: Any) -> list[int]:
    """Ids of the single-byte tokens of the byte-level BPE alphabet (235 in SmolLM2's vocab)."""
    vocab = tokenizer.get_vocab()
    singles = sorted(i for t, i in vocab.items() if len(t) == 1)
    assert len(singles) >= 200
    return singles


@SETTINGS
@given(data=st.data(), sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_property_random_ids(
    tokenizer: Any, byte_ids: list[int], data: st.DataObject, sizes: list[int]
) -> None:
    ids = data.draw(vocab_ids(tokenizer, byte_ids), label="ids")
    prompt = data.draw(vocab_ids(tokenizer, byte_ids), label="prompt")
    full = decode(tokenizer, ids)
    d, deltas = run(tokenizer, ids, sizes=sizes, prompt=prompt)
    # Each delta is the slice of the full decode at its place: in particular a
    # U+FFFD only comes out where the full decode has one.
    assert_deltas_match(full, deltas)
    assert d.text == full


# -- stop strings -----------------------------------------------------------------


def test_stop_spanning_tokens(tokenizer: Any) -> None:
    text = TEXTS["english"]
    ids = tokenizer.encode(text)
    stop = "brown fox jumps"
    d = IncrementalDetokenizer(tokenizer, [], [stop])
    deltas = []
    for i in ids:
        deltas.append(d.add_tokens([i]))
        assert "brown" not in d.text
        if d.stopped:
            break
    assert d.stopped and d.stop_string == stop
    assert d.text == "".join(deltas) == "The quick "
    # Nothing after the stop, ever.
    assert d.add_tokens(ids) == ""
    assert d.flush() == ""
    assert d.text == "The quick "


def test_stop_held_back_then_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("The lazy dog sleeps")
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["The", "Ġlazy", "Ġdog"]
    d = IncrementalDetokenizer(tokenizer, [], ["lazy cat"])
    assert d.add_tokens(ids[:1]) == "The"
    assert d.add_tokens(ids[1:2]) == " "  # "lazy" could still become "lazy cat"
    assert d.add_tokens(ids[2:3]) == "lazy dog"  # it cannot any more: released
    rest = d.add_tokens(ids[3:]) + d.flush()
    assert d.text == "The lazy dog" + rest == "The lazy dog sleeps" and not d.stopped


def test_stop_that_is_a_prefix_of_another(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS["english"])
    for stops in (["fox jumps", "fox"], ["fox", "fox jumps"]):
        d, deltas = run(tokenizer, ids, stop=stops)
        assert d.stopped and d.stop_string == "fox"
        assert "".join(deltas) == "The quick brown "


def test_earliest_stop_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS["english"])
    for sizes in ((1,), (1000,)):
        d, deltas = run(tokenizer, ids, stop=["lazy", "quick"], sizes=sizes)
        assert d.stop_string == "quick" and "".join(deltas) == "The "


def test_stop_completing_first_wins_within_one_chunk(tokenizer: Any) -> None:
    # "brown" completes before "quick brown fox" does: same cut however chunked.
    ids = tokenizer.encode(TEXTS["english"])
    for sizes in ((1,), (3,), (1000,)):
        d, deltas = run(tokenizer, ids, stop=["quick brown fox", "brown"], sizes=sizes)
        assert d.stop_string == "brown" and "".join(deltas) == "The quick "


def test_stop_at_the_very_first_token(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXTS["english"])
    d = IncrementalDetokenizer(tokenizer, [], ["The"])
    assert d.add_tokens(ids[:1]) == ""
    assert d.stopped and d.text == ""
    assert d.add_tokens(ids[1:]) == "" and d.flush() == ""
    d = IncrementalDetokenizer(tokenizer, [], ["Th"])  # inside the first token
    assert d.add_tokens(ids) == "" and d.stopped


def test_stop_inside_a_multibyte_character_sequence(tokenizer: Any) -> None:
    text = TEXTS["emoji"]
    ids = tokenizer.encode(text)
    d, deltas = run(tokenizer, ids, stop=["👨‍👩"])
    assert d.stopped and "".join(deltas) == "🎉👍🏽 "
    d, deltas = run(tokenizer, tokenizer.encode(TEXTS["chinese"]), stop=["公园"])
    assert "".join(deltas) == "天气怎么样？我们今天去"


def test_stop_completed_by_flushed_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 符")[:-1]  # ends with a cut character: U+FFFD at flush
    d = IncrementalDetokenizer(tokenizer, [], ["\ufffd"])
    assert "".join(d.add_tokens([i]) for i in ids) == "ok"
    assert d.flush() == " " and d.stopped and d.text == "ok "


def test_no_stop_match_returns_everything(tokenizer: Any) -> None:
    text = TEXTS["mixed"]
    _, deltas = run(tokenizer, tokenizer.encode(text), stop=["nowhere", "Hello 世界!!"])
    assert "".join(deltas) == text


@SETTINGS
@given(
    text=st.sampled_from(sorted(TEXTS.values())) | st.text(max_size=40),
    spans=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 6)), max_size=3),
    extra=st.lists(st.text(min_size=1, max_size=4), max_size=2),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
def test_property_stop_strings(
    tokenizer: Any,
    text: str,
    spans: list[tuple[int, int]],
    extra: list[str],
    sizes: list[int],
) -> None:
    ids = tokenizer.encode(text)
    full = decode(tokenizer, ids)
    stops = [full[a : a + n] for a, n in spans if full[a : a + n]] + extra
    expected, which = expected_stop_cut(full, stops)
    d = IncrementalDetokenizer(tokenizer, [], stops)
    deltas = []
    for c in chunks(ids, sizes):
        deltas.append(d.add_tokens(c))
        assert expected.startswith(d.text)  # never anything past the cut
        if which is None:
            assert not d.stopped
    deltas.append(d.flush())
    assert "".join(deltas) == d.text == expected
    assert d.stopped == (which is not None)
    assert d.stop_string == which


# -- DecodeStream edge cases --------------------------------------------------------


class _FlakyStream:
    """A DecodeStream that raises "Invalid prefix" on chosen steps, once each."""

    fail_at: set[int] = set()  # noqa: RUF012 - set per test
    steps = 0

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False) -> None:
        self._inner = _REAL_DECODE_STREAM(ids=ids, skip_special_tokens=skip_special_tokens)

    def step(self, tokenizer: Any, tid: int) -> str | None:
        _FlakyStream.steps += 1
        if _FlakyStream.steps in _FlakyStream.fail_at:
            raise Exception("Invalid prefix encountered while decoding stream. Token ID: 1")
        return self._inner.step(tokenizer, tid)


_REAL_DECODE_STREAM = detok_module.DecodeStream


@pytest.mark.parametrize("fail_at", [{1}, {3}, {5, 6}, {4, 5, 6, 7, 8}, set(range(1, 400))])
@pytest.mark.parametrize("name", ["mixed", "emoji"])
def test_invalid_prefix_recovery(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, fail_at: set[int], name: str
) -> None:
    monkeypatch.setattr(detok_module, "DecodeStream", _FlakyStream)
    monkeypatch.setattr(_FlakyStream, "fail_at", fail_at)
    monkeypatch.setattr(_FlakyStream, "steps", 0)
    text = TEXTS[name]
    _, deltas = run(tokenizer, tokenizer.encode(text), prompt=tokenizer.encode("Hi"))
    assert_deltas_match(text, deltas)


def test_other_decode_errors_propagate(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(_FlakyStream):
        def step(self, tokenizer: Any, tid: int) -> str | None:
            raise ValueError("boom")

    monkeypatch.setattr(detok_module, "DecodeStream", Broken)
    d = IncrementalDetokenizer(tokenizer, [], [])
    with pytest.raises(ValueError, match="boom"):
        d.add_tokens([5])


def test_old_decode_stream_without_ids(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokenizers < 0.22 has no `ids=`: the stream is primed by stepping the prompt tail."""

    class OldStream:
        def __init__(self, skip_special_tokens: bool = False) -> None:
            self._inner = _REAL_DECODE_STREAM(skip_special_tokens=skip_special_tokens)

        def step(self, tokenizer: Any, tid: int) -> str | None:
            return self._inner.step(tokenizer, tid)

    monkeypatch.setattr(detok_module, "DecodeStream", OldStream)
    prompt = tokenizer.encode("Question: 天气怎么样？")
    text = " Sunny, 晴天 🎉."
    _, deltas = run(tokenizer, tokenizer.encode(text), prompt=prompt)
    assert_deltas_match(text, deltas)


def test_include_stop_str_in_output_keeps_the_stop(tokenizer: Any) -> None:
    ids = tokenizer.encode(" one, two, three, four")
    kept = IncrementalDetokenizer(tokenizer, [], ["three"], include_stop_str_in_output=True)
    text = "".join(kept.add_tokens([t]) for t in ids) + kept.flush()
    assert text == " one, two, three" and kept.stopped
    cut = IncrementalDetokenizer(tokenizer, [], ["three"])
    assert "".join(cut.add_tokens([t]) for t in ids) + cut.flush() == " one, two, "


def test_min_tokens_delays_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("a\nb\nc\nd")  # one token per character
    assert len(ids) == 7
    early = IncrementalDetokenizer(tokenizer, [], ["\n"], min_tokens=0)
    assert "".join(early.add_tokens([t]) for t in ids) == "a"
    # stop strings count from the 4th token on: "\n" (token 2) is given out, token 4 stops
    late = IncrementalDetokenizer(tokenizer, [], ["\n"], min_tokens=4)
    assert "".join(late.add_tokens([t]) for t in ids) == "a\nb" and late.stopped
    short = IncrementalDetokenizer(tokenizer, [], ["\n"], min_tokens=20)
    assert "".join(short.add_tokens([t]) for t in ids) + short.flush() == "a\nb\nc\nd"
