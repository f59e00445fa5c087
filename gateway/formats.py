"""The two OpenAI response shapes: text completions and chat completions, whole and as stream chunks;
and vLLM's `prompt_logprobs`.

Logprob tokens are shown by `Tokenizer.token_text`: a token that is no whole UTF-8 characters on its own
reads `bytes:\\xNN...`, and chat's `bytes` carry its real bytes.
"""
from __future__ import annotations

import math
from typing import Any

from gateway.calls import GenerateCall
from gateway.generation import TokenLogprob
from gateway.model import Tokenizer
from gateway.tools import CallDelta, ToolCall
from shared.protocol import PromptLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a token of probability 0 reports this


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def prompt_records(token_ids: list[int], logprobs: list[PromptLogprob], offsets: tuple[int, ...],
                   top: int) -> list[TokenLogprob]:
    """The prompt's tokens as logprob records (each with its `top` likeliest); the first token has none."""
    return [TokenLogprob(token_ids[0], None, [], offsets[0], generated=False)] + [
        TokenLogprob(t, p.logprob, p.top[:top], offset, generated=False)
        for t, p, offset in zip(token_ids[1:], logprobs, offsets[1:])]


def vllm_prompt_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[PromptLogprob],
                         top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: None for the first token, then per token {token id: {logprob, rank, decoded_token}} for
    the prompt's own token and its position's `top` likeliest."""
    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": tokenizer.token_text(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, p in zip(token_ids[1:], logprobs):
        position = {str(token_id): entry(token_id, p.logprob, p.rank)}
        for rank, (t, lp) in enumerate(p.top[:top], 1):
            position.setdefault(str(t), entry(t, lp, rank))
        out.append(position)
    return out


class Format:
    """What the two shapes share: how logprob tokens read, and which extra keys a call asked for."""
    id_prefix = object = chunk_object = ""

    def __init__(self, tokenizer: Tokenizer, call: GenerateCall) -> None:
        self.tokenizer = tokenizer
        self.want_logprobs = call.logprobs is not None
        self.token_ids = call.return_token_ids
        # vLLM's return_tokens_as_token_ids: a logprob token reads `token_id:<id>`, whatever its text
        self.token_text = (lambda t: f"token_id:{t}") if call.tokens_as_ids else tokenizer.token_text
        # Chunks that differ in their text alone, so that a template can stand for them (see Generation)
        self.plain_chunks = not (self.want_logprobs or call.return_token_ids or call.continuous_usage
                                 or call.tool_format is not None)

    def _ids(self, out: dict[str, Any], records: list[TokenLogprob]) -> dict[str, Any]:
        if self.token_ids:
            out["token_ids"] = [r.token_id for r in records]
        return out


class CompletionFormat(Format):
    """`/v1/completions`: choices carry `text`; logprobs in the legacy tokens/token_logprobs layout; vLLM's
    `prompt_logprobs` and `prompt_token_ids` on each choice (its prompt's)."""
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def logprobs(self, records: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        text = self.token_text
        tops: list[dict[str, float | None] | None] = []
        for r in records:
            if r.logprob is None:
                tops.append(None)  # the first prompt token: nothing to rank
                continue
            # Keyed by text, as OpenAI's format is; the chosen token's own logprob goes in as sent, so that a
            # client comparing it with the best of the top (lm-eval's greedy check) compares equal floats.
            top = {text(t): _finite(lp) for t, lp in sorted(r.top, key=lambda item: -item[1])}
            top[text(r.token_id)] = _finite(r.logprob)
            tops.append(top)
        return {"tokens": [text(r.token_id) for r in records],
                "token_logprobs": [_finite(r.logprob) for r in records],
                "top_logprobs": tops,
                "text_offset": [r.text_offset for r in records]}

    def choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
               stop_reason: str | None) -> dict[str, Any]:
        return self._ids({"index": index, "text": text, "logprobs": self.logprobs(records),
                          "finish_reason": finish_reason, "stop_reason": stop_reason, "prompt_logprobs": None},
                         [r for r in records if r.generated])

    def chunk_choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
                     stop_reason: str | None) -> dict[str, Any]:
        return self._ids({"index": index, "text": text, "logprobs": self.logprobs(records),
                          "finish_reason": finish_reason, "stop_reason": stop_reason},
                         [r for r in records if r.generated])

    def openings(self, index: int, echo_text: str | None, records: list[TokenLogprob]) -> list[dict[str, Any]]:
        """The chunk choices sent before a choice's first token: the echoed prompt (and its logprobs), if asked."""
        return [] if echo_text is None else [self.chunk_choice(index, echo_text, records, None, None)]

    def first_chunk(self, chunk: dict[str, Any], prompt_ids: list[int], stream_start: bool) -> None:
        """vLLM puts the prompt's ids on the first chunk of each choice."""
        if self.token_ids:
            chunk["choices"][0]["prompt_token_ids"] = prompt_ids

    def answer(self, body: dict[str, Any], prompt_ids: list[list[int]], per_prompt: list[list | None] | None,
               prompt_of: list[int]) -> None:
        """Put the per-prompt keys on each choice of a whole answer (`prompt_of[i]`: choice i's prompt)."""
        for i, choice in enumerate(body["choices"]):
            if per_prompt is not None:
                choice["prompt_logprobs"] = per_prompt[prompt_of[i]]
            if self.token_ids:
                choice["prompt_token_ids"] = prompt_ids[prompt_of[i]]


