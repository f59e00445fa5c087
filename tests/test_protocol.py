"""The bus protocol: every message round-trips, and the decoder only ever raises ProtocolError."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from shared.protocol import (
    MAX_MESSAGE_BYTES, PROTOCOL_VERSION, Abort, Decodes, NewSequence, ProtocolError, PromptLogprob, RefusedRequest,
    Request, ScheduledSequence, SchedulerStats, StepOutcome, StepPlan, StepResult, TokenOutput, WorkerGone,
    WorkerRegistration, WorkerStats, decode, encode,
)
from shared.sampling import SamplingParams

PARAMS = SamplingParams(n=2, max_tokens=32, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                        stop_token_ids=[2, 5], ignore_eos=True, logprobs=3, logit_bias=[(4, -100.0), (9, 2.5)],
                        allowed_token_ids=[4, 9, 11])

EXAMPLES = [
    Request("r1", "tiny", [1, 2, 3], PARAMS, 1234.5),
    Abort("r1", "client disconnected"),
    WorkerRegistration("w0", "tiny", 1000, 200, 16, 2048, [2, 4]),
    WorkerGone("w0"),
    StepPlan("w0", 3, 17,
             new_sequences=[NewSequence(5, "r1", 1, [1, 2, 3], [9], PARAMS)],
             scheduled=[ScheduledSequence(5, 0, 4, [7, 8]), ScheduledSequence(6, 30, 1, [], [1, 2, 3])],
             copies=[(7, 9)], swap_out=[(3, 0)], swap_in=[(1, 4)], freed=[2, 3],
             decodes=Decodes([11, 12, 13], [40, 47, 63], [0, 2], [21, 22])),
    StepResult("w0", 3, 17, [5, 6, 6], [42, 7, 9], [RefusedRequest("r2", "bad step plan: unknown sequence 8")]),
    StepResult("w0", 3, 18, error="CUDA out of memory"),
    TokenOutput("r1", 1, 0, 42, -0.25, [(42, -0.25), (7, -1.5)], "stop",
                prompt_logprobs=[PromptLogprob(-1.5, 3, [(9, -0.5)]), PromptLogprob(-0.25, 1)]),
    TokenOutput("r9", -1, 0, -1, finish_reason="error", error="prompt too long"),
    SchedulerStats(12.5, 3, 1, 0, 4, [WorkerStats("w0", 100, 40, 5, 320, 160)]),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_expected_type_is_enforced():
    with pytest.raises(ProtocolError, match="unexpected message type"):
        decode(encode(Abort("r1")), expected=Request)
    assert decode(encode(Abort("r1")), expected=(Request, Abort)) == Abort("r1")


def _body(msg) -> dict:
    return msgpack.unpackb(encode(msg))


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b["scheduled"]["num_new_tokens"].pop(), r"StepPlan.scheduled: columns of different lengths \[1, 2\]"),
    (lambda b: b["scheduled"].pop("seq_id"), r"StepPlan.scheduled: missing column 'seq_id'"),
    (lambda b: b["scheduled"]["seq_id"].__setitem__(1, "6"), r"StepPlan.scheduled.seq_id\[1\]: expected a 64-bit int"),
    (lambda b: b.update(scheduled=[{"seq_id": 5}]), "StepPlan.scheduled: expected a map of columns, got list"),
])
def test_a_list_of_messages_travels_as_columns_checked_like_fields(mutate, message):
    body = _body(EXAMPLES[4])
    assert body["scheduled"]["seq_id"] == [5, 6] and "block_table" in body["scheduled"]
    assert "append_token_ids" not in body["scheduled"], "a column at its default everywhere is left out"
    mutate(body)
    with pytest.raises(ProtocolError, match=message):
        decode(msgpack.packb(body))


def test_a_plans_decodes_stand_for_a_decode_token_each_after_the_scheduled_ones():
    plan = EXAMPLES[4]
    assert plan.num_sequences == 5
    assert [(s.seq_id, s.num_computed_tokens, s.num_new_tokens, s.new_block_ids) for s in plan.sequences()[:3]] == [
        (11, 40, 1, [21]), (12, 47, 1, []), (13, 63, 1, [22])]
    assert plan.sequences()[3:] == plan.scheduled
    assert _body(plan)["decodes"] == {"seq_ids": [11, 12, 13], "num_computed_tokens": [40, 47, 63],
                                      "growing": [0, 2], "new_block_ids": [21, 22]}, "columns of plain ints"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["num_computed_tokens"].pop(), "StepPlan.decodes: 3 seq ids for 2 token counts"),
    (lambda d: d["new_block_ids"].pop(), "StepPlan.decodes: 2 growing sequences for 1 new blocks"),
    (lambda d: d.update(growing=[2, 0]), "StepPlan.decodes: growing positions must ascend"),
    (lambda d: d.update(growing=[0, 3]), "StepPlan.decodes: growing position 3 is outside the 3 sequences"),
    (lambda d: d["seq_ids"].__setitem__(0, 1.5), r"StepPlan.decodes.seq_ids\[0\]: expected a 64-bit int, got float"),
])
def test_malformed_decodes_are_a_typed_error(mutate, message):
    body = _body(EXAMPLES[4])
    mutate(body["decodes"])
    with pytest.raises(ProtocolError, match=message):
        decode(msgpack.packb(body))


def test_a_result_whose_columns_differ_in_length_is_a_typed_error():
    body = _body(EXAMPLES[5])
    body["token_ids"].pop()
    with pytest.raises(ProtocolError, match="3 seq ids for 2 tokens"):
        decode(msgpack.packb(body))


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.update(v=PROTOCOL_VERSION + 1), "unsupported protocol version"),
    (lambda b: b.pop("v"), "unsupported protocol version"),
    (lambda b: b.update(type="Pickle"), "unknown message type"),
    (lambda b: b.pop("rid"), "missing field 'rid'"),
    (lambda b: b.update(prompt_token_ids="1 2 3"), "expected a list"),
    (lambda b: b.update(prompt_token_ids=[1, "2"]), r"prompt_token_ids\[1\]: expected a 64-bit int"),
    (lambda b: b.update(prompt_token_ids=[True]), "expected a 64-bit int"),
    (lambda b: b["params"].update(temperature="hot"), "expected a number"),
    (lambda b: b["params"].update(temperature=9.0), "temperature must be in"),
    (lambda b: b["params"].update(n=0), r"n must be in \[1, 128\]; got 0"),
    (lambda b: b["params"].update(max_tokens=0), "max_tokens must be at least 1"),
    (lambda b: b.update(params=[]), "expected a map"),
])
def test_malformed_request_is_a_typed_error(mutate, message):
    body = _body(EXAMPLES[0])
    mutate(body)
    with pytest.raises(ProtocolError, match=message):
        decode(msgpack.packb(body))


def test_oversized_payload_is_rejected_before_parsing():
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))


def test_non_bytes_and_non_map_payloads():
    with pytest.raises(ProtocolError):
        decode("text")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="must be a map"):
        decode(msgpack.packb([1, 2]))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data):
    try:
        decode(data)
    except ProtocolError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                  st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLES), st.dictionaries(st.sampled_from(
    ["rid", "params", "prompt_token_ids", "scheduled", "new_sequences", "copies", "outputs", "token_id",
     "logprob", "top_logprobs", "epoch", "num_blocks", "eos_token_ids", "error", "finish_reason"]), _values, max_size=4))
def test_fuzz_wrong_field_values(msg, overrides):
    body = _body(msg)
    body.update(overrides)
    try:
        out = decode(msgpack.packb(body, use_bin_type=True))
    except ProtocolError:
        return
    assert type(out) is type(msg)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=10), _values, max_size=6))
def test_fuzz_random_maps(body):
    body.setdefault("v", PROTOCOL_VERSION)
    try:
        decode(msgpack.packb(body, use_bin_type=True))
    except ProtocolError:
        pass


def test_a_join_runs_with_the_plan_before_it_less_the_sequences_it_frees_and_its_outcome_splits_back_per_plan():
    """StepPlan.joined and StepOutcome.split, which the worker service uses for a plan that joins the next one."""
    ahead = StepPlan("w0", 1, 10, scheduled=[ScheduledSequence(4, 0, 8, [7])], freed=[1],
                     decodes=Decodes([2, 3, 5], [16, 9, 32], [0, 2], [8, 9]))
    new = NewSequence(6, "late", 0, [1, 2, 3], [], PARAMS)
    join = StepPlan("w0", 1, 11, [new], [ScheduledSequence(6, 0, 3, [10])], freed=[3], joins=True)
    step = ahead.joined(join)
    assert (step.step_id, step.freed, step.new_sequences) == (10, [1, 3], [new])
    assert [(s.seq_id, s.num_computed_tokens, s.new_block_ids) for s in step.sequences()] == \
        [(2, 16, [8]), (5, 32, [9]), (4, 0, [7]), (6, 0, [10])], "3 left before the pass; the blocks stay in place"
    tokens = [TokenOutput(rid, 0, 0, t) for rid, t in (("a", 20), ("b", 21), ("c", 22), ("late", 23))]
    result = StepResult("w0", 1, 10, [2, 5, 4, 6], [20, 21, 22, 23], [RefusedRequest("late", "bad")], waited=0.5)
    first, joined = StepOutcome(result, tokens).split([join])
    assert (first.result.step_id, first.result.seq_ids, first.result.token_ids, first.result.refused) == \
        (10, [2, 5, 4], [20, 21, 22], [])
    assert first.result.waited == 0.5 and first.outputs == tokens[:3]
    assert (joined.result.step_id, joined.result.seq_ids, joined.outputs) == (11, [6], tokens[3:])
    assert joined.result.refused == [RefusedRequest("late", "bad")] and joined.result.waited == 0.0
