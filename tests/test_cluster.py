"""The cluster's policies, without Redis: workers joining, restarting, expiring and stalling; aborts that
overtake their request; requests of a gateway that is gone; resuming a request from its stream."""
from __future__ import annotations

import dataclasses

from sched_sim import SimWorker, drive
from scheduler.cluster import Cluster, Orphans
from scheduler.request import FinishedRequest
from shared.protocol import Assignment, Request, TokenOutput, WorkerRegistration
from shared.sampling import SamplingParams
from shared.settings import Settings

BS = 8
EOS = 1


def reg(worker_id: str, instance: str = "i1", num_blocks: int = 64) -> WorkerRegistration:
    return WorkerRegistration(worker_id, "model", num_blocks, 0, BS, 256, [EOS], instance, vocab_size=512)


def pick(rid: str, sample: int, index: int) -> int:
    return 2 + (sum(map(ord, rid)) + 5 * sample + 3 * index) % 40


def request(rid: str, max_tokens: int = 6, gateway: str = "", n: int = 1) -> Request:
    return Request(rid, "model", [50 + (ord(rid[-1]) * 7 + i) % 300 for i in range(12)],
                   SamplingParams(max_tokens=max_tokens, n=n), 0.0, gateway)


def test_sync_workers_adds_the_live_drops_the_gone_and_refuses_the_unusable():
    cluster = Cluster(Settings(block_size=BS))
    changes = cluster.sync_workers({"w0": reg("w0"), "bad": dataclasses.replace(reg("bad"), block_size=12)})
    assert [r.worker_id for r in changes.joined] == ["w0"] and cluster.worker_ids == ["w0"]
    assert [w for w, _ in changes.refused] == ["bad"] and "power of two" in changes.refused[0][1]
    assert cluster.sync_workers({"w0": reg("w0")}).joined == [], "the same registration again changes nothing"
    cluster.add_request(request("r"))
    changes = cluster.sync_workers({"w1": reg("w1")})
    assert changes.gone == ["w0"] and [r.worker_id for r in changes.joined] == ["w1"]
    assert cluster.requests["r"].worker_id == "w1", "the gone worker's request moved"


def test_a_restarted_worker_starts_over_and_its_requests_resume_from_their_tokens():
    cluster = Cluster(Settings(block_size=BS, async_scheduling=False))
    cluster.sync_workers({"w0": reg("w0")})
    cluster.add_request(request("r", max_tokens=8))
    sims = {"w0": SimWorker(reg("w0"), pick)}
    drive(cluster, sims, rounds=3)
    had = list(cluster.requests["r"].outputs[0])
    assert len(had) == 3
    cluster.sync_workers({"w0": reg("w0", instance="i2")})  # same id, a new process
    plan = cluster.schedule("w0")
    assert plan.new_sequences[0].output_token_ids == had, "resumed by recompute from the tokens it had"


def test_a_worker_stuck_in_a_step_is_quarantined_until_a_new_instance_registers():
    cluster = Cluster(Settings(block_size=BS, step_timeout=10.0))
    cluster.sync_workers({"w0": reg("w0"), "w1": reg("w1")})
    cluster.add_request(request("r"))
    stuck = cluster.requests["r"].worker_id
    other = "w1" if stuck == "w0" else "w0"
    cluster.pop_placements()
    assert cluster.schedule(stuck) is not None  # and its result never comes
    assert cluster.check_stalled(100.0) == [] and cluster.check_stalled(109.0) == []
    assert cluster.check_stalled(110.5) == [(stuck, 0, 10.5)]
    assert cluster.worker_ids == [other] and cluster.requests["r"].worker_id == other
    assert cluster.pop_placements() == [("r", other)], "readers learn that only the new worker's tokens count"
    live = {"w0": reg("w0"), "w1": reg("w1")}
    assert cluster.sync_workers(live).joined == [] and cluster.worker_ids == [other], "alive but stuck: kept out"
    live[stuck] = reg(stuck, instance="i2")
    assert [r.worker_id for r in cluster.sync_workers(live).joined] == [stuck], "a restart comes back"


def test_an_abort_that_overtakes_its_request_ends_it_on_arrival_unless_it_is_too_old():
    cluster = Cluster(Settings(block_size=BS, request_timeout=30.0))
    cluster.sync_workers({"w0": reg("w0")})
    cluster.abort("early", "abort", now=100.0)
    cluster.abort("stale", "abort", now=100.0)
    cluster.expire(120.0)
    cluster.add_request(request("early"))
    assert cluster.pop_finished() == [FinishedRequest("early", "abort")] and not cluster.has_unfinished()
    cluster.expire(131.0)
    cluster.add_request(request("stale"))
    assert cluster.pop_finished() == [] and cluster.requests["stale"].worker_id == "w0"


