"""The scheduler of one worker (sans-IO): its KV-cache accounting and its queues; a step plan out, the
step's result in.

One step shares a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`) between:
1. running requests in rank order (arrival; under the priority policy, priority first): each sequence's next
   chunk (a decode token, or a piece of a long prompt: chunked prefill; a lone sequence's decode token, most chunks of
   most steps, takes a fast lane that plans it as the general path would). When the cache has no room for a chunk,
   the last-ranked running request is preempted, all its sequences together: by recompute (its blocks are freed;
   it resumes from prompt + output) or by swap (its blocks move to the worker's swap area);
2. then, unless the step preempted, preempted and waiting requests in the order the policy gives
   (scheduler/policy.py), each admitted only if its blocks fit above the watermark, until one does not; one whose
   tenant runs its most sequences already is passed over. Before any chunk is planned, a first request that does
   not fit preempts the running request its policy names, if any (priority: the last one, when it outranks it;
   fair: the latest of the tenant furthest over its share; one ranked before the first request goes behind it). A
   lookahead does so too, by recompute: the victim's tokens in flight count when they come back (its worker streams
   them). A request preempted in a step waits for the next one, and for the results of the plans in flight that sample
   its tokens. Requests that come after the lookahead went out join it: a plan of their admissions alone, run in the
   lookahead's step if the worker has not begun it (`_join`; scheduler/pacing.py).
A request's samples (n > 1) share its prompt: the first computes it alone, then the others fork from it
and share its blocks, copying a block on their first write into it (copy-on-write); its group (scheduler/groups.py:
samples, or a beam search's beams) says what its next chunks are and what a step's result does to it. Plans are deltas
against what the worker holds (shared/protocol.py: StepPlan); a sequence's `num_computed` counts the
tokens of plans sent, and a step's result commits them (prefix-cache index) and appends its tokens.

The cluster's ledger (scheduler/ledger.py) is charged with the tokens each plan computes for a tenant and counts
its running sequences. Two policies are passed in: its pacing (scheduler/pacing.py: one plan in flight, or a lookahead planned while
the worker computes one, as `settings.async_scheduling` says) and its reservation (scheduler/reservation.py:
blocks on demand, or a benchmark's contiguous baseline).
"""
from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Iterator

from scheduler.beam_search import Hypothesis
from scheduler.groups import Chunk
from scheduler.kv_cache_manager import Growth, KVCacheManager, Opening, Slots, Write
from scheduler.ledger import Ledger
from scheduler.pacing import Lookahead, Synchronous
from scheduler.policy import policy_for
from scheduler.request import FinishedRequest, RequestState, SeqState, Status
from scheduler.reservation import OnDemand, Reservation
from scheduler.speculation import Drafting
from shared.protocol import (
    FAILED, NewSequence, ScheduledSequence, StepPlan, StepResult, WorkerRegistration, WorkerStats,
)
from shared.settings import Settings

ORDER = attrgetter("rank")
SEQS = attrgetter("seqs")
TENANT = attrgetter("tenant")
# What a step's result still acts on: its running requests, and those a lookahead preempted while the step computed
# their tokens (a recompute-preempted request has a chunk in flight only then: every other plan is made with none).
LIVE = (Status.RUNNING, Status.PREEMPTED)


@dataclass(slots=True)
class Ids:
    """Id sources shared by every worker's scheduler: a worker dropped and added again never sees a step id
    or a sequence id twice; arrivals (a request's rank after its priority) are counted across the cluster."""
    steps: itertools.count = field(default_factory=itertools.count)
    seqs: itertools.count = field(default_factory=itertools.count)
    ranks: itertools.count = field(default_factory=itertools.count)


@dataclass(slots=True)
class Scheduled:
    """One sequence's chunk in a plan in flight."""
    rs: RequestState
    seq: SeqState
    start: int
    num_new: int
    emits_token: bool  # the chunk reaches the sequence's end: the worker samples a token
    num_draft: int = 0  # draft tokens the worker may check after it (speculative decoding)


@dataclass(slots=True)
class DecodeRun:
    """The fast lane's chunks (`_decode_alone`): consecutive running requests' lone sequences, a decode token each,
    in plan order, as columns (they are most chunks of most steps: no object each)."""
    requests: list[RequestState] = field(default_factory=list)
    seqs: list[SeqState] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # the token's position: its sequence's num_computed before it
    # Where its result indexes blocks (in the prefix cache): a token that fills one, or a fork's (see _sort_and_commit)
    commits: list[int] = field(default_factory=list)


@dataclass(slots=True)
class InFlight:
    step_id: int
    chunks: list[Scheduled | DecodeRun]  # in plan order
    drafting: bool = False  # a sequence may check a draft: how many tokens it ends with is known only from its result
    ahead: bool = False  # a lookahead: planned behind another plan in flight, or after it because the clock held it
    joins: bool = False  # admissions joining the plan before it (StepPlan.joins): no step of its own to the pacing

    def requests(self) -> Iterator[RequestState]:
        """Each chunk's request, in plan order."""
        for c in self.chunks:
            if type(c) is DecodeRun:
                yield from c.requests
            else:
                yield c.rs

    def num_sampling(self) -> int:
        """Chunks that reach their sequence's end: the worker samples a token after each."""
        return sum(len(c.seqs) if type(c) is DecodeRun else c.emits_token for c in self.chunks)


