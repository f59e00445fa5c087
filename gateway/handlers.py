"""What every route handler shares: the app's keys, the threads that parse and tokenize bodies, reading a JSON body,
whose a call is, and how a generating call begins: new, or as the rest of a stream made earlier (`Last-Event-ID`)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from gateway.calls import GenerateCall
from gateway.errors import ApiError, bad_request
from gateway.model import ServedModel
from gateway.records import CallRecord, owner
from gateway.resume import LAST_EVENT_ID, Position
from gateway.serving import BUS_ERRORS, REQUEST_ID, CallLog, Gateway, Origin, bus_unavailable
from shared.tenants import Tenant

log = logging.getLogger("gateway.app")


GATEWAY = web.AppKey("gateway", Gateway)
TENANT = web.RequestKey("tenant", Tenant)  # the call's, from its API key (the auth middleware's)

# The gateway decodes a compressed body itself (aiohttp's own decoding answers a bad one in its own format, or
# not at all): gzip or zlib-wrapped deflate, told apart by their headers.
CONTENT_ENCODINGS = {"gzip": zlib.MAX_WBITS | 32, "deflate": zlib.MAX_WBITS | 32, "identity": None, "": None}

SMALL_BODY_BYTES = 64 << 10
LARGE_BODY_THREADS = 2

@dataclass(slots=True)
class Tokenizing:
    """Where request bodies are decoded and tokenized: threads, off the event loop (the Rust tokenizer lets go
    of the GIL while it works), with small bodies in a lane of their own so that a few huge prompts never
    hold up a small one."""
    small: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize-small"))
    large: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(LARGE_BODY_THREADS, thread_name_prefix="tokenize-large"))

    async def run(self, raw: bytes, handle: Callable[[Any, ServedModel], Any], model: ServedModel) -> Any:
        """`handle(body, model)` over the JSON body `raw`, in the lane its size picks."""
        return await self.call(len(raw), _handle_json, raw, handle, model)

    async def call(self, size: int, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)` for a body of `size` bytes, in the lane that size picks."""
        lane = self.small if size <= SMALL_BODY_BYTES else self.large
        return await asyncio.get_running_loop().run_in_executor(lane, work, *args)

    def shutdown(self) -> None:
        for lane in (self.small, self.large):
            lane.shutdown(wait=False, cancel_futures=True)


TOKENIZING = web.AppKey("tokenizing", Tokenizing)


def _handle_json(raw: bytes, handle: Callable[[Any, ServedModel], Any], model: ServedModel) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    return handle(body, model)


def too_large(limit: int, size: int | None = None) -> ApiError:
    got = f"of {size} bytes " if size is not None else ""
    return ApiError(413, f"the request body {got}exceeds the limit of {limit} bytes", code="request_too_large")


def request_id(request: web.Request) -> str:
    return request.headers[REQUEST_ID]


def call_log(request: web.Request) -> CallLog:
    return CallLog(log, {"request_id": request_id(request)})


def given_key(request: web.Request) -> str:
    """The API key a call sends: `Authorization: Bearer <key>`, or Anthropic's `x-api-key` header."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


def owner_of(request: web.Request) -> str:
    """Whose the call's stored streams and responses are: its API key's (all one owner where the server has none)."""
    return owner(given_key(request) if request.app[GATEWAY].keys.keys.required else None)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The JSON body, decompressed as its Content-Encoding says, at most `limit` bytes either way. Any other
    Content-Type is a 415 before the body is read: a browser sends form and text bodies cross-origin without asking
    first, so a page a user opens must not be able to make a server on their loopback generate."""
    if request.content_type != "application/json" or (request.charset or "utf-8").lower() != "utf-8":
        given = request.headers.get("Content-Type") or "none"
        raise ApiError(415, f"the request body must be JSON, sent with `Content-Type: application/json` (UTF-8); "
                       f"got {given}", code="unsupported_media_type")
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit, request.content_length)
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in CONTENT_ENCODINGS:
        raise ApiError(415, f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none",
                       code="unsupported_content_encoding")
    raw = await request.read()
    wbits = CONTENT_ENCODINGS[encoding]
    if wbits is None:
        return raw
    inflate = zlib.decompressobj(wbits)
    try:
        body = inflate.decompress(raw, limit + 1)
    except zlib.error as e:
        raise bad_request(f"the request body is not {encoding} as its Content-Encoding says: {e}") from None
    if len(body) > limit:
        raise too_large(limit)
    if not inflate.eof:
        raise bad_request(f"the request body is cut short: its {encoding} stream does not end")
    return body


@dataclass(frozen=True, slots=True)
class Begun:
    """A generating call as its handler has it: the call, where it comes from, when it came."""
    call: GenerateCall
    origin: Origin
    received: float


async def begin(request: web.Request, plan: Callable[[Any, ServedModel], GenerateCall]) -> Begun:
    """A new call (admitted), or with `Last-Event-ID` the call whose stream it picks up (made at any gateway)."""
    gw = request.app[GATEWAY]
    received = time.time()
    raw = await read_body(request, gw.settings.max_body_bytes)
    last = request.headers.get(LAST_EVENT_ID)
    if last is None:
        origin = Origin(CallRecord(request.path, raw, owner_of(request), int(received)), tenant=request[TENANT])
    else:
        origin = await _resumed(request, Position.parse(last), raw)
    call = await request.app[TOKENIZING].run(origin.record.body, plan, gw.model)
    if origin.resume is None:
        if call.user is not None:
            call_log(request).info("for user %r", call.user)
        await gw.admit(call, request[TENANT])
    elif not call.stream:
        raise bad_request(f"`{LAST_EVENT_ID}` picks up a stream; this call has `stream` false", param=LAST_EVENT_ID)
    else:
        call_log(request).info("picking up the stream of %s after %s", origin.call_id, last)
    return Begun(call, origin, received)


async def _resumed(request: web.Request, position: Position, raw: bytes) -> Origin:
    """The origin of a stream picked up again: the call's record, which must be this route's and this key's, and
    whose body the client sent again (a client reconnects with its request as it was)."""
    gw = request.app[GATEWAY]
    try:
        record = await gw.bus.load_call(position.call_id)
    except BUS_ERRORS as e:
        raise bus_unavailable(e) from None
    if record is None or record.route != request.path or record.owner != owner_of(request):
        raise ApiError(404, f"no stream of `{position.call_id}` to pick up at {request.path}: it has expired, or "
                       "was never made here", param=LAST_EVENT_ID, code="stream_not_found")
    if raw != record.body and _json_or_none(raw) != _json_or_none(record.body):
        raise bad_request(f"the body differs from that of `{position.call_id}`, whose stream `{LAST_EVENT_ID}` "
                          "picks up: send the same request again", param=LAST_EVENT_ID)
    return Origin(record, position.call_id, position)


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
