"""The bus protocol: message types, the msgpack codec, and strict validation on decode.

Every payload is a msgpack map `{"v": PROTOCOL_VERSION, "type": <name>, ...fields}`; nested
messages are maps without the envelope, and a list of messages is a map of columns, one list per field (a step's
hundreds of sequences cost a few packed lists, not a map each). Decoding checks the version, the type, each field's
type (from the dataclass annotations) and the size; anything wrong raises ProtocolError and nothing else.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import msgpack

from shared.sampling import SamplingParams
from shared.tenants import Tenant

PROTOCOL_VERSION = 8
# Why the scheduler ended a request with an error, so the gateway can answer with the right status.
REJECTED = "rejected"  # the request can never be served as sent (e.g. longer than any worker's cache): 400
UNAVAILABLE = "unavailable"  # no worker took it in time: 503, worth retrying
FAILED = "failed"  # a worker failed while serving it: 500
OVERLOADED = "overloaded"  # a queue limit (its tenant's or the server's) turned it away: 429, retry after a while
SCHEDULER_WRITER = ":scheduler"  # the writer of the tokens the scheduler writes itself (beam search results)
MAX_MESSAGE_BYTES = 64 << 20
_INT64 = (-(2**63), 2**63 - 1)


class ProtocolError(ValueError):
    """A payload that is not a valid message of this protocol version."""


@dataclass(slots=True)
class Request:
    """gateway → scheduler (`requests` stream): one request, already tokenized and validated."""
    rid: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    gateway_id: str = ""  # the submitting gateway's instance: its requests are aborted once it is gone
    retention: float = 0.0  # seconds its out: stream is kept after it ends, if longer than the default (stored)
    tenant: Tenant = field(default_factory=Tenant)
    priority: int = 0  # lower runs first (vLLM's), under the priority policy
    cache_salt: str = ""  # the client's: blocks are shared only between requests of one tenant and one salt


@dataclass(slots=True)
class Abort:
    """gateway → scheduler (`control` stream): client gone or stop string hit."""
    rid: str
    reason: str = "abort"


@dataclass(slots=True)
class WorkerRegistration:
    """worker → scheduler: what the worker can hold; sent on start and kept in the workers hash."""
    worker_id: str
    model_id: str
    num_blocks: int
    num_swap_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    instance: str = ""  # one per worker process: a restart under the same id registers anew
    vocab_size: int = 0  # token ids run from 0 to vocab_size - 1 (0: unknown)
    # a row's logits the same bits in any batch (gpu_worker/cpu_paths.py): its greedy and seeded tokens survive
    # preemption, restarts and recovery exactly
    batch_invariant: bool = False


@dataclass(slots=True)
class WorkerGone:
    """worker → scheduler (`control` stream): graceful shutdown; its requests move elsewhere."""
    worker_id: str


@dataclass(slots=True)
class NewSequence:
    """First sight of a sequence on a worker; later steps refer to it by `seq_id` alone.

    A request resumed by recompute arrives again as a new sequence whose prompt is unchanged and
    whose `output_token_ids` holds what it had generated (penalties and seeds need the split). A beam
    forked from another sequence names it in `fork_of` and carries no tokens: it starts with that
    sequence's, as the worker holds them when the plan arrives.
    """
    seq_id: int
    rid: str
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    fork_of: int | None = None


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [num_computed_tokens, +num_new_tokens).

    The worker samples only when the chunk reaches the sequence's last token (for a beam: it returns
    its candidates instead, see BeamCandidates). Its block table grows by `new_block_ids`, unless
    `block_table` is set, which replaces it (after swap-in or copy-on-write). `append_token_ids` are
    tokens the scheduler chose for the sequence (a beam's next token), appended before the chunk runs.
    A decode chunk may check up to `num_draft_tokens` tokens its worker proposes after it (speculative
    decoding): its block table covers them too, and the worker outputs the verified ones.
    """
    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    block_table: list[int] | None = None
    append_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0


