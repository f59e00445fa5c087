"""The two OpenAI response shapes: text completions and chat completions, whole and as stream chunks;
and vLLM's `prompt_logprobs`.

Logprob tokens are shown by `Tokenizer.token_text`: a token that is no whole UTF-8 characters on its own
reads `bytes:\\xNN...`, and chat's `bytes` carry its real bytes.
"""
from __future__ import annotations

import math
from typing import Any

from gateway.generation import TokenLogprob
from gateway.model import Tokenizer
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


def prompt_records(token_ids: list[int], logprobs: list[PromptLogprob], offsets: list[int],
                   top: int) -> list[TokenLogprob]:
    """The prompt's tokens as logprob records (each with its `top` likeliest); the first token has none."""
    return [TokenLogprob(token_ids[0], None, [], offsets[0])] + [
        TokenLogprob(t, p.logprob, p.top[:top], offset) for t, p, offset in zip(token_ids[1:], logprobs, offsets[1:])]


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


class CompletionFormat:
    """`/v1/completions`: choices carry `text`; logprobs in the legacy tokens/token_logprobs layout."""
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"
    prompt_logprobs_on_choices = True  # where vLLM puts `prompt_logprobs`: each choice (its prompt's)

    def __init__(self, tokenizer: Tokenizer, logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs

    def logprobs(self, records: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        text = self.tokenizer.token_text
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
        return {"index": index, "text": text, "logprobs": self.logprobs(records), "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
                     stop_reason: str | None) -> dict[str, Any]:
        return self.choice(index, text, records, finish_reason, stop_reason)

    def opening(self, index: int, echo_text: str | None, records: list[TokenLogprob]) -> dict[str, Any] | None:
        """The chunk choice sent before a choice's first token: the echoed prompt (and its logprobs), if asked."""
        if echo_text is None:
            return None
        return self.choice(index, echo_text, records, None, None)


class ChatFormat:
    """`/v1/chat/completions`: choices carry a message (or a delta); logprobs as a `content` list."""
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_logprobs_on_choices = False  # ... or the response (a chat has one prompt)

    def __init__(self, tokenizer: Tokenizer, logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"token": self.tokenizer.token_text(token_id), "logprob": _finite(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}

    def logprobs(self, records: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._entry(r.token_id, r.logprob)
                            | {"top_logprobs": [self._entry(t, lp) for t, lp in r.top]} for r in records]}

    def choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
               stop_reason: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs(records), "finish_reason": finish_reason, "stop_reason": stop_reason}

    def chunk_choice(self, index: int, text: str, records: list[TokenLogprob], finish_reason: str | None,
                     stop_reason: str | None) -> dict[str, Any]:
        # Every token gets its chunk, with empty content while its text is an unfinished character.
        return {"index": index, "delta": {"content": text}, "logprobs": self.logprobs(records),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def opening(self, index: int, echo_text: str | None, records: list[TokenLogprob]) -> dict[str, Any] | None:
        """The role delta OpenAI sends first for each choice."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
