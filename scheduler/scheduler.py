"""The scheduler core: requests in, one step plan per worker out, step results back in. No I/O.

One step on a worker shares a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`) between, in this order: running requests (earliest arrival first; a long prompt is
cut into chunks), then requests it preempted (earliest first), then new admissions. The last two
happen only when the step preempted nothing (or nothing is left running) and enough blocks stay free
above the watermark, and new requests wait while a preempted one cannot resume. When a running
request needs a block and none is free, the latest-arrived request is preempted, all its sequences
together, by recompute or by swap. Plans are deltas against the worker's cached state (the contract
in shared/protocol.py).

With `async_scheduling`, a worker has up to two plans in flight: the step it computes and a lookahead,
the next step planned from what the first will leave (each sequence it samples one token further, the
token still unknown). The worker runs them in order and results come back in order, so blocks freed
meanwhile are reused only by later plans. A sequence in flight cannot be preempted (its token would
still come), so a lookahead that would preempt stops short, and the worker's pipeline drains before
the full step that does.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from operator import attrgetter

from scheduler.kv_cache_manager import KVCacheManager, cdiv
from scheduler.request import RequestState, Sequence, Status
from shared.protocol import (
    FAILED, REJECTED, UNAVAILABLE, NewSequence, Request, SchedulerStats, ScheduledSequence, StepPlan, StepResult,
    WorkerRegistration, WorkerStats,
)
from shared.sampling import ParamError, finish_reason
from shared.settings import Settings

_ORDER = attrgetter("order")


@dataclass(slots=True)
class FinishedRequest:
    rid: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set for rejected/failed requests: a clear message for the client
    error_kind: str | None = None  # REJECTED, UNAVAILABLE or FAILED, with `error`


@dataclass(slots=True)
class Scheduled:
    """One sequence's share of a plan in flight."""
    rs: RequestState
    seq: Sequence
    num_new: int
    samples: bool  # the chunk reaches the sequence's end: the worker samples a token


@dataclass(slots=True)
class InFlight:
    step_id: int
    entries: list[Scheduled]


@dataclass(slots=True)
class WorkerState:
    reg: WorkerRegistration
    kv: KVCacheManager
    waiting: list[RequestState] = field(default_factory=list)  # placed here, not admitted; arrival order
    preempted: list[RequestState] = field(default_factory=list)  # recompute or swapped; arrival order
    running: list[RequestState] = field(default_factory=list)  # arrival order
    finished_seqs: list[int] = field(default_factory=list)  # for the next plan's `finished`
    in_flight: list[InFlight] = field(default_factory=list)  # oldest first; at most two
    drain: bool = False  # a lookahead plan met what only a full step can do: plan again once none is in flight

    @property
    def num_running_seqs(self) -> int:
        return sum(len(rs.seqs) for rs in self.running)

    @property
    def capacity_tokens(self) -> int:
        return self.kv.pool.num_usable * self.kv.block_size


@dataclass(slots=True)
class StepBuilder:
    plan: StepPlan
    budget: int  # tokens left
    seqs_left: int
    entries: list[Scheduled] = field(default_factory=list)
    preempted: bool = False
    running_seqs: int = 0  # live sequences of the worker's running requests, kept during admission
    lookahead: bool = False  # built while another plan is in flight
    blocked: bool = False  # a running request is short of blocks: stop here and let a full step decide


