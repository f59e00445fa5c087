"""Tenants in the scheduler core, run against SimWorker (the plan contract on a checked shadow cache): priorities,
fair shares across workers, the queue limits and queue time, the cap on a tenant's running sequences, and prefix
caches that tenants (and cache salts) never share. Over HTTP, the keys file: see test_tenants_http.py."""
from __future__ import annotations

import pytest

from sched_sim import drive
from scheduler.ledger import DECODE_COST
from scheduler.request import Status
from shared.protocol import OVERLOADED, Request
from shared.tenants import Keys, Tenant, TenantError, parse_keys
from test_scheduler_core import EOS, make, pick, request

LIGHT, HEAVY = Tenant("light"), Tenant("heavy")


def of(tenant: Tenant, rid: str, priority: int = 0, cache_salt: str = "", **kw) -> Request:
    req = request(rid, **kw)
    return Request(req.rid, req.model, req.prompt_token_ids, req.params, 0.0, tenant=tenant, priority=priority,
                   cache_salt=cache_salt)


def running(sched, wid: str = "w0") -> list[str]:
    return [rs.rid for rs in sched.workers[wid].running]


def admitted_order(sched, sims, rids: set[str]) -> list[str]:
    """The order in which the requests `rids` first get a sequence on a worker, stepping until they all have."""
    order: list[str] = []
    for _ in range(500):
        for wid in sched.worker_ids:
            plan = sched.schedule(wid)
            if plan is None:
                continue
            order += [s.rid for s in plan.new_sequences if s.rid in rids and s.rid not in order]
            sched.apply_result(sims[wid].execute(plan).result)
        if set(order) == rids:
            return order
    raise AssertionError(f"only {order} of {sorted(rids)} were admitted")


# ---- priority ---------------------------------------------------------------------------------
def test_under_priority_a_more_urgent_arrival_preempts_the_least_urgent_running_request_when_the_batch_is_full():
    sched, sims = make(scheduling_policy="priority", max_num_seqs=2)
    for rid, priority in (("low-a", 5), ("low-b", 9)):
        sched.add_request(of(HEAVY, rid, priority, max_tokens=40))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    assert running(sched) == ["low-a", "low-b"], "the batch is full"
    sched.add_request(of(LIGHT, "urgent", -1, max_tokens=4))
    plan = sched.schedule("w0")
    assert [s.rid for s in plan.new_sequences] == ["urgent"]
    assert running(sched) == ["urgent", "low-a"], "the least urgent (priority 9) made room"
    assert [rs.rid for rs in sched.workers["w0"].preempted] == ["low-b"]
    outcome = sims["w0"].execute(plan)
    sched.apply_result(outcome.result)
    for out in outcome.outputs:
        outputs.setdefault((out.rid, 0), []).append(out.token_id)
    drive(sched, sims, outputs)
    assert {rid: len(tokens) for (rid, _), tokens in outputs.items()} == {"low-a": 40, "low-b": 40, "urgent": 4}
    assert sched.num_preemptions == 1 and not sched.has_unfinished(), "the preempted one resumed and finished"


def test_under_priority_two_urgent_arrivals_in_one_step_both_make_room_and_start_in_the_next():
    sched, sims = make(scheduling_policy="priority", max_num_seqs=3)
    for rid, priority in (("low-a", 5), ("low-b", 9), ("mid", 1)):
        sched.add_request(of(HEAVY, rid, priority, max_tokens=40))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    for rid in ("urgent-1", "urgent-2"):
        sched.add_request(of(LIGHT, rid, -1, max_tokens=4))
    plan = sched.schedule("w0")
    assert [s.rid for s in plan.new_sequences] == ["urgent-1", "urgent-2"]
    assert running(sched) == ["urgent-1", "urgent-2", "mid"], "the two least urgent made room"
    assert [rs.rid for rs in sched.workers["w0"].preempted] == ["low-a", "low-b"]
    collect(outputs, outcome := sims["w0"].execute(plan))
    sched.apply_result(outcome.result)
    drive(sched, sims, outputs)
    assert outputs == {(rid, 0): [pick(rid, 0, i) for i in range(n)] for rid, n in
                       (("low-a", 40), ("low-b", 40), ("mid", 40), ("urgent-1", 4), ("urgent-2", 4))}


