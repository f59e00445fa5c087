"""How a worker process is set up to compute on the CPU: how many torch threads, pinned to which cores, and
memory that is reused rather than handed back to the OS after every op.

Like vLLM's VLLM_CPU_OMP_THREADS_BIND: a worker's compute threads get cores of their own, so that the
gateway, the scheduler and Redis (and other workers) do not preempt them mid-step; an OpenMP team
waiting for one preempted thread stalls every op of the step. `pagedserve up` knows how many workers
share the machine and gives each its cores (`stack_placement`); a worker started alone uses the
settings as given.

glibc's malloc serves big blocks (activations, gathered keys and values of a large batch) with a fresh
mmap each time and returns them on free, so every such op pays a page fault per 4 KiB (several times the op's own
time for a large gather: benchmarks/results/cpu-efficiency-log-2026-12.md). `reuse_freed_memory` keeps them in
the heap, as the tcmalloc that vLLM's CPU backend preloads does.
"""
from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)
# mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


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

    With more cores than workers, the last core is left to those three (as vLLM's CPU backend leaves it to
    its front end) and the rest are split evenly (a worker gets at least one; the remainder stays with the
    front end); with as many workers as cores or more, each worker gets one core, round robin. A worker
    with one thread is not pinned, only limited to that thread: the OS may then move it off a core that
    something else is using, which measured faster under outside load (2 cores, tiny model, 16 sequences:
    763 tok/s pinned, 981–1,069 not); an OpenMP team of several threads is pinned to its cores.
    """
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    usable = cores[:-1] if len(cores) > workers else cores
    share = max(1, len(usable) // workers)
    mine = usable[index * share:(index + 1) * share] or [usable[index % len(usable)]]
    return Placement(len(mine), mine if len(mine) > 1 else [])


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


def reuse_freed_memory() -> None:
    """Big allocations from the heap, never trimmed: freed activations are reused without page faults."""
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):  # not glibc
        ok = False
    if not ok:
        log.info("malloc is not glibc's: freed memory is handled by the allocator's own rules")
