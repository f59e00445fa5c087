"""The two OpenAI response shapes: text completions and chat completions, whole and as stream chunks."""
from __future__ import annotations

import math
from typing import Any

from gateway.generation import TokenLogprob
from gateway.model import Tokenizer

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a token of probability 0 reports this


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(logprob: float | None) -> float | None:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class CompletionFormat:
    """`/v1/completions`: choices carry `text`; logprobs in the legacy tokens/token_logprobs layout."""
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, tokenizer: Tokenizer, logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs

    def logprobs(self, records: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        text = self.tokenizer.token_text
        tops = []
        for r in records:
            # Keyed by text, as OpenAI's format is: tokens that decode alike keep the likeliest's logprob.
            top: dict[str, float | None] = {}
            for t, lp in sorted(r.top, key=lambda item: -item[1]):
                top.setdefault(text(t), _finite(lp))
            top.setdefault(text(r.token_id), _finite(r.logprob))
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

    def opening(self, index: int, echo_text: str | None) -> dict[str, Any] | None:
        """The choice of the first chunk sent before any token: the echoed prompt, if asked for."""
        if echo_text is None:
            return None
        return self.choice(index, echo_text, [], None, None)


class ChatFormat:
    """`/v1/chat/completions`: choices carry a message (or a delta); logprobs as a `content` list."""
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, tokenizer: Tokenizer, logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.want_logprobs = logprobs

    def _entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        token = self.tokenizer.token_text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

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
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": self.logprobs(records), "finish_reason": finish_reason, "stop_reason": stop_reason}

    def opening(self, index: int, echo_text: str | None) -> dict[str, Any] | None:
        """The role delta OpenAI sends first for each choice."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
