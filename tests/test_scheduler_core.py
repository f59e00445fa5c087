"""Scenarios of the scheduler core, run against SimWorker (the plan contract on a checked shadow cache)."""
from __future__ import annotations

import dataclasses

import pytest

from sched_sim import SimWorker, drive
from scheduler.cluster import Cluster
from scheduler.request import FinishedRequest
from scheduler.worker_scheduler import WorkerScheduler
from shared.protocol import (
    FAILED, REJECTED, UNAVAILABLE, Decodes, RefusedRequest, Request, StepResult, TokenOutput, WorkerRegistration,
    encode,
)
from shared.sampling import SamplingParams
from shared.settings import Settings

BS = 8
EOS = 1


def pick(rid: str, sample: int, index: int) -> int:
    """Sampled tokens depend on (request, sample, position) only, like seeded sampling; never EOS."""
    return 2 + (sum(map(ord, rid)) + 5 * sample + 3 * index) % 40


def make(num_blocks: int = 64, num_swap: int = 0, workers=("w0",), max_model_len: int = 256, worker_scheduler=None,
         **overrides):
    sched = Cluster(Settings(**{"block_size": BS, "watermark": 0.0, **overrides}), worker_scheduler=worker_scheduler)
    sims = {}
    for wid in workers:
        reg = WorkerRegistration(wid, "model", num_blocks, num_swap, BS, max_model_len, [EOS], vocab_size=512)
        sims[wid] = SimWorker(reg, pick)
        sched.add_worker(reg)
    return sched, sims


def request(rid: str, prompt_len: int = 8, max_tokens: int = 20, prompt: list[int] | None = None,
            **params) -> Request:
    tokens = prompt if prompt is not None else [50 + (ord(rid[0]) * 31 + i) % 400 for i in range(prompt_len)]
    return Request(rid, "model", tokens, SamplingParams(max_tokens=max_tokens, **params), 0.0)


def used_blocks(sched: Cluster, wid: str = "w0") -> int:
    kv = sched.workers[wid].kv
    return kv.pool.num_usable - kv.num_free


def reference_outputs(requests: list[Request]) -> dict[tuple[str, int], list[int]]:
    """The same requests on a cache large enough for no preemption."""
    sched, sims = make(num_blocks=256, enable_prefix_caching=False)
    for req in requests:
        sched.add_request(req)
    outputs: dict[tuple[str, int], list[int]] = {}
    drive(sched, sims, outputs)
    assert sched.num_preemptions == 0
    return outputs


# ---- preemption -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_latest_arrival_is_preempted_and_the_earliest_resumes_first(mode):
    # 6 usable blocks of 8 tokens; each request grows to 28 tokens (4 blocks): they cannot all run.
    sched, sims = make(num_blocks=7, num_swap=16, preemption_mode=mode, enable_prefix_caching=False)
    ws, sim = sched.workers["w0"], sims["w0"]
    requests = [request(rid) for rid in "abc"]
    for req in requests:
        sched.add_request(req)
    victims, resumed, first_sent = [], [], {}  # (step, rid) events
    outputs: dict[tuple[str, int], list[int]] = {}
    step = 0
    while sched.has_unfinished():
        running = {rs.rid: rs for rs in ws.running}
        held = {rid: {b for s in rs.seqs for b in ws.kv.block_ids(s.seq_id)} for rid, rs in running.items()}
        parked = [rs.rid for rs in ws.preempted]
        plan = sched.schedule("w0")
        now_parked = [rs.rid for rs in ws.preempted]
        out = [rid for rid in reversed(now_parked) if rid in running]
        victims += [(step, rid) for rid in out]
        resumed += [(step, rid) for rid in parked if rid not in now_parked]
        if mode == "recompute":
            assert {s.seq_id for rid in out for s in running[rid].seqs if s.sent} <= set(plan.freed)
        else:
            assert {dev for dev, _ in plan.swap_out} == set().union(*(held[rid] for rid in out))
        for new in plan.new_sequences:
            first_sent.setdefault(new.rid, step)
        outcome = sim.execute(plan)
        for token in outcome.outputs:
            outputs.setdefault((token.rid, token.sample_index), []).append(token.token_id)
        sched.apply_result(outcome.result)
        if victims and len(requests) == 3:
            requests.append(request("d"))  # arrives while a preempted request waits
            sched.add_request(requests[-1])
        step += 1
    assert [rid for _, rid in victims][:2] == ["c", "b"], "the latest arrival goes first"
    assert [rid for _, rid in resumed][:2] == ["b", "c"], "the earliest preempted comes back first"
    for when, rid in victims:
        if when < first_sent["d"]:
            assert any(when < back <= first_sent["d"] for back, r in resumed if r == rid), \
                "a new request waits while a preempted one has not resumed"
    assert sched.num_preemptions == len(victims) >= 2
    assert outputs == reference_outputs(requests), "preemption changes no token"


