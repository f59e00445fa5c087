"""Draft-free proposers for speculative decoding: the tokens a sequence's next step checks after its last one.

- `NgramProposer` (vLLM's `ngram`, prompt lookup): the last n tokens (n from `prompt_lookup_max` down to
  `prompt_lookup_min`) matched at their latest earlier place in the prompt and output; the tokens that followed
  there are proposed.
- `SuffixProposer` (vLLM's `suffix`): the longest context (up to `suffix_decoding_max_tree_depth` tokens) seen
  before, in the sequence itself or in the outputs of recently finished sequences on this worker, and its most
  frequent continuation, one token at a time. arctic-inference's suffix trees do this with speculation trees, which
  need tree attention; it is a C++ extension not installable here, and pagedserve checks one chain per sequence,
  so a small index of context hashes does the same job.

Each sequence's index is built from its tokens alone and extended as tokens are accepted (DESIGN.md: a worker's
state of a sequence is rebuilt from its tokens). The suffix proposer's shared index of finished outputs is not,
which is allowed because a proposal never decides a token: the target model's own sample at each position does
(gpu_worker/model_runner.py), so outputs are the same whatever was proposed.
"""
from __future__ import annotations

from collections import Counter, deque
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
        if len(tokens) < self.num_indexed:  # never happens for a live sequence: its tokens only grow
            self.ends.clear()
            self.num_indexed = 0
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


@dataclass(slots=True)
class ContextIndex:
    """Continuation counts of every context of 1 to `depth` tokens, keyed by the context's tokens."""
    depth: int
    counts: dict[tuple[int, ...], Counter[int]] = field(default_factory=dict)
    num_indexed: int = 0

    def extend(self, tokens: list[int]) -> None:
        """Count the continuations of the tokens added since the last call."""
        self.count(tokens, self.num_indexed, 1)
        self.num_indexed = len(tokens)

    def count(self, tokens: list[int], start: int, sign: int) -> None:
        """Add (`sign` 1) or take out (-1) the continuations of `tokens[start:]`."""
        for end in range(max(start, 1), len(tokens)):
            nxt = tokens[end]
            for n in range(1, min(self.depth, end) + 1):
                key = tuple(tokens[end - n:end])
                counter = self.counts.get(key)
                if counter is None:
                    counter = self.counts[key] = Counter()
                counter[nxt] += sign
                if counter[nxt] <= 0:
                    del counter[nxt]
                    if not counter:
                        del self.counts[key]

    def longest(self, context: list[int]) -> tuple[int, Counter[int]] | None:
        for n in range(min(self.depth, len(context)), 0, -1):
            counter = self.counts.get(tuple(context[-n:]))
            if counter:
                return n, counter
        return None


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.recent = ContextIndex(config.suffix_decoding_max_tree_depth)  # outputs of finished sequences
        self.cached: deque[list[int]] = deque()

    def propose(self, seq: SequenceState, k: int) -> list[int]:
        index = seq.draft_index
        if index is None:
            index = seq.draft_index = ContextIndex(self.config.suffix_decoding_max_tree_depth)
        index.extend(seq.token_ids)
        context = list(seq.token_ids[-self.config.suffix_decoding_max_tree_depth:])
        draft: list[int] = []
        while len(draft) < k:
            token = self._next(index, context)
            if token is None:
                break
            draft.append(token)
            context.append(token)
        return draft

    def _next(self, index: ContextIndex, context: list[int]) -> int | None:
        """The most frequent continuation of the longest context found (the sequence's own on a tie of length), if
        its share of what followed that context is at least the config's least."""
        own, shared = index.longest(context), self.recent.longest(context)
        found = own if shared is None or (own is not None and own[0] >= shared[0]) else shared
        if found is None:
            return None
        counter = found[1]
        token, count = counter.most_common(1)[0]
        return token if count >= self.config.suffix_decoding_min_token_prob * sum(counter.values()) else None

    def finished(self, seq: SequenceState) -> None:
        """Index the sequence's output for the sequences after it, forgetting the oldest past the config's most."""
        if self.config.suffix_decoding_max_cached_requests == 0:
            return
        output = seq.output_token_ids
        self.cached.append(output)
        self.recent.count(output, 0, 1)
        if len(self.cached) > self.config.suffix_decoding_max_cached_requests:
            self.recent.count(self.cached.popleft(), 0, -1)


Proposer = NgramProposer | SuffixProposer


def proposer_for(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    return NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)
