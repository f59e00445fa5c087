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
import functools
import sys
from dataclasses import dataclass
from typing import Callable

from scheduler import service
from scheduler.kv_cache_manager import Growth, Write
from scheduler.request import RequestState
from scheduler.worker_scheduler import WorkerScheduler, WorkerSchedulerFactory


def max_model_len_tokens(rs: RequestState, max_model_len: int) -> int:
    """Orca (Max): max_model_len."""
    return max_model_len


def pow2_tokens(rs: RequestState, max_model_len: int) -> int:
    """Orca (Pow2): the prompt plus the output length rounded up to a power of two."""
    return len(rs.prompt) + (1 << (rs.req.params.max_tokens - 1).bit_length())


def oracle_tokens(rs: RequestState, max_model_len: int) -> int:
    """Orca (Oracle): the prompt plus exactly the output length."""
    return len(rs.prompt) + rs.req.params.max_tokens


@dataclass(frozen=True, slots=True)
class ContiguousReservation:
    """A reservation policy (scheduler/reservation.py): admission takes `reserved_tokens` per sequence, within the
    worker's capacity, or waits."""
    reserved_tokens: Callable[[RequestState, int], int]  # (request, max_model_len) → tokens a sequence reserves

    def _blocks(self, ws: WorkerScheduler, rs: RequestState) -> int:
        """Blocks each sequence of the request reserves."""
        share = ws.stats().num_blocks // max(1, len(rs.live_samples))
        max_model_len = ws.reg.max_model_len
        tokens = min(self.reserved_tokens(rs, max_model_len), max_model_len, share * ws.reg.block_size)
        return ws.kv.num_blocks_for(tokens)

    def admits(self, ws: WorkerScheduler, rs: RequestState, keep_free: int) -> bool:
        return self._blocks(ws, rs) * len(rs.live_samples) + keep_free <= ws.stats().free_blocks

    def started(self, ws: WorkerScheduler, rs: RequestState) -> None:
        self._top_up(ws, rs)

    def forked(self, ws: WorkerScheduler, rs: RequestState) -> None:
        self._top_up(ws, rs)

    def _top_up(self, ws: WorkerScheduler, rs: RequestState) -> None:
        """Extend each sequence's table to its reservation (blocks no token writes yet); admission made room
        for every sample's, so only forked samples can find too few blocks left, and grow on demand then."""
        bs = ws.reg.block_size
        for seq in rs.seqs:
            held = ws.kv.table_len(seq.seq_id)
            more = self._blocks(ws, rs) - held
            if more > 0 and ws.kv.allocate_slots(Growth(writes=[Write(seq.seq_id, held * bs, more * bs)])):
                seq.resend_table = True  # the worker learns of the blocks with the sequence's next chunk


RESERVATIONS: dict[str, Callable[[RequestState, int], int]] = {
    "max": max_model_len_tokens,
    "pow2": pow2_tokens,
    "oracle": oracle_tokens,
}


def reserving_scheduler(reservation: str = "max") -> WorkerSchedulerFactory:
    """The per-worker scheduler with that contiguous reservation (with or without async scheduling, as the
    settings it is given say)."""
    return functools.partial(WorkerScheduler, reservation=ContiguousReservation(RESERVATIONS[reservation]))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["up"]:
        from pagedserve import launcher

        parser = argparse.ArgumentParser(prog="python -m benchmarks.contiguous up")
        launcher.add_arguments(parser)
        args = parser.parse_args(argv[1:])
        raise SystemExit(launcher.up(launcher.settings_for_up(args), launcher.Topology.from_args(args),
                                     scheduler_module="benchmarks.contiguous"))
    service.main(argv, reserving_scheduler())


if __name__ == "__main__":
    main()
