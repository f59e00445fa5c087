"""/dashboard against `pagedserve up` (two workers, an API key) under load from the official openai client.

Oracle for the block counts: the scheduler's own SchedulerStats (what /metrics exports), read from the stack's
Redis every few milliseconds; the scheduler publishes a cache snapshot and its stats from one tick with one
timestamp, so a count the page shows for snapshot time T must equal the stats of time T. The browser test drives
the page in Debian's headless chromium through selenium (skipped where no chromium is installed); the other tests
read the page's data as the page does, over HTTP.
"""
from __future__ import annotations

import base64
import json
import random
import shutil
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis_harness import free_port
from test_monitoring import queried_metrics
from up_harness import UpProcess

from gateway.dashboard import WATCH_TTL_MS
from shared.keys import Keys
from shared.protocol import BLOCK_MOVING, BLOCK_STATES, SchedulerStats, decode

pytestmark = [pytest.mark.slow, pytest.mark.redis]
KEY = "dashboard-test-key"
KEYS = Keys()
SHARED_PROMPT = "Requests that share a prompt prefix share its cached blocks, counted by reference. " * 3


@dataclass(slots=True)
class Stack:
    up: UpProcess
    model: str
    redis: redis.Redis
    stats: dict[float, SchedulerStats] = field(default_factory=dict)  # by time, as the scheduler wrote them
    stop: threading.Event = field(default_factory=threading.Event)

    def record_stats(self) -> None:
        """Keep every SchedulerStats the scheduler writes (it does every 0.25 s; this reads every 20 ms)."""
        while not self.stop.is_set():
            raw = self.redis.get(KEYS.stats)
            if raw is not None:
                stats = decode(raw, SchedulerStats)
                self.stats[stats.time] = stats
            time.sleep(0.02)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.up.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

    def get(self, path: str, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
        request = urllib.request.Request(self.up.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def state(self) -> dict:
        status, _, body = self.get("/dashboard/api/state")
        assert status == 200, body
        return json.loads(body)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    up = UpProcess.start(["--workers", "2", "--model", str(tiny_model_dir), "--port", str(free_port()), "--api-key", KEY,
                   "--dtype", "float32", "--kv-cache-bytes", str(16 << 20)], tmp_path_factory.mktemp("up") / "up.log")
    client = redis.Redis.from_url(up.redis_url(), socket_timeout=10)
    s = Stack(up, tiny_model_dir.name, client)
    recorder = threading.Thread(target=s.record_stats, daemon=True)
    recorder.start()
    yield s
    s.stop.set()
    recorder.join(10)
    client.close()
    up.stop()


class Load:
    """Streaming completions from `threads` clients until stopped (or `limit_s`): random prompts, a third of them on
    one shared prefix, some with n=2. Remembers the request ids each stream reported."""

    def __init__(self, stack: Stack, threads: int = 6, limit_s: float = 120.0) -> None:
        self.stack = stack
        self.deadline = time.monotonic() + limit_s
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.done = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)
        assert not self.errors, self.errors

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        client = self.stack.client()
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            prompt = (SHARED_PROMPT if rng.random() < 0.33 else "") + " ".join(
                str(rng.randrange(1000)) for _ in range(rng.randrange(4, 40)))
            try:
                stream(client, self.stack.model, prompt, rng.choice([1, 1, 2]), rng.randrange(8, 64))
                self.done += 1
            except BaseException as e:  # noqa: BLE001 (reported by __exit__)
                self.errors.append(e)
                return


def stream(client: openai.OpenAI, model: str, prompt: str, n: int, max_tokens: int, ids: list[str] | None = None) -> None:
    for chunk in client.completions.create(model=model, prompt=prompt, n=n, max_tokens=max_tokens, stream=True,
                                           temperature=0.8, extra_body={"ignore_eos": True}):
        if ids is not None and chunk.id not in ids:
            ids.append(chunk.id)


def counts(worker: dict, names: list[str], moving: int) -> dict[str, int]:
    states = base64.b64decode(worker["states"])
    out = {name: 0 for name in names}
    for s in states:
        out[names[s & ~moving]] += 1
    return out


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


# ---- over HTTP --------------------------------------------------------------------------------------------
def test_nothing_is_published_until_a_dashboard_polls_then_the_counts_equal_the_schedulers_under_load(stack):
    # Nobody has polled this stack yet: no watch key, so the scheduler built no snapshot.
    time.sleep(1.0)
    assert stack.redis.get(KEYS.dashboard_watch) is None and stack.redis.get(KEYS.cache_snapshot) is None
    assert stack.state()["snapshot"] is None  # the first poll sets the watch key; the scheduler sees it after
    matched = 0
    with Load(stack) as load:
        deadline = time.monotonic() + 60
        while matched < 8 and time.monotonic() < deadline:
            state = stack.state()
            snap = state["snapshot"]
            stats = stack.stats.get(snap["time"]) if snap else None
            if stats is None:
                time.sleep(0.2)
                continue
            assert sorted(w["worker_id"] for w in snap["workers"]) == sorted(w.worker_id for w in stats.workers)
            for w, s in zip(sorted(snap["workers"], key=lambda w: w["worker_id"]),
                            sorted(stats.workers, key=lambda w: w.worker_id)):
                c = counts(w, state["states"], state["moving"])
                assert c["null"] == 1 and len(base64.b64decode(w["states"])) - 1 == s.num_blocks
                assert c["free"] + c["cached"] == s.free_blocks
                assert c["used"] + c["shared"] == s.num_blocks - s.free_blocks and c["shared"] == s.shared_blocks
                assert (w["prefix_queries"], w["prefix_hits"]) == (s.prefix_queries, s.prefix_hits)
            matched += 1
            time.sleep(0.3)
    assert matched == 8, f"only {matched} snapshots met a stats entry of their time"
    assert state["states"] == list(BLOCK_STATES) and state["moving"] == BLOCK_MOVING
    assert sorted(state["workers_alive"]) == ["worker-0", "worker-1"]
    # This gateway's series saw the load: requests ended and TTFT quantiles. On a loaded machine the snapshots can
    # all be matched before a request ends, so the series is read again until the sampler's next points (1 s apart)
    # count the requests ended meanwhile.
    assert load.done > 0

    def saw_load() -> bool:
        gateway = stack.state()["gateway"]
        return max(gateway["requests_per_s"], default=0) > 0 and any(v is not None for v in gateway["ttft_p99"])
    wait_for(saw_load, 10, "the gateway's series to count the requests ended", poll=0.5)


def test_the_page_is_open_its_data_needs_the_api_key_and_a_malformed_snapshot_is_shown_as_none(stack):
    status, headers, body = stack.get("/dashboard", key=None)
    assert status == 200 and b"<canvas" in body and headers["Content-Type"].startswith("text/html")
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert stack.get("/dashboard/static/dashboard.js", key=None)[0] == 200
    assert stack.get("/dashboard/static/..%2Fdashboard.py", key=None)[0] == 404
    for key in (None, "wrong"):
        status, _, body = stack.get("/dashboard/api/state", key=key)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    # Once the watch key expires the scheduler stops writing; a bad snapshot in its place is dropped, not served.
    time.sleep(WATCH_TTL_MS / 1000 + 1.0)
    stack.redis.set(KEYS.cache_snapshot, b"\xc1 not msgpack", px=60_000)
    assert stack.state()["snapshot"] is None
    wait_for(lambda: "ignoring a malformed cache snapshot" in stack.up.log(), 10, "the gateway's warning")
    wait_for(lambda: stack.state()["snapshot"] is not None, 10, "the scheduler's next snapshot")


def test_every_metric_the_grafana_dashboard_queries_is_on_metrics(stack):
    client = stack.client()  # (every labelled series shows once it has a value)
    for n in (1, 2):
        client.completions.create(model=stack.model, prompt="metrics", max_tokens=4, n=n)
    status, _, body = stack.get("/metrics", key=None)
    assert status == 200
    samples = {s.name for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert queried_metrics() <= samples, queried_metrics() - samples


# ---- in a browser -----------------------------------------------------------------------------------------
SHOWN = """return [...document.querySelectorAll("section.worker")].map((s) => ({
  worker: s.dataset.worker, time: parseFloat(s.dataset.snapshotTime),
  counts: Object.fromEntries([...s.querySelectorAll("[data-count]")].map((e) => [e.dataset.count, e.textContent]))}));"""
# The centres of the cells drawn in the shared colour on a worker's block map, as offsets from the canvas' centre.
SHARED_CELLS = """const [section, color] = arguments;
const canvas = document.querySelector(`section[data-worker="${section}"] canvas.blockmap`);
const cell = +canvas.dataset.cell, cols = +canvas.dataset.cols;
const px = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
const want = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
const r = canvas.getBoundingClientRect(), out = [];
for (let i = 0; i < cols * Math.floor(canvas.height / cell); i++) {
  const x = (i % cols) * cell + Math.floor(cell / 2), y = Math.floor(i / cols) * cell + Math.floor(cell / 2);
  const o = (y * canvas.width + x) * 4;
  if (px[o] === want[0] && px[o + 1] === want[1] && px[o + 2] === want[2]) out.push([x - r.width / 2, y - r.height / 2]);
}
return out;"""
SHARED_COLOR = "#f59e0b"  # gateway/static/dashboard.js: COLORS.shared


@pytest.fixture
def browser(tmp_path):
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium and chromedriver on the PATH (Debian: apt-get install chromium chromium-driver; "
                    ".ci/run installs them where apt-get works): the dashboard's browser test needs them")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1250",
                f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver, log_output=str(tmp_path / "chromedriver.log")), options=options)
    yield chrome
    chrome.quit()