@dataclass(slots=True)
class Decodes:
    """A decode token each for sequences the worker holds, with nothing else to send (most sequences of most steps),
    as columns: sequence `seq_ids[i]` computes the token after its first `num_computed_tokens[i]`; those at the
    positions `growing` names (ascending) first append to their block table the block `new_block_ids` gives at the
    same place. Each is the ScheduledSequence(seq_ids[i], num_computed_tokens[i], 1, [its new block, if any])."""
    seq_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    growing: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if len(self.seq_ids) != len(self.num_computed_tokens):
            raise ValueError(f"{len(self.seq_ids)} seq ids for {len(self.num_computed_tokens)} token counts")
        if len(self.growing) != len(self.new_block_ids):
            raise ValueError(f"{len(self.growing)} growing sequences for {len(self.new_block_ids)} new blocks")
        outside = [i for i in self.growing if not 0 <= i < len(self.seq_ids)]
        if outside:
            raise ValueError(f"growing position {outside[0]} is outside the {len(self.seq_ids)} sequences")
        if any(a >= b for a, b in zip(self.growing, self.growing[1:])):
            raise ValueError("growing positions must ascend")

    def without(self, seq_ids: set[int]) -> Decodes:
        """These columns less the sequences `seq_ids` names."""
        new_blocks = dict(zip(self.growing, self.new_block_ids))
        kept = Decodes()
        for i, (seq_id, start) in enumerate(zip(self.seq_ids, self.num_computed_tokens)):
            if seq_id in seq_ids:
                continue
            if i in new_blocks:
                kept.growing.append(len(kept.seq_ids))
                kept.new_block_ids.append(new_blocks[i])
            kept.seq_ids.append(seq_id)
            kept.num_computed_tokens.append(start)
        return kept

    def items(self) -> list[ScheduledSequence]:
        new_blocks = dict(zip(self.growing, self.new_block_ids))
        return [ScheduledSequence(seq_id, start, 1, [new_blocks[i]] if i in new_blocks else [])
                for i, (seq_id, start) in enumerate(zip(self.seq_ids, self.num_computed_tokens))]


@dataclass(slots=True)
class StepPlan:
    """scheduler → worker (`plans:{worker}` stream): one step, as deltas against the worker's state.

    Order of work on the worker: free `freed`, swap out, swap in, copies, then the forward pass over `sequences()`.

    A plan that `joins` the one before it admits requests that came after that one was sent (a lookahead): it has no
    `decodes`, moves no block, and holds no block that a sequence of the plan before it still writes or reads but for
    those it frees. A worker that has not begun the plan before it runs the two as one step (`joined`), else it runs
    it as a step of its own; the scheduler's state is the same either way, but that a sequence it frees may have its
    token in the plan before it or not.
    """
    worker_id: str
    epoch: int
    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, swap block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap block, device block)
    freed: list[int] = field(default_factory=list)  # seq ids whose state the worker drops (their blocks are free)
    decodes: Decodes = field(default_factory=Decodes)  # the scheduler's fast lane: no object per sequence
    joins: bool = False  # admissions after a lookahead, to run with it if the worker has not begun it

    def joined(self, join: StepPlan) -> StepPlan:
        """This plan and a join behind it as one step: the join's `freed` go first, with their chunks in this plan
        (the blocks they held may be the join's), then the join's sequences after this plan's."""
        gone = set(join.freed)
        return StepPlan(
            self.worker_id, self.epoch, self.step_id,
            [m for m in self.new_sequences if m.seq_id not in gone] + join.new_sequences,
            [s for s in self.scheduled if s.seq_id not in gone] + join.scheduled,
            self.copies + join.copies, self.swap_out + join.swap_out, self.swap_in + join.swap_in,
            self.freed + join.freed, self.decodes.without(gone) if gone else self.decodes)

    def sequences(self) -> list[ScheduledSequence]:
        """Every sequence the step computes, in the order it computes them: `decodes`, then `scheduled`."""
        return self.decodes.items() + self.scheduled

    @property
    def num_sequences(self) -> int:
        return len(self.scheduled) + len(self.decodes.seq_ids)


