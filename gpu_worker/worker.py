"""The worker core (sans-IO): a step plan in, a step result out.

It keeps each sequence's tokens, parameters and block table between steps and applies a plan in the
order the protocol fixes (shared/protocol.py, StepPlan): new epoch → free the freed → swap out →
swap in → copies → register new sequences → one forward pass → sample. A sequence the plan cannot run
(token ids outside the vocabulary, an unknown id, a table that does not cover its tokens) is refused
alone: its request is named in the result's refusals and the rest of the step runs. A plan that is
unusable as a whole (another worker's, block moves out of range) is refused before anything changes,
with a StepResult carrying the error. A sequence that stopped here (its last token out, or its step
failed, or it was refused) is skipped from then on: with async scheduling the plan after it was made
before the scheduler knew.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from gpu_worker.proposers import proposer_for
from gpu_worker.sampler import SampledToken, StepToken
from gpu_worker.sequence import Chunk, SequenceState
from gpu_worker.structured import Grammars, SequenceGrammar
from shared import model_dir as model_dirs
from shared.protocol import (
    BeamCandidates, DraftReport, RefusedRequest, ScheduledSequence, StepOutcome, StepPlan, StepResult, TokenOutput,
    WorkerRegistration,
)
from shared.sampling import SamplingParams, finish_reason
from shared.settings import Settings
from shared.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


class PlanError(ValueError):
    """A step plan the worker cannot execute as written (unknown sequence, block out of range, ...)."""


class BlockOps(Protocol):
    def swap_out(self, pairs: list[tuple[int, int]]) -> None: ...
    def swap_in(self, pairs: list[tuple[int, int]]) -> None: ...
    def copy(self, pairs: list[tuple[int, int]]) -> None: ...


class Runner(Protocol):
    """The device side the worker core drives: the model runner, or any stand-in with the same semantics."""
    cache: BlockOps

    def execute(self, chunks: list[Chunk], eos_token_ids: list[int],
                drafts: dict[int, list[int]]) -> list[StepToken]:
        """Sample each chunk that ends its sequence; a sequence with a draft (seq id → proposed tokens) gets the
        draft's accepted tokens and the one after them (gpu_worker/speculation.py), in order."""


