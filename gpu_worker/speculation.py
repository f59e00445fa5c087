"""Verifying a draft (speculative decoding): which proposed tokens a step accepts, and the token after them.

Each of a drafting sequence's rows is sampled as if the draft's tokens before it were the sequence's own (its
penalties, `min_tokens` and seeded draws see them so: `draft_rows`), and the draft is accepted while each sample
equals the proposed token; the first sample that differs, or the one after a draft accepted whole, ends the step's
tokens. For a draft that is one proposed token per place (every draft-free proposer's), this is exactly Leviathan et
al.'s rejection sampling: a proposal d is accepted with probability p(d), and after a rejection the token is drawn
from p without d, renormalised; greedy decoding is its limit. And since each place's sample is the one the sampler
draws without a draft (seeded draws are a pure function of seed, sample and output position), greedy and seeded
outputs are the same token for token with speculation as without, on kernels whose rows do not depend on the batch.
"""
from __future__ import annotations

import dataclasses

from gpu_worker.sampler import SampledToken, StepToken
from gpu_worker.sequence import SequenceState


def draft_rows(seq: SequenceState, draft: list[int]) -> list[SequenceState]:
    """The sequence as each of its rows samples it: after its tokens, then after each prefix of the draft."""
    if not draft:
        return [seq]
    return [seq, *(dataclasses.replace(seq, token_ids=seq.token_ids + draft[:i]) for i in range(1, len(draft) + 1))]


def accepted(draft: list[int], sampled: list[int]) -> int:
    """How many of the draft's tokens the samples (one per row, one more than the draft) accept."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n


def verified(seqs: list[SequenceState], drafts: dict[int, list[int]],
             tokens: list[SampledToken]) -> list[StepToken]:
    """Each sequence's step tokens from its rows' samples (in `seqs` order, a drafting one's rows in turn): the
    draft's accepted tokens and the sample after them."""
    out, row = [], 0
    for seq in seqs:
        draft = drafts.get(seq.seq_id, [])
        rows = tokens[row:row + len(draft) + 1]
        row += len(rows)
        n = accepted(draft, [t.token_id for t in rows])
        out.extend(StepToken(seq, t) for t in rows[:n + 1])
    return out
