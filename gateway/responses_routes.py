"""OpenAI's Responses API: `POST /v1/responses` is a chat call (gateway/responses_api.py translates it) whose answer
ResponseShape writes; a stored response lives in Redis (gateway/records.py), so that any gateway retrieves, replays,
continues, cancels or deletes it, and a background one runs to its end whoever watches.

A stored response's answer is never written down: it is read from its request's `out:` stream, which the scheduler
keeps as long as the record (the request's retention). So every gateway, at any time, tells the same answer and
replays the same events.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway import calls, records, request_model, responses_api, shaped
from gateway.calls import GenerateCall
from gateway.errors import ApiError, bad_request
from gateway.formats import ChatFormat
from gateway.handlers import GATEWAY, TENANT, TOKENIZING, owner_of, read_body, request_id
from gateway.model import ServedModel
from gateway.records import ResponseRecord
from gateway.responses_api import ResponseShape, ResponsesRequest
from gateway.resume import LAST_EVENT_ID, Position
from gateway.bus import Stored
from gateway.serving import BUS_ERRORS, Generation, Origin, bus_unavailable

ID_PREFIX = "resp_"
NUMBER = re.compile(r"[0-9]{1,9}")
LIST_LIMIT = 20  # input items listed per page unless `limit` says otherwise (OpenAI's default)


@dataclass(frozen=True, slots=True)
class Planned:
    """A Responses request and the chat call it makes."""
    req: ResponsesRequest
    call: GenerateCall


def plan(body: Any, model: ServedModel, earlier: list[dict[str, Any]]) -> Planned:
    """The request and its chat call, continuing the stored conversation `earlier`."""
    return plan_request(responses_api.parse(body), model, earlier)


def plan_request(req: ResponsesRequest, model: ServedModel, earlier: list[dict[str, Any]]) -> Planned:
    try:
        chat = request_model.parse_chat(responses_api.chat_body(req, earlier), model.name, model.vocab_size)
        return Planned(req, calls.chat_call(chat, model))
    except ApiError as e:
        raise responses_api.relabel(e) from None


def parse_only(body: Any, model: ServedModel) -> ResponsesRequest:
    return responses_api.parse(body)


async def _run(request: web.Request, raw: bytes, handle) -> Any:
    return await request.app[TOKENIZING].run(raw, handle, request.app[GATEWAY].model)


async def _record(request: web.Request, response_id: str, param: str | None = None) -> ResponseRecord:
    """The stored response, if it exists and is this key's (another key's is a 404 too, as OpenAI answers)."""
    gw = request.app[GATEWAY]
    try:
        record = await gw.bus.load_response(response_id)
    except BUS_ERRORS as e:
        raise bus_unavailable(e) from None
    if record is None or record.owner != owner_of(request):
        raise ApiError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")
    return record


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """A stored response rebuilt: its request, its generation (which follows its request's stream), its shape."""
    record: ResponseRecord
    req: ResponsesRequest
    generation: Generation
    shape: ResponseShape


async def _rebuild(request: web.Request, response_id: str, record: ResponseRecord,
                   resume: Position | None = None) -> Rebuilt:
    gw = request.app[GATEWAY]
    earlier = json.loads(record.earlier)
    planned = await _run(request, record.body, lambda body, model: plan(body, model, earlier))
    origin = Origin(call_id=response_id, resume=resume, background=record.background)
    call = planned.call
    generation = Generation(gw, call, ChatFormat(gw.model.tokenizer, call), record.created, request_id(request),
                            origin)
    return Rebuilt(record, planned.req, generation, ResponseShape(planned.req, response_id, record.created, call.model))


async def _progress(request: web.Request, rebuilt: Rebuilt) -> shaped.Progress:
    try:
        entries = await request.app[GATEWAY].bus.read_out(records.request_id(rebuilt.generation.id))
    except BUS_ERRORS as e:
        raise bus_unavailable(e) from None
    return shaped.snapshot(rebuilt.generation, entries)


def _body(rebuilt: Rebuilt, progress: shaped.Progress) -> dict[str, Any]:
    """The stored response as it stands now."""
    if progress.error is not None:
        error = responses_api.error_body(ApiError(500, progress.error, type="server_error"))
        return rebuilt.shape.body("failed", progress.answer, error)
    if progress.ended:
        return rebuilt.shape.body(responses_api.status_of(progress.answer), progress.answer)
    return rebuilt.shape.body("in_progress" if progress.started else "queued",
                             progress.answer if progress.started else None)


async def _conversation(request: web.Request, previous_id: str) -> list[dict[str, Any]]:
    """The conversation a request continues: the previous response's own, then its input and output items."""
    record = await _record(request, previous_id, "previous_response_id")
    rebuilt = await _rebuild(request, previous_id, record)
    progress = await _progress(request, rebuilt)
    if not progress.ended or progress.error is not None:
        how = "failed" if progress.error is not None else "has not finished yet"
        raise bad_request(f"the previous response {previous_id} {how}", param="previous_response_id")
    return json.loads(record.earlier) + responses_api.conversation_items(rebuilt.req, previous_id, progress.answer)


async def create(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    received = time.time()
    raw = await read_body(request, gw.settings.max_body_bytes)
    if (last := request.headers.get(LAST_EVENT_ID)) is not None:
        position = Position.parse(last)
        return await _replay(request, position.call_id, position)
    req = await _run(request, raw, parse_only)
    earlier = await _conversation(request, req.previous_response_id) if req.previous_response_id else []
    planned = await request.app[TOKENIZING].call(len(raw), plan_request, req, gw.model, earlier)  # parsed once
    call = planned.call
    await gw.admit(call, request[TENANT])
    response_id = ID_PREFIX + uuid.uuid4().hex
    settings = gw.settings
    stored = Stored(response_id, ResponseRecord(raw, json.dumps(earlier).encode(), owner_of(request), int(received),
                                                req.background),
                    settings.response_ttl, settings.max_stored_responses) if req.store else None
    origin = Origin(call_id=response_id, background=req.background, stored=stored, resumable=req.store,
                    retention=settings.response_ttl if req.store else 0.0, tenant=request[TENANT])
    generation = Generation(gw, call, ChatFormat(gw.model.tokenizer, call), received, request_id(request), origin)
    shape = ResponseShape(req, response_id, int(received), call.model)
    if req.background and not req.stream:
        await generation.submit()
        return web.json_response(shape.body("queued", None))
    if req.stream:
        return await shaped.stream(generation, shape, request)
    return web.json_response(await shaped.respond(generation, shape))


async def _replay(request: web.Request, response_id: str, after: Position | None) -> web.StreamResponse:
    record = await _record(request, response_id)
    rebuilt = await _rebuild(request, response_id, record, after or Position(response_id, (0,)))
    return await shaped.stream(rebuilt.generation, rebuilt.shape, request)


def _starting_after(request: web.Request, response_id: str) -> Position | None:
    """Where a replay starts: after `starting_after` (a sequence number), or after the `Last-Event-ID` sent."""
    if (last := request.headers.get(LAST_EVENT_ID)) is not None:
        position = Position.parse(last)
        if position.call_id != response_id:
            raise bad_request(f"`{LAST_EVENT_ID}` names an event of {position.call_id}, not of {response_id}",
                              param=LAST_EVENT_ID)
        return position
    given = request.query.get("starting_after")
    if given is None:
        return None
    if not NUMBER.fullmatch(given):
        raise bad_request(f"`starting_after` must be a sequence number; got {given!r}", param="starting_after")
    return Position(response_id, (int(given) + 1,))  # sequence numbers count from 0


def _flag(request: web.Request, name: str) -> bool:
    value = request.query.get(name, "false").lower()
    if value not in ("true", "false"):
        raise bad_request(f"`{name}` must be true or false; got {value!r}", param=name)
    return value == "true"


async def retrieve(request: web.Request) -> web.StreamResponse:
    response_id = request.match_info["response_id"]
    if _flag(request, "stream"):
        return await _replay(request, response_id, _starting_after(request, response_id))
    rebuilt = await _rebuild(request, response_id, await _record(request, response_id))
    return web.json_response(_body(rebuilt, await _progress(request, rebuilt)))


async def delete(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    await _record(request, response_id)
    try:
        await gw.bus.delete_response(response_id)
    except BUS_ERRORS as e:
        raise bus_unavailable(e) from None
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """Only a background response can be cancelled (OpenAI's rule); one that ended already is answered as it is."""
    gw = request.app[GATEWAY]
    response_id = request.match_info["response_id"]
    record = await _record(request, response_id)
    if not record.background:
        raise bad_request("Only responses created with background=true can be cancelled", param="response_id")
    rebuilt = await _rebuild(request, response_id, record)
    progress = await _progress(request, rebuilt)
    if progress.ended:
        return web.json_response(_body(rebuilt, progress))
    try:
        await gw.bus.abort([records.request_id(response_id)], "cancelled")
    except BUS_ERRORS as e:
        raise bus_unavailable(e) from None
    return web.json_response(rebuilt.shape.body("cancelled", progress.answer))


async def input_items(request: web.Request) -> web.Response:
    """The response's input items in OpenAI's list shape: newest first unless `order=asc`, `limit` (1-100) after the
    item `after` names."""
    response_id = request.match_info["response_id"]
    record = await _record(request, response_id)
    req = await _run(request, record.body, parse_only)
    listed = responses_api.input_items(req, response_id)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"`order` must be asc or desc; got {order!r}", param="order")
    if order == "desc":
        listed.reverse()
    limit = request.query.get("limit", str(LIST_LIMIT))
    if not NUMBER.fullmatch(limit) or not 1 <= int(limit) <= 100:
        raise bad_request(f"`limit` must be from 1 to 100; got {limit!r}", param="limit")
    if (after := request.query.get("after")) is not None:
        ids = [item["id"] for item in listed]
        if after not in ids:
            raise bad_request(f"`after` names no input item of {response_id}: {after!r}", param="after")
        listed = listed[ids.index(after) + 1:]
    page = listed[:int(limit)]
    return web.json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > len(page)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
