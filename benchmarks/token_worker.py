"""A model-free worker for scheduler benchmarks: it follows each sequence's length through the step plans
and samples a token for every sequence whose chunk reaches its end, as the real worker would."""
from __future__ import annotations

from typing import Callable

from shared.protocol import StepPlan, StepResult, TokenOutput, WorkerRegistration


def default_token(rid: str, sample_index: int, output_index: int) -> int:
    return 1000 + 7 * sample_index + output_index % 97


class TokenWorker:
    def __init__(self, reg: WorkerRegistration, pick: Callable[[str, int, int], int] = default_token) -> None:
        self.reg = reg
        self.pick = pick
        self.seqs: dict[int, list] = {}  # seq id → [rid, sample index, tokens, outputs]

    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished:
            self.seqs.pop(seq_id, None)
        for new in plan.new_sequences:
            outputs = len(new.output_token_ids)
            self.seqs[new.seq_id] = [new.rid, new.sample_index, len(new.prompt_token_ids) + outputs, outputs]
        outputs = []
        for sched in plan.scheduled:
            seq = self.seqs[sched.seq_id]
            if sched.num_computed_tokens + sched.num_new_tokens == seq[2]:
                outputs.append(TokenOutput(seq[0], seq[1], seq[3], self.pick(seq[0], seq[1], seq[3])))
                seq[2] += 1
                seq[3] += 1
        return StepResult(plan.worker_id, plan.epoch, plan.step_id, outputs)
