"""CPU seconds of a process and everything it started, from /proc (Linux): what a server costs the machine."""
from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, grandchildren, ...), whatever their session."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found + [g for c in found for g in descendants(c)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    return sum(cpu_seconds(p) for p in [pid, *descendants(pid)])
