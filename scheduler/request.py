"""Scheduler-side state of a request and of its sequences (one per live sample on its worker).

The request owns the token lists: its prompt and each sample's output, kept across preemption and
worker loss. A sequence is one sample's place on a worker: its id there and how far its KV reaches.
"""
from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field

from scheduler.beam_search import Hypothesis
from scheduler.groups import RequestGroup, SamplingGroup
from scheduler.kv_cache_manager import chain_root
from shared.protocol import SCHEDULER_WRITER, Assignment, Request, TokenOutput


class Status(enum.Enum):
    WAITING = "waiting"  # never admitted on its current worker (or on no worker yet)
    RUNNING = "running"
    PREEMPTED = "preempted"  # by recompute: holds no blocks, resumes from prompt + output
    SWAPPED = "swapped"  # its blocks sit in the worker's swap area
    FINISHED = "finished"


@dataclass(slots=True)
class FinishedRequest:
    """A request's end, as the scheduler writes it on the request's stream."""
    rid: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set for rejected/failed requests: a clear message for the client
    error_kind: str | None = None  # REJECTED, UNAVAILABLE or FAILED, with `error`
    beams: list[Hypothesis] | None = None  # a beam search's n best beams, which the scheduler writes itself
    retry_after: float | None = None  # with error_kind OVERLOADED: seconds its client should wait

    def stream_entries(self, epoch: int) -> list[Assignment | TokenOutput]:
        """What the scheduler writes on the request's stream: a beam search's results, as their writer, then the
        request-level end (the gateway ends every sample the workers did not finish with its reason)."""
        entries: list[Assignment | TokenOutput] = []
        if self.beams is not None:
            entries.append(Assignment(self.rid, SCHEDULER_WRITER, epoch))
            entries += [TokenOutput(self.rid, i, k, token, beam.logprobs[k],
                                    finish_reason=beam.finish_reason if k == len(beam.tokens) - 1 else None,
                                    worker_id=SCHEDULER_WRITER, epoch=epoch)
                        for i, beam in enumerate(self.beams) for k, token in enumerate(beam.tokens)]
        entries.append(TokenOutput(self.rid, -1, 0, -1, finish_reason=self.finish_reason, error=self.error,
                                   error_kind=self.error_kind, retry_after=self.retry_after))
        return entries


@dataclass(slots=True, eq=False)
class SeqState:
    """The scheduler's side of one sequence on its worker (the worker's is gpu_worker/sequence.py's SequenceState)."""
    seq_id: int
    sample_index: int  # which of its request's samples (or live beams) it computes
    num_computed: int = 0  # tokens whose KV is in the cache, or will be once the plans sent are done
    num_placeholders: int = 0  # tokens sampled by plans in flight, not known yet (scheduler/pacing.py)
    sent: bool = False  # the worker has its NewSequence
    fork_of: SeqState | None = None  # forked from this one: while it lives on the worker, the prompt comes from there
    resend_table: bool = False  # the worker's block table must be replaced (after swap-in)
    appended: list[int] = field(default_factory=list)  # tokens the scheduler chose, not yet sent (beams)
    # speculative decoding (scheduler/speculation.py): the draft its worker holds for its next step, the most
    # draft tokens it may check now (0: the config's), its drafts in a row with none accepted, steps it sits out
    draft_ready: int = 0
    draft_cap: int = 0
    draft_misses: int = 0
    draft_pause: int = 0


@dataclass(slots=True, eq=False)
class RequestState:
    req: Request
    rank: tuple[int, int]  # (priority under the priority policy, else 0; arrival): preemption takes the last
    outputs: list[list[int]]  # per sample index
    reasons: list[str | None]  # per sample index: why it ended, None while it goes on
    status: Status = Status.WAITING
    worker_id: str | None = None
    seqs: list[SeqState] = field(default_factory=list)  # live sequences on its worker
    unplaced_since: float | None = None  # first time the cluster saw it with no worker
    prompt_hashes: dict[bytes, list[bytes]] = field(default_factory=dict)  # extra keys → block hashes
    uncached: int = 0  # prompt tokens its worker had not cached when it was placed there
    last_reason: str = "stop"
    group: RequestGroup = field(default_factory=SamplingGroup)  # its sequences' strategy (scheduler/groups.py)
    gateway_id: str = field(init=False)  # the gateway streaming it to its client: its submitter's, or a taker's since
    root: bytes = field(init=False)  # where its chain of block hashes starts: its tenant's and its cache salt's
    prompt_len: int = field(init=False)  # (read for every sequence in every step)
    # Its tenant's name, one string object for every request of the tenant (the ledger is charged for every sequence
    # in every step, the tenants' counts in one pass)
    tenant: str = field(init=False)
    queued: bool = True  # never admitted yet: it counts against its tenant's queue limits (scheduler/ledger.py)
    queued_since: float | None = None  # first tick that saw it queued
    seats: int = 0  # sequences its tenant counts as running for it (since it was admitted or swapped in last)
    # On its worker (set as it is placed there): the tokens that end a sample (its stop tokens and the model's EOS,
    # params.stop_tokens), and the output length that does (max_tokens, or max_model_len less its prompt)
    ends_on: frozenset[int] = frozenset()
    ends_at: int = 0
    # Preempted by recompute while plans in flight sample its tokens: the last plan then in flight, before whose result
    # it is not admitted back (its outputs would miss the tokens still to come)
    held_until: int = -1

    def __post_init__(self) -> None:
        self.gateway_id = self.req.gateway_id
        self.prompt_len = len(self.req.prompt_token_ids)
        self.tenant = sys.intern(self.req.tenant.name)
        salt = (self.req.tenant.cache_salt, self.req.cache_salt)
        self.root = chain_root("\0".join(salt) if any(salt) else "")

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt_token_ids

    @property
    def live_samples(self) -> list[int]:
        return [i for i, reason in enumerate(self.reasons) if reason is None]

    @property
    def done(self) -> bool:
        return all(reason is not None for reason in self.reasons)

    def tokens(self, sample_index: int) -> list[int]:
        return self.prompt + self.outputs[sample_index]

    def num_tokens(self, seq: SeqState) -> int:
        return self.prompt_len + len(self.outputs[seq.sample_index])

    def target(self, seq: SeqState) -> int:
        """The tokens the sequence's KV should cover: those known and those its plans in flight sample, but nothing
        after a token in flight sure to end it (max_tokens or max_model_len: `ends_at`; an EOS cannot be foreseen,
        and the worker skips a sequence it saw end)."""
        output, placeholders = len(self.outputs[seq.sample_index]), seq.num_placeholders
        if placeholders and output + placeholders >= self.ends_at:
            return seq.num_computed
        return self.prompt_len + output + placeholders

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
        return self.prompt_len + min(common, min(len(o) for o in outs) - 1)

    @property
    def longest(self) -> int:
        """Tokens of its longest unfinished sample (prompt + output)."""
        return self.prompt_len + max((len(self.outputs[i]) for i in self.live_samples), default=0)
