"""The discrete-event driver of the simulated benchmarks (benchmarks/discrete_event.py) and the Orca-style
reservations it runs (benchmarks/baselines.py).

Oracles: the cost model's step times summed by hand along a request's steps, and the number of reservations
that fit in a worker's cache.
"""
from __future__ import annotations

import pytest

from benchmarks.baselines import reserving_scheduler
from benchmarks.discrete_event import Simulation
from pagedserve.workloads import SampleRequest
from gpu_worker.cost_model import ChunkSize, get_profile
from shared.settings import Settings

PROFILE = get_profile("a100-40gb-opt-13b")


def test_a_lone_request_takes_the_cost_model_time_of_its_steps():
    simulation = Simulation(Settings(max_model_len=2048), PROFILE, 1)
    (timing,) = simulation.run([SampleRequest(list(range(100)), 5)], [3.0])
    prefill = PROFILE.step_time([ChunkSize(0, 100)], 1)
    decodes = [PROFILE.step_time([ChunkSize(100 + i, 1)], 1) for i in range(4)]
    assert timing.token_times[0] == pytest.approx(3.0 + prefill)
    assert timing.end == pytest.approx(3.0 + prefill + sum(decodes)), "it ends with its last token"
    assert simulation.stats()["steps"] == 5


def test_requests_arriving_together_share_steps_and_each_gets_its_tokens():
    simulation = Simulation(Settings(max_model_len=2048), PROFILE, 2)
    requests = [SampleRequest([7 + i] * (20 + i), 8 + i) for i in range(6)]
    timings = simulation.run(requests, [0.0] * 6)
    assert [len(t.token_times) for t in timings] == [8 + i for i in range(6)]
    assert all(t.error is None and t.end >= t.token_times[-1] for t in timings)
    assert simulation.stats()["max_batch_seqs"] == 3, "6 requests over 2 workers, each worker batches its 3"


@pytest.mark.parametrize("reservation, concurrent", [
    ("max", 2),  # 512 tokens = 32 of the 64 usable blocks each
    ("pow2", 9),  # 40 + 64 = 104 tokens = 7 blocks each
    ("oracle", 12),  # 40 + 40 = 80 tokens = 5 blocks each
    (None, 16),  # pagedserve: blocks as they fill, up to max_num_seqs
])
def test_a_reservation_limits_the_batch_to_the_reservations_that_fit(reservation, concurrent):
    settings = Settings(max_model_len=512, num_blocks=65, watermark=0.0, max_num_seqs=16, swap_space_bytes=0)
    worker_scheduler = reserving_scheduler(reservation) if reservation else None
    simulation = Simulation(settings, PROFILE, 1, worker_scheduler)
    timings = simulation.run([SampleRequest([i] * 40, 40) for i in range(20)], [0.0] * 20)  # no shared prefix
    assert all(len(t.token_times) == 40 for t in timings)
    assert simulation.stats()["max_batch_seqs"] == concurrent