def test_recompute_resends_the_generated_tokens():
    sched, sims = make(num_blocks=7, enable_prefix_caching=False)
    requests = [request(rid) for rid in "abc"]
    for req in requests:
        sched.add_request(req)
    outputs: dict[tuple[str, int], list[int]] = {}
    plans = drive(sched, sims, outputs)
    resumed = [new for plan in plans for new in plan.new_sequences if new.output_token_ids]
    assert resumed, "the small cache forces a recompute"
    for new in resumed:
        final = outputs[(new.rid, new.sample_index)]
        assert new.output_token_ids == final[:len(new.output_token_ids)]
        assert new.prompt_token_ids == next(r.prompt_token_ids for r in requests if r.rid == new.rid)
    assert outputs == reference_outputs(requests)


def test_swap_round_trip_maps_each_block_back():
    sched, sims = make(num_blocks=7, num_swap=16, preemption_mode="swap", enable_prefix_caching=False)
    sim = sims["w0"]
    requests = [request(rid) for rid in "abc"]
    for req in requests:
        sched.add_request(req)
    outputs: dict[tuple[str, int], list[int]] = {}
    to_swap: dict[int, list[int]] = {}  # seq id → its table in swap blocks
    pending: dict[int, list[int]] = {}  # seq id → the device table it must come back with
    swap_ins = 0
    while sched.has_unfinished():
        plan = sched.schedule("w0")
        assert not (plan.swap_out and plan.swap_in), "swap-in waits for a step without preemption"
        out = dict(plan.swap_out)
        for seq_id, seq in sim.seqs.items():
            if seq.table and set(seq.table) <= set(out) and seq_id not in pending:
                to_swap[seq_id] = [out[b] for b in seq.table]
        back = dict(plan.swap_in)
        swap_ins += bool(back)
        for seq_id, table in list(to_swap.items()):
            if table and set(table) <= set(back):
                pending[seq_id] = [back[b] for b in table]
                del to_swap[seq_id]
        for sched_seq in plan.sequences():
            if sched_seq.seq_id in pending:
                expected = pending.pop(sched_seq.seq_id)
                assert sched_seq.block_table[:len(expected)] == expected
                assert not any(n.seq_id == sched_seq.seq_id for n in plan.new_sequences), "the worker kept it"
        outcome = sim.execute(plan)
        for token in outcome.outputs:
            outputs.setdefault((token.rid, token.sample_index), []).append(token.token_id)
        sched.apply_result(outcome.result)
    assert swap_ins >= 2 and not to_swap and not pending
    assert outputs == reference_outputs(requests)


def test_swap_falls_back_to_recompute_without_swap_space():
    sched, sims = make(num_blocks=7, num_swap=1, preemption_mode="swap", enable_prefix_caching=False)
    requests = [request(rid) for rid in "abc"]
    for req in requests:
        sched.add_request(req)
    outputs: dict[tuple[str, int], list[int]] = {}
    plans = drive(sched, sims, outputs)
    assert sched.num_preemptions > 0 and not any(p.swap_out for p in plans)
    assert outputs == reference_outputs(requests)


# ---- chunked prefill --------------------------------------------------------------------------
def test_long_prompt_is_chunked_by_the_token_budget():
    sched, sims = make(max_num_batched_tokens=16)
    sched.add_request(request("x", prompt_len=50, max_tokens=3))
    outputs: dict[tuple[str, int], list[int]] = {}
    plans = drive(sched, sims, outputs)
    steps = [[(s.num_computed_tokens, s.num_new_tokens) for s in p.sequences()] for p in plans]
    assert steps == [[(0, 16)], [(16, 16)], [(32, 16)], [(48, 2)], [(50, 1)], [(51, 1)]]
    assert len(outputs[("x", 0)]) == 3, "only the chunk that reaches the end samples"


def test_decodes_go_first_and_a_prefill_chunk_fills_the_rest_of_the_budget():
    sched, sims = make(max_num_batched_tokens=16)
    sched.add_request(request("y", prompt_len=4, max_tokens=10))
    drive(sched, sims, rounds=1)
    sched.add_request(request("x", prompt_len=50, max_tokens=3))
    plan = sched.schedule("w0")
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in plan.sequences()] == [(4, 1), (0, 15)]
    assert [n.rid for n in plan.new_sequences] == ["x"]


