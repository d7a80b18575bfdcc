"""The batched sampler against argmax and transformers' logits processors."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from sluiceway.sampling_params import SamplingParams
from sluiceway.status import FieldError
from sluiceway.worker import sampler
from sluiceway.worker.sampler import (
    apply_repetition_penalty,
    sample,
    top_k_top_p_mask,
    truncated_candidates,
)

V = 1000


def _tokens_and_logprobs(*args):  # type: ignore[no-untyped-def]
    result = sample(*args)
    return result.token_ids, result.logprobs


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    tokens, logprobs = _tokens_and_logprobs(
        logits.clone(), [SamplingParams(temperature=0)] * 6, [None] * 6, [[]] * 6
    )
    assert tokens.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_top_k_1_is_greedy() -> None:
    logits = _logits(5, seed=1)
    opts = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 0.7, 1.3)]
    tokens, _ = _tokens_and_logprobs(logits.clone(), opts, [None] * 5, [[]] * 5)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def _draws(rows_before: int, rows_after: int, steps: int = 8) -> list[int]:
    """Tokens of a seeded row (seed 1234, top_p 0.9) placed among other, unrelated rows."""
    gen = torch.Generator().manual_seed(1234)
    row = _logits(1, seed=7)[0]
    target = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, seed=99),
        SamplingParams(top_p=0.5, repetition_penalty=1.3),
    ]
    out = []
    for step in range(steps):
        before = [others[i % 4] for i in range(rows_before)]
        after = [others[(i + 2) % 4] for i in range(rows_after)]
        logits = torch.cat(
            [_logits(rows_before, seed=step), row[None], _logits(rows_after, seed=50 + step)]
        )
        gens = (
            [torch.Generator().manual_seed(5) if o.seed else None for o in before]
            + [gen]
            + [torch.Generator().manual_seed(6) if o.seed else None for o in after]
        )
        opts = [*before, target, *after]
        tokens, _ = _tokens_and_logprobs(logits, opts, gens, [[1, 2, 3]] * len(opts))
        out.append(int(tokens[rows_before]))
    return out


def test_seeded_rows_reproducible_and_independent_of_batch() -> None:
    alone = _draws(0, 0)
    assert _draws(0, 0) == alone
    assert _draws(3, 0) == alone
    assert _draws(2, 5) == alone
    assert len(set(alone)) > 1  # the generator advances between steps


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(4, seed=2)
    ids = torch.randint(0, V, (4, 30), generator=torch.Generator().manual_seed(3))
    penalties = [1.2, 0.8, 1.0, 2.5]
    ref = torch.cat(
        [
            RepetitionPenaltyLogitsProcessor(p)(ids[i : i + 1], logits[i : i + 1].clone())
            for i, p in enumerate(penalties)
        ]
    )
    mine = apply_repetition_penalty(logits.clone(), ids, torch.tensor(penalties))
    torch.testing.assert_close(mine, ref, rtol=0, atol=0)
    # through sample(): greedy after the penalty, logprob of the penalized distribution
    opts = [SamplingParams(temperature=0, repetition_penalty=p) for p in penalties]
    tokens, logprobs = _tokens_and_logprobs(
        logits.clone(), opts, [None] * 4, [r.tolist() for r in ids]
    )
    assert tokens.tolist() == ref.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(ref, -1).max(-1).values)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_transformers(top_p: float) -> None:
    logits = _logits(8, seed=int(top_p * 1000))
    ref = TopPLogitsWarper(top_p)(None, logits.clone())
    mine = top_k_top_p_mask(logits.clone(), None, torch.full((8,), top_p))
    assert torch.equal(torch.isinf(mine), torch.isinf(ref))
    torch.testing.assert_close(mine, ref, rtol=0, atol=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (50, 0.9), (1, 0.5), (900, 0.8)])
def test_top_k_then_top_p_matches_transformers(top_k: int, top_p: float) -> None:
    logits = _logits(6, seed=top_k)
    ref = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits.clone()))
    mine = top_k_top_p_mask(logits.clone(), torch.full((6,), top_k), torch.full((6,), top_p))
    torch.testing.assert_close(mine, ref, rtol=0, atol=0)


@pytest.mark.parametrize("candidates", [4, 32, 1000])
def test_candidates_match_transformers(candidates: int) -> None:
    logits = _logits(12, seed=candidates)
    top_k = torch.tensor([0, 0, 0, 0, 5, 50, 3, 0, 1, 0, 20, 0])
    top_p = torch.tensor([0.9, 0.5, 0.1, 0.99, 1.0, 0.9, 0.3, 0.7, 0.9, 0.2, 0.95, 0.6])
    ids, probs, exact = truncated_candidates(logits, top_k, top_p, candidates)
    for r in range(12):
        warped = logits[r : r + 1].clone()
        if top_k[r] > 0:
            warped = TopKLogitsWarper(int(top_k[r]))(None, warped)
        warped = TopPLogitsWarper(float(top_p[r]))(None, warped)[0]
        kept = set(torch.nonzero(torch.isfinite(warped)).squeeze(1).tolist())
        if not exact[r]:
            assert len(kept) > ids.shape[1] or probs[r].sum() < top_p[r]
            continue
        assert set(ids[r][probs[r] > 0].tolist()) == kept
        ref = torch.softmax(warped, -1)[ids[r]]
        mine = probs[r] / probs[r].sum()
        torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-5)
    if candidates == 1000:
        assert bool(exact.all())
    if candidates == 4:
        assert not bool(exact.all())


def test_fallback_rows_sample_inside_the_nucleus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler, "CANDIDATES", 2)
    logits = _logits(1, seed=11).repeat(200, 1)
    warped = TopPLogitsWarper(0.9)(None, logits[:1].clone())[0]
    kept = set(torch.nonzero(torch.isfinite(warped)).squeeze(1).tolist())
    assert len(kept) > 2
    tokens, _ = _tokens_and_logprobs(
        logits.clone(), [SamplingParams(top_p=0.9)] * 200, [None] * 200, [[]] * 200
    )
    assert set(tokens.tolist()) <= kept
    assert len(set(tokens.tolist())) > 2


def test_samples_follow_the_truncated_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    opts = [SamplingParams(temperature=1.0, top_p=0.8)] * 4000
    tokens, _ = _tokens_and_logprobs(logits.clone(), opts, [None] * 4000, [[]] * 4000)
    kept = top_k_top_p_mask(logits[:1], None, torch.tensor([0.8]))[0]
    probs = torch.softmax(kept, -1)
    freq = torch.bincount(tokens, minlength=6).double() / 4000
    assert set(tokens.tolist()) <= {i for i in range(6) if probs[i] > 0}
    torch.testing.assert_close(freq, probs.double(), atol=0.03, rtol=0)


def test_invalid_options_are_refused_when_made_not_when_sampled() -> None:
    with pytest.raises(FieldError) as err:
        SamplingParams(top_p=0.0)
    assert (err.value.field, err.value.message) == ("sampling.top_p", "must be in (0, 1]; got 0.0")


def test_logit_bias_is_added_to_the_raw_logits_before_the_penalties() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    # +100 on token 0 forces it greedily; -100 on the argmax bans it
    forced = SamplingParams(temperature=0, logit_bias={0: 100.0})
    banned = SamplingParams(temperature=0, logit_bias={2: -100.0})
    tokens, logprobs = _tokens_and_logprobs(
        logits.repeat(2, 1), [forced, banned], [None, None], [[], []]
    )
    assert tokens.tolist() == [0, 1]
    # the logprob comes from the biased logits: token 0 at 101 against 2, 3 and 0.5
    expected = torch.log_softmax(torch.tensor([101.0, 2.0, 3.0, 0.5]), -1)[0]
    assert logprobs[0].item() == pytest.approx(expected.item(), abs=1e-6)
    # then the repetition penalty divides the biased logit (vLLM's order): (1 + 2) / 3 = 1
    biased = SamplingParams(temperature=0, logit_bias={0: 2.0}, repetition_penalty=3.0, logprobs=4)
    result = sample(logits.clone(), [biased], [None], [[0]])
    assert result.top_logprobs is not None and result.top_ids is not None
    got = dict(zip(result.top_ids[0].tolist(), result.top_logprobs[0].tolist(), strict=True))
    want = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0, 0.5]), -1)
    assert got == pytest.approx({i: want[i].item() for i in range(4)}, abs=1e-6)


def test_presence_and_frequency_penalties_use_output_counts_only() -> None:
    from sluiceway.worker.sampler import apply_output_penalties

    logits = torch.zeros(2, 6)
    apply_output_penalties(logits, [[1, 1, 3], []], presence=[0.5, 0.5], frequency=[0.25, 0.25])
    # token 1 twice: 0.5 + 2 * 0.25; token 3 once: 0.5 + 0.25; row 2 has no output yet
    assert logits[0].tolist() == [0.0, -1.0, 0.0, -0.75, 0.0, 0.0]
    assert logits[1].tolist() == [0.0] * 6


def test_sample_applies_penalties_to_the_right_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    prompt_and_output = [[1, 0, 2]]  # prompt [1], output [0, 2]
    opts = [SamplingParams(temperature=0, presence_penalty=1.0)]
    # presence counts the output only: token 2 (output) drops to 1.9, token 1 (prompt) stays
    r = sample(logits.clone(), opts, [None], prompt_and_output, [1])
    assert r.token_ids.tolist() == [1]
    opts = [SamplingParams(temperature=0, presence_penalty=0.0, repetition_penalty=2.0)]
    # repetition covers prompt and output: 3.0 -> 1.5, 2.9 -> 1.45; token 1 still wins
    r = sample(logits.clone(), opts, [None], prompt_and_output, [1])
    assert r.token_ids.tolist() == [1]
    logits2 = torch.tensor([[0.0, 3.0, 2.0, 2.5]])
    r = sample(logits2.clone(), opts, [None], [[1]], [1])  # 1 only in the prompt: 1.5 < 2.5
    assert r.token_ids.tolist() == [3]


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    opts = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(1,))]
    assert sample(logits.clone(), opts, [None], [[9, 4]], [1]).token_ids.tolist() == [2]
    assert sample(logits.clone(), opts, [None], [[9, 4, 4]], [1]).token_ids.tolist() == [1]


def test_min_p_keeps_tokens_near_the_top() -> None:
    from sluiceway.worker.sampler import min_p_mask

    scaled = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = min_p_mask(scaled, torch.tensor([0.5]))  # threshold 0.25
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    opts = [SamplingParams(temperature=1.0, min_p=0.5)] * 2000
    tokens = sample(scaled.repeat(2000, 1), opts, [None] * 2000, [[]] * 2000).token_ids
    assert set(tokens.tolist()) == {0, 1}


def test_top_logprobs_are_the_top_of_the_returned_distribution() -> None:
    logits = _logits(3)
    opts = [SamplingParams(temperature=0, logprobs=n) for n in (0, 3, None)]
    r = sample(logits.clone(), opts, [None] * 3, [[]] * 3)
    assert r.top_ids is not None and r.top_logprobs is not None
    ref_lp, ref_ids = torch.topk(torch.log_softmax(logits, -1), 3, dim=-1)
    assert r.top_ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(r.top_logprobs, ref_lp)
    assert r.token_ids.tolist() == ref_ids[:, 0].tolist()  # greedy = the top entry


def test_allowed_token_ids_restrict_every_draw_and_the_logprobs() -> None:
    logits = _logits(1, seed=3).repeat(400, 1)
    allowed = (1, 4, 5)
    greedy = SamplingParams(temperature=0, allowed_token_ids=allowed, logprobs=3)
    result = sample(logits[:1].clone(), [greedy], [None], [[]])
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert result.token_ids.tolist() == [best]
    # the logprobs are those of the distribution over the allowed tokens alone
    want = torch.log_softmax(logits[0, list(allowed)], -1)
    assert result.top_ids is not None and result.top_logprobs is not None
    assert sorted(result.top_ids[0].tolist()) == sorted(allowed)
    got = dict(zip(result.top_ids[0].tolist(), result.top_logprobs[0].tolist(), strict=True))
    assert got == pytest.approx({t: w.item() for t, w in zip(allowed, want, strict=True)}, abs=1e-5)
    hot = [SamplingParams(temperature=2.0, allowed_token_ids=allowed)] * 400
    tokens, _ = _tokens_and_logprobs(logits.clone(), hot, [None] * 400, [[]] * 400)
    assert set(tokens.tolist()) == set(allowed)  # every allowed one drawn, nothing else


def test_extreme_penalty_and_temperature_keep_every_row_finite() -> None:
    """A repetition penalty near 0 divides a logit past float32's range and a temperature
    near 0 does so to every logit: the row's softmax would be NaN (the draw's index then
    fell off the vocabulary and failed the whole step). The largest finite value stands in
    for +inf: the token is the limit's (the argmax), the logprobs stay finite."""
    logits = _logits(3)
    best = logits.argmax(-1).tolist()
    seen = [[best[0]], [best[1]], []]
    options = [
        SamplingParams(temperature=0, repetition_penalty=1e-38, logprobs=2),
        SamplingParams(temperature=1.0, repetition_penalty=1e-38, seed=1, logprobs=2),
        SamplingParams(temperature=2e-5, logprobs=2),
    ]
    gens = [None, torch.Generator().manual_seed(1), None]
    result = sample(logits.clone(), options, gens, seen, [1, 1, 0])
    assert result.token_ids.tolist() == best
    assert torch.isfinite(result.logprobs).all()
    assert result.top_logprobs is not None and torch.isfinite(result.top_logprobs).all()
