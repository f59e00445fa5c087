"""Where a worker computes on the CPU: how many torch threads, pinned to which cores.

Like vLLM's VLLM_CPU_OMP_THREADS_BIND: a worker's compute threads get cores of their own, so that the
gateway, the scheduler and Redis (and other workers) do not preempt them mid-step; an OpenMP team
waiting for one preempted thread stalls every op of the step. `pagedserve up` knows how many workers
share the machine and gives each its cores (`stack_placement`); a worker started alone uses the
settings as given.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


class PlacementError(ValueError):
    """A core list that cannot be parsed or names cores this process may not use."""


@dataclass(slots=True)
class Placement:
    threads: int  # torch intra-op threads; 0 = torch's own default
    cores: list[int]  # cores the worker process runs on; empty = wherever the OS likes


def parse_cores(text: str) -> list[int]:
    """'0-3,6' → [0, 1, 2, 3, 6]; '' → []."""
    cores: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        try:
            low, high = int(first), int(last or first)
        except ValueError:
            raise PlacementError(f"cpu_cores: {part!r} is not a core number or a range like 0-3") from None
        if low < 0 or high < low:
            raise PlacementError(f"cpu_cores: {part!r} is not a range of core numbers")
        cores.extend(range(low, high + 1))
    return sorted(set(cores))


def format_cores(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def stack_placement(index: int, workers: int, cores: list[int] | None = None) -> Placement:
    """Worker `index` of `workers` on one machine beside the gateway, the scheduler and Redis.

    With more cores than workers, the first core is left to those three and the rest are split evenly
    (a worker gets at least one; the remainder stays with the front end); with as many workers as cores or
    more, each worker gets one core, round robin.
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    usable = cores[1:] if len(cores) > workers else cores
    share = max(1, len(usable) // workers)
    mine = usable[index * share:(index + 1) * share] or [usable[index % len(usable)]]
    return Placement(len(mine), mine)


def apply(placement: Placement) -> None:
    """Pin every thread of this process (those started later inherit it) and set torch's thread count."""
    import torch

    if placement.cores:
        allowed = os.sched_getaffinity(0)
        missing = sorted(set(placement.cores) - allowed)
        if missing:
            raise PlacementError(f"cpu_cores names cores this process may not run on: {missing} "
                                 f"(allowed: {format_cores(sorted(allowed))})")
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), placement.cores)
    if placement.threads > 0:
        torch.set_num_threads(placement.threads)
