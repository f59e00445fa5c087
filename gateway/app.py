"""The aiohttp application: routes, request-id, error and API-key middlewares, start-up and shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import uuid
from typing import Any, AsyncIterator, Callable

from aiohttp import web
from aiohttp.web_log import AccessLogger
from multidict import CIMultiDict

from gateway import calls, messages_api, messages_routes, request_model, responses_routes
from gateway.admission import Admission
from gateway.bus import Bus
from gateway.dashboard import PAGE, STATIC_PREFIX, add_dashboard
from gateway.calls import GenerateCall
from gateway.errors import ApiError
from gateway.formats import ChatFormat, CompletionFormat
from gateway.handlers import (
    GATEWAY, TENANT, TOKENIZING, Tokenizing, begin, call_log, given_key, read_body, request_id, too_large,
)
from gateway.keys import KeyRing
from gateway.metrics import CONTENT_TYPE
from gateway.model import ServedModel
from gateway.replication import ReplicaGate
from gateway.serving import BUS_ERRORS, REQUEST_ID, Gateway, Generation
from shared.settings import Settings

log = logging.getLogger(__name__)
USABLE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: safe in headers and logs
OPEN_PATHS = ("/health", "/metrics", PAGE)  # answer without the API key
PROBE_PATHS = ("/health", "/metrics")  # polled by launchers, load balancers and Prometheus: not access-logged
SERVER_OPTIONS = {"auto_decompress": False}
SHUTDOWN_TIMEOUT_S = 5.0
ANTHROPIC_PREFIX = "/v1/messages"  # routes that answer errors in Anthropic's shape


class AccessLog(AccessLogger):
    """aiohttp's access log, less the probes' calls: `pagedserve up` polls /health five times a second while its
    stack starts, and those lines would bury what the services say they are doing."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path not in PROBE_PATHS:
            super().log(request, response, time)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every call has a request id: the client's X-Request-Id when it sends a usable one, else a new one. The
    answer carries it back, and the call's log lines start with it."""
    given = request.headers.get(REQUEST_ID, "")
    rid = given if USABLE_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
    if rid != given:
        headers = CIMultiDict(request.headers)
        headers[REQUEST_ID] = rid
        request = request.clone(headers=headers)
    response = await handler(request)
    if not response.prepared:  # a stream sets it itself, before its headers leave
        response.headers[REQUEST_ID] = rid
    return response


@web.middleware
async def errors_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every failure leaves as OpenAI's error body (Anthropic's on its routes)."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error(request, e)
    except web.HTTPRequestEntityTooLarge:
        return _error(request, too_large(request.app[GATEWAY].settings.max_body_bytes))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(request, ApiError(e.status, f"{e.reason}: {request.method} {request.path}",
                                        type="invalid_request_error" if e.status < 500 else "server_error"))
    except Exception:
        call_log(request).exception("unexpected error answering %s %s", request.method, request.path)
        return _error(request, ApiError(500, "internal error in the gateway; see its log", type="server_error"))


