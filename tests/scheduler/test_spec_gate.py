"""The speculation gate: an A/B of speculating and plain decoding on the steps themselves."""

from __future__ import annotations

import random

import pytest

from sluiceway.spec_gate import SpeculationGate, StreamGuard


def _run(gate: SpeculationGate, batch: int, steps: int, goodput: dict[bool, float],
         noise: float = 0.0, seed: int = 0) -> list[bool]:  # fmt: skip
    """`steps` decode steps of `batch` sequences whose goodput (tokens per second) is
    `goodput[policy]` times a uniform factor in 1 +- `noise`; the policies chosen, in order."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        speculate = gate.choose(batch)
        chosen.append(speculate)
        rate = goodput[speculate] * (1.0 + rng.uniform(-noise, noise))
        emitted = [2 if speculate else 1] * batch  # every stream gains alike
        gate.observe(speculate, emitted, sum(emitted) / rate)
    return chosen


def test_speculation_stays_on_where_it_pays_exploring_less_and_less() -> None:
    """1.3x plain (a draft model at one stream): plain decoding is explored every other step
    until three such steps were compared, then every 32nd step, the interval doubling after
    each three explored steps that kept speculation, up to every 256th."""
    gate = SpeculationGate()
    chosen = _run(gate, 1, 1332, {True: 130.0, False: 100.0}, noise=0.05)
    plain = [i for i, c in enumerate(chosen, 1) if not c]
    assert plain == [2, 4, 6, 64, 128, 192, 256, 384, 512, 768, 1024, 1280]
    assert gate.speculating(1)


def test_speculation_turns_off_where_it_loses_after_three_explored_steps() -> None:
    """0.67x plain (a draft model at 32 streams on the Intel Xeon): the gate starts
    speculating, compares every other step (plain) with the step before it, and after the
    third such pair runs plain decoding, speculating at steps 32, 64, 96, then every 64th,
    128th, 256th: over 1,000 steps (a bench run at 32 streams has about as many) the policy
    costs 0.6% against plain decoding."""
    gate = SpeculationGate()
    chosen = _run(gate, 32, 6, {True: 67.0, False: 100.0}, noise=0.05)
    assert chosen == [True, False] * 3
    assert not gate.speculating(32)
    chosen += _run(gate, 32, 994, {True: 67.0, False: 100.0}, noise=0.05, seed=1)
    speculated = [i for i, c in enumerate(chosen, 1) if c]
    assert speculated == [1, 3, 5, 32, 64, 96, 128, 192, 256, 384, 512, 640, 768]
    cost = (chosen.count(True) / 67.0 + chosen.count(False) / 100.0) / (len(chosen) / 100.0)
    assert round(cost, 3) == 1.006


def test_each_batch_class_decides_apart_and_one_not_measured_follows_the_nearest() -> None:
    assert [SpeculationGate.batch_class(b) for b in (0, 1, 2, 3, 4, 7, 8, 31, 32)] == [
        1, 1, 2, 2, 3, 3, 4, 5, 6,
    ]  # fmt: skip
    gate = SpeculationGate()
    _run(gate, 1, 64, {True: 130.0, False: 100.0})
    _run(gate, 32, 64, {True: 67.0, False: 100.0})
    assert [gate.speculating(b) for b in (1, 4, 32, 40, 64)] == [True, True, False, False, False]
    chosen = _run(gate, 64, 16, {True: 50.0, False: 100.0})
    assert chosen == [False, True] * 3 + [False] * 10  # started plain, explored speculation
    _run(gate, 4, 64, {True: 90.0, False: 100.0})
    # 2-3: as near 1 (speculating) as 4-7 (plain): the larger decides
    assert [gate.speculating(b) for b in (1, 2, 4, 8)] == [True, False, False, False]


def test_a_workload_that_turns_repetitive_turns_speculation_back_on() -> None:
    gate = SpeculationGate()
    _run(gate, 8, 64, {True: 80.0, False: 100.0})
    assert not gate.speculating(8)
    chosen = _run(gate, 8, 64, {True: 150.0, False: 100.0}, seed=2)
    assert gate.speculating(8)
    assert chosen[-16:-1] == [True] * 15  # (the 128th step explores plain decoding)


def test_a_10_percent_difference_wins_through_10_percent_noise() -> None:
    """Per-step noise as large as the difference: over 2,000 steps at least 90% run the
    better policy, whichever it is."""
    for better in (True, False):
        gate = SpeculationGate()
        goodput = {better: 110.0, not better: 100.0}
        chosen = _run(gate, 16, 2000, goodput, noise=0.10, seed=3)
        assert chosen.count(better) >= 0.9 * len(chosen), (better, chosen.count(better))


def test_a_tie_goes_to_plain_decoding_and_speculation_must_win_by_2_percent() -> None:
    gate = SpeculationGate()
    _run(gate, 32, 24, {True: 100.0, False: 99.0})  # plain within 2%: plain
    assert not gate.speculating(32)
    _run(gate, 32, 200, {True: 101.5, False: 100.0})  # speculation 1.5% ahead: stays plain
    assert not gate.speculating(32)
    _run(gate, 32, 200, {True: 103.0, False: 100.0})
    assert gate.speculating(32)
    _run(gate, 32, 200, {True: 101.0, False: 100.0})  # plain within 2% again
    assert not gate.speculating(32)


def test_a_step_without_tokens_or_time_is_ignored() -> None:
    gate = SpeculationGate()
    assert not gate.observe(False, [], 0.01)
    assert not gate.observe(False, [1, 0], 0.01)  # (a cancelled sequence)
    assert not gate.observe(False, [1], 0.0)
    assert gate.speculating(1)


def test_a_draft_model_is_not_tried_again_where_plain_decoding_won() -> None:
    """An explored speculative step of a draft model computes the draft's K/V for every token
    since its sequences' last proposal (7 s at 32 streams): once plain decoding won a class,
    it runs there for good; where speculation runs, plain decoding is still explored."""
    gate = SpeculationGate(draft_catches_up=True)
    chosen = _run(gate, 32, 1024, {True: 67.0, False: 100.0})
    assert chosen[:24] == ([True] * 7 + [False]) * 3 and not any(chosen[24:])
    assert not gate.speculating(32)
    chosen = _run(gate, 64, 64, {True: 130.0, False: 100.0})  # follows 32: plain, stays
    assert not any(chosen)
    gate = SpeculationGate(draft_catches_up=True)
    chosen = _run(gate, 1, 64, {True: 130.0, False: 100.0})
    assert [i for i, c in enumerate(chosen, 1) if not c] == [8, 16, 24, 64]


def test_catch_up_steps_count_at_their_full_cost() -> None:
    """Speculating steps 1.28x plain's goodput (a draft model at 4 streams: 71 ms for 15
    tokens against 24 ms for 4) but every 8th one a 10x slower catch-up (a new sequence's
    prompt through the draft): 0.7x overall, and the gate runs plain decoding."""
    gate = SpeculationGate(draft_catches_up=True)
    steps = 0
    for _ in range(48):
        speculate = gate.choose(4)
        if speculate:
            steps += 1
            slow = 10.0 if steps % 8 == 0 else 1.0
            gate.observe(True, [4, 4, 4, 3], 0.071 * slow)
        else:
            gate.observe(False, [1, 1, 1, 1], 0.024)
    assert not gate.speculating(4)


def test_a_class_met_only_in_prefill_steps_follows_the_measured_ones() -> None:
    """At 32 streams the batch dips to 16-31 while a wave of prompts comes in: steps that
    prefill, which the gate does not measure. That class, created speculating before 32 was
    measured, follows 32 once it runs plain (each such step would otherwise compute the
    draft's K/V for every prompt of the wave)."""
    gate = SpeculationGate()
    assert gate.choose(20)  # created before anything was measured: speculate
    _run(gate, 32, 64, {True: 67.0, False: 100.0})
    assert not gate.speculating(32)
    assert not any(gate.choose(20) for _ in range(64))


def test_speculation_that_speeds_a_few_streams_and_slows_the_typical_one_turns_off() -> None:
    """n-gram lookup at 4 streams: one stream's proposals accepted (4 tokens), the other three
    without one, and the step 25% longer than a plain one (its rows): 7 tokens against 4, 1.4x
    the goodput, but the median stream emits 1 token in 1.25x the time. Plain decoding wins;
    with two of the four accepting, the median stream gains too and speculation stays."""
    for accepting, expected in ((1, False), (2, True)):
        gate = SpeculationGate()
        for _ in range(64):
            speculate = gate.choose(4)
            if speculate:
                gate.observe(True, [4] * accepting + [1] * (4 - accepting), 0.025)
            else:
                gate.observe(False, [1, 1, 1, 1], 0.020)
        assert gate.speculating(4) == expected, accepting


def _guard(plain_s: float, spec_s: float, batch: int, extra_rows: int) -> StreamGuard:
    """A guard that measured ten plain steps of `batch` sequences (ids 100...) at `plain_s`
    each, then ten speculating ones with `extra_rows` proposed tokens at `spec_s` each."""
    guard = StreamGuard()
    seq_ids = list(range(100, 100 + batch))
    for _ in range(10):
        guard.observe(seq_ids, [1] * batch, batch, plain_s)
    for _ in range(10):
        guard.observe(seq_ids, [2] * batch, batch + extra_rows, spec_s)
    return guard


def test_the_guard_predicts_a_steps_cost_from_the_measured_seconds_per_extra_row() -> None:
    """n-gram lookup at 4 streams on the Intel Xeon: plain steps 28 ms, speculating steps with
    16 proposed tokens 58 ms: 30 ms / 16 rows over 28 ms, so 8 proposed tokens cost 1.54x.
    Each speculating step settled 2 tokens in 58/28 plain steps' time on each account."""
    guard = _guard(0.028, 0.058, 4, 16)
    assert guard.cost_ratio(4, 16) == pytest.approx(58 / 28)
    assert guard.cost_ratio(5, 8) == pytest.approx(1 + 15 / 28)  # (4-7: one class)
    assert guard.account(100) == pytest.approx(10 * (2 - 58 / 28))
    assert guard.cost_ratio(8, 8) is None  # another class: nothing measured
    guard.observe(list(range(8)), [1] * 8, 8, 0.040)
    assert guard.cost_ratio(8, 8) is None  # plain only: no extra row measured
    guard.forget(100)
    assert guard.account(100) == 0.0


def test_the_guard_lets_a_step_speculate_only_where_no_stream_loses_more_than_5pc() -> None:
    """At 58/28 = 2.07x a plain step's time, a stream that has emitted 10 tokens (5% of them:
    half a plain step of tolerance) and gained nothing yet must expect 1.57 tokens or more; a
    stream without a proposal (1 token) keeps the step plain, unless it gained enough in
    earlier steps or has emitted enough tokens for its 5% to cover the loss. One stream (the
    gate's own measure), a step with no proposal and a class not yet measured pass."""
    guard = _guard(0.028, 0.058, 4, 16)
    ids, done = [1, 2, 3, 4], [10] * 4
    assert guard.allows(ids, done, [4, 4, 4, 4], [3.5, 3.0, 2.5, 1.6])
    assert not guard.allows(ids, done, [4, 4, 4, 4], [3.5, 3.0, 2.5, 1.5])
    assert not guard.allows(ids, done, [4, 4, 4, 0], [3.5, 3.0, 2.5, 1.0])
    assert guard.allows(ids, [10, 10, 10, 22], [4, 4, 4, 0], [3.5, 3.0, 2.5, 1.0])
    guard.observe(ids, [3, 3, 3, 5], 20, 0.058)  # stream 4 gained 5 - 2.07 plain steps
    assert guard.allows(ids, done, [4, 4, 4, 0], [3.5, 3.0, 2.5, 1.0])
    assert guard.allows(ids, done, [2, 2, 2, 2], [1.6, 1.6, 1.6, 1.6])  # 8 rows: 1.54x
    assert guard.allows([1], [0], [4], [1.0])
    assert guard.allows([1, 2], [0, 0], [0, 0], [1.0, 1.0])
    assert guard.allows(list(range(8)), [0] * 8, [4] * 8, [1.0] * 8)