@dataclass(slots=True)
class PromptLogprob:
    """The model's log-probability of one prompt token given the tokens before it."""
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass(slots=True)
class TokenOutput:
    """One sampled token (`out:{rid}` stream, and inside a step result).

    Written by the worker the request is assigned to, with its id and the plan's epoch (readers drop
    entries from any other writer: see shared/out_stream.py). The first token of a sample carries
    `num_cached_tokens` (prompt tokens its prefill found in the prefix cache) and, when the request
    asked for them, `prompt_logprobs` (one per prompt token after the first).

    The scheduler ends each request with an entry of `sample_index` -1: `finish_reason` "error" with
    `error` (the message) and `error_kind` (REJECTED, UNAVAILABLE, FAILED or OVERLOADED) for a failure, else the
    reason that ends every sample the workers did not finish.
    """
    rid: str
    sample_index: int
    output_index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None
    worker_id: str = ""
    epoch: int = 0
    num_cached_tokens: int | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    retry_after: float | None = None  # with error_kind OVERLOADED: seconds to wait before retrying


@dataclass(slots=True)
class Assignment:
    """scheduler → `out:{rid}`: from here on, only this worker's entries of this epoch are the request's
    tokens. Written when a request is placed on a worker (and, with `worker_id` "", as a fence when a
    scheduler resumes the request after a restart), before any plan that runs it."""
    rid: str
    worker_id: str
    epoch: int


@dataclass(slots=True)
class BeamCandidates:
    """A beam's continuations after one step: its most likely next tokens, with their logprobs."""
    seq_id: int
    top: list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(slots=True)
class DraftReport:
    """A speculating sequence after one step: the tokens its worker proposed and how many of them were accepted,
    and the draft its proposer holds for its next step (`ready` tokens), so that its scheduler reserves room for
    it. Sent only for a sequence with one of them non-zero."""
    seq_id: int
    proposed: int = 0
    accepted: int = 0
    ready: int = 0


@dataclass(slots=True)
class RefusedRequest:
    """A request whose sequences a worker could not run (a bad plan for it, a grammar that failed): the scheduler
    ends it with `error`; the rest of the step ran."""
    rid: str
    error: str


@dataclass(slots=True)
class StepResult:
    """worker → scheduler (`results` stream): what one step sampled, as two columns, one entry per token in the
    order sampled (a sequence that checked a draft has one per token it emitted), its beams' candidates and the
    requests it refused; or the error that stopped it. Columns, as the scheduler reads every token of every step:
    the tokens themselves, with their logprobs, go to each request's `out:` stream as TokenOutputs."""
    worker_id: str
    epoch: int
    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    refused: list[RefusedRequest] = field(default_factory=list)
    error: str | None = None
    beams: list[BeamCandidates] = field(default_factory=list)
    waited: float = 0.0  # seconds the worker, holding sequences, waited for this plan after its step before
    drafts: list[DraftReport] = field(default_factory=list)

    def validate(self) -> None:
        if len(self.seq_ids) != len(self.token_ids):
            raise ValueError(f"{len(self.seq_ids)} seq ids for {len(self.token_ids)} tokens")


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What a worker's step comes to (not a message itself): the result for the scheduler, and the tokens for the
    requests' `out:` streams, which the worker service writes (the in-process engine takes them directly)."""
    result: StepResult
    outputs: list[TokenOutput] = field(default_factory=list)

    def split(self, joins: list[StepPlan]) -> list[StepOutcome]:
        """The outcome of a step that ran plans joined (StepPlan.joined) as one per plan: first the plan joined to,
        under this result's step id, then each join's own. A join's sequences and requests are all its own (it only
        admits), the first plan's are the rest."""
        result = self.result
        parts = [StepOutcome(StepResult(result.worker_id, result.epoch, step_id, error=result.error))
                 for step_id in (result.step_id, *(join.step_id for join in joins))]
        seq_owner = {s.seq_id: k for k, join in enumerate(joins, 1) for s in join.scheduled}
        rid_owner = {m.rid: k for k, join in enumerate(joins, 1) for m in join.new_sequences}
        for i, (seq_id, token_id) in enumerate(zip(result.seq_ids, result.token_ids)):
            part = parts[seq_owner.get(seq_id, 0)]
            part.result.seq_ids.append(seq_id)
            part.result.token_ids.append(token_id)
            if self.outputs:  # (they run beside the seq ids)
                part.outputs.append(self.outputs[i])
        for refused in result.refused:
            parts[rid_owner.get(refused.rid, 0)].result.refused.append(refused)
        for beams in result.beams:
            parts[seq_owner.get(beams.seq_id, 0)].result.beams.append(beams)
        for draft in result.drafts:
            parts[seq_owner.get(draft.seq_id, 0)].result.drafts.append(draft)
        parts[0].result.waited = result.waited
        return parts