def test_with_a_step_in_flight_an_urgent_arrival_takes_a_seat_in_the_lookahead_and_the_victims_token_stands():
    """Async scheduling plans a step while one computes: the urgent request preempts the least urgent one in that
    lookahead, by recompute. The victim's token in the step in flight was streamed, so it counts: the victim resumes
    after it, every stream exact, each output index once."""
    sched, sims = make(scheduling_policy="priority", max_num_seqs=2, async_scheduling=True)
    for rid, priority in (("low-a", 5), ("low-b", 9)):
        sched.add_request(of(HEAVY, rid, priority, max_tokens=40))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    in_flight = sched.schedule("w0")
    victim = sched.requests["low-b"]
    (victim_seq,) = [s.seq_id for s in victim.seqs]
    sched.add_request(of(LIGHT, "urgent", -1, max_tokens=4))
    lookahead = sched.schedule("w0")
    assert [s.rid for s in lookahead.new_sequences] == ["urgent"] and lookahead.freed == [victim_seq]
    assert running(sched) == ["urgent", "low-a"] and victim.status is Status.PREEMPTED
    for plan in (in_flight, lookahead):
        outcome = sims["w0"].execute(plan)
        sched.apply_result(outcome.result)
        for out in outcome.outputs:
            outputs.setdefault((out.rid, 0), []).append(out.token_id)
        if plan is in_flight:
            assert victim.outputs == [outputs[("low-b", 0)]], "its token in flight counts"
    drive(sched, sims, outputs)
    assert outputs == {(rid, 0): [pick(rid, 0, i) for i in range(n)]
                       for rid, n in (("low-a", 40), ("low-b", 40), ("urgent", 4))}
    assert sched.num_preemptions == 1 and not sched.has_unfinished()


def collect(outputs: dict, outcome) -> None:
    for out in outcome.outputs:
        tokens = outputs.setdefault((out.rid, out.sample_index), [])
        assert out.output_index == len(tokens), "each output index arrives exactly once"
        tokens.append(out.token_id)


def full_batch_and_a_lookahead_sent():
    """Two low-priority requests fill a batch of two; a step is in flight, its lookahead sent (a clock given)."""
    sched, sims = make(scheduling_policy="priority", max_num_seqs=2, async_scheduling=True)
    for rid, priority in (("low-a", 5), ("low-b", 9)):
        sched.add_request(of(HEAVY, rid, priority, max_tokens=40))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    in_flight, lookahead = sched.plans("w0", now=0.0)
    return sched, sims, outputs, in_flight, lookahead


@pytest.mark.parametrize("begun", [False, True], ids=["in-the-lookaheads-step", "after-it"])
def test_an_urgent_arrival_after_the_lookahead_went_out_joins_it_and_every_stream_stays_exact(begun):
    """With a step in flight and its lookahead sent, an urgent request is planned at once in a join: its admission
    alone, preempting the least urgent request by recompute. A worker that has not begun the lookahead runs the two
    as one step (the victim's chunk leaves it, its blocks may be the urgent one's: the shadow cache checks every
    write and read), else one after the other; either way every stream is exact and each output index comes once."""
    sched, sims, outputs, in_flight, lookahead = full_batch_and_a_lookahead_sent()
    victim = sched.requests["low-b"]
    (victim_seq,) = [s.seq_id for s in victim.seqs]
    sched.add_request(of(LIGHT, "urgent", -1, max_tokens=4))
    (join,) = sched.plans("w0", now=0.001)
    assert join.joins and [s.rid for s in join.new_sequences] == ["urgent"] and join.freed == [victim_seq]
    assert running(sched) == ["urgent", "low-a"] and victim.status is Status.PREEMPTED
    assert sched.plans("w0", now=0.002) == [], "nothing else came"
    step = lookahead.joined(join)
    assert [s.seq_id for s in step.sequences()] == [*lookahead.decodes.without({victim_seq}).seq_ids,
                                                     *(s.seq_id for s in join.scheduled)]
    assert len(step.sequences()) <= 2, "the step keeps to max_num_seqs"
    sim = sims["w0"]
    collect(outputs, outcome := sim.execute(in_flight))
    sched.apply_result(outcome.result, now=0.03)
    if begun:
        outcomes = [sim.execute(lookahead), sim.execute(join)]
    else:
        outcomes = sim.execute(step).split([join])
        assert [o.result.step_id for o in outcomes] == [lookahead.step_id, join.step_id]
        assert {out.rid for out in outcomes[1].outputs} == {"urgent"}
    for outcome in outcomes:
        collect(outputs, outcome)
        sched.apply_result(outcome.result, now=0.06)
    assert len(victim.outputs[0]) == len(outputs[("low-b", 0)]), "the victim's tokens that came count, no more"
    drive(sched, sims, outputs)
    assert outputs == {(rid, 0): [pick(rid, 0, i) for i in range(n)]
                       for rid, n in (("low-a", 40), ("low-b", 40), ("urgent", 4))}
    assert sched.num_preemptions == 1 and not sched.has_unfinished()