class ChatFormat(Format):
    """`/v1/chat/completions`: choices carry a message (or a delta); logprobs as a `content` list; vLLM's
    `prompt_logprobs` and `prompt_token_ids` on the response (a chat has one prompt)."""
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, call: GenerateCall) -> None:
        super().__init__(tokenizer, call)
        self.role = call.response_role
        self.prompt_text = call.prompt_text
        self.named_tool = call.named_tool
        self.tokens_as_ids = call.tokens_as_ids

    def _calls_finish(self, finish_reason: str | None) -> str | None:
        """A choice that ends where its model stopped, after tool calls, ends with them (`tool_calls`), unless the
        call named the function: then, as OpenAI answers, `stop`."""
        return "tool_calls" if finish_reason == "stop" and not self.named_tool else finish_reason

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        text = self.token_text(token_id)
        raw = text.encode() if self.tokens_as_ids else self.tokenizer.token_bytes(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}

    def logprobs(self, records: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._entry(r.token_id, r.logprob)
                            | {"top_logprobs": [self._entry(t, lp) for t, lp in r.top]} for r in records]}

    def choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
               stop_reason: str | None, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        """`calls`: the tool calls read from the answer, where the call offered tools (text before them is the
        content, null if none; they end the choice as `tool_calls`)."""
        message: dict[str, Any] = {"role": self.role, "content": text}
        if calls is not None:
            message["tool_calls"] = [c.as_message() for c in calls]
            if calls:
                message["content"] = text or None
                finish_reason = self._calls_finish(finish_reason)
        return self._ids({"index": index, "message": message, "logprobs": self.logprobs(records),
                          "finish_reason": finish_reason, "stop_reason": stop_reason}, records)

    def chunk_choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
                     stop_reason: str | None, calls: list[CallDelta] | None = None,
                     called: bool = False) -> dict[str, Any]:
        """`calls`: parts of tool calls this chunk adds (OpenAI's `delta.tool_calls`); `called`: the choice made
        calls, which its finish reason says."""
        # Every token gets its chunk, with empty content while its text is an unfinished character.
        delta: dict[str, Any] = {"content": text}
        if calls:
            delta = {"tool_calls": [c.as_chunk() for c in calls]} | ({"content": text} if text else {})
        if called:
            finish_reason = self._calls_finish(finish_reason)
        return self._ids({"index": index, "delta": delta, "logprobs": self.logprobs(records),
                          "finish_reason": finish_reason, "stop_reason": stop_reason}, records)

    def openings(self, index: int, echo_text: str | None, records: list[TokenLogprob]) -> list[dict[str, Any]]:
        """The role delta OpenAI sends first for each choice, then (vLLM's echo) the echoed message's content."""
        role = {"index": index, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}
        echo = {"index": index, "delta": {"content": echo_text}, "logprobs": None, "finish_reason": None}
        return [role, echo] if echo_text else [role]

    def first_chunk(self, chunk: dict[str, Any], prompt_ids: list[int], stream_start: bool) -> None:
        """vLLM puts the prompt's ids and text on the stream's first chunk."""
        if not stream_start:
            return
        if self.token_ids:
            chunk["prompt_token_ids"] = prompt_ids
        if self.prompt_text is not None:
            chunk["prompt_text"] = self.prompt_text

    def answer(self, body: dict[str, Any], prompt_ids: list[list[int]], per_prompt: list[list | None] | None,
               prompt_of: list[int]) -> None:
        body["prompt_logprobs"] = per_prompt[0] if per_prompt is not None else None
        if self.token_ids:
            body["prompt_token_ids"] = prompt_ids[0]
        if self.prompt_text is not None:
            body["prompt_text"] = self.prompt_text
