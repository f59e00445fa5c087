"""The worker service: the worker core behind the Redis bus.

Registers, keeps a heartbeat alive from a thread (a long step must not look like a death), reads its
plan stream, executes each plan and publishes every sampled token to `out:{rid}` plus the step
result in one MULTI/EXEC round trip, so the scheduler's view and the clients' streams never diverge;
the same round trip fetches the next plan when the scheduler has already sent it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import socket
import threading
import time
import uuid

from shared.bus import BLOCK_MS, RECONNECT_ERRORS, Backoff, connect, decode_entry, retry
from shared.keys import CONTROL_MAXLEN, FIELD, RESULTS_MAXLEN, Keys
from shared.log import setup_logging
from shared.protocol import StepPlan, StepResult, WorkerGone, encode
from shared.settings import Settings

log = logging.getLogger("gpu_worker")
EXPIRY_REFRESH_TOKENS = 64


class WorkerService:
    def __init__(self, settings: Settings, worker, keys: Keys | None = None) -> None:
        self.settings = settings
        self.worker = worker
        self.registration = dataclasses.replace(worker.registration, instance=uuid.uuid4().hex)
        self.worker_id: str = self.registration.worker_id
        self.keys = keys or Keys()
        self.client = connect(settings.redis_url)
        self.reader = connect(settings.redis_url, blocking=True)
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
        stream = self.keys.plans(self.worker_id)
        last_id = "0-0"
        backoff = Backoff()
        entries: list = []  # read, not yet run
        try:
            while not self.stop_event.is_set():
                if not entries:
                    try:
                        entries = _entries(self.reader.xread({stream: last_id}, count=1, block=BLOCK_MS))
                        backoff.reset()
                    except RECONNECT_ERRORS as e:
                        log.warning("reading plans failed, reconnecting: %s", e)
                        time.sleep(backoff.next())
                    continue
                entry_id, fields = entries.pop(0)
                last_id = entry_id
                plan = decode_entry(stream, entry_id, fields, StepPlan)
                if plan is not None and self._is_new(plan):
                    entries = self._publish(self._execute(plan), stream, last_id)
        finally:
            self.stop_event.set()
            self.deregister()

    def _is_new(self, plan: StepPlan) -> bool:
        """Skip replays: a plan written twice by a retried round trip, or one from an older scheduler."""
        if plan.worker_id != self.worker_id:
            log.warning("dropped a plan addressed to %s", plan.worker_id)
            return False
        if plan.epoch < self.epoch or (plan.epoch == self.epoch and plan.step_id <= self.last_step):
            return False
        self.epoch, self.last_step = plan.epoch, plan.step_id
        return True

    def _execute(self, plan: StepPlan) -> StepResult:
        try:
            return self.worker.execute(plan)
        except Exception as e:  # the scheduler fails this step's requests; the worker keeps serving
            log.exception("step %d failed", plan.step_id)
            return StepResult(self.worker_id, plan.epoch, plan.step_id, error=f"{type(e).__name__}: {e}")

    def _publish(self, result: StepResult, stream: str, last_id: bytes) -> list:
        """Publish a step's tokens and result; in the same round trip, the plans already waiting after it
        (with async scheduling the next one usually is)."""
        keep_ms = int((self.settings.request_timeout + self.settings.out_stream_ttl) * 1000)

        def publish() -> list:
            pipe = self.client.pipeline(transaction=True)
            for out in result.outputs:
                if out.sample_index < 0:
                    continue  # a request it could not run: the scheduler ends it on its stream
                key = self.keys.out(out.rid)
                pipe.xadd(key, {FIELD: encode(out)})
                if out.output_index % EXPIRY_REFRESH_TOKENS == 0:  # abandoned streams expire
                    pipe.pexpire(key, keep_ms)
            pipe.xadd(self.keys.results, {FIELD: encode(result)}, maxlen=RESULTS_MAXLEN, approximate=True)
            pipe.set(self.keys.heartbeat(self.worker_id), 1, px=self._ttl_ms)
            pipe.xread({stream: last_id}, count=1)
            return _entries(pipe.execute()[-1])
        return retry(publish, f"publishing step {result.step_id}", self.stop_event) or []


def _entries(reply) -> list:
    """The (entry id, fields) pairs of an XREAD reply."""
    return [entry for _, entries in reply or () for entry in entries]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedserve worker", description="pagedserve GPU worker service")
    Settings.add_arguments(parser)
    settings = Settings.from_args(parser.parse_args(argv))
    setup_logging("worker", settings.log_level)
    from gpu_worker.worker import Worker

    worker = Worker.load(settings, settings.worker_id or f"{socket.gethostname()}-{os.getpid()}")
    service = WorkerService(settings, worker)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop_event.set())
    service.run()