def test_a_victim_of_a_join_is_not_admitted_back_while_a_plan_in_flight_samples_its_token():
    """Its token in the lookahead is still to come when the plan after it is made: taken back then, it would start
    from outputs that miss it. It waits for that result, and its stream stays exact."""
    sched, sims, outputs, in_flight, lookahead = full_batch_and_a_lookahead_sent()
    sched.add_request(of(LIGHT, "urgent", -1, max_tokens=4))
    (join,) = sched.plans("w0", now=0.001)
    sched.abort("low-a")  # a seat for the victim
    sim = sims["w0"]
    collect(outputs, outcome := sim.execute(in_flight))
    sched.apply_result(outcome.result, now=0.03)
    (behind,) = sched.plans("w0", now=1.0)
    assert "low-b" not in {s.rid for s in behind.new_sequences}, "its token in the lookahead is in flight"
    for plan in (lookahead, join, behind):
        collect(outputs, outcome := sim.execute(plan))
        sched.apply_result(outcome.result, now=1.0)
    drive(sched, sims, outputs)
    assert outputs[("low-b", 0)] == [pick("low-b", 0, i) for i in range(40)]
    assert outputs[("urgent", 0)] == [pick("urgent", 0, i) for i in range(4)]


def test_without_a_clock_nothing_joins_a_lookahead():
    """The in-process engine runs each plan as it is made: there is no step yet to be begun to join."""
    sched, sims = make(scheduling_policy="priority", max_num_seqs=2, async_scheduling=True)
    for rid, priority in (("low-a", 5), ("low-b", 9)):
        sched.add_request(of(HEAVY, rid, priority, max_tokens=40))
    drive(sched, sims, rounds=3)
    assert len(sched.plans("w0")) == 2, "a step and its lookahead"
    sched.add_request(of(LIGHT, "urgent", -1, max_tokens=4))
    assert sched.plans("w0") == [] and running(sched) == ["low-a", "low-b"]


def test_a_request_preempted_in_a_step_is_not_admitted_back_in_it_even_where_it_would_fit():
    """The room the urgent request needed counts the blocks the running ones grow into; once it is in, what the victim
    gave back would seat the victim again. It waits for the next step: in a lookahead its token is still in flight."""
    sched, sims = make(num_blocks=8, scheduling_policy="priority", async_scheduling=True, enable_prefix_caching=False)
    sched.add_request(of(HEAVY, "low-a", 5, max_tokens=30))
    sched.add_request(of(HEAVY, "low-b", 9, max_tokens=30))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=8)
    in_flight = sched.schedule("w0")
    sched.add_request(of(LIGHT, "urgent", -1, prompt_len=16, max_tokens=4))
    lookahead = sched.schedule("w0")
    assert [s.rid for s in lookahead.new_sequences] == ["urgent"]
    assert [rs.rid for rs in sched.workers["w0"].preempted] == ["low-b"] and sched.workers["w0"].kv.num_free >= 2
    for plan in (in_flight, lookahead):
        outcome = sims["w0"].execute(plan)
        sched.apply_result(outcome.result)
        for out in outcome.outputs:
            outputs.setdefault((out.rid, 0), []).append(out.token_id)
    drive(sched, sims, outputs)
    assert outputs[("low-b", 0)] == [pick("low-b", 0, i) for i in range(30)]


