"""A worker that executes step plans by the letter of the contract on a shadow KV cache (no model).

Each slot of the shadow cache holds the token-id prefix whose KV a real worker would have written
there, so every position a step reads is checked against the sequence's own tokens: a wrong prefix
hit, a lost copy-on-write, a bad swap or a stale block table shows up as a mismatch.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from shared.protocol import (
    BeamCandidates, DraftReport, StepOutcome, StepPlan, StepResult, TokenOutput, WorkerRegistration,
)
from shared.sampling import SamplingParams, finish_reason

# (rid, sample_index, output_index) → token id
TokenPicker = Callable[[str, int, int], int]
# n → a count from 0 to n: how many draft tokens to propose, how many of them are right, how many to hold next
DraftCounter = Callable[[int], int]
REJECTED = -7  # a proposed token no sampler ever returns: the place where a draft goes wrong


@dataclass(slots=True)
class SimSequence:
    rid: str
    sample_index: int
    params: SamplingParams
    tokens: list[int]
    num_outputs: int
    table: list[int] = field(default_factory=list)
    finished: bool = False  # as the real worker: a lookahead planned before the finish was known skips it


class SimWorker:
    def __init__(self, reg: WorkerRegistration, pick: TokenPicker, drafts: DraftCounter | None = None) -> None:
        self.reg = reg
        self.pick = pick
        self.drafts = drafts  # speculative decoding: drafts of these sizes, each written into its reserved slots
        self.epoch: int | None = None
        self.slots: dict[int, tuple[int, ...]] = {}
        self.swap: dict[int, list[tuple[int, ...] | None]] = {}
        self.seqs: dict[int, SimSequence] = {}
        self.last_step = -1

    def block_content(self, block_id: int) -> list[tuple[int, ...] | None]:
        bs = self.reg.block_size
        return [self.slots.get(block_id * bs + k) for k in range(bs)]

    def execute(self, plan: StepPlan) -> StepOutcome:
        bs = self.reg.block_size
        assert plan.worker_id == self.reg.worker_id
        if plan.epoch != self.epoch:
            self.epoch, self.seqs, self.last_step = plan.epoch, {}, -1
        assert plan.step_id > self.last_step, "step ids grow"
        self.last_step = plan.step_id
        for seq_id in plan.freed:
            self.seqs.pop(seq_id, None)
        for dev, swap in plan.swap_out:
            assert 0 < dev < self.reg.num_blocks and 0 <= swap < self.reg.num_swap_blocks
            self.swap[swap] = self.block_content(dev)
        for swap, dev in plan.swap_in:
            assert 0 < dev < self.reg.num_blocks and swap in self.swap
            for k, value in enumerate(self.swap[swap]):
                self.slots[dev * bs + k] = value
        for src, dst in plan.copies:
            assert 0 < src < self.reg.num_blocks and 0 < dst < self.reg.num_blocks and src != dst
            for k, value in enumerate(self.block_content(src)):
                self.slots[dst * bs + k] = value
        for new in plan.new_sequences:
            assert new.seq_id not in self.seqs, "a NewSequence is sent once"
            prompt = new.prompt_token_ids
            if new.fork_of is not None:
                parent = self.seqs[new.fork_of]
                assert not prompt, "a fork takes its parent's prompt"
                prompt = parent.tokens[:len(parent.tokens) - parent.num_outputs]
            self.seqs[new.seq_id] = SimSequence(new.rid, new.sample_index, new.params,
                                                prompt + new.output_token_ids, len(new.output_token_ids))
        written: set[int] = set()
        computed = []
        verified: dict[int, tuple[int, list[int]]] = {}  # seq id → its draft's length and the tokens its step gives
        beams: list[BeamCandidates] = []
        for sched in plan.sequences():
            seq = self.seqs[sched.seq_id]
            if sched.block_table is not None:
                seq.table = list(sched.block_table)
            else:
                seq.table.extend(sched.new_block_ids)
            if seq.finished:
                continue
            seq.tokens += sched.append_token_ids
            seq.num_outputs += len(sched.append_token_ids)
            computed.append(sched)
            end = sched.num_computed_tokens + sched.num_new_tokens
            assert sched.num_new_tokens > 0 and end <= len(seq.tokens)
            assert len(seq.table) * bs >= end, "the table covers every position computed"
            assert 0 not in seq.table[:-(-end // bs)], "the null block is never used"
            draft: list[int] = []
            if sched.num_draft_tokens and end == len(seq.tokens) and not seq.params.beam_width and self.drafts:
                assert len(seq.table) * bs >= end + sched.num_draft_tokens, "the table covers the draft's slots"
                proposed = self.drafts(sched.num_draft_tokens)
                right = self.drafts(proposed)
                tokens = [self.pick(seq.rid, seq.sample_index, seq.num_outputs + i) for i in range(right + 1)]
                draft = (tokens[:right] + [REJECTED] * proposed)[:proposed]
                verified[sched.seq_id] = (proposed, tokens)
            for p in range(sched.num_computed_tokens, end + len(draft)):
                slot = seq.table[p // bs] * bs + p % bs
                assert slot not in written, "two sequences write one slot in one step"
                written.add(slot)
                self.slots[slot] = tuple((seq.tokens + draft)[:p + 1])
        outputs: list[TokenOutput] = []
        seq_ids: list[int] = []
        reports: list[DraftReport] = []
        for sched in computed:
            seq = self.seqs[sched.seq_id]
            end = sched.num_computed_tokens + sched.num_new_tokens
            for p in range(end):
                slot = seq.table[p // bs] * bs + p % bs
                assert self.slots.get(slot) == tuple(seq.tokens[:p + 1]), \
                    f"seq {sched.seq_id} position {p}: the KV there is not its own"
            if end == len(seq.tokens) and seq.params.beam_width:
                beams.append(BeamCandidates(sched.seq_id, self.candidates(seq)))
            elif end == len(seq.tokens):
                proposed, tokens = verified.get(sched.seq_id, (0, []))
                emitted = 0
                for token in tokens or [self.pick(seq.rid, seq.sample_index, seq.num_outputs)]:
                    seq.tokens.append(token)
                    seq.num_outputs += 1
                    emitted += 1
                    reason = finish_reason(seq.params, seq.tokens[len(seq.tokens) - seq.num_outputs:],
                                           len(seq.tokens), self.reg.max_model_len, self.reg.eos_token_ids)
                    seq.finished = reason is not None
                    outputs.append(TokenOutput(seq.rid, seq.sample_index, seq.num_outputs - 1, token,
                                               finish_reason=reason))
                    seq_ids.append(sched.seq_id)
                    if seq.finished:
                        break
                ready = self.drafts(4) if self.drafts and not seq.finished else 0
                if proposed or ready:
                    reports.append(DraftReport(sched.seq_id, proposed, min(emitted - 1, proposed), ready))
        result = StepResult(self.reg.worker_id, plan.epoch, plan.step_id, seq_ids, [out.token_id for out in outputs],
                            beams=beams, drafts=reports)
        return StepOutcome(result, outputs)

    def candidates(self, seq: SimSequence) -> list[tuple[int, float]]:
        """A beam's K best continuations under a made-up distribution that depends on its tokens alone."""
        width = seq.params.beam_width
        k = max(2, 1 + (0 if seq.params.ignore_eos else len(self.reg.eos_token_ids))) * width
        rng = random.Random(hash(tuple(seq.tokens)))
        logits = {t: rng.gauss(0.0, 2.0) for t in range(1, 40)}
        norm = math.log(sum(math.exp(v) for v in logits.values()))
        top = sorted(logits.items(), key=lambda item: -item[1])[:k]
        return [(t, v - norm) for t, v in top]


def drive(sched, sims: dict[str, SimWorker], outputs: dict[tuple[str, int], list[int]] | None = None,
          rounds: int | None = None) -> list[StepPlan]:
    """Step every worker (plan, execute, apply) until no request is left, or for `rounds` rounds; returns
    the plans in order. Given `outputs`, it collects each sample's tokens there, checking that every output
    index arrives exactly once."""
    plans: list[StepPlan] = []
    for _ in range(rounds or 10_000):
        if not sched.has_unfinished():
            return plans
        planned = False
        for wid in sched.worker_ids:
            plan = sched.schedule(wid)
            if plan is None:
                continue
            planned = True
            plans.append(plan)
            outcome = sims[wid].execute(plan)
            sched.apply_result(outcome.result)
            for out in outcome.outputs if outputs is not None else ():
                tokens = outputs.setdefault((out.rid, out.sample_index), [])
                assert out.output_index == len(tokens), "each output index arrives exactly once"
                tokens.append(out.token_id)
        assert planned or not sched.has_unfinished(), "requests wait but no worker got a plan"
    assert rounds is not None, "requests still unfinished after 10000 rounds"
    return plans
