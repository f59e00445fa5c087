"""Serving one API call: admission, submitting its requests to the bus, reading their tokens back,
and answering as one JSON response or as server-sent events; aborting on the bus whatever ends early."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from aiohttp import web
from redis.exceptions import RedisError

from gateway import records, sse, tools
from gateway.admission import Admission
from gateway.bus import Bus, Resumable, Stored
from gateway.errors import ApiError, bad_request, rate_limited
from gateway.calls import GenerateCall
from gateway.formats import Format, prompt_records, usage, vllm_prompt_logprobs
from gateway.generation import Delta, RequestTracker, TokenLogprob
from gateway.keys import KeyRing
from gateway.metrics import Metrics
from gateway.model import ServedModel
from gateway.records import CallRecord
from gateway.resume import Numbering, Position
from shared.protocol import OVERLOADED, REJECTED, UNAVAILABLE, Assignment, Request, TokenOutput
from shared.settings import Settings
from shared.tenants import Tenant

log = logging.getLogger(__name__)
REQUEST_ID = "X-Request-Id"
RETRY_AFTER_S = 1
BUS_ERRORS = (RedisError, OSError)  # redis-py wraps most socket errors, not all


class RequestFailed(Exception):
    """The scheduler ended a request with an error entry; `tokens` says whether any token came first."""

    def __init__(self, message: str, tokens: int, kind: str | None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.kind = kind
        self.retry_after = retry_after


def bus_unavailable(e: Exception) -> ApiError:
    return ApiError(503, f"the request bus (Redis) is unavailable: {e}", type="server_error",
                    code="bus_unavailable")


class CallLog(logging.LoggerAdapter):
    """The log lines of one API call, led by its request id (the client's X-Request-Id, or one made for it)."""

    def process(self, msg, kwargs):
        return f"[{self.extra['request_id']}] {msg}", kwargs


@dataclass(slots=True)
class Gateway:
    """What every handler shares: settings, the model, the bus, admission, the API keys and metrics."""
    settings: Settings
    model: ServedModel
    bus: Bus
    admission: Admission
    keys: KeyRing
    metrics: Metrics = field(default_factory=Metrics)
    started: float = field(default_factory=time.time)
    background: set[asyncio.Task] = field(default_factory=set)
    releases: set[asyncio.Task] = field(default_factory=set)  # streams whose client went, waiting out their grace

    def spawn(self, coro, tasks: set[asyncio.Task] | None = None) -> None:
        """Run work that must finish even if the handler that asked for it is cancelled (bus writes), or that
        outlives any handler (the start-up warm-up)."""
        tasks = self.background if tasks is None else tasks
        task = asyncio.get_running_loop().create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def admit(self, call: GenerateCall, tenant: Tenant) -> None:
        """Reserve a waiting place per prompt of `call`, or 400/429 (see Admission), counting the scheduler's
        waiting requests too while its snapshot is fresh. The Generation that follows releases them. A priority
        needs the priority policy, and one more urgent than the tenant's cap is a 400."""
        if call.priority and self.settings.scheduling_policy != "priority":
            raise bad_request(f"`priority` {call.priority} needs the priority scheduling policy (this server's is "
                              f"{self.settings.scheduling_policy}); send 0 or leave it out", param="priority")
        if tenant.max_priority is not None and call.priority < tenant.max_priority:
            raise bad_request(f"`priority` {call.priority} is more urgent than tenant {tenant.name} may ask for "
                              f"(lower runs first; its most urgent is {tenant.max_priority})", param="priority")
        self.admission.check_size(call.work)
        try:
            stats = await self.bus.stats()
        except BUS_ERRORS as e:
            raise bus_unavailable(e) from None
        now = time.time()
        fresh = stats is not None and now - stats.time <= self.settings.heartbeat_ttl
        count = len(call.prompts)
        fair = fresh and self.settings.scheduling_policy == "fair"
        self.admission.admit(count, stats.waiting if fresh else 0, now,
                             in_share=fair and self.admission.within_share(stats, tenant, count))

    async def abort(self, rids: list[str], reason: str, log: logging.Logger | logging.LoggerAdapter) -> None:
        try:
            await self.bus.abort(rids, reason)
        except BUS_ERRORS as e:
            log.warning("could not abort %s (%s): %s", rids, reason, e)

    async def release(self, call_id: str, rids: list[str], reader: str,
                      log: logging.Logger | logging.LoggerAdapter) -> None:
        """After the reconnect grace period, abort the requests of a stream whose client went, unless a client
        took the stream up again meanwhile (at any gateway); the call's record then goes with its streams. A
        gateway stopping leaves this to the scheduler."""
        await asyncio.sleep(self.settings.reconnect_grace)
        try:
            aborted = await self.bus.release(rids, reader, "client gone")
            if aborted == len(rids):
                await self.bus.end_call(call_id, self.settings.out_stream_ttl)
        except BUS_ERRORS as e:
            log.warning("could not abort %s (client gone): %s", rids, e)
            return
        if aborted < len(rids):
            log.info("%d of %d requests of a stream whose client went were taken up again", len(rids) - aborted,
                     len(rids))


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a call's requests come from, and what becomes of them when its client goes: a new call (`record` kept
    while it streams, so that any gateway can pick the stream up), or a stream picked up again after `resume` (its
    requests run already: nothing is submitted; one that takes the stream up from its reader governs it from then
    on). A background call's requests run to their end whoever watches, and keep their streams `retention` seconds.
    Its requests are its tenant's (their limits, priority cap, share and prefix cache)."""
    record: CallRecord | None = None
    call_id: str | None = None  # the call's id where it has one already (resumed, or a stored response's)
    resume: Position | None = None
    background: bool = False
    retention: float = 0.0
    stored: Stored | None = None  # a stored response's record, written with its requests
    resumable: bool = True  # its stream can be picked up again (a response that is not stored cannot)
    tenant: Tenant = Tenant()


