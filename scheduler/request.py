"""Scheduler-side state of a request and of its sequences (one per sample)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shared.protocol import Request


class Status(enum.Enum):
    WAITING = "waiting"  # never admitted on its current worker (or on no worker yet)
    RUNNING = "running"
    PREEMPTED = "preempted"  # by recompute: holds no blocks, resumes from prompt + output
    SWAPPED = "swapped"  # its blocks sit in the worker's swap area
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    sample_index: int
    token_ids: list[int]  # prompt + output, as the worker's token list
    output: list[int]  # the request's output list of this sample (the same list object)
    num_computed: int = 0  # tokens whose KV is in the cache
    sent: bool = False  # the worker has its NewSequence
    table_stale: bool = False  # the worker's block table must be replaced (after swap-in)
    # Work in plans not yet answered (async scheduling plans a step while the worker runs the last one):
    num_in_flight: int = 0  # tokens being computed
    samples_in_flight: int = 0  # plans in flight that sample this sequence (the step and its lookahead: 2)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled(self) -> int:
        """Tokens whose KV will be in the cache once the plans in flight are done."""
        return self.num_computed + self.num_in_flight


@dataclass(slots=True, eq=False)
class RequestState:
    req: Request
    order: int  # arrival order: preemption takes the latest, resumption the earliest
    outputs: list[list[int]]  # per sample index; kept across preemption and worker loss
    reasons: list[str | None]  # per sample index: why it ended, None while it goes on
    status: Status = Status.WAITING
    worker_id: str | None = None
    seqs: list[Sequence] = field(default_factory=list)  # live sequences on its worker
    fork_at: int | None = None  # n > 1: the first sample runs their common prefix alone, then the rest fork
    unplaced_since: float | None = None  # first time expire_waiting saw it with no worker
    prompt_hashes: dict[bytes, list[bytes]] = field(default_factory=dict)  # extra keys → block hashes
    uncached: int = 0  # prompt tokens its worker had not cached when it was placed there
    last_reason: str = "stop"

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt_token_ids

    @property
    def live_samples(self) -> list[int]:
        return [i for i, reason in enumerate(self.reasons) if reason is None]

    def tokens(self, sample_index: int) -> list[int]:
        return self.prompt + self.outputs[sample_index]

    def fork_point(self) -> int | None:
        """Where the live samples part: their common prefix, short of each one's last token (it gives that
        sample's logits). None with one live sample."""
        live = self.live_samples
        if len(live) < 2:
            return None
        outs = [self.outputs[i] for i in live]
        common = 0
        while all(len(o) > common for o in outs) and len({o[common] for o in outs}) == 1:
            common += 1
        return len(self.prompt) + min(common, min(len(o) for o in outs) - 1)

    @property
    def longest(self) -> int:
        """Tokens of its longest unfinished sample (prompt + output)."""
        return len(self.prompt) + max((len(self.outputs[i]) for i in self.live_samples), default=0)
