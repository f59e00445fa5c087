"""The cluster (sans-IO): every worker's scheduler, and what happens between them.

It places new and orphaned requests (the longest prefix hit, weighed against load), follows workers
joining, leaving, expiring and stalling, keeps aborts that arrive before their request, aborts the
requests of a gateway that is gone, and resumes a request from the tokens already on its stream. Its
ledger (scheduler/ledger.py) holds every tenant's account: a new request past a queue limit is turned away,
one that waited past its queue time ends, both with the wait to advise. Time comes in as an argument; the
scheduler service only reads, decodes, calls these, and writes.
"""
from __future__ import annotations

import bisect
import sys
from dataclasses import dataclass, field

from scheduler.beam_search import BeamSearch
from scheduler.groups import BeamGroup
from scheduler.ledger import Ledger
from scheduler.request import FinishedRequest, RequestState, Status
from scheduler.worker_scheduler import ORDER, Ids, WorkerScheduler, WorkerSchedulerFactory
from shared.out_stream import OutOfOrder, OutputFold
from shared.protocol import (
    OVERLOADED, REJECTED, SCHEDULER_WRITER, UNAVAILABLE, Assignment, ProtocolError, Request, SchedulerStats, StepPlan,
    StepResult, TenantStats, TokenOutput, WorkerRegistration, decode,
)
from shared.sampling import finish_reason
from shared.settings import Settings


@dataclass(slots=True)
class WorkerChanges:
    """What `sync_workers` changed, for the service to log and to clear from the registry."""
    joined: list[WorkerRegistration] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (worker id, why)


@dataclass(frozen=True, slots=True)
class Orphans:
    """What became of a gone gateway's requests."""
    taken_up: int  # by another gateway, whose client reconnected there
    aborted: int