@dataclass(slots=True)
class StepBuilder:
    plan: StepPlan
    budget: int  # tokens left
    seqs_left: int
    chunks: list[Scheduled | DecodeRun] = field(default_factory=list)
    running_seqs: int = 0  # sequences of running requests, kept up to date while admitting
    preempted: bool = False  # a running request's chunks preempted another
    victims: list[RequestState] = field(default_factory=list)  # preempted in this step: they wait for the next one
    blocked: bool = False  # short of blocks where it may not preempt: the step ends here

    @property
    def full(self) -> bool:
        return self.budget == 0 or self.seqs_left == 0


@dataclass(slots=True)
class Room:
    """What admission has left on a worker: sequences under the cap, and blocks above the watermark and the running
    requests' next tokens."""
    seqs: int
    blocks: int


@dataclass(slots=True)
class RequestBlocks:
    """The device blocks a running request's sequences hold."""
    rid: str
    block_ids: list[int]  # each sequence's table in turn
    several: bool  # several sequences: their tables may share blocks


@dataclass(slots=True)
class WorkerView:
    """What an observer (the dashboard's snapshot) sees of one worker's cache, as block ids."""
    num_blocks: int  # every device block, the null block included
    has_null_block: bool
    cached_block_ids: list[int]  # blocks with a hash in the prefix index, free or held
    running: list[RequestBlocks]  # running requests, earliest arrival first
    num_swap_blocks: int
    free_swap_blocks: int


