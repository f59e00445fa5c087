"""Anthropic's Messages API: `POST /v1/messages` is a chat call (gateway/messages_api.py translates it) whose answer
MessagesShape writes; `POST /v1/messages/count_tokens` counts its prompt. Errors leave in Anthropic's shape (the
app's error middleware writes them so on these routes)."""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from aiohttp import web

from gateway import calls, messages_api, request_model, shaped
from gateway.calls import GenerateCall
from gateway.errors import ApiError
from gateway.formats import ChatFormat
from gateway.handlers import GATEWAY, TOKENIZING, begin, read_body, request_id
from gateway.model import ServedModel
from gateway.serving import Generation

ID_PREFIX = "msg_"


def messages_call(body: Any, model: ServedModel) -> GenerateCall:
    try:
        chat = request_model.parse_chat(messages_api.chat_body(body), model.name, model.vocab_size)
        return calls.chat_call(chat, model)
    except ApiError as e:
        raise messages_api.relabel(e) from None


def count_tokens_answer(body: Any, model: ServedModel) -> dict:
    try:
        tokenize = request_model.parse_tokenize(messages_api.count_tokens_body(body), model.name)
        return messages_api.count_tokens_answer(calls.tokenize(tokenize, model)["count"])
    except ApiError as e:
        raise messages_api.relabel(e) from None


async def messages(request: web.Request) -> web.StreamResponse:
    begun = await begin(request, messages_call)
    gw, call = request.app[GATEWAY], begun.call
    origin = begun.origin
    if origin.call_id is None:
        origin = dataclasses.replace(origin, call_id=ID_PREFIX + uuid.uuid4().hex)
    generation = Generation(gw, call, ChatFormat(gw.model.tokenizer, call), begun.received, request_id(request),
                            origin)
    shape = messages_api.MessagesShape(generation.id, call.model, generation.prompt_tokens)
    if call.stream:
        return await shaped.stream(generation, shape, request)
    return web.json_response(await shaped.respond(generation, shape))


async def count_tokens(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    raw = await read_body(request, gw.settings.max_body_bytes)
    return web.json_response(await request.app[TOKENIZING].run(raw, count_tokens_answer, gw.model))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
