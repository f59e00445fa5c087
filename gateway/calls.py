"""From a parsed request to a call (sans-IO, tokenizer included): the prompts' token ids, the sampling parameters the
bus runs every prompt with, and how to answer: choices, echo, logprobs, usage, token ids.

One pure function per route; SamplingParams is built once, whole, and checked by its own rules (shared/sampling.py),
their errors named as the route names the field.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from gateway.detokenizer import IncrementalDetokenizer
from gateway.errors import bad_request
from gateway.model import ServedModel, Tokenizer
from gateway.request_model import ChatRequest, CompletionRequest, DetokenizeRequest, Sampling, TokenizeRequest
from gateway import tools
from gateway.tools import CallFormat
from shared import constraints
from shared.sampling import ParamError, SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    text: str  # as the echo shows it
    from_text: bool = True  # given as text (else as token ids, and `text` is their decoding)
    text_offsets: tuple[int, ...] | None = None  # per token, where its text starts in `text` (echo with logprobs)


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One completions or chat call: what goes on the bus (a request per prompt, each with `params`) and how the
    answer is made of what comes back."""
    model: str
    prompts: tuple[Prompt, ...]
    params: SamplingParams  # as the bus runs each prompt: params.n samples (best_of or the beam width)
    choices_per_prompt: int  # the client's n
    ranked: bool  # best_of or beam search: choices best first, with their cumulative logprobs
    logprobs: int | None  # top k the client sees per output token (0: the chosen token's alone); None: none
    prompt_logprobs: int | None  # vLLM's `prompt_logprobs` field of the answer
    echo: tuple[str, ...] | None  # per prompt, the text each of its choices starts with; None: no echo
    echo_logprobs: bool  # completions: the choices' logprobs start with the prompt's
    hide_output: bool  # `max_tokens` 0 with echo: the bus makes one token, which is dropped
    stop: tuple[str, ...]
    include_stop_str: bool
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    tokens_as_ids: bool
    response_role: str = ASSISTANT  # chat
    prompt_text: str | None = None  # chat's return_prompt_text
    user: str | None = None
    tool_format: CallFormat | None = None  # chat with tools it may call: how the answers' calls are read
    named_tool: bool = False  # tool_choice named the function: its call ends the choice as `stop` (OpenAI's)
    priority: int = 0  # lower runs first (the priority policy)
    cache_salt: str = ""

    @property
    def work(self) -> int:
        """What the call queues, in tokens: prompts x n x (prompt tokens + max_tokens)."""
        return self.params.n * sum(len(p.token_ids) + self.params.max_tokens for p in self.prompts)


def _check_constraint(s: Sampling, model: ServedModel) -> None:
    """A constraint that does not compile for this model (or not within llguidance's limits) is the client's 400,
    named by the field that asked for it, before anything is queued."""
    if s.constraint is None:
        return
    try:
        constraints.check(s.constraint, model.grammar_tokenizer())
    except constraints.ConstraintError as e:
        raise bad_request(f"`{s.constraint_param}` does not compile: {e}", param=s.constraint_param,
                          code="invalid_constraint") from None


def completion_call(req: CompletionRequest, model: ServedModel) -> GenerateCall:
    tokenizer = model.tokenizer
    prompts = []
    for raw in req.prompts:
        if isinstance(raw, str):
            whole = tokenizer.encode(raw, req.add_special_tokens)
            ids = _truncated(whole, req.sampling, model, req.max_tokens == 0)
            prompts.append(Prompt(ids, raw if ids is whole else tokenizer.decode(ids, skip_special_tokens=True)))
        else:
            ids = _truncated(list(raw), req.sampling, model, req.max_tokens == 0)
            prompts.append(Prompt(ids, tokenizer.decode(ids, skip_special_tokens=False), from_text=False))
    if any(not p.token_ids for p in prompts):
        raise bad_request("the prompt tokenizes to no tokens", param="prompt")
    hide_output = req.echo and req.max_tokens == 0  # as vLLM: the prompt alone, with its logprobs if asked for
    max_tokens = _fit_max_tokens(prompts, 1 if hide_output else req.max_tokens, model, "prompt", COMPLETION_MAX_TOKENS,
                                 "max_tokens")
    echo_logprobs = req.echo and req.logprobs is not None
    bus_prompt_logprobs = max((k for k in (req.sampling.prompt_logprobs, req.logprobs if echo_logprobs else None)
                               if k is not None), default=None)
    params, choices, ranked = _params(req.sampling, max_tokens, req.logprobs, bus_prompt_logprobs, {})
    _check_constraint(req.sampling, model)
    if echo_logprobs:
        prompts = [Prompt(p.token_ids, p.text, p.from_text, _text_offsets(tokenizer, p)) for p in prompts]
    return _call(model, prompts, params, choices, ranked, req.sampling, logprobs=req.logprobs,
                 echo=tuple(p.text for p in prompts) if req.echo else None, echo_logprobs=echo_logprobs,
                 hide_output=hide_output, user=req.sampling.user)


