"""The in-process engine: the cluster core and worker cores wired together with no Redis.

The same plans and results the services pass over the bus pass here by function call, in the same
order: each step, every worker gets the plans its scheduler will give (with async scheduling, the step
and its lookahead), runs the oldest, and its result goes back. So the services must produce exactly
this engine's tokens. Tests, benchmarks and the offline API use it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from shared.protocol import PromptLogprob, Request, StepPlan, TokenOutput
from shared.sampling import SamplingParams
from shared.settings import Settings


@dataclass(slots=True)
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class Completion:
    rid: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    error: str | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
    prompt_logprobs: list[PromptLogprob] | None = None  # when asked for: one per prompt token after the first

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finish_reason is not None for s in self.samples)


class Engine:
    def __init__(self, settings: Settings, num_workers: int = 1) -> None:
        from gpu_worker.worker_factory import make_worker
        from scheduler.cluster import Cluster

        self.settings = settings
        self.cluster = Cluster(settings)
        self.workers = {}
        self.queued: dict[str, list[StepPlan]] = {}  # plans sent to each worker, not yet run
        for i in range(num_workers):
            worker = make_worker(settings, f"worker-{i}")
            self.workers[worker.registration.worker_id] = worker
            self.queued[worker.registration.worker_id] = []
            self.cluster.add_worker(worker.registration)
        first = next(iter(self.workers.values())).registration
        self.model_id = first.model_id
        self.max_model_len = first.max_model_len
        self.completions: dict[str, Completion] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, rid: str | None = None) -> str:
        rid = rid or f"req-{next(self._ids)}"
        params.validate()
        self.cluster.add_request(Request(rid, self.model_id, list(prompt_token_ids), params, time.time()))
        self.completions[rid] = Completion(rid, list(prompt_token_ids), [Sample() for _ in range(params.n)])
        return rid

    def abort(self, rid: str) -> None:
        self.cluster.abort(rid, "abort", time.time())

    def step(self) -> list[TokenOutput]:
        """One step on every worker that has work; returns the tokens it produced."""
        outputs: list[TokenOutput] = []
        ran = False
        for worker_id, worker in self.workers.items():
            queued = self.queued[worker_id]
            queued.extend(self.cluster.plans(worker_id))
            if not queued:
                continue
            ran = True
            outcome = worker.execute(queued.pop(0))
            self.cluster.apply_result(outcome.result)
            outputs.extend(outcome.outputs)
        for out in outputs:
            completion = self.completions[out.rid]
            if out.num_cached_tokens is not None:  # the prompt's results come with a first token
                completion.num_cached_tokens, completion.prompt_logprobs = out.num_cached_tokens, out.prompt_logprobs
            sample = completion.samples[out.sample_index]
            sample.token_ids.append(out.token_id)
            sample.logprobs.append(out.logprob)
            sample.top_logprobs.append(out.top_logprobs)
            sample.finish_reason = out.finish_reason
        if not self._settle() and not ran and self.cluster.has_unfinished():
            raise RuntimeError("the scheduler planned nothing while requests are unfinished")
        return outputs

    def _settle(self) -> int:
        """Record requests that ended (finished, aborted, rejected); returns how many."""
        finished = self.cluster.pop_finished()
        for done in finished:
            completion = self.completions[done.rid]
            completion.error = done.error
            for sample, beam in zip(completion.samples, done.beams or ()):  # a beam search's results
                sample.token_ids, sample.logprobs = list(beam.tokens), list(beam.logprobs)
                sample.finish_reason = beam.finish_reason
            for sample in completion.samples:
                sample.finish_reason = sample.finish_reason or done.finish_reason
        return len(finished)

    def has_unfinished(self) -> bool:
        return self.cluster.has_unfinished() or any(self.queued.values())

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run prompts (token ids) to completion, batched together; completions in prompt order."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        while self.has_unfinished():
            self.step()
        self._settle()
        return [self.completions.pop(rid) for rid in rids]
