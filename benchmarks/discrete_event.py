"""A discrete-event driver: the scheduler's cluster core and simulated workers on a virtual clock.

The objects the scheduler service and the worker services run (scheduler/cluster.py with its per-worker
schedulers, and gpu_worker/worker.py's core over a SimulatedRunner that does not pace), wired as the services
wire them with async scheduling, but with no Redis, no processes and no sleeping: a step the cost model says
takes 30 ms moves the clock 30 ms on, so an hour of a paper-scale trace runs in minutes of CPU. Bus round trips
and the scheduler's own time count as zero (the profile's per-step overhead stands for the host-side work).

Two kinds of event: a request arrives (the cluster places it), a worker's step ends (its result goes back and
its tokens are timed then). After each, the workers it touched get every plan their schedulers give (the step
and its lookahead), and an idle worker starts its next. A request ends when the cluster reports it ended, as a
client's stream ends on the scheduler's end entry.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.bench import RequestOutput, summarize
from pagedserve.workloads import SampleRequest
from gpu_worker.cost_model import Profile
from gpu_worker.simulated import SimulatedRunner, simulated_worker
from gpu_worker.worker import Worker
from scheduler.cluster import Cluster
from scheduler.worker_scheduler import WorkerSchedulerFactory
from shared.protocol import Request, StepOutcome, StepPlan
from shared.sampling import SamplingParams
from shared.settings import Settings

MODEL_ID = "simulated"
ClusterFactory = Callable[..., Cluster]  # (settings, worker_scheduler=...): Cluster or a subclass


@dataclass(slots=True)
class Timing:
    """One request as its client would see it."""
    prompt_tokens: int
    max_tokens: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None

    def output(self) -> RequestOutput:
        out = RequestOutput(self.prompt_tokens, self.max_tokens)
        if self.error is not None or self.end is None or not self.token_times:
            out.error = self.error or "the request did not end"
            return out
        out.success = True
        out.output_tokens = len(self.token_times)
        out.ttft = self.token_times[0] - self.arrival
        out.latency = self.end - self.arrival
        out.itl = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return out


@dataclass(slots=True)
class WorkerLoad:
    steps: int = 0
    sequences: int = 0  # summed over steps: sequences in each step
    most_sequences: int = 0  # in one step


class Simulation:
    def __init__(self, settings: Settings, profile: Profile, num_workers: int,
                 worker_scheduler: WorkerSchedulerFactory | None = None, cluster: ClusterFactory | None = None) -> None:
        self.settings = settings
        self.cluster = (cluster or Cluster)(settings, worker_scheduler=worker_scheduler)
        self.workers: dict[str, Worker] = {}
        for i in range(num_workers):
            worker = simulated_worker(profile, settings, f"worker-{i}", MODEL_ID,
                                      settings.max_model_len or profile.model.max_model_len,
                                      profile.model.vocab_size, [], pace=False)
            self.workers[worker.registration.worker_id] = worker
            self.cluster.add_worker(worker.registration)
        self.queued: dict[str, list[StepPlan]] = {w: [] for w in self.workers}
        self.busy: set[str] = set()
        self.load = {w: WorkerLoad() for w in self.workers}
        self.timings: dict[str, Timing] = {}
        self.now = 0.0
        self._events: list[tuple[float, int, str, Any]] = []
        self._order = itertools.count()

    @property
    def registration(self):
        return next(iter(self.workers.values())).registration

    def run(self, requests: list[SampleRequest], arrivals: list[float]) -> list[Timing]:
        """Serve `requests` arriving at `arrivals` (seconds) to the end; their timings, in request order."""
        rids = []
        for i, (req, at) in enumerate(zip(requests, arrivals)):
            rid = f"req-{i}"
            rids.append(rid)
            self.timings[rid] = Timing(len(req.prompt_token_ids), req.max_tokens, at)
            self._push(at, "arrival", (rid, req))
        while self._events:
            self.now, _, kind, payload = heapq.heappop(self._events)
            if kind == "arrival":
                rid, req = payload
                params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
                self.cluster.add_request(Request(rid, MODEL_ID, list(req.prompt_token_ids), params, self.now))
                touched = {wid for _, wid in self.cluster.pop_placements()}
            else:
                worker_id, outcome = payload
                self.busy.discard(worker_id)
                self._apply(outcome)
                touched = {worker_id} | {wid for _, wid in self.cluster.pop_placements()}
            for done in self.cluster.pop_finished():
                timing = self.timings[done.rid]
                timing.end = self.now
                timing.error = done.error
            for worker_id in touched:
                self._pump(worker_id)
        return [self.timings[rid] for rid in rids]

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (at, next(self._order), kind, payload))

    def _apply(self, outcome: StepOutcome) -> None:
        self.cluster.apply_result(outcome.result)
        for out in outcome.outputs:
            self.timings[out.rid].token_times.append(self.now)

    def _pump(self, worker_id: str) -> None:
        """Send the worker every plan its scheduler gives now; start the oldest if the worker is idle."""
        queued = self.queued[worker_id]
        while (plan := self.cluster.schedule(worker_id)) is not None:
            queued.append(plan)
        if worker_id in self.busy or not queued:
            return
        plan = queued.pop(0)
        worker = self.workers[worker_id]
        outcome = worker.execute(plan)
        runner: SimulatedRunner = worker.runner
        load = self.load[worker_id]
        load.steps += 1
        load.sequences += plan.num_sequences
        load.most_sequences = max(load.most_sequences, plan.num_sequences)
        self.busy.add(worker_id)
        self._push(self.now + runner.last_step_s, "step", (worker_id, outcome))

    def stats(self) -> dict[str, Any]:
        """What the scheduler saw: steps, batch sizes, preemptions, prefix-cache lookups and hits."""
        steps = sum(w.steps for w in self.load.values())
        snapshot = self.cluster.stats(self.now)
        queries = sum(w.prefix_queries for w in snapshot.workers)
        return {
            "steps": steps,
            "mean_batch_seqs": sum(w.sequences for w in self.load.values()) / steps if steps else 0.0,
            "max_batch_seqs": max(w.most_sequences for w in self.load.values()),
            "preemptions": snapshot.preemptions,
            "prefix_queries": queries,
            "prefix_hits": sum(w.prefix_hits for w in snapshot.workers),
            "num_blocks": self.registration.num_blocks,
        }


def point(simulation: Simulation, requests: list[SampleRequest], arrivals: list[float], rate: float) -> dict[str, Any]:
    """Run one sweep point; a report point as pagedserve/bench.py writes it (virtual seconds), plus the
    scheduler's view."""
    timings = simulation.run(requests, arrivals)
    outputs = [t.output() for t in timings]
    duration = max((t.end for t in timings if t.end is not None), default=0.0) - min(arrivals, default=0.0)
    result: dict[str, Any] = {"request_rate": rate, "num_prompts": len(requests)}
    result.update(summarize(outputs, duration))
    result.update(simulation.stats())
    return result