def chat_call(req: ChatRequest, model: ServedModel) -> GenerateCall:
    use = req.tool_use
    offered = [t.for_template() for t in use.tools] if use is not None else None
    rendered = model.tokenizer.render_chat([m.for_template() for m in req.messages], req.template, offered)
    sampling, tool_format = req.sampling, None
    if use is not None and use.choice != "none":
        if sampling.constraint is not None:
            raise bad_request(f"`{sampling.constraint_param}` cannot go with tools the model may call (their calls are "
                              "constrained already): send `tool_choice: \"none\"` to constrain the answer instead",
                              param=sampling.constraint_param)
        tool_format = model.tool_format
        sampling = dataclasses.replace(sampling, constraint=tools.constraint(use, tool_format),
                                       constraint_param="tools")
    ids = _truncated(rendered.token_ids, sampling, model, False)
    prompts = [Prompt(ids, "")]
    max_tokens = _fit_max_tokens(prompts, req.max_tokens, model, "messages", None, req.max_tokens_param)
    renames = {"logprobs": "top_logprobs", "max_tokens": req.max_tokens_param}
    params, choices, ranked = _params(sampling, max_tokens, req.logprobs, sampling.prompt_logprobs, renames)
    _check_constraint(sampling, model)
    # As vLLM: the answer's role is the assistant's, or, continuing the last message, that message's role; its
    # echo is that last message's content when the roles agree.
    last = req.messages[-1]
    role = ASSISTANT if req.template.add_generation_prompt else last.role
    echo = (last.content if last.role == role else "",) if req.echo else None
    return _call(model, prompts, params, choices, ranked, sampling, logprobs=req.logprobs, echo=echo,
                 response_role=role, prompt_text=rendered.text if req.return_prompt_text else None,
                 user=sampling.user or req.safety_identifier, tool_format=tool_format,
                 named_tool=use is not None and use.choice == "function")


def _call(model: ServedModel, prompts: list[Prompt], params: SamplingParams, choices: int, ranked: bool,
          s: Sampling, *, logprobs: int | None, echo: tuple[str, ...] | None, user: str | None,
          echo_logprobs: bool = False, hide_output: bool = False, response_role: str = ASSISTANT,
          prompt_text: str | None = None, tool_format: CallFormat | None = None,
          named_tool: bool = False) -> GenerateCall:
    return GenerateCall(model.name, tuple(prompts), params, choices, ranked, logprobs, s.prompt_logprobs, echo,
                        echo_logprobs, hide_output, s.stop, s.include_stop_str_in_output, s.skip_special_tokens,
                        s.stream, s.include_usage, s.continuous_usage_stats, s.return_token_ids,
                        s.return_tokens_as_token_ids, response_role, prompt_text, user, tool_format, named_tool,
                        s.priority, s.cache_salt)


