"""How far ahead of its worker a per-worker scheduler plans: one plan in flight (`Synchronous`), or one more planned
while the worker computes it (`Lookahead`, async scheduling).

A lookahead plans as if each sequence sampled in the step in flight had its coming token already: one placeholder
each, whose id the worker fills in itself (it runs plans in order, and results come back in order, so blocks freed
meanwhile are reused only by later plans). A lookahead never preempts, since a sequence in flight cannot give back
its token: short of blocks, it ends there, and the worker's pipeline drains before the full step that makes room.
Nor is a plan made behind one in which a sequence checks a draft (speculative decoding): how many tokens that
sequence ends the step with is known only from its result.
"""
from __future__ import annotations

from scheduler.request import RequestState, SeqState


class Synchronous:
    """One plan in flight: the next is planned once its result is in."""

    def may_plan(self, num_in_flight: int, drafting: bool) -> bool:
        """Whether a plan may be made now (`drafting`: the last plan in flight lets a sequence check a draft)."""
        return num_in_flight == 0

    def target(self, rs: RequestState, seq: SeqState, known: int) -> int:
        """The tokens the sequence's KV should cover, given the `known` ones it has to."""
        return known

    def may_make_room(self, num_in_flight: int) -> bool:
        """A running request's chunks do not fit: may the step preempt (True), or must it end here?"""
        return True

    def scheduled(self, seq: SeqState, emits_token: bool) -> None:
        """A chunk of `seq` went into a plan."""

    def token_arrived(self, seq: SeqState) -> None:
        """A token `seq` emitted came back."""


class Lookahead:
    """At most one plan ahead of the one the worker computes, its sequences counting their tokens in flight."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.draining = False  # short of blocks while a plan was in flight: the next plan waits for the pipeline

    def may_plan(self, num_in_flight: int, drafting: bool) -> bool:
        if not num_in_flight:
            self.draining = False
            return True
        return num_in_flight == 1 and not self.draining and not drafting

    def target(self, rs: RequestState, seq: SeqState, known: int) -> int:
        if seq.num_placeholders and self._token_in_flight_ends(rs, seq):
            return seq.num_computed  # nothing after a token that is sure to be its last
        return known + seq.num_placeholders

    def _token_in_flight_ends(self, rs: RequestState, seq: SeqState) -> bool:
        """Whether the sequence's tokens in flight are sure to end it (max_tokens or max_model_len; an EOS
        cannot be foreseen: the worker skips a sequence it saw end)."""
        return (len(rs.outputs[seq.sample_index]) + seq.num_placeholders >= rs.req.params.max_tokens
                or rs.num_tokens(seq) + seq.num_placeholders >= self.max_model_len)

    def may_make_room(self, num_in_flight: int) -> bool:
        if not num_in_flight:
            return True
        self.draining = True
        return False

    def scheduled(self, seq: SeqState, emits_token: bool) -> None:
        seq.num_placeholders += emits_token

    def token_arrived(self, seq: SeqState) -> None:
        seq.num_placeholders -= 1
