"""A worker's compute threads and cores: parsing, the split `pagedserve up` makes, and pinning a real process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpu_worker.cpu_setup import Placement, PlacementError, format_cores, parse_cores, stack_placement


def test_core_lists_parse_like_taskset():
    assert parse_cores("") == []
    assert parse_cores("3") == [3]
    assert parse_cores("0-3,6, 2") == [0, 1, 2, 3, 6]
    assert format_cores(parse_cores("4-5,1")) == "1,4,5"
    for bad in ("a", "3-1", "-2", "1-x"):
        with pytest.raises(PlacementError, match="cpu_cores"):
            parse_cores(bad)


@pytest.mark.parametrize("cores,workers,expected", [
    ([0, 1], 1, [[0]]),  # the last core is left to the gateway, scheduler and Redis
    ([0], 1, [[0]]),  # one core: shared
    ([0, 1], 2, [[0], [1]]),  # as many workers as cores: one each, nothing reserved
    ([0, 1], 3, [[0], [1], [0]]),  # more workers than cores: round robin
    (list(range(16)), 2, [list(range(0, 7)), list(range(7, 14))]),  # even split, the remainder to the front end
    ([2, 5, 7, 9], 1, [[2, 5, 7]]),
])
def test_up_gives_each_worker_its_share_of_the_cores(cores, workers, expected):
    placements = [stack_placement(i, workers, cores) for i in range(workers)]
    assert [p.threads for p in placements] == [len(c) for c in expected]
    # a team of threads is pinned to its cores; a single thread only limited to one, free to move
    assert [p.cores for p in placements] == [c if len(c) > 1 else [] for c in expected]


def test_a_worker_process_is_pinned_with_its_threads():
    """In a fresh process: every thread (the OpenMP team included) is on the core, torch uses one thread."""
    core = min(os.sched_getaffinity(0))
    code = ("import json, os, threading, torch\n"
            "torch.set_num_threads(2); torch.ones(1 << 16).sum()  # an OpenMP team exists before pinning\n"
            "from gpu_worker.cpu_setup import Placement, apply\n"
            f"apply(Placement(1, [{core}]))\n"
            "late = threading.Thread(target=lambda: None); late.start(); late.join()\n"
            "masks = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')]\n"
            "print(json.dumps({'threads': torch.get_num_threads(), 'masks': masks}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["threads"] == 1
    assert report["masks"] and all(mask == [core] for mask in report["masks"])


def test_cores_the_process_may_not_use_are_refused():
    from gpu_worker.cpu_setup import apply

    allowed = os.sched_getaffinity(0)
    with pytest.raises(PlacementError, match="may not run on"):
        apply(Placement(0, [max(allowed) + 1000]))
    assert os.sched_getaffinity(0) == allowed


def test_freed_big_blocks_are_reused_not_mapped_again():
    """In a fresh process: a 32 MiB tensor copied 50 times. glibc's default maps and faults in every copy's
    8192 pages; after reuse_freed_memory the heap keeps them (this machine's memory reclaim still takes some
    back, so not all faults go)."""
    code = ("import resource, sys, torch\n"
            "from gpu_worker.cpu_setup import reuse_freed_memory\n"
            "if sys.argv[1] == 'reuse': reuse_freed_memory()\n"
            "x = torch.ones(1 << 23); x.clone()\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "for _ in range(50): x.clone()\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 50)\n")
    faults = {mode: float(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                                         timeout=120, check=True).stdout.split()[-1]) for mode in ("default", "reuse")}
    assert faults["default"] >= 8192
    assert faults["reuse"] < faults["default"] / 2
