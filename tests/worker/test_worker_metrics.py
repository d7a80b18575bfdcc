"""The worker's step phase: prefill or decode, whatever the prompt's length."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.metrics import init_series, step_phase
from sluiceway.worker.model_runner import ScheduledChunk, SequenceData


def chunk(tokens: int, prompt: int, computed: int, new: int) -> ScheduledChunk:
    """A chunk of a sequence of `tokens` tokens, the first `prompt` of them its prompt."""
    seq = SequenceData(1, list(range(tokens)), [0], SamplingParams(), num_prompt_tokens=prompt)
    return ScheduledChunk(seq, computed, new)


def test_a_one_token_prompt_is_a_prefill_step() -> None:
    assert step_phase([chunk(1, prompt=1, computed=0, new=1)]) == "prefill"
    # ... alone or beside decodes
    decode = chunk(9, prompt=5, computed=8, new=1)
    assert step_phase([decode, chunk(1, prompt=1, computed=0, new=1)]) == "prefill"


def test_decode_prefill_chunks_and_recompute() -> None:
    assert step_phase([chunk(9, prompt=5, computed=8, new=1)]) == "decode"
    assert step_phase([chunk(9, 5, 8, 1), chunk(7, 3, 6, 1)]) == "decode"
    assert step_phase([chunk(5, prompt=5, computed=0, new=5)]) == "prefill"
    assert step_phase([chunk(5, prompt=5, computed=4, new=1)]) == "prefill"  # last prompt chunk
    # a preempted sequence recomputing its generated tokens: prefill, one token at a time too
    assert step_phase([chunk(9, prompt=5, computed=5, new=4)]) == "prefill"
    assert step_phase([chunk(9, prompt=5, computed=6, new=1)]) == "prefill"


def test_init_series_exports_both_phases_at_zero() -> None:
    init_series("unit-phases")
    for phase in ("prefill", "decode"):
        labels = {"model_name": "unit-phases", "phase": phase}
        assert REGISTRY.get_sample_value("sluiceway:forward_seconds_count", labels) == 0.0
