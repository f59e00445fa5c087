"""A request's sequences on its worker as a group, with its own strategy: which sequences compute how far in a
step, and what a step's result does to them.

Both open their live samples (or beams) as one group does (`ForkingGroup`): those that share tokens (the prompt,
and any output they agree on) compute them once in the first one's sequence, then the others fork from it
(copy-on-write). `SamplingGroup`: one sample, or n; the worker samples each sequence's next token, which is
appended to its sample. `BeamGroup`: the live beams of a beam search (scheduler/beam_search.py); the worker reports
each beam's candidates instead of sampling, and once every live beam reported, the search keeps the best
continuations: a beam that goes on in several ways forks its sequence, one that does not is freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from scheduler.beam_search import BeamSearch, Hypothesis
from shared.sampling import finish_reason

if TYPE_CHECKING:  # a group acts on its request's scheduler: types only, never an import cycle at run time
    from scheduler.request import RequestState, SeqState
    from scheduler.worker_scheduler import WorkerScheduler


class Chunk(NamedTuple):
    """A sequence's tokens to compute in a step being built."""
    seq: SeqState
    num_new: int
    emits_token: bool  # they reach the sequence's end: the worker samples a token
    num_draft: int = 0  # tokens its worker may propose after them, checked in the same step (speculative decoding)


class Start(NamedTuple):
    """The sequences a request opens when it is admitted, and how far they compute first."""
    samples: list[int]  # the sample (or beam) indices that get a sequence
    shared_end: int | None  # the fork point they compute to, or None: each to its end
    samples_tokens: bool  # a chunk reaching a sequence's end has the worker sample its next token


@dataclass(slots=True)
class ForkingGroup:
    """What every group does: live samples (or beams) that share a prefix (n > 1, or a group resumed) compute it
    once in the first one's sequence, then the others fork from it."""
    samples_tokens: ClassVar[bool]  # the worker samples a sequence's next token (else it reports candidates)
    fork_at: int | None = None  # the shared tokens' end while the first sequence computes them alone

    def start(self, rs: RequestState) -> Start:
        # Set here, as admission opens the sequences on it; a failed admission starts again with a fresh one.
        self.fork_at = rs.fork_point()
        live = rs.live_samples
        return Start(samples=live if self.fork_at is None else live[:1], shared_end=self.fork_at,
                     samples_tokens=self.samples_tokens)

    def prepare(self, ws: WorkerScheduler, rs: RequestState) -> None:
        """Before its chunks are taken: once the first sequence has the shared tokens, the others fork from it,
        sharing its blocks up to the fork point, each going on with its own tokens."""
        if self.fork_at is None or rs.seqs[0].num_computed != self.fork_at:
            return
        parent = rs.seqs[0]
        for i in rs.live_samples[1:]:
            rs.seqs.append(ws.fork(parent, i, self.fork_at))
        self.fork_at = None
        ws.reservation.forked(ws, rs)

    def chunks(self, rs: RequestState, budget: int, seqs_left: int) -> list[Chunk]:
        """Each sequence's tokens for this step (to the fork point, or to its target), within the budget and the cap.
        (The shared tokens before a fork point sample nothing: the first sequence has no token in flight.)"""
        fork_at, chunks = self.fork_at, []
        emits = fork_at is None and self.samples_tokens
        for seq in rs.seqs:
            if budget == 0 or seqs_left == 0:
                break
            left = (rs.target(seq) if fork_at is None else fork_at) - seq.num_computed
            num_new = min(left, budget)
            if num_new > 0:
                chunks.append(Chunk(seq, num_new, num_new == left and emits))
                budget -= num_new
                seqs_left -= 1
        return chunks

    def released(self) -> None:
        """Its sequences are gone (preempted by recompute, ended, or their worker lost)."""
        self.fork_at = None