class Worker:
    def __init__(self, runner: Runner, registration: WorkerRegistration, grammars: Grammars | None = None,
                 speculation: SpeculativeConfig | None = None) -> None:
        self.runner = runner
        self.proposer = proposer_for(speculation)
        self.max_draft = speculation.num_speculative_tokens if speculation is not None else 0
        self._registration = registration
        self.grammars = grammars  # constrained outputs; None where the device cannot run them (simulated)
        self.eos_token_ids = list(registration.eos_token_ids)
        self.vocab_size = registration.vocab_size
        self.epoch: int | None = None
        self.seqs: dict[int, SequenceState] = {}
        # Sequences that stopped here: their last token out, or their step failed or was refused (the scheduler
        # fails their requests). A plan made before the scheduler knew may still list them; they are skipped until
        # a plan frees them.
        self.stopped: set[int] = set()

    @classmethod
    def load(cls, settings: Settings, worker_id: str = "worker-0", progress: bool = True) -> "Worker":
        """A worker over the model in `settings.model`, its KV cache sized from the settings (a simulated device's:
        gpu_worker/worker_factory.py)."""
        from gpu_worker.model_runner import ModelRunner

        model_dir = model_dirs.resolve_model_dir(settings.model)
        path = model_dir.path
        runner = ModelRunner(settings, path, progress)
        eos = list(model_dirs.eos_token_ids(path))
        vocab = runner.model.lm_head.out_features
        return cls(runner, WorkerRegistration(
            worker_id=worker_id,
            model_id=model_dir.served_name(settings.served_model_name),
            num_blocks=runner.cache.num_blocks,
            num_swap_blocks=runner.cache.num_swap_blocks,
            block_size=settings.block_size,
            max_model_len=runner.max_model_len,
            eos_token_ids=eos,
            vocab_size=vocab,
            batch_invariant=runner.batch_invariant,
        ), Grammars(path, vocab, eos), settings.speculation)

    @property
    def registration(self) -> WorkerRegistration:
        return self._registration

    def execute(self, plan: StepPlan) -> StepOutcome:
        reg = self._registration
        sequences = plan.sequences()
        try:
            failed = self._check(plan, sequences)
        except PlanError as e:
            log.error("refused step %d of epoch %d: %s", plan.step_id, plan.epoch, e)
            self._enter_epoch(plan.epoch)
            self._free(plan.freed)
            self.stopped.update(_seq_ids(plan, sequences))
            return StepOutcome(StepResult(reg.worker_id, plan.epoch, plan.step_id, error=f"bad step plan: {e}"))
        self._enter_epoch(plan.epoch)
        self._free(plan.freed)
        cache = self.runner.cache
        cache.swap_out(plan.swap_out)
        cache.swap_in(plan.swap_in)
        cache.copy(plan.copies)
        for msg in plan.new_sequences:
            if msg.seq_id not in failed:
                prompt = msg.prompt_token_ids if msg.fork_of is None else self.seqs[msg.fork_of].prompt_token_ids
                seq = SequenceState.from_message(msg, prompt, self._run_params(msg.params))
                if seq.params.constraint is not None:
                    if self.grammars is None:
                        failed[msg.seq_id] = "this worker cannot constrain outputs (a simulated device)"
                        continue
                    seq.grammar = SequenceGrammar(seq.params.constraint, self.vocab_size)
                self.seqs[msg.seq_id] = seq
                self.stopped.discard(msg.seq_id)  # an id named by a refused plan that never registered it
        self.stopped.update(failed)
        chunks = []
        drafts: dict[int, list[int]] = {}
        for item in sequences:
            if item.seq_id in self.stopped:
                continue
            seq = self.seqs[item.seq_id]
            seq.token_ids += item.append_token_ids
            if seq.reports_prompt and seq.num_cached_tokens is None:
                seq.num_cached_tokens = item.num_computed_tokens
            if item.block_table is not None:
                seq.block_table = list(item.block_table)
            else:
                seq.block_table.extend(item.new_block_ids)
            chunks.append(Chunk(seq, item.num_computed_tokens, item.num_new_tokens))
            if item.num_draft_tokens and self._drafts_for(seq) and item.num_computed_tokens + item.num_new_tokens == \
                    len(seq.token_ids):
                draft = self._draft(seq)[:item.num_draft_tokens]
                if draft:
                    drafts[seq.seq_id] = draft
        if self.grammars is not None:
            self.grammars.prepare([(seq.grammar, seq.output_token_ids) for seq, computed, new in chunks
                                   if seq.grammar is not None and computed + new == len(seq.token_ids)])
        try:
            sampled_tokens = self.runner.execute(chunks, self.eos_token_ids, drafts)
        except Exception:
            self.stopped.update(_seq_ids(plan, sequences))
            raise
        # a sequence whose grammar failed (it rejects the output a resumed request brings, or its work ran out of
        # fuel) is failed alone: its token, sampled unconstrained, is dropped
        broken = {seq.seq_id: seq.grammar.error for seq, _ in sampled_tokens
                  if seq.grammar is not None and seq.grammar.error is not None}
        failed |= broken
        self.stopped.update(broken)
        outputs: list[TokenOutput] = []
        seq_ids: list[int] = []
        beams = []
        emitted: dict[int, SequenceState] = {}
        counts: dict[int, int] = {}
        for seq, sampled in sampled_tokens:
            if seq.seq_id in self.stopped:  # failed, or ended by an earlier token of its draft
                continue
            if seq.params.beam_width:  # the scheduler ranks the beams' candidates and chooses
                beams.append(BeamCandidates(seq.seq_id, sampled.top_logprobs))
                continue
            output_index = seq.num_output_tokens
            seq.token_ids.append(sampled.token_id)
            seq_ids.append(seq.seq_id)
            emitted[seq.seq_id] = seq
            counts[seq.seq_id] = counts.get(seq.seq_id, 0) + 1
            reason = finish_reason(seq.params, seq.output_token_ids, len(seq.token_ids), reg.max_model_len,
                                   self.eos_token_ids)
            if reason is not None:
                self.stopped.add(seq.seq_id)
                if self.proposer is not None:
                    self.proposer.finished(seq)
            first = seq.reports_prompt and output_index == 0
            outputs.append(TokenOutput(seq.rid, seq.sample_index, output_index, sampled.token_id, sampled.logprob,
                                       sampled.top_logprobs, reason, worker_id=reg.worker_id, epoch=plan.epoch,
                                       num_cached_tokens=seq.num_cached_tokens if first else None,
                                       prompt_logprobs=seq.prompt_logprobs if first else None))
        reports = self._draft_reports(emitted, drafts, counts) if self.proposer is not None else []
        result = StepResult(reg.worker_id, plan.epoch, plan.step_id, seq_ids, [out.token_id for out in outputs],
                            self._refusals(plan, failed), beams=beams, drafts=reports)
        return StepOutcome(result, outputs)

    def _drafts_for(self, seq: SequenceState) -> bool:
        """Whether the sequence may speculate: a proposer, and neither a beam nor constrained (its proposals would
        have to be checked against its grammar too: not done, so it decodes one token a step)."""
        return self.proposer is not None and not seq.params.beam_width and seq.grammar is None

    def _draft(self, seq: SequenceState) -> list[int]:
        """The proposer's draft after the sequence's tokens (made once per length)."""
        if seq.draft_at != len(seq.token_ids):
            seq.draft = self.proposer.propose(seq, self.max_draft)
            seq.draft_at = len(seq.token_ids)
        return seq.draft

    def _draft_reports(self, emitted: dict[int, SequenceState], drafts: dict[int, list[int]],
                       counts: dict[int, int]) -> list[DraftReport]:
        """What each drafting sequence's draft came to, and the draft each going one holds for its next step."""
        reports = []
        for seq_id, seq in emitted.items():
            going = seq_id not in self.stopped and self._drafts_for(seq)
            ready = len(self._draft(seq)) if going else 0
            proposed = len(drafts.get(seq_id, ()))
            if ready or proposed:
                reports.append(DraftReport(seq_id, proposed, min(counts[seq_id] - 1, proposed), ready))
        return reports

    def _run_params(self, params: SamplingParams) -> SamplingParams:
        """A beam's next-token candidates are the most likely tokens of the model's distribution (as in
        transformers' beam search): K of them (SamplingParams.beam_candidates), plus one per stop token, which the
        scheduler drops while min_tokens forbids them."""
        if not params.beam_width:
            return params
        candidates = params.beam_candidates(self.eos_token_ids) + len(params.stop_tokens(self.eos_token_ids))
        return dataclasses.replace(params, temperature=0.0, logprobs=candidates)

    def _refusals(self, plan: StepPlan, failed: dict[int, str]) -> list[RefusedRequest]:
        """Each request with a sequence the plan cannot run, once (the scheduler fails that request; the rest of the
        step runs)."""
        rids = {m.seq_id: m.rid for m in plan.new_sequences} | {sid: s.rid for sid, s in self.seqs.items()}
        refused: dict[str, str] = {}
        for seq_id, reason in failed.items():
            if seq_id in rids:
                refused.setdefault(rids[seq_id], reason)
        for rid, reason in refused.items():
            log.error("step %d of epoch %d: refused the sequences of request %s: %s", plan.step_id, plan.epoch,
                      rid, reason)
        return [RefusedRequest(rid, f"bad step plan: {reason}") for rid, reason in refused.items()]

    def _enter_epoch(self, epoch: int) -> None:
        """A new scheduler: what the old one had sent means nothing now."""
        if epoch != self.epoch:
            self.seqs.clear()
            self.stopped.clear()
            self.epoch = epoch

    def _free(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)
            self.stopped.discard(seq_id)

    def _check(self, plan: StepPlan, sequences: list[ScheduledSequence]) -> dict[int, str]:
        """Raise PlanError when the plan as a whole cannot run against the state it will meet (another
        worker's, block moves out of range, a sequence sent twice); return the sequences it names that cannot
        run (seq id → why): those alone are refused."""
        reg = self._registration
        if plan.worker_id != reg.worker_id:
            raise PlanError(f"plan for worker {plan.worker_id!r} reached {reg.worker_id!r}")
        live = set() if plan.epoch != self.epoch else set(self.seqs) - set(plan.freed)
        _check_pairs("swap_out", plan.swap_out, (1, reg.num_blocks), (0, reg.num_swap_blocks))
        _check_pairs("swap_in", plan.swap_in, (0, reg.num_swap_blocks), (1, reg.num_blocks))
        _check_pairs("copies", plan.copies, (1, reg.num_blocks), (1, reg.num_blocks))
        failed: dict[int, str] = {}
        lengths: dict[int, int] = {}
        prompts: dict[int, int] = {}  # prompt lengths of the sequences this plan registers
        for msg in plan.new_sequences:
            if msg.seq_id in live:
                raise PlanError(f"new sequence {msg.seq_id} is already known")
            bad = [t for t in [*msg.prompt_token_ids, *msg.output_token_ids] if not 0 <= t < self.vocab_size]
            if msg.fork_of is not None and msg.fork_of not in live:
                failed[msg.seq_id] = f"new sequence {msg.seq_id} forks sequence {msg.fork_of}, which is unknown"
            elif msg.fork_of is None and not msg.prompt_token_ids:
                failed[msg.seq_id] = f"new sequence {msg.seq_id} has an empty prompt"
            elif bad:
                failed[msg.seq_id] = (f"new sequence {msg.seq_id} has token ids outside the vocabulary "
                                      f"(0..{self.vocab_size - 1}): {bad[:4]}")
            else:
                live.add(msg.seq_id)
                parent = msg.fork_of
                prompts[msg.seq_id] = (len(msg.prompt_token_ids) if parent is None else
                                       prompts[parent] if parent in prompts else self.seqs[parent].num_prompt_tokens)
                lengths[msg.seq_id] = prompts[msg.seq_id] + len(msg.output_token_ids)
        seen = set()
        stopped = (self.stopped - set(plan.freed) - {m.seq_id for m in plan.new_sequences}
                 if plan.epoch == self.epoch else set())
        for item in sequences:
            sid = item.seq_id
            if sid in stopped or sid in failed:
                continue  # skipped, whatever the plan says of it
            reason = self._item_problem(item, sid in live, lengths.get(sid), sid in seen)
            seen.add(sid)
            if reason is not None:
                failed[sid] = reason
        return failed

    def _item_problem(self, item: ScheduledSequence, known: bool, new_length: int | None, again: bool) -> str | None:
        """Why one scheduled sequence cannot run, or None."""
        reg = self._registration
        sid = item.seq_id
        if not known:
            return f"sequence {sid} is scheduled but unknown (never sent or already freed)"
        if again:
            return f"sequence {sid} is scheduled twice"
        length = (new_length if new_length is not None else len(self.seqs[sid].token_ids)) + len(item.append_token_ids)
        end = item.num_computed_tokens + item.num_new_tokens
        if any(not 0 <= t < self.vocab_size for t in item.append_token_ids):
            return f"sequence {sid} is given token ids outside the vocabulary (0..{self.vocab_size - 1})"
        if item.num_computed_tokens < 0 or item.num_new_tokens < 1 or end > length:
            return f"sequence {sid} of {length} tokens cannot compute tokens [{item.num_computed_tokens}, {end})"
        if end > reg.max_model_len:
            return f"sequence {sid} reaches {end} tokens, beyond max_model_len {reg.max_model_len}"
        if item.block_table is not None:
            table_len, added = len(item.block_table), item.block_table
        else:
            table_len = (0 if new_length is not None else len(self.seqs[sid].block_table)) + len(item.new_block_ids)
            added = item.new_block_ids
        bad = [b for b in added if not 1 <= b < reg.num_blocks]
        if bad:
            return f"sequence {sid} got block ids outside 1..{reg.num_blocks - 1}: {bad[:4]}"
        if table_len * reg.block_size < end + item.num_draft_tokens:
            return (f"sequence {sid}'s block table of {table_len} blocks does not cover {end} tokens and "
                    f"{item.num_draft_tokens} draft tokens")
        if item.num_draft_tokens < 0 or end + item.num_draft_tokens > reg.max_model_len:
            return f"sequence {sid} may not check {item.num_draft_tokens} draft tokens after {end}"
        return None


def _check_pairs(name: str, pairs: list[tuple[int, int]], src_range: tuple[int, int],
                 dst_range: tuple[int, int]) -> None:
    for src, dst in pairs:
        if not (src_range[0] <= src < src_range[1] and dst_range[0] <= dst < dst_range[1]):
            raise PlanError(f"{name} pair ({src}, {dst}) is out of range: sources {src_range[0]}.."
                            f"{src_range[1] - 1}, targets {dst_range[0]}..{dst_range[1] - 1}")


def _seq_ids(plan: StepPlan, sequences: list[ScheduledSequence]) -> list[int]:
    """Every sequence the plan names."""
    return [m.seq_id for m in plan.new_sequences] + [item.seq_id for item in sequences]
