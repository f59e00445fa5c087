"""The cache snapshots the dashboard draws (scheduler/snapshot.py), against the scheduler's own structures: the
block pool's LRU free queue, hash index and reference counts, the sequences' block tables, the plans sent and
the results applied. A shadow worker (tests/sched_sim.py) runs every plan and checks it, so the states are
those of a real run: shared prefixes, copy-on-write forks, preemption by swap, requests ending."""
from __future__ import annotations

import random

import pytest
from sched_sim import SimWorker

from benchmarks.token_worker import TokenWorker

from scheduler.cluster import Cluster
from scheduler.snapshot import HISTORY_INTERVAL_S, MAX_BLOCKS_PER_S, MAX_HOLDER_ENTRIES, SNAPSHOT_INTERVAL_S, CacheMonitor
from shared.protocol import (
    BLOCK_MOVING, BLOCK_STATES, CacheSnapshot, ProtocolError, Request, StepResult, WorkerRegistration,
    WorkerSnapshot, decode, encode,
)
from shared.sampling import SamplingParams
from shared.settings import Settings

BS = 16
PREFIX = list(range(100, 100 + 3 * BS))  # three full blocks every prompt shares


def pick(rid: str, sample: int, index: int) -> int:
    return 1000 + (hash((rid, sample, index)) % 500)


def registration(worker_id: str = "w0", num_blocks: int = 64, swap: int = 0, max_model_len: int = 4096) -> WorkerRegistration:
    return WorkerRegistration(worker_id, "m", num_blocks, swap, BS, max_model_len, [2], "i1")


def request(rid: str, rng: random.Random, n: int = 1, max_tokens: int = 12) -> Request:
    prompt = PREFIX + [rng.randrange(3, 90) for _ in range(rng.randrange(5, 40))]
    return Request(rid, "m", prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=1.0,
                                                    seed=1), 0.0)


class Run:
    """A cluster, its shadow workers and a monitor, stepped the way the scheduler service steps them."""

    def __init__(self, regs: list[WorkerRegistration], worker=lambda reg: SimWorker(reg, pick), **settings) -> None:
        self.cluster = Cluster(Settings(block_size=BS, async_scheduling=False, **settings))
        self.sims = {}
        for reg in regs:
            self.cluster.add_worker(reg)
            self.sims[reg.worker_id] = worker(reg)
        self.monitor = CacheMonitor()
        self.plans = []
        self.results: list[StepResult] = []

    def plan(self, worker_id: str):
        plan = self.cluster.schedule(worker_id)
        if plan is not None:
            self.monitor.planned(self.cluster, plan)
            self.plans.append(plan)
        return plan

    def finish(self, plan) -> None:
        result = self.sims[plan.worker_id].execute(plan).result
        self.results.append(result)
        self.cluster.apply_result(result)
        self.cluster.pop_finished()

    def step(self) -> None:
        for worker_id in self.cluster.worker_ids:
            plan = self.plan(worker_id)
            if plan is not None:
                self.finish(plan)


def test_a_plan_and_its_lookahead_sent_together_count_their_own_samples():
    """The service takes a worker's next plan and the lookahead behind it in one go (Cluster.plans), then tells the
    monitor of each: a prompt's first chunk samples nothing, its last chunk, planned ahead, samples one token."""
    cluster = Cluster(Settings(block_size=BS, max_num_batched_tokens=BS, async_scheduling=True))
    cluster.add_worker(registration())
    monitor = CacheMonitor()
    monitor.tick(cluster, 0.0, False)
    cluster.add_request(Request("r", "m", PREFIX[:BS + 8], SamplingParams(max_tokens=4), 0.0))
    plans = cluster.plans("w0")
    for plan in plans:
        monitor.planned(cluster, plan)
    monitor.tick(cluster, HISTORY_INTERVAL_S, False)
    h = decoded(monitor.snapshot(cluster, HISTORY_INTERVAL_S))["w0"].history
    assert [s.num_new_tokens for p in plans for s in p.sequences()] == [BS, 8]
    assert (sum(h.steps), sum(h.tokens), sum(h.sampled)) == (2, BS + 8, 1)


def decoded(snapshot: CacheSnapshot) -> dict[str, WorkerSnapshot]:
    """The snapshot as the gateway gets it: through the bus codec."""
    return {w.worker_id: w for w in decode(encode(snapshot), CacheSnapshot).workers}


def holders(w: WorkerSnapshot) -> dict[str, set[int]]:
    ids = [int.from_bytes(w.holder_blocks[i:i + 4], "little") for i in range(0, len(w.holder_blocks), 4)]
    out, k = {}, 0
    for rid, count in zip(w.holder_rids, w.holder_counts):
        out[rid] = set(ids[k:k + count])
        k += count
    assert k == len(ids)
    return out


