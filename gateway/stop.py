"""Stop strings: find the first one in the generated text, and hold back text that may begin one."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StopStrings:
    """Fed text deltas; releases the text that can no longer be part of a stop string.

    The longest tail of the text that begins some stop string stays pending, so a stop string split
    over several deltas is never half-streamed; on a match the text before it is released and the rest
    dropped.
    """
    stops: list[str]
    include: bool = False  # the stop string matched stays in the text (vLLM's include_stop_str_in_output)
    pending: str = ""
    hold: int = field(init=False)

    def __post_init__(self) -> None:
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to send, the stop string matched or None)."""
        if not self.stops:
            return text, None  # most requests have none: nothing to search or hold back
        self.pending += text
        hit = min(((i, s) for s in self.stops if (i := self.pending.find(s)) >= 0), default=None)
        if hit is not None:
            end = hit[0] + len(hit[1]) if self.include else hit[0]
            out, self.pending = self.pending[:end], ""
            return out, hit[1]
        cut = len(self.pending) - self._partial_match()
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def _partial_match(self) -> int:
        """Length of the longest tail of `pending` that is the start of a stop string."""
        for k in range(min(self.hold, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """At the end of the sequence the held-back tail can no longer start a stop string."""
        out, self.pending = self.pending, ""
        return out