# ---- parallel sampling ------------------------------------------------------------------------
def test_four_samples_share_the_prompt_blocks():
    prompt = list(range(100, 136))  # 4 full blocks and 4 tokens
    shared, shared_sims = make(enable_prefix_caching=False)
    shared.add_request(request("n4", prompt=prompt, max_tokens=2, n=4))
    outputs: dict[tuple[str, int], list[int]] = {}
    plans = drive(shared, shared_sims, outputs, rounds=2)
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in plans[0].sequences()] == [(0, 35)]
    fork = plans[1]
    assert len(fork.new_sequences) == 3 and all(s.num_computed_tokens == 35 for s in fork.sequences())
    assert len(fork.copies) == 3 and len({src for src, _ in fork.copies}) == 1, "copy-on-write of the last block"
    used_shared = used_blocks(shared)

    separate, separate_sims = make(enable_prefix_caching=False)
    for k in range(4):
        separate.add_request(request(f"s{k}", prompt=prompt, max_tokens=2))
    drive(separate, separate_sims, rounds=1)
    used_separate = used_blocks(separate)
    assert (used_shared, used_separate) == (4 + 4, 4 * 5), "4 shared full blocks + 1 own block per sample"

    drive(shared, shared_sims, outputs)
    assert sorted(outputs) == [("n4", i) for i in range(4)] and all(len(t) == 2 for t in outputs.values())
    assert used_blocks(shared) == 0


# ---- rejection and bad input ------------------------------------------------------------------
def test_a_prompt_larger_than_the_cache_is_rejected_at_once():
    sched, _ = make(num_blocks=4)  # 3 usable blocks: 24 tokens
    sched.add_request(request("big", prompt_len=30))
    assert not sched.has_unfinished()
    message = "the request has 30 tokens, which need 4 KV blocks of 8 tokens, but worker w0 holds only 3 blocks"
    assert sched.pop_finished() == [FinishedRequest("big", "error", message, REJECTED)]


def test_a_prompt_as_long_as_max_model_len_is_rejected():
    sched, _ = make(max_model_len=20)
    sched.add_request(request("long", prompt_len=20))
    (done,) = sched.pop_finished()
    assert done.finish_reason == "error" and "max_model_len is 20" in done.error


def test_a_request_only_a_larger_worker_holds_goes_there():
    sched = Cluster(Settings(block_size=BS))
    sched.add_worker(WorkerRegistration("small", "model", 4, 0, BS, 256, [EOS]))
    sched.add_worker(WorkerRegistration("large", "model", 40, 0, BS, 256, [EOS]))
    sched.add_request(request("big", prompt_len=30))
    assert sched.schedule("small") is None and sched.schedule("large").new_sequences[0].rid == "big"


@pytest.mark.parametrize("req, message", [
    (Request("r", "model", [], SamplingParams(), 0.0), "the prompt is empty"),
    (Request("r", "model", [3, -1], SamplingParams(), 0.0), "token ids must be 0 or more"),
    (Request("r", "model", [3, 600], SamplingParams(), 0.0), "token id 600 is outside the vocabulary of the model "
                                                              "on worker w0 (0..511)"),
    (Request("r", "model", [3], SamplingParams(logit_bias=[(700, 1.0)]), 0.0), "token id 700 is outside"),
    (Request("r", "model", [3], SamplingParams(allowed_token_ids=[5, 800]), 0.0), "token id 800 is outside"),
])
def test_bad_requests_fail_with_a_clear_message(req, message):
    """What decoding cannot check (it checks the parameters: tests/test_protocol.py)."""
    sched, _ = make()
    sched.add_request(req)
    (done,) = sched.pop_finished()
    assert done.finish_reason == "error" and message in done.error and not sched.has_unfinished()
    assert done.error_kind == REJECTED


def test_outputs_for_a_sample_that_does_not_exist_are_refused():
    sched, _ = make()
    sched.add_request(request("r"), {3: [5]})
    (done,) = sched.pop_finished()
    assert done.error == "outputs given for sample 3 of a request with n=1"


def test_unusable_registration_is_refused():
    sched, _ = make()
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        sched.add_worker(WorkerRegistration("w1", "model", 16, 0, 12, 256, [EOS]))
    with pytest.raises(ValueError, match="num_blocks >= 2"):
        sched.add_worker(WorkerRegistration("w1", "model", 1, 0, BS, 256, [EOS]))
    assert sched.worker_ids == ["w0"]


# ---- several workers --------------------------------------------------------------------------
def test_requests_of_a_lost_worker_resume_elsewhere_keeping_their_tokens():
    requests = [request(rid, max_tokens=12) for rid in "abcd"]
    sched, sims = make(workers=("w0", "w1"), enable_prefix_caching=False)
    for req in requests:
        sched.add_request(req)
    outputs: dict[tuple[str, int], list[int]] = {}
    drive(sched, sims, outputs, rounds=4)
    on_w0 = {rs.rid for rs in sched.workers["w0"].running}
    assert on_w0 and all(outputs[(rid, 0)] for rid in on_w0)
    before = {rid: list(outputs[(rid, 0)]) for rid in on_w0}
    sched.remove_worker("w0")
    assert sched.worker_ids == ["w1"]
    plans = drive(sched, sims, outputs)
    moved = {n.rid: n.output_token_ids for n in plans[0].new_sequences}
    assert moved == before, "the moved requests resume from prompt + the tokens they had"
    assert outputs == reference_outputs(requests), "every token exactly once, the same tokens"


