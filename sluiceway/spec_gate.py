"""Whether speculative decoding runs at all at a given batch size: an A/B test of the two
policies on the steps themselves (:class:`SpeculationGate`); and whether a step the gate chose
to speculate does, given its streams' proposals (:class:`StreamGuard`).

:class:`~sluiceway.speculative.AdaptiveLength` used to predict from a fitted cost model how long
a proposal pays. A model misses what it does not model (a draft model's catch-up forwards, its
sampling and bookkeeping per proposal, the prefill-path attention of a chunk of several
queries), and at 4-32 streams a draft model ran 0.67-0.78x plain decoding with the model's
limit still above zero. The gate measures instead: per batch-size class it runs one policy
(speculate, or decode plainly) and every :attr:`SpeculationGate.EXPLORE_EVERY`-th step the
other, and compares that step's goodput (tokens emitted per second of the step) with the
recent steps' of the policy in use (their tokens over their seconds, the last ten or so
weighted most), which ran at about the same batch (a pair of neighbours:
the batch drifts slowly, so the pair cancels it). Each step is measured twice: its goodput,
and its typical stream's pace (the median over its sequences of the tokens each emitted, per
second of the step): speculation that adds tokens to a few streams while every stream's step
takes longer raises the one and lowers the other (n-gram lookup at 4 streams: 1.04x the
throughput with a 17% longer TPOT median). Speculation must win on both. The gate switches
to speculation when it beats plain decoding by :attr:`SpeculationGate.MARGIN` on both on
average over recent pairs, and to plain decoding when plain decoding comes within ``MARGIN``
of it on either: a tie goes to plain decoding, whose per-stream latency is steadier (at 32
streams n-gram lookup matched plain decoding's throughput with a 7-9% longer TPOT median).
The slowest stream's pace is not a third measure: a stream whose proposals miss, or a reply
in its last tokens, emits one token in a step the others' rows made longer, and weighing it
(the fewest tokens a sequence emitted per second) cost n-gram lookup at 4 streams on
`repeat` 1.43x -> 1.13x plain decoding's throughput while the requests that ended more than
5% later went only from 25 to 18 of 128 (the gate cannot follow which streams share a
step): :class:`StreamGuard` weighs them per step instead. What the
exploration costs: one step in ``EXPLORE_EVERY`` under the worse policy, one in 64, 128, then
256 as explored steps keep confirming it (one in ``EXPLORE_FIRST``, every other step, until a
batch class's first decision); a draft model with a KV pool of its own is not tried again
where plain decoding won (its explored step would first catch its draft up; a draft that
reads the model's K/V is explored as n-gram lookup is).

A step that leaves plain decoding for speculation carries the draft model's catch-up (the
tokens since its last proposal), so an explored speculative step looks worse than a steady
one: the gate errs on the side of plain decoding, the side that never makes a workload slower.
The in-use policy's goodput is its recent steps' tokens over their seconds, so a draft
model's catch-up steps (a new sequence's prompt) count at their full cost.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SpeculationGate", "StreamGuard"]


@dataclass(slots=True)
class _Class:
    """One batch-size class: the policy in use and what recent steps measured."""

    speculate: bool = True  # the policy in use
    steps: int = 0
    # the policy in use: decayed sums of its steps' tokens and seconds (their ratio, the
    # goodput, counts a draft model's catch-up steps at their full cost)
    recent_tokens: float = 0.0
    recent_median: float = 0.0  # (each step's median over its sequences of tokens emitted)
    recent_seconds: float = 0.0
    # decayed sum over explored steps of log(explored / recent): of the measure on which
    # speculation fares worse (explored speculation: the lower ratio; explored plain: the higher)
    log_ratio: float = 0.0
    weight: float = 0.0  # decayed count of those
    pairs: int = 0  # explored steps since the last switch
    explored: int = 0  # explored steps ever

    @property
    def measured(self) -> bool:
        """Whether a step of the policy in use was measured (an explored step needs one)."""
        return self.recent_seconds > 0.0


class SpeculationGate:
    """Chooses, step by step, whether a step of ``batch`` decoding sequences speculates.

    Batch-size classes are powers of two (1, 2-3, 4-7, 8-15, ...): one decision each, since
    what pays at one stream (nearly any proposal, the weights read once per step dominate)
    loses at 32 (the step's rows dominate)."""

    EXPLORE_EVERY = 32
    # each MIN_PAIRS explored steps in a row that keep the policy in use double the interval,
    # up to 8x: a settled class pays less for the question (at 32 streams a draft model's
    # speculating step took 4.3x a plain one's time for 3.9x its tokens)
    BACKOFF_DOUBLINGS = 3
    # until a class's first MIN_PAIRS explored steps: every other step, so that it decides
    # within 6 steps; every 8th for a draft that catches up, so that its first catch-up (the
    # prompt) is not most of what the pairs see
    EXPLORE_FIRST = 2
    EXPLORE_FIRST_CATCHING_UP = 8
    MIN_PAIRS = 3  # explored steps before a switch
    MARGIN = 0.02  # speculation must be this much faster (goodput ratio - 1) to run
    RECENT_DECAY = 0.9  # the policy in use: about its last ten steps
    PAIR_DECAY = 0.8  # explored steps: about the last five

    def __init__(self, draft_catches_up: bool = False) -> None:
        """`draft_catches_up`: a draft model with a KV pool of its own, whose explored step
        first computes the draft's K/V for every token since its sequences' last proposal
        (new sequences' whole prompts: at 32 streams one took 7 s against 83 ms for a plain
        step): once plain decoding won a class it stays there
        (``explore_speculation_every`` 0), and a class's first explored steps come every
        :attr:`EXPLORE_FIRST_CATCHING_UP`. Otherwise the policy not in use is explored every
        :attr:`EXPLORE_EVERY` steps, with back-off (:attr:`BACKOFF_DOUBLINGS`)."""
        self.explore_speculation_every = 0 if draft_catches_up else self.EXPLORE_EVERY
        self.explore_first = (
            self.EXPLORE_FIRST_CATCHING_UP if draft_catches_up else self.EXPLORE_FIRST
        )
        self._classes: dict[int, _Class] = {}

    @staticmethod
    def batch_class(batch: int) -> int:
        """The class of a step of ``batch`` decodes: ``batch.bit_length()``."""
        return max(1, batch).bit_length()

    def choose(self, batch: int) -> bool:
        """Whether the next step, of ``batch`` decoding sequences, speculates. Counts it."""
        c = self._class(batch)
        c.steps += 1
        later = self.EXPLORE_EVERY if c.speculate else self.explore_speculation_every
        if not later or not c.measured:
            return c.speculate
        if c.explored < self.MIN_PAIRS:
            every = self.explore_first
        else:  # (the intervals are multiples of each other: no step explored twice as soon)
            every = later << min(c.pairs // self.MIN_PAIRS, self.BACKOFF_DOUBLINGS)
        return c.speculate != (c.steps % every == 0)

    def _class(self, batch: int) -> _Class:
        """``batch``'s class. One that has measured nothing yet follows the nearest class that
        has (the larger of two as near; none: speculate): a class met mostly in steps that
        may prefill, which do not speculate and are not measured
        (`Scheduler._prefill_due`), would otherwise keep its first policy in its few
        decode-only steps."""
        key = self.batch_class(batch)
        c = self._classes.get(key)
        if c is None:
            c = self._classes[key] = _Class()
        if not c.measured:
            c.speculate = self._prior(key)
        return c

    def _prior(self, key: int) -> bool:
        measured = [(abs(k - key), -k, c.speculate)
                    for k, c in self._classes.items() if c.measured]  # fmt: skip
        return min(measured)[2] if measured else True

    def speculating(self, batch: int) -> bool:
        """The policy in use for ``batch`` (no step counted)."""
        key = self.batch_class(batch)
        c = self._classes.get(key)
        return c.speculate if c is not None and c.measured else self._prior(key)

    def observe(self, speculated: bool, emitted: Sequence[int], seconds: float) -> bool:
        """A finished decode step that ran policy ``speculated`` in ``seconds``; ``emitted``:
        the tokens each of its sequences emitted (accepted proposals included; its length
        is the batch). Returns whether the class's policy switched (to ``speculated``)."""
        if not emitted or min(emitted) <= 0 or seconds <= 0.0:
            return False  # (a sequence without a token: cancelled; nothing to weigh)
        tokens, median = sum(emitted), statistics.median(emitted)
        c = self._class(len(emitted))
        if speculated == c.speculate:
            d = self.RECENT_DECAY
            c.recent_tokens = d * c.recent_tokens + tokens
            c.recent_median = d * c.recent_median + median
            c.recent_seconds = d * c.recent_seconds + seconds
            return False
        if not c.measured:
            return False  # nothing to pair it with yet
        # (the seconds cancel in no ratio: the recent ones are decayed sums)
        ratios = (
            math.log(tokens / seconds * c.recent_seconds / c.recent_tokens),
            math.log(median / seconds * c.recent_seconds / c.recent_median),
        )
        worse_for_speculation = min(ratios) if speculated else max(ratios)
        c.log_ratio = self.PAIR_DECAY * c.log_ratio + worse_for_speculation
        c.weight = self.PAIR_DECAY * c.weight + 1.0
        c.pairs += 1
        c.explored += 1
        # ties go to plain decoding: its per-stream latency is the steadier
        threshold = math.log1p(self.MARGIN if speculated else -self.MARGIN)
        if c.pairs >= self.MIN_PAIRS and c.log_ratio / c.weight > threshold:
            c.speculate = speculated
            c.recent_tokens, c.recent_median, c.recent_seconds = tokens, median, seconds
            c.log_ratio = c.weight = 0.0
            c.pairs = 0
            return True
        return False


@dataclass(slots=True)
class _Cost:
    """One batch-size class's step times: decayed sums."""

    plain_seconds: float = 0.0
    plain_steps: float = 0.0
    extra_seconds: float = 0.0  # speculating steps: their seconds over the plain mean
    extra_rows: float = 0.0  # and their rows beyond one a sequence


class StreamGuard:
    """Per step, at two or more decoding sequences: whether a step the gate chose to speculate
    does, given the proposals its sequences have. The gate weighs a batch class's steps on
    average (their goodput and their median stream); a speculating step lasts longer for
    every stream in it, and a stream that gains no token from it (no proposal: no n-gram
    match, a reply in its last token, a proposal after misses) emits one token in that longer
    step. On 2 cores that made a third of ShareGPT's requests at 4 streams more than 5% slower
    (their decoding time up to 1.9x at P90) while the workload's tok/s rose 1.2x.

    So each stream keeps an account, in plain steps' time: a speculating step in which it
    emitted ``e`` tokens in ``r`` times a plain step's seconds adds ``e - r`` (what plain
    decoding would have taken for those tokens, less what it took). A step speculates only
    when every stream's account, plus :attr:`TOLERANCE` of a plain step per token it has
    emitted, stays at or above zero after the step's expected outcome, ``1 + expected
    accepted - r`` (a stream without a proposal: ``1 - r``). A stream that gained can afford
    a step that costs it; a new one, or one whose proposals miss, keeps the step plain. The
    cost ratio ``r`` is predicted from this class's measured steps as ``1 + extra rows x
    seconds per extra row / plain step seconds`` (a draft model's forwards and catch-up count
    in its seconds per row, on average), and settled with the step's measured seconds. Until
    a class has measured both kinds of step the guard lets the gate's exploration run."""

    DECAY = 0.9  # about the last ten steps of each kind
    TOLERANCE = 0.05  # a stream's decoding may take 5% longer than plain decoding's

    def __init__(self) -> None:
        self._costs: dict[int, _Cost] = {}
        self._accounts: dict[int, float] = {}  # seq_id -> plain steps gained (< 0: lost)

    def observe(self, seq_ids: Sequence[int], emitted: Sequence[int], rows: int,
                seconds: float) -> None:  # fmt: skip
        """A finished decode-only step of sequences ``seq_ids``, which emitted ``emitted``
        tokens each, that computed ``rows`` positions (more than the batch: it carried
        proposals) in ``seconds``."""
        batch = len(seq_ids)
        if batch < 1 or seconds <= 0.0:
            return
        c = self._costs.setdefault(SpeculationGate.batch_class(batch), _Cost())
        d = self.DECAY
        if rows <= batch:
            c.plain_seconds = d * c.plain_seconds + seconds
            c.plain_steps = d * c.plain_steps + 1.0
            return
        if not c.plain_steps:
            return
        plain = c.plain_seconds / c.plain_steps
        c.extra_seconds = d * c.extra_seconds + seconds - plain
        c.extra_rows = d * c.extra_rows + rows - batch
        ratio = seconds / plain
        for seq_id, tokens in zip(seq_ids, emitted, strict=True):
            self._accounts[seq_id] = self._accounts.get(seq_id, 0.0) + tokens - ratio

    def cost_ratio(self, batch: int, extra_rows: int) -> float | None:
        """A step of ``batch`` sequences and ``extra_rows`` proposed tokens over a plain
        step's time, predicted; None until the class measured both kinds of step."""
        c = self._costs.get(SpeculationGate.batch_class(batch))
        if c is None or not c.plain_steps or not c.extra_rows:
            return None
        per_row = max(0.0, c.extra_seconds / c.extra_rows)
        return 1.0 + extra_rows * per_row * c.plain_steps / c.plain_seconds

    def account(self, seq_id: int) -> float:
        """Plain steps' time sequence ``seq_id`` gained from speculating steps (< 0: lost)."""
        return self._accounts.get(seq_id, 0.0)

    def allows(self, seq_ids: Sequence[int], emitted: Sequence[int], proposed: Sequence[int],
               expected_tokens: Sequence[float]) -> bool:  # fmt: skip
        """Whether a step whose decoding sequences ``seq_ids``, having emitted ``emitted``
        tokens each so far, propose ``proposed`` tokens each and are expected to emit
        ``expected_tokens`` each in it (1 + expected accepted; 1 without a proposal)
        speculates: always at one sequence (the gate's goodput is its pace), else when no
        stream's account would fall below its tolerance."""
        if len(seq_ids) < 2 or not any(proposed):
            return True
        ratio = self.cost_ratio(len(seq_ids), sum(proposed))
        return ratio is None or all(
            self.account(seq_id) + self.TOLERANCE * done + expected >= ratio
            for seq_id, done, expected in zip(seq_ids, emitted, expected_tokens, strict=True)
        )

    def forget(self, seq_id: int) -> None:
        """Drops a finished or preempted sequence's account."""
        self._accounts.pop(seq_id, None)
