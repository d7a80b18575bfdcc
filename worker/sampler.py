"""Sampling on the device for a batch of rows, each with its own parameters.

Order, as in vLLM's sampler: tokens outside ``allowed_token_ids`` masked, ``logit_bias``
added to the raw logits, then the penalties
(repetition over prompt + output, CTRL / HF; then frequency and presence over the output,
OpenAI / vLLM; stop ids masked while a sequence is under ``min_tokens``), then temperature,
min-p, top-k, top-p, then one draw.
``temperature == 0`` is greedy (argmax after the penalties). The logprobs returned (the chosen
token's and the top ``logprobs``) come from ``log_softmax`` of the logits after the bias and
the penalties (before temperature and truncation).

Each row's parameters are a resolved :class:`sluiceway.sampling_params.SamplingParams` (the one
sampling contract; it checked its ranges when it was made).

Rows that share nothing are handled together: one argmax for all greedy rows, one softmax and
one inverse-CDF draw for all sampled rows; rows with top-k/top-p draw among their
``CANDIDATES`` most likely tokens (one ``topk``), with a full sort only for a row whose nucleus
is wider than that. A row with a seed draws its uniform number from its
own ``torch.Generator`` (the only per-row loop), so its tokens do not depend on the rest of the
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sluiceway.kernels import cpu_ops
from sluiceway.sampling_params import FLOAT32_MAX, SamplingParams

__all__ = [
    "SampleResult",
    "apply_output_penalties",
    "apply_repetition_penalty",
    "min_p_mask",
    "sample",
    "top_k_top_p_mask",
    "truncated_candidates",
]


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL / HF repetition penalty, in place: for every id seen, ``logit > 0 -> logit / p``,
    else ``logit * p``.

    Args:
        logits: ``[R, V]`` float32.
        token_ids: ``[R, N]`` int64 ids seen per row (pad by repeating an id of the row).
        penalty: ``[R]`` float32.

    Returns:
        ``logits`` (modified in place).
    """
    score = torch.gather(logits, 1, token_ids)
    p = penalty[:, None]
    # a penalty near 0 divides past float32's range: +inf would make the row's softmax NaN
    score = torch.where(score < 0, score * p, score / p).clamp_(max=FLOAT32_MAX)
    return logits.scatter_(1, token_ids, score)


