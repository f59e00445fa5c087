"""Parsing and validating OpenAI request bodies into one `GenerateCall` (sans-IO, tokenizer included).

Every rejection is an ApiError with the offending parameter named, so nothing malformed reaches the bus.
Unknown fields are ignored (clients send many); fields pagedserve cannot honour are rejected, not
silently dropped.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import ApiError, bad_request
from gateway.model import ServedModel, Tokenizer
from shared.sampling import ParamError, SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_INT64 = (-(2**63), 2**63 - 1)
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str  # what `echo` shows
    from_text: bool = True  # given as text (else as token ids, and `text` is their decoding)
    text_offsets: list[int] | None = None  # per token, where its text starts in `text` (echo with logprobs)


@dataclass(slots=True)
class GenerateCall:
    model: str
    prompts: list[Prompt]
    params: SamplingParams  # as sent on the bus
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field: top k per prompt token
    echo_logprobs: bool = False  # the choices' logprobs start with the prompt's (`echo` with `logprobs`)
    hide_output: bool = False  # `max_tokens` 0 with `echo`: the bus makes one token, which is dropped
    choices_per_prompt: int = 0  # `n`; fewer than the bus samples with `best_of` (0: as many)
    ranked: bool = False  # best_of or beam search: choices best first, with their cumulative logprobs
    want_logprobs: bool = False  # the client asked for logprobs (best_of asks the bus for them to rank)

    def __post_init__(self) -> None:
        self.choices_per_prompt = self.choices_per_prompt or self.params.n

    @property
    def work(self) -> int:
        """What the call queues, in tokens: prompts x n x (prompt tokens + max_tokens)."""
        return self.params.n * sum(len(p.token_ids) + self.params.max_tokens for p in self.prompts)


def parse_completion(body: Any, model: ServedModel) -> GenerateCall:
    body = _object(body)
    _check_model(body, model)
    _reject_unsupported(body, {"suffix": (None, ""), "logit_bias": (None, {})})
    prompts = _prompts(body.get("prompt"), model)
    echo = _get(body, "echo", bool, False)
    logprobs = _get(body, "logprobs", int, None)
    max_tokens = _get(body, "max_tokens", int, None)
    # As vLLM: with `echo`, max_tokens 0 answers the prompt alone (with its logprobs, if asked for).
    hide_output = echo and max_tokens == 0
    params = _sampling(body, model, logprobs)
    params.max_tokens = _fit_max_tokens(prompts, 1 if hide_output else max_tokens, model, "prompt",
                                        COMPLETION_MAX_TOKENS)
    stream = _stream(body)
    prompt_logprobs = _prompt_logprobs(body, stream[0])
    echo_logprobs = echo and logprobs is not None
    params.prompt_logprobs = max((k for k in (prompt_logprobs, logprobs if echo_logprobs else None) if k is not None),
                                 default=None)
    n, ranked = _best_of(body, params, stream[0])
    _validate(params, {"beam_width": "best_of"})
    if echo_logprobs:
        for p in prompts:
            p.text_offsets = _text_offsets(model.tokenizer, p)
    return GenerateCall(model.name, prompts, params, _stop(body), *stream, echo,
                        _get(body, "skip_special_tokens", bool, True), prompt_logprobs, echo_logprobs, hide_output,
                        n, ranked, logprobs is not None)


def parse_chat(body: Any, model: ServedModel) -> GenerateCall:
    body = _object(body)
    _check_model(body, model)
    _reject_unsupported(body, {"logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
                               "tool_choice": (None, "none")})
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("response_format other than {\"type\": \"text\"} is not supported",
                          param="response_format")
    messages = _messages(body.get("messages"))
    add_generation_prompt = _get(body, "add_generation_prompt", bool, True)
    ids = model.tokenizer.render_chat(messages, add_generation_prompt)
    prompts = [Prompt(ids, "")]  # chat has no echo
    want = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int, None)
    if top is not None and not want:
        raise bad_request("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    renames = {"logprobs": "top_logprobs", "max_tokens": max_name, "beam_width": "best_of"}  # ours → this API's
    max_tokens = _get(body, max_name, int, None)
    params = _sampling(body, model, (top or 0) if want else None)
    params.max_tokens = _fit_max_tokens(prompts, max_tokens, model, "messages", None, max_name)
    stream = _stream(body)
    params.prompt_logprobs = _prompt_logprobs(body, stream[0])
    wanted = params.logprobs is not None
    n, ranked = _best_of(body, params, stream[0])
    _validate(params, renames)
    return GenerateCall(model.name, prompts, params, _stop(body), *stream, False,
                        _get(body, "skip_special_tokens", bool, True), params.prompt_logprobs,
                        choices_per_prompt=n, ranked=ranked, want_logprobs=wanted)


def tokenize(body: Any, model: ServedModel) -> dict[str, Any]:
    """`POST /tokenize` in vLLM's shape: a `prompt` (special tokens added unless `add_special_tokens` is false) or
    chat `messages` (rendered by the chat template, which writes its own)."""
    body = _object(body)
    _check_model(body, model)
    if "messages" in body:
        ids = model.tokenizer.render_chat(_messages(body.get("messages")),
                                          _get(body, "add_generation_prompt", bool, True),
                                          _get(body, "add_special_tokens", bool, False))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("`prompt` (a string) or `messages` is required", param="prompt")
        ids = model.tokenizer.encode(_utf8(prompt, "prompt"), _get(body, "add_special_tokens", bool, True))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    if _get(body, "return_token_strs", bool, False):
        out["token_strs"] = model.tokenizer.token_strs(ids)
    return out


def detokenize(body: Any, model: ServedModel) -> dict[str, Any]:
    """`POST /detokenize` in vLLM's shape: `tokens` back to their text, special tokens written out."""
    body = _object(body)
    _check_model(body, model)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise bad_request("`tokens` must be an array of token ids", param="tokens")
    _check_ids(ids, model, "tokens")
    return {"prompt": model.tokenizer.decode(ids, skip_special_tokens=False)}


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    k = _get(body, "prompt_logprobs", int, None)
    if k is not None and stream:
        raise bad_request("`prompt_logprobs` are not available when `stream` is true", param="prompt_logprobs")
    return k