def _error(request: web.Request, e: ApiError) -> web.Response:
    if request.path.startswith(ANTHROPIC_PREFIX):
        return web.json_response(messages_api.error_body(e), status=e.status, headers=e.headers)
    return e.response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """With API keys set, every route but health, metrics and the dashboard's page and files (which hold no data)
    needs one of them, as `Authorization: Bearer <key>` (or `x-api-key: <key>`); the key names the call's tenant."""
    if request.path in OPEN_PATHS or request.path.startswith(STATIC_PREFIX):
        return await handler(request)
    tenant = request.app[GATEWAY].keys.tenant(given_key(request))
    if tenant is None:
        raise ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`", code="invalid_api_key")
    request[TENANT] = tenant
    return await handler(request)


def completion_call(body: Any, model: ServedModel) -> GenerateCall:
    return calls.completion_call(request_model.parse_completion(body, model.name, model.vocab_size), model)


def chat_call(body: Any, model: ServedModel) -> GenerateCall:
    return calls.chat_call(request_model.parse_chat(body, model.name, model.vocab_size), model)


def tokenize_answer(body: Any, model: ServedModel) -> dict:
    return calls.tokenize(request_model.parse_tokenize(body, model.name), model)


def detokenize_answer(body: Any, model: ServedModel) -> dict:
    return calls.detokenize(request_model.parse_detokenize(body, model.name, model.vocab_size), model)


async def _generate(request: web.Request, plan: Callable[[Any, ServedModel], GenerateCall],
                    fmt: type[CompletionFormat] | type[ChatFormat]) -> web.StreamResponse:
    begun = await begin(request, plan)
    gw, call = request.app[GATEWAY], begun.call
    generation = Generation(gw, call, fmt(gw.model.tokenizer, call), begun.received, request_id(request), begun.origin)
    return await (generation.stream(request) if call.stream else generation.respond())


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, completion_call, CompletionFormat)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat_call, ChatFormat)


async def _tokenizer_call(request: web.Request, handle: Callable[[Any, ServedModel], dict]) -> web.Response:
    gw = request.app[GATEWAY]
    raw = await read_body(request, gw.settings.max_body_bytes)
    return web.json_response(await request.app[TOKENIZING].run(raw, handle, gw.model))


async def tokenize(request: web.Request) -> web.Response:
    return await _tokenizer_call(request, tokenize_answer)


async def detokenize(request: web.Request) -> web.Response:
    return await _tokenizer_call(request, detokenize_answer)


async def tokenizer_info(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response(gw.model.tokenizer.info(gw.model.max_model_len))


def model_card(gw: Gateway) -> dict[str, Any]:
    return {"id": gw.model.name, "object": "model", "created": int(gw.started), "owned_by": "pagedserve",
            "root": gw.model.name, "max_model_len": gw.model.max_model_len}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(request.app[GATEWAY])]})


async def model(request: web.Request) -> web.Response:
    """OpenAI's retrieve-model route: the served model's card, or a 404 naming the model asked for."""
    gw = request.app[GATEWAY]
    name = request.match_info["model"]
    if name != gw.model.name:
        raise ApiError(404, f"the model `{name}` does not exist; this server serves `{gw.model.name}`",
                       param="model", code="model_not_found")
    return web.json_response(model_card(gw))


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
    body = gw.metrics.render(stats, alive, gw.admission.waiting, gw.bus.failovers_followed(), gw.bus.gate.shortfalls)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


# The app is its own process's (`run`): once start-up is all in, what it made (modules, the tokenizer, the
# chat-template renderer) lives as long as the process, so it goes out of the garbage collector's sight, and full
# collections, each of which stalls every stream of the gateway, stop scanning it and run less often (below). Not for
# the apps tests run, many to a process, whose garbage must stay collectable.
FREEZE_START_UP = web.AppKey("freeze_start_up", bool)
# What is left for a full collection to scan is the open requests (~150 objects each), so with a backlog of hundreds
# one stalls every stream for tens of ms. CPython 3.11-3.13 start one after ten middle-generation collections once
# the old generation grew by a quarter since the last: about once a half-minute of a growing backlog, a light
# tenant's TTFT tail in benchmarks.tenants. Reference counting frees a finished request; a cut request's cycle (~145
# objects: its CancelledError's traceback holds the request, which holds its task, which holds the error) waits for
# a full collection, now ten times as many young objects later at least. (3.14's incremental collector ignores it.)
MIDDLE_COLLECTIONS_PER_FULL = 100


async def _on_startup(app: web.Application) -> None:
    gw = app[GATEWAY]
    gw.bus.start()
    gw.spawn(_warm_up(gw, app.get(FREEZE_START_UP, False)))


async def _warm_up(gw: Gateway, freeze: bool) -> None:
    # the chat-template renderer takes seconds to import: serve meanwhile (a chat request waits for it)
    await asyncio.to_thread(gw.model.tokenizer.warm_up)
    if freeze:
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, MIDDLE_COLLECTIONS_PER_FULL)


async def _watching_keys(app: web.Application) -> AsyncIterator[None]:
    """The keys file read again on SIGHUP and when it changes, for as long as the app runs."""
    task = asyncio.get_running_loop().create_task(app[GATEWAY].keys.watch())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _on_cleanup(app: web.Application) -> None:
    gw = app[GATEWAY]
    for task in gw.releases:  # a stopping gateway's streams wait out their grace at the scheduler
        task.cancel()
    if gw.background:
        await asyncio.wait(list(gw.background), timeout=SHUTDOWN_TIMEOUT_S)
    await gw.bus.close()
    app[TOKENIZING].shutdown()


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.settings.max_body_bytes,
                          middlewares=[request_id_middleware, errors_middleware, auth_middleware])
    app[GATEWAY] = gw
    app[TOKENIZING] = Tokenizing()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    responses_routes.add_routes(app)
    messages_routes.add_routes(app)
    app.on_startup.append(_on_startup)
    app.cleanup_ctx.append(_watching_keys)
    add_dashboard(app, gw)
    app.on_cleanup.append(_on_cleanup)
    return app


async def create_app(settings: Settings, model: ServedModel | None = None) -> web.Application:
    """The gateway for `settings`; `model` skips loading the tokenizer again (tests share one)."""
    if model is None:
        model = await asyncio.to_thread(ServedModel.load, settings)
    log.info("serving %s (max_model_len %d) from %s", model.name, model.max_model_len, model.path)
    bus = Bus(settings.redis_url, settings.redis_max_connections, settings.heartbeat_ttl,
              ReplicaGate(settings.replica_acks, int(settings.replica_ack_timeout * 1000)))
    admission = Admission(settings.max_waiting_requests, settings.max_call_tokens)
    return build_app(Gateway(settings, model, bus, admission, KeyRing(settings)))


async def _process_app(settings: Settings) -> web.Application:
    app = await create_app(settings)
    app[FREEZE_START_UP] = True
    return app


def run(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; in-flight requests are aborted on the bus as their handlers end."""
    log.info("gateway starting on http://%s:%d", settings.host, settings.port)
    web.run_app(_process_app(settings), host=settings.host, port=settings.port, handler_cancellation=True,
                shutdown_timeout=SHUTDOWN_TIMEOUT_S, print=None, access_log_class=AccessLog, **SERVER_OPTIONS)
    return 0
