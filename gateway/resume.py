"""Streams a client can pick up again, at any gateway: every event of a call's stream has an SSE id that says where
it stands, and the call's record in Redis lets any gateway make the same call again and replay its requests' `out:`
streams. A stream's events are a pure function of those streams' entries, so the replay writes the same events; the
client gets those after the id it sends back as `Last-Event-ID`, each once.

The events of a call with several prompts interleave as their tokens arrive, in an order a replay need not repeat:
so an id counts the events of each prompt (a lane) apart, and of the call's own closing events (the last lane).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.errors import ApiError

EVENT_ID = re.compile(r"([A-Za-z0-9_-]{1,100}):(\d{1,9}(?:\.\d{1,9}){0,1024})")
LAST_EVENT_ID = "Last-Event-ID"


@dataclass(frozen=True, slots=True)
class Position:
    """How many events of each lane of call `call_id` a client has."""
    call_id: str
    counts: tuple[int, ...]

    @property
    def event_id(self) -> str:
        return f"{self.call_id}:{'.'.join(map(str, self.counts))}"

    @classmethod
    def parse(cls, text: str) -> Position:
        match = EVENT_ID.fullmatch(text.strip())
        if match is None:
            raise ApiError(400, f"`{LAST_EVENT_ID}: {text[:120]}` is not the id of an event this server sent",
                           param=LAST_EVENT_ID, code="invalid_last_event_id")
        return cls(match[1], tuple(int(c) for c in match[2].split(".")))


class Numbering:
    """Gives each event of a stream its id, lane by lane, and holds back those a resumed client already has."""

    def __init__(self, call_id: str, lanes: int, after: Position | None = None) -> None:
        self.prefix = f"id: {call_id}:".encode()
        self.counts = [0] * lanes
        if after is not None and len(after.counts) != lanes:
            raise ApiError(400, f"`{LAST_EVENT_ID}` counts {len(after.counts)} lanes of events; this call's stream has "
                           f"{lanes}", param=LAST_EVENT_ID, code="invalid_last_event_id")
        self.after = after.counts if after is not None else (0,) * lanes

    def event(self, lane: int, event: bytes) -> bytes | None:
        """`event` (one `data:` event) with its `id:` line, or None if the client had it."""
        self.counts[lane] += 1
        if self.counts[lane] <= self.after[lane]:
            return None
        return self.prefix + ".".join(map(str, self.counts)).encode() + b"\n" + event
