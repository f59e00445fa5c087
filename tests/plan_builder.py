"""A tiny test-side stand-in for the scheduler: block allocation with reference counts and step-plan
building, so worker tests can drive exact plans (prefix hits, chunks, swaps, forks, recompute).

It follows the plan semantics of shared/protocol.py (StepPlan, ScheduledSequence) and nothing more: the
real scheduler decides *when*; tests here decide explicitly.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from shared.protocol import NewSequence, ScheduledSequence, StepOutcome, StepPlan
from shared.sampling import SamplingParams

# Greedy and unbounded, so that a sequence ends only where a test says (the oracle ignores EOS too).
GREEDY = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)


@dataclass
class Seq:
    seq_id: int
    rid: str
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent_blocks: int = 0  # entries of `blocks` the worker already has
    replace_table: bool = False  # next schedule sends the whole table (after swap-in or copy-on-write)
    swap_blocks: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class PlanBuilder:
    def __init__(self, worker_id: str, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 epoch: int = 0) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.epoch = epoch
        self.free = list(range(num_blocks - 1, 0, -1))  # a stack: freed blocks are reused first
        self.free_swap = deque(range(num_swap_blocks))
        self.refs: dict[int, int] = {}
        self._seq_ids = itertools.count()
        self._steps = itertools.count()
        self.live: dict[tuple[str, int], Seq] = {}
        self._reset_pending()

    def _reset_pending(self) -> None:
        self.new: list[NewSequence] = []
        self.scheduled: list[ScheduledSequence] = []
        self.copies: list[tuple[int, int]] = []
        self.swap_out_pairs: list[tuple[int, int]] = []
        self.swap_in_pairs: list[tuple[int, int]] = []
        self.freed: list[int] = []

    def _alloc(self) -> int:
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            self.free.append(block)

    def add(self, prompt: list[int], params: SamplingParams | None = None, rid: str | None = None,
            sample_index: int = 0, outputs: list[int] | None = None, prefix_of: Seq | None = None,
            cached_blocks: int = 0) -> Seq:
        """A new sequence; with `prefix_of`, its first `cached_blocks` blocks are a prefix-cache hit on that one's."""
        seq_id = next(self._seq_ids)
        seq = Seq(seq_id, rid or f"r{seq_id}", sample_index, list(prompt), params or GREEDY, list(outputs or []))
        if prefix_of is not None:
            assert prefix_of.tokens[:cached_blocks * self.block_size] == seq.tokens[:cached_blocks * self.block_size]
            seq.blocks = prefix_of.blocks[:cached_blocks]
            for block in seq.blocks:
                self.refs[block] += 1
            seq.num_computed = cached_blocks * self.block_size
        self.new.append(NewSequence(seq_id, seq.rid, sample_index, seq.prompt, seq.outputs, seq.params))
        self.live[(seq.rid, sample_index)] = seq
        return seq

    def fork(self, parent: Seq, sample_index: int) -> Seq:
        """A parallel sample of `parent`'s request sharing all its blocks (copy-on-write on first write)."""
        seq_id = next(self._seq_ids)
        child = Seq(seq_id, parent.rid, sample_index, list(parent.prompt), parent.params, list(parent.outputs),
                    blocks=list(parent.blocks), num_computed=parent.num_computed)
        for block in child.blocks:
            self.refs[block] += 1
        self.new.append(NewSequence(seq_id, child.rid, sample_index, child.prompt, child.outputs, child.params))
        self.live[(child.rid, sample_index)] = child
        return child

    def schedule(self, seq: Seq, num_new: int | None = None) -> None:
        """Compute the next `num_new` tokens of `seq` (default: all it has not computed yet)."""
        num_new = len(seq.tokens) - seq.num_computed if num_new is None else num_new
        first_block = seq.num_computed // self.block_size
        if seq.num_computed % self.block_size and self.refs[seq.blocks[first_block]] > 1:
            shared = seq.blocks[first_block]
            fresh = self._alloc()
            self.copies.append((shared, fresh))
            self._release(shared)
            seq.blocks[first_block] = fresh
            seq.replace_table = True
        while len(seq.blocks) * self.block_size < seq.num_computed + num_new:
            seq.blocks.append(self._alloc())
        if seq.replace_table:
            item = ScheduledSequence(seq.seq_id, seq.num_computed, num_new, block_table=list(seq.blocks))
        else:
            item = ScheduledSequence(seq.seq_id, seq.num_computed, num_new, new_block_ids=seq.blocks[seq.sent_blocks:])
        seq.sent_blocks, seq.replace_table = len(seq.blocks), False
        seq.num_computed += num_new
        self.scheduled.append(item)

    def drop(self, seq: Seq) -> None:
        """Free the sequence (finished, aborted or preempted by recompute)."""
        for block in reversed(seq.blocks):
            self._release(block)
        seq.blocks = []
        self.freed.append(seq.seq_id)

    def recompute(self, seq: Seq) -> Seq:
        """Preempt by recompute: free `seq`, re-send prompt + outputs so far as a new sequence."""
        self.drop(seq)
        return self.add(seq.prompt, seq.params, seq.rid, seq.sample_index, seq.outputs)

    def swap_out(self, seq: Seq) -> None:
        seq.swap_blocks = [self.free_swap.popleft() for _ in seq.blocks]
        self.swap_out_pairs.extend(zip(seq.blocks, seq.swap_blocks))
        for block in seq.blocks:
            self._release(block)
        seq.blocks = []

    def swap_in(self, seq: Seq) -> None:
        seq.blocks = [self._alloc() for _ in seq.swap_blocks]
        self.swap_in_pairs.extend(zip(seq.swap_blocks, seq.blocks))
        self.free_swap.extend(seq.swap_blocks)
        seq.swap_blocks = []
        seq.replace_table = True

    def plan(self) -> StepPlan:
        plan = StepPlan(self.worker_id, self.epoch, next(self._steps), self.new, self.scheduled, self.copies,
                        self.swap_out_pairs, self.swap_in_pairs, self.freed)
        self._reset_pending()
        return plan

    def apply(self, outcome: StepOutcome) -> None:
        assert outcome.result.error is None, outcome.result.error
        for out in outcome.outputs:
            seq = self.live[(out.rid, out.sample_index)]
            assert out.output_index == len(seq.outputs)
            seq.outputs.append(out.token_id)
            seq.logprobs.append(out.logprob)
            seq.top_logprobs.append(out.top_logprobs)
            seq.finish_reasons.append(out.finish_reason)


def step(worker, builder: PlanBuilder) -> StepOutcome:
    outcome = worker.execute(builder.plan())
    builder.apply(outcome)
    return outcome


def run_until(worker, builder: PlanBuilder, seqs: list[Seq], num_outputs: int) -> None:
    """Step every sequence (whole remaining prompt, then one token a step) until each has `num_outputs` or
    has finished."""
    while True:
        pending = [s for s in seqs if len(s.outputs) < num_outputs and not (s.finish_reasons and s.finish_reasons[-1])]
        if not pending:
            return
        for seq in pending:
            builder.schedule(seq)
        step(worker, builder)
