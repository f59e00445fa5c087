"""How many proposed tokens each running sequence may check in a step (speculative decoding), and what its last
drafts came to.

The worker proposes (gpu_worker/proposers.py) and reports, after each step, the draft it holds for a sequence's
next one (`ready`); the scheduler reserves that many slots more after the sequence's decode token, within the step's
budget, the request's max_tokens and max_model_len. Per sequence, the slots offered adapt to how its drafts fared:
up to one more than its last draft accepted (all of the config's tokens after a draft accepted whole), and after a
draft that had nothing accepted, none at all for a pause that doubles with each such draft (up to `MAX_PAUSE`
steps; a draft with tokens accepted halves the count), so a sequence whose text does not repeat decodes as it would
without speculation: each step with a draft to check is planned without a lookahead, which costs every sequence
of the worker a little. Slots of rejected tokens are given
back when the result comes in (WorkerScheduler.apply_result). A worker running more sequences than the config's
`disable_by_batch_size` gets no drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import RequestState, SeqState
from shared.protocol import DraftReport
from shared.speculative_config import SpeculativeConfig

MAX_PAUSE = 64  # steps a sequence whose drafts keep failing waits at most before it may draft again


@dataclass(slots=True)
class DraftTally:
    """Drafts checked on one worker since start (vLLM's spec-decode metrics)."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted tokens by their place in the draft


class Drafting:
    def __init__(self, config: SpeculativeConfig | None, max_model_len: int) -> None:
        self.max_draft = config.num_speculative_tokens if config is not None else 0
        self.max_batch = config.disable_by_batch_size if config is not None else 0
        self.off = False  # this step offers no drafts: the worker runs more than `max_batch` sequences
        self.max_model_len = max_model_len
        self.tally = DraftTally(accepted_at=[0] * self.max_draft)

    def begin_step(self, running_seqs: int) -> None:
        """A step is being built on a worker running `running_seqs` sequences (called only under a limit)."""
        self.off = running_seqs > self.max_batch

    def offer(self, rs: RequestState, seq: SeqState, budget: int) -> int:
        """Draft tokens the sequence may check after its decode token in the step being built (`budget`: the step's
        tokens left after that one)."""
        if self.off or not seq.draft_ready or seq.draft_pause or rs.req.params.constraint is not None:
            return 0
        outputs = len(rs.outputs[seq.sample_index]) + seq.num_placeholders + 1  # with the decode token's
        return max(0, min(seq.draft_ready, seq.draft_cap or self.max_draft, budget,
                          rs.req.params.max_tokens - outputs, self.max_model_len - seq.num_computed - 1))

    def reported(self, seq: SeqState, report: DraftReport | None) -> None:
        """A step's result for a sequence that ran in it: its draft's fate, and the next one the worker holds."""
        seq.draft_ready = report.ready if report is not None else 0
        if seq.draft_pause:
            seq.draft_pause -= 1
        if report is None or not report.proposed:
            return
        tally = self.tally
        tally.drafts += 1
        tally.draft_tokens += report.proposed
        tally.accepted_tokens += report.accepted
        for place in range(report.accepted):
            tally.accepted_at[place] += 1
        if report.accepted:
            seq.draft_misses //= 2
            seq.draft_cap = self.max_draft if report.accepted == report.proposed else report.accepted + 1
        else:
            seq.draft_misses += 1
            seq.draft_cap = 1
            seq.draft_pause = min(MAX_PAUSE, 1 << (seq.draft_misses - 1))