def test_a_new_request_goes_where_its_prefix_is_cached():
    sched, sims = make(workers=("w0", "w1"))
    prefix = list(range(200, 232))  # 4 blocks
    sched.add_request(request("first", prompt=prefix + [1, 2, 3], max_tokens=2))
    drive(sched, sims)
    warm = next(wid for wid, ws in sched.workers.items() if ws.snapshot().cached_block_ids)
    cold = "w1" if warm == "w0" else "w0"
    sched.add_request(request("second", prompt=prefix + [4, 5], max_tokens=2))
    sched.add_request(request("other", prompt=list(range(300, 335)), max_tokens=2))
    assert sched.requests["second"].worker_id == warm, "the longest prefix hit wins"
    assert sched.requests["other"].worker_id == cold, "without a hit, the least loaded worker"
    hits = sched.stats(0.0).workers[sched.worker_ids.index(warm)].prefix_hits
    drive(sched, sims)
    assert sched.stats(0.0).workers[sched.worker_ids.index(warm)].prefix_hits - hits == 32


def test_queued_work_outweighs_a_short_prefix_hit():
    sched, sims = make(workers=("w0", "w1"))
    prefix = list(range(200, 208))  # 1 block
    sched.add_request(request("first", prompt=prefix + [1, 2], max_tokens=1))
    drive(sched, sims)
    warm = next(wid for wid, ws in sched.workers.items() if ws.snapshot().cached_block_ids)
    cold = "w1" if warm == "w0" else "w0"
    sched.add_request(request("queued", prompt=list(range(400, 440)), max_tokens=4))
    assert sched.requests["queued"].worker_id == warm, "a tie goes to the first worker"
    sched.add_request(request("second", prompt=prefix + [9, 9], max_tokens=2))
    assert sched.requests["second"].worker_id == cold, "40 queued tokens there outweigh an 8-token hit"


def test_re_registering_a_worker_is_a_no_op_and_a_changed_one_starts_over():
    sched, sims = make()
    sched.add_request(request("r", max_tokens=6))
    drive(sched, sims, rounds=2)
    reg = sims["w0"].reg
    sched.add_worker(reg)
    assert sched.requests["r"].seqs, "the same registration again changes nothing"
    bigger = WorkerRegistration(reg.worker_id, reg.model_id, 128, 0, BS, 256, [EOS])
    sched.add_worker(bigger)
    assert not sched.requests["r"].seqs and sched.workers["w0"].stats().num_blocks == 127
    plans = drive(sched, {"w0": SimWorker(bigger, pick)})
    assert len(plans[0].new_sequences[0].output_token_ids) == 2


# ---- the plan in flight, aborts, failures, restarts -------------------------------------------
def test_one_plan_in_flight_and_stale_results_are_ignored():
    sched, sims = make(async_scheduling=False)
    sched.add_request(request("r", max_tokens=4))
    plan = sched.schedule("w0")
    assert sched.schedule("w0") is None
    result = sims["w0"].execute(plan).result
    sched.apply_result(dataclasses.replace(result, step_id=plan.step_id + 1))
    sched.apply_result(dataclasses.replace(result, epoch=plan.epoch + 1))
    sched.apply_result(dataclasses.replace(result, worker_id="nobody"))
    assert sched.schedule("w0") is None, "still waiting for the real result"
    sched.apply_result(result)
    token = result.token_ids[0]
    assert sched.requests["r"].outputs == [[token]]
    sched.apply_result(result)
    assert sched.requests["r"].outputs == [[token]], "a replayed result is ignored"
    assert sched.schedule("w0").step_id == plan.step_id + 1


def test_a_lookahead_plans_the_next_token_while_the_step_runs():
    sched, sims = make()
    sched.add_request(request("r", max_tokens=3))
    first = sched.schedule("w0")
    ahead = sched.schedule("w0")
    assert sched.schedule("w0") is None, "two plans in flight at most"
    assert [(s.num_computed_tokens, s.num_new_tokens, s.new_block_ids) for s in ahead.sequences()] == [(8, 1, [2])]
    results = [sims["w0"].execute(first).result, sims["w0"].execute(ahead).result]
    sched.apply_result(results[1])
    assert sched.requests["r"].outputs == [[]], "results are taken in plan order"
    for result in results:
        sched.apply_result(result)
    third = sched.schedule("w0")
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in third.sequences()] == [(9, 1)]
    assert sched.schedule("w0") is None, "its token in flight is the last (max_tokens=3): no lookahead"
    results.append(sims["w0"].execute(third).result)
    sched.apply_result(results[-1])
    assert sched.pop_finished() == [FinishedRequest("r", "length")] and used_blocks(sched) == 0
    assert [token for result in results for token in result.token_ids] == [pick("r", 0, i) for i in range(3)]


