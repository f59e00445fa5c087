"""The aiohttp application: routes, API-key and error middlewares, start-up and shutdown."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from aiohttp import web

from gateway.bus import Bus
from gateway.errors import ApiError, bad_request
from gateway.formats import ChatFormat, CompletionFormat
from gateway.metrics import CONTENT_TYPE
from gateway.model import ServedModel
from gateway.params import GenerateCall, parse_chat, parse_completion
from gateway.serving import BUS_ERRORS, Gateway, Generation
from shared.settings import Settings

log = logging.getLogger(__name__)
GATEWAY = web.AppKey("gateway", Gateway)
# Tokenization runs off the event loop, one call at a time: HF tokenizers are not safe to share between
# concurrent encode calls.
TOKENIZER = web.AppKey("tokenizer_executor", ThreadPoolExecutor)
SHUTDOWN_TIMEOUT_S = 5.0


def too_large(limit: int, size: int | None = None) -> ApiError:
    got = f"of {size} bytes " if size is not None else ""
    return ApiError(413, f"the request body {got}exceeds the limit of {limit} bytes", code="request_too_large")


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every failure leaves as OpenAI's error body."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge:
        return too_large(request.app[GATEWAY].settings.max_body_bytes).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                        type="invalid_request_error" if e.status < 500 else "server_error").response()
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return ApiError(500, "internal error in the gateway; see its log", type="server_error").response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """With an API key set, the /v1 routes need `Authorization: Bearer <key>`; health and metrics stay open."""
    key = request.app[GATEWAY].settings.api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                           code="invalid_api_key")
    return await handler(request)


async def read_json(request: web.Request, limit: int) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit, request.content_length)
    raw = await request.read()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


async def _generate(request: web.Request, parse: Callable[[Any, ServedModel], GenerateCall],
                    fmt: type[CompletionFormat] | type[ChatFormat]) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    received = time.time()
    body = await read_json(request, gw.settings.max_body_bytes)
    call = await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER], parse, body, gw.model)
    generation = Generation(gw, call, fmt(gw.model.tokenizer, call.params.logprobs is not None), received)
    await gw.admit(len(call.prompts))
    return await (generation.stream(request) if call.stream else generation.respond())


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion, CompletionFormat)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat, ChatFormat)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({"object": "list", "data": [{
        "id": gw.model.name, "object": "model", "created": int(gw.started), "owned_by": "pagedserve",
        "root": str(gw.model.path), "max_model_len": gw.model.max_model_len}]})


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        alive, registered = await gw.bus.live_workers()
    except BUS_ERRORS as e:
        return web.json_response({"status": "unavailable", "reason": f"Redis is unreachable: {e}"}, status=503)
    if alive:
        return web.json_response({"status": "ok", "workers": alive})
    reason = ("no worker has registered" if registered == 0
              else f"none of the {registered} registered workers has a live heartbeat")
    return web.json_response({"status": "unavailable", "reason": reason, "workers": []}, status=503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        stats = await gw.bus.stats()
        alive = len((await gw.bus.live_workers())[0])
    except BUS_ERRORS as e:
        log.warning("metrics without the scheduler's snapshot: %s", e)
        stats, alive = None, 0
    body = gw.metrics.render(stats, alive, gw.waiting)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _on_cleanup(app: web.Application) -> None:
    gw = app[GATEWAY]
    if gw.background:
        await asyncio.wait(list(gw.background), timeout=SHUTDOWN_TIMEOUT_S)
    await gw.bus.close()
    app[TOKENIZER].shutdown(wait=False, cancel_futures=True)


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.settings.max_body_bytes,
                          middlewares=[errors_middleware, auth_middleware])
    app[GATEWAY] = gw
    app[TOKENIZER] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.on_cleanup.append(_on_cleanup)
    return app


async def create_app(settings: Settings, model: ServedModel | None = None) -> web.Application:
    """The gateway for `settings`; `model` skips loading the tokenizer again (tests share one)."""
    if model is None:
        model = await asyncio.to_thread(ServedModel.load, settings)
    log.info("serving %s (max_model_len %d) from %s", model.name, model.max_model_len, model.path)
    return build_app(Gateway(settings, model, Bus(settings.redis_url)))


def run(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; in-flight requests are aborted on the bus as their handlers end."""
    log.info("gateway starting on http://%s:%d", settings.host, settings.port)
    web.run_app(create_app(settings), host=settings.host, port=settings.port, handler_cancellation=True,
                shutdown_timeout=SHUTDOWN_TIMEOUT_S, print=None)
    return 0
