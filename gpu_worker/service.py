"""The worker service: the worker core behind the Redis bus.

Registers, keeps a heartbeat alive from a thread (a long step must not look like a death), reads its
plan stream, executes each plan and publishes every sampled token to `out:{rid}` plus the step
result in one atomic script, so the scheduler's view and the clients' streams never diverge.

Neither Redis round trip waits on the step's path: a thread reads the plan stream into a queue while steps run, so
the next plan (which the scheduler writes while this step runs) is at hand when the step ends, and with it any plan
that joins it (shared/protocol.py: StepPlan.joins): those run in the same step; and a step's writes are sent without
waiting, their reply read after the next step has run.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections import deque

import redis

from shared.bus import BLOCK_MS, RECONNECT_ERRORS, Backoff, connect, decode_entry, retry
from shared.keys import CONTROL_MAXLEN, FIELD, RESULTS_MAXLEN, Keys
from shared.log import setup_logging
from shared.protocol import StepOutcome, StepPlan, StepResult, WorkerGone, encode
from shared.settings import Settings

log = logging.getLogger("gpu_worker")
EXPIRY_REFRESH_TOKENS = 64
PLANS_PER_READ = 64
# A step's writes as one script: atomic as a MULTI/EXEC, but one command to build and one reply to parse
# where a transaction had two per token.
# KEYS: each token's out stream, then results, then the heartbeat. ARGV: field, results maxlen, heartbeat
# ms, stream expiry ms, the result, then per token its payload and "1" where its stream's expiry is renewed.
PUBLISH_STEP = """
local n = #KEYS - 2
for i = 1, n do
  redis.call('XADD', KEYS[i], '*', ARGV[1], ARGV[4 + 2 * i])
  if ARGV[5 + 2 * i] == '1' then redis.call('PEXPIRE', KEYS[i], ARGV[4]) end
