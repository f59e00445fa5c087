"""Serving one API call: admission, submitting its requests to the bus, reading their tokens back,
and answering as one JSON response or as server-sent events; aborting on the bus whatever ends early."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from aiohttp import web
from redis.exceptions import RedisError

from gateway import sse
from gateway.bus import Bus
from gateway.errors import ApiError
from gateway.formats import ChatFormat, CompletionFormat, usage
from gateway.generation import Delta, RequestTracker, TokenLogprob
from gateway.metrics import Metrics
from gateway.model import ServedModel
from gateway.params import GenerateCall
from shared.protocol import REJECTED, UNAVAILABLE, Assignment, Request, TokenOutput
from shared.settings import Settings

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
BUS_ERRORS = (RedisError, OSError)  # redis-py wraps most socket errors, not all


class RequestFailed(Exception):
    """The scheduler ended a request with an error entry; `tokens` says whether any token came first."""

    def __init__(self, message: str, tokens: int, kind: str | None) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.kind = kind


def bus_unavailable(e: Exception) -> ApiError:
    return ApiError(503, f"the request bus (Redis) is unavailable: {e}", type="server_error",
                    code="bus_unavailable")


@dataclass(slots=True)
class Gateway:
    """What every handler shares: settings, the model, the bus, metrics, and the local waiting count."""
    settings: Settings
    model: ServedModel
    bus: Bus
    metrics: Metrics = field(default_factory=Metrics)
    waiting: int = 0  # requests submitted by this gateway that have no first token yet
    started: float = field(default_factory=time.time)
    background: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro) -> None:
        """Run a bus write that must finish even if the handler that asked for it is cancelled."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def admit(self, count: int) -> None:
        """Reserve `count` waiting places, or 429 once `max_waiting_requests` wait (here, or at the
        scheduler per its fresh snapshot). The Generation that follows releases them."""
        try:
            stats = await self.bus.stats()
        except BUS_ERRORS as e:
            raise bus_unavailable(e) from None
        # Read the local count only now: other handlers ran during the await.
        waiting = self.waiting
        if stats is not None and time.time() - stats.time <= self.settings.heartbeat_ttl:
            waiting = max(waiting, stats.waiting)
        limit = self.settings.max_waiting_requests
        if waiting >= limit:
            raise ApiError(429, f"{waiting} requests are waiting, the limit is {limit}; retry in "
                           f"{RETRY_AFTER_S} s", type="rate_limit_error", code="too_many_requests",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.waiting += count

    async def abort(self, rids: list[str], reason: str) -> None:
        try:
            await self.bus.abort(rids, reason)
        except BUS_ERRORS as e:
            log.warning("could not abort %s (%s): %s", rids, reason, e)


class Generation:
    """One API call: its prompts become bus requests (`{id}-{i}`), their samples the response's choices."""

    def __init__(self, gw: Gateway, call: GenerateCall, fmt: CompletionFormat | ChatFormat, received: float) -> None:
        self.gw = gw
        self.call = call
        self.fmt = fmt
        self.received = received
        self.id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(received)
        decode = functools.partial(gw.model.tokenizer.decode, skip_special_tokens=call.skip_special_tokens)
        self.trackers = [RequestTracker(f"{self.id}-{i}", call.params.n, call.params.max_tokens, p.token_ids, decode,
                                        call.stop)
                         for i, p in enumerate(call.prompts)]
        self.first_token: list[float | None] = [None] * len(self.trackers)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.call.prompts)

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(t.num_generated for t in self.trackers))

    async def events(self) -> AsyncIterator[tuple[int, Delta]]:
        """(choice index, delta) as tokens arrive, until every choice has finished."""
        gw, n = self.gw, self.call.params.n
        arrival = time.time()
        requests = [Request(t.rid, self.call.model, p.token_ids, self.call.params, arrival)
                    for t, p in zip(self.trackers, self.call.prompts)]
        waiting = set(range(len(self.trackers)))  # places reserved by Gateway.admit
        queue: asyncio.Queue[tuple[int, TokenOutput | Assignment | BaseException]] = asyncio.Queue()
        submitted = False
        try:
            for i, tracker in enumerate(self.trackers):
                gw.bus.follow(tracker.rid, queue, i)
            try:
                await gw.bus.submit(requests)
            except BUS_ERRORS as e:
                raise bus_unavailable(e) from None
            submitted = True
            gw.metrics.prompt_tokens.inc(self.prompt_tokens)
            while not all(t.finished for t in self.trackers):
                i, out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                tracker = self.trackers[i]
                deltas = tracker.apply(out)
                if i in waiting and (deltas or tracker.finished):
                    waiting.discard(i)
                    gw.waiting -= 1
                    self._first_token(i, arrival)
                if tracker.error is not None:
                    raise RequestFailed(tracker.error, sum(t.num_generated for t in self.trackers),
                                        tracker.error_kind)
                for delta in deltas:
                    yield i * n + delta.sample_index, delta
        finally:
            gw.bus.unfollow([t.rid for t in self.trackers])
            gw.waiting -= len(waiting)
            if submitted:
                self._finish(arrival)

    def _first_token(self, i: int, arrival: float) -> None:
        now = time.time()
        self.first_token[i] = now
        self.gw.metrics.ttft.observe(now - self.received)
        self.gw.metrics.queue.observe(now - arrival)

    def _finish(self, arrival: float) -> None:
        now, m = time.time(), self.gw.metrics
        aborts = []
        for tracker, first in zip(self.trackers, self.first_token):
            if tracker.needs_abort:
                aborts.append(tracker.rid)
            m.generation_tokens.inc(tracker.num_generated)
            for s in tracker.samples:
                m.finished.labels(s.finish_reason or ("error" if tracker.error else "abort")).inc()
            longest = max(len(s.token_ids) for s in tracker.samples)
            if first is not None and longest > 1:
                m.tpot.observe((now - first) / (longest - 1))
            m.e2e.observe(now - self.received)
        if aborts:
            finished = [t for t in self.trackers if t.finished and t.error is None]
            reason = "stop string" if len(finished) == len(self.trackers) else "client gone or call failed"
            self.gw.spawn(self.gw.abort(aborts, reason))

    def _choice_texts(self) -> list[str | None]:
        """Per choice, the echoed prompt (completions with `echo`), else None."""
        n = self.call.params.n
        return [p.text if self.call.echo else None for p in self.call.prompts for _ in range(n)]

    async def respond(self) -> web.Response:
        echo = self._choice_texts()
        texts = ["" for _ in echo]
        records: list[list[TokenLogprob]] = [[] for _ in echo]
        ends: list[tuple[str | None, str | None]] = [(None, None)] * len(echo)
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for index, delta in events:
                    texts[index] += delta.text
                    records[index] += delta.logprobs
                    ends[index] = (delta.finish_reason, delta.stop_reason)
        except RequestFailed as e:
            raise _failure(e) from None
        choices = [self.fmt.choice(i, (echo[i] or "") + texts[i], records[i], *ends[i]) for i in range(len(echo))]
        return web.json_response({"id": self.id, "object": self.fmt.object, "created": self.created,
                                  "model": self.call.model, "choices": choices, "usage": self.usage()})

    def _chunk(self, choices: list[dict]) -> bytes:
        return sse.event({"id": self.id, "object": self.fmt.chunk_object, "created": self.created,
                          "model": self.call.model, "choices": choices})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response: web.StreamResponse | None = None

        async def open_stream() -> web.StreamResponse:
            # Headers go out with the first token, so a request rejected before any gets a plain 4xx.
            resp = web.StreamResponse(headers=sse.HEADERS)
            await resp.prepare(request)
            for i, text in enumerate(self._choice_texts()):
                if (choice := self.fmt.opening(i, text)) is not None:
                    await _send(resp, self._chunk([choice]))
            return resp

        try:
            async with contextlib.aclosing(self.events()) as events:
                async for index, delta in events:
                    if response is None:
                        response = await open_stream()
                    if delta.text or delta.finish_reason or self.fmt.want_logprobs:
                        await _send(response, self._chunk([self.fmt.chunk_choice(
                            index, delta.text, delta.logprobs, delta.finish_reason, delta.stop_reason)]))
            if response is None:
                response = await open_stream()
            if self.call.include_usage:
                await _send(response, sse.event({"id": self.id, "object": self.fmt.chunk_object,
                                                 "created": self.created, "model": self.call.model,
                                                 "choices": [], "usage": self.usage()}))
            await _send(response, sse.DONE)
            await response.write_eof()
        except ClientGone:
            log.info("the client of %s went away mid-stream", self.id)
        except Exception as e:
            error = _as_api_error(e, self.id)
            if response is None:
                raise error from None
            # Headers are gone already: the error travels as a last event, as OpenAI's streams do.
            with contextlib.suppress(ConnectionResetError):
                await response.write(sse.event(error.body()))
                await response.write(sse.DONE)
        return response


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


async def _send(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        raise ClientGone from None


def _as_api_error(e: Exception, call_id: str) -> ApiError:
    if isinstance(e, RequestFailed):
        return _failure(e)
    if isinstance(e, ApiError):
        return e
    log.error("call %s failed", call_id, exc_info=e)
    return ApiError(500, f"internal error in the gateway ({type(e).__name__}); see its log", type="server_error")


def _failure(e: RequestFailed) -> ApiError:
    """The scheduler's reason picks the status: a request it can never serve is the client's to fix (400), no
    worker in time is worth a retry (503), a worker failing is ours (500)."""
    if e.tokens:
        return ApiError(500, f"the request failed after {e.tokens} tokens: {e}", type="server_error",
                        code="request_failed")
    if e.kind == REJECTED:
        return ApiError(400, str(e), code="request_rejected")
    if e.kind == UNAVAILABLE:
        return ApiError(503, str(e), type="server_error", code="no_worker_available",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return ApiError(500, str(e), type="server_error", code="request_failed")