@dataclass(slots=True)
class WorkerStats:
    worker_id: str
    num_blocks: int
    free_blocks: int
    running: int  # sequences
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached
    shared_blocks: int = 0  # blocks held by more than one sequence now
    steps: int = 0  # plans sent, since start
    forks: int = 0  # sequences forked from another (n > 1, beams), since start
    copies: int = 0  # copy-on-write block copies, since start
    plan_wait: float = 0.0  # seconds the worker, holding sequences, waited for a plan, since start
    drafts: int = 0  # speculative drafts checked, since start
    draft_tokens: int = 0  # tokens they proposed
    accepted_tokens: int = 0  # of those, tokens accepted
    accepted_at: list[int] = field(default_factory=list)  # accepted tokens by their place in the draft (0 first)


@dataclass(slots=True)
class TenantStats:
    tenant: str
    waiting: int  # requests not admitted yet
    running_seqs: int
    tokens_last_minute: int  # prompt and generated tokens computed for it, in the last minute
    weight: float = 1.0  # its weight under the fair policy (the gateway splits the waiting limit by it)


@dataclass(slots=True)
class SchedulerStats:
    """scheduler → gateway (`stats` key): the state /metrics exports."""
    time: float
    running: int  # requests
    waiting: int
    preempted: int
    preemptions: int  # total since start
    workers: list[WorkerStats] = field(default_factory=list)
    tenants: list[TenantStats] = field(default_factory=list)


# A KV block's state in a CacheSnapshot, one byte per block; BLOCK_MOVING is or-ed onto the state of a block that a
# plan in flight copies (copy-on-write) or swaps.
BLOCK_STATES = ("null", "free", "cached", "used", "shared")  # cached: free, but its hash can still be hit
BLOCK_NULL, BLOCK_FREE, BLOCK_CACHED, BLOCK_USED, BLOCK_SHARED = range(len(BLOCK_STATES))
BLOCK_MOVING = 0x80


@dataclass(slots=True)
class WorkerHistory:
    """One worker's last minutes, a sample per `CacheSnapshot.interval`, oldest first: its columns end at the
    snapshot's last `history_time`. Step columns sum over the steps planned in the interval."""
    steps: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)  # sequences in those steps (batch sizes summed)
    tokens: list[int] = field(default_factory=list)  # tokens computed (prefill chunks and decode)
    sampled: list[int] = field(default_factory=list)  # tokens sampled: chunks that reach their sequence's end
    prefix_queries: list[int] = field(default_factory=list)  # prompt tokens looked up in the interval
    prefix_hits: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)  # requests, at the end of the interval
    waiting: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WorkerSnapshot:
    """One worker's KV cache: a byte per block (`states`, `ref_counts` capped at 255), its queues, and which
    requests hold its blocks: `holder_rids[i]` holds `holder_counts[i]` blocks, whose ids follow in
    `holder_blocks` (little-endian uint32); `holders_complete` is False when the list was cut to its bound."""
    worker_id: str
    block_size: int
    states: bytes
    ref_counts: bytes
    running: int  # requests
    waiting: int
    preempted: int  # by recompute or swapped
    swapped: int
    running_seqs: int
    prefix_queries: int  # since the worker joined
    prefix_hits: int
    swap_blocks: int
    swap_free: int
    holder_rids: list[str] = field(default_factory=list)
    holder_counts: list[int] = field(default_factory=list)
    holder_blocks: bytes = b""
    holders_complete: bool = True
    history: WorkerHistory = field(default_factory=WorkerHistory)
    drafts: int = 0  # speculative drafts checked since the worker joined
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(slots=True)
class CacheSnapshot:
    """scheduler → gateway (`cache_snapshot` key, while a dashboard watches): every worker's blocks, for /dashboard."""
    time: float
    interval: float  # seconds between history samples
    workers: list[WorkerSnapshot] = field(default_factory=list)
    history_time: list[float] = field(default_factory=list)  # when each history sample was taken
    history_workers: list[int] = field(default_factory=list)  # workers in the cluster then
    unplaced: int = 0  # requests waiting for any worker
    tenants: list[TenantStats] = field(default_factory=list)