class Cluster:
    def __init__(self, settings: Settings, epoch: int = 0,
                 worker_scheduler: WorkerSchedulerFactory | None = None) -> None:
        self.settings = settings
        self.epoch = epoch
        self.worker_scheduler = worker_scheduler or WorkerScheduler
        self.workers: dict[str, WorkerScheduler] = {}
        self.requests: dict[str, RequestState] = {}
        self.unplaced: list[RequestState] = []  # no worker yet; arrival order
        self.finished: list[FinishedRequest] = []
        self.gateways_down: dict[str, float] = {}  # gateway → when its heartbeat was first seen expired
        self.placements: list[tuple[str, str]] = []  # (rid, worker id): Assignments to write before any plan
        self.early_aborts: dict[str, tuple[str, float]] = {}  # rid → (reason, when) of aborts ahead of their request
        self.stalled: dict[str, str] = {}  # worker id → the instance that overran step_timeout
        self.oldest_steps: dict[str, tuple[int, float]] = {}  # worker id → (its oldest step in flight, seen since)
        self.ids = Ids()
        self.ledger = Ledger(settings)
        self._past_preemptions = 0  # of workers removed since

    def _count_seats(self) -> None:
        """The fair policy's shares split every worker's sequences."""
        self.ledger.seats = self.settings.max_num_seqs * len(self.workers)

    @property
    def worker_ids(self) -> list[str]:
        return list(self.workers)

    @property
    def num_preemptions(self) -> int:
        return self._past_preemptions + sum(ws.num_preemptions for ws in self.workers.values())

    def has_unfinished(self) -> bool:
        """Whether a request has not ended (one that ended may wait in `requests` for its plans in flight)."""
        return any(rs.status is not Status.FINISHED for rs in self.requests.values())

    # ---- workers --------------------------------------------------------------------------
    def add_worker(self, reg: WorkerRegistration) -> None:
        """Register a worker; the same registration again is a no-op, a changed one replaces the worker (its
        requests resume by recompute). Raises ValueError for a registration it cannot use."""
        bs = reg.block_size
        if reg.worker_id in ("", SCHEDULER_WRITER):
            raise ValueError(f"worker id {reg.worker_id!r} is reserved")
        if not (bs > 0 and bs & (bs - 1) == 0):
            raise ValueError(f"worker {reg.worker_id}: block_size must be a power of two; got {bs}")
        if reg.num_blocks < 2 or reg.num_swap_blocks < 0 or reg.max_model_len < 2:
            raise ValueError(f"worker {reg.worker_id}: needs num_blocks >= 2, num_swap_blocks >= 0 and "
                             f"max_model_len >= 2; got {reg.num_blocks}, {reg.num_swap_blocks}, {reg.max_model_len}")
        known = self.workers.get(reg.worker_id)
        if known is not None:
            if known.reg == reg:
                return
            self.remove_worker(reg.worker_id)
        self.workers[reg.worker_id] = self.worker_scheduler(reg, self.settings, self.epoch, self.ids, self.ledger)
        self._count_seats()
        unplaced, self.unplaced = self.unplaced, []
        for rs in unplaced:
            self._place(rs)

    def remove_worker(self, worker_id: str) -> None:
        """The worker is gone: its requests resume elsewhere by recompute, from the tokens they have."""
        ws = self.workers.pop(worker_id, None)
        if ws is None:
            return
        self._count_seats()
        self._past_preemptions += ws.num_preemptions
        self.oldest_steps.pop(worker_id, None)
        self._collect(ws.finished)  # nothing in flight there will come back
        for rs in sorted(ws.requests, key=ORDER):
            ws.unseat(rs)
            rs.seqs = []
            rs.group.released()
            rs.status = Status.WAITING
            rs.worker_id = None
            self._place(rs)

    def sync_registry(self, registry: list[tuple[str, bytes, bool]]) -> WorkerChanges:
        """`sync_workers` from the registry as Redis holds it: (worker id, encoded registration, heartbeat alive);
        a registration that does not decode is refused."""
        live, refused = {}, []
        for worker_id, payload, alive in registry:
            try:
                reg = decode(payload, WorkerRegistration)
            except ProtocolError as e:
                refused.append((worker_id, f"malformed: {e}"))
                continue
            if alive:
                live[worker_id] = reg
        changes = self.sync_workers(live)
        changes.refused += refused
        return changes

    def sync_workers(self, live: dict[str, WorkerRegistration]) -> WorkerChanges:
        """Follow the workers whose heartbeat is alive: add the new (or restarted) ones, drop the rest. A
        stalled instance stays out while it lives; a restart registers a new one."""
        changes = WorkerChanges()
        self.stalled = {w: i for w, i in self.stalled.items() if w in live and live[w].instance == i}
        live = {w: reg for w, reg in live.items() if w not in self.stalled}
        for worker_id in list(self.workers):
            if worker_id not in live:
                self.remove_worker(worker_id)
                changes.gone.append(worker_id)
        for worker_id, reg in live.items():
            known = self.workers.get(worker_id)
            if known is not None and known.reg == reg:
                continue
            try:
                self.add_worker(reg)
            except ValueError as e:
                changes.refused.append((worker_id, str(e)))
                continue
            changes.joined.append(reg)
        return changes

    def check_stalled(self, now: float) -> list[tuple[str, int, float]]:
        """Quarantine the workers whose oldest step in flight has been so for over step_timeout (counted from
        the first check that saw it oldest: the step before it may have run until then); they get nothing
        until they restart, and their requests move. Returns (worker, step, seconds) for each."""
        timeout = self.settings.step_timeout
        stalled = []
        oldest: dict[str, tuple[int, float]] = {}
        for worker_id, ws in list(self.workers.items()):
            if not ws.in_flight:
                continue
            step_id = ws.in_flight[0].step_id
            seen = self.oldest_steps.get(worker_id)
            since = seen[1] if seen is not None and seen[0] == step_id else now
            if timeout and now - since > timeout:
                stalled.append((worker_id, step_id, now - since))
                self.stalled[worker_id] = ws.reg.instance
                self.remove_worker(worker_id)
            else:
                oldest[worker_id] = (step_id, since)
        self.oldest_steps = oldest
        return stalled

    # ---- requests -------------------------------------------------------------------------
    def knows(self, rid: str) -> bool:
        """Whether `rid` is a request here, or one that ended here and whose end `pop_finished` has not handed out."""
        return rid in self.requests or any(done.rid == rid for done in self.finished)

    def add_request(self, req: Request, outputs: dict[int, list[int]] | None = None,
                    reasons: dict[int, str] | None = None) -> bool:
        """A request, with the tokens its samples already have and why those that ended did (a resumed one: the
        queue limits turn away new requests only). False, and nothing done, for an id `knows` (a redelivery, or a
        second request under a live id)."""
        if self.knows(req.rid):
            return False
        outputs, reasons = outputs or {}, reasons or {}
        early = self.early_aborts.pop(req.rid, None)
        if early is not None:
            self._collect([FinishedRequest(req.rid, _abort_reason(early[0]))])
            return True
        error = self._invalid(req, outputs)
        if error is not None:
            self._collect([FinishedRequest(req.rid, "error", error, REJECTED)])
            return True
        refusal = self.ledger.refusal(req) if not outputs and not reasons else None
        if refusal is not None:
            self._collect([FinishedRequest(req.rid, "error", refusal.message, OVERLOADED,
                                           retry_after=refusal.retry_after)])
            return True
        params = req.params
        rank = (req.priority if self.settings.scheduling_policy == "priority" else 0, next(self.ids.ranks))
        if params.beam_width:  # its samples are the live beams: one to begin with (a restart begins again)
            rs = RequestState(req, rank, [[]], [None],
                              group=BeamGroup(search=BeamSearch(params.beam_width, params.length_penalty,
                                                                params.early_stopping)))
        else:
            rs = RequestState(req, rank, [list(outputs.get(i, ())) for i in range(params.n)],
                              [reasons.get(i) for i in range(params.n)])
        for i in rs.live_samples:  # what ends a sample whatever the worker: max_tokens, stop_token_ids
            rs.reasons[i] = finish_reason(req.params, rs.outputs[i], len(rs.tokens(i)), sys.maxsize, ())
        if rs.done:
            self._collect([FinishedRequest(req.rid, rs.reasons[-1] or "stop")])
            return True
        self.requests[req.rid] = rs
        self.ledger.arrived(req)
        self._place(rs)
        return True

    def resume(self, req: Request, entries: list[TokenOutput | Assignment]) -> bool:
        """Take up a request another scheduler left unfinished, from the entries of its stream (read after a
        fence: see shared/out_stream.py). False when the stream shows it ended (nothing is left to do), or when the id
        is one `knows`."""
        fold = OutputFold(req.params.n, req.params.max_tokens)
        for entry in entries:
            try:
                fold.apply(entry)
            except OutOfOrder:
                continue
        if fold.ended or all(r is not None for r in fold.finish_reasons):
            return False
        return self.add_request(req, dict(enumerate(fold.tokens)),
                                {i: r for i, r in enumerate(fold.finish_reasons) if r is not None})

    @staticmethod
    def _invalid(req: Request, outputs: dict[int, list[int]]) -> str | None:
        """What the protocol's decoding cannot know is wrong with a request (its parameters it checks)."""
        if not req.prompt_token_ids:
            return "the prompt is empty"
        if min(req.prompt_token_ids) < 0:
            return "token ids must be 0 or more"
        bad = [i for i in outputs if not 0 <= i < req.params.n]
        if bad:
            return f"outputs given for sample {bad[0]} of a request with n={req.params.n}"
        return None

    def abort(self, rid: str, reason: str = "abort", now: float = 0.0) -> None:
        """Abort a request (client gone, stop string hit); one not seen yet is aborted when it comes (if it
        comes within request_timeout of `now`)."""
        rs = self.requests.get(rid)
        if rs is None:
            self.early_aborts[rid] = (reason, now)
        else:
            self._end(rs, FinishedRequest(rid, _abort_reason(reason)))

    def _end(self, rs: RequestState, end: FinishedRequest) -> None:
        """End a request that has not, on its worker or with none."""
        if rs.worker_id is not None:
            self.workers[rs.worker_id].finish(rs, end.finish_reason, end.error, end.error_kind,
                                              retry_after=end.retry_after)
        elif rs.status is not Status.FINISHED:
            self.unplaced.remove(rs)
            rs.status = Status.FINISHED
            self._collect([end])

    def gateway_ids(self) -> set[str]:
        """The gateways whose requests run here (requests with no gateway are never aborted for one)."""
        return {rs.gateway_id for rs in self.requests.values() if rs.gateway_id}

    def orphaned(self, down: set[str], now: float) -> list[str]:
        """Of the gateways `down` (their heartbeat expired), those gone for the reconnect grace period: a client
        of theirs that reconnected elsewhere within it has its stream taken up by that gateway."""
        self.gateways_down = {g: self.gateways_down.get(g, now) for g in down}
        return sorted(g for g, since in self.gateways_down.items() if now - since >= self.settings.reconnect_grace)

    def requests_of(self, gateway_id: str) -> list[str]:
        return [rid for rid, rs in self.requests.items()
                if rs.gateway_id == gateway_id and rs.status is not Status.FINISHED]

    def gateway_gone(self, gateway_id: str, now: float, taken_up: dict[str, str] | None = None) -> Orphans:
        """A gateway is gone: each of its requests goes to the live gateway that took its stream up (`taken_up`:
        rid → gateway), or is aborted, as nobody will read its tokens."""
        taken_up = taken_up or {}
        self.gateways_down.pop(gateway_id, None)
        rids = self.requests_of(gateway_id)
        for rid in rids:
            if rid in taken_up:
                self.requests[rid].gateway_id = taken_up[rid]
            else:
                self.abort(rid, "abort", now)
        moved = sum(rid in taken_up for rid in rids)
        return Orphans(taken_up=moved, aborted=len(rids) - moved)

    def expire(self, now: float) -> None:
        """Fail the requests that waited for a worker over request_timeout, and those that waited for admission over
        their queue time (429); forget old early aborts; stamp the ledger's window with the time."""
        self.ledger.tick(now)
        self._expire_queued(now)
        timeout = self.settings.request_timeout
        for rs in list(self.unplaced):
            if rs.unplaced_since is None:
                rs.unplaced_since = now
            elif now - rs.unplaced_since > timeout:
                self._end(rs, FinishedRequest(rs.rid, "error", f"no worker could take the request within {timeout:g} s",
                                              UNAVAILABLE))
        self.early_aborts = {rid: e for rid, e in self.early_aborts.items() if now - e[1] <= timeout}

    def _expire_queued(self, now: float) -> None:
        queued = [rs for rs in self.unplaced if rs.queued]
        for ws in self.workers.values():
            queued += [rs for rs in ws.waiting if rs.queued]
        for rs in queued:
            limit = self.ledger.queue_time_limit(rs.req.tenant)
            if rs.queued_since is None:
                rs.queued_since = now
            elif limit and now - rs.queued_since > limit:
                self._end(rs, FinishedRequest(rs.rid, "error", f"the request waited {now - rs.queued_since:.1f} s "
                                              f"for admission, past the queue time of {limit:g} s", OVERLOADED,
                                              retry_after=self.ledger.retry_after(rs.req.tenant)))

    def _collect(self, finished: list[FinishedRequest]) -> None:
        for done in finished:
            rs = self.requests.pop(done.rid, None)
            if rs is not None:
                self.ledger.ended(rs.req, rs.queued)
            self.finished.append(done)

    def pop_finished(self) -> list[FinishedRequest]:
        """Requests that ended, each once, as soon as no plan in flight still carries it."""
        for ws in self.workers.values():
            self._collect(ws.pop_finished())
        done, self.finished = self.finished, []
        return done

    def pop_placements(self) -> list[tuple[str, str]]:
        placed, self.placements = self.placements, []
        return placed

    # ---- placement ------------------------------------------------------------------------
    def _place(self, rs: RequestState) -> None:
        """Put the request on the worker with the least to compute before its first token (its uncached
        prompt plus what is queued there), then the least loaded; reject it if no worker can ever run it."""
        if not self.workers:
            bisect.insort(self.unplaced, rs, key=ORDER)
            return
        misfits = {wid: _misfit(rs, ws) for wid, ws in self.workers.items()}
        fitting = [ws for wid, ws in self.workers.items() if misfits[wid] is None]
        if not fitting:
            largest = max(self.workers.values(), key=lambda ws: ws.stats().num_blocks * ws.reg.block_size)
            rs.status = Status.FINISHED
            self._collect([FinishedRequest(rs.rid, "error", misfits[largest.worker_id], REJECTED)])
            return
        uncached = {ws.worker_id: ws.uncached_prompt(rs) for ws in fitting}
        ws = self._choose(fitting, uncached)
        rs.uncached = uncached[ws.worker_id]
        rs.unplaced_since = None
        ws.enqueue(rs)
        self.placements.append((rs.rid, ws.worker_id))

    def _choose(self, fitting: list[WorkerScheduler], uncached: dict[str, int]) -> WorkerScheduler:
        """The placement policy: of the workers that can run a request (with the prompt tokens each would have to
        compute for it), the one it goes to. Benchmarks subclass this for baselines."""
        return min(fitting, key=lambda w: _placement_key(uncached[w.worker_id], w))

    # ---- steps ----------------------------------------------------------------------------
    def schedule(self, worker_id: str, now: float | None = None) -> StepPlan | None:
        ws = self.workers.get(worker_id)
        return ws.schedule(now) if ws is not None else None

    def plans(self, worker_id: str, now: float | None = None) -> list[StepPlan]:
        """Every plan the worker may be sent now: its next step and, with async scheduling, the one after (by
        `now`, the service's clock, once it falls due; at once without a clock)."""
        plans = []
        while (plan := self.schedule(worker_id, now)) is not None:
            plans.append(plan)
        return plans

    def lookahead_due(self, now: float) -> float | None:
        """The earliest time after `now` at which a worker's lookahead falls due: when the service plans again."""
        return min((due for ws in self.workers.values() if (due := ws.lookahead_due()) is not None and due > now),
                   default=None)

    def apply_result(self, result: StepResult, now: float | None = None) -> None:
        ws = self.workers.get(result.worker_id)
        if ws is not None:
            ws.apply_result(result, now)

    def stats(self, now: float) -> SchedulerStats:
        workers = [ws.stats() for ws in self.workers.values()]
        return SchedulerStats(
            time=now,
            running=sum(len(ws.running) for ws in self.workers.values()),
            waiting=len(self.unplaced) + sum(len(ws.waiting) for ws in self.workers.values()),
            preempted=sum(len(ws.preempted) for ws in self.workers.values()),
            preemptions=self.num_preemptions,
            workers=workers,
            tenants=self.tenant_stats(),
        )

    def tenant_stats(self) -> list[TenantStats]:
        return [TenantStats(name, a.waiting, a.running_seqs, a.tokens_in_window(), a.tenant.weight)
                for name, a in sorted(self.ledger.accounts.items())]


