"""One chat answer (a single choice) as the APIs beyond chat completions see it: the Responses API and Anthropic's
Messages API take the same call to the bus, and each writes what comes back in its own shape (a `Shape`).

A Shape is fed in order: `opening()` before the first token, `step()` per token, `closing()` once the answer ended
(or `failure()` if it failed). It may keep state between calls (the blocks or items it opened), but it must be a
pure function of what it was fed: a stream picked up again after a reconnect is the same Shape fed the same steps
from the start, its events counted, the ones the client had skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gateway.errors import ApiError
from gateway.tools import CallDelta, ToolCall


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache


@dataclass(frozen=True, slots=True)
class Step:
    """What one token adds to the answer: answer text (maybe empty), parts of tool calls, and on the last step, how
    the answer ended."""
    content: str
    calls: tuple[CallDelta, ...]
    finish_reason: str | None  # the bus's: "stop" (EOS, a stop string or token), "length", "abort"; None before
    stop_reason: str | int | None  # the stop string (or stop token id) that ended it, if one did


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer so far, or whole: its text (tool-call markup taken out), its finished tool calls, how it ended
    (None while it runs) and its usage."""
    content: str
    calls: tuple[ToolCall, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    usage: Usage


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: its `event:` name (None: the line is left out) and its JSON data."""
    name: str | None
    data: dict[str, Any]


class Shape(Protocol):
    """How one API writes a single-choice answer, whole and streamed."""

    def whole(self, answer: Answer) -> dict[str, Any]:
        """The non-streamed answer's body."""

    def opening(self) -> list[Event]:
        """The events before the first token."""

    def step(self, step: Step) -> list[Event]:
        """The events one token makes (none where it adds nothing a client would see)."""

    def closing(self, answer: Answer) -> list[Event]:
        """The events after the last token."""

    def failure(self, error: ApiError, answer: Answer) -> list[Event]:
        """The events that end a stream whose answer failed after its headers were sent."""