end
redis.call('XADD', KEYS[n + 1], 'MAXLEN', '~', ARGV[2], '*', ARGV[1], ARGV[5])
redis.call('SET', KEYS[n + 2], 1, 'PX', ARGV[3])
"""


class WorkerService:
    def __init__(self, settings: Settings, worker, keys: Keys | None = None) -> None:
        self.settings = settings
        self.worker = worker
        self.registration = dataclasses.replace(worker.registration, instance=uuid.uuid4().hex)
        self.worker_id: str = self.registration.worker_id
        self.keys = keys or Keys()
        self.client = connect(settings.redis_url)
        self.reader = connect(settings.redis_url, blocking=True)
        self.publisher = self.client.connection_pool.make_connection()  # steps are sent here, replies read later
        self.stop_event = threading.Event()
        self.epoch = -1
        self.last_step = -1

    @property
    def _ttl_ms(self) -> int:
        return int(self.settings.heartbeat_ttl * 1000)

    def register(self) -> None:
        # A fresh plan stream: plans meant for an earlier process with this id must not run here.
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.plans(self.worker_id))
        pipe.hset(self.keys.workers, self.worker_id, encode(self.registration))
        pipe.set(self.keys.heartbeat(self.worker_id), 1, px=self._ttl_ms)
        pipe.execute()

    def deregister(self) -> None:
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hdel(self.keys.workers, self.worker_id)
            pipe.delete(self.keys.heartbeat(self.worker_id))
            pipe.xadd(self.keys.control, {FIELD: encode(WorkerGone(self.worker_id))}, maxlen=CONTROL_MAXLEN,
                      approximate=True)
            pipe.execute()
        except RECONNECT_ERRORS as e:
            log.warning("could not deregister (Redis unreachable: %s); the heartbeat will expire", e)

    def _heartbeat_loop(self) -> None:
        client = connect(self.settings.redis_url)
        registration = encode(self.registration)
        while not self.stop_event.wait(self.settings.heartbeat_ttl / 4):
            try:
                pipe = client.pipeline(transaction=True)
                pipe.set(self.keys.heartbeat(self.worker_id), 1, px=self._ttl_ms)
                pipe.hset(self.keys.workers, self.worker_id, registration)
                pipe.execute()
            except RECONNECT_ERRORS as e:
                log.warning("heartbeat failed, retrying: %s", e)

    def run(self) -> None:
        gc.freeze()  # the model and the modules live as long as the process: full collections need not scan them
        retry(self.register, "registering (Redis unreachable?)", self.stop_event)
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        log.info("worker %s ready: %d KV blocks of %d tokens, %d swap blocks", self.worker_id,
                 self.registration.num_blocks, self.registration.block_size, self.registration.num_swap_blocks)
        reader = PlanReader(self.reader, self.keys.plans(self.worker_id), self.stop_event)
        reader.start()
        plans: deque[StepPlan] = deque()  # read, not yet run
        sent: _Sent | None = None  # the last step's writes, their reply not read yet
        waited = 0.0  # seconds spent, holding sequences, waiting for the next plan: the scheduler's lag
        try:
            while not self.stop_event.is_set():
                if not plans:
                    if sent is not None and reader.idle():  # idle: the last step's writes must land first
                        self._confirm(sent)
                        sent = None
                    due = bool(self.worker.seqs)  # sequences held: their next plan is due
                    began = time.monotonic()
                    plans.extend(self._new_plans(reader, reader.take(BLOCK_MS / 1000)))
                    waited += (time.monotonic() - began) if due else 0.0
                    continue
                plan = plans.popleft()
                plans.extend(self._new_plans(reader, reader.take(0.0)))
                joins = []
                while plans and plans[0].joins:
                    joins.append(plans.popleft())
                outcomes = self._execute(plan, joins)
                outcomes[0].result.waited, waited = waited, 0.0
                if sent is not None:
                    self._confirm(sent)
                sent = self._send(outcomes)
            if sent is not None:
                self._confirm(sent)
        finally:
            self.stop_event.set()
            self.deregister()

    def _new_plans(self, reader: PlanReader, entries: list) -> list[StepPlan]:
        """The plans of these entries this worker has yet to run, in order."""
        plans = []
        for entry_id, fields in entries:
            plan = decode_entry(reader.stream, entry_id, fields, StepPlan)
            if plan is not None and self._is_new(plan):
                plans.append(plan)
        return plans

    def _is_new(self, plan: StepPlan) -> bool:
        """Skip replays: a plan written twice by a retried round trip, or one from an older scheduler."""
        if plan.worker_id != self.worker_id:
            log.warning("dropped a plan addressed to %s", plan.worker_id)
            return False
        if plan.epoch < self.epoch or (plan.epoch == self.epoch and plan.step_id <= self.last_step):
            return False
        self.epoch, self.last_step = plan.epoch, plan.step_id
        return True

    def _execute(self, plan: StepPlan, joins: list[StepPlan]) -> list[StepOutcome]:
        """Run the plan and the plans that join it as one step: an outcome for each."""
        step = functools.reduce(StepPlan.joined, joins, plan)
        try:
            outcome = self.worker.execute(step)
        except Exception as e:  # the scheduler fails this step's requests; the worker keeps serving
            log.exception("step %d failed", plan.step_id)
            outcome = StepOutcome(StepResult(self.worker_id, plan.epoch, plan.step_id,
                                             error=f"{type(e).__name__}: {e}"))
        return outcome.split(joins) if joins else [outcome]

    def _send(self, outcomes: list[StepOutcome]) -> _Sent:
        """Send a step's tokens and results (a result per plan it ran); `_confirm` reads the replies."""
        keep_ms = int((self.settings.request_timeout + self.settings.out_stream_ttl) * 1000)
        commands = []
        for outcome in outcomes:
            result, tokens = outcome.result, outcome.outputs
            keys = [self.keys.out(out.rid) for out in tokens] + [self.keys.results,
                                                                   self.keys.heartbeat(self.worker_id)]
            args = [FIELD, RESULTS_MAXLEN, self._ttl_ms, keep_ms, encode(result)]
            for out in tokens:  # abandoned streams expire
                args += (encode(out), "1" if out.output_index % EXPIRY_REFRESH_TOKENS == 0 else "0")
            commands.append(("EVAL", PUBLISH_STEP, len(keys), *keys, *args))
        sent = _Sent(outcomes[0].result.step_id, commands)
        try:
            self.publisher.send_packed_command(self.publisher.pack_commands(sent.commands))
            sent.on_wire = True
        except RECONNECT_ERRORS as e:
            self.publisher.disconnect()
            log.warning("sending step %d failed, retrying: %s", sent.step_id, e)
        return sent

    def _confirm(self, sent: _Sent) -> None:
        """Read a sent step's replies. If the connection broke, write the step again (readers skip what they
        already have) until Redis takes it."""
        if sent.on_wire:
            try:
                for _ in sent.commands:
                    self.client.parse_response(self.publisher, "EVAL")
                return
            except RECONNECT_ERRORS as e:
                self.publisher.disconnect()
                log.warning("publishing step %d failed, retrying: %s", sent.step_id, e)
        for command in sent.commands:
            retry(lambda: self.client.execute_command(*command), f"publishing step {sent.step_id}", self.stop_event)