def check_against_the_pool(run: Run, snapshot: CacheSnapshot, moving: set[int] = frozenset()) -> None:
    """Every block's state and reference count as the pool holds them; the requests holding each block as their
    sequences' tables say; the free count as /metrics exports it."""
    stats = {s.worker_id: s for s in run.cluster.stats(snapshot.time).workers}
    for worker_id, w in decoded(snapshot).items():
        ws = run.cluster.workers[worker_id]
        pool = ws.kv.pool
        in_queue = {b.block_id for b in pool.free_queue}  # the LRU free queue itself
        assert len(w.states) == len(w.ref_counts) == len(pool.blocks)
        for block in pool.blocks:
            state = w.states[block.block_id]
            assert bool(state & BLOCK_MOVING) == (block.block_id in moving)
            if block.block_id == 0:
                expected = "null"
            elif block.block_id in in_queue:
                expected = "cached" if block.block_hash is not None else "free"
            else:
                expected = "used" if block.ref_cnt == 1 else "shared"
            assert BLOCK_STATES[state & ~BLOCK_MOVING] == expected, block
            assert w.ref_counts[block.block_id] == min(block.ref_cnt, 255)
        names = [BLOCK_STATES[s & ~BLOCK_MOVING] for s in w.states]
        assert names.count("free") + names.count("cached") == stats[worker_id].free_blocks == pool.num_free
        assert names.count("shared") == stats[worker_id].shared_blocks
        assert len(w.states) - 1 == stats[worker_id].num_blocks
        expected_holders = {rs.rid: {b for seq in rs.seqs for b in ws.kv.block_ids(seq.seq_id)} for rs in ws.running}
        assert w.holders_complete and holders(w) == expected_holders
        assert (w.running, w.waiting, w.preempted) == (len(ws.running), len(ws.waiting), len(ws.preempted))


def test_each_block_shows_the_state_the_pool_gives_it_through_shared_prefixes_forks_and_ends():
    rng = random.Random(0)
    run = Run([registration("w0"), registration("w1")])
    for i in range(10):
        run.cluster.add_request(request(f"r{i}", rng, n=2 if i % 3 == 0 else 1))
    seen = set()
    for t in range(200):
        run.step()
        snapshot = run.monitor.snapshot(run.cluster, float(t))
        check_against_the_pool(run, snapshot)
        seen |= {BLOCK_STATES[s & ~BLOCK_MOVING] for w in snapshot.workers for s in w.states}
        if not run.cluster.has_unfinished():
            break
    assert not run.cluster.has_unfinished()
    # The run went through every state: a prefix shared while its requests ran, and cached once they ended.
    assert seen == {"null", "free", "cached", "used", "shared"}


def test_blocks_a_plan_copies_or_swaps_are_marked_until_its_result_comes_back():
    rng = random.Random(1)
    # A cache too small for all of it: requests are preempted by swap and come back; n=2 forks copy on write.
    run = Run([registration("w0", num_blocks=24, swap=64)], preemption_mode="swap")
    for i in range(6):
        run.cluster.add_request(request(f"r{i}", rng, n=2, max_tokens=40))
    kinds = set()
    for t in range(2000):
        plan = run.plan("w0")
        if plan is None:
            break
        moved = {b for pair in plan.copies for b in pair} | {d for d, _ in plan.swap_out} | {d for _, d in plan.swap_in}
        kinds |= {k for k in ("copies", "swap_out", "swap_in") if getattr(plan, k)}
        check_against_the_pool(run, run.monitor.snapshot(run.cluster, float(t)), moved)
        run.finish(plan)
        check_against_the_pool(run, run.monitor.snapshot(run.cluster, t + 0.5))
    assert not run.cluster.has_unfinished()
    assert kinds == {"copies", "swap_out", "swap_in"}