def apply_output_penalties(
    logits: torch.Tensor,
    output_ids: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> None:
    """OpenAI / vLLM presence and frequency penalties, in place, over each row's output tokens:
    ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``.

    Args:
        logits: ``[R, V]`` float32.
        output_ids: per row, the tokens generated so far.
        presence, frequency: per row.
    """
    rows = len(output_ids)
    counts = torch.zeros_like(logits)
    width = max((len(x) for x in output_ids), default=0)
    if width == 0:
        return
    ids = torch.tensor([list(x) + [0] * (width - len(x)) for x in output_ids], device=logits.device)
    ones = torch.tensor(
        [[1.0] * len(x) + [0.0] * (width - len(x)) for x in output_ids], device=logits.device
    )
    counts.scatter_add_(1, ids, ones)
    freq = torch.tensor(frequency, dtype=torch.float32, device=logits.device)[:rows, None]
    pres = torch.tensor(presence, dtype=torch.float32, device=logits.device)[:rows, None]
    logits -= freq * counts + pres * (counts > 0).float()


def min_p_mask(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Logits ``[R, V]`` (after temperature) with ``-inf`` where the probability is below
    ``min_p [R]`` times the row's largest (vLLM's min-p); a new tensor."""
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def top_k_top_p_mask(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to ``-inf`` the logits that top-k then top-p remove, as HF's ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` (``min_tokens_to_keep=1``) do.

    Args:
        logits: ``[R, V]`` float32 (already divided by the temperature).
        top_k: ``[R]`` int64 (``0`` = off) or None.
        top_p: ``[R]`` float32 (``1`` = off) or None.

    Returns:
        A new ``[R, V]`` tensor.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)[:, None]
        remove[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# rows with top-k/top-p look at this many most likely tokens before falling back to a full sort
CANDIDATES = 128


def truncated_candidates(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, candidates: int = CANDIDATES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p without sorting the vocabulary: the same kept set as HF's warpers,
    found among the row's ``top_k`` (with top-k) or ``candidates`` (without) most likely
    tokens, so a row's result does not depend on the other rows.

    Args:
        logits: ``[R, V]`` float32 (already divided by the temperature).
        top_k: ``[R]`` int64, ``0`` = off.
        top_p: ``[R]`` float32 in ``(0, 1]``.
        candidates: candidate count for rows without top-k.

    Returns:
        ``(ids [R, K] int64, probs [R, K] float32, exact [R] bool)``: candidate token ids,
        their probabilities after top-k renormalization with 0 for removed tokens (the kept
        ones sum to at most 1, sample proportionally), and whether the row's kept set lies
        within the candidates (False: the row needs :func:`top_k_top_p_mask`).
    """
    vocab = logits.shape[-1]
    k0 = min(vocab, max(candidates, int(top_k.max())))
    # a row without top-k looks at the first `candidates` only, however many the batch
    # fetched for the others: its kept set and its draw do not depend on the other rows
    # log_softmax is one fused pass (logsumexp is several); candidates come sorted descending
    logp, ids = torch.topk(torch.log_softmax(logits, dim=-1), k0, dim=-1)
    probs = logp.exp_()
    has_k = top_k > 0
    kk = torch.where(has_k, top_k.clamp(max=k0), min(candidates, vocab))
    in_k = torch.arange(k0, device=logits.device)[None, :] < kk[:, None]
    probs.masked_fill_(~in_k, 0.0)
    # top-k renormalizes over the k kept tokens (softmax of the masked logits)
    probs = torch.where(has_k[:, None], probs / probs.sum(dim=-1, keepdim=True), probs)
    exclusive = probs.cumsum(dim=-1) - probs
    keep = in_k & (exclusive < top_p[:, None])
    keep[:, 0] = True
    exact = has_k | (probs.sum(dim=-1) >= top_p)
    return ids, probs.masked_fill_(~keep, 0.0), exact


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative ``weights`` ``[R, N]`` with uniforms ``u``
    ``[R]``; never an index of weight 0."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[:, None], right=True).squeeze(1)


def _draw(scaled: torch.Tensor, opts: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One token per row of temperature-scaled logits ``[R, V]`` with uniforms ``u`` ``[R]``."""
    device = scaled.device
    trunc = [r for r, o in enumerate(opts) if o.top_p < 1.0 or o.top_k > 0]
    plain = [r for r, o in enumerate(opts) if not (o.top_p < 1.0 or o.top_k > 0)]
    draw = torch.empty(len(opts), dtype=torch.int64, device=device)
    if plain:
        rows = torch.tensor(plain, device=device)
        part = scaled if len(plain) == len(opts) else scaled[rows]
        draw[rows] = _inverse_cdf(torch.softmax(part, dim=-1), u[rows])
    if trunc:
        rows = torch.tensor(trunc, device=device)
        top_k = torch.tensor([opts[r].top_k for r in trunc], device=device)
        top_p = torch.tensor([opts[r].top_p for r in trunc], dtype=torch.float32, device=device)
        part = scaled if len(trunc) == len(opts) else scaled[rows]
        ur = u[rows]
        ids, probs, exact = truncated_candidates(part, top_k, top_p, CANDIDATES)
        picked = ids.gather(1, _inverse_cdf(probs, ur)[:, None]).squeeze(1)
        if not bool(exact.all()):  # rare: the nucleus is wider than the candidates
            wide = (~exact).nonzero().squeeze(1)
            masked = top_k_top_p_mask(part[wide], top_k[wide], top_p[wide])
            picked[wide] = _inverse_cdf(torch.softmax(masked, dim=-1), ur[wide])
        draw[rows] = picked
    return draw


def _plain_greedy(o: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits first (a bias, penalties, a min_tokens
    mask)."""
    return (
        o.temperature == 0
        and o.repetition_penalty == 1.0
        and not o.presence_penalty
        and not o.frequency_penalty
        and not o.logit_bias
        and not o.allowed_token_ids
        and not (o.min_tokens and o.stop_token_ids)
    )


@dataclass(slots=True)
class SampleResult:
    """What :func:`sample` picked: ``token_ids [R] int64``, ``logprobs [R] float32`` (of the
    chosen tokens), and for rows that asked, ``top_ids``/``top_logprobs`` ``[R, N]`` with
    ``N`` the largest ``logprobs`` asked (None when no row asked)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample(
    logits: torch.Tensor,
    options: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen_token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int] | None = None,
    *,
    cpu_kernels: bool = False,
) -> SampleResult:
    """Pick one token per row.

    Args:
        logits: ``[R, V]`` raw model logits, float32 (modified in place by the bias and the
            penalties), or in the model's dtype: converted to float32 first unless every row
            is greedy without bias, penalties or logprobs, ``cpu_kernels`` is set and they are
            bfloat16 (then read as they are).
        options: per-row parameters (``R`` entries).
        generators: per-row generator for seeded rows (None for the others), on ``logits``'
            device.
        seen_token_ids: per-row prompt + output ids, read only for rows with a penalty or
            ``min_tokens``.
        num_prompt_tokens: per-row prompt length within ``seen_token_ids`` (the rest is
            output); None = all prompt (no output yet).
        cpu_kernels: CPU logits and the C++ kernels loaded (:mod:`kernels.cpu_ops`): the
            argmax and the log-sum-exp of every row in one pass
            (:func:`kernels.cpu_ops.argmax_log_normalizer`), same tokens as ``torch.argmax``.

    Returns:
        A :class:`SampleResult` on ``logits``' device.
    """
    top_n = max((o.logprobs or 0 for o in options), default=0)
    fast_dtype = logits.dtype in (torch.float32, torch.bfloat16)
    if cpu_kernels and fast_dtype and not top_n and all(_plain_greedy(o) for o in options):
        # argmax and log-sum-exp in one pass, in float32, over the logits as they are (an
        # argmax of bfloat16 values is the argmax of their float32 widening)
        first_max, _, shifted = cpu_ops.argmax_log_normalizer(logits)
        return SampleResult(first_max, -shifted)
    logits = logits.float()

    def output_of(i: int) -> Sequence[int]:
        start = num_prompt_tokens[i] if num_prompt_tokens is not None else len(seen_token_ids[i])
        return seen_token_ids[i][start:]

    _process(logits, options, seen_token_ids, output_of)
    # the chosen tokens' logprobs come from one formula whatever else the batch asks (top
    # logprobs for some rows, say): (logit - max) - log(sum(exp(row - max)))
    normalizer: tuple[torch.Tensor, torch.Tensor] | None = None
    argmax: torch.Tensor | None = None
    if cpu_kernels:
        argmax, row_max, shifted = cpu_ops.argmax_log_normalizer(logits)
        normalizer = (row_max, shifted)
    tokens = _pick(logits, options, generators, argmax)
    log_probs = torch.log_softmax(logits, dim=-1) if top_n else None
    if normalizer is not None:
        row_max, shifted = normalizer
        chosen_lp = (logits.gather(1, tokens[:, None]).squeeze(1) - row_max) - shifted
    elif log_probs is not None:
        chosen_lp = log_probs.gather(1, tokens[:, None]).squeeze(1)
    else:  # the chosen token's only: no [R, V] log_softmax written out
        chosen_lp = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
    result = SampleResult(tokens, chosen_lp)
    if log_probs is not None:
        result.top_logprobs, result.top_ids = torch.topk(log_probs, top_n, dim=-1)
    return result


def _process(
    logits: torch.Tensor,
    options: Sequence[SamplingParams],
    seen_token_ids: Sequence[Sequence[int]],
    output_of: Callable[[int], Sequence[int]],
) -> None:
    """In place on float32 ``logits [R, V]``: each row's ``allowed_token_ids`` (every other
    token masked), its ``logit_bias``, its repetition,
    presence and frequency penalties, and its stop ids masked while it is under
    ``min_tokens`` (unless that would leave nothing: a grammar that allows only a stop id)."""
    device = logits.device
    for i, o in enumerate(options):
        if o.allowed_token_ids:
            allowed = torch.tensor(o.allowed_token_ids, device=device)
            kept = logits[i, allowed].clone()
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        if o.logit_bias:
            ids = torch.tensor(list(o.logit_bias), device=device)
            bias = torch.tensor(list(o.logit_bias.values()), dtype=torch.float32, device=device)
            logits[i, ids] += bias
    pen_rows = [i for i, o in enumerate(options) if o.repetition_penalty != 1.0]
    if pen_rows:
        ids_list = [list(seen_token_ids[i]) or [0] for i in pen_rows]
        width = max(len(x) for x in ids_list)
        padded = torch.tensor([x + [x[0]] * (width - len(x)) for x in ids_list], device=device)
        idx = torch.tensor(pen_rows, device=device)
        penalty = torch.tensor(
            [options[i].repetition_penalty for i in pen_rows], dtype=torch.float32, device=device
        )
        logits[idx] = apply_repetition_penalty(logits[idx], padded, penalty)
    out_rows = [i for i, o in enumerate(options) if o.presence_penalty or o.frequency_penalty]
    if out_rows:
        idx = torch.tensor(out_rows, device=device)
        part = logits[idx]
        apply_output_penalties(
            part,
            [output_of(i) for i in out_rows],
            [options[i].presence_penalty for i in out_rows],
            [options[i].frequency_penalty for i in out_rows],
        )
        logits[idx] = part
    for i, o in enumerate(options):
        if o.min_tokens and o.stop_token_ids and len(output_of(i)) < o.min_tokens:
            stop_ids = torch.tensor(o.stop_token_ids, device=device)
            kept = logits[i, stop_ids].clone()
            logits[i, stop_ids] = float("-inf")
            if not torch.isfinite(logits[i]).any():  # a grammar that allows only a stop id
                logits[i, stop_ids] = kept


def _pick(
    logits: torch.Tensor,
    options: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    argmax: torch.Tensor | None,
) -> torch.Tensor:
    """One token per row of processed float32 ``logits [R, V]``: the argmax of greedy rows
    (``argmax [R]`` when the caller has it), a draw for the others (temperature, min-p,
    top-k/top-p; a seeded row's uniform from its own generator). Returns ``[R]`` int64."""
    rows = logits.shape[0]
    device = logits.device
    greedy = [i for i, o in enumerate(options) if o.temperature == 0]
    sampled = [i for i, o in enumerate(options) if o.temperature != 0]
    if argmax is None and len(greedy) == rows:
        argmax = logits.argmax(dim=-1)
    if argmax is not None and len(greedy) == rows:
        return argmax
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    if greedy:
        g = torch.tensor(greedy, device=device)
        tokens[g] = logits[g].argmax(dim=-1) if argmax is None else argmax[g]
    s_idx = None if len(sampled) == rows else torch.tensor(sampled, device=device)
    sub = logits if s_idx is None else logits[s_idx]
    temps = torch.tensor(
        [options[i].temperature for i in sampled], dtype=torch.float32, device=device
    )
    # a temperature near 0 (or a logit near float32's top) divides past the range: +inf
    # would make the row's softmax NaN; the largest finite value keeps its limit, argmax
    sub = (sub / temps[:, None]).clamp_(max=FLOAT32_MAX)
    min_p_rows = [j for j, i in enumerate(sampled) if options[i].min_p > 0]
    if min_p_rows:
        mp = torch.tensor(min_p_rows, device=device)
        threshold = torch.tensor(
            [options[sampled[j]].min_p for j in min_p_rows], dtype=torch.float32, device=device
        )
        sub[mp] = min_p_mask(sub[mp], threshold)
    u = torch.rand(len(sampled), device=device)
    for j, i in enumerate(sampled):
        gen = generators[i]
        if gen is not None:
            u[j] = torch.rand(1, generator=gen, device=device)[0]
    draw = _draw(sub, [options[i] for i in sampled], u)
    if s_idx is None:
        return draw
    tokens[s_idx] = draw
    return tokens
