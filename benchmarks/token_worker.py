"""A model-free worker for scheduler benchmarks: it follows each sequence's tokens through the step plans and
samples a token for every sequence whose chunk reaches its end, as the real worker would; a beam gets its K
best continuations under a made-up, peaked distribution that depends on its tokens alone."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from shared.protocol import BeamCandidates, StepOutcome, StepPlan, StepResult, TokenOutput, WorkerRegistration
from shared.sampling import SamplingParams

CANDIDATES = 64  # tokens a beam's made-up distribution covers


def default_token(rid: str, sample_index: int, output_index: int) -> int:
    return 1000 + 7 * sample_index + output_index % 97


@dataclass(slots=True)
class TokenSeq:
    rid: str
    sample_index: int
    params: SamplingParams
    tokens: list[int]
    num_outputs: int


class TokenWorker:
    def __init__(self, reg: WorkerRegistration, pick: Callable[[str, int, int], int] = default_token) -> None:
        self.reg = reg
        self.pick = pick
        self.seqs: dict[int, TokenSeq] = {}

    def execute(self, plan: StepPlan) -> StepOutcome:
        for seq_id in plan.freed:
            self.seqs.pop(seq_id, None)
        for new in plan.new_sequences:
            prompt = new.prompt_token_ids
            if new.fork_of is not None:
                parent = self.seqs[new.fork_of]
                prompt = parent.tokens[:len(parent.tokens) - parent.num_outputs]
            self.seqs[new.seq_id] = TokenSeq(new.rid, new.sample_index, new.params, prompt + new.output_token_ids,
                                             len(new.output_token_ids))
        outputs, seq_ids, beams = [], [], []
        for sched in plan.sequences():
            seq = self.seqs[sched.seq_id]
            seq.tokens += sched.append_token_ids
            seq.num_outputs += len(sched.append_token_ids)
            if sched.num_computed_tokens + sched.num_new_tokens != len(seq.tokens):
                continue
            if seq.params.beam_width:
                beams.append(BeamCandidates(sched.seq_id, self.candidates(seq)))
                continue
            token = self.pick(seq.rid, seq.sample_index, seq.num_outputs)
            outputs.append(TokenOutput(seq.rid, seq.sample_index, seq.num_outputs, token))
            seq_ids.append(sched.seq_id)
            seq.tokens.append(token)
            seq.num_outputs += 1
        result = StepResult(plan.worker_id, plan.epoch, plan.step_id, seq_ids, [out.token_id for out in outputs],
                            beams=beams)
        return StepOutcome(result, outputs)

    def candidates(self, seq: TokenSeq) -> list[tuple[int, float]]:
        eos = 0 if seq.params.ignore_eos else len(self.reg.eos_token_ids)
        k = max(2, 1 + eos) * seq.params.beam_width
        rng = random.Random(hash(tuple(seq.tokens[-8:])) ^ len(seq.tokens))
        logits = sorted((rng.gauss(0.0, 2.5) for _ in range(CANDIDATES)), reverse=True)
        norm = math.log(sum(math.exp(v) for v in logits))
        return list(zip(rng.sample(range(2000, 32000), k), (v - norm for v in logits[:k])))
