"""The grammar engines side by side on SmolLM2's tokenizer (README, Structured outputs).

xgrammar, llguidance and outlines-core each compile the same JSON schema, regex and choice,
then mask 64 sequences that follow 64 JSON documents token by token (the same documents for
every engine; a token an engine refuses is an error), timing the mask and the advance.

Run it in a scratch venv, outside the project (only xgrammar is a dependency):
    python3 -m venv /tmp/gv && /tmp/gv/bin/pip install torch==2.13.0 protobuf xgrammar llguidance \\
        outlines-core transformers
    PYTHONPATH=. /tmp/gv/bin/python scripts/grammar_engines.py [MODEL_DIR]
MODEL_DIR: an HF folder with the tokenizer (default: the converted embedded GGUF under
~/.cache/sluiceway, which any `sluiceway serve` makes).
"""

from __future__ import annotations

import json
import pathlib
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer

from sluiceway.bench.grammar import PERSON as SCHEMA
from sluiceway.bench.grammar import person_document as document
from sluiceway.router.token_bytes import bytes_to_unicode

REGEX = r"\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}"
CHOICE = "positive|negative|neutral"
SEQS = 64


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def run_steps(
    paths: list[list[int]],
    fill: Callable[[list[int], int], None],
    advance: Callable[[int, int], None],
) -> dict[str, float]:
    """Per step: `fill(live rows, step)` then `advance(row, token)` for each live row."""
    fill_s = advance_s = 0.0
    steps = max(map(len, paths))
    for step in range(steps):
        live = [i for i, p in enumerate(paths) if step < len(p)]
        fill_s += timed(lambda: fill(live, step))[1]  # noqa: B023
        t0 = time.perf_counter()
        for i in live:
            advance(i, paths[i][step])
        advance_s += time.perf_counter() - t0
    return {"mask_ms": fill_s / steps * 1e3, "advance_ms": advance_s / steps * 1e3}


def bench_xgrammar(tok: Any, vocab: int, paths: list[list[int]]) -> dict[str, float]:
    import xgrammar as xgr

    info, tokenizer_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    out = {"tokenizer_s": tokenizer_s}
    compilers = {
        "json": lambda c: c.compile_json_schema(json.dumps(SCHEMA)),
        "regex": lambda c: c.compile_regex(REGEX),
        "choice": lambda c: c.compile_regex(CHOICE),
    }
    for name, compile_ in compilers.items():
        cold = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        out[f"compile_{name}_ms"] = timed(lambda: compile_(cold))[1] * 1e3  # noqa: B023
    compiled = xgr.GrammarCompiler(info, max_threads=2).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in paths]
    bitmask = xgr.allocate_token_bitmask(len(paths), info.vocab_size)
    batch = xgr.BatchGrammarMatcher(max_threads=2)

    def fill(live: list[int], step: int) -> None:
        batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask[: len(live)])

    def advance(i: int, token: int) -> None:
        assert matchers[i].accept_token(token), (i, token)

    return out | run_steps(paths, fill, advance)


def bench_llguidance(tok: Any, vocab: int, paths: list[list[int]]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    lltok, tokenizer_s = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    out = {"tokenizer_s": tokenizer_s}
    grammars = {
        "json": llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)),
        "regex": llguidance.LLMatcher.grammar_from_regex(REGEX),
        "choice": llguidance.LLMatcher.grammar_from_regex(CHOICE),
    }
    for name, grammar in grammars.items():  # compiled lazily: creation and the first mask

        def first_mask(g: str = grammar) -> None:
            m = llguidance.LLMatcher(lltok, g)
            lt.fill_next_token_bitmask(m, lt.allocate_token_bitmask(1, vocab), 0)
            assert not m.is_error(), m.get_error()

        out[f"compile_{name}_ms"] = timed(first_mask)[1] * 1e3
    executor = llguidance.LLExecutor(num_threads=2)
    matchers = [llguidance.LLMatcher(lltok, grammars["json"]) for _ in paths]
    bitmask = lt.allocate_token_bitmask(len(paths), vocab)

    def fill(live: list[int], step: int) -> None:
        lt.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in live], bitmask)

    def advance(i: int, token: int) -> None:
        assert matchers[i].consume_token(token), matchers[i].get_error()

    return out | run_steps(paths, fill, advance)


def bench_outlines_core(tok: Any, vocab: int, paths: list[list[int]]) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import allocate_token_bitmask, fill_next_token_bitmask

    def vocabulary() -> Any:
        decoder = {c: b for b, c in bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        for tid in range(vocab):
            if tid == tok.eos_token_id:
                continue
            s = tok.convert_ids_to_tokens(tid)
            raw = bytes(decoder[c] for c in s) if all(c in decoder for c in s) else s.encode()
            tokens.setdefault(raw, []).append(tid)
        return Vocabulary(tok.eos_token_id, tokens)

    v, tokenizer_s = timed(vocabulary)
    out = {"tokenizer_s": tokenizer_s}
    regexes = {
        "json": build_regex_from_schema(json.dumps(SCHEMA)),
        "regex": REGEX,
        "choice": CHOICE,
    }
    indexes = {}
    for name, regex in regexes.items():
        indexes[name], seconds = timed(lambda: Index(regex, v))  # noqa: B023
        out[f"compile_{name}_ms"] = seconds * 1e3
    guides = [Guide(indexes["json"]) for _ in paths]
    no_eos = [p[:-1] for p in paths]  # its guides end at the document's end

    def fill(live: list[int], step: int) -> None:
        for i in live:
            fill_next_token_bitmask(guides[i], allocate_token_bitmask(vocab))

    def advance(i: int, token: int) -> None:
        guides[i].advance(token)

    return out | run_steps(no_eos, fill, advance)


def main() -> None:
    model = pathlib.Path(
        sys.argv[1]
        if len(sys.argv) > 1
        else next((pathlib.Path.home() / ".cache/sluiceway/gguf").glob("*/config.json")).parent
    )
    tok = AutoTokenizer.from_pretrained(model)
    vocab = len(tok)
    rnd = random.Random(0)
    paths = [[*tok.encode(document(rnd, i), add_special_tokens=False), tok.eos_token_id]
             for i in range(SEQS)]  # fmt: skip
    print(f"{model.name}: vocabulary {vocab}, {SEQS} documents, {torch.get_num_threads()} threads")
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                        ("outlines-core", bench_outlines_core)):  # fmt: skip
        figures = bench(tok, vocab, paths)
        print(name, json.dumps({k: round(v, 3) for k, v in figures.items()}), flush=True)


if __name__ == "__main__":
    main()
