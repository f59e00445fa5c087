"""The scheduler service: the cluster core (scheduler/cluster.py) behind the Redis bus.

One asyncio loop, three blocking readers (requests through the consumer group, control, results), each
on its own connection, a housekeeping tick (lease, worker and gateway liveness, timeouts, stats) and a timer for
the lookaheads planned late (scheduler/pacing.py). Every event ends in `pump()`: write the placements, each
worker's next plans and the ends of finished requests in one round trip. A request is acknowledged only once it has
ended, so a scheduler that dies leaves it pending for the next one, which resumes it from its `out:` stream.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass

import redis

from scheduler.cluster import Cluster, next_epoch
from scheduler.lease import Lease
from scheduler.request import FinishedRequest
from scheduler.publisher import Publisher
from scheduler.worker_scheduler import WorkerSchedulerFactory
from shared.bus import (
    BLOCK_MS, RECONNECT_ERRORS, Backoff, MasterMoved, acknowledge_move, connect_async, decode_entry, read_registry,
    registry_query, retry_async,
)
from shared.keys import FIELD, PLANS_MAXLEN, Keys
from shared.log import setup_logging
from shared.protocol import Abort, Assignment, Request, StepResult, TokenOutput, WorkerGone, encode
from shared.settings import Settings

log = logging.getLogger("scheduler")
TICK_S = 0.25
# A plan makes a few objects per sequence that live until its result, a step or two. A young collection runs each
# time the tracked objects made, less those freed, pass a threshold (700 in CPython 3.11, 2,000 from 3.13): every plan
# of 256 sequences ran one, which found its objects alive and moved them on, to the old generation in the end, so that
# a full collection ran every ~0.4 s at 16 workers (~55 ms each, every worker's next plan held up:
# benchmarks.scheduler_capacity). Above what any plan makes, young collections come as the requests held (or cyclic
# garbage) grow, each scanning up to this many objects.
YOUNG_COLLECTION_AFTER = 50_000
Command = tuple[str, tuple, dict]


@dataclass(frozen=True, slots=True)
class Queued:
    """A request's entry in the requests stream (acknowledged when it ends) and how long its out: stream is kept."""
    entry_id: bytes
    retention: float


