"""One bus request seen from the gateway: TokenOutputs in, text deltas out (sans-IO).

Applies the bus contract through the stream's fold (shared/out_stream.py): only the assigned worker's
tokens count, each once, in index order; a sample ends at the entry carrying its finish reason; the
scheduler's entry with sample_index -1 ends the whole request: with its error (finish reason "error"),
or by ending every sample still running with its finish reason. Text is detokenized
incrementally and checked for stop strings; a sample that hits one is finished here, and the request
must then be aborted on the bus (`needs_abort`) so the scheduler frees its blocks. The request's first token
brings what the worker learnt from the prompt: its cached tokens and, when asked for, its logprobs (a first
token without them fails the request: the answer would lack them).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop import StopStrings
from shared.out_stream import OutOfOrder, OutputFold
from shared.protocol import FAILED, Assignment, PromptLogprob, TokenOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: the first prompt token, which has none
    top: list[tuple[int, float]]
    text_offset: int  # where this token's text starts in the sample's detokenized text
    generated: bool = True  # else a prompt token's (an echo's)


@dataclass(slots=True)
class Delta:
    """What one new token changes for one sample: text to send (maybe empty), its logprob, the finish."""
    sample_index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass(slots=True)
class SampleText:
    """One sample of a request as the gateway turns its tokens into text: detokenized, held back at stop strings."""
    detok: IncrementalDetokenizer
    stop: StopStrings
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""  # sent (or to be sent) to the client
    detok_len: int = 0
    finish_reason: str | None = None
    stop_reason: str | None = None
    ended_on_bus: bool = False


class RequestTracker:
    def __init__(self, rid: str, n: int, max_tokens: int, prompt_ids: list[int], decode: Callable[[list[int]], str],
                 stops: tuple[str, ...], *, include_stop: bool = False,
                 appended_text: Callable[[int], str | None] | None = None,
                 prompt_logprobs: bool = False, hide_output: bool = False,
                 logger: logging.Logger | logging.LoggerAdapter = log) -> None:
        self.rid = rid
        self.fold = OutputFold(n, max_tokens)
        self.samples = [SampleText(IncrementalDetokenizer.after_prompt(decode, prompt_ids, appended_text),
                               StopStrings(list(stops), include_stop)) for _ in range(n)]
        self.running = n  # samples not finished yet
        self.prompt_len = len(prompt_ids)
        self.want_prompt_logprobs = prompt_logprobs
        self.hide_output = hide_output  # the tokens end the samples but are no part of the answer
        self.log = logger
        self.error: str | None = None
        self.error_kind: str | None = None
        self.retry_after: float | None = None  # with error_kind OVERLOADED
        self.ended_on_bus = False  # the scheduler ended the whole request (error, abort, or cache outgrown)
        self.started = False  # a first token arrived
        self.num_cached_tokens = 0  # prompt tokens the worker found in its prefix cache
        self.prompt_logprobs: list[PromptLogprob] | None = None  # one per prompt token after the first

    @property
    def finished(self) -> bool:
        return self.error is not None or self.running == 0

    @property
    def needs_abort(self) -> bool:
        """Finished here while the scheduler still runs some sample (a stop string was hit)."""
        return not self.ended_on_bus and not all(s.ended_on_bus for s in self.samples)

    @property
    def num_generated(self) -> int:
        return 0 if self.hide_output else sum(len(s.token_ids) for s in self.samples)

    def apply(self, entry: TokenOutput | Assignment) -> list[Delta]:
        """Take one entry of the request's output stream; the deltas it makes (none, one, or one per
        sample still running when the scheduler ends the whole request)."""
        if entry.rid != self.rid or self.error is not None:
            return []
        try:
            out = self.fold.apply(entry)
        except OutOfOrder as e:
            self.log.warning("request %s: dropped an entry of its output stream: %s", self.rid, e)
            return []
        if out is None:
            return []
        if out.sample_index == -1:
            self.ended_on_bus = True
            if out.finish_reason == "error":
                self.error = out.error or "the request failed"
                self.error_kind = out.error_kind
                self.retry_after = out.retry_after
                return []
            reason = out.finish_reason or "abort"
            return [self._end(i, "", reason) for i, s in enumerate(self.samples) if s.finish_reason is None]
        if not self.started and not self._take_prompt_results(out):
            return []
        sample = self.samples[out.sample_index]
        if out.finish_reason is not None:
            sample.ended_on_bus = True
        if sample.finish_reason is not None:
            return []  # ended here by a stop string; the bus goes on until the abort lands
        if self.hide_output:
            sample.token_ids.append(out.token_id)
            return [self._end(out.sample_index, "", out.finish_reason and "length")]
        sample.token_ids.append(out.token_id)
        record = TokenLogprob(out.token_id, out.logprob, list(out.top_logprobs), sample.detok_len + sample.detok.held)
        sample.logprobs.append(record)
        # A token that ends the sample as a stop token (EOS or stop_token_ids) is not part of the text.
        new = "" if out.finish_reason == "stop" else sample.detok.add(out.token_id)
        return [self._end(out.sample_index, new, out.finish_reason, [record])]

    def _take_prompt_results(self, first: TokenOutput) -> bool:
        """Keep what the request's first token says about the prompt; False (the request failed) when it lacks
        the prompt logprobs asked for."""
        self.started = True
        if first.num_cached_tokens is not None:
            self.num_cached_tokens = min(max(first.num_cached_tokens, 0), self.prompt_len)
        if not self.want_prompt_logprobs:
            return True
        got = first.prompt_logprobs
        if got is None or len(got) != self.prompt_len - 1:
            self.error = (f"the worker sent {'no' if got is None else len(got)} prompt logprobs for a prompt of "
                          f"{self.prompt_len} tokens")
            self.error_kind = FAILED
            return False
        self.prompt_logprobs = got
        return True

    def _end(self, index: int, new: str, finish_reason: str | None, records: list[TokenLogprob] | None = None) -> Delta:
        """Feed new text to a sample through its stop strings; a finish flushes what was held back."""
        sample = self.samples[index]
        if finish_reason is not None:
            new += sample.detok.flush()
        sample.detok_len += len(new)
        text, stop = sample.stop.feed(new)
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
        elif finish_reason is not None:
            text += sample.stop.flush()
            sample.finish_reason = finish_reason
        if sample.finish_reason is not None:  # callers pass running samples only
            self.running -= 1
        sample.text += text
        return Delta(index, text, records or [], sample.finish_reason, sample.stop_reason)
