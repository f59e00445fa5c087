"""The rules every reader of a request's `out:` stream applies (shared/out_stream.py)."""
from __future__ import annotations

import pytest

from shared.out_stream import OutOfOrder, OutputFold
from shared.protocol import Assignment, TokenOutput


def token(sample: int, index: int, token_id: int, worker: str = "w0", epoch: int = 1,
          finish: str | None = None) -> TokenOutput:
    return TokenOutput("r", sample, index, token_id, finish_reason=finish, worker_id=worker, epoch=epoch)


def placed(n: int = 1, max_tokens: int = 8) -> OutputFold:
    fold = OutputFold(n, max_tokens)
    assert fold.apply(Assignment("r", "w0", 1)) is None
    return fold


def test_tokens_count_once_in_index_order_and_a_replay_with_another_token_is_a_conflict():
    fold = placed(n=2)
    assert fold.apply(token(0, 0, 11)) is not None
    assert fold.apply(token(1, 0, 21)) is not None
    assert fold.apply(token(0, 0, 11)) is None  # a retried write
    assert fold.apply(token(0, 0, 99)) is None and fold.conflicts == [(0, 0)]
    assert fold.apply(token(0, 1, 12, finish="stop")).finish_reason == "stop"
    assert fold.tokens == [[11, 12], [21]] and fold.finish_reasons == ["stop", None]


@pytest.mark.parametrize("entry, why", [
    (token(0, 2, 5), "a gap"),
    (token(0, 8, 5), "beyond max_tokens"),
    (token(3, 0, 5), "a sample the request does not have"),
    (token(0, 0, 5, worker="w9"), "another worker"),
    (token(0, 0, 5, epoch=0), "an older epoch"),
])
def test_entries_from_anyone_but_the_assigned_writer_or_out_of_order_are_refused(entry, why):
    fold = placed(max_tokens=8)
    with pytest.raises(OutOfOrder):
        fold.apply(entry)
    assert fold.tokens == [[]], why


def test_tokens_before_any_assignment_and_after_a_sample_finished_are_refused():
    fold = OutputFold(1, 8)
    with pytest.raises(OutOfOrder):
        fold.apply(token(0, 0, 5))
    fold.apply(Assignment("r", "w0", 1))
    fold.apply(token(0, 0, 5, finish="stop"))
    with pytest.raises(OutOfOrder):
        fold.apply(token(0, 1, 6))


def test_a_new_assignment_moves_the_request_and_a_fence_admits_no_writer():
    fold = placed()
    fold.apply(token(0, 0, 5))
    fold.apply(Assignment("r", "", 2))  # a restarted scheduler's fence
    with pytest.raises(OutOfOrder):
        fold.apply(token(0, 1, 6))  # the old epoch's worker, still writing
    fold.apply(Assignment("r", "w1", 2))
    assert fold.apply(token(0, 1, 7, worker="w1", epoch=2)) is not None
    with pytest.raises(OutOfOrder):
        fold.apply(Assignment("r", "w0", 1))  # epochs never go back
    assert fold.tokens == [[5, 7]]


def test_the_first_end_entry_ends_the_request_and_nothing_after_it_counts():
    fold = placed()
    fold.apply(token(0, 0, 5))
    end = TokenOutput("r", -1, 0, -1, finish_reason="abort")
    assert fold.apply(end) is end and fold.ended
    for late in (token(0, 1, 6), TokenOutput("r", -1, 0, -1, finish_reason="error", error="forged"),
                 Assignment("r", "w0", 3)):
        with pytest.raises(OutOfOrder):
            fold.apply(late)
    assert fold.end is end and fold.tokens == [[5]]