def test_under_swap_preemption_an_urgent_arrival_gets_the_plan_after_the_flight_lands_not_a_lookahead():
    """A swap would move the blocks the step in flight writes: the pipeline drains, and the next plan preempts."""
    sched, sims = make(num_swap=16, scheduling_policy="priority", max_num_seqs=2, async_scheduling=True,
                       preemption_mode="swap")
    for rid in ("low-a", "low-b"):
        sched.add_request(of(HEAVY, rid, 5, max_tokens=40))
    drive(sched, sims, rounds=3)
    in_flight = sched.schedule("w0")
    sched.add_request(of(LIGHT, "urgent", -1, max_tokens=4))
    assert sched.schedule("w0") is None, "no lookahead that leaves the urgent request out"
    assert running(sched) == ["low-a", "low-b"]
    sched.apply_result(sims["w0"].execute(in_flight).result)
    plan = sched.schedule("w0")
    assert [s.rid for s in plan.new_sequences] == ["urgent"] and plan.swap_out and running(sched) == ["urgent", "low-a"]


def test_a_request_preempted_for_one_that_then_ends_short_of_blocks_runs_in_that_step_rather_than_the_worker_idle():
    """Growing, the urgent request's samples preempt the other request and still do not fit, so it ends alone in the
    cache ('length'): the request it preempted is taken back in the same step, not left waiting on an idle worker."""
    sched, sims = make(num_blocks=4, max_model_len=24, max_num_batched_tokens=8, enable_prefix_caching=False,
                       scheduling_policy="priority")
    sched.add_request(of(HEAVY, "first", prompt_len=4, max_tokens=1))
    sched.add_request(of(HEAVY, "low", 2, prompt=[2], n=3, max_tokens=1))
    sched.add_request(of(HEAVY, "urgent", prompt=[2, 2, 2], n=3, max_tokens=12))
    drive(sched, sims)  # (it asserts that a worker gets a plan whenever requests wait)
    ends = {done.rid: done.finish_reason for done in sched.pop_finished()}
    assert ends == {"first": "length", "low": "length", "urgent": "length"} and sched.num_preemptions >= 1


def test_under_priority_an_equal_or_less_urgent_arrival_waits_for_room():
    sched, sims = make(scheduling_policy="priority", max_num_seqs=2)
    for rid in ("a", "b"):
        sched.add_request(of(HEAVY, rid, 3, max_tokens=10))
    drive(sched, sims, rounds=2)
    sched.add_request(of(LIGHT, "same", 3))
    sched.add_request(of(LIGHT, "later", 7))
    drive(sched, sims, rounds=2)
    assert running(sched) == ["a", "b"] and sched.num_preemptions == 0


def test_under_priority_waiting_requests_are_admitted_by_priority_then_arrival():
    sched, sims = make(scheduling_policy="priority", max_num_seqs=1)
    sched.add_request(of(HEAVY, "first", 0, max_tokens=2))
    arrivals = [("p5-a", 5), ("p1", 1), ("p5-b", 5), ("p-2", -2)]
    for rid, priority in arrivals:
        sched.add_request(of(HEAVY, rid, priority, max_tokens=2))
    assert admitted_order(sched, sims, {"first", *(r for r, _ in arrivals)}) == ["p-2", "first", "p1", "p5-a", "p5-b"]


def test_under_fcfs_the_priority_field_orders_nothing():
    sched, sims = make(max_num_seqs=1)
    for rid, priority in (("a", 9), ("b", -9)):
        sched.add_request(of(HEAVY, rid, priority, max_tokens=2))
    assert admitted_order(sched, sims, {"a", "b"}) == ["a", "b"]


# ---- fair shares --------------------------------------------------------------------------------
def queue_on(sched, wid: str, req: Request) -> None:
    """Queue `req` on worker `wid`, whatever the placement rule would choose."""
    sched.add_request(req)
    rs = sched.requests[req.rid]
    sched.workers[rs.worker_id].waiting.remove(rs)
    sched.workers[wid].enqueue(rs)


@pytest.mark.parametrize("policy, first", [("fair", "light-1"), ("fcfs", "heavy-1")])
def test_under_fair_the_tenant_with_the_least_weighted_tokens_goes_first_across_workers(policy, first):
    """Heavy's long prompt on w0 counts on w1 too: there, light's request goes first though heavy's came first."""
    sched, sims = make(scheduling_policy=policy, workers=("w0", "w1"), max_num_seqs=1)
    queue_on(sched, "w0", of(HEAVY, "heavy-0", prompt_len=64, max_tokens=30))
    queue_on(sched, "w1", of(LIGHT, "light-0", max_tokens=3))
    queued = [of(HEAVY, f"heavy-{i}", max_tokens=2) for i in range(1, 4)] + [of(LIGHT, "light-1", max_tokens=2)]
    for req in queued:
        queue_on(sched, "w1", req)
    order = admitted_order(sched, sims, {r.rid for r in queued})
    assert order[0] == first, order
    assert sched.ledger.counter("heavy") > sched.ledger.counter("light")


