"""The embedded GGUF: our conversion against transformers' own GGUF loader (slow: ~1 min)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from sluiceway.model_files import resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk
from tests.oracle import greedy

pytestmark = pytest.mark.slow


_CONVERT = (
    "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
    "from sluiceway.model_files import resolve_model; print(resolve_model(None))"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def converted(cache: pathlib.Path) -> pathlib.Path:
    """The embedded GGUF converted by two processes started at the same moment."""
    env = {**os.environ, "SLUICEWAY_CACHE_DIR": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONVERT],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert sum(err.count("converted ") for _, err in outs) == 1  # one conversion, one waiter
    return pathlib.Path(paths.pop())


def test_conversion_folder(converted: pathlib.Path, cache: pathlib.Path) -> None:
    assert converted.parent == cache / "gguf"
    assert sorted(p.name for p in converted.parent.iterdir() if p.is_dir()) == [converted.name]
    files = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert resolve_model_again(cache) == converted


def resolve_model_again(cache: pathlib.Path) -> pathlib.Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("SLUICEWAY_CACHE_DIR", str(cache))
    try:
        return resolve_model(None)
    finally:
        mp.undo()


def test_state_dict_matches_transformers(converted: pathlib.Path, oracle) -> None:  # type: ignore[no-untyped-def]
    ours = load_file(converted / "model.safetensors")
    theirs = {k: v for k, v in oracle.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name
    assert oracle.config.tie_word_embeddings


def test_greedy_matches_transformers(converted: pathlib.Path, oracle) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.chat_template
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [tok(chat)["input_ids"], tok("The three primary colors are")["input_ids"]]
    runner = ModelRunner(converted, dtype="float32", kv_cache_memory=64 * 2**20)
    assert runner.model_id == "SmolLM2-135M-Instruct"
    assert runner.eos_token_ids == [2]
    seqs = [
        runner.make_sequence(i, p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)
    ]
    next_block = 0
    computed = [0, 0]
    for _ in range(16):
        chunks = []
        for i, s in enumerate(seqs):
            while len(s.block_table) * runner.block_size < len(s.token_ids):
                s.block_table.append(next_block)
                next_block += 1
            chunks.append(ScheduledChunk(s, computed[i], len(s.token_ids) - computed[i]))
            computed[i] = len(s.token_ids)
        for s, t in zip(seqs, runner.execute(chunks), strict=True):
            assert t.seq_id == s.seq_id
            s.token_ids.append(t.token_id)
    for s, p in zip(seqs, prompts, strict=True):
        ours = s.token_ids[len(p) :]
        # transformers' generate stops at EOS: equal up to and including it
        ref = oracle.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.int64),
            max_new_tokens=16,
            do_sample=False,
        )[0, len(p) :].tolist()
        assert ours[: len(ref)] == ref
        # and all 16 tokens, ignoring EOS, against transformers' forward with its KV cache
        assert ours == greedy(oracle, p, 16)
