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

No ``[R, V]`` tensor is made per step where one can be kept (a 262,144-token vocabulary makes
each 1 MiB a row, and a fresh one costs its page faults every step): the sampled rows'
temperature-scaled logits go into a :class:`SamplerBuffers` scratch kept between steps (sampled
rows first, then top-k/top-p rows, so each group is a slice), their softmax, CDF and
log-softmax are written over it, the logprobs' log-softmax over the logits once nothing else
reads them, and the penalties touch only the seen tokens. These are the same operations on
the same values as with fresh tensors: the results are bitwise those of the allocating code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sluiceway.kernels import cpu_ops
from sluiceway.sampling_params import FLOAT32_MAX, SamplingParams

__all__ = [
    "SampleResult",
    "SamplerBuffers",
    "apply_output_penalties",
    "apply_repetition_penalty",
    "log_softmax_",
    "min_p_mask",
    "sample",
    "top_k_top_p_mask",
    "truncated_candidates",
]


def apply_repetition_penalty(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    penalty: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """CTRL / HF repetition penalty, in place: for every id seen, ``logit > 0 -> logit / p``,
    else ``logit * p``. Only the seen tokens are read and written.

    Args:
        logits: ``[R, V]`` float32.
        token_ids: ``[P, N]`` int64 ids seen per penalized row (pad by repeating an id of the
            row).
        penalty: ``[P]`` float32.
        rows: ``[P]`` int64, the row of ``logits`` of each penalized row (default: ``P == R``,
            row ``i`` is row ``i``).

    Returns:
        ``logits`` (modified in place).
    """
    if rows is None:
        rows = torch.arange(token_ids.shape[0], device=logits.device)
    where = (rows[:, None].expand_as(token_ids), token_ids)
    score = logits[where]
    p = penalty[:, None]
    # a penalty near 0 divides past float32's range: +inf would make the row's softmax NaN
    score = torch.where(score < 0, score * p, score / p).clamp_(max=FLOAT32_MAX)
    return logits.index_put_(where, score)


def apply_output_penalties(
    logits: torch.Tensor,
    output_ids: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    rows: Sequence[int] | None = None,
) -> None:
    """OpenAI / vLLM presence and frequency penalties, in place, over each row's output tokens:
    ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``. Only the tokens seen are
    read and written (no ``[R, V]`` count table).

    Args:
        logits: ``[R, V]`` float32.
        output_ids: per penalized row, the tokens generated so far.
        presence, frequency: per penalized row.
        rows: the row of ``logits`` of each entry (default ``0 .. len(output_ids) - 1``).
    """
    rows = range(len(output_ids)) if rows is None else rows
    r_idx: list[int] = []
    t_idx: list[int] = []
    count: list[float] = []
    freq: list[float] = []
    pres: list[float] = []
    for j, (row, ids) in enumerate(zip(rows, output_ids, strict=True)):
        for t, n in Counter(ids).items():
            r_idx.append(row)
            t_idx.append(t)
            count.append(float(n))
            freq.append(frequency[j])
            pres.append(presence[j])
    if not r_idx:
        return
    device = logits.device
    where = (torch.tensor(r_idx, device=device), torch.tensor(t_idx, device=device))
    counts = torch.tensor(count, dtype=torch.float32, device=device)
    f = torch.tensor(freq, dtype=torch.float32, device=device)
    p = torch.tensor(pres, dtype=torch.float32, device=device)
    # the same float32 operations, element by element, as over a dense count table
    logits.index_put_(where, logits[where] - (f * counts + p * (counts > 0).float()))


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
# rows with top-k/top-p look at this many most likely tokens before falling back to a full sort
CANDIDATES = 128


def truncated_candidates(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    candidates: int = CANDIDATES,
    *,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k then top-p without sorting the vocabulary: the same kept set as HF's warpers,
    found among the row's ``top_k`` (with top-k) or ``candidates`` (without) most likely
    tokens, so a row's result does not depend on the other rows.

    Args:
        logits: ``[R, V]`` float32 (already divided by the temperature).
        top_k: ``[R]`` int64, ``0`` = off.
        top_p: ``[R]`` float32 in ``(0, 1]``.
        candidates: candidate count for rows without top-k.
        overwrite: write the log-softmax over ``logits`` (rows contiguous) instead of a new
            ``[R, V]`` tensor; the same values.

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
    log_probs = log_softmax_(logits) if overwrite else torch.log_softmax(logits, dim=-1)
    logp, ids = torch.topk(log_probs, k0, dim=-1)
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


def _softmax_(x: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(x, -1)`` written over ``x`` (``[R, V]`` float32, contiguous) and
    returned. On the CPU the kernel writes over its input (it reads a row's max and sum
    before it writes the row; tests check the values equal torch's); elsewhere through a
    temporary, which the CUDA caching allocator serves without new pages."""
    if x.device.type != "cpu":
        return x.copy_(torch.softmax(x, dim=-1))
    return torch.ops.aten._softmax.out(x, -1, False, out=x)


def log_softmax_(x: torch.Tensor) -> torch.Tensor:
    """``torch.log_softmax(x, -1)`` written over ``x`` (``[R, V]`` float32, contiguous) and
    returned, as :func:`_softmax_`: the same values without a second ``[R, V]`` tensor on the
    CPU."""
    if x.device.type != "cpu":
        return x.copy_(torch.log_softmax(x, dim=-1))
    return torch.ops.aten._log_softmax.out(x, -1, False, out=x)


def _inverse_cdf(
    weights: torch.Tensor, u: torch.Tensor, *, overwrite: bool = False
) -> torch.Tensor:
    """Index drawn from each row of non-negative ``weights`` ``[R, N]`` with uniforms ``u``
    ``[R]``; never an index of weight 0. ``overwrite``: the CDF is written over ``weights``."""
    cdf = weights.cumsum_(dim=-1) if overwrite else weights.cumsum(dim=-1)
    total = cdf[:, -1]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[:, None], right=True).squeeze(1)


def _truncates(o: SamplingParams) -> bool:
    """Whether the row draws after top-k or top-p (among candidates, or a sorted row)."""
    return o.top_p < 1.0 or o.top_k > 0


def _scale(
    logits: torch.Tensor, rows: Sequence[int], opts: Sequence[SamplingParams], out: torch.Tensor
) -> torch.Tensor:
    """``out`` (``[len(rows), V]`` float32) = ``logits[rows]`` divided by each row's
    temperature, then its min-p mask (:func:`min_p_mask`). Returns ``out``."""
    device = logits.device
    temps = torch.tensor([o.temperature for o in opts], dtype=torch.float32, device=device)
    if list(rows) == list(range(logits.shape[0])):
        torch.div(logits, temps[:, None], out=out)
    else:
        torch.index_select(logits, 0, torch.tensor(list(rows), device=device), out=out)
        out.div_(temps[:, None])
    # a temperature near 0 (or a logit near float32's top) divides past the range: +inf
    # would make the row's softmax NaN; the largest finite value keeps its limit, argmax
    out.clamp_(max=FLOAT32_MAX)
    min_p_rows = [j for j, o in enumerate(opts) if o.min_p > 0]
    if min_p_rows:
        mp = torch.tensor(min_p_rows, device=device)
        threshold = torch.tensor(
            [opts[j].min_p for j in min_p_rows], dtype=torch.float32, device=device
        )
        out[mp] = min_p_mask(out[mp], threshold)
    return out


def _draw(
    logits: torch.Tensor,
    rows: Sequence[int],
    opts: Sequence[SamplingParams],
    u: torch.Tensor,
    scratch: torch.Tensor,
) -> torch.Tensor:
    """One token for each of ``rows`` of processed float32 ``logits [R, V]``, each row with its
    options ``opts`` (temperature > 0) and uniform ``u``; ``rows`` lists the rows without
    top-k/top-p first. ``scratch`` (``[len(rows), V]`` float32) is overwritten."""
    device = logits.device
    n_plain = sum(1 for o in opts if not _truncates(o))
    scaled = _scale(logits, rows, opts, scratch)
    draw = torch.empty(len(rows), dtype=torch.int64, device=device)
    if n_plain:
        probs = _softmax_(scaled[:n_plain])
        draw[:n_plain] = _inverse_cdf(probs, u[:n_plain], overwrite=True)
    if n_plain < len(rows):
        trunc = opts[n_plain:]
        top_k = torch.tensor([o.top_k for o in trunc], device=device)
        top_p = torch.tensor([o.top_p for o in trunc], dtype=torch.float32, device=device)
        ur = u[n_plain:]
        ids, probs, exact = truncated_candidates(
            scaled[n_plain:], top_k, top_p, CANDIDATES, overwrite=True
        )
        picked = ids.gather(1, _inverse_cdf(probs, ur)[:, None]).squeeze(1)
        if not bool(exact.all()):  # rare: the nucleus is wider than the candidates
            wide = (~exact).nonzero().squeeze(1)
            w = wide.tolist()
            # the scaled rows again, into the scratch the candidates no longer need (it holds
            # their log-softmax now): the same values
            part = scaled[n_plain : n_plain + len(w)]
            part = _scale(logits, [rows[n_plain + j] for j in w], [trunc[j] for j in w], part)
            masked = top_k_top_p_mask(part, top_k[wide], top_p[wide])
            picked[wide] = _inverse_cdf(torch.softmax(masked, dim=-1), ur[wide])
        draw[n_plain:] = picked
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


class SamplerBuffers:
    """A float32 ``[rows, V]`` scratch kept between steps (grown as needed), so that a step
    writes its scaled logits, softmax and CDF (or prompt logprobs' comparisons) into memory
    already mapped. One per model runner; not thread safe (one step at a time)."""

    __slots__ = ("_scratch",)

    def __init__(self) -> None:
        self._scratch = torch.empty(0, 0)

    def scratch(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """A contiguous ``[rows, vocab]`` float32 view of the kept buffer (contents undefined;
        the next call may return the same memory)."""
        buf = self._scratch
        if buf.device != device or buf.shape[1] != vocab or buf.shape[0] < rows:
            self._scratch = buf = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        return buf[:rows]


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
    buffers: SamplerBuffers | None = None,
) -> SampleResult:
    """Pick one token per row.

    Args:
        logits: ``[R, V]`` raw model logits, float32 (overwritten: the bias and the penalties,
            then the log-softmax when a row asks for logprobs or without ``cpu_kernels``; the
            model's kept logits buffer is meant to be used so), or in the model's dtype:
            converted to float32 first unless every row
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
        buffers: the caller's kept scratch (:class:`SamplerBuffers`); None: a new one for this
            call (the same results).

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
    buffers = SamplerBuffers() if buffers is None else buffers

    def output_of(i: int) -> Sequence[int]:
        start = num_prompt_tokens[i] if num_prompt_tokens is not None else len(seen_token_ids[i])
        return seen_token_ids[i][start:]

    _process(logits, options, seen_token_ids, output_of)
    # the chosen tokens' logprobs come from one formula whatever else the batch asks (top
    # logprobs for some rows, say): with the C++ kernels (logit - max) - log(sum(exp(row -
    # max))), else log_softmax's (its CPU kernel reduces each row alone; a sum over one row
    # would split it across threads when the batch has one row). The top logprobs use the
    # same formula: a chosen token among them shows the same value twice.
    if cpu_kernels:
        argmax, row_max, shifted = cpu_ops.argmax_log_normalizer(logits)
        tokens = _pick(logits, options, generators, argmax, buffers)

        def logprobs_of(values: torch.Tensor) -> torch.Tensor:  # values [R, n]
            return (values - row_max[:, None]) - shifted[:, None]

        result = SampleResult(tokens, logprobs_of(logits.gather(1, tokens[:, None])).squeeze(1))
        if top_n:
            top_logits, result.top_ids = torch.topk(logits, top_n, dim=-1)
            result.top_logprobs = logprobs_of(top_logits)
        return result
    tokens = _pick(logits, options, generators, None, buffers)
    # nothing reads the logits after this: the log-softmax goes over them
    log_probs = log_softmax_(_contiguous(logits))
    result = SampleResult(tokens, log_probs.gather(1, tokens[:, None]).squeeze(1))
    if top_n:
        result.top_logprobs, result.top_ids = torch.topk(log_probs, top_n, dim=-1)
    return result


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` when contiguous (the in-place kernels' layout), else a copy (logits sliced from
    a tensor-parallel gather's padded columns)."""
    return x if x.is_contiguous() else x.contiguous()


def _process(
    logits: torch.Tensor,
    options: Sequence[SamplingParams],
    seen_token_ids: Sequence[Sequence[int]],
    output_of: Callable[[int], Sequence[int]],
) -> None:
    """In place on float32 ``logits [R, V]``: each row's ``allowed_token_ids`` (every other
    token masked), its ``logit_bias``, its repetition,
    presence and frequency penalties, and its stop ids masked while it is under
    ``min_tokens`` (unless that would leave nothing: a grammar that allows only a stop id).
    The penalties read and write the seen tokens only."""
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
        penalty = torch.tensor(
            [options[i].repetition_penalty for i in pen_rows], dtype=torch.float32, device=device
        )
        apply_repetition_penalty(logits, padded, penalty, torch.tensor(pen_rows, device=device))
    out_rows = [i for i, o in enumerate(options) if o.presence_penalty or o.frequency_penalty]
    if out_rows:
        apply_output_penalties(
            logits,
            [output_of(i) for i in out_rows],
            [options[i].presence_penalty for i in out_rows],
            [options[i].frequency_penalty for i in out_rows],
            rows=out_rows,
        )
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
    buffers: SamplerBuffers,
) -> torch.Tensor:
    """One token per row of processed float32 ``logits [R, V]``: the argmax of greedy rows
    (``argmax [R]`` when the caller has it), a draw for the others (temperature, min-p,
    top-k/top-p; a seeded row's uniform from its own generator) in ``buffers``' scratch.
    Returns ``[R]`` int64."""
    rows = logits.shape[0]
    device = logits.device
    greedy = [i for i, o in enumerate(options) if o.temperature == 0]
    sampled = [i for i, o in enumerate(options) if o.temperature != 0]
    if greedy and argmax is None:  # every row's: cheaper than copying out the greedy ones
        argmax = logits.argmax(dim=-1)
    if argmax is not None and len(greedy) == rows:
        return argmax
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    if greedy:
        g = torch.tensor(greedy, device=device)
        assert argmax is not None
        tokens[g] = argmax[g]
    u = torch.rand(len(sampled), device=device)
    for j, i in enumerate(sampled):
        gen = generators[i]
        if gen is not None:
            u[j] = torch.rand(1, generator=gen, device=device)[0]
    # rows without top-k/top-p first: each group a slice of the scratch
    order = sorted(range(len(sampled)), key=lambda j: _truncates(options[sampled[j]]))
    rows_in_order = [sampled[j] for j in order]
    u_in_order = u[torch.tensor(order, device=device)]
    scratch = buffers.scratch(len(sampled), logits.shape[1], device)
    draw = _draw(logits, rows_in_order, [options[i] for i in rows_in_order], u_in_order, scratch)
    tokens[torch.tensor(rows_in_order, device=device)] = draw
    return tokens