def test_an_idle_tenant_comes_back_with_no_credit_saved_up():
    sched, sims = make(scheduling_policy="fair", max_num_seqs=1)
    sched.add_request(of(HEAVY, "heavy-0", max_tokens=60))
    drive(sched, sims, rounds=40)
    heavy = sched.ledger.counter("heavy")
    assert heavy >= 30 * DECODE_COST
    sched.add_request(of(LIGHT, "light-0", max_tokens=2))
    assert sched.ledger.counter("light") == heavy, "starts at the least counter of the tenants with work"


def test_a_tenant_of_twice_the_weight_gets_twice_the_tokens():
    sched, sims = make(scheduling_policy="fair", max_num_seqs=1)
    double = Tenant("double", weight=2.0)
    for i in range(12):
        sched.add_request(of(double, f"d{i}", max_tokens=4))
        sched.add_request(of(LIGHT, f"l{i}", max_tokens=4))
    order = admitted_order(sched, sims, {f"d{i}" for i in range(12)} | {f"l{i}" for i in range(12)})
    first = order[:12]
    assert sum(r.startswith("d") for r in first) == 8, first


def test_a_weight_the_keys_file_changes_counts_for_the_running_requests_tokens_from_the_next_plan():
    """Its counter grows by a decode token's cost over the weight its latest request carried, not over the weight
    the running request arrived with (a reload is in force within a second, for the requests already running too)."""
    sched, sims = make(scheduling_policy="fair", max_num_seqs=1)
    sched.add_request(of(Tenant("t"), "running", max_tokens=40))
    drive(sched, sims, rounds=6)
    before = sched.ledger.counter("t")
    drive(sched, sims, rounds=1)
    assert sched.ledger.counter("t") - before == DECODE_COST, "one decode token at weight 1"
    sched.add_request(of(Tenant("t", weight=4.0), "after-reload", max_tokens=4))  # waits: the batch is full
    before = sched.ledger.counter("t")
    drive(sched, sims, rounds=1)
    assert running(sched) == ["running"]
    assert sched.ledger.counter("t") - before == DECODE_COST / 4, "the running request's token at the new weight"


def test_under_fair_a_tenant_under_its_share_of_the_batch_preempts_the_latest_of_the_tenant_over_it():
    """Heavy holds the whole batch: light's request takes a seat from heavy's latest request at once, which resumes
    and finishes; nobody's tokens are lost."""
    sched, sims = make(scheduling_policy="fair", max_num_seqs=4)
    for i in range(6):
        sched.add_request(of(HEAVY, f"heavy-{i}", max_tokens=30))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    assert running(sched) == [f"heavy-{i}" for i in range(4)], "the batch is full of heavy's work"
    # Its counter starts level with heavy's: the tie goes to the tenant using less of the batch, in the next plan.
    sched.add_request(of(LIGHT, "light", max_tokens=4))
    plan = sched.schedule("w0")
    assert [s.rid for s in plan.new_sequences] == ["light"]
    assert [rs.rid for rs in sched.workers["w0"].preempted] == ["heavy-3"] and sched.num_preemptions == 1
    sched.apply_result((outcome := sims["w0"].execute(plan)).result)
    for out in outcome.outputs:
        outputs.setdefault((out.rid, 0), []).append(out.token_id)
    drive(sched, sims, outputs)
    assert {rid: len(t) for (rid, _), t in outputs.items()} == {**{f"heavy-{i}": 30 for i in range(6)}, "light": 4}


def test_under_fair_the_request_preempted_for_a_share_goes_behind_it_so_the_cache_never_trades_them_back():
    """Heavy's five samples fill the cache. Light's request preempts them for its share; heavy's request comes back
    on the blocks left and grows: the cache's growth preempts the last-ranked, which is heavy's, not light's again."""
    sched, sims = make(num_blocks=7, scheduling_policy="fair", max_num_seqs=8, enable_prefix_caching=False)
    sched.add_request(of(HEAVY, "heavy", n=5, max_tokens=8))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    assert running(sched) == ["heavy"] and sched.workers["w0"].kv.num_free == 0
    sched.add_request(of(LIGHT, "light", prompt_len=16, max_tokens=20))
    while sched.requests["light"].status is not Status.FINISHED:
        drive(sched, sims, outputs, rounds=1)
        assert "light" not in [rs.rid for rs in sched.workers["w0"].preempted], "light's seat was taken back"
    drive(sched, sims, outputs)
    assert outputs[("light", 0)] == [pick("light", 0, i) for i in range(20)]
    assert all(outputs[("heavy", i)] == [pick("heavy", i, k) for k in range(8)] for i in range(5))


