"""Model families beyond Llama on tiny random checkpoints that transformers writes: Phi-3 (its
checkpoint packs q/k/v and gate/up) and Llama 3's rope scaling past its original context;
greedy token ids equal transformers' in float32. And the one-line refusals of what is not
implemented."""

from __future__ import annotations

import json
import pathlib

import pytest

from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.architectures import ARCHITECTURES, UnsupportedModelError
from sluiceway.worker.model import ModelConfig
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk
from tests.oracle import greedy

PROMPT_LEN = 70
NEW_TOKENS = 40


def _runner_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of our runner: the prompt in one chunk, then one token a step."""
    seq = runner.make_sequence(0, list(prompt), SamplingParams(temperature=0.0))
    blocks = len(prompt) + n
    seq.block_table.extend(range(-(-blocks // runner.block_size)))
    chunk = ScheduledChunk(seq, 0, len(prompt))
    out: list[int] = []
    while len(out) < n:
        (token,) = runner.execute([chunk])
        out.append(token.token_id)
        seq.token_ids.append(token.token_id)
        chunk = ScheduledChunk(seq, len(seq.token_ids) - 1, 1)
    return out


@pytest.mark.parametrize("variant", ["phi3", "llama3-rope-bias"])
def test_greedy_matches_transformers(tiny_models: dict[str, pathlib.Path], variant: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_models[variant]
    cfg = json.loads((model_dir / "config.json").read_text())
    if variant == "llama3-rope-bias":  # positions run past the original context
        rope = cfg["rope_parameters"]
        assert rope["rope_type"] == "llama3"
        assert rope["original_max_position_embeddings"] + 32 < PROMPT_LEN + NEW_TOKENS
    else:
        assert cfg["architectures"] == ["Phi3ForCausalLM"]
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    oracle = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(model_dir, dtype="float32", block_size=16, kv_cache_memory=1 << 20)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        prompt = torch.randint(3, 256, (PROMPT_LEN,), generator=gen).tolist()
        expected = greedy(oracle, prompt, NEW_TOKENS)
        assert len(set(expected)) > 5  # not one token repeated: the test can tell
        assert _runner_greedy(runner, prompt, NEW_TOKENS) == expected


def _phi3_config(**changes: object) -> dict[str, object]:
    return {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        **changes,
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8}},
            "rope scaling 'longrope' is not implemented (supported: default, linear, llama3)",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                 "partial_rotary_factor": 0.75}},
            "partial_rotary_factor 0.75 is not implemented (rotary over whole heads only)",
        ),
        (
            {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},
            "architecture Gemma2ForCausalLM is not implemented; supported: "
            + ", ".join(ARCHITECTURES),
        ),
        (
            {"architectures": None, "model_type": "gpt2"},
            "architecture model_type 'gpt2' is not implemented; supported: "
            + ", ".join(ARCHITECTURES),
        ),
    ],
)  # fmt: skip
def test_what_is_not_implemented_is_refused_in_one_line(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf_dict(_phi3_config(**changes))
    assert str(e.value) == message


def test_phi3_config() -> None:
    c = ModelConfig.from_hf_dict(_phi3_config(rope_parameters={"rope_type": "default",
                                                               "rope_theta": 1e4,
                                                               "partial_rotary_factor": 1.0}))  # fmt: skip
    assert (c.model_type, c.head_dim, c.num_kv_heads, c.rope_scaling) == ("phi3", 16, 2, None)
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias)