@dataclasses.dataclass(slots=True)
class _Sent:
    """A step's writes, as sent to Redis: a script per plan it ran."""
    step_id: int
    commands: list[tuple]
    on_wire: bool = False  # False: sending failed, `_confirm` sends again


class PlanReader:
    """A worker's plan stream, read into a queue by a thread of its own (blocking XREADs on its own connection)."""

    def __init__(self, client: redis.Redis, stream: str, stop_event: threading.Event) -> None:
        self.client = client
        self.stream = stream
        self.stop_event = stop_event
        self.entries: queue.SimpleQueue = queue.SimpleQueue()  # (entry id, fields), in stream order
        self.failure: Exception | None = None  # what stopped the thread: `take` raises it, and the service ends
        self.thread = threading.Thread(target=self._read_forever, name="plans", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _read_forever(self) -> None:
        cursor: bytes | str = "0-0"  # the last plan read
        backoff = Backoff()
        try:
            while not self.stop_event.is_set():
                try:
                    reply = self.client.xread({self.stream: cursor}, count=PLANS_PER_READ, block=BLOCK_MS)
                    backoff.reset()
                except RECONNECT_ERRORS as e:
                    log.warning("reading plans failed, reconnecting: %s", e)
                    time.sleep(backoff.next())
                    continue
                for entry in _entries(reply):
                    cursor = entry[0]
                    self.entries.put(entry)
        except Exception as e:  # a worker that reads no plans must not look alive
            self.failure = e

    def idle(self) -> bool:
        """Whether no plan is at hand."""
        return self.entries.empty()

    def take(self, timeout: float) -> list:
        """The plans read so far, waiting up to `timeout` seconds for one if there are none."""
        if self.failure is not None:
            raise RuntimeError("the plan stream's reader failed") from self.failure
        try:
            entries = [self.entries.get(timeout=timeout) if timeout else self.entries.get_nowait()]
        except queue.Empty:
            return []
        while not self.entries.empty():
            entries.append(self.entries.get_nowait())
        return entries


def _entries(reply) -> list:
    """The (entry id, fields) pairs of an XREAD reply (RESP3: a map of stream to entries; RESP2: pairs)."""
    return [entry for _, entries in (reply.items() if isinstance(reply, dict) else reply or ()) for entry in entries]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedserve worker", description="pagedserve GPU worker service")
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(argv))
    setup_logging("worker", settings.log_level)
    from gpu_worker.worker_factory import make_worker

    worker = make_worker(settings, settings.worker_id or f"{socket.gethostname()}-{os.getpid()}")
    service = WorkerService(settings, worker)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop_event.set())
    service.run()
