"""Server-sent events in OpenAI's streaming format: `data: <json>` events, then `data: [DONE]`."""
from __future__ import annotations

import json
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
TEXT = "\x00"  # where a TextEvent's string goes
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps would build one per event
_TEXT_JSON = _JSON.encode(TEXT).encode()


def event(data: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(data).encode() + b"\n\n"


@dataclass(slots=True)
class TextEvent:
    """Events alike but for one string: the JSON around it is encoded once, and each event only escapes its
    string, as the encoder does (a whole encode costs about ten times that, on every streamed token)."""
    before: bytes
    after: bytes

    @classmethod
    def around(cls, data: dict[str, Any]) -> TextEvent | None:
        """The events `data` stands for, with TEXT where the string goes; None unless TEXT is a value exactly once."""
        parts = event(data).split(_TEXT_JSON)
        return cls(*parts) if len(parts) == 2 else None

    def event(self, text: str) -> bytes:
        return self.before + encode_basestring(text).encode() + self.after
