"""Serving a call whose one answer a Shape writes (gateway/answer.py): the Responses and Messages APIs. The answer's
deltas come from the call's one request as Generation reads them; its events get ids as every stream's do
(gateway/resume.py), so that a client can pick the stream up again at any gateway.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from aiohttp import web

from gateway import sse, tools
from gateway.answer import Answer, Event, Shape, Step, Usage
from gateway.generation import Delta
from gateway.errors import ApiError
from gateway.serving import Generation, LaneEvent, RequestFailed, failure
from shared.protocol import Assignment, TokenOutput


class Steps:
    """A generation's one choice read as Steps: the answer's text less its tool calls, and the calls' parts, by the
    same parser whole and streamed (so that the two agree)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        fmt = generation.call.tool_format
        self.parser = tools.CallParser(fmt, f"{generation.id}/0") if fmt is not None else None
        self.content: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def step(self, delta: Delta) -> Step:
        ends = delta.finish_reason is not None
        piece = tools.Piece(delta.text) if self.parser is None else self.parser.feed(delta.text, end=ends)
        self.content.append(piece.content)
        if ends:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return Step(piece.content, piece.calls, delta.finish_reason, delta.stop_reason)

    def answer(self) -> Answer:
        trackers = self.generation.trackers
        usage = Usage(self.generation.prompt_tokens, sum(t.num_generated for t in trackers),
                      sum(t.num_cached_tokens for t in trackers))
        calls = tuple(self.parser.calls) if self.parser is not None else ()
        return Answer("".join(self.content), calls, self.finish_reason, self.stop_reason, usage)


def encode(event: Event) -> bytes:
    named = b"event: " + event.name.encode() + b"\n" if event.name is not None else b""
    return named + sse.event(event.data)


async def respond(generation: Generation, shape: Shape) -> dict:
    """The whole answer's body; a failed request raises its ApiError."""
    steps = Steps(generation)
    try:
        async with contextlib.aclosing(generation.events()) as events:
            async for batch in events:
                for _, delta in batch:
                    steps.step(delta)
    except RequestFailed as e:
        raise failure(e) from None
    return shape.whole(steps.answer())


class ShapeEvents:
    """A Shape's events as a stream's (gateway/serving.py's EventSource), in one lane."""
    lanes = 1

    def __init__(self, shape: Shape, steps: Steps) -> None:
        self.shape = shape
        self.steps = steps

    def opening(self) -> list[LaneEvent]:
        return self._lane(self.shape.opening())

    def batch(self, batch: list[tuple[int, Delta]]) -> list[LaneEvent]:
        return self._lane([e for _, delta in batch for e in self.shape.step(self.steps.step(delta))])

    def closing(self) -> list[LaneEvent]:
        return self._lane(self.shape.closing(self.steps.answer()))

    def failure(self, error: ApiError) -> list[LaneEvent]:
        return self._lane(self.shape.failure(error, self.steps.answer()))

    @staticmethod
    def _lane(events: list[Event]) -> list[LaneEvent]:
        return [LaneEvent(0, encode(e)) for e in events]


async def stream(generation: Generation, shape: Shape, request: web.Request) -> web.StreamResponse:
    """The answer as the shape's events, each with its id; a resumed stream leaves out those its client had."""
    return await generation.stream(request, ShapeEvents(shape, Steps(generation)))


def snapshot(generation: Generation, entries: list[TokenOutput | Assignment]) -> Progress:
    """Where the generation's one request stands after `entries` of its stream (read as they are now)."""
    steps = Steps(generation)
    tracker = generation.trackers[0]
    for entry in entries:
        for delta in tracker.apply(entry):
            steps.step(delta)
        if tracker.error is not None:
            break
    return Progress(steps.answer(), tracker.started, tracker.finished, tracker.error)


@dataclass(frozen=True, slots=True)
class Progress:
    """A request's answer so far: whether a token came, whether it ended, and how it failed if it did."""
    answer: Answer
    started: bool
    ended: bool
    error: str | None