def settle_heap() -> None:
    """Once the scheduler has started: what start-up made (modules, the cluster's block pools) lives as long as the
    process, taken out of the garbage collector's sight (its full collections stop scanning it: tens of ms each at
    1,024 sequences), and young collections wait for YOUNG_COLLECTION_AFTER objects."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, middle, old)


class SchedulerService:
    def __init__(self, settings: Settings, keys: Keys | None = None,
                 worker_scheduler: WorkerSchedulerFactory | None = None) -> None:
        self.settings = settings
        self.keys = keys or Keys()
        self.name = f"scheduler-{socket.gethostname()}-{os.getpid()}"
        # Fenced: after a failover nothing it writes may rest on what only the old master held (_follow_failover).
        self.client = connect_async(settings.redis_url, fenced=True)
        self.worker_scheduler = worker_scheduler
        self.cluster = Cluster(settings, worker_scheduler=worker_scheduler)
        self.publisher = Publisher(self.client, self.keys)
        self.queued: dict[str, Queued] = {}  # rid → its entry in the requests stream, acked at the end
        self.lease = Lease(self.client, self.keys.scheduler_lease, self.name, int(settings.heartbeat_ttl * 1000))
        self.reread_pending = False
        self.stop_event = asyncio.Event()
        self.pump_lock = asyncio.Lock()
        self.lookahead_due: float | None = None  # when the next worker's lookahead falls due, on the loop's clock
        self.due_changed = asyncio.Event()
        self.failed = False

    # ---- start-up -------------------------------------------------------------------------
    async def _start(self) -> None:
        try:
            await self.lease.acquire(self.stop_event)
            await self._load()
        except MasterMoved:  # nothing rests on the old master yet: start again on the new one
            acknowledge_move(self.client)
            raise redis.ConnectionError("the Redis master moved while the scheduler started") from None

    async def _load(self) -> None:
        """Take up the work Redis holds: a new epoch, the registered workers, and every request left unfinished,
        resumed from its `out:` stream."""
        epoch = next_epoch(int(await self.client.incr(self.keys.epoch)), time.time())
        await self.client.set(self.keys.epoch, epoch)
        self.cluster = Cluster(self.settings, epoch, self.worker_scheduler)
        self.queued = {}
        await self._create_group()
        await self._sync_workers()
        await self._recover_pending()
        log.info("scheduler %s ready (epoch %d, %d workers, %d resumed requests)", self.name, epoch,
                 len(self.cluster.worker_ids), len(self.queued))

    async def _follow_failover(self) -> None:
        """The Redis master moved (a Sentinel failover), and the writes the old one had not passed on are gone: the
        queues in memory may be ahead of Redis. Nothing was written to the new master since (the client is fenced);
        take up what it holds, as a restarted scheduler would, and go on."""
        async with self.pump_lock:
            if not acknowledge_move(self.client):
                return  # another reader met the move first and took it up
            log.warning("the Redis master moved; taking up the requests from what the new master holds")
            backoff = Backoff()
            while not self.stop_event.is_set():
                try:
                    if not await self.lease.renew():
                        log.error("another scheduler took the lease; stopping")
                        self.failed = True
                        self.stop_event.set()
                        return
                    await self._load()
                    await self._missed_aborts()
                    break
                except MasterMoved:  # it moved again meanwhile: take up the newest
                    acknowledge_move(self.client)
                except RECONNECT_ERRORS as e:
                    log.warning("taking up the new master's requests failed, retrying: %s", e)
                    await asyncio.sleep(backoff.next())
            self.reread_pending = True
        await self.pump()

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
        if req is None or self.cluster.knows(req.rid):  # malformed, or queued twice (a gateway's write redone)
            await self._drop(entry_id)
            return
        key = self.keys.out(req.rid)
        # A fence first: a worker of the old epoch still writing cannot add a token after what is read here.
        await self.client.xadd(key, {FIELD: encode(Assignment(req.rid, "", self.cluster.epoch))})
        entries = [decode_entry(key, out_id, out_fields, (TokenOutput, Assignment))
                   for out_id, out_fields in await self.client.xrange(key)]
        if self.cluster.resume(req, [e for e in entries if e is not None]):
            self.queued[req.rid] = Queued(entry_id, req.retention)
        else:
            await self._drop(entry_id)

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
            except MasterMoved:
                await self._follow_failover()
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
                known = self.queued.get(req.rid) if req is not None else None
                if known is not None and known.entry_id == entry_id:
                    continue  # this consumer's pending entry, read again after a reconnect
                if req is None or not self.cluster.add_request(req):
                    await self._drop(entry_id)  # malformed, or a second request with a live rid
                    continue
                self.queued[req.rid] = Queued(entry_id, req.retention)
        if reply:
            await self.pump()

    async def _stream_reader(self, stream: str, expected: tuple[type, ...], handle):
        """A reader of `stream` from its current end (taken now, before any plan goes out)."""
        reader = connect_async(self.settings.redis_url, blocking=True)
        newest = await self.client.xrevrange(stream, count=1)
        cursor = [newest[0][0] if newest else "0-0"]

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

    async def _missed_aborts(self) -> None:
        """Aborts written while no scheduler read them (a client gone, a response cancelled during a restart): the
        control stream keeps them, and those of the requests resumed apply now (the reader takes the rest)."""
        for entry_id, fields in await self.client.xrange(self.keys.control):
            msg = decode_entry(self.keys.control, entry_id, fields, (Abort, WorkerGone))
            if isinstance(msg, Abort) and msg.rid in self.cluster.requests:
                self.cluster.abort(msg.rid, msg.reason, time.time())

    def _on_control(self, msg: Abort | WorkerGone) -> None:
        if isinstance(msg, Abort):
            self.cluster.abort(msg.rid, msg.reason, time.time())
        elif msg.worker_id in self.cluster.worker_ids:
            log.info("worker %s left; moving its requests", msg.worker_id)
            self.cluster.remove_worker(msg.worker_id)

    def _on_result(self, msg: StepResult) -> None:
        if msg.error:
            log.error("worker %s failed step %d: %s", msg.worker_id, msg.step_id, msg.error)
        self.cluster.apply_result(msg, asyncio.get_running_loop().time())

    # ---- the loop -------------------------------------------------------------------------
    async def pump(self) -> None:
        """Write placements, every idle worker's next plans and the ends of finished requests; one round trip."""
        async with self.pump_lock:
            cluster = self.cluster
            commands: list[Command] = [
                ("xadd", (self.keys.out(rid), {FIELD: encode(Assignment(rid, worker_id, cluster.epoch))}), {})
                for rid, worker_id in cluster.pop_placements()]
            now = asyncio.get_running_loop().time()
            for worker_id in cluster.worker_ids:
                for plan in cluster.plans(worker_id, now):
                    self.publisher.planned(cluster, plan)
                    commands.append(("xadd", (self.keys.plans(worker_id), {FIELD: encode(plan)}),
                                     {"maxlen": PLANS_MAXLEN, "approximate": True}))
            for done in cluster.pop_finished():
                commands.extend(self._end(done))
            if commands:
                # The core already counts these plans as in flight: they must reach Redis. A replay after a
                # connection drop is harmless (workers skip plans they have run; readers skip indices).
                await retry_async(lambda: self._execute(commands), "writing plans")
            due = cluster.lookahead_due(now)
            if due != self.lookahead_due:
                self.lookahead_due = due
                self.due_changed.set()

    async def _plan_lookaheads(self) -> None:
        """Pump when a worker's lookahead falls due (scheduler/pacing.py: it is planned late, so that requests
        arriving while the step runs join the next one), unless a pump meanwhile moves that time."""
        self.due_changed.clear()
        due = self.lookahead_due
        timeout = None if due is None else max(0.0, due - asyncio.get_running_loop().time())
        try:
            await asyncio.wait_for(self.due_changed.wait(), timeout)
        except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11)
            await self.pump()

    async def _execute(self, commands: list[Command]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name, args, kwargs in commands:
            getattr(pipe, name)(*args, **kwargs)
        await pipe.execute()

    def _end(self, done: FinishedRequest) -> list[Command]:
        key = self.keys.out(done.rid)
        commands: list[Command] = [("xadd", (key, {FIELD: encode(entry)}), {})
                                   for entry in done.stream_entries(self.cluster.epoch)]
        queued = self.queued.pop(done.rid, None)
        ttl = max(self.settings.out_stream_ttl, queued.retention if queued is not None else 0.0)
        commands.append(("pexpire", (key, int(ttl * 1000)), {}))
        commands.append(("pexpire", (self.keys.reader(done.rid), int(ttl * 1000)), {}))  # resumable as long
        if queued is not None:
            commands.append(("xack", (self.keys.requests, self.keys.scheduler_group, queued.entry_id), {}))
            commands.append(("xdel", (self.keys.requests, queued.entry_id), {}))
        return commands

    async def _sync_workers(self) -> None:
        """Follow the registered workers whose heartbeat is alive; clear the registry of the others."""
        changes = self.cluster.sync_registry(read_registry(await self.client.eval(*registry_query(self.keys))))
        for reg in changes.joined:
            log.info("worker %s joined: %d blocks of %d tokens, %sbatch invariant", reg.worker_id, reg.num_blocks,
                     reg.block_size, "" if reg.batch_invariant else "not ")
        if changes.joined:
            gc.freeze()  # a worker's block pool lives as long as it does: full collections need not scan its blocks
        for worker_id in changes.gone:
            log.warning("worker %s is gone (heartbeat expired); resuming its requests elsewhere", worker_id)
        for worker_id, why in changes.refused:
            log.warning("dropped the registration of %s: %s", worker_id, why)
        forget = changes.gone + [w for w, _ in changes.refused]
        if forget:
            await self.client.hdel(self.keys.workers, *forget)

    async def _abort_orphans(self, now: float) -> None:
        """The requests of a gateway whose heartbeat expired run on for the reconnect grace period; then each goes to
        the live gateway whose client took its stream up (the request's reader key names it), or is aborted."""
        gateways = sorted(self.cluster.gateway_ids())
        if not gateways:
            return
        alive = await self._alive(gateways)
        for gateway_id in self.cluster.orphaned({g for g in gateways if not alive[g]}, now):
            rids = self.cluster.requests_of(gateway_id)
            readers = await self.client.mget([self.keys.reader(rid) for rid in rids]) if rids else []
            holders = {rid: self.keys.reader_instance(r) for rid, r in zip(rids, readers) if r}
            holders = {rid: g for rid, g in holders.items() if g != gateway_id}
            live = await self._alive(sorted(set(holders.values())))
            orphans = self.cluster.gateway_gone(gateway_id, now, {rid: g for rid, g in holders.items() if live[g]})
            log.warning("gateway %s is gone; %d of its requests taken up by other gateways, %d aborted", gateway_id,
                        orphans.taken_up, orphans.aborted)

    async def _alive(self, gateways: list[str]) -> dict[str, bool]:
        async with self.client.pipeline(transaction=False) as pipe:
            for gateway_id in gateways:
                pipe.exists(self.keys.gateway_alive(gateway_id))
            return dict(zip(gateways, map(bool, await pipe.execute())))

    async def _tick(self) -> None:
        if not await self.lease.renew():
            log.error("another scheduler took the lease; stopping")
            self.failed = True
            self.stop_event.set()
            return
        for worker_id, step_id, waited in self.cluster.check_stalled(time.monotonic()):
            log.error("worker %s has not finished step %d in %.0f s (step_timeout); moving its requests and "
                      "sending it nothing until it restarts", worker_id, step_id, waited)
        await self._sync_workers()
        now = time.time()
        await self._abort_orphans(now)
        self.cluster.expire(now)
        await self.publisher.publish(self.cluster, now)
        await self.pump()

    async def _housekeeping(self) -> None:
        while not self.stop_event.is_set():
            await self._tick()
            await asyncio.sleep(TICK_S)

    async def run(self) -> None:
        await retry_async(self._start, "starting (Redis unreachable?)", self.stop_event)
        if self.stop_event.is_set():
            return
        settle_heap()
        requests_reader = connect_async(self.settings.redis_url, blocking=True)
        read_control = await self._stream_reader(self.keys.control, (Abort, WorkerGone), self._on_control)
        await self._missed_aborts()
        read_results = await self._stream_reader(self.keys.results, (StepResult,), self._on_result)
        tasks = [
            asyncio.create_task(self._read_forever("requests", lambda: self._read_requests(requests_reader))),
            asyncio.create_task(self._read_forever("control", read_control)),
            asyncio.create_task(self._read_forever("results", read_results)),
            asyncio.create_task(self._read_forever("housekeeping", self._housekeeping)),
            asyncio.create_task(self._read_forever("lookaheads", self._plan_lookaheads)),
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
        await self.lease.release()


def main(argv: list[str] | None = None,
         worker_scheduler: WorkerSchedulerFactory | None = None) -> None:
    """`worker_scheduler` makes another per-worker scheduler (benchmarks' baselines)."""
    parser = argparse.ArgumentParser(prog="pagedserve scheduler", description="pagedserve scheduler service")
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(argv))
    setup_logging("scheduler", settings.log_level)

    async def serve() -> bool:
        service = SchedulerService(settings, worker_scheduler=worker_scheduler)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop_event.set)
        await service.run()
        return service.failed

    if asyncio.run(serve()):
        raise SystemExit(1)