def _params(s: Sampling, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
            renames: dict[str, str]) -> tuple[SamplingParams, int, bool]:
    """The bus's parameters for every prompt of the call, the choices per prompt, and whether they are ranked.

    Sampling with best_of > n: the bus samples best_of on the prompt's shared blocks, with their logprobs, and the n
    most likely come back (streaming them is a 400, as in OpenAI's API). `use_beam_search`: beams of width best_of
    (or n), the n best returned, best first; what they return only exists at the end (no streaming), and they follow
    the model's distribution itself (penalties, seeds, biases do not apply: a 400 if set)."""
    n = s.n if s.n is not None else 1
    if s.prompt_logprobs is not None and s.stream:
        raise bad_request("`prompt_logprobs` are not available when `stream` is true", param="prompt_logprobs")
    if s.best_of is not None and s.best_of < n:
        raise bad_request(f"`best_of` must be at least `n` ({n}); got {s.best_of}", param="best_of")
    common = dict(max_tokens=max_tokens, min_tokens=s.min_tokens or 0, stop_token_ids=list(s.stop_token_ids),
                  ignore_eos=s.ignore_eos, prompt_logprobs=prompt_logprobs, constraint=s.constraint)
    if not s.use_beam_search:
        for name in ("length_penalty", "early_stopping"):
            if getattr(s, name) is not None:
                raise bad_request(f"`{name}` needs `use_beam_search`", param=name)
        samples = s.best_of if s.best_of is not None else n
        ranked = samples > n
        if ranked and s.stream:
            raise bad_request("`best_of` greater than `n` cannot be streamed", param="best_of")
        params = SamplingParams(
            n=samples, temperature=_or(s.temperature, 1.0), top_p=_or(s.top_p, 1.0), top_k=_or(s.top_k, 0),
            min_p=_or(s.min_p, 0.0), seed=s.seed, presence_penalty=_or(s.presence_penalty, 0.0),
            frequency_penalty=_or(s.frequency_penalty, 0.0), repetition_penalty=_or(s.repetition_penalty, 1.0),
            logit_bias=list(s.logit_bias), allowed_token_ids=list(s.allowed_token_ids or ()),
            # ranking the samples needs each sampled token's logprob, asked for or not
            logprobs=logprobs if logprobs is not None or not ranked else 0, **common)
        return _validated(params, renames | ({"n": "best_of"} if ranked else {})), n, ranked
    if s.stream:
        raise bad_request("beam search cannot be streamed: its beams are known only at the end", param="stream")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "prompt_logprobs"):
        if getattr(s, name) is not None:
            raise bad_request(f"`{name}` does not apply to beam search", param=name)
    params = SamplingParams(n=n, temperature=0.0, beam_width=s.best_of or n, length_penalty=_or(s.length_penalty, 1.0),
                            early_stopping=_or(s.early_stopping, False), logprobs=logprobs,
                            logit_bias=list(s.logit_bias), allowed_token_ids=list(s.allowed_token_ids or ()),
                            **common)
    return _validated(params, renames | {"beam_width": "best_of"}), n, True


def _or(value, default):
    return default if value is None else value


def _validated(params: SamplingParams, renames: dict[str, str]) -> SamplingParams:
    try:
        return params.validate()
    except ParamError as e:
        name = renames.get(e.param, e.param)
        raise bad_request(str(e).replace(e.param, name, 1), param=name) from None


def _truncated(ids: list[int], s: Sampling, model: ServedModel, whole_context: bool) -> list[int]:
    """`truncate_prompt_tokens` as vLLM: keep that many of the prompt's tokens (-1: as many as leave room for one
    output token, or the whole context for an echo alone), the last ones unless `truncation_side` is right."""
    k = s.truncate_prompt_tokens
    if k is None:
        return ids
    limit = model.max_model_len
    if k == -1:
        k = limit if whole_context else limit - 1
    if k < 1:
        raise bad_request(f"`truncate_prompt_tokens` must be -1 or at least 1; got {k} (0 would leave no prompt)",
                          param="truncate_prompt_tokens")
    if k > limit:
        raise bad_request(f"`truncate_prompt_tokens` of {k} is greater than max_model_len, {limit}",
                          param="truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    return ids[-k:] if s.truncation_side == "left" else ids[:k]


def _fit_max_tokens(prompts: list[Prompt], requested: int | None, model: ServedModel, what: str,
                    default: int | None, param: str) -> int:
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


def _text_offsets(tokenizer: Tokenizer, prompt: Prompt) -> tuple[int, ...]:
    """Where each prompt token's text starts in the echoed prompt: after the whole characters the tokens before
    it decode to (a token that continues a character starts where the character does).
    Special tokens count as the echo shows them: written out when the prompt came as token ids, absent from
    a text prompt (where the tokenizer added them)."""
    detok = IncrementalDetokenizer(functools.partial(tokenizer.decode, skip_special_tokens=prompt.from_text))
    offsets, length = [], 0
    for token_id in prompt.token_ids:
        offsets.append(length + detok.held)
        length += len(detok.add(token_id))
    return tuple(offsets)


def tokenize(req: TokenizeRequest, model: ServedModel) -> dict[str, Any]:
    """`POST /tokenize` in vLLM's shape (`token_strs` null unless asked for)."""
    if req.messages is not None:
        ids = model.tokenizer.render_chat([m.for_template() for m in req.messages], req.template,
                                          [t.for_template() for t in req.tools]).token_ids
    else:
        ids = model.tokenizer.encode(req.prompt, req.add_special_tokens)
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
            "token_strs": model.tokenizer.token_strs(ids) if req.return_token_strs else None}


def detokenize(req: DetokenizeRequest, model: ServedModel) -> dict[str, Any]:
    """`POST /detokenize` in vLLM's shape: the ids' text, special tokens written out."""
    return {"prompt": model.tokenizer.decode(list(req.tokens), skip_special_tokens=False)}
