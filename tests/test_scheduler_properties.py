"""Property test of the scheduler core: random interleavings of arrivals, steps, results, aborts and
worker loss, with tiny block pools so that prefix hits, copy-on-write, preemption (both modes) and
rejection all happen, under each scheduling policy. Plans run on SimWorker, whose shadow cache checks every
position a step reads.
"""
from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sched_sim import SimWorker
from scheduler.kv_cache_manager import hash_full_blocks
from scheduler.request import Status
from benchmarks.baselines import reserving_scheduler
from scheduler.cluster import Cluster
from shared.protocol import Request, WorkerRegistration
from shared.sampling import SamplingParams
from shared.settings import Settings
from shared.tenants import Tenant

BS = 8
EOS = 1
VOCAB = [2, 3, 4, 5]  # few distinct ids: prompts and generated blocks collide, so prefixes are shared
PREFIXES = [[], [2] * 8, [2, 3, 4, 5] * 4]
SPECULATION = '{"method": "ngram", "num_speculative_tokens": 3}'
MAX_DRAIN_STEPS = 5000  # rounds; slow configurations (one sequence a step) need several hundred

worker_spec = st.tuples(st.integers(4, 10), st.integers(0, 20), st.integers(24, 80))
request_spec = st.tuples(st.sampled_from(PREFIXES), st.lists(st.sampled_from(VOCAB), min_size=1, max_size=24),
                         st.integers(1, 3), st.integers(1, 16), st.booleans(), st.sampled_from([[], [5]]),
                         st.sampled_from([0, 0, 2, 3]),  # beam width (0: sampling)
                         st.integers(0, 2))  # priority, and of two tenants which (by its parity)
