"""The Orca-style contiguous-reservation baseline (the paper's Orca-Max) on pagedserve's own machinery.

A per-worker scheduler that, when it admits a request, reserves a whole max_model_len of KV blocks for
each of its sequences (within the worker's capacity), as a contiguous allocator must, so a request never
grows into new blocks and the batch is as small as the reservations make it. Benchmarks only: the
product allocates blocks on demand.

    python -m benchmarks.contiguous up --model M ...   # `pagedserve up` with this scheduler
    python -m benchmarks.contiguous                    # the scheduler service alone (what `up` starts)
"""
from __future__ import annotations

import argparse
import sys

from scheduler import service
from scheduler.kv_cache_manager import Growth, cdiv
from scheduler.request import RequestState
from scheduler.worker_scheduler import LookaheadScheduler, StepBuilder, WorkerScheduler
from shared.settings import Settings


class Reserving:
    """Mixed into a WorkerScheduler: admission takes a max_model_len reservation per sequence, or waits."""

    def _reservation(self: WorkerScheduler, rs: RequestState) -> int:
        """Blocks each sequence of the request reserves."""
        share = self.kv.pool.num_usable // max(1, len(rs.live_samples))
        return cdiv(min(self.reg.max_model_len, share * self.kv.block_size), self.kv.block_size)

    def _admit(self: WorkerScheduler, rs: RequestState, step: StepBuilder) -> bool:
        if self._reservation(rs) * len(rs.live_samples) + self._keep_free() > self.kv.num_free:
            return False
        if not super()._admit(rs, step):
            return False
        self._top_up(rs)
        return True

    def _fork_if_due(self: WorkerScheduler, rs: RequestState) -> None:
        forking = rs.fork_at is not None
        super()._fork_if_due(rs)
        if forking and rs.fork_at is None:
            self._top_up(rs)

    def _top_up(self: WorkerScheduler, rs: RequestState) -> None:
        """Extend each sequence's table to its reservation (blocks no token writes yet); admission made room
        for every sample's, so only forked samples can find too few blocks left, and grow on demand then."""
        bs = self.kv.block_size
        for seq in rs.seqs:
            held = self.kv.table_len(seq.seq_id)
            more = self._reservation(rs) - held
            if more > 0 and self.kv.allocate_slots(Growth(writes=[(seq.seq_id, held * bs, more * bs)])):
                seq.resend_table = True  # the worker learns of the blocks with the sequence's next chunk


class ReservingScheduler(Reserving, WorkerScheduler):
    pass


class ReservingLookaheadScheduler(Reserving, LookaheadScheduler):
    pass


def scheduler_class(settings: Settings) -> type[WorkerScheduler]:
    return ReservingLookaheadScheduler if settings.async_scheduling else ReservingScheduler


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:
        from pagedserve import launcher

        parser = argparse.ArgumentParser(prog="python -m benchmarks.contiguous up")
        launcher.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        raise SystemExit(launcher.up(launcher.settings_for_up(args), args.workers, args.redis_port,
                                     scheduler_module="benchmarks.contiguous"))
    service.main(argv, scheduler_class)


if __name__ == "__main__":
    main()
