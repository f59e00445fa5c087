"""The scheduler service: the scheduler core behind the Redis bus.

One asyncio loop, three blocking readers (requests through the consumer group, control, results),
each on its own connection, and a housekeeping tick (lease, worker liveness, timeouts, stats). Every
event ends in `pump()`: plan each worker's next steps (with async scheduling, the step after the one
it computes too) and settle finished requests. A request is
acknowledged only once it has ended, so a scheduler that dies leaves it pending for the next one.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time

import redis

from scheduler.scheduler import FinishedRequest, Scheduler
from shared.bus import BLOCK_MS, RECONNECT_ERRORS, Backoff, connect_async, decode_entry, retry_async
from shared.keys import FIELD, PLANS_MAXLEN, Keys
from shared.log import setup_logging
from shared.out_stream import OutOfOrder, OutputFold
from shared.protocol import (
    Abort, Assignment, ProtocolError, Request, StepResult, TokenOutput, WorkerGone, WorkerRegistration, decode,
    encode,
)
from shared.settings import Settings

log = logging.getLogger("scheduler")
TICK_S = 0.25
# Renew the lease only while we still hold it (a plain SET could steal it back from a successor).
_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
elseif redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return false
"""


class SchedulerService:
    def __init__(self, settings: Settings, keys: Keys | None = None) -> None:
        self.settings = settings
        self.keys = keys or Keys()
        self.name = f"scheduler-{socket.gethostname()}-{os.getpid()}"
        self.client = connect_async(settings.redis_url)
        self.core: Scheduler | None = None
        self.entry_ids: dict[str, bytes] = {}  # rid → its entry in the requests stream, acked at the end
        self.registrations: dict[str, WorkerRegistration] = {}  # as the core has them
        self.early_aborts: dict[str, float] = {}  # rid → when its abort came, for requests not seen yet
        self.oldest_steps: dict[str, tuple[int, float]] = {}  # worker → (its oldest step in flight, seen since)
        # worker → instance that overran step_timeout: alive by its heartbeat but stuck (a hung GPU, a
        # deadlock), it gets no plans until a restart registers a new instance
        self.stalled: dict[str, str] = {}
        self.reread_pending = False
        self.stop_event = asyncio.Event()
        self.pump_lock = asyncio.Lock()
        self.failed = False

    # ---- start-up -------------------------------------------------------------------------
    async def _acquire_lease(self) -> None:
        backoff = Backoff(cap=1.0)
        waiting_logged = False
        while not self.stop_event.is_set():
            try:
                if await self.client.set(self.keys.scheduler_lease, self.name, nx=True, px=self._lease_ms):
                    return
            except RECONNECT_ERRORS as e:
                log.warning("Redis unreachable, retrying: %s", e)
            if not waiting_logged:
                log.info("another scheduler holds the lease; standing by")
                waiting_logged = True
            await asyncio.sleep(backoff.next())

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.heartbeat_ttl * 1000)

    async def _start(self) -> None:
        await self._acquire_lease()
        # Above the last epoch, and above the wall clock in ms: were Redis to lose the counter (no AOF), a
        # restarted count would fall below the epoch the workers hold, and they would skip every plan.
        epoch = max(int(await self.client.incr(self.keys.epoch)), int(time.time() * 1000))
        await self.client.set(self.keys.epoch, epoch)
        self.core = Scheduler(self.settings, epoch)
        self.registrations = {}
        await self._create_group()
        await self._sync_workers()
        await self._recover_pending()
        log.info("scheduler %s ready (epoch %d, %d workers, %d resumed requests)", self.name, epoch,
                 len(self.core.worker_ids), len(self.entry_ids))

    async def _recover_pending(self) -> None:
        """Claim every request a dead scheduler left unacknowledged and resume it from its `out:` stream."""
        start = "0-0"
        while True:
            reply = await self.client.xautoclaim(self.keys.requests, self.keys.scheduler_group, self.name,
                                                 min_idle_time=0, start_id=start, count=100)
            start, entries = reply[0], reply[1]
            for entry_id, fields in entries:
                await self._resume(entry_id, fields)
            if start in (b"0-0", "0-0"):
                return

    async def _resume(self, entry_id: bytes, fields: dict) -> None:
        req = decode_entry(self.keys.requests, entry_id, fields, Request)
        if req is None:
            await self._drop(entry_id)
            return
        key = self.keys.out(req.rid)
        # A fence first: a worker of the old epoch still writing cannot add a token after what is read here.
        await self.client.xadd(key, {FIELD: encode(Assignment(req.rid, "", self.core.epoch))})
        fold = OutputFold(req.params.n, req.params.max_tokens)
        for out_id, out_fields in await self.client.xrange(key):
            out = decode_entry(key, out_id, out_fields, (TokenOutput, Assignment))
            try:
                if out is not None:
                    fold.apply(out)
            except OutOfOrder:
                continue
        if fold.ended or all(r is not None for r in fold.finish_reasons):
            await self._drop(entry_id)
            return
        self.entry_ids[req.rid] = entry_id
        self.core.add_request(req, dict(enumerate(fold.tokens)))

    async def _drop(self, entry_id: bytes) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.keys.requests, self.keys.scheduler_group, entry_id)
        pipe.xdel(self.keys.requests, entry_id)
        await pipe.execute()

    # ---- readers --------------------------------------------------------------------------
    async def _read_forever(self, name: str, read) -> None:
        """Run one blocking reader; reconnect with backoff when Redis goes away. Anything else ends the
        task, and with it the service (see run): a deaf scheduler must not look alive."""
        backoff = Backoff()
        while not self.stop_event.is_set():
            try:
                await read()
                backoff.reset()
            except RECONNECT_ERRORS as e:
                log.warning("%s reader lost Redis, reconnecting: %s", name, e)
                self.reread_pending = True
                await asyncio.sleep(backoff.next())
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):  # the stream or its group vanished
                    raise
                log.warning("the requests consumer group is gone (Redis lost its data?); creating it again")
                await self._create_group()

    async def _create_group(self) -> None:
        try:
            await self.client.xgroup_create(self.keys.requests, self.keys.scheduler_group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def _last_id(self, stream: str) -> bytes | str:
        newest = await self.client.xrevrange(stream, count=1)
        return newest[0][0] if newest else "0-0"

    async def _read_requests(self, reader) -> None:
        # After a reconnect, first re-read this consumer's pending entries: a reply lost on the way
        # leaves delivered entries that ">" never hands out again.
        cursor = "0" if self.reread_pending else ">"
        reply = await reader.xreadgroup(self.keys.scheduler_group, self.name, {self.keys.requests: cursor},
                                        count=256, block=BLOCK_MS)
        if cursor == "0":
            self.reread_pending = False
        for _, entries in reply or []:
            for entry_id, fields in entries:
                req = decode_entry(self.keys.requests, entry_id, fields, Request)
                known = self.entry_ids.get(req.rid) if req is not None else None
                if known == entry_id:
                    continue
                if req is None or known is not None:
                    await self._drop(entry_id)  # malformed, or a second request with a live rid
                    continue
                self.entry_ids[req.rid] = entry_id
                self.core.add_request(req)
                if self.early_aborts.pop(req.rid, None) is not None:
                    self.core.abort(req.rid)
        if reply:
            await self.pump()

    async def _stream_reader(self, stream: str, expected: tuple[type, ...], handle):
        """A reader of `stream` from its current end (taken now, before any plan goes out)."""
        reader = connect_async(self.settings.redis_url, blocking=True)
        cursor = [await self._last_id(stream)]

        async def read() -> None:
            reply = await reader.xread({stream: cursor[0]}, count=256, block=BLOCK_MS)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    cursor[0] = entry_id
                    msg = decode_entry(stream, entry_id, fields, expected)
                    if msg is not None:
                        handle(msg)
            if reply:
                await self.pump()
        return read

    def _on_control(self, msg: Abort | WorkerGone) -> None:
        if isinstance(msg, Abort):
            if msg.rid in self.entry_ids:
                self.core.abort(msg.rid, msg.reason)
            else:  # the abort overtook its request (they travel on different streams)
                self.early_aborts[msg.rid] = time.time()
        elif msg.worker_id in self.core.worker_ids:
            log.info("worker %s left; moving its requests", msg.worker_id)
            self.core.remove_worker(msg.worker_id)
            self.registrations.pop(msg.worker_id, None)

    def _on_result(self, msg: StepResult) -> None:
        if msg.error:
            log.error("worker %s failed step %d: %s", msg.worker_id, msg.step_id, msg.error)
        self.core.apply_result(msg)

    # ---- the loop -------------------------------------------------------------------------
    async def pump(self) -> None:
        """Plan every idle worker's next step, settle ended requests; one Redis round trip."""
        async with self.pump_lock:
            commands: list[tuple[str, tuple, dict]] = [
                ("xadd", (self.keys.out(rid), {FIELD: encode(Assignment(rid, worker_id, self.core.epoch))}), {})
                for rid, worker_id in self.core.pop_placements()]
            for worker_id in self.core.worker_ids:
                while (plan := self.core.schedule(worker_id)) is not None:  # a step, then its lookahead
                    commands.append(("xadd", (self.keys.plans(worker_id), {FIELD: encode(plan)}),
                                     {"maxlen": PLANS_MAXLEN, "approximate": True}))
            for done in self.core.pop_finished():
                commands.extend(self._settle(done))
            if commands:
                await self._execute_until_done(commands)

    def _settle(self, done: FinishedRequest) -> list[tuple[str, tuple, dict]]:
        key = self.keys.out(done.rid)
        # The request-level end: the gateway ends every sample the workers did not finish (an error,
        # an abort, a request that outgrew the cache) with this reason.
        end = TokenOutput(done.rid, -1, 0, -1, finish_reason=done.finish_reason, error=done.error,
                          error_kind=done.error_kind)
        commands: list[tuple[str, tuple, dict]] = [("xadd", (key, {FIELD: encode(end)}), {})]
        commands.append(("pexpire", (key, int(self.settings.out_stream_ttl * 1000)), {}))
        entry_id = self.entry_ids.pop(done.rid, None)
        if entry_id is not None:
            commands.append(("xack", (self.keys.requests, self.keys.scheduler_group, entry_id), {}))
            commands.append(("xdel", (self.keys.requests, entry_id), {}))
        return commands

    async def _execute_until_done(self, commands: list[tuple[str, tuple, dict]]) -> None:
        # The core already counts these plans as in flight: they must reach Redis. A replay after a
        # connection drop is harmless (workers skip plans they have run; the gateway skips indices).
        async def execute() -> None:
            pipe = self.client.pipeline(transaction=False)
            for name, args, kwargs in commands:
                getattr(pipe, name)(*args, **kwargs)
            await pipe.execute()
        await retry_async(execute, "writing plans")

    async def _sync_workers(self) -> None:
        """Add registered workers whose heartbeat is alive; drop those whose heartbeat expired."""
        registered = await self.client.hgetall(self.keys.workers)
        ids = [k.decode() for k in registered]
        alive = await asyncio.gather(*(self.client.exists(self.keys.heartbeat(w)) for w in ids)) if ids else []
        live: dict[str, WorkerRegistration] = {}
        for (raw_id, payload), is_alive in zip(registered.items(), alive):
            try:
                reg = decode(payload, WorkerRegistration)
            except ProtocolError as e:
                log.warning("dropped malformed registration of %s: %s", raw_id, e)
                await self.client.hdel(self.keys.workers, raw_id)
                continue
            if is_alive:
                live[reg.worker_id] = reg
        # a stalled instance stays out while it lives; once it is gone or replaced, forget it
        self.stalled = {w: i for w, i in self.stalled.items() if w in live and live[w].instance == i}
        for worker_id in self.stalled:
            del live[worker_id]
        for worker_id in list(self.core.worker_ids):
            if worker_id not in live:
                log.warning("worker %s is gone (heartbeat expired); resuming its requests elsewhere", worker_id)
                self.core.remove_worker(worker_id)
                self.registrations.pop(worker_id, None)
                await self.client.hdel(self.keys.workers, worker_id)
        for worker_id, reg in live.items():
            if self.registrations.get(worker_id) != reg:  # new, or restarted under the same id
                try:
                    self.core.add_worker(reg)
                except ValueError as e:
                    log.warning("dropped unusable registration of %s: %s", worker_id, e)
                    await self.client.hdel(self.keys.workers, worker_id)
                    continue
                self.registrations[worker_id] = reg
                log.info("worker %s joined: %d blocks of %d tokens", worker_id, reg.num_blocks, reg.block_size)

    def _drop_stalled(self) -> None:
        """Quarantine workers whose oldest step in flight has been so for over step_timeout (counted from the
        first tick that saw it oldest: the step before it may have been running until then)."""
        timeout = self.settings.step_timeout
        now = time.monotonic()
        oldest: dict[str, tuple[int, float]] = {}
        for worker_id in self.core.worker_ids:
            step_id = self.core.in_flight_step(worker_id)
            if step_id is None:
                continue
            seen = self.oldest_steps.get(worker_id)
            since = seen[1] if seen is not None and seen[0] == step_id else now
            if timeout and now - since > timeout:
                log.error("worker %s has not finished step %d in %.0f s (step_timeout); moving its requests and "
                          "sending it nothing until it restarts", worker_id, step_id, now - since)
                self.core.remove_worker(worker_id)
                self.stalled[worker_id] = self.registrations.pop(worker_id).instance
            else:
                oldest[worker_id] = (step_id, since)
        self.oldest_steps = oldest

    async def _tick(self) -> None:
        if not await self.client.eval(_RENEW_LEASE, 1, self.keys.scheduler_lease, self.name, self._lease_ms):
            log.error("another scheduler took the lease; stopping")
            self.failed = True
            self.stop_event.set()
            return
        self._drop_stalled()
        await self._sync_workers()
        now = time.time()
        for rid, seen in list(self.early_aborts.items()):
            if now - seen > self.settings.request_timeout:
                del self.early_aborts[rid]
        self.core.expire_waiting(now, self.settings.request_timeout)
        await self.client.set(self.keys.stats, encode(self.core.stats(now)))
        await self.pump()

    async def _housekeeping(self) -> None:
        while not self.stop_event.is_set():
            await self._tick()
            await asyncio.sleep(TICK_S)

    async def run(self) -> None:
        await retry_async(self._start, "starting (Redis unreachable?)", self.stop_event)
        if self.stop_event.is_set():
            return
        requests_reader = connect_async(self.settings.redis_url, blocking=True)
        read_control = await self._stream_reader(self.keys.control, (Abort, WorkerGone), self._on_control)
        read_results = await self._stream_reader(self.keys.results, (StepResult,), self._on_result)
        tasks = [
            asyncio.create_task(self._read_forever("requests", lambda: self._read_requests(requests_reader))),
            asyncio.create_task(self._read_forever("control", read_control)),
            asyncio.create_task(self._read_forever("results", read_results)),
            asyncio.create_task(self._read_forever("housekeeping", self._housekeeping)),
        ]
        stop = asyncio.create_task(self.stop_event.wait())
        done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stop and task.exception() is not None:
                log.error("scheduler loop failed; exiting so a supervisor restarts it", exc_info=task.exception())
                self.failed = True
        for task in (stop, *tasks):
            task.cancel()
        await asyncio.gather(stop, *tasks, return_exceptions=True)
        try:
            if await self.client.get(self.keys.scheduler_lease) == self.name.encode():
                await self.client.delete(self.keys.scheduler_lease)
        except RECONNECT_ERRORS:
            pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedserve scheduler", description="pagedserve scheduler service")
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(argv))
    setup_logging("scheduler", settings.log_level)

    async def serve() -> bool:
        service = SchedulerService(settings)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop_event.set)
        await service.run()
        return service.failed

    if asyncio.run(serve()):
        raise SystemExit(1)