def _text_offsets(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """Where each prompt token's text starts in the echoed prompt: after the whole characters the tokens before
    it decode to (a token that continues a character starts where the character does).
    Special tokens count as the echo shows them: written out when the prompt came as token ids, absent from
    a text prompt (where the tokenizer added them)."""
    detok = IncrementalDetokenizer(functools.partial(tokenizer.decode, skip_special_tokens=prompt.from_text))
    offsets, length = [], 0
    for token_id in prompt.token_ids:
        offsets.append(length + detok.held)
        length += len(detok.add(token_id))
    return offsets


def _utf8(text: str, param: str) -> str:
    """The text, or 400 when it holds what JSON can carry but UTF-8 cannot: a lone surrogate (\\ud800)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise bad_request(f"`{param}` holds a lone surrogate (U+{ord(e.object[e.start]):04X}), which is not "
                          "text", param=param) from None
    return text


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for tp, name in _KIND_NAMES.items() if type(value) is tp), type(value).__name__)


def _get(body: dict[str, Any], name: str, tp: type, default: Any) -> Any:
    """The field converted to `tp`, or `default` when absent or null; 400 naming the field otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if tp is float and type(value) in (int, float):
        if not math.isfinite(value):
            raise bad_request(f"`{name}` must be a finite number; got {value}", param=name)
        return float(value)
    if tp is int and type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not tp:
        raise bad_request(f"`{name}` must be {_KIND_NAMES[tp]}, not {_kind(value)}", param=name)
    if tp is int and not _INT64[0] <= value <= _INT64[1]:
        raise bad_request(f"`{name}` must fit in a signed 64-bit integer; got {value}", param=name)
    return value


def _check_model(body: dict[str, Any], model: ServedModel) -> None:
    name = _get(body, "model", str, model.name)
    if name != model.name:
        raise ApiError(404, f"the model `{name}` does not exist; this server serves `{model.name}`",
                       param="model", code="model_not_found")


def _reject_unsupported(body: dict[str, Any], harmless: dict[str, tuple[Any, ...]]) -> None:
    for name, allowed in harmless.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"`{name}` is not supported by this server", param=name, code="unsupported")


def _best_of(body: dict[str, Any], params: SamplingParams, stream: bool) -> tuple[int, bool]:
    """OpenAI's `best_of` and vLLM's beam search fields, into `params` (as the bus runs the call). Returns the
    choices per prompt (`n`) and whether they are ranked by cumulative logprob.

    Sampling with best_of > n: the bus samples best_of on the prompt's shared blocks, with their logprobs, and
    the n most likely come back (streaming them is a 400, as in OpenAI's API). `use_beam_search`: beams of width
    best_of (or n), the n best returned, best first; what they return only exists at the end (no streaming), and
    the beams follow the model's distribution itself (penalties and seeds do not apply: a 400 if set)."""
    n = params.n
    best_of = _get(body, "best_of", int, None)
    if best_of is not None and best_of < n:
        raise bad_request(f"`best_of` must be at least `n` ({n}); got {best_of}", param="best_of")
    if not _get(body, "use_beam_search", bool, False):
        for name in ("length_penalty", "early_stopping"):
            if body.get(name) is not None:
                raise bad_request(f"`{name}` needs `use_beam_search`", param=name)
        if best_of is None or best_of == n:
            return n, False
        if stream:
            raise bad_request("`best_of` greater than `n` cannot be streamed", param="best_of")
        params.n = best_of
        if params.logprobs is None:
            params.logprobs = 0  # each sampled token's logprob, to rank the samples by
        return n, True
    if stream:
        raise bad_request("beam search cannot be streamed: its beams are known only at the end", param="stream")
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name) != default:
            raise bad_request(f"`{name}` does not apply to beam search", param=name)
    if params.seed is not None or params.prompt_logprobs is not None:
        name = "seed" if params.seed is not None else "prompt_logprobs"
        raise bad_request(f"`{name}` does not apply to beam search", param=name)
    early = body.get("early_stopping", False)
    if early not in (True, False, "never"):
        raise bad_request(f"`early_stopping` must be true, false or \"never\"; got {early!r}", param="early_stopping")
    params.beam_width = best_of or n
    params.length_penalty = _get(body, "length_penalty", float, 1.0)
    params.early_stopping = early
    params.temperature = 0.0
    return n, True


