"""Each token's own bytes (router/token_bytes.py): byte-level BPE (SmolLM2's tokenizer) and a
SentencePiece-style tokenizer with byte fallback (Llama 2's, Gemma's form), built here."""

from __future__ import annotations

import pytest

from sluiceway.router.openai_logprobs import TextOffsets
from sluiceway.router.token_bytes import TokenBytes, bytes_to_unicode, display_text

EMOJI = "Reply with exactly these emoji: 🍎 🚀 😀 💚"


@pytest.fixture(scope="module")
def smollm2():  # type: ignore[no-untyped-def]
    from sluiceway.model_files import resolve_model
    from sluiceway.router.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


def test_gpt2_byte_table() -> None:
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert (table[ord("A")], table[ord(" ")], table[ord("\n")], table[0xF0], table[0x9F]) == (
        "A", "Ġ", "Ċ", "ð", "Ł",
    )  # fmt: skip


def test_display_text_escapes_only_the_bytes_of_incomplete_characters() -> None:
    assert display_text(b" \xf0\x9f") == " \\xf0\\x9f"
    assert display_text("🍎".encode()) == "🍎"
    assert display_text(b"\x8e caf\xc3\xa9") == "\\x8e café"


def test_byte_level_bpe_split_emoji(smollm2) -> None:  # type: ignore[no-untyped-def]
    tb = TokenBytes(smollm2)
    ids = [int(i) for i in smollm2.encode(EMOJI)]
    pieces = [tb.token_bytes(i) for i in ids]
    assert b"".join(pieces) == EMOJI.encode()
    # " 💚" is F0 9F 92 9A over three tokens: ' ðŁ', 'Ĵ', 'ļ'
    assert ids[-3:] == [15107, 236, 244]
    assert pieces[-3:] == [b" \xf0\x9f", b"\x92", b"\x9a"]
    assert [tb.entry(i, True)[0] for i in ids[-3:]] == [" \\xf0\\x9f", "\\x92", "\\x9a"]
    offsets = TextOffsets()
    assert [offsets.advance(p) for p in pieces][-6:] == [34, 35, 36, 37, 38, 38]
    assert offsets.chars == len(EMOJI) == 39


def test_special_tokens_add_no_bytes_when_the_text_skips_them(smollm2) -> None:  # type: ignore[no-untyped-def]
    tb = TokenBytes(smollm2)
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    assert tb.is_special(im_end)
    assert tb.entry(im_end, True) == ("<|im_end|>", b"")
    assert tb.entry(im_end, False) == ("<|im_end|>", b"<|im_end|>")


@pytest.mark.parametrize("metaspace", [False, True])
def test_sentencepiece_byte_fallback(metaspace: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁": 1, "▁hello": 2, "▁world": 3, "é": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    if metaspace:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    else:
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ])  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tb = TokenBytes(fast)
    assert tb.token_bytes(2) == b" hello"
    assert tb.token_bytes(5 + 0xF0) == b"\xf0"
    assert tb.entry(5 + 0xF0, True) == ("\\xf0", b"\xf0")
    assert tb.token_bytes(4) == "é".encode()
    if not metaspace:  # byte fallback: an emoji the vocabulary lacks is its 4 byte tokens
        ids = [2, 1, *(5 + b for b in "🍎".encode())]
        assert fast.decode(ids) == "hello 🍎"  # the decoder strips the text's first space
        assert b"".join(tb.token_bytes(i) for i in ids) == " hello 🍎".encode()