class Generation:
    """One API call: its prompts become bus requests (`{id}-{i}`), their samples the response's choices."""

    def __init__(self, gw: Gateway, call: GenerateCall, fmt: Format, received: float, request_id: str,
                 origin: Origin = Origin()) -> None:
        self.gw = gw
        self.call = call
        self.fmt = fmt
        self.received = received
        self.request_id = request_id
        self.origin = origin
        self.log = CallLog(log, {"request_id": request_id})
        self.id = origin.call_id or f"{fmt.id_prefix}-{uuid.uuid4().hex}"
        self.created = origin.record.created if origin.record is not None else int(received)
        self.reader = gw.bus.reader_token()  # this connection's, in its requests' reader keys
        self.took_up = False  # a resumed stream: this connection streams its requests now (it holds their readers)
        self.text_chunks: dict[int, sse.TextEvent | None] = {}  # per choice, see _token_chunk
        self.generated: dict[int, int] = {}  # per choice streamed, its tokens so far
        self.call_parsers: dict[int, tools.CallParser] = {}  # per choice streamed, where the call offered tools
        decode = functools.partial(gw.model.tokenizer.decode, skip_special_tokens=call.skip_special_tokens)
        self.trackers = [RequestTracker(records.request_id(self.id, i), call.params.n, call.params.max_tokens,
                                        p.token_ids, decode, call.stop, include_stop=call.include_stop_str,
                                        appended_text=gw.model.tokenizer.appended_text,
                                        prompt_logprobs=call.params.prompt_logprobs is not None,
                                        hide_output=call.hide_output, logger=self.log)
                         for i, p in enumerate(call.prompts)]
        self.first_token: list[float | None] = [None] * len(self.trackers)
        # (prompt index, entries of its stream, or the error that ended the reading), as the bus routes them
        self.queue: asyncio.Queue[tuple[int, list[TokenOutput | Assignment] | BaseException]] = asyncio.Queue()

    @property
    def tenant(self) -> str:
        return self.origin.tenant.name

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.call.prompts)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(t.num_generated for t in self.trackers),
                     sum(t.num_cached_tokens for t in self.trackers))

    async def events(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        """(choice index, delta) as tokens arrive, until every choice has finished: a list per batch of entries
        the bus routed at once."""
        gw, n = self.gw, self.call.params.n
        arrival = time.time()
        origin = self.origin
        new = origin.resume is None
        waiting = set(range(len(self.trackers))) if new else set()  # places reserved by Gateway.admit
        running = set(range(len(self.trackers)))
        submitted = False
        try:
            for i, tracker in enumerate(self.trackers):
                gw.bus.follow(tracker.rid, self.queue, i)
            try:
                if new:
                    await gw.bus.submit(self._requests(arrival), self._resumable(), origin.stored)
                else:
                    self.took_up = await gw.bus.take_up([t.rid for t in self.trackers], self.reader)
                    if not self.took_up and origin.record is not None:
                        raise ApiError(404, f"the stream of {self.id} has expired (streams are kept "
                                       f"{gw.settings.out_stream_ttl:g} s after they end)", code="stream_expired")
            except BUS_ERRORS as e:
                raise bus_unavailable(e) from None
            submitted = True
            if new:
                gw.metrics.prompt_tokens.labels(self.tenant).inc(self.prompt_tokens)
            while running:
                i, outs = await self.queue.get()
                if isinstance(outs, BaseException):
                    raise outs
                tracker = self.trackers[i]
                batch = []
                for out in outs:
                    deltas = tracker.apply(out)
                    if i in waiting and (tracker.started or tracker.finished):
                        waiting.discard(i)
                        if tracker.started:
                            self._first_token(i, arrival)
                        else:
                            gw.admission.release(1)
                    if tracker.error is not None:
                        if batch:
                            yield batch  # the tokens before the error are streamed before it
                        raise RequestFailed(tracker.error, tracker.num_generated, tracker.error_kind, tracker.retry_after)
                    batch += [(i * n + delta.sample_index, delta) for delta in deltas]
                    if tracker.finished:
                        running.discard(i)
                        if not running:
                            break  # the call is answered: entries after that are not read
                if batch:
                    yield batch
        finally:
            gw.bus.unfollow([t.rid for t in self.trackers])
            gw.admission.release(len(waiting))
            if submitted:
                self._finish(arrival)

    async def submit(self) -> None:
        """Queue the call's requests and let them go: a background call, which nobody here follows."""
        try:
            await self.gw.bus.submit(self._requests(time.time()), stored=self.origin.stored)
        except BUS_ERRORS as e:
            raise bus_unavailable(e) from None
        finally:
            self.gw.admission.release(len(self.trackers))  # nobody here waits for a first token to release them
        self.gw.metrics.prompt_tokens.labels(self.tenant).inc(self.prompt_tokens)

    def _requests(self, arrival: float) -> list[Request]:
        gateway_id = "" if self.origin.background else self.gw.bus.instance
        call, origin = self.call, self.origin
        return [Request(t.rid, call.model, p.token_ids, call.params, arrival, gateway_id, origin.retention,
                        origin.tenant, call.priority, call.cache_salt) for t, p in zip(self.trackers, call.prompts)]

    def _resumable(self) -> Resumable | None:
        """What a new streamed call leaves in Redis for a client that reconnects, to this gateway or another."""
        if not self.call.stream or self.origin.background or not self.origin.resumable:
            return None
        return Resumable(self.id, self.origin.record, self.reader, self.gw.settings.response_ttl)

    def _first_token(self, i: int, arrival: float) -> None:
        now = time.time()
        self.first_token[i] = now
        self.gw.admission.first_token(now)
        self.gw.metrics.ttft.labels(self.tenant).observe(now - self.received)
        self.gw.metrics.queue.labels(self.tenant).observe(now - arrival)

    def _finish(self, arrival: float) -> None:
        self._end_requests()
        if self.origin.resume is not None:
            return  # its own metrics were counted where it began
        now, m, tenant = time.time(), self.gw.metrics, self.tenant
        for tracker, first in zip(self.trackers, self.first_token):
            m.generation_tokens.labels(tenant).inc(tracker.num_generated)
            for s in tracker.samples:
                m.finished.labels(s.finish_reason or ("error" if tracker.error else "abort"), tenant).inc()
            longest = max(len(s.token_ids) for s in tracker.samples)
            if first is not None and longest > 1:
                m.tpot.labels(tenant).observe((now - first) / (longest - 1))
            m.e2e.labels(tenant).observe(now - self.received)

    def _end_requests(self) -> None:
        """Abort on the bus what the call no longer reads: at once where a stop string ended a sample here, after
        the reconnect grace period where the client of a stream went (unless it comes back), else at once."""
        gw = self.gw
        stopped = [t.rid for t in self.trackers if t.needs_abort and t.finished]
        gone = [t.rid for t in self.trackers if t.needs_abort and not t.finished]
        if stopped:
            gw.spawn(gw.abort(stopped, "stop string", self.log))
        if gone and (self.origin.background or (self.origin.resume is not None and not self.took_up)):
            return  # its requests are not this connection's to end
        failed = any(t.error is not None for t in self.trackers)  # the call is over: no client comes back for it
        if gone and self.call.stream and gw.settings.reconnect_grace > 0 and not failed:
            gw.spawn(gw.release(self.id, gone, self.reader, self.log), gw.releases)
        elif gone:
            gw.spawn(gw.abort(gone, "client gone or call failed", self.log))
        elif self.call.stream and self.origin.record is not None:
            gw.spawn(self._end_call())

    async def _end_call(self) -> None:
        try:
            await self.gw.bus.end_call(self.id, self.gw.settings.out_stream_ttl)
        except BUS_ERRORS as e:
            self.log.warning("could not shorten the record of %s: %s", self.id, e)

    def _prefix(self, sample: int) -> tuple[str, list[TokenLogprob]]:
        """What a sample's text and logprobs start with: with `echo`, its prompt's echo and (completions, with
        logprobs) its prompt tokens' logprobs; the prompt's tracker has them once its first token arrived."""
        if self.call.echo is None:
            return "", []
        i = sample // self.call.params.n
        prompt, tracker = self.call.prompts[i], self.trackers[i]
        if not self.call.echo_logprobs or tracker.prompt_logprobs is None:
            return self.call.echo[i], []
        return self.call.echo[i], prompt_records(prompt.token_ids, tracker.prompt_logprobs, prompt.text_offsets or (),
                                                 self.call.logprobs or 0)

    def _choice_order(self) -> list[int]:
        """The samples that become choices, in order: per prompt, its n samples; with best_of, the n of highest
        cumulative logprob (a beam search's come ranked already)."""
        call, n = self.call, self.call.params.n
        order = []
        for p, tracker in enumerate(self.trackers):
            samples = range(n)
            if call.ranked and not call.params.beam_width:
                samples = sorted(samples, key=lambda s: -sum(r.logprob or 0.0 for r in tracker.samples[s].logprobs))
            order += [p * n + s for s in list(samples)[:call.choices_per_prompt]]
        return order

    def _vllm_prompt_logprobs(self, i: int) -> list | None:
        tracker = self.trackers[i]
        if tracker.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.gw.model.tokenizer, self.call.prompts[i].token_ids, tracker.prompt_logprobs,
                                    self.call.prompt_logprobs)

    async def respond(self) -> web.Response:
        count = len(self.call.prompts) * self.call.params.n
        texts = ["" for _ in range(count)]
        records: list[list[TokenLogprob]] = [[] for _ in range(count)]
        ends: list[tuple[str | None, str | None]] = [(None, None)] * count
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for batch in events:
                    for index, delta in batch:
                        texts[index] += delta.text
                        records[index] += delta.logprobs
                        ends[index] = (delta.finish_reason, delta.stop_reason)
        except RequestFailed as e:
            raise failure(e) from None
        choices = []
        order = self._choice_order()
        for i in order:
            text, prefix = self._prefix(i)
            answer, calls = texts[i], {}
            if self.call.tool_format is not None:
                answer, calls["calls"] = tools.parse(self.call.tool_format, answer, f"{self.id}/{i}")
            choice = self.fmt.choice(len(choices), text + answer, prefix + _shifted(records[i], len(text)), *ends[i],
                                     **calls)
            if self.call.ranked:
                choice["cumulative_logprob"] = sum(r.logprob or 0.0 for r in records[i])
            choices.append(choice)
        body = {"id": self.id, "object": self.fmt.object, "created": self.created, "model": self.call.model,
                "choices": choices, "usage": self.usage()}
        per_prompt = None if self.call.prompt_logprobs is None else [
            self._vllm_prompt_logprobs(i) for i in range(len(self.call.prompts))]
        self.fmt.answer(body, [p.token_ids for p in self.call.prompts], per_prompt,
                        [i // self.call.params.n for i in order])
        return web.json_response(body)

    def _chunk_body(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.fmt.chunk_object, "created": self.created, "model": self.call.model,
                "choices": choices}

    def _chunk(self, sample: int, choice: dict, tokens: int) -> dict:
        """One chunk of one sample's choice; with continuous_usage_stats, with that choice's usage: `tokens` so far."""
        body = self._chunk_body([choice])
        if self.call.continuous_usage:
            prompt = self.call.prompts[sample // self.call.params.n]
            body["usage"] = usage(len(prompt.token_ids), tokens, 0)
        return body

    def _token_chunk(self, sample: int, delta: Delta, echoed: int) -> bytes:
        """A token's chunk. Without logprobs (or other per-token keys), a choice's chunks up to its last differ in
        their text only: those are filled into the choice's template."""
        if delta.finish_reason is None and self.fmt.plain_chunks:
            if sample not in self.text_chunks:
                self.text_chunks[sample] = sse.TextEvent.around(
                    self._chunk_body([self.fmt.chunk_choice(sample, sse.TEXT, [], None, None)]))
            if (template := self.text_chunks[sample]) is not None:
                return template.event(delta.text)
        return sse.event(self._chunk(sample, self._chunk_choice(sample, delta, echoed), self.generated[sample]))

    def _chunk_choice(self, sample: int, delta: Delta, echoed: int) -> dict:
        """A token's chunk choice; where the call offered tools, its text read for tool calls as it comes."""
        if self.call.tool_format is None:
            return self.fmt.chunk_choice(sample, delta.text, _shifted(delta.logprobs, echoed), delta.finish_reason,
                                         delta.stop_reason)
        parser = self.call_parsers.setdefault(sample, tools.CallParser(self.call.tool_format, f"{self.id}/{sample}"))
        piece = parser.feed(delta.text, end=delta.finish_reason is not None)
        return self.fmt.chunk_choice(sample, piece.content, _shifted(delta.logprobs, echoed), delta.finish_reason,
                                     delta.stop_reason, calls=list(piece.calls), called=parser.complete > 0)

    def _opening(self, sample: int, echo: str | None, prefix: list[TokenLogprob], delta: Delta,
                 stream_start: bool) -> list[bytes]:
        """A choice's first chunks: its openings (chat's role, an echo), then its first token's; the first of them
        carries what vLLM puts on a choice's (or the stream's) first chunk."""
        chunks = [self._chunk(sample, c, 0) for c in self.fmt.openings(sample, echo, prefix)]
        chunks.append(self._chunk(sample, self._chunk_choice(sample, delta, len(echo or "")), self.generated[sample]))
        self.fmt.first_chunk(chunks[0], self.call.prompts[sample // self.call.params.n].token_ids, stream_start)
        return [sse.event(c) for c in chunks]

    async def open_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=sse.HEADERS | {REQUEST_ID: self.request_id})
        await response.prepare(request)
        return response

    async def stream(self, request: web.Request, source: EventSource | None = None) -> web.StreamResponse:
        """The answer as server-sent events, made by `source` (chat's or completions' chunks unless given), each
        with its id (see gateway/resume.py); a resumed stream leaves out the events its client had."""
        source = source or ChoiceEvents(self)
        numbering = Numbering(self.id, source.lanes, self.origin.resume)
        response: web.StreamResponse | None = None
        ready: list[bytes] = []  # written together while more tokens wait in the queue: one write, not one each

        def add(events: list[LaneEvent]) -> None:
            for event in events:
                if (numbered := numbering.event(event.lane, event.data)) is not None:
                    ready.append(numbered)

        async def open_stream() -> web.StreamResponse:
            opened = await self.open_stream(request)
            add(source.opening())
            return opened

        try:
            async with contextlib.aclosing(self.events()) as events:
                async for batch in events:
                    if response is None:
                        # Headers go out with the first token, so a request rejected before any gets a plain 4xx.
                        response = await open_stream()
                    add(source.batch(batch))
                    if self.queue.empty():
                        await send(response, ready)
            if response is None:
                response = await open_stream()
            add(source.closing())
            await send(response, ready)
            await response.write_eof()
        except ClientGone:
            self.log.info("the client of %s went away mid-stream", self.id)
        except Exception as e:
            error = as_api_error(e, self.id, self.log)
            if response is None:
                raise error from None
            # Headers are gone already: the error travels as a last event, with no id, as it is no event of the
            # requests' streams (a client that picks the stream up again gets those after its last real one).
            ready.extend(e.data for e in source.failure(error))
            with contextlib.suppress(ClientGone):
                await send(response, ready)
        return response


@dataclass(frozen=True, slots=True)
class LaneEvent:
    """One event of a stream (its encoded bytes, `data:` and any `event:` line) and its lane (gateway/resume.py)."""
    lane: int
    data: bytes


class EventSource(Protocol):
    """What a stream's events are made of, fed in order; a pure function of what it is fed, so that a stream picked
    up again is the same events."""
    lanes: int

    def opening(self) -> list[LaneEvent]:
        """The events that go out with the headers."""

    def batch(self, batch: list[tuple[int, Delta]]) -> list[LaneEvent]:
        """The events of the deltas the bus brought at once ((choice index, delta) each)."""

    def closing(self) -> list[LaneEvent]:
        """The events after every choice ended."""

    def failure(self, error: ApiError) -> list[LaneEvent]:
        """The events that end a stream whose call failed."""


class ChoiceEvents:
    """Chat's and completions' chunks, as OpenAI streams them: a lane per prompt, then the closing lane (usage if
    asked for, `[DONE]`), which also takes an error."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.n = generation.call.params.n
        self.closing_lane = len(generation.call.prompts)
        self.lanes = self.closing_lane + 1
        self.echoed: dict[int, int] = {}  # per opened choice, the length of its echoed text

    def opening(self) -> list[LaneEvent]:
        return []

    def batch(self, batch: list[tuple[int, Delta]]) -> list[LaneEvent]:
        g, events = self.generation, []
        for index, delta in batch:
            g.generated[index] = g.generated.get(index, 0) + sum(r.generated for r in delta.logprobs)
            lane = index // self.n
            if index not in self.echoed:
                text, prefix = g._prefix(index)
                self.echoed[index] = len(text)
                events += [LaneEvent(lane, e) for e in g._opening(index, text if g.call.echo is not None else None,
                                                                  prefix, delta, not self.echoed.keys() - {index})]
            else:
                # One event per token, with empty text while its characters are unfinished or held back by a stop
                # string, so that clients see every token arrive.
                events.append(LaneEvent(lane, g._token_chunk(index, delta, self.echoed[index])))
        return events

    def closing(self) -> list[LaneEvent]:
        g = self.generation
        usage = [sse.event(g._chunk_body([]) | {"usage": g.usage()})] if g.call.include_usage else []
        return [LaneEvent(self.closing_lane, e) for e in usage + [sse.DONE]]

    def failure(self, error: ApiError) -> list[LaneEvent]:
        return [LaneEvent(self.closing_lane, e) for e in (sse.event(error.body()), sse.DONE)]


def _shifted(records: list[TokenLogprob], offset: int) -> list[TokenLogprob]:
    """Records whose text offsets count from `offset` characters before the generated text (the echo)."""
    if not offset:
        return records
    return [dataclasses.replace(r, text_offset=r.text_offset + offset) for r in records]


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


async def send(response: web.StreamResponse, events: list[bytes]) -> None:
    """Write `events` in one go, and empty the list."""
    data = b"".join(events)
    events.clear()
    try:
        await response.write(data)
    except ConnectionResetError:
        raise ClientGone from None


def as_api_error(e: Exception, call_id: str, log: CallLog) -> ApiError:
    if isinstance(e, RequestFailed):
        return failure(e)
    if isinstance(e, ApiError):
        return e
    log.error("call %s failed", call_id, exc_info=e)
    return ApiError(500, f"internal error in the gateway ({type(e).__name__}); see its log", type="server_error")


def failure(e: RequestFailed) -> ApiError:
    """The scheduler's reason picks the status: a request it can never serve is the client's to fix (400), no
    worker in time is worth a retry (503), a worker failing is ours (500)."""
    if e.tokens:
        return ApiError(500, f"the request failed after {e.tokens} tokens: {e}", type="server_error",
                        code="request_failed")
    if e.kind == REJECTED:
        return ApiError(400, str(e), code="request_rejected")
    if e.kind == OVERLOADED:
        return rate_limited(str(e), e.retry_after or RETRY_AFTER_S)
    if e.kind == UNAVAILABLE:
        return ApiError(503, str(e), type="server_error", code="no_worker_available",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return ApiError(500, str(e), type="server_error", code="request_failed")