TENANTS = (Tenant("even"), Tenant("odd", weight=2.0))


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        budget=st.sampled_from([8, 16, 64]),
        max_seqs=st.sampled_from([1, 2, 4, 8]),
        mode=st.sampled_from(["recompute", "swap"]),
        policy=st.sampled_from(["fcfs", "priority", "fair"]),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]),
        reservation=st.sampled_from(["paged", "paged", "max_model_len"]),
        lookahead=st.booleans(),
        speculation=st.booleans(),
        specs=st.lists(worker_spec, min_size=1, max_size=2),
    )
    def setup(self, budget, max_seqs, mode, policy, caching, watermark, reservation, lookahead, speculation, specs):
        settings = Settings(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs, preemption_mode=mode,
                            scheduling_policy=policy,
                            enable_prefix_caching=caching, watermark=watermark, async_scheduling=lookahead,
                            speculative_config=SPECULATION if speculation else "")
        # the benchmarks' contiguous-reservation baseline runs on the same core: check it too
        self.sched = Cluster(settings, epoch=7,
                             worker_scheduler=reserving_scheduler() if reservation == "max_model_len" else None)
        self.sims: dict[str, SimWorker] = {}
        # worker → results of the plans it has run, oldest first, not yet applied: the plans in flight
        self.pending: dict[str, list] = {}
        self.requests: dict[str, Request] = {}
        self.record: dict[str, list[list[int]]] = {}
        self.aborted: set[str] = set()
        self.ended: dict[str, str] = {}
        self.roots: set[bytes] = set()  # where each tenant's chain of block hashes starts
        self.ids = itertools.count()
        self.draw_token = lambda: VOCAB[0]
        self.draw_count = lambda n: n  # drafts: a count in 0..n, drawn per step like the tokens
        for spec in specs:
            self._add_worker(spec)

    def _add_worker(self, spec) -> None:
        num_blocks, num_swap, max_len = spec
        reg = WorkerRegistration(f"w{next(self.ids)}", "model", num_blocks, num_swap, BS, max_len, [EOS])
        self.sims[reg.worker_id] = SimWorker(reg, lambda rid, sample, index: self.draw_token(),
                                             lambda n: self.draw_count(n) if self.sched.settings.speculation else 0)
        self.sched.add_worker(reg)

    def _worker(self, index: int) -> str:
        ids = self.sched.worker_ids
        return ids[index % len(ids)]

    # ---- rules ----------------------------------------------------------------------------
    @rule(batch=st.lists(request_spec, min_size=1, max_size=4))
    def arrive(self, batch):
        for prefix, suffix, n, max_tokens, ignore_eos, stop, width, priority in batch:
            rid = f"r{next(self.ids)}"
            params = SamplingParams(n=min(n, width or n), max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    stop_token_ids=stop, beam_width=width)
            req = Request(rid, "model", prefix + suffix, params, 0.0, tenant=TENANTS[priority % 2], priority=priority)
            self.requests[rid] = req
            if not width:  # (beams are reordered every step: their tokens are checked at the end)
                self.record[rid] = [[] for _ in range(n)]
            self.sched.add_request(req)
            if rid in self.sched.requests:
                self.roots.add(self.sched.requests[rid].root)

    @rule(data=st.data(), index=st.integers(0, 1))
    def step(self, data, index):
        wid = self._worker(index)
        preemptions = self.sched.num_preemptions
        plan = self.sched.schedule(wid)
        in_flight = len(self.pending.get(wid, ()))
        if in_flight and (in_flight > 1 or not self.sched.settings.async_scheduling):
            assert plan is None, "at most two plans in flight, and one without async scheduling"
            return
        if plan is None:
            return
        ws = self.sched.workers[wid]
        for sched in plan.sequences():
            table = ws.kv.seqs[sched.seq_id].table
            written = sched.num_computed_tokens + sched.num_new_tokens + sched.num_draft_tokens
            first, end = sched.num_computed_tokens // BS, -(-written // BS)
            assert all(b.ref_cnt == 1 for b in table[first:end]), "a write into a shared block"
        for new in plan.new_sequences:
            req = self.requests[new.rid]
            assert new.prompt_token_ids == req.prompt_token_ids or new.fork_of is not None
            if new.rid in self.record:
                assert new.output_token_ids == self.record[new.rid][new.sample_index], "generated tokens are kept"
        event(f"plan: copies={bool(plan.copies)} swap_out={bool(plan.swap_out)} swap_in={bool(plan.swap_in)}")
        event(f"plan: lookahead={in_flight > 0}")
        event(f"plan: lookahead preempts={in_flight > 0 and self.sched.num_preemptions > preemptions}")
        event(f"plan: drafts={any(s.num_draft_tokens for s in plan.sequences())}")
        self.draw_token = lambda: data.draw(st.sampled_from([EOS] + VOCAB), label="token")
        self.draw_count = lambda n: data.draw(st.integers(0, n), label="draft count")
        self.pending.setdefault(wid, []).append(self.sims[wid].execute(plan))

    @rule(data=st.data(), steps=st.integers(1, 8))
    def run(self, data, steps):
        """Several steps on every worker, so that requests progress: plan as the service does (a step and,
        with async scheduling, its lookahead), then take the oldest result."""
        for _ in range(steps):
            for index in range(len(self.sched.worker_ids)):
                wid = self._worker(index)
                self.step(data, index)
                self.step(data, index)
                self._apply_oldest(wid)

    @rule(index=st.integers(0, 1))
    def result(self, index):
        busy = sorted(w for w, results in self.pending.items() if results)
        if busy:
            self._apply_oldest(busy[index % len(busy)])

    def _apply_oldest(self, wid: str) -> None:
        if self.pending.get(wid):
            self._apply(self.pending[wid].pop(0))

    def _apply(self, outcome) -> None:
        result = outcome.result
        before = {out.rid: self.sched.requests.get(out.rid) for out in outcome.outputs}
        status = {rid: rs.status for rid, rs in before.items() if rs is not None}
        self.sched.apply_result(result)
        for out in outcome.outputs:
            rs = before[out.rid]
            if rs is not None and status[out.rid] is not Status.FINISHED and rs.worker_id == result.worker_id:
                assert rs.outputs[out.sample_index][out.output_index] == out.token_id, "a token was dropped"
        self._sync_outputs()

    def _sync_outputs(self) -> None:
        """Generated tokens only ever grow: preemption and worker loss keep them."""
        for rid, rs in self.sched.requests.items():
            if rid not in self.record:
                continue
            for i, out in enumerate(rs.outputs):
                assert out[:len(self.record[rid][i])] == self.record[rid][i]
                assert len(out) <= self.requests[rid].params.max_tokens
                self.record[rid][i] = list(out)

    @rule(data=st.data())
    def abort(self, data):
        live = sorted(rid for rid, rs in self.sched.requests.items() if rs.status is not Status.FINISHED)
        if not live:
            return
        rid = data.draw(st.sampled_from(live))
        self.aborted.add(rid)
        self.sched.abort(rid)

    @rule(index=st.integers(0, 1), spec=worker_spec)
    def lose_worker(self, index, spec):
        wid = self._worker(index)
        self.sched.remove_worker(wid)
        self.pending.pop(wid, None)
        del self.sims[wid]
        self._add_worker(spec)

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def blocks_are_accounted(self):
        for wid, ws in self.sched.workers.items():
            for pool, tables in ((ws.kv.pool, ws.kv.seqs), (ws.kv.swap_pool, ws.kv.swapped)):
                if pool is None:
                    assert not tables
                    continue
                holders = Counter(b.block_id for seq in tables.values() for b in seq.table)
                free = [b.block_id for b in pool.free_queue]
                assert len(free) == len(set(free)) == pool.num_free
                first = len(pool.blocks) - pool.num_usable  # the null block, if reserved
                assert all(b not in holders and b not in free for b in range(first))
                for block in pool.blocks[first:]:
                    assert block.ref_cnt == holders[block.block_id], "ref count = tables holding it"
                    assert (block.ref_cnt == 0) == block.is_free, "free xor in use"
                assert pool.num_free + len(holders) == pool.num_usable, "free + in use = total"
                assert pool.num_shared == sum(n > 1 for n in holders.values()), "shared blocks are counted"
            running = {s.seq_id for rs in ws.running for s in rs.seqs}
            swapped = {s.seq_id for rs in ws.preempted if rs.status is Status.SWAPPED for s in rs.seqs}
            assert set(ws.kv.seqs) == running and set(ws.kv.swapped) == swapped, "no table without an owner"
            assert all(not rs.seqs for rs in ws.waiting + ws.preempted if rs.status is not Status.SWAPPED)

    @invariant()
    def prefix_index_maps_identical_tokens(self):
        for wid, ws in self.sched.workers.items():
            sim = self.sims[wid]
            for block_hash, block in ws.kv.pool.cached.items():
                assert block.block_hash == block_hash
                content = sim.block_content(block.block_id)
                prefix = content[-1]
                assert prefix is not None and all(c == prefix[:len(prefix) - BS + k + 1] for k, c in enumerate(content))
                assert block_hash in {hash_full_blocks(list(prefix), BS, ws.kv.extra, root=r)[-1] for r in self.roots}

    @invariant()
    def outputs_only_grow_and_requests_end_once(self):
        self._sync_outputs()
        for done in self.sched.pop_finished():
            assert done.rid not in self.ended, "a request ends once"
            self.ended[done.rid] = done.finish_reason
            event(f"finish: {done.finish_reason}")
            if done.rid in self.aborted:
                assert done.finish_reason == "abort"
            elif done.finish_reason == "error":
                assert "KV blocks" in done.error or "max_model_len" in done.error
            else:
                assert done.finish_reason in ("stop", "length")
            params = self.requests[done.rid].params
            if params.beam_width and done.finish_reason != "error" and done.rid not in self.aborted:
                assert done.beams and len(done.beams) <= params.n, "a beam search returns its best beams"
                assert all(len(b.tokens) <= params.max_tokens for b in done.beams)
                assert [b.score for b in done.beams] == sorted((b.score for b in done.beams), reverse=True)
                event("finish: beam search")

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self.draw_token = lambda: VOCAB[0]
        self.draw_count = lambda n: n  # every draft as long as allowed, and right
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished() and not any(self.pending.values()):
                break
            planned = False
            for wid in self.sched.worker_ids:
                while self.pending.get(wid):
                    self._apply_oldest(wid)
                plan = self.sched.schedule(wid)
                if plan is not None:
                    planned = True
                    self._apply(self.sims[wid].execute(plan))
            self.blocks_are_accounted()
            self.outputs_only_grow_and_requests_end_once()
            assert planned or not self.sched.has_unfinished(), "no worker got a plan while requests wait"
        assert not self.sched.has_unfinished(), "every request ends"
        event(f"preempted: {self.sched.num_preemptions > 0}, mode {self.sched.settings.preemption_mode}")
        self.outputs_only_grow_and_requests_end_once()
        assert set(self.ended) == set(self.requests)
        for ws in self.sched.workers.values():
            assert ws.kv.pool.num_free == ws.kv.pool.num_usable, "no block is held after every request ended"
            assert ws.kv.swap_pool is None or ws.kv.swap_pool.num_free == ws.kv.swap_pool.num_usable
            assert not ws.kv.seqs and not ws.kv.swapped


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase
