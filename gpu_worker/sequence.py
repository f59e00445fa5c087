"""What the worker remembers about a sequence between steps: its tokens, parameters and block table."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from gpu_worker.structured import SequenceGrammar
from shared.protocol import NewSequence, PromptLogprob
from shared.sampling import SamplingParams

if TYPE_CHECKING:  # the proposers' indexes know sequences: a type only, never an import cycle at run time
    from gpu_worker.proposers import ContextIndex, NgramIndex


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    rid: str
    sample_index: int
    params: SamplingParams
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    block_table: list[int] = field(default_factory=list)
    # What its first token tells of the prompt, for a sequence that computes its prompt (not a fork, nor one
    # resumed after its first token): the prompt tokens its first chunk found computed (prefix-cache hits), and,
    # when asked for, each prompt token's logprob, gathered chunk by chunk (the runner appends them).
    reports_prompt: bool = False
    num_cached_tokens: int | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    grammar: SequenceGrammar | None = None  # a constrained sequence's place in its grammar
    # Speculative decoding (gpu_worker/proposers.py): its proposer's index of its tokens, and the draft proposed
    # for its next step, made when its tokens numbered `draft_at`.
    draft_index: NgramIndex | ContextIndex | None = None
    draft: list[int] = field(default_factory=list)
    draft_at: int = -1

    @classmethod
    def from_message(cls, msg: NewSequence, prompt: list[int], params: SamplingParams) -> "SequenceState":
        """`prompt`: the message's, or its parent's for a fork; `params`: as the worker runs it."""
        reports = msg.fork_of is None and not msg.output_token_ids
        return cls(msg.seq_id, msg.rid, msg.sample_index, params, list(prompt) + list(msg.output_token_ids),
                   len(prompt), reports_prompt=reports,
                   prompt_logprobs=[] if reports and params.prompt_logprobs is not None else None)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Chunk(NamedTuple):
    """A sequence's part of a step: `new` tokens after the `computed` its cache already holds."""
    seq: SequenceState
    computed: int
    new: int