def hover_shared_cells(browser, worker: str):
    """The tooltip over each cell of `worker`'s map drawn as shared, checked to say so with a ref count of 2 or more."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = browser.find_element(By.CSS_SELECTOR, f'section[data-worker="{worker}"] canvas.blockmap')
    for offset in browser.execute_script(SHARED_CELLS, worker, SHARED_COLOR):
        ActionChains(browser).move_to_element_with_offset(canvas, *offset).perform()
        tip = wait_for(lambda: (e := browser.find_element(By.ID, "tooltip")).is_displayed() and e.text, 10, "the tooltip")
        assert ": shared" in tip and int(tip.split("ref count ")[1].split()[0]) >= 2, tip
        yield tip


def test_the_page_in_chromium_shows_the_schedulers_blocks_a_shared_prefix_and_keeps_updating(stack, browser, tmp_path):
    from selenium.webdriver.common.by import By

    def shown() -> list[dict]:
        return browser.execute_script(SHOWN)

    browser.get(stack.up.url + "/dashboard")
    # No key yet: the gateway answers 401 and the page asks for one.
    key_input = wait_for(lambda: (e := browser.find_element(By.ID, "key-input")).is_displayed() and e, 30, "the key form")
    key_input.send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_for(lambda: len(shown()) == 2, 30, "both workers' block maps")
    assert browser.execute_script("return sessionStorage.getItem('pagedserve-api-key')") == KEY

    with Load(stack):
        # The counts the page shows equal the scheduler's stats of the same tick (the page refreshes every 0.5 s).
        matched, seen = 0, set()
        deadline = time.monotonic() + 60
        while matched < 6 and time.monotonic() < deadline:
            for w in shown():
                stats = stack.stats.get(w["time"])
                if stats is None or (w["worker"], w["time"]) in seen:
                    continue
                seen.add((w["worker"], w["time"]))
                s = next(s for s in stats.workers if s.worker_id == w["worker"])
                c = {k: v for k, v in w["counts"].items()}
                assert int(c["free"]) + int(c["cached"]) == s.free_blocks
                assert int(c["in-use"]) == int(c["used"]) + int(c["shared"]) == s.num_blocks - s.free_blocks
                assert int(c["shared"]) == s.shared_blocks
                assert int(c["blocks"]) == s.num_blocks
                assert c["usage"] == f"{100 * (s.num_blocks - s.free_blocks) / s.num_blocks:.1f}%"
                matched += 1
            time.sleep(0.2)
        assert matched >= 6, f"only {matched} of the page's counts met the scheduler's stats of their tick"

        # A burst on one prompt, two samples each: its blocks are shared while the burst runs.
        client, ids = stack.client(), []
        burst = [threading.Thread(target=stream, args=(client, stack.model, SHARED_PROMPT + "burst", 2, 96, ids))
                 for _ in range(6)]
        for t in burst:
            t.start()
        wait_for(lambda: len(ids) == len(burst), 60, "every request of the burst to stream")
        running = time.time()
        wait_for(lambda: any(w["time"] > running and int(w["counts"]["shared"]) > 0 for w in shown()), 30,
                 "shared blocks on the page")
        browser.find_element(By.ID, "pause").click()  # hold the maps still to hover over them
        burst_rids = {f"{i}-0" for i in ids}  # the gateway's request id: the completion's id and the prompt's index
        tips = []
        for tip in (t for w in shown() if int(w["counts"]["shared"]) > 0 for t in hover_shared_cells(browser, w["worker"])):
            tips.append(tip)
            holders = tip.split("held by ")[1].split(": ")[-1].split(", and")[0].split(", ")
            if len(holders) >= 2 and burst_rids & set(holders):
                break  # a block of the burst's prompt, held by several requests
        else:
            raise AssertionError(f"no shared block listed two requests, one of the burst {burst_rids}: {tips}")
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        browser.find_element(By.ID, "pause").click()
        for t in burst:
            t.join(120)

    # Once the burst ended its blocks stay cached; and the page keeps updating while idle.
    wait_for(lambda: all(int(w["counts"]["used"]) + int(w["counts"]["shared"]) == 0 for w in shown()), 60,
             "every request to end")
    assert any(int(w["counts"]["cached"]) > 0 for w in shown())
    times = set()
    wait_for(lambda: len(times.update(w["time"] for w in shown()) or times) >= 4, 10, "four snapshots in a row", 0.2)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]
              and "favicon" not in e["message"]]
    assert errors == []