def test_under_fair_a_tenant_under_its_share_of_the_cluster_takes_a_seat_on_a_worker_its_requests_crowd():
    """Two workers of two seats: light's share is two of the four. Light's requests happen to crowd w0 (one running,
    a second queued there) while heavy runs three, two on w1: light is under its share of the cluster, so its request
    takes heavy's seat on w0 at once, though it would be over half of w0 alone."""
    sched, sims = make(scheduling_policy="fair", workers=("w0", "w1"), max_num_seqs=2)
    queue_on(sched, "w0", of(LIGHT, "light-0", max_tokens=40))
    queue_on(sched, "w0", of(HEAVY, "heavy-0", max_tokens=40))
    for i in (1, 2):
        queue_on(sched, "w1", of(HEAVY, f"heavy-{i}", max_tokens=40))
    outputs: dict = {}
    drive(sched, sims, outputs, rounds=3)
    assert (running(sched, "w0"), running(sched, "w1")) == (["light-0", "heavy-0"], ["heavy-1", "heavy-2"])
    queue_on(sched, "w0", of(LIGHT, "light-1", max_tokens=4))
    plan = sched.schedule("w0")
    assert [s.rid for s in plan.new_sequences] == ["light-1"]
    assert [rs.rid for rs in sched.workers["w0"].preempted] == ["heavy-0"]
    sched.apply_result((outcome := sims["w0"].execute(plan)).result)
    for out in outcome.outputs:
        outputs.setdefault((out.rid, 0), []).append(out.token_id)
    drive(sched, sims, outputs)
    assert {rid: len(t) for (rid, _), t in outputs.items()} == {"light-0": 40, "light-1": 4,
                                                                 **{f"heavy-{i}": 40 for i in range(3)}}


@pytest.mark.parametrize("light_running", [0, 2])
def test_under_fair_a_tenant_at_its_share_waits_and_two_tenants_never_preempt_each_other_back(light_running):
    """With one seat, seating either tenant would put it over its half: nobody preempts. With four seats and light
    at two (its share), a third light request waits for a seat like any other."""
    seats = 1 if not light_running else 4
    sched, sims = make(scheduling_policy="fair", max_num_seqs=seats)
    for i in range(light_running):
        sched.add_request(of(LIGHT, f"light-{i}", max_tokens=40))
    for i in range(seats - light_running):
        sched.add_request(of(HEAVY, f"heavy-{i}", max_tokens=40))
    drive(sched, sims, rounds=3)
    sched.add_request(of(LIGHT, "light-late", max_tokens=4))
    drive(sched, sims, rounds=3)
    assert "light-late" not in running(sched) and sched.num_preemptions == 0


# ---- limits -------------------------------------------------------------------------------------
def refusals(sched) -> dict[str, tuple[str, float]]:
    return {f.rid: (f.error, f.retry_after) for f in sched.pop_finished() if f.error_kind == OVERLOADED}


def test_a_tenants_waiting_limit_turns_its_next_request_away_with_a_wait_and_leaves_the_others():
    sched, sims = make(max_num_seqs=1)
    capped = Tenant("capped", max_waiting_requests=2)
    for rid in ("c0", "c1", "c2", "c3"):
        sched.add_request(of(capped, rid, max_tokens=30))
    sched.add_request(of(LIGHT, "other"))
    turned = refusals(sched)
    assert list(turned) == ["c2", "c3"] and "capped has 2 requests waiting" in turned["c2"][0]
    assert all(0 < wait <= 60 for _, wait in turned.values())
    drive(sched, sims, rounds=1)  # c0 is admitted: a place frees
    sched.add_request(of(capped, "c4"))
    assert not refusals(sched)


