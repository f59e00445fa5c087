"""Draft-free proposers for speculative decoding: the tokens a sequence's next step checks after its last one.

- `NgramProposer` (vLLM's `ngram`, prompt lookup): the last n tokens (n from `prompt_lookup_max` down to
  `prompt_lookup_min`) matched at their latest earlier place in the prompt and output; the tokens that followed
  there are proposed.
- `SuffixProposer` (vLLM's `suffix`): the longest context (up to `suffix_decoding_max_tree_depth` tokens) seen
  before, in the sequence itself or in the outputs of recently finished sequences on this worker, and its most
  frequent continuation, one token at a time. arctic-inference's suffix trees do this with speculation trees, which
  need tree attention; it is a C++ extension not installable here, and pagedserve checks one chain per sequence,
  so a small index of context hashes (`ContextIndex`) does the same job.

Each sequence's index is built from its tokens alone and extended as tokens are accepted (DESIGN.md: a worker's
state of a sequence is rebuilt from its tokens). The suffix proposer's shared index of finished outputs is not,
which is allowed because a proposal never decides a token: the target model's own sample at each position does
(gpu_worker/model_runner.py), so outputs are the same whatever was proposed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_worker.sequence import SequenceState
from shared.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class NgramIndex:
    """For each n-gram of the sequence's tokens that something followed: where its latest such place ends."""
    min_n: int
    max_n: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # tokens whose preceding n-grams are in `ends`

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending at the tokens added since the last call (a sequence's tokens only grow)."""
        for end in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.num_indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier place of the longest n-gram ending the tokens; a copy that runs
        into the tokens' end goes on through the draft itself (a repeating pattern goes on repeating)."""
        length = len(tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                draft = tokens[end:end + k]
                while len(draft) < k:
                    draft.append(draft[end + len(draft) - length])
                return draft
        return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        index = seq.draft_index
        if index is None:
            index = seq.draft_index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        index.extend(seq.token_ids)
        return index.propose(seq.token_ids, k)

    def finished(self, seq: SequenceState) -> None:
        """The sequence's output is final (only the suffix proposer keeps outputs)."""


LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the context lengths indexed, up to the config's depth
FIELD = 21  # bits of each part of a vote
CAP = (1 << FIELD) - 1
MIN_OWN_MATCH = 2  # context tokens a draft's first token needs matched in the sequence's own text
MIN_RECENT_MATCH = 4  # ... and in the outputs of finished sequences


@dataclass(slots=True)
class ContextIndex:
    """For each context of the indexed lengths (keyed by the hash of its tokens): the continuation that followed it
    most, by a majority vote (Boyer and Moore's: the candidate, its lead over the rest, and how often the context was
    seen), packed in one int. A few lengths and one int each keep it to a few hundred bytes a token: a counter of
    every continuation of every length took tens of times more. A hash collision can only make a proposal wrong."""
    lengths: tuple[int, ...]
    votes: dict[int, int] = field(default_factory=dict)
    num_indexed: int = 0

    @classmethod
    def of_depth(cls, depth: int) -> ContextIndex:
        return cls(tuple(n for n in LENGTHS if n <= depth) or (depth,))

    def extend(self, tokens: list[int]) -> None:
        """Count the continuations of the tokens added since the last call."""
        self.count(tokens, self.num_indexed)
        self.num_indexed = len(tokens)

    def count(self, tokens: list[int], start: int) -> None:
        votes = self.votes
        for end in range(max(start, 1), len(tokens)):
            nxt = tokens[end]
            for n in self.lengths:
                if n > end:
                    break
                key = hash(tuple(tokens[end - n:end]))
                vote = votes.get(key, 0)
                candidate, lead, seen = vote >> 2 * FIELD, (vote >> FIELD) & CAP, vote & CAP
                if not lead:
                    candidate, lead = nxt, 1
                else:
                    lead += 1 if candidate == nxt else -1
                votes[key] = candidate << 2 * FIELD | min(lead, CAP) << FIELD | min(seen + 1, CAP)

    def longest(self, context: list[int]) -> Match | None:
        """The longest indexed context ending `context` that was seen, and its vote."""
        for n in reversed(self.lengths):
            if n <= len(context):
                vote = self.votes.get(hash(tuple(context[-n:])))
                if vote is not None and vote >> FIELD & CAP:
                    return Match(n, vote >> 2 * FIELD, (vote >> FIELD & CAP) / (vote & CAP))
        return None


@dataclass(frozen=True, slots=True)
class Match:
    length: int  # tokens of context matched
    token: int  # the continuation that followed it most
    share: float  # its lead over the other continuations, as a share of how often the context was seen


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.recent = ContextIndex.of_depth(config.suffix_decoding_max_tree_depth)  # outputs of finished sequences
        self.cached: deque[list[int]] = deque(maxlen=config.suffix_decoding_max_cached_requests or 1)
        self.since_rebuild = 0

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        """Continuations one at a time while they keep a share of at least the config's least; at most the first
        match's length times `suffix_decoding_max_spec_factor` tokens (a short match is weak evidence)."""
        config = self.config
        index = seq.draft_index
        if index is None:
            index = seq.draft_index = ContextIndex.of_depth(config.suffix_decoding_max_tree_depth)
        index.extend(seq.token_ids)
        context = list(seq.token_ids[-config.suffix_decoding_max_tree_depth:])
        draft: list[int] = []
        while len(draft) < k:
            match = self._best(index, context, first=not draft)
            if match is None or match.share < config.suffix_decoding_min_token_prob:
                break
            if not draft:
                k = min(k, max(1, int(match.length * config.suffix_decoding_max_spec_factor)))
            draft.append(match.token)
            context.append(match.token)
        return draft

    def _best(self, index: ContextIndex, context: list[int], first: bool) -> Match | None:
        """The longer match of the sequence's own tokens and the recent outputs (its own on a tie). A draft's first
        token needs a match of at least `MIN_OWN_MATCH` tokens in its own, `MIN_RECENT_MATCH` in the recent outputs:
        nearly every token was seen before, and a short match in other requests' text is no evidence."""
        own, shared = index.longest(context), self.recent.longest(context)
        if first:
            own = own if own is not None and own.length >= MIN_OWN_MATCH else None
            shared = shared if shared is not None and shared.length >= MIN_RECENT_MATCH else None
        return own if shared is None or (own is not None and own.length >= shared.length) else shared

    def finished(self, seq: SequenceState) -> None:
        """Index the sequence's output for the sequences after it. Past the config's most outputs the index is
        built again from the latest ones (a vote cannot be taken back), so it holds between one and two times
        that many."""
        if self.config.suffix_decoding_max_cached_requests == 0:
            return
        output = seq.output_token_ids
        self.cached.append(output)
        self.recent.count(output, 0)
        self.since_rebuild += 1
        if self.since_rebuild >= self.config.suffix_decoding_max_cached_requests:
            self.recent = ContextIndex(self.recent.lengths)
            for cached in self.cached:
                self.recent.count(cached, 0)
            self.since_rebuild = 0


Proposer = NgramProposer | SuffixProposer


def proposer_for(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)