class Scheduler:
    def __init__(self, settings: Settings, epoch: int = 0) -> None:
        self.settings = settings
        self.epoch = epoch
        self.workers: dict[str, WorkerState] = {}
        self.requests: dict[str, RequestState] = {}
        self.unplaced: list[RequestState] = []  # no worker yet; arrival order
        self.finished: list[FinishedRequest] = []
        self.placements: list[tuple[str, str]] = []  # (rid, worker id): Assignments to write before any plan
        self.num_preemptions = 0
        self._order = itertools.count()
        self._seq_ids = itertools.count()
        # One counter for every worker: a worker dropped and added again never sees a step id twice.
        self._step_ids = itertools.count()

    @property
    def worker_ids(self) -> list[str]:
        return list(self.workers)

    def in_flight_step(self, worker_id: str) -> int | None:
        """The step a worker is computing now, if any."""
        ws = self.workers.get(worker_id)
        return ws.in_flight[0].step_id if ws is not None and ws.in_flight else None

    # ---- workers --------------------------------------------------------------------------
    def add_worker(self, reg: WorkerRegistration) -> None:
        """Register a worker; the same registration again is a no-op, a changed one replaces the worker
        (its requests resume by recompute). Raises ValueError for a registration it cannot use."""
        bs = reg.block_size
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
        kv = KVCacheManager(reg.num_blocks, reg.num_swap_blocks, bs, (reg.model_id,),
                            self.settings.enable_prefix_caching)
        self.workers[reg.worker_id] = WorkerState(reg, kv)
        unplaced, self.unplaced = self.unplaced, []
        for rs in unplaced:
            self._place(rs)

    def remove_worker(self, worker_id: str) -> None:
        ws = self.workers.pop(worker_id, None)
        if ws is None:
            return
        for rs in sorted(ws.running + ws.preempted + ws.waiting, key=_ORDER):
            rs.seqs = []
            rs.status = Status.WAITING
            rs.worker_id = None
            self._place(rs)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: Request, outputs: dict[int, list[int]] | None = None) -> None:
        if req.rid in self.requests:
            return  # a redelivery of a request already here
        outputs = outputs or {}
        error = self._invalid(req, outputs)
        if error is not None:
            self.finished.append(FinishedRequest(req.rid, "error", error, REJECTED))
            return
        n = req.params.n
        rs = RequestState(req, next(self._order), [list(outputs.get(i, ())) for i in range(n)], [None] * n)
        self.requests[req.rid] = rs
        self._place(rs)

    @staticmethod
    def _invalid(req: Request, outputs: dict[int, list[int]]) -> str | None:
        try:
            req.params.validate()
        except ParamError as e:
            return str(e)
        if not req.prompt_token_ids:
            return "the prompt is empty"
        if any(t < 0 for t in req.prompt_token_ids):
            return "token ids must be 0 or more"
        bad = [i for i in outputs if not 0 <= i < req.params.n]
        if bad:
            return f"outputs given for sample {bad[0]} of a request with n={req.params.n}"
        return None

    def abort(self, rid: str, reason: str = "abort") -> None:
        rs = self.requests.get(rid)
        if rs is not None:
            self._finish(rs, reason if reason in ("stop", "length") else "abort")

    def pop_finished(self) -> list[FinishedRequest]:
        done, self.finished = self.finished, []
        return done

    def pop_placements(self) -> list[tuple[str, str]]:
        placed, self.placements = self.placements, []
        return placed

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def expire_waiting(self, now: float, timeout: float) -> None:
        for rs in list(self.unplaced):
            if rs.unplaced_since is None:
                rs.unplaced_since = now
            elif now - rs.unplaced_since > timeout:
                self._fail(rs, UNAVAILABLE, f"no worker could take the request within {timeout:g} s")

    def stats(self, now: float) -> SchedulerStats:
        workers = [WorkerStats(wid, ws.kv.pool.num_usable, ws.kv.num_free, ws.num_running_seqs,
                               ws.kv.pool.prefix_queries, ws.kv.pool.prefix_hits)
                   for wid, ws in self.workers.items()]
        return SchedulerStats(
            time=now,
            running=sum(len(ws.running) for ws in self.workers.values()),
            waiting=len(self.unplaced) + sum(len(ws.waiting) for ws in self.workers.values()),
            preempted=sum(len(ws.preempted) for ws in self.workers.values()),
            preemptions=self.num_preemptions,
            workers=workers,
        )

    # ---- placement ------------------------------------------------------------------------
    def _misfit(self, rs: RequestState, ws: WorkerState) -> str | None:
        """Why the request can never run on this worker, or None."""
        tokens, reg = rs.longest, ws.reg
        if tokens >= reg.max_model_len:
            return (f"the request has {tokens} tokens, but max_model_len is {reg.max_model_len}: "
                    "there is no room to generate")
        blocks = cdiv(tokens, reg.block_size)
        if blocks > ws.kv.pool.num_usable:
            return (f"the request has {tokens} tokens, which need {blocks} KV blocks of {reg.block_size} tokens, "
                    f"but worker {reg.worker_id} holds only {ws.kv.pool.num_usable} blocks")
        return None

    def _hashes(self, rs: RequestState, kv: KVCacheManager) -> list[bytes]:
        hashes = rs.prompt_hashes.get(kv.extra)
        if hashes is None:
            hashes = rs.prompt_hashes[kv.extra] = kv.hash_tokens(rs.prompt)
        return hashes

    def _uncached(self, rs: RequestState, ws: WorkerState) -> int:
        hits = ws.kv.find_prefix(self._hashes(rs, ws.kv), len(rs.prompt))
        return len(rs.prompt) - len(hits) * ws.kv.block_size

    @staticmethod
    def _placement_key(uncached: int, ws: WorkerState) -> tuple[int, int, int]:
        """Estimated tokens to compute before a request's first token there (its uncached prompt plus the
        worker's queued prefill, uncached parts only, and one token per running sequence), then the least
        loaded."""
        queued = sum(r.uncached for r in ws.waiting) + sum(r.longest for r in ws.preempted)
        running = sum(s.num_tokens - s.num_computed for r in ws.running for s in r.seqs)
        load = len(ws.waiting) + len(ws.preempted) + ws.num_running_seqs
        return queued + running + uncached, load, -ws.kv.num_free

    def _settle(self, rs: RequestState, reg: WorkerRegistration) -> bool:
        """Mark the samples whose tokens so far already end them (a restart or a resume rebuilt them);
        True when none is left."""
        for i in rs.live_samples:
            out = rs.outputs[i]
            reason = finish_reason(rs.req.params, out, len(rs.prompt) + len(out), reg.max_model_len,
                                   reg.eos_token_ids)
            if reason is not None:
                rs.reasons[i] = rs.last_reason = reason
        if rs.live_samples:
            return False
        self._finish(rs, rs.last_reason)
        return True

    def _place(self, rs: RequestState) -> None:
        if not self.workers:
            bisect.insort(self.unplaced, rs, key=_ORDER)
            return
        if self._settle(rs, next(iter(self.workers.values())).reg):
            return
        misfits = {wid: self._misfit(rs, ws) for wid, ws in self.workers.items()}
        fitting = [ws for wid, ws in self.workers.items() if misfits[wid] is None]
        if not fitting:
            largest = max(self.workers, key=lambda wid: self.workers[wid].capacity_tokens)
            self._fail(rs, REJECTED, misfits[largest])
            return
        uncached = {ws.reg.worker_id: self._uncached(rs, ws) for ws in fitting}
        ws = min(fitting, key=lambda w: self._placement_key(uncached[w.reg.worker_id], w))
        rs.uncached = uncached[ws.reg.worker_id]
        rs.worker_id = ws.reg.worker_id
        rs.unplaced_since = None
        self.placements.append((rs.rid, rs.worker_id))
        bisect.insort(ws.waiting, rs, key=_ORDER)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, worker_id: str) -> StepPlan | None:
        """The worker's next step, or None; with one plan in flight, its lookahead (see the module's notes)."""
        ws = self.workers.get(worker_id)
        if ws is None:
            return None
        lookahead = bool(ws.in_flight)
        if lookahead and (len(ws.in_flight) > 1 or ws.drain or not self.settings.async_scheduling):
            return None
        step = StepBuilder(StepPlan(worker_id, self.epoch, next(self._step_ids)),
                           self.settings.max_num_batched_tokens, self.settings.max_num_seqs, lookahead=lookahead)
        for rs in list(ws.running):
            if step.budget == 0 or step.seqs_left == 0 or step.blocked:
                break
            if rs.status is Status.RUNNING:
                self._schedule_request(ws, rs, step, may_preempt=True)
        if not step.blocked and (not step.preempted or not ws.running):  # (nothing left running: nothing to thrash)
            self._admit_from(ws, ws.preempted, step)
            if not ws.preempted:
                self._admit_from(ws, ws.waiting, step)
        ws.drain = step.blocked
        plan = step.plan
        if not (step.entries or plan.swap_out or plan.swap_in or plan.copies):
            return None
        plan.finished, ws.finished_seqs = ws.finished_seqs, []
        ws.in_flight.append(InFlight(plan.step_id, step.entries))
        return plan

    def _reserve(self, ws: WorkerState, rs: RequestState) -> int:
        """Tokens each sequence's table must cover up front: 0 for paged allocation; the benchmark-only
        "max_model_len" mode reserves a whole max_model_len (Orca-style), within the worker's capacity."""
        if self.settings.kv_reservation != "max_model_len":
            return 0
        share = ws.kv.pool.num_usable // max(1, len(rs.live_samples))
        return min(ws.reg.max_model_len, share * ws.kv.block_size)

    def _chunks(self, rs: RequestState, step: StepBuilder) -> list[tuple[Sequence, int]]:
        """Each sequence's tokens for this step, within what is left of the budget and the cap."""
        items = []
        budget, seqs_left = step.budget, step.seqs_left
        for seq in rs.seqs:
            if budget == 0 or seqs_left == 0:
                break
            if seq.samples_in_flight and self._ends_by_length(rs, seq):
                continue  # its token in flight is its last
            target = seq.num_tokens + seq.samples_in_flight if rs.fork_at is None else rs.fork_at
            num_new = min(target - seq.num_scheduled, budget)
            if num_new > 0:
                items.append((seq, num_new))
                budget -= num_new
                seqs_left -= 1
        return items

    def _ends_by_length(self, rs: RequestState, seq: Sequence) -> bool:
        """Whether the token sampled in flight is sure to end the sequence (max_tokens or max_model_len);
        asked only while one plan is in flight, so that one token is all it samples."""
        ws = self.workers[rs.worker_id]
        return (len(seq.output) + 1 >= rs.req.params.max_tokens
                or seq.num_tokens + 1 >= ws.reg.max_model_len)

    def _schedule_request(self, ws: WorkerState, rs: RequestState, step: StepBuilder, may_preempt: bool) -> None:
        if rs.fork_at is not None and rs.seqs[0].num_computed == rs.fork_at:
            self._fork(rs, ws)
        items = self._chunks(rs, step)
        if not items:
            return
        reserve = self._reserve(ws, rs)
        while ws.kv.blocks_needed([(s.seq_id, s.num_scheduled, n, reserve) for s, n in items]) > ws.kv.num_free:
            if may_preempt and step.lookahead:  # the pipeline drains; a full step decides
                step.blocked = True
                return
            victim = ws.running[-1]
            if may_preempt and len(ws.running) > 1:
                self._preempt(ws, victim, step)
                if victim is rs:
                    return
            elif len(items) > 1:
                items.pop()  # alone (or being admitted): run those of its samples that fit
            else:
                if may_preempt:
                    # Alone, it holds every used block and still needs more: the cache cannot hold it.
                    self._finish(rs, "length")
                return
        for seq, num_new in items:
            self._add(ws, rs, seq, num_new, reserve, step)

    def _add(self, ws: WorkerState, rs: RequestState, seq: Sequence, num_new: int, reserve: int,
             step: StepBuilder) -> None:
        start = seq.num_scheduled
        new_ids, copies = ws.kv.allocate(seq.seq_id, start, num_new, reserve)
        plan = step.plan
        plan.copies.extend(copies)
        if not seq.sent:
            plan.new_sequences.append(NewSequence(seq.seq_id, rs.rid, seq.sample_index, list(rs.prompt),
                                                  list(seq.output), rs.req.params))
            seq.sent = True
            sched = ScheduledSequence(seq.seq_id, start, num_new, ws.kv.block_ids(seq.seq_id))
        elif copies or seq.table_stale:
            sched = ScheduledSequence(seq.seq_id, start, num_new, [], ws.kv.block_ids(seq.seq_id))
        else:
            sched = ScheduledSequence(seq.seq_id, start, num_new, new_ids)
        seq.table_stale = False
        plan.scheduled.append(sched)
        samples = start + num_new == seq.num_tokens + seq.samples_in_flight
        seq.num_in_flight += num_new
        seq.samples_in_flight += samples
        step.entries.append(Scheduled(rs, seq, num_new, samples))
        step.budget -= num_new
        step.seqs_left -= 1

    def _fork(self, rs: RequestState, ws: WorkerState) -> None:
        """n > 1: the other samples share the first one's blocks up to the fork point (copy-on-write on
        first write); each goes on with its own tokens from there."""
        parent = rs.seqs[0]
        for i in rs.live_samples[1:]:
            child = Sequence(next(self._seq_ids), i, rs.tokens(i), rs.outputs[i], rs.fork_at)
            ws.kv.fork(parent.seq_id, child.seq_id, rs.fork_at)
            rs.seqs.append(child)
        rs.fork_at = None

    def _preempt(self, ws: WorkerState, rs: RequestState, step: StepBuilder) -> None:
        ws.running.remove(rs)
        self.num_preemptions += 1
        step.preempted = True
        seq_ids = [s.seq_id for s in rs.seqs]
        if self.settings.preemption_mode == "swap" and ws.kv.can_swap_out(seq_ids):
            step.plan.swap_out.extend(ws.kv.swap_out(seq_ids))
            for seq in rs.seqs:
                seq.table_stale = True
            rs.status = Status.SWAPPED
        else:
            self._release(ws, rs)
            rs.status = Status.PREEMPTED
        bisect.insort(ws.preempted, rs, key=_ORDER)

    def _release(self, ws: WorkerState, rs: RequestState) -> None:
        """Free every block of the request's sequences; the worker forgets those it knows."""
        for seq in rs.seqs:
            ws.kv.free(seq.seq_id)
            if seq.sent:
                ws.finished_seqs.append(seq.seq_id)
        rs.seqs = []

    # ---- admission ------------------------------------------------------------------------
    def _admit_from(self, ws: WorkerState, queue: list[RequestState], step: StepBuilder) -> None:
        step.running_seqs = ws.num_running_seqs
        while queue and step.budget > 0 and step.seqs_left > 0:
            rs = queue[0]
            admitted = self._resume_swapped(ws, rs, step) if rs.status is Status.SWAPPED else self._admit(ws, rs, step)
            if not admitted:
                return
            if rs.status is not Status.FINISHED:
                queue.pop(0)

    def _room(self, ws: WorkerState, step: StepBuilder, need_blocks: int, num_seqs: int) -> bool:
        """Admission control; an idle worker takes anything that fits at all, so nothing waits forever."""
        if not ws.running:
            return need_blocks <= ws.kv.num_free
        watermark = int(self.settings.watermark * ws.kv.pool.num_usable)
        return (need_blocks + watermark <= ws.kv.num_free
                and step.running_seqs + num_seqs <= self.settings.max_num_seqs)

    def _start_running(self, ws: WorkerState, rs: RequestState, step: StepBuilder, num_seqs: int) -> None:
        rs.status = Status.RUNNING
        bisect.insort(ws.running, rs, key=_ORDER)
        step.running_seqs += num_seqs

    def _resume_swapped(self, ws: WorkerState, rs: RequestState, step: StepBuilder) -> bool:
        seq_ids = [s.seq_id for s in rs.seqs]
        need = ws.kv.swap_in_needed(seq_ids)
        if ws.running:  # with room to grow too, or it would be the next victim (alone, it takes what fits)
            reserve = self._reserve(ws, rs)
            need += sum(max(0, cdiv(max(seq.num_computed + num_new, reserve), ws.kv.block_size)
                            - ws.kv.table_len(seq.seq_id)) for seq, num_new in self._chunks(rs, step))
        if not self._room(ws, step, need, len(seq_ids)):
            return False
        step.plan.swap_in.extend(ws.kv.swap_in(seq_ids))
        self._start_running(ws, rs, step, len(seq_ids))
        self._schedule_request(ws, rs, step, may_preempt=False)
        return True

    def _admit(self, ws: WorkerState, rs: RequestState, step: StepBuilder) -> bool:
        """Start a waiting or recompute-preempted request: prompt + output so far, on its prefix hits."""
        if self._settle(rs, ws.reg):
            return True
        live = rs.live_samples
        fork_at = rs.fork_point()
        prompt_hashes = self._hashes(rs, ws.kv)
        reserve = self._reserve(ws, rs)
        bs = ws.kv.block_size
        starts = []
        need = 0
        budget = step.budget
        hit_free: dict[int, bool] = {}
        for i in live if fork_at is None else live[:1]:
            tokens = rs.tokens(i)
            hashes = ws.kv.hash_tokens(tokens, prompt_hashes) if rs.outputs[i] else prompt_hashes
            hits = ws.kv.find_prefix(hashes, len(tokens) if fork_at is None else fork_at + 1)
            cached = len(hits) * bs
            num_new = min((len(tokens) if fork_at is None else fork_at) - cached, budget)
            budget -= num_new
            # (forking at once, the first sample still computes a token: count its block too)
            need += max(0, cdiv(max(cached + max(num_new, 1), reserve), bs) - len(hits))
            hit_free.update((b.block_id, b.ref_cnt == 0) for b in hits)
            starts.append((i, tokens, hashes, hits))
        if not self._room(ws, step, need + sum(hit_free.values()), len(live)):
            return False
        rs.seqs = []
        for i, tokens, hashes, hits in starts:
            seq = Sequence(next(self._seq_ids), i, tokens, rs.outputs[i])
            seq.num_computed = ws.kv.start(seq.seq_id, hits, hashes, len(tokens))
            rs.seqs.append(seq)
        rs.fork_at = fork_at
        self._start_running(ws, rs, step, len(live))
        self._schedule_request(ws, rs, step, may_preempt=False)
        return True

    # ---- results --------------------------------------------------------------------------
    def apply_result(self, result: StepResult) -> None:
        """Take the result of the worker's oldest plan in flight (results come back in plan order)."""
        ws = self.workers.get(result.worker_id)
        if (ws is None or not ws.in_flight or result.epoch != self.epoch
                or result.step_id != ws.in_flight[0].step_id):
            return
        entries = ws.in_flight.pop(0).entries
        if result.error is not None:
            for rs in {id(e.rs): e.rs for e in entries}.values():
                if rs.status is Status.RUNNING:
                    self._fail(rs, FAILED, f"worker {ws.reg.worker_id} failed the step: {result.error}")
            return
        sampled: dict[tuple[str, int], Scheduled] = {}
        for e in entries:
            seq = e.seq
            if e.rs.status is not Status.RUNNING or seq not in e.rs.seqs:
                continue  # aborted, or its sample ended, while in flight
            seq.num_computed += e.num_new
            seq.num_in_flight -= e.num_new
            ws.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed)
            if e.samples:
                seq.samples_in_flight -= 1
                sampled[(e.rs.rid, seq.sample_index)] = e
        for out in result.outputs:
            if out.sample_index < 0:
                rs = self.requests.get(out.rid)
                if rs is not None and rs.worker_id == ws.reg.worker_id:
                    self._fail(rs, FAILED, out.error or "the worker failed the request")
                continue
            e = sampled.pop((out.rid, out.sample_index), None)
            if e is None or e.rs.status is not Status.RUNNING or out.output_index != len(e.seq.output):
                continue
            self._append_token(ws, e.rs, e.seq, out.token_id)
        for e in sampled.values():
            # The worker samples every sequence a plan asks it to and skips only those it saw end, as the
            # scheduler did: a token missing here means the two disagree, and sampling again could loop.
            if e.rs.status is Status.RUNNING:
                self._fail(e.rs, FAILED, f"worker {ws.reg.worker_id} returned no token for sample "
                                         f"{e.seq.sample_index} in step {result.step_id}")

    def _append_token(self, ws: WorkerState, rs: RequestState, seq: Sequence, token_id: int) -> None:
        seq.output.append(token_id)
        seq.token_ids.append(token_id)
        reason = finish_reason(rs.req.params, seq.output, seq.num_tokens, ws.reg.max_model_len,
                               ws.reg.eos_token_ids)
        if reason is None:
            return
        ws.kv.free(seq.seq_id)
        ws.finished_seqs.append(seq.seq_id)
        rs.seqs.remove(seq)
        rs.reasons[seq.sample_index] = rs.last_reason = reason
        if not rs.live_samples:
            self._finish(rs, reason)

    def _fail(self, rs: RequestState, kind: str, error: str) -> None:
        self._finish(rs, "error", error, kind)

    def _finish(self, rs: RequestState, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        ws = self.workers.get(rs.worker_id) if rs.worker_id is not None else None
        if ws is not None:
            self._release(ws, rs)
            for queue in (ws.running, ws.preempted, ws.waiting):
                if rs in queue:
                    queue.remove(rs)
        elif rs in self.unplaced:
            self.unplaced.remove(rs)
        rs.status = Status.FINISHED
        self.requests.pop(rs.rid, None)
        self.finished.append(FinishedRequest(rs.rid, reason, error, error_kind))
