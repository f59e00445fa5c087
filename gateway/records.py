"""What a gateway keeps in Redis about a call beyond its requests, so that any gateway can serve it later: a streamed
call's record (to pick its stream up again) and a stored response (to retrieve, replay, continue or cancel it).
Each belongs to the API key that made it."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


def request_id(call_id: str, prompt: int = 0) -> str:
    """The bus request of a call's `prompt`th prompt."""
    return f"{call_id}-{prompt}"


def owner(api_key: str | None) -> str:
    """Whose a stored call or response is: a digest of the API key that made it ("" where the server has none)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32] if api_key else ""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """What a gateway needs to make a streamed call again: its route, its body, whose it is and when it came."""
    route: str
    body: bytes
    owner: str
    created: int

    def mapping(self) -> dict[str, bytes | str | int]:
        return {"route": self.route, "body": self.body, "owner": self.owner, "created": self.created}

    @classmethod
    def from_mapping(cls, raw: dict[bytes, bytes]) -> CallRecord:
        return cls(raw[b"route"].decode(), raw[b"body"], raw[b"owner"].decode(), int(raw[b"created"]))


@dataclass(frozen=True, slots=True)
class ResponseRecord:
    """A stored response of the Responses API: its request's body, the conversation it continues (the items of its
    previous responses, as JSON), whose it is, when it came, and whether it runs in the background.
    Its answer is never stored: it is read from its request's `out:` stream, kept as long as the record."""
    body: bytes
    earlier: bytes
    owner: str
    created: int
    background: bool

    def mapping(self) -> dict[str, bytes | str | int]:
        return {"body": self.body, "earlier": self.earlier, "owner": self.owner, "created": self.created,
                "background": int(self.background)}

    @classmethod
    def from_mapping(cls, raw: dict[bytes, bytes]) -> ResponseRecord:
        return cls(raw[b"body"], raw[b"earlier"], raw[b"owner"].decode(), int(raw[b"created"]),
                   raw[b"background"] == b"1")