def test_the_requests_of_a_gateway_that_is_gone_are_aborted_and_their_blocks_freed():
    cluster = Cluster(Settings(block_size=BS, async_scheduling=False))
    cluster.sync_workers({"w0": reg("w0")})
    for rid, gateway in (("a1", "gw-a"), ("a2", "gw-a"), ("b1", "gw-b"), ("t1", "")):
        cluster.add_request(request(rid, max_tokens=50, gateway=gateway))
    sims = {"w0": SimWorker(reg("w0"), pick)}
    drive(cluster, sims, rounds=2)
    assert cluster.gateway_ids() == {"gw-a", "gw-b"}, "a request with no gateway is never orphaned"
    assert cluster.gateway_gone("gw-a", 5.0) == Orphans(taken_up=0, aborted=2)
    assert sorted((f.rid, f.finish_reason) for f in cluster.pop_finished()) == [("a1", "abort"), ("a2", "abort")]
    ws = cluster.workers["w0"]
    held = {s.seq_id for rs in ws.running for s in rs.seqs}
    assert set(ws.kv.seqs) == held and {rs.rid for rs in ws.running} == {"b1", "t1"}


def test_a_gone_gateways_requests_wait_out_the_grace_period_and_go_to_the_gateway_that_took_them_up():
    cluster = Cluster(Settings(block_size=BS, async_scheduling=False, reconnect_grace=10.0))
    cluster.sync_workers({"w0": reg("w0")})
    for rid in ("a1", "a2"):
        cluster.add_request(request(rid, max_tokens=50, gateway="gw-a"))
    drive(cluster, {"w0": SimWorker(reg("w0"), pick)}, rounds=2)
    assert cluster.orphaned({"gw-a"}, 100.0) == [] and cluster.orphaned({"gw-a"}, 109.9) == []
    assert cluster.orphaned(set(), 109.95) == [], "a gateway whose heartbeat came back starts its grace again"
    assert cluster.orphaned({"gw-a"}, 110.0) == [] and cluster.orphaned({"gw-a"}, 120.0) == ["gw-a"]
    assert cluster.gateway_gone("gw-a", 120.0, {"a2": "gw-b"}) == Orphans(taken_up=1, aborted=1)
    assert [(f.rid, f.finish_reason) for f in cluster.pop_finished()] == [("a1", "abort")]
    assert cluster.gateway_ids() == {"gw-b"} and cluster.requests_of("gw-b") == ["a2"]
    assert cluster.orphaned({"gw-b"}, 121.0) == [], "the gateway that took a request up has a grace period of its own"


def test_a_request_resumes_from_what_its_stream_holds_by_the_readers_rules():
    cluster = Cluster(Settings(block_size=BS), epoch=9)
    cluster.sync_workers({"w0": reg("w0")})

    def tok(sample: int, index: int, token: int, worker: str = "w0", epoch: int = 8, finish: str | None = None):
        return TokenOutput("r", sample, index, token, finish_reason=finish, worker_id=worker, epoch=epoch)
    entries = [Assignment("r", "w0", 8), tok(0, 0, 11), tok(1, 0, 21), tok(1, 1, 22, finish="stop"),
               tok(0, 1, 99, worker="w7"),  # a writer that was never assigned
               Assignment("r", "", 9),  # this scheduler's fence
               tok(0, 1, 12)]  # the old epoch's worker, still writing after the fence
    assert cluster.resume(request("r", n=2), entries)
    rs = cluster.requests["r"]
    assert rs.outputs == [[11], [21, 22]] and rs.reasons == [None, "stop"]
    ended = [Assignment("q", "w0", 8), TokenOutput("q", -1, 0, -1, finish_reason="abort")]
    assert not cluster.resume(request("q"), ended) and "q" not in cluster.requests


def test_a_request_the_stream_shows_complete_is_not_resumed():
    cluster = Cluster(Settings(block_size=BS))
    done = [Assignment("r", "w0", 1)] + [TokenOutput("r", 0, i, 5, finish_reason="length" if i == 1 else None,
                                                     worker_id="w0", epoch=1) for i in range(2)]
    assert not cluster.resume(request("r", max_tokens=2), done)