def _prompts(raw: Any, model: ServedModel) -> list[Prompt]:
    if raw is None:
        raise bad_request("`prompt` is required", param="prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(type(t) is int for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad_request("`prompt` must be a non-empty string, a list of token ids, or a list of either",
                          param="prompt")
    prompts = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise bad_request("`prompt` must not be empty", param="prompt")
            prompts.append(Prompt(model.tokenizer.encode(_utf8(item, "prompt")), item))
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            _check_ids(item, model, "prompt")
            prompts.append(Prompt(list(item), model.tokenizer.decode(item, skip_special_tokens=False), False))
        else:
            raise bad_request("each prompt must be a non-empty string or a non-empty list of token ids, "
                              f"not {_kind(item) if item != [] else 'an empty array'}", param="prompt")
    for p in prompts:
        if not p.token_ids:
            raise bad_request("the prompt tokenizes to no tokens", param="prompt")
    return prompts


def _check_ids(ids: list[int], model: ServedModel, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {model.vocab_size})", param=param)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("`messages` must be a non-empty array of messages", param="messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, not {_kind(m)}", param="messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                              param="messages")
        messages.append({"role": role, "content": _content(m.get("content"), i)})
    return messages


def _content(raw: Any, i: int) -> str:
    if raw is None or isinstance(raw, str):
        return _utf8(raw or "", "messages")
    if isinstance(raw, list):
        parts = []
        for part in raw:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                  "this server takes text only", param="messages")
            parts.append(part["text"])
        return _utf8("".join(parts), "messages")
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts, not {_kind(raw)}",
                      param="messages")


def _stop(body: dict[str, Any]) -> list[str]:
    raw = body.get("stop")
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("`stop` must be a non-empty string or an array of non-empty strings", param="stop")
    return [_utf8(s, "stop") for s in stops]


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true", param="stream_options")
    include_usage = _get(options, "include_usage", bool, False) if options is not None else False
    return stream, include_usage


def _sampling(body: dict[str, Any], model: ServedModel, logprobs: int | None) -> SamplingParams:
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(type(t) is int for t in stop_ids):
        raise bad_request("`stop_token_ids` must be an array of integers", param="stop_token_ids")
    _check_ids(stop_ids, model, "stop_token_ids")
    params = SamplingParams(
        n=_get(body, "n", int, 1),
        min_tokens=_get(body, "min_tokens", int, 0),
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0),
        min_p=_get(body, "min_p", float, 0.0),
        seed=_get(body, "seed", int, None),
        presence_penalty=_get(body, "presence_penalty", float, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", float, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", float, 1.0),
        stop_token_ids=list(stop_ids),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=logprobs,
    )
    _get(body, "user", str, None)  # accepted and type-checked; pagedserve keeps no per-user state
    return params


def _fit_max_tokens(prompts: list[Prompt], requested: int | None, model: ServedModel, what: str,
                    default: int | None, param: str = "max_tokens") -> int:
    """`requested`, or the default capped to the room left; 400 when a prompt leaves too little room."""
    limit = model.max_model_len
    longest = max(len(p.token_ids) for p in prompts)
    if requested is not None:
        if requested >= 1 and longest + requested > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{longest + requested} tokens ({longest} in the {what}, {requested} in the "
                              f"completion). Please reduce the length of the {what} or `{param}`.",
                              param=param, code="context_length_exceeded")
        return requested
    if longest >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, the {what} is "
                          f"{longest} tokens long, which leaves no room for the completion.",
                          param=what, code="context_length_exceeded")
    room = limit - longest
    return room if default is None else min(default, room)


def _validate(params: SamplingParams, renames: dict[str, str]) -> None:
    try:
        params.validate()
    except ParamError as e:
        name = renames.get(e.param, e.param)
        raise bad_request(str(e).replace(e.param, name, 1), param=name) from None