@pytest.mark.parametrize("policy, turned_away", [("fcfs", ["h4", "l0", "l1", "l2"]), ("fair", ["h4", "l2"])])
def test_under_fair_a_tenant_within_its_share_joins_a_queue_that_another_tenant_filled(policy, turned_away):
    """Ten times the load must not turn the light tenant away: under fair a full queue still takes a tenant within
    its weighted share of the limit (here 2 of 4), and goes on refusing the one that filled it."""
    sched, _ = make(max_waiting_requests=4, scheduling_policy=policy)
    for rid in ("h0", "h1", "h2", "h3", "h4", "l0", "l1", "l2"):
        sched.add_request(of(HEAVY if rid[0] == "h" else LIGHT, rid))
    turned = refusals(sched)
    assert list(turned) == turned_away
    assert "requests are waiting, the server's limit" in turned["l2"][0]
    assert sched.ledger.accounts["light"].waiting == 3 - sum(rid[0] == "l" for rid in turned)


def test_queued_prompt_tokens_are_bounded_per_tenant_and_in_all():
    sched, _ = make(max_queued_tokens=50)
    sched.add_request(of(Tenant("t", max_queued_tokens=20), "t0", prompt_len=16))
    sched.add_request(of(Tenant("t", max_queued_tokens=20), "t1", prompt_len=8))
    sched.add_request(of(LIGHT, "l0", prompt_len=30))
    sched.add_request(of(HEAVY, "h0", prompt_len=8))
    turned = refusals(sched)
    assert list(turned) == ["t1", "h0"]
    assert "16 prompt tokens waiting" in turned["t1"][0] and "server's limit of 50" in turned["h0"][0]


def test_tokens_per_minute_turn_requests_away_until_the_window_frees():
    sched, sims = make()
    metered = Tenant("metered", tokens_per_minute=40)
    sched.add_request(of(metered, "m0", prompt_len=16, max_tokens=30))
    drive(sched, sims)
    sched.expire(100.0)
    sched.add_request(of(metered, "m1"))
    turned = refusals(sched)
    assert "tokens computed in the last minute" in turned["m1"][0] and 59 < turned["m1"][1] <= 60
    sched.expire(161.0)
    sched.add_request(of(metered, "m2"))
    assert not refusals(sched)


def test_a_request_that_waits_past_its_queue_time_ends_overloaded_and_the_running_one_goes_on():
    sched, sims = make(max_num_seqs=1, max_queue_time=30.0)
    sched.add_request(of(LIGHT, "runs", max_tokens=200))
    drive(sched, sims, rounds=1)
    sched.add_request(of(Tenant("impatient", max_queue_time=5.0), "short"))
    sched.add_request(of(LIGHT, "long"))
    sched.expire(0.0)
    sched.expire(6.0)
    drive(sched, sims, rounds=1)
    assert list(refusals(sched)) == ["short"]
    sched.expire(40.0)
    drive(sched, sims, rounds=1)
    ended = refusals(sched)
    assert list(ended) == ["long"] and "past the queue time of 30 s" in ended["long"][0]
    assert running(sched) == ["runs"]


def test_a_tenants_running_sequences_are_capped_across_workers_and_the_others_pass_it():
    sched, sims = make(workers=("w0", "w1"))
    capped = Tenant("capped", max_seqs=3)
    for i in range(4):
        sched.add_request(of(capped, f"c{i}", max_tokens=30, n=1 + (i == 0)))
    sched.add_request(of(LIGHT, "other", max_tokens=30))
    drive(sched, sims, rounds=3)
    seqs = {wid: sum(len(rs.seqs) for rs in ws.running if rs.req.tenant.name == "capped")
            for wid, ws in sched.workers.items()}
    assert sum(seqs.values()) == 3 == sched.ledger.accounts["capped"].running_seqs, seqs
    assert "other" in running(sched, "w0") + running(sched, "w1")
    drive(sched, sims)
    assert sched.ledger.accounts["capped"].running_seqs == 0 and not sched.has_unfinished()


