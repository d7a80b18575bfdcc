"""Request validation: the public sampling parameters, checked and resolved.

Unset fields take vLLM's defaults. Every rejection is an `InvalidRequest`
naming the field in the public proto's words ("sampling.top_p",
"sampling.stop[2]", "prompt_token_ids.ids[7]", "input") and the allowed range.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.errors import InvalidRequest
from sluiceway.v1 import inference_pb2

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "GREEDY_TEMPERATURE_EPS",
    "MAX_CHOICES",
    "MAX_CONSTRAINT_BYTES",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_BYTES",
    "ResolvedSampling",
    "check_structured_outputs",
    "resolve_request",
    "validate_prompt_token_ids",
]

#: Generated tokens at most when `max_tokens` is unset (vLLM's default).
DEFAULT_MAX_TOKENS = 16
#: Stop strings a request may carry at most.
MAX_STOP_STRINGS = 16
#: Length of one stop string at most, in UTF-8 bytes.
MAX_STOP_STRING_BYTES = 256
#: Longest client-chosen request_id, characters (it is echoed in every response).
MAX_REQUEST_ID_CHARS = 256
#: Top log-probabilities a request may ask for per token at most (vLLM's default cap).
MAX_LOGPROBS = 20
#: Samples of one prompt at most (`n`, parallel sampling).
MAX_N = 16
#: Presence and frequency penalties lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (vLLM's range).
PENALTY_LIMIT = 2.0
#: A temperature below this is greedy sampling (vLLM's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5
#: A structured-outputs JSON schema, regex or grammar at most, UTF-8 bytes.
MAX_CONSTRAINT_BYTES = 64 * 1024
#: Alternatives of a `choice` constraint at most.
MAX_CHOICES = 256


@dataclass(slots=True)
class ResolvedSampling:
    """Sampling parameters of one request with every default applied.

    Attributes:
        sampling: what travels to the scheduler once per sequence:
            temperature (0 = greedy), top_p in (0, 1], top_k (0 = off),
            repetition_penalty (1 = off), seed (set only when the request
            set one).
        max_tokens: generated tokens at most, >= 1, already capped so that
            prompt_len + max_tokens <= max_model_len.
        stop: stop strings, deduplicated, in request order (the router
            matches them; they never reach the scheduler).
        stop_token_ids: ids that end generation (the token itself is
            generated): the request's, then the model's EOS ids unless
            ignore_eos, deduplicated.
        min_tokens: no stop of any kind before this many generated tokens
            (<= max_tokens).
        include_stop_str_in_output: keep a matched stop string in the text.
        skip_special_tokens: leave special tokens out of the text.
        logprobs: top log-probabilities per token, or None (not asked).
        n: samples of the prompt (parallel sampling), 1..MAX_N.
    """

    sampling: scheduler_pb2.SequenceSamplingParams
    max_tokens: int
    stop: list[str]
    stop_token_ids: list[int]
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    n: int = 1


def _dedup(items: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(items))


def resolve_request(
    sampling: inference_pb2.SamplingParams | inference_pb2.GenerateRequest,
    *,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    eos_token_ids: Sequence[int],
) -> ResolvedSampling:
    """Checks a request's sampling parameters and applies vLLM's defaults.

    Args:
        sampling: the request's `SamplingParams` (a whole `GenerateRequest` is
            accepted too: its `sampling` field is used).
        prompt_len: tokens in the prompt, after the chat template.
        max_model_len: tokens the model may hold, prompt plus output.
        vocab_size: token ids must be below this.
        eos_token_ids: the model's end-of-sequence ids, added to the stop
            token ids unless `ignore_eos`.

    Defaults and normalisation: temperature 1.0 (below 1e-5 it is greedy:
    0, with top_p 1 and top_k 0, as vLLM); top_p 1.0; top_k 0, where -1
    also means off and a top_k >= vocab_size keeps every token so is off
    too; repetition_penalty 1.0; min_p 0 (off; 0 for greedy); presence and
    frequency penalties 0; max_tokens 16, capped at max_model_len -
    prompt_len; min_tokens 0, capped with max_tokens; skip_special_tokens
    true; logprobs unset (none returned); n 1.

    Raises:
        InvalidRequest("sampling.temperature"): negative, NaN or infinite.
        InvalidRequest("sampling.top_p"): outside (0, 1] (or NaN).
        InvalidRequest("sampling.top_k"): below -1.
        InvalidRequest("sampling.repetition_penalty"): <= 0, NaN or infinite.
        InvalidRequest("sampling.min_p"): outside [0, 1] (or NaN).
        InvalidRequest("sampling.presence_penalty" / "sampling.frequency_penalty"):
            outside [-2, 2] (or NaN).
        InvalidRequest("sampling.logprobs"): over 20.
        InvalidRequest("sampling.n"): 0, or over 16.
        InvalidRequest("sampling.max_tokens"): set to 0.
        InvalidRequest("sampling.min_tokens"): over max_tokens.
        InvalidRequest("sampling.stop"): more than 16 stop strings.
        InvalidRequest("sampling.stop[i]"): empty, or over 256 UTF-8 bytes.
        InvalidRequest("sampling.stop_token_ids[i]"): an id >= vocab_size.
        InvalidRequest("input"): prompt_len >= max_model_len (no room to
            generate even one token).
    """
    if isinstance(sampling, inference_pb2.GenerateRequest):
        sampling = sampling.sampling
    sp = sampling

    temperature = float(sp.temperature) if sp.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(
            "sampling.temperature",
            f"must be a finite number >= 0 (0 = greedy); got {temperature}",
        )
    top_p = float(sp.top_p) if sp.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:  # NaN fails too
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1]; got {top_p}")
    top_k = int(sp.top_k) if sp.HasField("top_k") else 0
    if top_k < -1:
        raise InvalidRequest(
            "sampling.top_k", f"must be -1 or 0 (off), or >= 1 tokens; got {top_k}"
        )
    if top_k == -1 or top_k >= vocab_size:
        top_k = 0
    repetition_penalty = float(sp.repetition_penalty) if sp.HasField("repetition_penalty") else 1.0
    if not math.isfinite(repetition_penalty) or repetition_penalty <= 0:
        raise InvalidRequest(
            "sampling.repetition_penalty",
            f"must be a finite number > 0 (1 = off); got {repetition_penalty}",
        )
    min_p = float(sp.min_p) if sp.HasField("min_p") else 0.0
    if not 0.0 <= min_p <= 1.0:  # NaN fails too
        raise InvalidRequest("sampling.min_p", f"must be in [0, 1] (0 = off); got {min_p}")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = float(getattr(sp, name)) if sp.HasField(name) else 0.0
        if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            raise InvalidRequest(
                f"sampling.{name}",
                f"must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 = off); got {value}",
            )
        penalties[name] = value
    logprobs = int(sp.logprobs) if sp.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise InvalidRequest("sampling.logprobs", f"must be at most {MAX_LOGPROBS}; got {logprobs}")
    n = int(sp.n) if sp.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise InvalidRequest("sampling.n", f"must be in [1, {MAX_N}] (unset = 1); got {n}")
    if temperature < GREEDY_TEMPERATURE_EPS:
        temperature, top_p, top_k, min_p = 0.0, 1.0, 0, 0.0

    if sp.HasField("max_tokens"):
        max_tokens = int(sp.max_tokens)
        if max_tokens == 0:
            raise InvalidRequest(
                "sampling.max_tokens", f"must be >= 1 (unset = {DEFAULT_MAX_TOKENS}); got 0"
            )
    else:
        max_tokens = DEFAULT_MAX_TOKENS
    min_tokens = int(sp.min_tokens) if sp.HasField("min_tokens") else 0
    if min_tokens > max_tokens:
        raise InvalidRequest(
            "sampling.min_tokens", f"must be at most max_tokens ({max_tokens}); got {min_tokens}"
        )
    room = max_model_len - prompt_len
    if room <= 0:
        raise InvalidRequest(
            "input",
            f"the prompt has {prompt_len} tokens; max_model_len is {max_model_len}, "
            f"so a prompt may have at most {max_model_len - 1}",
        )
    max_tokens = min(max_tokens, room)
    min_tokens = min(min_tokens, max_tokens)

    if len(sp.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings; got {len(sp.stop)}"
        )
    for i, s in enumerate(sp.stop):
        if not s:
            raise InvalidRequest(f"sampling.stop[{i}]", "must not be empty")
        n_bytes = len(s.encode("utf-8"))
        if n_bytes > MAX_STOP_STRING_BYTES:
            raise InvalidRequest(
                f"sampling.stop[{i}]",
                f"must be at most {MAX_STOP_STRING_BYTES} UTF-8 bytes; got {n_bytes}",
            )
    stop = list(dict.fromkeys(sp.stop))

    for i, tid in enumerate(sp.stop_token_ids):
        if tid >= vocab_size:
            raise InvalidRequest(
                f"sampling.stop_token_ids[{i}]", f"must be < vocab_size ({vocab_size}); got {tid}"
            )
    stop_token_ids = list(sp.stop_token_ids)
    if not sp.ignore_eos:
        stop_token_ids.extend(int(e) for e in eos_token_ids)

    stop_token_ids = _dedup(stop_token_ids)
    resolved = scheduler_pb2.SequenceSamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
        min_p=min_p,
        presence_penalty=penalties["presence_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        min_tokens=min_tokens,
        stop_token_ids=stop_token_ids if min_tokens else [],
    )
    if sp.HasField("structured_outputs"):
        check_structured_outputs(sp.structured_outputs)
        resolved.structured_outputs.CopyFrom(sp.structured_outputs)
    if sp.HasField("seed"):
        resolved.seed = sp.seed
    if logprobs is not None:
        resolved.num_logprobs = logprobs
    return ResolvedSampling(
        sampling=resolved,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=stop_token_ids,
        min_tokens=min_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
        logprobs=logprobs,
        n=n,
    )


def check_structured_outputs(c: inference_pb2.StructuredOutputs) -> None:
    """Checks what can be checked without the tokenizer (the workers compile it: a schema
    or grammar xgrammar refuses is INVALID_ARGUMENT from there, naming the field too).

    Raises:
        InvalidRequest("sampling.structured_outputs"): no constraint set.
        InvalidRequest("sampling.structured_outputs.<kind>"): json not JSON text of an
            object or boolean schema, json_object false, an empty regex or grammar, text over
            MAX_CONSTRAINT_BYTES, no choices, an empty choice or over MAX_CHOICES of them.
    """
    kind = c.WhichOneof("constraint")
    field = f"sampling.structured_outputs.{kind}"
    if kind is None:
        raise InvalidRequest(
            "sampling.structured_outputs",
            "set one of json, json_object, regex, choice, grammar (or leave it unset)",
        )
    if kind == "json_object":
        if not c.json_object:
            raise InvalidRequest(field, "must be true when set (unset: no constraint)")
        return
    if kind == "choice":
        choices = c.choice.choices
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequest(field, f"needs 1 to {MAX_CHOICES} choices; got {len(choices)}")
        for i, choice in enumerate(choices):
            if not choice:
                raise InvalidRequest(f"{field}.choices[{i}]", "must not be empty")
        return
    text = getattr(c, kind)
    size = len(text.encode("utf-8"))
    if not 0 < size <= MAX_CONSTRAINT_BYTES:
        raise InvalidRequest(field, f"must be 1 to {MAX_CONSTRAINT_BYTES} UTF-8 bytes; got {size}")
    if kind == "json":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidRequest(field, f"not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(
                field, f"a JSON schema is an object or a boolean; got {type(schema).__name__}"
            )
        external = _external_ref(schema)
        if external is not None:  # the engine would leave that part unconstrained
            raise InvalidRequest(
                field, f"only local $ref (#/...) can be resolved; got $ref {external!r}"
            )


def _external_ref(schema: object) -> str | None:
    """The first ``$ref`` in ``schema`` (at any depth) that does not point into the document
    itself (``#...``), or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def validate_prompt_token_ids(ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Checks prompt token ids before they go to a scheduler.

    Args:
        ids: the prompt's token ids (given by the client, or from the
            tokenizer / chat template).
        vocab_size: every id must be below this.
        max_model_len: the prompt must leave room for one generated token,
            so it may have at most max_model_len - 1 tokens.

    Raises:
        InvalidRequest("input"): the prompt is empty, or has
            >= max_model_len tokens.
        InvalidRequest("prompt_token_ids.ids[i]"): the first id >= vocab_size.
    """
    n = len(ids)
    if n == 0:
        raise InvalidRequest("input", "the prompt is empty (0 tokens); it needs at least 1")
    if n >= max_model_len:
        raise InvalidRequest(
            "input",
            f"the prompt has {n} tokens; max_model_len is {max_model_len}, "
            f"so a prompt may have at most {max_model_len - 1}",
        )
    if max(ids) >= vocab_size:  # C-speed check first; find the index only on failure
        for i, tid in enumerate(ids):
            if tid >= vocab_size:
                raise InvalidRequest(
                    f"prompt_token_ids.ids[{i}]",
                    f"must be < vocab_size ({vocab_size}); got {tid}",
                )


def validate_request_id(request_id: str) -> None:
    """Raises InvalidRequest("request_id") for an id over MAX_REQUEST_ID_CHARS characters."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            "request_id",
            f"at most {MAX_REQUEST_ID_CHARS} characters; got {len(request_id)}",
        )
