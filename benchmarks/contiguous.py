"""The Orca-style contiguous-reservation baselines (the vLLM paper's Orca) on pagedserve's own machinery.

A per-worker scheduler that, when it admits a request, reserves KV blocks for the whole length each of its
sequences may reach (within the worker's capacity), as a contiguous allocator must, so a request never grows
into new blocks and the batch is as small as the reservations make it. The paper's three variants differ in
what they reserve: Orca (Max) max_model_len; Orca (Pow2) the prompt plus its output length rounded up to a
power of two ("if the true output length is 25, it reserves 32 positions for outputs"); Orca (Oracle) the
prompt plus exactly its output length. Pow2 and Oracle know the output length: `max_tokens`, which is the
output length of the benchmarks' requests (they ignore EOS). Benchmarks only: the product allocates blocks
on demand.

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
    """Mixed into a WorkerScheduler: admission takes a max_model_len reservation per sequence (Orca (Max)),
    or waits."""

    def _reserved_tokens(self: WorkerScheduler, rs: RequestState) -> int:
        return self.reg.max_model_len

    def _reservation(self: WorkerScheduler, rs: RequestState) -> int:
        """Blocks each sequence of the request reserves."""
        share = self.kv.pool.num_usable // max(1, len(rs.live_samples))
        tokens = min(self._reserved_tokens(rs), self.reg.max_model_len, share * self.kv.block_size)
        return cdiv(tokens, self.kv.block_size)

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


class Pow2Reserving(Reserving):
    """Orca (Pow2): the prompt plus the output length rounded up to a power of two."""

    def _reserved_tokens(self: WorkerScheduler, rs: RequestState) -> int:
        return len(rs.prompt) + (1 << (rs.req.params.max_tokens - 1).bit_length())


class OracleReserving(Reserving):
    """Orca (Oracle): the prompt plus exactly the output length."""

    def _reserved_tokens(self: WorkerScheduler, rs: RequestState) -> int:
        return len(rs.prompt) + rs.req.params.max_tokens


class ReservingScheduler(Reserving, WorkerScheduler):
    pass


class ReservingLookaheadScheduler(Reserving, LookaheadScheduler):
    pass


class Pow2ReservingScheduler(Pow2Reserving, WorkerScheduler):
    pass


class Pow2ReservingLookaheadScheduler(Pow2Reserving, LookaheadScheduler):
    pass


class OracleReservingScheduler(OracleReserving, WorkerScheduler):
    pass


class OracleReservingLookaheadScheduler(OracleReserving, LookaheadScheduler):
    pass


# reservation → (scheduler, with async scheduling)
RESERVATIONS: dict[str, tuple[type[WorkerScheduler], type[WorkerScheduler]]] = {
    "max": (ReservingScheduler, ReservingLookaheadScheduler),
    "pow2": (Pow2ReservingScheduler, Pow2ReservingLookaheadScheduler),
    "oracle": (OracleReservingScheduler, OracleReservingLookaheadScheduler),
}


def scheduler_class(settings: Settings, reservation: str = "max") -> type[WorkerScheduler]:
    return RESERVATIONS[reservation][settings.async_scheduling]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:
        from pagedserve import launcher

        parser = argparse.ArgumentParser(prog="python -m benchmarks.contiguous up")
        launcher.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        raise SystemExit(launcher.up(launcher.settings_for_up(args), launcher.Topology.from_args(args),
                                     scheduler_module="benchmarks.contiguous"))
    service.main(argv, scheduler_class)


if __name__ == "__main__":
    main()