def test_a_sample_that_ends_gives_its_seat_back_to_its_tenant_while_the_request_runs_on():
    """Capped at two sequences, the tenant runs both samples of c0; when sample 1 stops on EOS, c1 takes that seat
    while sample 0 goes on."""
    sched, sims = make(max_num_seqs=8)
    sims["w0"].pick = lambda rid, sample, i: EOS if (rid, sample, i) == ("c0", 1, 2) else pick(rid, sample, i)
    capped = Tenant("capped", max_seqs=2)
    sched.add_request(of(capped, "c0", max_tokens=30, n=2))
    sched.add_request(of(capped, "c1", max_tokens=30))
    drive(sched, sims, rounds=3)
    assert running(sched) == ["c0"] and sched.ledger.accounts["capped"].running_seqs == 2
    drive(sched, sims, rounds=3)
    assert sched.requests["c0"].reasons == [None, "stop"], "sample 1 stopped, sample 0 goes on"
    assert running(sched) == ["c0", "c1"] and sched.ledger.accounts["capped"].running_seqs == 2


# ---- isolated prefix caches ---------------------------------------------------------------------
PROMPT = list(range(100, 140))  # five full blocks


def cached_tokens(sched, sims, req: Request) -> int:
    sched.add_request(req)
    outputs: dict = {}
    plans = drive(sched, sims, outputs)
    first = next(s for p in plans for s in p.sequences() if any(n.rid == req.rid for n in p.new_sequences))
    return first.num_computed_tokens


@pytest.mark.parametrize("second, shared", [
    (of(LIGHT, "again", prompt=PROMPT), True),
    (of(HEAVY, "other-tenant", prompt=PROMPT), False),
    (of(LIGHT, "other-salt", prompt=PROMPT, cache_salt="x"), False),
])
def test_prefix_blocks_are_shared_within_a_tenant_and_a_salt_and_never_across(second, shared):
    sched, sims = make()
    assert cached_tokens(sched, sims, of(LIGHT, "first", prompt=PROMPT)) == 0
    assert cached_tokens(sched, sims, second) == (32 if shared else 0)


def test_tenants_that_opt_in_share_one_cache_and_the_rest_stay_apart():
    sched, sims = make()
    a, b = Tenant("a", shared_cache=True), Tenant("b", shared_cache=True)
    assert cached_tokens(sched, sims, of(a, "a0", prompt=PROMPT)) == 0
    assert cached_tokens(sched, sims, of(b, "b0", prompt=PROMPT)) == 32
    assert cached_tokens(sched, sims, of(LIGHT, "l0", prompt=PROMPT)) == 0


# ---- the keys file ------------------------------------------------------------------------------
KEYS_FILE = """
[tenants.interactive]
keys = ["key-i1", "key-i2"]
weight = 4
max_priority = -10
max_queue_time = 5

[tenants.batch]
keys = ["key-b"]
max_seqs = 8
shared_cache = true
"""


def test_a_keys_file_names_each_keys_tenant_and_terms_with_defaults_for_the_rest():
    keys = parse_keys(KEYS_FILE)
    assert keys.tenant("key-i2") == Tenant("interactive", weight=4.0, max_priority=-10, max_queue_time=5.0)
    assert keys.tenant("key-b") == Tenant("batch", max_priority=0, max_seqs=8, shared_cache=True)
    assert Keys.single([]).tenant("anything") == Tenant(), "no keys: one tenant, any priority"


@pytest.mark.parametrize("text, says", [
    ("[tenants.a\nkeys = 1", "not valid TOML"),
    ("[tenants.a]\nweight = 2", "needs `keys`"),
    ("[tenants.a]\nkeys = ['k']\nweight = 0", "weight must be a positive number"),
    ("[tenants.a]\nkeys = ['k']\nwieght = 2", "unknown field 'wieght'"),
    ("[tenants.a]\nkeys = ['k']\nmax_seqs = 'many'", "max_seqs must be int"),
    ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']", "a key names one tenant"),
    ("[tenants.default]\nkeys = ['k']", "name yours otherwise"),
    ("[other]\nx = 1", "unknown table 'other'"),
])
def test_a_malformed_keys_file_is_refused_saying_what_and_where(text, says):
    with pytest.raises(TenantError) as caught:
        parse_keys(text, "keys.toml")
    assert says in str(caught.value) and "keys.toml" in str(caught.value)


def test_a_tenant_on_the_bus_is_checked_as_the_file_is():
    from shared.protocol import ProtocolError, decode, encode
    req = of(Tenant("x", weight=-1.0), "r")
    with pytest.raises(ProtocolError, match="weight must be a positive number"):
        decode(encode(req), Request)
    assert decode(encode(of(LIGHT, "r", priority=-3, cache_salt="s")), Request) == of(LIGHT, "r", -3, "s")