def next_epoch(counter: int, now: float) -> int:
    """A new scheduler's epoch, from the counter Redis just incremented: above the last epoch, and above the wall
    clock in ms, since were Redis to lose the counter (no AOF, a failover), a restarted count would fall below the
    epoch the workers hold, and they would skip every plan."""
    return max(counter, int(now * 1000))


def _abort_reason(reason: str) -> str:
    """An abort ends a request with "stop" or "length" when the gateway says so (a stop string), else "abort"."""
    return reason if reason in ("stop", "length") else "abort"


def _misfit(rs: RequestState, ws: WorkerScheduler) -> str | None:
    """Why the request can never run on this worker, or None."""
    tokens, reg = rs.longest, ws.reg
    if tokens >= reg.max_model_len:
        return (f"the request has {tokens} tokens, but max_model_len is {reg.max_model_len}: "
                "there is no room to generate")
    blocks, capacity = ws.kv.num_blocks_for(tokens), ws.stats().num_blocks
    if blocks > capacity:
        return (f"the request has {tokens} tokens, which need {blocks} KV blocks of {reg.block_size} tokens, "
                f"but worker {reg.worker_id} holds only {capacity} blocks")
    if reg.vocab_size:
        params = rs.req.params
        ids = (*rs.prompt, *params.stop_token_ids, *params.allowed_token_ids, *(t for t, _ in params.logit_bias))
        bad = [t for t in ids if t >= reg.vocab_size]
        if bad:
            return (f"token id {bad[0]} is outside the vocabulary of the model on worker {reg.worker_id} "
                    f"(0..{reg.vocab_size - 1})")
    return None


def _placement_key(uncached: int, ws: WorkerScheduler) -> tuple[int, int, int]:
    """Estimated tokens to compute before a request's first token there (its uncached prompt plus the worker's
    queued prefill, uncached parts only, and what its running sequences have left to compute, at least a token
    each), then the least loaded, then the most free blocks."""
    queued = sum(r.uncached for r in ws.waiting) + sum(r.longest for r in ws.preempted)
    running = sum(max(1, r.num_tokens(s) - s.num_computed) for r in ws.running for s in r.seqs)
    load = len(ws.waiting) + len(ws.preempted) + ws.num_running_seqs
    return queued + running + uncached, load, -ws.stats().free_blocks