Message = Union[Request, Abort, WorkerRegistration, WorkerGone, StepPlan, StepResult, TokenOutput, Assignment,
                SchedulerStats, CacheSnapshot]
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}


def encode(msg: Message) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGE_TYPES:
        raise ProtocolError(f"{name} is not a bus message")
    body = {"v": PROTOCOL_VERSION, "type": name}
    body.update(_fields(msg))
    return msgpack.packb(body, use_bin_type=True, default=_plain)


def decode(data: bytes, expected: type | tuple[type, ...] | None = None) -> Message:
    """Decode and validate one payload; raise ProtocolError for anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"payload must be bytes, not {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"payload of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises many types for garbage; all mean "not a message"
        raise ProtocolError(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"payload must be a map, not {type(body).__name__}")
    version = body.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this is {PROTOCOL_VERSION})")
    name = body.get("type")
    cls = MESSAGE_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r}")
    if expected is not None and not issubclass(cls, expected):
        raise ProtocolError(f"unexpected message type {cls.__name__} here")
    try:
        return _validator(cls)(body)
    except _Invalid as e:
        raise ProtocolError(f"{cls.__name__}{''.join(reversed(e.where))}: {e.reason}") from None


_REQUIRED = object()


class _Field(typing.NamedTuple):
    name: str
    default: Any  # `_REQUIRED` for a field without one
    columns: bool  # a list of messages: it travels as columns


@functools.cache
def _layout(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(_Field(f.name, f.default if f.default is not dataclasses.MISSING
                        else _REQUIRED if f.default_factory is dataclasses.MISSING else f.default_factory(),
                        _message_item(hints[f.name]) is not None)
                 for f in dataclasses.fields(cls))


def _message_item(tp: Any) -> type | None:
    """M for a field of type list[M] (or list[M] | None) whose items are messages, else None."""
    nullable = typing.get_origin(tp) in (Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if nullable else [tp]
    if len(args) != 1 or typing.get_origin(args[0]) is not list:
        return None
    (item,) = typing.get_args(args[0])
    return item if dataclasses.is_dataclass(item) else None


def _fields(obj: Any) -> dict[str, Any]:
    """A message's fields, less those at their default: the reader fills them in again. A token's entry is
    half the bytes so, and every reader decodes it faster (most of its fields are usually unset)."""
    body = {}
    for name, default, columns in _layout(type(obj)):
        value = getattr(obj, name)
        if default is _REQUIRED or value != default:
            body[name] = _columns(value) if columns and value is not None else value
    return body


def _columns(items: list[Any]) -> dict[str, Any]:
    """A list of messages (of one type) as a map of columns, less those where every item is at its default; an empty
    list has none."""
    if not items:
        return {}
    layout = _layout(type(items[0]))
    values = operator.attrgetter(*(f.name for f in layout))
    rows = map(values, items) if len(layout) > 1 else ((values(item),) for item in items)
    body = {}
    for (name, default, columns), column in zip(layout, zip(*rows)):
        if default is _REQUIRED or column.count(default) != len(column):
            body[name] = [v if v is None else _columns(v) for v in column] if columns else column
    return body


def _plain(obj: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: nested messages become maps."""
    if dataclasses.is_dataclass(obj):
        return _fields(obj)
    raise TypeError(f"cannot put {type(obj).__name__} on the bus")


