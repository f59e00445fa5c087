"""The worker core's plan handling with no model: a runner that records what reaches the device side.

What the model computes is tested against transformers in test_worker_plans.py; here, what the core does
with a plan: the order of the work, the block tables it hands the runner, what it samples and skips.
"""
from __future__ import annotations

from plan_builder import PlanBuilder

from gpu_worker.sampler import SampledToken, StepToken
from gpu_worker.sequence import Chunk
from gpu_worker.worker import Worker
from shared.protocol import WorkerRegistration
from shared.sampling import SamplingParams

BS = 8
EOS = 2


class RecordingRunner:
    """Stands in for ModelRunner: records block moves and forward passes; the token it samples for a
    sequence is 100 + its length, or EOS once the sequence reaches `eos_at` tokens. Empty block moves are
    not recorded."""

    def __init__(self, eos_at: int = 10_000) -> None:
        self.cache = self
        self.calls: list[tuple] = []
        self.eos_at = eos_at

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._move("swap_out", pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._move("swap_in", pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._move("copy", pairs)

    def _move(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.calls.append((kind, pairs))

    def execute(self, chunks: list[Chunk], eos_token_ids: list[int],
                drafts: dict[int, list[int]]) -> list[StepToken]:
        self.calls.append(("forward", [(s.seq_id, c, n, list(s.block_table)) for s, c, n in chunks]))
        return [StepToken(s, SampledToken(EOS if len(s.token_ids) >= self.eos_at else 100 + len(s.token_ids)))
                for s, c, n in chunks if c + n == len(s.token_ids)]


def make(eos_at: int = 10_000) -> tuple[Worker, RecordingRunner, PlanBuilder]:
    runner = RecordingRunner(eos_at)
    worker = Worker(runner, WorkerRegistration("w0", "fake", 32, 8, BS, 64, [EOS], vocab_size=512))
    return worker, runner, PlanBuilder("w0", 32, BS, 8)


def test_block_moves_come_before_the_forward_pass_in_the_protocol_order():
    worker, runner, builder = make()
    a = builder.add([5] * 12)
    builder.schedule(a)
    plan = builder.plan()
    plan.swap_out, plan.swap_in, plan.copies = [(30, 1)], [(2, 29)], [(28, 27)]
    outcome = worker.execute(plan)
    assert [call[0] for call in runner.calls] == ["swap_out", "swap_in", "copy", "forward"]
    (forward,) = [call[1] for call in runner.calls if call[0] == "forward"]
    assert forward == [(a.seq_id, 0, 12, a.blocks)], "the runner gets the scheduler's table"
    (out,) = outcome.outputs
    assert (out.rid, out.output_index, out.token_id, out.worker_id, out.epoch) == (a.rid, 0, 112, "w0", 0)
    assert (outcome.result.seq_ids, outcome.result.token_ids) == ([a.seq_id], [112]), "the scheduler's columns"


def test_only_a_chunk_that_reaches_the_end_samples_and_tables_grow_by_the_plans_deltas():
    worker, runner, builder = make()
    a = builder.add(list(range(10, 30)))
    builder.schedule(a, 8)
    assert worker.execute(builder.plan()).outputs == []
    builder.schedule(a)
    builder.apply(worker.execute(builder.plan()))
    assert a.outputs == [120]
    forwards = [call[1][0] for call in runner.calls]
    assert [(c, n) for _, c, n, _ in forwards] == [(0, 8), (8, 12)]
    assert forwards[1][3] == a.blocks[:3] and len(forwards[0][3]) == 1


def test_a_stopped_sequence_is_skipped_until_the_scheduler_frees_it():
    worker, runner, builder = make(eos_at=6)
    a = builder.add([5] * 5, SamplingParams(temperature=0.0, max_tokens=20))  # reaches 6 tokens, and EOS, first
    b = builder.add([6] * 2)
    for _ in range(2):
        builder.schedule(a)
        builder.schedule(b)
        builder.apply(worker.execute(builder.plan()))
    assert a.finish_reasons[-1] == "stop" and a.seq_id in worker.stopped
    builder.schedule(b)
    runner.calls.clear()
    lookahead = builder.plan()  # as if planned before the scheduler knew a had stopped
    lookahead.scheduled.insert(0, type(lookahead.scheduled[0])(a.seq_id, len(a.tokens) - 1, 1))
    outcome = worker.execute(lookahead)
    assert [s for s, *_ in runner.calls[0][1]] == [b.seq_id] and [o.rid for o in outcome.outputs] == [b.rid]
    builder.drop(a)
    worker.execute(builder.plan())
    assert a.seq_id not in worker.stopped and a.seq_id not in worker.seqs


def test_a_new_epoch_forgets_every_sequence():
    worker, runner, builder = make()
    a = builder.add([5] * 4)
    builder.schedule(a)
    builder.apply(worker.execute(builder.plan()))
    fresh = PlanBuilder("w0", 32, BS, 8, epoch=3)
    b = fresh.add([7] * 4)
    fresh.schedule(b)
    fresh.apply(worker.execute(fresh.plan()))
    assert set(worker.seqs) == {b.seq_id} and worker.epoch == 3