class WorkerScheduler:
    def __init__(self, reg: WorkerRegistration, settings: Settings, epoch: int, ids: Ids, ledger: Ledger,
                 reservation: Reservation | None = None) -> None:
        self.reg = reg
        self.pacing = Lookahead() if settings.async_scheduling else Synchronous()
        self.reservation = reservation or OnDemand()
        self.ledger = ledger
        self.policy = policy_for(settings.scheduling_policy, ledger)
        self.drafting = Drafting(settings.speculation, reg.max_model_len)
        self.settings = settings
        self.epoch = epoch
        self.ids = ids
        self.kv = KVCacheManager(reg.num_blocks, reg.num_swap_blocks, reg.block_size, (reg.model_id,),
                                 settings.enable_prefix_caching)
        self.waiting: list[RequestState] = []  # placed here, not admitted; rank order
        self.preempted: list[RequestState] = []  # recompute or swapped; rank order
        self.running: list[RequestState] = []  # rank order
        self.in_flight: deque[InFlight] = deque()  # plans sent, oldest first
        self.arrived = False  # a request was placed here since the last plan: one may join it
        self.to_free: list[int] = []  # seq ids the worker may drop: the next plan's `freed`
        self.finished: list[FinishedRequest] = []  # see pop_finished
        self.num_preemptions = 0
        self.num_steps = 0
        self.plan_wait = 0.0  # seconds the worker reported waiting for plans: where this scheduler kept it waiting

    @property
    def worker_id(self) -> str:
        return self.reg.worker_id

    @property
    def requests(self) -> list[RequestState]:
        return self.running + self.preempted + self.waiting

    @property
    def num_running_seqs(self) -> int:
        # (Admission counts them every step while requests wait: a walk in C rather than a generator's.)
        return sum(map(len, map(SEQS, self.running)))

    def stats(self) -> WorkerStats:
        kv, pool = self.kv, self.kv.pool
        tally = self.drafting.tally
        return WorkerStats(self.worker_id, pool.num_usable, pool.num_free, self.num_running_seqs, pool.prefix_queries,
                           pool.prefix_hits, pool.num_shared, self.num_steps, kv.num_forks, kv.num_copies,
                           self.plan_wait, tally.drafts, tally.draft_tokens, tally.accepted_tokens,
                           list(tally.accepted_at))

    def snapshot(self) -> WorkerView:
        kv, pool, swap = self.kv, self.kv.pool, self.kv.swap_pool
        running = [RequestBlocks(rs.rid, [b for seq in rs.seqs for b in kv.block_ids(seq.seq_id)], len(rs.seqs) > 1)
                   for rs in self.running]
        return WorkerView(len(pool.blocks), pool.num_usable < len(pool.blocks),
                          [b.block_id for b in pool.cached.values()], running,
                          swap.num_usable if swap else 0, swap.num_free if swap else 0)

    def enqueue(self, rs: RequestState) -> None:
        rs.status = Status.WAITING
        rs.worker_id = self.worker_id
        rs.ends_on = rs.req.params.stop_tokens(self.reg.eos_token_ids)
        rs.ends_at = min(rs.req.params.max_tokens, self.reg.max_model_len - rs.prompt_len)
        bisect.insort(self.waiting, rs, key=ORDER)
        self.arrived = True

    # ---- one step -------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> StepPlan | None:
        """The worker's next step, or None: nothing to do, or no plan may be sent now (`now`: the caller's clock,
        by which a lookahead falls due; without one it is planned at once)."""
        steps = self._steps_in_flight()
        if not self.pacing.may_plan(steps, self._drafting(), now):
            return self._join() if self.arrived and self.pacing.may_join(steps, now) else None
        self.arrived = False
        step = StepBuilder(StepPlan(self.worker_id, self.epoch, next(self.ids.steps)),
                           self.settings.max_num_batched_tokens, self.settings.max_num_seqs)
        if self.drafting.max_batch:  # (counting the running sequences walks every running request)
            self.drafting.begin_step(self.num_running_seqs)
        if self.running and not self._make_room(step):
            return None  # the room waits for the plans in flight: no plan behind them keeps the head out longer
        lane = not self.drafting.max_draft  # (a draft goes with a decode token: the general path offers it)
        running, i = list(self.running), 0
        while i < len(running) and not (step.full or step.blocked):
            if lane:
                i = self._decode_alone(running, i, step)
                if i == len(running) or step.full:
                    break
            rs = running[i]
            if rs.status is Status.RUNNING:  # (one a request before it preempted in this step is running no more)
                self._schedule_running(rs, step)
            i += 1
        # After a preemption, admitting would only preempt again, unless nothing is left running.
        if not step.blocked and (not step.preempted or not self.running) and (self.waiting or self.preempted):
            self._admit_all(step)
        plan = step.plan
        if not (step.chunks or plan.swap_out or plan.swap_in or plan.copies):
            return None
        plan.freed, self.to_free = self.to_free, []
        ahead = self.pacing.planned(now, steps > 0)
        drafting = not lane and any(c.num_draft for c in step.chunks)
        self.in_flight.append(InFlight(plan.step_id, step.chunks, drafting, ahead))
        self.num_steps += 1
        return plan

    def lookahead_due(self) -> float | None:
        """When the pacing lets the next plan be made, if only the clock holds it back (None: not by the clock)."""
        return self.pacing.due(self._steps_in_flight(), self._drafting())

    def _steps_in_flight(self) -> int:
        return sum(not flight.joins for flight in self.in_flight)  # (a few plans at most)

    def _drafting(self) -> bool:
        return bool(self.in_flight) and self.in_flight[-1].drafting

    def _join(self) -> StepPlan | None:
        """A plan of the requests that came since the lookahead went out, admitted (making room as any plan does, by
        recompute) within what the lookahead leaves of the step's budget and cap: the worker runs the two as one step
        if it has not begun the lookahead (the sequences this plan frees leave it first), else one after the other.
        None when none is admitted; no swapped request comes back in a join (its blocks would move)."""
        self.arrived = False
        if any(rs.status is Status.SWAPPED for rs in self.preempted):
            return None
        step = StepBuilder(StepPlan(self.worker_id, self.epoch, next(self.ids.steps), joins=True), 0, 0)
        if not self._make_room(step):
            return None
        tokens = seqs = 0
        running = Status.RUNNING
        for flight in itertools.islice(self.in_flight, 1, None):  # what runs beside it: the lookahead, joins
            for c in flight.chunks:
                if type(c) is DecodeRun:
                    n = sum(rs.status is running and seq in rs.seqs for rs, seq in zip(c.requests, c.seqs))
                    tokens, seqs = tokens + n, seqs + n
                elif c.rs.status is running and c.seq in c.rs.seqs:
                    tokens, seqs = tokens + c.num_new + c.num_draft, seqs + 1
        step.budget = max(0, self.settings.max_num_batched_tokens - tokens)
        step.seqs_left = max(0, self.settings.max_num_seqs - seqs)
        self._admit_all(step)
        if not step.chunks:
            return None
        plan = step.plan
        plan.freed, self.to_free = self.to_free, []
        self.in_flight.append(InFlight(plan.step_id, step.chunks, self.in_flight[-1].drafting, joins=True))
        self.num_steps += 1
        return plan

    def _schedule_running(self, rs: RequestState, step: StepBuilder, admitting: bool = False) -> None:
        """Schedule the request's next chunks; while the cache has no room for them, preempt the latest-
        arrived running request (while `admitting`, run those of its samples that fit)."""
        rs.group.prepare(self, rs)
        chunks = self._chunks(rs, step)
        while chunks:
            slots = self.kv.allocate_slots(Growth(writes=_writes(chunks)))
            if slots is not None:
                self._add(rs, chunks, slots, step)
                return
            if any(c.num_draft for c in chunks):  # a draft is worth no preemption: its room is asked for first
                chunks = [c._replace(num_draft=0) for c in chunks]
                continue
            if not admitting and not self.pacing.may_make_room(self._steps_in_flight()):
                step.blocked = True
                return
            if admitting or len(self.running) == 1:
                if len(chunks) > 1:
                    chunks.pop()
                    continue
                if not admitting:  # alone, it holds every used block and still needs more
                    self.finish(rs, "length", beams=rs.group.cut_short(rs))
                return
            victim = self.running[-1]
            self._preempt(victim, step)
            step.preempted = True
            if victim is rs:
                return

    def _decode_alone(self, running: list[RequestState], i: int, step: StepBuilder) -> int:
        """What most running requests take in most steps, planned without the general path's objects (the plan's
        `decodes`, shared/protocol.py): from `running[i]` on, each request's one sampled sequence's next decode token,
        written into the block it writes already or one new block, with nothing else to send (no table resent, no
        tokens appended; no draft: the caller asks only when none may be offered), until the step is full or a request
        needs more; the index of that one, which `_schedule_running` plans. Both plan alike
        (tests/test_scheduler_core.py compares them). It runs for every sequence in every step: written out, on
        locals."""
        run, decodes = DecodeRun(), step.plan.decodes
        add_request, add_seq, add_start = run.requests.append, run.seqs.append, run.starts.append
        add_id, add_computed = decodes.seq_ids.append, decodes.num_computed_tokens.append
        grow_by_one = self.kv.grow_by_one
        block_size = self.kv.block_size
        budget, seqs_left = step.budget, step.seqs_left
        while i < len(running) and budget and seqs_left:
            rs = running[i]
            if rs.status is not Status.RUNNING:  # a request before it preempted it in this step
                i += 1
                continue
            seqs, group = rs.seqs, rs.group
            if len(seqs) != 1 or group.fork_at is not None or not group.samples_tokens:
                break
            seq = seqs[0]
            if not seq.sent or seq.resend_table:  # (no `appended` to look at: only beams are given tokens)
                break
            start = seq.num_computed
            if start < rs.prompt_len or rs.target(seq) != start + 1:
                break  # a prompt's chunk, or nothing to compute before its token in flight comes back
            # Mid-block, the block it writes is its own: only full blocks are shared (prefix hits), but for a fork's
            # last one, and a lone sequence has no fork beside it.
            if not start % block_size:
                new_block_ids = grow_by_one(seq.seq_id, start)
                if new_block_ids is None:
                    break
                if new_block_ids:
                    decodes.growing.append(len(decodes.seq_ids))
                    decodes.new_block_ids += new_block_ids
            if not (start + 1) % block_size or seq.fork_of is not None:
                run.commits.append(len(run.seqs))
            add_id(seq.seq_id)
            add_computed(start)
            seq.num_computed = start + 1
            seq.num_placeholders += 1
            add_request(rs)
            add_seq(seq)
            add_start(start)
            budget -= 1
            seqs_left -= 1
            i += 1
        if run.seqs:
            step.chunks.append(run)
            step.budget, step.seqs_left = budget, seqs_left
            for tenant, num_decodes in Counter(map(TENANT, run.requests)).items():  # (a few tenants: a charge each)
                self.ledger.charge(tenant, 0, num_decodes)
        return i

    def _chunks(self, rs: RequestState, step: StepBuilder) -> list[Chunk]:
        """The request's next chunks, as its group takes them, within what is left of the budget and the cap; a
        decode token may be followed by draft tokens (scheduler/speculation.py)."""
        chunks = rs.group.chunks(rs, step.budget, step.seqs_left)
        if not self.drafting.max_draft or not rs.group.samples_tokens:
            return chunks
        budget = step.budget - sum(c.num_new for c in chunks)
        for i, c in enumerate(chunks):
            if c.emits_token and c.num_new == 1 and budget:
                k = self.drafting.offer(rs, c.seq, budget)
                if k:
                    chunks[i] = c._replace(num_draft=k)
                    budget -= k
        return chunks

    def _add(self, rs: RequestState, chunks: list[Chunk], slots: Slots, step: StepBuilder) -> None:
        """Put the chunks, on the blocks `slots` granted them, into the plan."""
        plan = step.plan
        plan.copies.extend(slots.copies)
        prompt_len, prefill, computed = rs.prompt_len, 0, 0
        for seq, num_new, emits, num_draft in chunks:
            start = seq.num_computed
            if start < prompt_len:
                prefill += min(num_new, prompt_len - start)
            computed += num_new + num_draft
            if not seq.sent:
                parent = seq.fork_of  # while it lives on the worker, the prompt comes from there
                if parent is not None and not (parent.sent and parent in rs.seqs):
                    parent = None
                plan.new_sequences.append(NewSequence(
                    seq.seq_id, rs.rid, seq.sample_index, list(rs.prompt) if parent is None else [],
                    list(rs.outputs[seq.sample_index]), rs.req.params, None if parent is None else parent.seq_id))
                seq.sent = True
                seq.appended = []  # in its outputs already
                item = ScheduledSequence(seq.seq_id, start, num_new, self.kv.block_ids(seq.seq_id))
            elif seq.resend_table or seq.seq_id in slots.rewritten:
                item = ScheduledSequence(seq.seq_id, start, num_new, [], self.kv.block_ids(seq.seq_id))
            else:
                item = ScheduledSequence(seq.seq_id, start, num_new, slots.new_block_ids[seq.seq_id])
            if seq.appended:
                item.append_token_ids, seq.appended = seq.appended, []
            item.num_draft_tokens = num_draft
            seq.resend_table = False
            plan.scheduled.append(item)
            seq.num_computed += num_new
            seq.num_placeholders += emits
            step.chunks.append(Scheduled(rs, seq, start, num_new, emits, num_draft))
            step.budget -= num_new + num_draft
            step.seqs_left -= 1
        self.ledger.charge(rs.tenant, prefill, computed - prefill)

    def fork(self, parent: SeqState, sample_index: int, num_tokens: int) -> SeqState:
        """A new sequence for the sample, sharing the parent's blocks of its first `num_tokens` (copy-on-write on
        its first write into one)."""
        child = SeqState(next(self.ids.seqs), sample_index, num_computed=num_tokens, fork_of=parent)
        self.kv.fork(parent.seq_id, child.seq_id, num_tokens)
        return child

    def _preempt(self, rs: RequestState, step: StepBuilder) -> None:
        step.victims.append(rs)
        self.running.remove(rs)
        self.unseat(rs)
        self.num_preemptions += 1
        seq_ids = [s.seq_id for s in rs.seqs]
        if self.settings.preemption_mode == "swap" and self.kv.can_swap_out(seq_ids):
            step.plan.swap_out.extend(self.kv.swap_out(seq_ids))
            for seq in rs.seqs:
                seq.resend_table = True
            rs.status = Status.SWAPPED
        else:
            self._release(rs)
            rs.status = Status.PREEMPTED
            rs.held_until = self.in_flight[-1].step_id if self.in_flight else -1
        bisect.insort(self.preempted, rs, key=ORDER)

    def _release(self, rs: RequestState) -> None:
        """Free every block of the request's sequences, and the worker's state of those it knows."""
        for seq in rs.seqs:
            self.drop(seq)
        rs.seqs = []
        rs.group.released()

    def drop(self, seq: SeqState) -> None:
        """Free the sequence's blocks, and the worker's state of it if it knows it."""
        self.kv.free(seq.seq_id)
        if seq.sent:
            self.to_free.append(seq.seq_id)

    # ---- admission ------------------------------------------------------------------------
    def _admit_all(self, step: StepBuilder) -> None:
        """Admit preempted and waiting requests in the policy's order until one does not fit. One preempted in this
        step waits for the next (back at once, it would undo that; a lookahead's victim has its token in flight still),
        unless nothing would run then: with no plan in flight, the worker takes it back rather than idle."""
        if len(self.running) >= self.settings.max_num_seqs:
            return  # every running request holds a sequence at least: none fits (nor, below, does any victim)
        step.running_seqs = self.num_running_seqs
        self._admit_in_order(step, passed_over=step.victims)
        if step.victims and not self.running and not self.in_flight:
            self._admit_in_order(step, passed_over=[])

    def _admit_in_order(self, step: StepBuilder, passed_over: list[RequestState]) -> None:
        for rs in self.policy.order(self):
            if step.full:
                return
            if rs in passed_over or not self._may_seat(rs):
                continue  # (or its tenant runs its most sequences, or its tokens are in flight: the others go on)
            if not (self._swap_in(rs, step) if rs.status is Status.SWAPPED else self._admit(rs, step)):
                return
            (self.preempted if rs in self.preempted else self.waiting).remove(rs)

    def _make_room(self, step: StepBuilder) -> bool:
        """While the first requests to admit do not fit beside the running ones and each other (the sequence cap, or
        the blocks their first chunks and the running ones' next tokens take), preempt the running request the policy
        names for each in turn, for as many as the policy makes room for in a step. False when the pacing does not let
        this step preempt: a lookahead planned now would hold the head out one step more."""
        heads = (rs for rs in self.policy.order(self) if self._may_seat(rs))
        room = self._room()
        for head in itertools.islice(heads, self.policy.heads_per_step):
            while self.running and not self._fits(head, room):
                victim = self.policy.victim(self, head)
                if victim is None:
                    return True
                if not (self._may_preempt_in_flight(victim) or
                        (not step.plan.joins and self.pacing.may_make_room(self._steps_in_flight()))):
                    return False
                if victim.rank < head.rank:  # (fair: a share, not the rank, named it) it goes behind the head, or the
                    # cache's growth, which preempts the last-ranked, could take the head's seat back, and so on
                    victim.rank = (victim.rank[0], next(self.ids.ranks))
                self._preempt(victim, step)
                room = self._room()
            room.seqs -= len(head.live_samples)
            room.blocks -= self._blocks_to_admit(head)
        return True

    def _may_seat(self, rs: RequestState) -> bool:
        """Whether the request may be admitted now: its tenant runs fewer than its most sequences, and no plan in
        flight samples tokens of it (a victim of a join: the lookahead it joined does)."""
        return (not self.in_flight or rs.held_until < self.in_flight[0].step_id) and \
            self.ledger.may_seat(rs.req.tenant, len(rs.live_samples))

    def _may_preempt_in_flight(self, victim: RequestState) -> bool:
        """Whether the victim can leave while a step computes its tokens: by recompute, as its sampled tokens then
        only add to its outputs (a swap would move blocks the step writes; a beam's candidates need its search)."""
        return self.settings.preemption_mode == "recompute" and victim.group.samples_tokens

    def _room(self) -> Room:
        settings, kv = self.settings, self.kv
        if len(self.running) >= settings.max_num_seqs:  # every running request holds a sequence at least: a full
            return Room(0, 0)  # worker is told without counting them
        growing = sum(1 for r in self.running for s in r.seqs if s.num_computed % kv.block_size == 0)
        return Room(settings.max_num_seqs - self.num_running_seqs, kv.num_free - self._keep_free() - growing)

    def _fits(self, rs: RequestState, room: Room) -> bool:
        return len(rs.live_samples) <= room.seqs and self._blocks_to_admit(rs) <= room.blocks

    def _blocks_to_admit(self, rs: RequestState) -> int:
        """The blocks the request takes to be admitted: its first chunk's (no prefix hit counted), or its swapped
        blocks."""
        if rs.status is Status.SWAPPED:
            return self.kv.swap_in_blocks([s.seq_id for s in rs.seqs])
        return self.kv.num_blocks_for(min(rs.longest, self.settings.max_num_batched_tokens)) + len(rs.live_samples) - 1

    def _room_for(self, step: StepBuilder, num_seqs: int) -> bool:
        """The sequence cap; an idle worker takes anything, so that nothing waits forever."""
        return not self.running or step.running_seqs + num_seqs <= self.settings.max_num_seqs

    def _keep_free(self) -> int:
        """Blocks admission leaves free for running requests to grow into (none on an idle worker)."""
        return int(self.settings.watermark * self.kv.pool.num_usable) if self.running else 0

    def _admit(self, rs: RequestState, step: StepBuilder) -> bool:
        """Start a waiting or recompute-preempted request: prompt + output so far, on its prefix hits."""
        if not self._room_for(step, len(rs.live_samples)) or not self.reservation.admits(self, rs, self._keep_free()):
            return False
        start = rs.group.start(rs)
        prompt_hashes = self._prompt_hashes(rs)
        opens = []
        seqs: list[SeqState] = []
        chunks: list[Chunk] = []
        budget, seqs_left = step.budget, step.seqs_left
        for i in start.samples:
            tokens = rs.tokens(i)
            end = len(tokens) if start.shared_end is None else start.shared_end
            hashes = self.kv.hash_tokens(tokens, prompt_hashes, rs.root) if rs.outputs[i] else prompt_hashes
            # The prompt logprobs asked for come from computing every prompt position: no prefix hit then.
            fresh = rs.req.params.prompt_logprobs is not None and not rs.outputs[i]
            hits = [] if fresh else self.kv.find_prefix(hashes, end + (start.shared_end is not None))
            seq = SeqState(next(self.ids.seqs), i, num_computed=len(hits) * self.kv.block_size)
            seqs.append(seq)
            opens.append(Opening(seq.seq_id, hits, hashes, len(tokens)))
            num_new = min(end - seq.num_computed, budget) if seqs_left else 0
            if num_new > 0:
                chunks.append(Chunk(seq, num_new, seq.num_computed + num_new == len(tokens) and start.samples_tokens))
                budget -= num_new
                seqs_left -= 1
        slots = self.kv.allocate_slots(Growth(opens, (), _writes(chunks)), self._keep_free())
        if slots is None:
            return False
        if rs.queued:
            rs.queued = False
            self.ledger.admitted(rs.req)
        rs.seqs = seqs
        self._start_running(rs, step, chunks, slots)
        self.reservation.started(self, rs)
        return True

    def _swap_in(self, rs: RequestState, step: StepBuilder) -> bool:
        """Bring a swapped request back, with room for its next chunks too (or it would be the next victim);
        on an idle worker it takes what fits."""
        if not self._room_for(step, len(rs.seqs)):
            return False
        chunks = self._chunks(rs, step) if self.running else []
        slots = self.kv.allocate_slots(Growth(swap_in=[s.seq_id for s in rs.seqs], writes=_writes(chunks)),
                                       self._keep_free())
        if slots is None:
            return False
        step.plan.swap_in.extend(slots.swap_in)
        self._start_running(rs, step, chunks, slots)
        return True

    def _start_running(self, rs: RequestState, step: StepBuilder, chunks: list[Chunk], slots: Slots) -> None:
        rs.status = Status.RUNNING
        bisect.insort(self.running, rs, key=ORDER)
        self._seat(rs, len(rs.live_samples))
        step.running_seqs += rs.seats
        if chunks:
            self._add(rs, chunks, slots, step)
        else:  # nothing granted yet: forking at once, or swapped in alone
            self._schedule_running(rs, step, admitting=True)

    def _prompt_hashes(self, rs: RequestState) -> list[bytes]:
        hashes = rs.prompt_hashes.get(self.kv.extra)
        if hashes is None:
            hashes = rs.prompt_hashes[self.kv.extra] = self.kv.hash_tokens(rs.prompt, root=rs.root)
        return hashes

    def uncached_prompt(self, rs: RequestState) -> int:
        """Prompt tokens this worker would have to compute for the request (no prefix hit)."""
        hits = self.kv.find_prefix(self._prompt_hashes(rs), rs.prompt_len)
        return rs.prompt_len - len(hits) * self.kv.block_size

    # ---- results --------------------------------------------------------------------------
    def apply_result(self, result: StepResult, now: float | None = None) -> None:
        """Take the result of the oldest plan in flight (results come back in plan order; `now`: when it came, on
        the clock `schedule` is given)."""
        if not self.in_flight or result.epoch != self.epoch or result.step_id != self.in_flight[0].step_id:
            return
        flight = self.in_flight.popleft()
        chunks = flight.chunks
        self.plan_wait += result.waited
        if not flight.joins:  # (a worker also waits for a plan sent to it idle, from before it was planned: no lead)
            self.pacing.step_ended(now, result.waited if flight.ahead else 0.0, self._steps_in_flight() > 0)
        if result.error is not None:
            for rs in {id(rs): rs for rs in flight.requests()}.values():
                if rs.status in LIVE:
                    self.finish(rs, "error", f"worker {self.worker_id} failed the step: {result.error}", FAILED)
            return
        for refused in result.refused:  # the worker could not run this request's sequences: before any block of
            # theirs is indexed, as the worker computed none
            rs = next((rs for rs in flight.requests() if rs.rid == refused.rid), None)
            if rs is not None and rs.status in LIVE:
                self.finish(rs, "error", refused.error, FAILED)
        emitting, reporting = self._sort_and_commit(chunks)
        received, missing = self._take_tokens(chunks, emitting, result)
        if self.drafting.max_draft:
            self._drafts_checked(chunks, result, received)
        for beams in result.beams:
            c = reporting.pop(beams.seq_id, None)
            if c is not None and c.rs.status is Status.RUNNING:
                c.rs.group.candidates(self, c.rs, c.seq, beams.top)
        for c in [*missing, *reporting.values()]:
            # The worker samples every sequence a plan asks it to and skips only those it saw end, as the
            # scheduler does: a token missing here means the two disagree, and sampling again could loop.
            if c.rs.status in LIVE:
                self.finish(c.rs, "error", f"worker {self.worker_id} returned no token for sample "
                                           f"{c.seq.sample_index} in step {result.step_id}", FAILED)

    def _sort_and_commit(self, chunks: list[Scheduled | DecodeRun]) -> tuple[dict[int, Scheduled],
                                                                              dict[int, Scheduled]]:
        """Index the blocks the step's chunks filled (a decode run's, where its plan noted one: `commits`); and sort
        out the general path's chunks that reached their sequence's end, by sequence id: those that sample a token, and
        those that report a beam's candidates. (It runs every step: written out, on locals.)"""
        emitting: dict[int, Scheduled] = {}
        reporting: dict[int, Scheduled] = {}
        commit, block_size, drafting = self.kv.commit, self.kv.block_size, self.drafting.max_draft
        running = Status.RUNNING
        for c in chunks:
            if type(c) is DecodeRun:
                for k in c.commits:
                    rs, seq = c.requests[k], c.seqs[k]
                    if rs.status is running and seq in rs.seqs:
                        commit(seq.seq_id, rs.prompt, rs.outputs[seq.sample_index], c.starts[k] + 1, rs.root)
                continue
            rs, seq = c.rs, c.seq
            if rs.status is not running or seq not in rs.seqs:
                if c.emits_token and rs.status is Status.PREEMPTED:
                    emitting[seq.seq_id] = c  # preempted while in flight: its token alone counts
                continue  # else aborted, or its sample ended, while in flight
            end = c.start + c.num_new
            # The prefix index has every full block before a chunk's start, as the results before it committed them,
            # except a fork's (its parent's tokens may have been in flight) or after a draft's rejected tokens.
            if end // block_size != c.start // block_size or seq.fork_of is not None or drafting:
                commit(seq.seq_id, rs.prompt, rs.outputs[seq.sample_index], end, rs.root)
            if c.emits_token:
                emitting[seq.seq_id] = c
            elif rs.group.reports(rs, seq, end):
                reporting[seq.seq_id] = c
        return emitting, reporting

    def _take_tokens(self, chunks: list[Scheduled | DecodeRun], emitting: dict[int, Scheduled],
                     result: StepResult) -> tuple[dict[int, int], list[Scheduled]]:
        """Give each chunk that sampled its tokens, in the order the scheduler planned them (its worker samples a
        plan's `decodes` first): a token counts if its sequence runs on, or if its request was preempted while it was
        in flight (none comes where a join freed it before its step ran). Returns how many each sequence took, and the
        chunks whose token did not come. (It runs for every sequence in every step: written out, on locals.)"""
        drafting = self.drafting.max_draft
        sampled: dict[int, list[int]] | dict[int, int]
        if drafting:  # a sequence that checked a draft emits several
            sampled = {}
            for seq_id, token_id in zip(result.seq_ids, result.token_ids):
                sampled.setdefault(seq_id, []).append(token_id)
        else:  # (a sequence named twice, by a faulty worker: its first token, as the drafting path takes)
            sampled = dict(zip(reversed(result.seq_ids), reversed(result.token_ids)))
        received: dict[int, int] = {}
        missing: list[Scheduled] = []
        running, preempted = Status.RUNNING, Status.PREEMPTED
        for c in chunks:
            if type(c) is DecodeRun:
                for rs, seq, start in zip(c.requests, c.seqs, c.starts):
                    status = rs.status
                    if status is preempted or (status is running and seq in rs.seqs):
                        token_id = sampled.get(seq.seq_id)
                        if token_id is None:
                            if status is running:
                                missing.append(Scheduled(rs, seq, start, 1, True))
                            continue
                        seq.num_placeholders -= 1
                        rs.group.token(self, rs, seq, token_id)
                continue
            seq_id = c.seq.seq_id
            if emitting.get(seq_id) is not c:
                continue
            tokens = sampled.get(seq_id)
            if tokens is None:
                if c.rs.status is running:
                    missing.append(c)
                continue
            rs, seq = c.rs, c.seq
            for n, token_id in enumerate(tokens if drafting else (tokens,)):
                if n > c.num_draft or not (rs.status is preempted or (rs.status is running and seq in rs.seqs)):
                    break  # more tokens than its draft allows, or its sample ended on the one before
                received[seq_id] = n + 1
                if not n:
                    seq.num_placeholders -= 1
                rs.group.token(self, rs, seq, token_id)
        return received, missing

    def _drafts_checked(self, chunks: list[Scheduled | DecodeRun], result: StepResult,
                        received: dict[int, int]) -> None:
        """A drafting sequence's accepted tokens have their KV computed: it counts them, commits the blocks they
        fill and gives back the blocks only its rejected tokens took (its next plan sends the worker its whole
        table). Each sequence that ran learns the draft its worker holds for its next step. (A plan that may draft
        has no decode run: `schedule` takes the fast lane only where no draft may be offered.)"""
        reports = {r.seq_id: r for r in result.drafts}
        for c in chunks:
            seq, rs = c.seq, c.rs
            if not c.emits_token or rs.status is not Status.RUNNING or seq not in rs.seqs:
                continue
            self.drafting.reported(seq, reports.get(seq.seq_id))
            accepted = received.get(seq.seq_id, 1) - 1
            if not c.num_draft:
                continue
            seq.num_computed += accepted
            output = rs.outputs[seq.sample_index]
            self.kv.commit(seq.seq_id, rs.prompt, output, seq.num_computed, rs.root)
            if self.kv.truncate(seq.seq_id, rs.prompt_len + len(output)):
                seq.resend_table = True

    # ---- ending ---------------------------------------------------------------------------
    def finish(self, rs: RequestState, reason: str, error: str | None = None, error_kind: str | None = None,
               beams: list[Hypothesis] | None = None, retry_after: float | None = None) -> None:
        """Finish the request here: free its blocks at once; pop_finished reports it."""
        if rs.status is Status.FINISHED:
            return
        self._release(rs)
        self.unseat(rs)
        for queue in (self.running, self.preempted, self.waiting):
            if rs in queue:
                queue.remove(rs)
        rs.status = Status.FINISHED
        self.finished.append(FinishedRequest(rs.rid, reason, error, error_kind, beams, retry_after))

    def reseat(self, rs: RequestState) -> None:
        """A running request's sample ended: its tenant counts the samples that go on."""
        if rs.seats:
            self._seat(rs, len(rs.live_samples))

    def unseat(self, rs: RequestState) -> None:
        """The request no longer runs here: its tenant's running sequences go down by those it counted."""
        if rs.seats:
            self._seat(rs, 0)

    def _seat(self, rs: RequestState, num_seqs: int) -> None:
        """The request's tenant counts `num_seqs` running sequences for it: its count and the ledger's move together."""
        self.ledger.seated(rs.tenant, num_seqs - rs.seats)
        rs.seats = num_seqs

    def pop_finished(self) -> list[FinishedRequest]:
        """Requests that ended here and that no plan in flight carries any more: the worker writes the tokens
        of a plan it runs, and none may follow the request's end on its stream."""
        if not self.finished:
            return []
        carried = {rs.rid for flight in self.in_flight for rs in flight.requests()}
        done = [f for f in self.finished if f.rid not in carried]
        self.finished = [f for f in self.finished if f.rid in carried]
        return done


# How a cluster makes each worker's scheduler: WorkerScheduler itself, or one given another reservation.
WorkerSchedulerFactory = Callable[[WorkerRegistration, Settings, int, Ids, Ledger], WorkerScheduler]


def _writes(chunks: list[Chunk]) -> list[Write]:
    return [Write(c.seq.seq_id, c.seq.num_computed, c.num_new + c.num_draft) for c in chunks]
