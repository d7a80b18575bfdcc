"""`sluiceway bench quality` on a tiny random model with a byte-level tokenizer: perplexity
against transformers' float32 forward, agreement of identical modes, the mode syntax, and the
printed table."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest
import torch

from sluiceway.bench.quality import (
    mode_options,
    parse_mode,
    score_mode,
    select_texts,
)
from sluiceway.cli import main
from sluiceway.router.tokenizer import load_tokenizer
from tests.worker.tiny_models import make_tiny_model

NUM_TEXTS = 4
MAX_TOKENS = 40
BUDGET = 24  # tokens per step: texts of 16..40 tokens are chunked and packed


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny Llama (vocab 256) with a byte-level tokenizer: one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = make_tiny_model(tmp_path_factory.mktemp("quality") / "m", "llama-untied", seed=3)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def _texts(model_dir: pathlib.Path) -> list[list[int]]:
    return select_texts(load_tokenizer(model_dir), NUM_TEXTS, MAX_TOKENS, seed=0)


def test_perplexity_equals_transformers_float32(model_dir: pathlib.Path) -> None:
    """exp(mean NLL) through the runner's chunked, packed steps equals transformers' float32
    forward on the same ids to 1e-4 (relative), as does each token's logprob (1e-4)."""
    from transformers import AutoModelForCausalLM

    texts = _texts(model_dir)
    assert [len(t) for t in texts] == [MAX_TOKENS] * NUM_TEXTS  # byte tokens: long turns
    score = score_mode(model_dir, "ref", {"dtype": "float32"}, texts, max_num_batched_tokens=BUDGET)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for ids, got in zip(texts, score.logprobs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got), lp, atol=1e-4, rtol=0)
        nll -= lp.double().sum().item()
        count += len(ids) - 1
    assert score.tokens == count == NUM_TEXTS * (MAX_TOKENS - 1)
    assert score.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_identical_mode_agrees_everywhere(model_dir: pathlib.Path) -> None:
    """A mode identical to the reference: top-1 agreement 1.0 and the same perplexity
    (bitwise: the same steps); a bfloat16 mode scores the same tokens."""
    texts = _texts(model_dir)
    ref = score_mode(model_dir, "a", {"dtype": "float32"}, texts, max_num_batched_tokens=BUDGET)
    same = score_mode(model_dir, "b", {"dtype": "float32"}, texts, max_num_batched_tokens=BUDGET)
    assert same.agreement(ref) == 1.0
    assert same.perplexity == ref.perplexity
    bf16 = score_mode(model_dir, "c", {"dtype": "bfloat16"}, texts, max_num_batched_tokens=BUDGET)
    assert bf16.tokens == ref.tokens
    assert 0.5 < bf16.agreement(ref) <= 1.0


def test_parse_mode() -> None:
    """Mode keys are the worker's flags (any spelling), values checked by the flag's choices
    and type; bad modes are one line naming the mode and the flag."""
    options = mode_options()
    assert {"dtype", "attention_backend", "block_size", "device"} <= set(options)
    assert "model" not in options and "kv_cache_memory" not in options
    assert parse_mode("dtype=bfloat16, --attention-backend=torch,block-size=8", options) == {
        "dtype": "bfloat16",
        "attention_backend": "torch",
        "block_size": 8,
    }
    for text, words in [
        ("dtype=int3", "mode 'dtype=int3': --dtype: one of auto, float32, bfloat16, float16"),
        ("block_size=0", "--block-size: must be >= 1"),
        ("model=x", "'model' is not a mode key (one of "),
        ("dtype", "'dtype' is not key=value"),
        ("dtype=float32,dtype=float32", "--dtype given twice"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_mode(text, options)


def test_cli_prints_the_table(
    model_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench quality` prints the reference's row and the mode's, and --json the same."""
    out_json = tmp_path / "q.json"
    argv = ["bench", "quality", "--model", str(model_dir), "--num-texts", "2"]
    argv += ["--max-tokens-per-text", "20", "--max-num-batched-tokens", "16"]
    argv += ["--mode", "dtype=float32,attention_backend=torch", "--json", str(out_json)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("mode "))) :]
    assert table[0].split() == [
        "mode", "perplexity", "ratio", "top-1", "agreement", "tokens", "weights", "MB"
    ]  # fmt: skip
    ref, mode = table[1].split(), table[2].split()
    report = json.loads(out_json.read_text())
    weights_mb = [
        f"{r['model_weight_bytes'] / 1e6:.1f}" for r in (report["reference"], *report["modes"])
    ]
    assert ref[:2] == ["dtype=float32,quantization=none", "(reference)"]
    assert ref[3:] == ["1.0000", "1.0000", "38", weights_mb[0]]
    assert mode[0] == "dtype=float32,attention_backend=torch"
    assert mode[-2:] == ["38", weights_mb[1]]
    assert report["reference"]["quantization"] == report["modes"][0]["quantization"] == "none"
    assert report["num_texts"] == 2 and report["reference"]["tokens_scored"] == 38
    assert report["modes"][0]["attention_backend"] == "torch"
    assert report["modes"][0]["perplexity_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert f"{report['reference']['perplexity']:.4f}" == ref[2]


def test_cli_bad_mode_is_one_line(
    model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "quality", "--model", str(model_dir), "--mode", "dtype=fp4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sluiceway bench quality: mode 'dtype=fp4': --dtype: one of")
    assert "\n" not in err
