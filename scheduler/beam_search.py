"""Beam search decisions (sans-IO), step by step as transformers' beam search makes them, so that a request
gives the tokens of `generate(num_beams=W, num_return_sequences=n, length_penalty=..., early_stopping=...)`.

Each step, every live beam of the request reports its K most likely next tokens with their logprobs
(K = max(2, 1 + number of EOS ids) x W, so that W continuations remain even when the best ones stop).
`BeamSearch.step` ranks the continuations by cumulative logprob, keeps the best W that go on as the next
live beams, files the stopping ones among the best W as finished hypotheses (scored by cumulative logprob
/ generated length ** length_penalty, the best W kept), and decides whether the search is over. The
per-worker scheduler turns what a step keeps (parent beam, token) into sequences: a parent's first
continuation goes on in its sequence, each further one forks it (sharing its blocks, copy-on-write), and a
parent with none is freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

NEG = -1.0e9  # transformers' score of an impossible beam


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""
    score: float  # length-penalized
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass(slots=True)
class Continuation:
    parent: int  # the live beam it extends
    token: int
    logprob: float  # the token's own logprob
    score: float  # cumulative logprob


@dataclass(slots=True)
class BeamSearch:
    width: int
    length_penalty: float
    early_stopping: bool | str
    scores: list[float] = field(default_factory=lambda: [0.0])  # per live beam: cumulative logprob, best first
    logprobs: list[list[float]] = field(default_factory=lambda: [[]])  # per live beam: its tokens' logprobs
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most `width`
    improvable: bool = True  # transformers' "early stop heuristic unsatisfied"
    num_generated: int = 0  # tokens each live beam has
    reported: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # live beam → its candidates
    done: bool = False

    def step(self, outputs: list[list[int]], num_candidates: int, max_new_tokens: int,
             stop_reason: Callable[[int, int], str | None]) -> list[Continuation]:
        """One step, once every live beam b (whose tokens are `outputs[b]`) has reported its candidates;
        `stop_reason(token, generated_length)` says whether a continuation stops there, and max_new_tokens is the
        most it may generate. Returns the next live beams, best first (none once `done`)."""
        candidates, self.reported = [self.reported[b] for b in range(len(outputs))], {}
        ranked = sorted(((self.scores[b] + lp, b, token, lp) for b, top in enumerate(candidates) for token, lp in top),
                        key=lambda c: (-c[0], c[1], c[2]))[:num_candidates]
        length = self.num_generated + 1
        reasons = [stop_reason(token, length) for _, _, token, _ in ranked]
        going = [Continuation(b, token, lp, score) for (score, b, token, lp), reason in zip(ranked, reasons)
                 if reason is None][:self.width]
        full = len(self.finished) == self.width
        if self.improvable and not (full and self.early_stopping is True):
            # only the best W may finish: the rest of the K are there to keep W beams going
            fresh = [Hypothesis(score / length ** self.length_penalty, outputs[b] + [token], self.logprobs[b] + [lp],
                                reason)
                     for (score, b, token, lp), reason in zip(ranked[:self.width], reasons) if reason is not None]
            self.finished = sorted(self.finished + fresh, key=lambda h: -h.score)[:self.width]
        self.num_generated = length
        best = going[0].score if going else NEG
        hypothetical = max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
        worst = min(h.score for h in self.finished) if len(self.finished) == self.width else NEG
        self.improvable = self.improvable and best / hypothetical ** self.length_penalty > worst
        full = len(self.finished) == self.width
        self.done = (not self.improvable or (full and self.early_stopping is True)
                     or all(reason is not None for reason in reasons))
        if self.done:
            return []
        self.logprobs = [self.logprobs[c.parent] + [c.logprob] for c in going]
        self.scores = [c.score for c in going]
        return going

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]

    def cut_short(self, n: int, outputs: list[list[int]]) -> list[Hypothesis]:
        """The n best of the finished and the live beams, for a search that cannot go on (the cache cannot
        hold it): the live ones end with "length"."""
        live = [Hypothesis(score / max(1, len(tokens)) ** self.length_penalty, tokens, logprobs, "length")
                for score, tokens, logprobs in zip(self.scores, outputs, self.logprobs) if tokens]
        return sorted(self.finished + live, key=lambda h: -h.score)[:n]
