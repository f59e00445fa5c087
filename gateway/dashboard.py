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
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from aiohttp import web
from prometheus_client import Histogram

from gateway.metrics import FAST_BUCKETS, Metrics
from gateway.serving import BUS_ERRORS, Gateway, bus_unavailable
from gateway.bus import decode_or_none
from shared.protocol import BLOCK_MOVING, BLOCK_STATES, CacheSnapshot

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


def _buckets(hist: Histogram, bounds: list[float]) -> list[float]:
    """The cumulative counts of a histogram at its upper `bounds`, summed over its tenants."""
    counts = dict.fromkeys(bounds, 0.0)
    for sample in hist.collect()[0].samples:
        if sample.name.endswith("_bucket") and (le := float(sample.labels["le"])) in counts:
            counts[le] += sample.value
    return list(counts.values())


@dataclass(slots=True)
class _Sample:
    time: float
    requests: float  # requests ended (every prompt of a call is one), cumulative
    ttft: list[float]  # cumulative bucket counts
    tpot: list[float]


class GatewayHistory:
    """This gateway's last minutes: a sample of its histograms every SAMPLE_S, each turned into a point of the
    series as it is taken."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.recent: deque[_Sample] = deque(maxlen=QUANTILE_WINDOW)  # the samples a new point is measured against
        self.bounds = {"ttft": [*FAST_BUCKETS, math.inf], "tpot": [*FAST_BUCKETS, math.inf]}
        names = ["time", "requests_per_s"] + [f"{n}_p{round(q * 100)}" for n in self.bounds for q in QUANTILES]
        self.points: dict[str, deque] = {name: deque(maxlen=HISTORY_LEN) for name in names}

    def sample(self, now: float) -> None:
        """Per sample after the first, a point: its time, requests/s since the one before, and TTFT and TPOT
        quantiles over the requests of the last QUANTILE_WINDOW samples (None where there were none)."""
        m = self.metrics
        new = _Sample(now, _buckets(m.e2e, [math.inf])[-1], _buckets(m.ttft, self.bounds["ttft"]),
                      _buckets(m.tpot, self.bounds["tpot"]))
        if self.recent:
            before, window = self.recent[-1], self.recent[0]
            self.points["time"].append(new.time)
            self.points["requests_per_s"].append((new.requests - before.requests) / (new.time - before.time))
            for name, bounds in self.bounds.items():
                counts = [a - b for a, b in zip(getattr(new, name), getattr(window, name))]
                for q in QUANTILES:
                    self.points[f"{name}_p{round(q * 100)}"].append(histogram_quantile(q, bounds, counts))
        self.recent.append(new)

    def series(self) -> dict[str, list]:
        return {name: list(values) for name, values in self.points.items()}


def _dumps(body: dict) -> str:
    """JSON with bytes (a snapshot's block states) as base64."""
    return json.dumps(body, default=lambda raw: base64.b64encode(raw).decode("ascii"))


class Dashboard:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.history = GatewayHistory(gw.metrics)
        self.sampler: asyncio.Task | None = None
        self.snapshot_raw: bytes | None = None
        self.snapshot: dict | None = None  # snapshot_raw decoded, as JSON objects

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
        try:
            raw, alive = await self.gw.bus.dashboard_state(WATCH_TTL_MS)
        except BUS_ERRORS as e:
            raise bus_unavailable(e) from None
        if raw != self.snapshot_raw:  # pages poll faster than the scheduler publishes: decode each snapshot once
            snapshot = decode_or_none(raw, CacheSnapshot, "cache snapshot")
            self.snapshot_raw, self.snapshot = raw, dataclasses.asdict(snapshot) if snapshot else None
        body = {"time": time.time(), "states": list(BLOCK_STATES), "moving": BLOCK_MOVING, "workers_alive": alive,
                "snapshot": self.snapshot, "gateway": self.history.series()}
        response = web.json_response(body, headers={"Cache-Control": "no-store"}, dumps=_dumps)
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