@dataclass(slots=True)
class SamplingGroup(ForkingGroup):
    samples_tokens: ClassVar[bool] = True

    def reports(self, rs: RequestState, seq: SeqState, end: int) -> bool:
        """Whether a chunk to `end` that samples no token has the worker report candidates: never here."""
        return False

    def token(self, ws: WorkerScheduler, rs: RequestState, seq: SeqState, token_id: int) -> None:
        """A token the worker sampled: appended to its sample, which may end there (and the request with it)."""
        output = rs.outputs[seq.sample_index]
        output.append(token_id)
        if token_id not in rs.ends_on and len(output) < rs.ends_at:
            return  # (most tokens: finish_reason, which says why a sample ends, need not run)
        reason = finish_reason(rs.req.params, output, rs.prompt_len + len(output), ws.reg.max_model_len,
                               ws.reg.eos_token_ids)
        if reason is None:
            return
        if seq in rs.seqs:  # (a request preempted while its token was in flight holds no sequence)
            ws.drop(seq)
            rs.seqs.remove(seq)
        rs.reasons[seq.sample_index] = rs.last_reason = reason
        if rs.done:
            ws.finish(rs, reason)
        else:
            ws.reseat(rs)

    def cut_short(self, rs: RequestState) -> list[Hypothesis] | None:
        """What the request ends with when the cache cannot hold it: its samples' tokens so far, as streamed."""
        return None


@dataclass(slots=True)
class BeamGroup(ForkingGroup):
    samples_tokens: ClassVar[bool] = False
    search: BeamSearch = field(kw_only=True)  # its samples are the live beams, best first

    def reports(self, rs: RequestState, seq: SeqState, end: int) -> bool:
        """A chunk to the beam's end has the worker report its candidates."""
        return end == rs.num_tokens(seq)

    def candidates(self, ws: WorkerScheduler, rs: RequestState, seq: SeqState, top: list[tuple[int, float]]) -> None:
        """A beam's candidates; once every live beam reported, the search advances."""
        self.search.reported[seq.sample_index] = top
        if len(self.search.reported) == len(rs.outputs):
            self._advance(ws, rs)

    def _advance(self, ws: WorkerScheduler, rs: RequestState) -> None:
        """Keep the best continuations (scheduler/beam_search.py). A beam that goes on in several ways forks its
        sequence (its blocks shared, copy-on-write); one that does not is freed."""
        params, reg, search = rs.req.params, ws.reg, self.search
        stops, max_new = rs.ends_on, rs.ends_at

        def stop_reason(token: int, length: int) -> str | None:
            return "stop" if token in stops else "length" if length >= max_new else None
        if search.num_generated + 1 < params.min_tokens:  # stop tokens are not candidates yet (the worker sent
            # one more candidate per stop token for this)
            search.reported = {b: [(t, lp) for t, lp in top if t not in stops] for b, top in search.reported.items()}
        going = search.step(rs.outputs, params.beam_candidates(reg.eos_token_ids), max_new, stop_reason)
        if search.done:
            best = search.best(params.n)
            ws.finish(rs, best[0].finish_reason if best else "length", beams=best)
            return
        parents = {seq.sample_index: seq for seq in rs.seqs}
        seqs = []
        for index, c in enumerate(going):
            parent = parents[c.parent]
            if parent in seqs:
                seq = ws.fork(parent, index, parent.num_computed)
            else:
                seq = parent
                seq.sample_index = index
                seq.appended.append(c.token)
            seqs.append(seq)
        for seq in parents.values():
            if seq not in seqs:
                ws.drop(seq)
        rs.outputs = [rs.outputs[c.parent] + [c.token] for c in going]
        rs.reasons = [None] * len(going)
        rs.seqs = seqs

    def released(self) -> None:
        """Its sequences are gone: every live beam reports again once it runs again."""
        ForkingGroup.released(self)
        self.search.reported = {}

    def cut_short(self, rs: RequestState) -> list[Hypothesis] | None:
        """What the request ends with when the cache cannot hold it: the n best of its finished and live beams."""
        return self.search.cut_short(rs.req.params.n, rs.outputs)


RequestGroup = SamplingGroup | BeamGroup