class _Invalid(Exception):
    """A value that does not fit its field; `where` collects the path innermost first."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.where: list[str] = []


# Validators are built once per type from the dataclass annotations, then run as plain closures:
# decoding sits on every hop of every step, so it must be cheap.
@functools.cache
def _validator(tp: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _union(tp)
    if origin is list:
        item = typing.get_args(tp)[0]
        return _columns_of(item) if dataclasses.is_dataclass(item) else _list(item)
    if origin is tuple:
        return _tuple(typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return _message(tp)
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise TypeError(f"no rule for {tp}")


def _union(tp: Any) -> Callable[[Any], Any]:
    args = typing.get_args(tp)
    nullable = type(None) in args
    options = [_validator(a) for a in args if a is not type(None)]

    def check(value: Any) -> Any:
        if value is None and nullable:
            return None
        for option in options:
            try:
                return option(value)
            except _Invalid:
                pass
        raise _Invalid(f"{type(value).__name__} is not {tp}")
    return check


def _list(item_type: Any) -> Callable[[Any], Any]:
    item = _validator(item_type)

    def check(value: Any) -> Any:
        if type(value) is not list:
            raise _Invalid(f"expected a list, got {type(value).__name__}")
        if item is _int and (not value or set(map(type, value)) == {int} and _INT64[0] <= min(value)
                             and max(value) <= _INT64[1]):
            return value  # token lists: the common case, checked in C
        out = []
        for i, v in enumerate(value):
            try:
                out.append(item(v))
            except _Invalid as e:
                e.where.append(f"[{i}]")
                raise
        return out
    return check


def _columns_of(cls: type) -> Callable[[Any], Any]:
    """A list of `cls` messages from its columns (see _columns): each column checked as a list of its field, all of one
    length, the required ones present unless the list is empty."""
    hints = typing.get_type_hints(cls)
    validators = {f.name: _list(hints[f.name]) for f in _layout(cls)}  # (a column of messages is a list of maps)
    required = [f.name for f in _layout(cls) if f.default is _REQUIRED]
    validate_obj = getattr(cls, "validate", None)

    def check(value: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid(f"expected a map of columns, got {type(value).__name__}")
        columns = {}
        for name, column in value.items():
            validate = validators.get(name)
            if validate is None:
                continue
            try:
                columns[name] = validate(column)
            except _Invalid as e:
                e.where.append(f".{name}")
                raise
        if not columns:
            return []
        lengths = {len(column) for column in columns.values()}
        if len(lengths) > 1:
            raise _Invalid(f"columns of different lengths {sorted(lengths)}")
        for name in required:
            if name not in columns:
                raise _Invalid(f"missing column {name!r}")
        names = list(columns)
        items = []
        for i, row in enumerate(zip(*columns.values())):
            try:
                items.append(_build(cls, validate_obj, dict(zip(names, row))))
            except _Invalid as e:
                e.where.append(f"[{i}]")
                raise
        return items
    return check


def _tuple(item_types: tuple[Any, ...]) -> Callable[[Any], Any]:
    items = [_validator(t) for t in item_types]

    def check(value: Any) -> Any:
        if type(value) is not list or len(value) != len(items):
            raise _Invalid(f"expected a list of {len(items)} items")
        out = []
        for i, (v, item) in enumerate(zip(value, items)):
            try:
                out.append(item(v))
            except _Invalid as e:
                e.where.append(f"[{i}]")
                raise
        return tuple(out)
    return check


def _message(cls: type) -> Callable[[Any], Any]:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, _validator(hints[f.name]), f.default is _REQUIRED) for f in _layout(cls)]
    validate_obj = getattr(cls, "validate", None)  # the rules of its own module (SamplingParams, Tenant)

    def check(value: Any) -> Any:
        if type(value) is not dict:
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        kwargs = {}
        for name, validate, required in fields:
            if name in value:
                try:
                    kwargs[name] = validate(value[name])
                except _Invalid as e:
                    e.where.append(f".{name}")
                    raise
            elif required:
                raise _Invalid(f"missing field {name!r}")
        return _build(cls, validate_obj, kwargs)
    return check


def _build(cls: type, validate_obj: Callable[[Any], Any] | None, kwargs: dict[str, Any]) -> Any:
    """The message from its checked fields, with the rules of its own module run on it."""
    obj = cls(**kwargs)
    if validate_obj is not None:
        try:
            validate_obj(obj)
        except ValueError as e:
            raise _Invalid(str(e)) from None
    return obj


def _int(value: Any) -> int:
    if type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
        raise _Invalid(f"expected a 64-bit int, got {type(value).__name__}")
    return value


def _float(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is not int:
        raise _Invalid(f"expected a number, got {type(value).__name__}")
    return float(value)


def _str(value: Any) -> str:
    if type(value) is not str:
        raise _Invalid(f"expected a string, got {type(value).__name__}")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _Invalid(f"expected a bool, got {type(value).__name__}")
    return value


def _bytes(value: Any) -> bytes:
    if type(value) is not bytes:
        raise _Invalid(f"expected bytes, got {type(value).__name__}")
    return value


_SCALARS: dict[type, Callable[[Any], Any]] = {int: _int, float: _float, str: _str, bool: _bool, bytes: _bytes}
