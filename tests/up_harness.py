"""`pagedserve up` for tests: run to its end (`run_up`, for the cases where it stops by itself), or running
(`UpProcess`, shared with the soak)."""
from __future__ import annotations

import subprocess

from benchmarks.up_process import UP, UpProcess, up_env

__all__ = ["UpProcess", "run_up"]


def run_up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pagedserve up ARGS` to its end, with `env` over up_env()."""
    return subprocess.run([*UP, *args], capture_output=True, text=True, timeout=300, env=up_env() | (env or {}))
