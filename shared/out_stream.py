"""A request's `out:` stream folded into its samples' tokens: the rules every reader applies.

Writers: the scheduler appends an Assignment whenever it places the request on a worker, then that
worker appends one TokenOutput per sampled token, and the scheduler appends the request-level end
(sample_index -1) last. A reader (the gateway streaming to its client, a scheduler resuming the request
after a restart, a test client) takes an entry only if it is
- an Assignment at least as new (by epoch) as the current one: it names the writer from here on;
- the end entry: the first one ends the request, and nothing after it counts;
- a token from the assigned worker and epoch, for a sample still running, at exactly that sample's next
  output index and below max_tokens.
A token at an index already taken is a replay (a retried write, a resume): skipped, and recorded as a
conflict if its token differs. Anything else is refused (OutOfOrder): a stale or foreign writer, a gap,
an index out of range. Every reader applies the same rules to the same entries in the same order, so all
agree on every token; a worker that lost the request (stalled, or from an older scheduler) cannot add one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import Assignment, TokenOutput


class OutOfOrder(ValueError):
    """An entry the stream's rules refuse; the message says why."""


@dataclass(slots=True)
class OutputFold:
    n: int
    max_tokens: int
    tokens: list[list[int]] = field(default_factory=list)  # per sample index
    finish_reasons: list[str | None] = field(default_factory=list)  # per sample index, as the worker ended it
    end: TokenOutput | None = None  # the scheduler's request-level end entry
    writer: tuple[str, int] | None = None  # (worker id, epoch) whose tokens count now
    conflicts: list[tuple[int, int]] = field(default_factory=list)  # (sample, index) replayed with another token

    def __post_init__(self) -> None:
        self.tokens = self.tokens or [[] for _ in range(self.n)]
        self.finish_reasons = self.finish_reasons or [None] * self.n

    @property
    def ended(self) -> bool:
        return self.end is not None

    def apply(self, entry: TokenOutput | Assignment) -> TokenOutput | None:
        """The entry if it counts (a new token, or the end), None for an assignment or a replay; raises
        OutOfOrder for an entry the rules refuse."""
        if self.end is not None:
            raise OutOfOrder("an entry after the request's end")
        if isinstance(entry, Assignment):
            if self.writer is not None and entry.epoch < self.writer[1]:
                raise OutOfOrder(f"an assignment of epoch {entry.epoch} after one of epoch {self.writer[1]}")
            self.writer = (entry.worker_id, entry.epoch)
            return None
        if entry.sample_index == -1:
            self.end = entry
            return entry
        if (entry.worker_id, entry.epoch) != self.writer:
            raise OutOfOrder(f"a token from worker {entry.worker_id!r} of epoch {entry.epoch}, "
                             f"not from the assigned {self.writer}")
        if not 0 <= entry.sample_index < self.n:
            raise OutOfOrder(f"sample {entry.sample_index} of a request with n={self.n}")
        i, index = entry.sample_index, entry.output_index
        taken = self.tokens[i]
        if 0 <= index < len(taken):
            if taken[index] != entry.token_id:
                self.conflicts.append((i, index))
            return None
        if self.finish_reasons[i] is not None:
            raise OutOfOrder(f"a token after sample {i} finished")
        if index != len(taken) or index >= self.max_tokens:
            raise OutOfOrder(f"output index {index} of sample {i}, expected {len(taken)} (max_tokens "
                             f"{self.max_tokens})")
        taken.append(entry.token_id)
        self.finish_reasons[i] = entry.finish_reason
        return entry