def test_with_a_clock_the_lookahead_waits_until_shortly_before_the_step_in_flight_ends():
    """So that a request arriving while a step runs joins the very next step, not the one after it."""
    sched, sims = make()
    sched.add_request(request("r", max_tokens=50))
    plans = sched.plans("w0", now=0.0)
    assert len(plans) == 2, "no step timed yet: the lookahead goes at once"
    sched.apply_result(sims["w0"].execute(plans[0]).result, now=0.1)  # a step of 100 ms; the next one begins
    assert sched.plans("w0", now=0.1) == [] and sched.lookahead_due(0.1) == pytest.approx(0.175), "a 25 ms lead"
    sched.add_request(request("late", max_tokens=5))
    assert sched.plans("w0", now=0.17) == []
    (ahead,) = sched.plans("w0", now=0.176)
    assert [s.num_new_tokens for s in ahead.sequences()] == [1, 8], "r's token and the arrival's prompt"
    assert sched.lookahead_due(0.176) is None, "two plans in flight"
    waited = dataclasses.replace(sims["w0"].execute(plans[1]).result, waited=0.01)  # the worker waited for it
    sched.apply_result(waited, now=0.3)
    assert sched.lookahead_due(0.3) == pytest.approx(0.3 + 0.075 - 0.01), "a wait moves lookaheads earlier"
    assert len(sched.plans("w0")) == 1, "without a clock it goes at once"


def test_a_wait_for_a_plan_sent_to_an_idle_worker_does_not_move_the_lookahead():
    """The worker counts the wait while it holds a sequence that ended; only a lookahead it waited for was late."""
    sched, sims = make()
    sched.add_request(request("a", max_tokens=2))
    first, ahead = sched.plans("w0", now=0.0)
    sched.apply_result(sims["w0"].execute(first).result, now=0.1)
    sched.apply_result(sims["w0"].execute(ahead).result, now=0.2)
    assert sched.pop_finished() == [FinishedRequest("a", "length")]
    sched.add_request(request("b", max_tokens=50))
    (alone,) = sched.plans("w0", now=1.0)
    sched.apply_result(dataclasses.replace(sims["w0"].execute(alone).result, waited=0.8), now=1.1)
    sched.plans("w0", now=1.1)
    assert sched.lookahead_due(1.1) == pytest.approx(1.1 + 0.075), "steps of 100 ms, and no wait for a lookahead"


def test_a_lookahead_the_clock_held_past_the_end_of_the_step_widens_the_lead_by_the_workers_wait():
    """The scheduler got to the lookahead only after the step's result: planned as if to an idle worker, it is still
    the late lookahead, and the worker's wait for it moves the next ones earlier."""
    sched, sims = make()
    sched.add_request(request("r", max_tokens=50))
    plans = sched.plans("w0", now=0.0)
    sched.apply_result(sims["w0"].execute(plans[0]).result, now=0.1)
    assert sched.plans("w0", now=0.12) == [], "held until 0.175"
    sched.apply_result(sims["w0"].execute(plans[1]).result, now=0.2)  # the step ended first
    (late,) = sched.plans("w0", now=0.21)
    sched.apply_result(dataclasses.replace(sims["w0"].execute(late).result, waited=0.01), now=0.31)
    sched.plans("w0", now=0.31)
    assert sched.lookahead_due(0.31) == pytest.approx(0.31 + 0.075 - 0.01), "steps of 100 ms; a 10 ms wait"


def test_a_sample_that_stops_in_flight_is_skipped_by_the_lookahead_and_freed():
    eos_at_1 = lambda rid, sample, index: EOS if index == 1 else pick(rid, sample, index)  # noqa: E731
    sched, sims = make()
    sims["w0"].pick = eos_at_1
    sched.add_request(request("r", max_tokens=10))
    plans = [sched.schedule("w0"), sched.schedule("w0")]
    results = [sims["w0"].execute(p).result for p in plans]
    sched.apply_result(results[0])
    plans.append(sched.schedule("w0"))
    results.append(sims["w0"].execute(plans[2]).result)
    sched.apply_result(results[1])
    assert results[1].token_ids == [EOS]
    assert used_blocks(sched) == 0 and not sched.has_unfinished(), "its blocks are free at once"
    assert sched.pop_finished() == [], "its end waits for the plan in flight that still carries it"
    assert results[2].token_ids == [], "the worker knew the sample had stopped"
    sched.apply_result(results[2])
    assert sched.pop_finished() == [FinishedRequest("r", "stop")] and sched.schedule("w0") is None


def test_an_abort_with_a_lookahead_in_flight_frees_everything():
    sched, sims = make()
    sched.add_request(request("r", prompt_len=20, max_tokens=50))
    plans = [sched.schedule("w0"), sched.schedule("w0")]
    sched.abort("r")
    assert used_blocks(sched) == 0
    for plan in plans:
        sched.apply_result(sims["w0"].execute(plan).result)
    assert sched.pop_finished() == [FinishedRequest("r", "abort")] and not sched.has_unfinished()


