"""The bus protocol: message types, the msgpack codec, and strict validation on decode.

Every payload is a msgpack map `{"v": PROTOCOL_VERSION, "type": <name>, ...fields}`; nested
messages are maps without the envelope. Decoding checks the version, the type, each field's type
(from the dataclass annotations) and the size; anything wrong raises ProtocolError and nothing else.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

from shared.sampling import ParamError, SamplingParams

PROTOCOL_VERSION = 1
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


@dataclass(slots=True)
class WorkerGone:
    """worker → scheduler (`control` stream): graceful shutdown; its requests move elsewhere."""
    worker_id: str


@dataclass(slots=True)
class NewSequence:
    """First sight of a sequence on a worker; later steps refer to it by `seq_id` alone.

    A request resumed by recompute arrives again as a new sequence whose prompt is unchanged and
    whose `output_token_ids` holds what it had generated (penalties and seeds need the split).
    """
    seq_id: int
    rid: str
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute tokens [num_computed_tokens, +num_new_tokens).

    The worker samples only when the chunk reaches the sequence's last token. Its block table grows
    by `new_block_ids`, unless `block_table` is set, which replaces it (after swap-in or copy-on-write).
    """
    seq_id: int
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int] = field(default_factory=list)
    block_table: list[int] | None = None


@dataclass(slots=True)
class StepPlan:
    """scheduler → worker (`plans:{worker}` stream): one step, as deltas against the worker's state.

    Order of work on the worker: forget `finished`, swap out, swap in, copies, then the forward pass.
    """
    worker_id: str
    epoch: int
    step_id: int
    new_sequences: list[NewSequence] = field(default_factory=list)
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, swap block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap block, device block)
    finished: list[int] = field(default_factory=list)  # seq ids the worker may forget


@dataclass(slots=True)
class TokenOutput:
    """One sampled token (`out:{rid}` stream, and inside a step result).

    A request-level failure is an entry with `sample_index` -1, `finish_reason` "error" and `error` set.
    """
    rid: str
    sample_index: int
    output_index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


@dataclass(slots=True)
class StepResult:
    """worker → scheduler (`results` stream): the tokens of one step, or the error that stopped it."""
    worker_id: str
    epoch: int
    step_id: int
    outputs: list[TokenOutput] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class WorkerStats:
    worker_id: str
    num_blocks: int
    free_blocks: int
    running: int  # sequences
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of those, tokens found cached


@dataclass(slots=True)
class SchedulerStats:
    """scheduler → gateway (`stats` key): the state /metrics exports."""
    time: float
    running: int  # requests
    waiting: int
    preempted: int
    preemptions: int  # total since start
    workers: list[WorkerStats] = field(default_factory=list)


Message = Union[Request, Abort, WorkerRegistration, WorkerGone, StepPlan, StepResult, TokenOutput, SchedulerStats]
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}
_HINTS: dict[type, dict[str, Any]] = {}


def encode(msg: Message) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGE_TYPES:
        raise ProtocolError(f"{name} is not a bus message")
    body = {"v": PROTOCOL_VERSION, "type": name}
    body.update(_to_plain(msg))
    return msgpack.packb(body, use_bin_type=True)


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
    return _from_plain(cls, body, cls.__name__)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(x) for x in obj]
    return obj


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _from_plain(cls: type, body: Any, path: str) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{path}: expected a map, got {type(body).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            kwargs[f.name] = _check(body[f.name], hints[f.name], f"{path}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{path}: missing field {f.name!r}")
    obj = cls(**kwargs)
    if isinstance(obj, SamplingParams):
        try:
            obj.validate()
        except ParamError as e:
            raise ProtocolError(f"{path}: {e}") from None
    return obj


def _check(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(value, option, path)
            except ProtocolError:
                pass
        raise ProtocolError(f"{path}: {type(value).__name__} is not {tp}")
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{path}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        items = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise ProtocolError(f"{path}: expected a list of {len(items)} items")
        return tuple(_check(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, items)))
    if dataclasses.is_dataclass(tp):
        return _from_plain(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{path}: expected a bool, got {type(value).__name__}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int) or not _INT64[0] <= value <= _INT64[1]:
            raise ProtocolError(f"{path}: expected a 64-bit int, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{path}: expected a string, got {type(value).__name__}")
        return value
    raise ProtocolError(f"{path}: no rule for {tp}")
