"""What the worker remembers about a sequence between steps: its tokens, parameters and block table."""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import NewSequence
from shared.sampling import SamplingParams


@dataclass(slots=True)
class SequenceState:
    seq_id: int
    rid: str
    sample_index: int
    params: SamplingParams
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    block_table: list[int] = field(default_factory=list)

    @classmethod
    def from_message(cls, msg: NewSequence, prompt: list[int], params: SamplingParams) -> "SequenceState":
        """`prompt`: the message's, or its parent's for a fork; `params`: as the worker runs it."""
        return cls(msg.seq_id, msg.rid, msg.sample_index, params, list(prompt) + list(msg.output_token_ids),
                   len(prompt))

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