def test_a_lookahead_never_preempts_it_drains_the_pipeline_for_a_full_step():
    # 3 usable blocks of 8: two 8-token prompts, each needs a second block for its first generated token
    sched, sims = make(num_blocks=4, enable_prefix_caching=False)
    sched.add_request(request("a", max_tokens=20))
    sched.add_request(request("b", max_tokens=20))
    first = sched.schedule("w0")
    assert len(first.sequences()) == 2 and used_blocks(sched) == 2
    ahead = sched.schedule("w0")
    assert [s.seq_id for s in ahead.sequences()] == [first.sequences()[0].seq_id], \
        "a gets the last block; b would preempt"
    assert sched.num_preemptions == 0
    for plan in (first, ahead):
        sched.apply_result(sims["w0"].execute(plan).result)
    full = sched.schedule("w0")
    assert sched.num_preemptions == 1 and [s.seq_id for s in full.sequences()] == [first.sequences()[0].seq_id]


def test_a_missing_token_fails_the_request():
    """The worker samples all it is asked to but sequences it saw end, as the scheduler does: a token that
    does not come back means they disagree, and sampling again could go on forever."""
    sched, sims = make()
    sched.add_request(request("r", max_tokens=5))
    sched.add_request(request("s", max_tokens=5))
    kept = _step_losing_tokens_of(sched, sims, "r")
    assert sched.requests["s"].outputs == [[kept.token_id]]


def _step_losing_tokens_of(sched, sims, rid: str) -> TokenOutput:
    """Plan a step, and apply its result less `rid`'s tokens: that request fails, the other's one token counts."""
    outcome = sims["w0"].execute(sched.schedule("w0"))
    (kept,) = [i for i, out in enumerate(outcome.outputs) if out.rid != rid]
    result = outcome.result
    sched.apply_result(dataclasses.replace(result, seq_ids=[result.seq_ids[kept]], token_ids=[result.token_ids[kept]]))
    (done,) = sched.pop_finished()
    assert done.rid == rid and done.error_kind == FAILED and "returned no token for sample 0" in done.error
    return outcome.outputs[kept]


def test_a_missing_decode_token_fails_its_request_alone():
    """The same for the fast lane's tokens (a plan's `decodes`), taken from the result by sequence id."""
    sched, sims = make()
    sched.add_request(request("r", max_tokens=9))
    sched.add_request(request("s", max_tokens=9))
    plans = drive(sched, sims, rounds=2)
    assert len(plans[-1].decodes.seq_ids) == 2 and not plans[-1].scheduled, "both decode in the fast lane"
    kept = _step_losing_tokens_of(sched, sims, "r")
    assert sched.requests["s"].outputs[0][-1] == kept.token_id
    drive(sched, sims)
    assert [d.rid for d in sched.pop_finished()] == ["s"]


def test_a_request_the_worker_refused_leaves_no_prefix_hit():
    """The worker computed nothing for a request it refused: none of its blocks may serve the next prompt."""
    sched, sims = make()
    prompt = [60 + i for i in range(3 * BS + 1)]
    sched.add_request(request("r", prompt=prompt, max_tokens=4))
    result = sims["w0"].execute(sched.schedule("w0")).result
    sched.apply_result(dataclasses.replace(result, seq_ids=[], token_ids=[],
                                           refused=[RefusedRequest("r", "bad step plan: forged")]))
    (done,) = sched.pop_finished()
    assert done.rid == "r" and done.error_kind == FAILED
    sched.add_request(request("t", prompt=prompt, max_tokens=4))
    drive(sched, sims)
    stats = sched.workers["w0"].stats()
    assert stats.prefix_queries >= len(prompt) and stats.prefix_hits == 0


def test_abort_frees_blocks_and_tells_the_worker():
    sched, sims = make()
    sched.add_request(request("r", prompt_len=20, max_tokens=50))
    plans = drive(sched, sims, rounds=3)
    seq_id = plans[0].new_sequences[0].seq_id
    assert used_blocks(sched) == 3
    sched.abort("r")
    sched.abort("r")
    sched.abort("unknown")
    assert sched.pop_finished() == [FinishedRequest("r", "abort")]
    assert used_blocks(sched) == 0 and not sched.has_unfinished()
    sched.add_request(request("s", max_tokens=1))
    assert sched.schedule("w0").freed == [seq_id]


def test_an_abort_while_the_step_runs_drops_its_tokens():
    sched, sims = make()
    sched.add_request(request("r", max_tokens=5))
    plan = sched.schedule("w0")
    result = sims["w0"].execute(plan).result
    sched.abort("r", "stop")  # a stop string the gateway found
    sched.apply_result(result)
    assert sched.pop_finished() == [FinishedRequest("r", "stop")] and used_blocks(sched) == 0


def test_a_failed_step_fails_its_requests():
    sched, _ = make()
    sched.add_request(request("r", max_tokens=5))
    sched.add_request(request("s", max_tokens=5))
    plan = sched.schedule("w0")
    sched.apply_result(StepResult("w0", plan.epoch, plan.step_id, [], error="CUDA error: out of memory"))
    done = sched.pop_finished()
    assert [d.rid for d in done] == ["r", "s"]
    assert all(d.finish_reason == "error" and "out of memory" in d.error and d.error_kind == FAILED for d in done)
    assert used_blocks(sched) == 0


