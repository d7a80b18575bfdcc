"""`sluiceway bench grammar`: what structured outputs cost the worker.

Compile time of one constraint of each kind (cold, then from the compiler's cache), and the
per-step cost of the token mask at ``--num-seqs`` constrained sequences: the matchers' fill
of the packed bitmask, its application to ``[num_seqs, V]`` float32 logits and the matchers'
advance by one token, each timed over every step of JSON documents that follow the schema
(the same documents every run, tokenized as the model would write them).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from sluiceway.argtypes import positive_int
from sluiceway.v1 import inference_pb2

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json (6-property schema)": inference_pb2.StructuredOutputs(json=json.dumps(PERSON)),
    "json_object": inference_pb2.StructuredOutputs(json_object=True),
    "regex (phone number)": inference_pb2.StructuredOutputs(
        regex=r"\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}"
    ),
    "choice (3 strings)": inference_pb2.StructuredOutputs(
        choice=inference_pb2.Choices(choices=["positive", "negative", "neutral"])
    ),
    "grammar (EBNF)": inference_pb2.StructuredOutputs(
        grammar='root ::= "yes" | "no" | "maybe, " [0-9] [0-9] "%"'
    ),
}
WORDS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]


def person_document(rnd: random.Random, i: int) -> str:
    """A JSON document valid against PERSON, as a model would write it."""
    return json.dumps(
        {
            "name": f"{rnd.choice(WORDS).title()} {rnd.choice(WORDS).title()}",
            "age": rnd.randint(0, 99),
            "email": f"{rnd.choice(WORDS)}.{i}@example.com",
            "tags": rnd.sample(WORDS, rnd.randint(0, 4)),
            "role": rnd.choice(["admin", "user", "guest"]),
            "address": {"city": rnd.choice(WORDS).title(), "zip": f"{rnd.randint(10000, 99999)}"},
        }
    )


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF folder or .gguf whose tokenizer to compile for "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )  # fmt: skip
    p.add_argument(
        "--num-seqs", type=positive_int, default=64, help="constrained sequences per step"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the JSON documents")


def grammar_command(args: argparse.Namespace) -> int:
    """Prints the compile times and the per-step mask cost; returns 0."""
    # here, not at the top: building the CLI parser (add_grammar_args) imports no torch
    import torch
    from transformers import AutoTokenizer

    from sluiceway.model_files import resolve_model, served_model_name
    from sluiceway.worker.loader import load_config
    from sluiceway.worker.structured_output import (
        GrammarCompiler,
        allow_all_bitmask,
        apply_token_bitmask,
    )

    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    grammars = GrammarCompiler(model_dir, config.vocab_size, list(config.eos_token_ids))
    grammars.compile(CONSTRAINTS["choice (3 strings)"])
    print(f"xgrammar on {served_model_name(model_dir)}'s tokenizer (vocabulary {config.vocab_size}): "
          f"ready in {time.perf_counter() - t0:.2f} s, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'compile':<40}{'cold':>10}{'cached':>12}")
    for name, constraint in CONSTRAINTS.items():
        grammars.clear_cache()
        _, cold = grammars.compile(constraint)
        _, cached = grammars.compile(constraint)
        print(f"{name:<40}{cold * 1e3:>7.2f} ms{cached * 1e3:>9.3f} ms")

    rnd = random.Random(args.seed)
    eos = int(config.eos_token_ids[0])
    paths = [
        [*tokenizer.encode(person_document(rnd, i), add_special_tokens=False), eos]
        for i in range(args.num_seqs)
    ]
    constraint = CONSTRAINTS["json (6-property schema)"]
    matchers = [grammars.matcher(constraint) for _ in paths]
    logits = torch.zeros(args.num_seqs, config.vocab_size)
    rows = list(range(args.num_seqs))
    fill_s: list[float] = []
    apply_s: list[float] = []
    accept_s: list[float] = []
    for step in range(max(map(len, paths))):
        live = [j for j in rows if step < len(paths[j])]
        bitmask = allow_all_bitmask(args.num_seqs, config.vocab_size)
        t0 = time.perf_counter()
        for j in live:
            matchers[j].fill(bitmask, j)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, bitmask, live)
        t2 = time.perf_counter()
        for j in live:
            if not bitmask[j, paths[j][step] // 32] >> (paths[j][step] % 32) & 1:
                raise RuntimeError(f"document {j}: token {step} masked out")
            matchers[j].accept([paths[j][step]])
        t3 = time.perf_counter()
        if len(live) == args.num_seqs:  # full steps only
            fill_s.append(t1 - t0)
            apply_s.append(t2 - t1)
            accept_s.append(t3 - t2)
    print(f"per step at {args.num_seqs} constrained sequences "
          f"(median of {len(fill_s)} steps of JSON documents):")  # fmt: skip
    total = 0.0
    for label, times in (("fill bitmask", fill_s), ("apply to logits", apply_s),
                         ("advance matchers", accept_s)):  # fmt: skip
        ms = statistics.median(times) * 1e3
        total += ms
        print(f"{label:<40}{ms:>7.2f} ms{ms * 1e3 / args.num_seqs:>9.1f} us/seq")
    print(f"{'total':<40}{total:>7.2f} ms")
    return 0
