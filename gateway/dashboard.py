"""GET /dashboard: a live page of every worker's KV blocks, queues and steps, and of the requests this gateway
serves; its data comes from GET /dashboard/api/state, which sits behind --api-key as /v1/ does.

The page (gateway/static/: plain HTML, JS and canvas, nothing fetched from elsewhere) polls the state every
half second. Each poll keeps the dashboard's watch key alive in Redis: the scheduler publishes its cache
snapshots (shared/protocol.py: CacheSnapshot) only while that key lives, so a cache nobody looks at costs
nothing. Requests per second, TTFT and TPOT are this gateway's: sampled every second from its Prometheus
histograms and turned into quantiles as Prometheus' histogram_quantile does (linear within a bucket), so the page
and Grafana agree.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import Histogram

from gateway.metrics import Metrics
from gateway.serving import BUS_ERRORS, Gateway, bus_unavailable
from shared.protocol import BLOCK_MOVING, BLOCK_STATES, CacheSnapshot, ProtocolError, decode

log = logging.getLogger(__name__)
PAGE = "/dashboard"
STATIC_PREFIX = "/dashboard/static/"  # the page's own files
API_PREFIX = "/dashboard/api/"
STATIC = Path(__file__).with_name("static")
FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
           "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
WATCH_TTL_MS = 3_000  # a closed page stops the snapshots within this
SAMPLE_S = 1.0
HISTORY_LEN = 300  # samples: five minutes
QUANTILE_WINDOW = 10  # samples each quantile covers, as rate(...[10s])
QUANTILES = (0.5, 0.99)


def histogram_quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Prometheus' estimate of quantile `q` from cumulative bucket counts (the last bucket is +Inf): linear
    within the bucket that holds the rank; the highest finite bound when that is the +Inf bucket; None with no
    observation."""
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(counts) - 1:
        return bounds[-2]
    lower, below = (bounds[i - 1], counts[i - 1]) if i > 0 else (0.0, 0.0)
    return lower + (bounds[i] - lower) * (rank - below) / (counts[i] - below)


def _buckets(hist: Histogram) -> tuple[list[float], list[float]]:
    """(upper bounds, cumulative counts) of a histogram without labels."""
    bounds, counts = [], []
    for sample in hist.collect()[0].samples:
        if sample.name.endswith("_bucket"):
            bounds.append(float(sample.labels["le"]))
            counts.append(sample.value)
    return bounds, counts


@dataclass(slots=True)
class _Sample:
    time: float
    requests: float  # requests ended (every prompt of a call is one), cumulative
    ttft: list[float]  # cumulative bucket counts
    tpot: list[float]


class GatewayHistory:
    """This gateway's last minutes: a sample of its histograms every SAMPLE_S, turned into series on demand."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.samples: deque[_Sample] = deque(maxlen=HISTORY_LEN + QUANTILE_WINDOW)
        self.bounds = {"ttft": _buckets(metrics.ttft)[0], "tpot": _buckets(metrics.tpot)[0]}

    def sample(self, now: float) -> None:
        m = self.metrics
        self.samples.append(_Sample(now, _buckets(m.e2e)[1][-1], _buckets(m.ttft)[1], _buckets(m.tpot)[1]))

    def series(self) -> dict[str, list]:
        """Per sample after the first: its time, requests/s since the one before, and TTFT and TPOT quantiles over
        the requests of the last QUANTILE_WINDOW samples (None where there were none)."""
        samples = list(self.samples)
        out: dict[str, list] = {"time": [], "requests_per_s": []}
        for name in self.bounds:
            for q in QUANTILES:
                out[f"{name}_p{round(q * 100)}"] = []
        for i in range(1, len(samples)):
            now, before, window = samples[i], samples[i - 1], samples[max(0, i - QUANTILE_WINDOW)]
            out["time"].append(now.time)
            out["requests_per_s"].append((now.requests - before.requests) / (now.time - before.time))
            for name, bounds in self.bounds.items():
                recent = [a - b for a, b in zip(getattr(now, name), getattr(window, name))]
                for q in QUANTILES:
                    out[f"{name}_p{round(q * 100)}"].append(histogram_quantile(q, bounds, recent))
        return {k: v[-HISTORY_LEN:] for k, v in out.items()}


def _plain(value: Any) -> Any:
    """A snapshot as JSON: dataclasses become objects, bytes base64."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return [_plain(v) for v in value]
    return value


class Dashboard:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.history = GatewayHistory(gw.metrics)
        self.sampler: asyncio.Task | None = None

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "dashboard.html", headers={**HEADERS, "Content-Type": "text/html"})

    async def static(self, request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name not in FILES:
            raise web.HTTPNotFound()
        return web.FileResponse(STATIC / name, headers={**HEADERS, "Content-Type": FILES[name]})

    async def state(self, request: web.Request) -> web.Response:
        """The latest cache snapshot (None until the scheduler has seen the watch key), the workers with a live
        heartbeat, and this gateway's series."""
        bus = self.gw.bus
        try:
            async with bus.client.pipeline(transaction=False) as pipe:
                pipe.set(bus.keys.dashboard_watch, b"1", px=WATCH_TTL_MS)
                pipe.get(bus.keys.cache_snapshot)
                _, raw = await pipe.execute()
            alive, _ = await bus.live_workers()
        except BUS_ERRORS as e:
            raise bus_unavailable(e) from None
        snapshot = None
        if raw is not None:
            try:
                snapshot = decode(raw, CacheSnapshot)
            except ProtocolError as e:
                log.warning("ignoring a malformed cache snapshot: %s", e)
        body = {"time": time.time(), "states": list(BLOCK_STATES), "moving": BLOCK_MOVING, "workers_alive": alive,
                "snapshot": _plain(snapshot), "gateway": self.history.series()}
        response = web.json_response(body, headers={"Cache-Control": "no-store"})
        response.enable_compression()
        return response

    async def _sample_forever(self) -> None:
        while True:
            self.history.sample(time.time())
            await asyncio.sleep(SAMPLE_S)

    async def start(self, app: web.Application) -> None:
        self.sampler = asyncio.get_running_loop().create_task(self._sample_forever())

    async def stop(self, app: web.Application) -> None:
        if self.sampler is not None:
            self.sampler.cancel()
            await asyncio.gather(self.sampler, return_exceptions=True)


def add_dashboard(app: web.Application, gw: Gateway) -> None:
    dashboard = Dashboard(gw)
    app.router.add_get(PAGE, dashboard.page)
    app.router.add_get(STATIC_PREFIX + "{name}", dashboard.static)
    app.router.add_get(API_PREFIX + "state", dashboard.state)
    app.on_startup.append(dashboard.start)
    app.on_cleanup.append(dashboard.stop)