def test_restart_resumes_from_the_tokens_already_sent():
    sched, sims = make()
    req = request("r", prompt_len=10, max_tokens=5, n=3)
    sent = {0: [7, 8, 9], 1: [7, 7, 7, 7, 7], 2: [7, EOS]}
    sched.add_request(req, {k: list(v) for k, v in sent.items()}, {2: "stop"})  # EOS is the worker's to see
    outputs = {(req.rid, k): list(v) for k, v in sent.items()}
    plans = drive(sched, sims, outputs)
    assert [(n.sample_index, n.output_token_ids) for n in plans[0].new_sequences] == [(0, [7, 8, 9])]
    assert len(outputs[("r", 0)]) == 5 and outputs[("r", 1)] == sent[1] and outputs[("r", 2)] == sent[2]
    assert sched.pop_finished() == [FinishedRequest("r", "length")]


def test_a_request_with_every_sample_done_finishes_at_once():
    sched, _ = make()
    sched.add_request(request("r", max_tokens=2), {0: [5, 6]})
    assert sched.pop_finished() == [FinishedRequest("r", "length")] and not sched.has_unfinished()


def test_requests_wait_for_a_worker_then_expire():
    sched = Cluster(Settings(block_size=BS, request_timeout=10.0))
    sched.add_request(request("early"))
    sched.expire(100.0)
    sched.expire(109.0)
    assert sched.has_unfinished() and sched.stats(109.0).waiting == 1
    sched.expire(111.0)
    assert sched.pop_finished() == [
        FinishedRequest("early", "error", "no worker could take the request within 10 s", UNAVAILABLE)]
    sched.add_request(request("late"))
    sched.expire(200.0)
    sched.add_worker(WorkerRegistration("w0", "model", 16, 0, BS, 256, [EOS]))
    sched.expire(300.0)
    assert sched.has_unfinished() and sched.requests["late"].worker_id == "w0"


def test_a_request_the_cache_cannot_grow_into_ends_with_length():
    sched, sims = make(num_blocks=4)  # 24 tokens of KV
    sched.add_request(request("r", prompt_len=10, max_tokens=30))
    outputs: dict[tuple[str, int], list[int]] = {}
    drive(sched, sims, outputs)
    assert sched.pop_finished() == [FinishedRequest("r", "length")]
    assert len(outputs[("r", 0)]) == 24 - 10 + 1, "it ran until every block held its tokens"


def test_stats():
    sched, sims = make(num_blocks=7, enable_prefix_caching=False)
    for rid in "abcd":
        sched.add_request(request(rid))
    while sched.num_preemptions == 0:
        drive(sched, sims, rounds=1)
    stats = sched.stats(5.0)
    ws = sched.workers["w0"]
    assert (stats.time, stats.running, stats.preempted, stats.preemptions) == (5.0, len(ws.running), 1, 1)
    assert stats.waiting == len(ws.waiting) == 4 - len(ws.running) - 1
    (worker,) = stats.workers
    assert (worker.worker_id, worker.num_blocks, worker.free_blocks) == ("w0", 6, ws.kv.num_free)
    assert worker.running == ws.num_running_seqs and worker.prefix_queries > 0 and worker.prefix_hits == 0


def test_duplicate_delivery_of_a_request_is_ignored():
    sched, _ = make()
    assert sched.add_request(request("r"))
    assert not sched.add_request(request("r", prompt_len=3))
    assert len(sched.workers["w0"].waiting) == 1 and sched.requests["r"].prompt == request("r").prompt_token_ids


def test_a_request_ended_on_arrival_is_known_until_its_end_is_handed_out():
    """A second request under the id of one refused on arrival, before the service wrote its end, is not taken: it
    would end twice."""
    sched, _ = make(max_model_len=64)
    assert sched.add_request(request("long", prompt_len=80))  # past max_model_len: ends at once, with an error
    assert sched.knows("long") and not sched.add_request(request("long"))
    (done,) = sched.pop_finished()
    assert done.rid == "long" and done.finish_reason == "error" and not sched.knows("long")


# ---- the contiguous-reservation baseline (benchmarks/baselines.py) ----------------------------
@pytest.mark.parametrize("reserving, batch", [(False, 8), (True, 3)])
def test_reserving_max_model_len_shrinks_the_batch(reserving, batch):
    from benchmarks.baselines import reserving_scheduler

    # 24 blocks, 8 per 64 tokens
    sched, sims = make(num_blocks=25, max_model_len=64,
                       worker_scheduler=reserving_scheduler() if reserving else None)
    for k in range(8):
        sched.add_request(request(f"r{k}", max_tokens=8))
    peak = 0
    while sched.has_unfinished():
        drive(sched, sims, rounds=1)
        peak = max(peak, sched.stats(0.0).running)
    assert peak == batch and sched.num_preemptions == 0


