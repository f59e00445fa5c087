"""The Orca-style contiguous-reservation baselines (the vLLM paper's Orca) on pagedserve's own machinery.

A per-worker scheduler that, when it admits a request, reserves KV blocks for the whole length each of its
sequences may reach (within the worker's capacity), as a contiguous allocator must, so a request never grows
into new blocks and the batch is as small as the reservations make it. The paper's three variants differ in
what they reserve: Orca (Max) max_model_len; Orca (Pow2) the prompt plus its output length rounded up to a
power of two ("if the true output length is 25, it reserves 32 positions for outputs"); Orca (Oracle) the
prompt plus exactly its output length. Pow2 and Oracle know the output length: `max_tokens`, which is the
output length of the benchmarks' requests (they ignore EOS). Benchmarks only: the product allocates blocks
on demand. The schedulers are in benchmarks/baselines.py; this module serves them.

    python -m benchmarks.contiguous up --model M ...   # `pagedserve up` with this scheduler
    python -m benchmarks.contiguous                    # the scheduler service alone (what `up` starts)
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.baselines import reserving_scheduler
from scheduler import service


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
