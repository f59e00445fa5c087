"""What picking a stream up costs: `pagedserve up --gateways 2` on the built-in tiny model, a chat stream cut after
k events at the first gateway and sent again with `Last-Event-ID` to the second, which replays the request's `out:`
stream to find its place. Measured: from the reconnect to its first event, and to its end (the stream still
generating), and then the same stream replayed from its start at the second gateway (its tokens all there by then).

    python -m benchmarks.resume                 # cut after 16, 256 and 1024 events of 1,500
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from statistics import median

import httpx

from benchmarks.up_process import UpProcess
from pagedserve.ports import free_port
from pagedserve.tiny_model import write_tiny_model


def body(tokens: int, seed: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Story {seed}"}], "max_tokens": tokens,
            "temperature": 0.8, "seed": seed, "ignore_eos": True, "stream": True}


def cut_after(url: str, sent: dict, events: int) -> str:
    """Read `events` events of a new stream and hang up; the last id read."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=sent, timeout=300) as resp:
        buffer, seen, last = "", 0, ""
        for chunk in resp.iter_text():
            buffer += chunk
            while "\n\n" in buffer and seen < events:
                frame, buffer = buffer.split("\n\n", 1)
                last, seen = frame.split("\n")[0].removeprefix("id: "), seen + 1
            if seen >= events:
                return last
    raise RuntimeError(f"the stream ended before {events} events")


def timed(url: str, sent: dict, headers: dict[str, str]) -> tuple[float, float]:
    """Seconds to the first event and to the end."""
    started = time.monotonic()
    first = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=sent, headers=headers, timeout=300) as resp:
        for _ in resp.iter_bytes():
            first = first if first is not None else time.monotonic() - started
    return first or 0.0, time.monotonic() - started


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--cuts", default="16,256,1024", help="events read before the connection is cut")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-resume-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny")
        port = free_port()
        up = UpProcess.start(["--model", str(model), "--gateways", "2", "--port", str(port), "--dtype", "float32"],
                             Path(tmp) / "up.log")
        try:
            first_gateway, second = up.gateways().values()
            for cut in map(int, args.cuts.split(",")):
                resumed, whole = [], []
                for seed in range(args.repeats):
                    sent = body(args.tokens, 1000 * cut + seed)
                    last = cut_after(first_gateway, sent, cut)
                    resumed.append(timed(second, sent, {"Last-Event-ID": last}))
                    # the same stream from its start: its tokens are all there now, so this is the replay alone
                    whole.append(timed(second, sent, {"Last-Event-ID": f"{last.partition(':')[0]}:0.0"}))
                rows.append((cut, median(r[0] for r in resumed), median(r[1] for r in resumed),
                             median(w[1] for w in whole)))
        finally:
            up.stop()
    print(f"\nA chat stream of {args.tokens} tokens cut after k events, picked up at the other gateway "
          f"(median of {args.repeats}):\n")
    print("| k | to the first event ms | to the end ms | the whole stream replayed ms |")
    print("|---:|---:|---:|---:|")
    for cut, first, end, replayed in rows:
        print(f"| {cut} | {1000 * first:.0f} | {1000 * end:.0f} | {1000 * replayed:.0f} |")


if __name__ == "__main__":
    main()
