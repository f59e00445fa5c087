"""`pagedserve up` for tests: run to its end (`run_up`, for the cases where it stops by itself), or running
(`UpProcess`, shared with the soak: `gateways()` gives each gateway's URL by child name, `kill(name)` SIGKILLs a
child); free ports for its gateways; and the fault phases that SIGKILL one of its children while streams run."""
from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai
from redis_harness import free_port

from benchmarks.up_process import UP, UpProcess, up_env
from pagedserve.ports import port_in_use

__all__ = ["FaultLoad", "Phase", "Streamed", "UpProcess", "free_gateway_port", "health", "run_phase", "run_up",
           "settle"]


def run_up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`pagedserve up ARGS` to its end, with `env` over up_env()."""
    return subprocess.run([*UP, *args], capture_output=True, text=True, timeout=300, env=up_env() | (env or {}))


def free_gateway_port(gateways: int) -> int:
    """A `--port` for `--gateways N`: the first of N consecutive ports that are free on 127.0.0.1 now."""
    while True:
        port = free_port()
        if port + gateways <= 65536 and all(port_in_use("127.0.0.1", port + i) is None for i in range(1, gateways)):
            return port


def health(url: str) -> tuple[int | None, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, OSError):
        return None, {}


@dataclass(frozen=True, slots=True)
class FaultLoad:
    """What a fault phase streams: greedy completions of token-id prompts, `max_tokens` each (ignoring EOS, so that
    every stream runs its whole length), from a stack of `workers` behind `api_key`."""
    model: str
    max_tokens: int
    api_key: str
    workers: tuple[str, ...]

    def client(self, up: UpProcess) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=up.url + "/v1", api_key=self.api_key, max_retries=0, timeout=120)


@dataclass(slots=True)
class Streamed:
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None


@dataclass(slots=True)
class Phase:
    fault: str
    prompts: list[list[int]]
    streams: list[Streamed] = field(default_factory=list)
    recovery_s: float = 0.0  # from the kill to the first new request served
    extra_bodies: list[dict] | None = None  # per prompt, the fields beside the load's (default: ignore EOS)


async def _stream(client: openai.AsyncOpenAI, load: FaultLoad, prompt: list[int], out: Streamed,
                  extra_body: dict) -> None:
    try:
        response = await client.completions.create(
            model=load.model, prompt=prompt, max_tokens=load.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra_body)
        async for chunk in response:
            for choice in chunk.choices:
                out.text += choice.text
                out.chunks += 1
                out.finish_reason = choice.finish_reason or out.finish_reason
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - a connection cut mid-stream raises the HTTP library's own error
        out.error = f"{type(e).__name__}: {e}"


async def _first_served(client: openai.AsyncOpenAI, load: FaultLoad) -> None:
    """Return once a new request is answered in full, trying again while the stack is recovering."""
    while True:
        try:
            response = await client.completions.create(model=load.model, prompt=[5, 6, 7], max_tokens=2,
                                                       temperature=0, timeout=30, extra_body={"ignore_eos": True})
            if response.usage.completion_tokens == 2:
                return
        except openai.APIError:
            await asyncio.sleep(0.1)


async def run_phase(up: UpProcess, load: FaultLoad, phase: Phase) -> None:
    """Stream the phase's prompts; once each stream has begun and none has ended, SIGKILL the child; time the
    first new request served after it; wait for every stream to end."""
    client = load.client(up)
    try:
        phase.streams = [Streamed() for _ in phase.prompts]
        bodies = phase.extra_bodies or [{"ignore_eos": True}] * len(phase.prompts)
        tasks = [asyncio.create_task(_stream(client, load, p, s, b))
                 for p, s, b in zip(phase.prompts, phase.streams, bodies)]

        async def begun() -> None:
            while not all(s.chunks >= 2 for s in phase.streams) and not any(t.done() for t in tasks):
                await asyncio.sleep(0.02)
        await asyncio.wait_for(begun(), 120)
        assert not any(t.done() for t in tasks), f"the fault must land mid-stream: {phase.streams}"
        up.kill(phase.fault)
        killed = time.monotonic()
        await asyncio.wait_for(_first_served(client, load), 60)
        phase.recovery_s = time.monotonic() - killed
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
    finally:
        await client.close()


def settle(up: UpProcess, load: FaultLoad, killed: str, old_pid: int) -> None:
    """Wait until the killed child runs again and every worker is live, so that phases do not overlap."""
    deadline = time.monotonic() + 120
    while not (up.pids()[killed] != old_pid and health(up.url)[1].get("workers") == list(load.workers)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the stack did not settle after {killed}'s restart:\n{up.log()[-3000:]}")
        time.sleep(0.2)