def test_the_history_adds_up_to_the_plans_sent_and_the_tokens_that_came_back():
    rng = random.Random(2)
    run = Run([registration("w0", num_blocks=128)])
    now = 0.0
    run.monitor.tick(run.cluster, now, False)  # the first sample: nothing before it
    for i in range(8):  # one arrival a step, so later ones hit the prefix the first computed
        run.cluster.add_request(request(f"r{i}", rng, n=1 + i % 2))
        run.step()
        now += 0.25
        assert run.monitor.tick(run.cluster, now, False) is None
    while run.cluster.has_unfinished():
        run.step()
        now += 0.25
        assert run.monitor.tick(run.cluster, now, False) is None  # nobody watches: no snapshot
    now += HISTORY_INTERVAL_S
    run.monitor.tick(run.cluster, now, False)
    h = decoded(run.monitor.snapshot(run.cluster, now))["w0"].history
    assert sum(h.steps) == len(run.plans)
    assert sum(h.seqs) == sum(len(p.sequences()) for p in run.plans)
    assert sum(h.tokens) == sum(s.num_new_tokens for p in run.plans for s in p.sequences())
    assert sum(h.sampled) == sum(len(r.token_ids) for r in run.results)  # synchronous: every chunk that ends samples
    stats = run.cluster.workers["w0"].stats()
    assert (sum(h.prefix_queries), sum(h.prefix_hits)) == (stats.prefix_queries, stats.prefix_hits)
    assert stats.prefix_hits > 0
    assert max(h.running) > 0 and h.running[-1] == h.waiting[-1] == 0
    assert len(h.steps) == len(run.monitor.history_time) == int(now // HISTORY_INTERVAL_S) + 1


def test_snapshots_come_only_while_watched_and_at_a_bounded_rate():
    big = Run([registration("w0", num_blocks=MAX_BLOCKS_PER_S * 2)])  # 2 s between snapshots of this one
    small = Run([registration("w0")])
    for run, interval in ((small, SNAPSHOT_INTERVAL_S), (big, 2.0)):
        monitor = run.monitor
        assert monitor.tick(run.cluster, 100.0, False) is None
        assert monitor.tick(run.cluster, 100.25, True) is not None
        assert monitor.tick(run.cluster, 100.25 + interval - 0.01, True) is None
        assert monitor.tick(run.cluster, 100.25 + interval, True) is not None


def test_a_worker_that_leaves_leaves_the_snapshot_and_one_that_returns_starts_a_new_history():
    rng = random.Random(3)
    run = Run([registration("w0"), registration("w1")])
    for i in range(4):
        run.cluster.add_request(request(f"r{i}", rng))
    for t in range(3):
        run.step()
        run.monitor.tick(run.cluster, float(t), False)
    run.cluster.remove_worker("w1")
    run.monitor.tick(run.cluster, 3.0, False)
    assert list(decoded(run.monitor.snapshot(run.cluster, 3.0))) == ["w0"]
    run.cluster.add_worker(registration("w1"))
    run.monitor.tick(run.cluster, 4.0, False)
    workers = decoded(run.monitor.snapshot(run.cluster, 4.0))
    assert len(workers["w1"].history.steps) == 1 and len(workers["w0"].history.steps) == 5
    assert run.monitor.snapshot(run.cluster, 4.0).history_workers == [2, 2, 2, 1, 2]


def test_a_100k_block_cache_snapshot_stays_under_a_megabyte_with_its_holders_cut_at_the_bound():
    rng = random.Random(4)
    num_blocks = 100_000
    # The model-free worker of the benchmarks: the shadow worker's per-slot checks are quadratic in prompt length.
    run = Run([registration("w0", num_blocks, max_model_len=8192)], TokenWorker, max_num_seqs=256,
              max_num_batched_tokens=16384)
    for i in range(256):  # 300 blocks each: 76800 blocks held, over MAX_HOLDER_ENTRIES
        prompt = [rng.randrange(3, 90) for _ in range(300 * BS - 1)]
        run.cluster.add_request(Request(f"r{i}", "m", prompt, SamplingParams(max_tokens=1000, ignore_eos=True), 0.0))
    cluster = run.cluster
    while sum(len(rs.seqs) for rs in cluster.workers["w0"].running) < 256 or any(
            s.num_computed < len(rs.prompt) for rs in cluster.workers["w0"].running for s in rs.seqs):
        run.step()
    raw = encode(run.monitor.snapshot(cluster, 0.0))
    assert len(raw) < 1 << 20
    w = decode(raw, CacheSnapshot).workers[0]
    assert len(w.states) == num_blocks
    ws = cluster.workers["w0"]
    assert not w.holders_complete
    assert sum(w.holder_counts) <= MAX_HOLDER_ENTRIES < sum(w.holder_counts) + 301
    assert w.holder_rids == [rs.rid for rs in ws.running[:len(w.holder_rids)]]  # the earliest running requests
    assert holders(w) == {rs.rid: set(ws.kv.block_ids(rs.seqs[0].seq_id)) for rs in ws.running[:len(w.holder_rids)]}


@pytest.mark.parametrize("field,value", [("states", "not bytes"), ("ref_counts", [1, 2]), ("holder_blocks", None)])
def test_a_snapshot_with_a_field_of_the_wrong_type_is_refused(field, value):
    run = Run([registration("w0")])
    body = run.monitor.snapshot(run.cluster, 1.0)
    setattr(body.workers[0], field, value)
    with pytest.raises(ProtocolError, match=field):
        decode(encode(body), CacheSnapshot)