# ---- beam search ------------------------------------------------------------------------------
def beam_request(rid: str, width: int, n: int, max_tokens: int = 12, prompt_len: int = 13, **params) -> Request:
    return request(rid, prompt_len=prompt_len, max_tokens=max_tokens, n=n, beam_width=width, ignore_eos=True, **params)


def test_beams_fork_on_shared_blocks_and_a_beam_that_dies_frees_its_own():
    sched, sims = make(enable_prefix_caching=False)
    sched.add_request(beam_request("b", width=3, n=2))
    ws = sched.workers["w0"]
    plans = drive(sched, sims, rounds=2)
    assert len(plans[0].new_sequences) == 1, "one beam until the first step's candidates are ranked"
    forks = [new for new in plans[1].new_sequences if new.fork_of is not None]
    assert len(forks) == 2 and all(not f.prompt_token_ids for f in forks), "forks take their parent's prompt"
    assert plans[1].copies and len(plans[1].sequences()) == 3, "each beam copies the shared last block it writes"
    rs = sched.requests["b"]
    tables = [ws.kv.block_ids(s.seq_id) for s in rs.seqs]
    assert tables[0][0] == tables[1][0] == tables[2][0], "the prompt's full block is shared by every beam"
    assert ws.kv.pool.blocks[tables[0][0]].ref_cnt == 3
    stats = sched.stats(0.0).workers[0]
    assert stats.forks >= 2 and stats.copies >= len(plans[1].copies) and stats.steps == 2 and stats.shared_blocks >= 1
    peak = 0
    while sched.has_unfinished():
        drive(sched, sims, rounds=1)
        peak = max(peak, used_blocks(sched))
    assert peak <= 3 * 4, "beams that die give their blocks back as they go"
    (done,) = sched.pop_finished()
    assert done.finish_reason == "length" and len(done.beams) == 2 and used_blocks(sched) == 0
    assert all(len(b.tokens) == 12 for b in done.beams) and done.beams[0].score >= done.beams[1].score
    assert all(abs(b.score - sum(b.logprobs) / 12) < 1e-9 for b in done.beams), "length penalty 1: mean logprob"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_beam_search_resumes_whole_and_ends_the_same(mode):
    def run(num_blocks: int) -> tuple[list, int]:
        sched, sims = make(num_blocks=num_blocks, num_swap=32, preemption_mode=mode, enable_prefix_caching=False)
        sched.add_request(beam_request("b", width=4, n=4, max_tokens=20, prompt_len=20))
        sched.add_request(request("x", prompt_len=20, max_tokens=20))
        drive(sched, sims)
        return {d.rid: d for d in sched.pop_finished()}, sched.num_preemptions
    reference, calm = run(256)
    squeezed, preemptions = run(14)
    assert calm == 0 and preemptions > 0
    assert [(b.tokens, b.score) for b in squeezed["b"].beams] == [(b.tokens, b.score) for b in reference["b"].beams]


@pytest.mark.parametrize("mode, async_scheduling", [("recompute", True), ("swap", True), ("recompute", False)])
def test_the_decode_fast_lane_plans_exactly_what_the_general_path_plans(monkeypatch, mode, async_scheduling):
    """WorkerScheduler._decode_alone plans most steps' tokens without the general path's objects: on a crowded cache
    (preemption, copy-on-write of n > 1, shared prefixes, EOS), every plan and every token is what the general
    path alone makes (its tokens travel as the plan's `decodes` columns: a plan is compared as the sequences it
    computes, by id)."""
    def run() -> tuple[list[bytes], dict, int]:
        sched, sims = make(num_blocks=14, num_swap=32, preemption_mode=mode, async_scheduling=async_scheduling)
        sims["w0"].pick = lambda rid, sample, index: EOS if (index + len(rid)) % 23 == 0 else pick(rid, sample, index)
        for i, rid in enumerate(["a", "bb", "ccc", "dddd", "ee", "f"]):
            sched.add_request(request(rid, prompt_len=5 + 4 * i, max_tokens=12 + 5 * i, n=2 if rid == "ee" else 1,
                                      prompt=[7] * 16 + [60 + i] * 3 if rid in ("a", "f") else None))
        outputs: dict = {}
        plans = drive(sched, sims, outputs)
        computed = [encode(dataclasses.replace(plan, scheduled=sorted(plan.sequences(), key=lambda s: s.seq_id),
                                               decodes=Decodes())) for plan in plans]
        return computed, outputs, sum(len(plan.decodes.seq_ids) for plan in plans)
    *fast, fast_lane = run()
    calls = []
    monkeypatch.setattr(WorkerScheduler, "_decode_alone", lambda self, running, i, step: calls.append(i) or i)
    *general, general_lane = run()
    assert calls and fast_lane > 0 and general_lane == 0 and fast == general
