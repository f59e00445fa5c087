"""The gateway over HTTP, in-process, against a real Redis. A small driver plays the scheduler's side of
the bus contract (read `requests`, write `out:{rid}`), so every gateway path runs without the services:
validation (nothing reaches the bus), auth, size limit, backpressure, health, metrics, completions and
chat (whole and streamed), stop strings and aborts, failures, disconnects, and a JSON-body fuzz."""
from __future__ import annotations

import asyncio
import codecs
import dataclasses
import gzip
import json
import shutil
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import SERVER_OPTIONS, create_app
from gateway.model import ServedModel
from shared.keys import FIELD, Keys
from shared.protocol import (
    FAILED, REJECTED, UNAVAILABLE, Abort, Assignment, PromptLogprob, Request, SchedulerStats, TokenOutput,
    WorkerRegistration, WorkerStats, decode, encode,
)
from shared.settings import Settings

KEYS = Keys()
Script = Callable[[Request], list[TokenOutput | Assignment]]


def as_placed(req: Request, outs: list[TokenOutput]) -> list[Assignment | TokenOutput]:
    """The entries of `req`'s stream had the scheduler placed it on worker "w0": the Assignment, then the
    tokens written as w0's."""
    return [Assignment(req.rid, "w0", 1)] + [dataclasses.replace(o, worker_id="w0", epoch=1) if o.sample_index >= 0
                                             else o for o in outs]


class Driver:
    """The scheduler's side of the bus for tests: each request gets the entries `script` returns, as placed
    (or, with `place` False, exactly as returned: a script that forges entries writes its own Assignment)."""

    def __init__(self, url: str, script: Script, place: bool = True) -> None:
        self.url = url
        self.script = script
        self.place = place
        self.requests: list[Request] = []
        self.stopped = False  # as the gateway's loops, it ends on this even where redis-py swallows a cancellation

    async def run(self) -> None:
        client = aioredis.Redis.from_url(self.url, socket_timeout=10)
        cursor = "0-0"
        try:
            while not self.stopped:
                for _, entries in await client.xread({KEYS.requests: cursor}, block=1000) or ():
                    for entry_id, fields in entries:
                        cursor = entry_id
                        req = decode(fields[FIELD.encode()], Request)
                        self.requests.append(req)
                        entries = self.script(req)
                        async with client.pipeline(transaction=False) as pipe:
                            for entry in as_placed(req, entries) if self.place else entries:
                                pipe.xadd(KEYS.out(req.rid), {FIELD: encode(entry)})
                            await pipe.execute()
        finally:
            await client.aclose()


@dataclass(slots=True)
class Reply:
    status: int
    headers: CIMultiDict
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


class LiveGateway:
    """The gateway app on a background event loop, reachable over real HTTP (an aiohttp client on the loop)."""

    def __init__(self, settings: Settings, model: ServedModel, script: Script | None = None,
                 place: bool = True) -> None:
        self.settings = settings
        self.model = model
        self.driver = Driver(settings.redis_url, script, place) if script else None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "LiveGateway":
        self.thread.start()
        self.run(self._start())
        return self

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

    async def _start(self) -> None:
        self.server = TestServer(await create_app(self.settings, self.model))
        await self.server.start_server(**SERVER_OPTIONS)  # it cancels handlers on disconnect, as `run` does
        self.url = str(self.server.make_url("")).rstrip("/")
        self.session = aiohttp.ClientSession()
        self.driver_task = asyncio.create_task(self.driver.run()) if self.driver else None

    async def _stop(self) -> None:
        await self.session.close()
        if self.driver_task:
            self.driver.stopped = True
            self.driver_task.cancel()
            await asyncio.wait([self.driver_task], timeout=5)
        await self.server.close()

    def __exit__(self, *exc) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    async def request(self, method: str, path: str, json_body: Any = None, content: bytes | None = None,
                      headers: dict[str, str] | None = None, timeout: float = 30) -> Reply:
        data = content if content is not None else None if json_body is None else json.dumps(json_body).encode()
        if data is not None:  # as clients send JSON, unless a test says otherwise
            headers = {"Content-Type": "application/json"} | (headers or {})
        async with self.session.request(method, self.url + path, data=data, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return Reply(resp.status, CIMultiDict(resp.headers), await resp.text())

    def post(self, path: str, json: Any = None, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> Reply:
        return self.run(self.request("POST", path, json, content, headers))

    def get(self, path: str, headers: dict[str, str] | None = None) -> Reply:
        return self.run(self.request("GET", path, headers=headers))


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)
    return result


def tokens(model: ServedModel, text: str) -> list[int]:
    return model.tokenizer.encode(text, add_special_tokens=False)


def prompt_logprobs_of(prompt_ids: list[int], k: int | None) -> list[PromptLogprob] | None:
    """What a worker would say of the prompt, made up but regular: prompt token j has logprob -j/8, and is
    the likeliest at odd j (rank 1) and second to token 9 at even j (rank 2); the top holds k tokens."""
    if k is None:
        return None
    out = []
    for j, t in enumerate(prompt_ids[1:], 1):
        lp = -j / 8
        rivals = [(u, lp - 1 - m) for m, u in enumerate(u for u in (7, 8, 9, 10, 11) if u != t)]
        top = [(t, lp)] + rivals if j % 2 else [(9 if t != 9 else 10, lp + 0.5), (t, lp)] + rivals
        out.append(PromptLogprob(lp, 1 if j % 2 else 2, top[:k]))
    return out


def cached_tokens_of(req: Request) -> int:
    return len(req.prompt_token_ids) // 2


def answer(model: ServedModel, texts: list[str], finish: str | None = "length", error: str | None = None,
           error_kind: str = FAILED) -> Script:
    """Sample i streams the tokens of texts[i % len(texts)]; `finish` None leaves it running on the bus. Each
    sample's first token carries the prompt's cached tokens and, when asked for, its logprobs."""
    def script(req: Request) -> list[TokenOutput]:
        outs = []
        for s in range(req.params.n if texts else 0):
            ids = tokens(model, texts[s % len(texts)])
            cut = len(ids) > req.params.max_tokens  # as a worker does, never past max_tokens
            ids = ids[:req.params.max_tokens]
            for i, t in enumerate(ids):
                end = ("length" if cut else finish) if i == len(ids) - 1 else None
                first = dict(num_cached_tokens=cached_tokens_of(req),
                             prompt_logprobs=prompt_logprobs_of(req.prompt_token_ids, req.params.prompt_logprobs))
                outs.append(TokenOutput(req.rid, s, i, t, logprob=-0.25 * (i + 1),
                                        top_logprobs=[(t, -0.25 * (i + 1)), (7, -3.0)], finish_reason=end,
                                        **(first if i == 0 else {})))
        if error is not None:
            outs.append(TokenOutput(req.rid, -1, 0, 0, finish_reason="error", error=error, error_kind=error_kind))
        return outs
    return script


def bytes_of(token: str) -> bytes:
    """A logprob token's bytes: its text, or after vLLM's `bytes:` its text with \\xNN escapes for raw bytes."""
    return codecs.escape_decode(token.removeprefix("bytes:").encode())[0] if token.startswith("bytes:") else token.encode()


def aborts(url: str) -> list[Abort]:
    return [decode(f[FIELD.encode()], Abort) for _, f in redis.Redis.from_url(url).xrange(KEYS.control)]


def sse_frames(body: str) -> list[tuple[str | None, str]]:
    """(id, data) of each event: every event has its id, then one data line; but an error that ends a stream, and
    its [DONE], which are no events of the requests' streams (None)."""
    assert body.endswith("\n\n")
    frames = [f.split("\n") for f in body.split("\n\n")[:-1]]
    numbered = [len(f) == 2 and f[0].startswith("id: ") and f[1].startswith("data: ") for f in frames]
    plain = [len(f) == 1 and f[0].startswith("data: ") for f in frames]
    assert all(a or b for a, b in zip(numbered, plain)) and (all(numbered) or '"error"' in frames[-2][0]), frames
    return [(f[0][len("id: "):], f[1][len("data: "):]) if len(f) == 2 else (None, f[0][len("data: "):])
            for f in frames]


def sse_events(body: str) -> list[str]:
    return [data for _, data in sse_frames(body)]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> ServedModel:
    return ServedModel.load(Settings(model=str(tiny_model_dir)))


@pytest.fixture
def base(redis_url, tiny_model_dir) -> Settings:
    return Settings(model=str(tiny_model_dir), redis_url=redis_url, max_body_bytes=64 << 10)


def check_error(resp: Reply, status: int, param: str | None, *fragments: str) -> dict:
    assert resp.status == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


HI = [{"role": "user", "content": "hi"}]
INVALID = [
    ("/v1/completions", b"{bad", 400, None, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "gpt-9"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "prompt"),
    ("/v1/completions", {}, 400, "prompt", "required"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "99999"),
    ("/v1/completions", {"prompt": ["ok", 3.5]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "[0.0, 2.0]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p", "[0.0, 1.0]"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", "[1, 128]"),
    ("/v1/completions", {"prompt": "hi", "n": True}, 400, "n", "integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2 ** 70}, 400, "max_tokens", "64-bit"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed", "seed"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "stream"),
    ("/v1/completions", {"prompt": "a\ud800b"}, 400, "prompt", "lone surrogate (U+D800)"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\udfff"]}, 400, "stop", "lone surrogate"),
    ("/v1/completions", {"prompt": ["hi"] * 1100, "n": 128, "max_tokens": 64}, 400, None, "max_call_tokens"),
    ("/v1/completions", {"prompt": [[5]] * 1025}, 400, "prompt", "max_waiting_requests"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", "[-2.0, 2.0]"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty", "[-2.0, 2.0]"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "(0, 2]"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, "x"]}, 400, "stop_token_ids", "integers"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}, 400, "logit_bias", "'five'"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias",
     "99999 in `logit_bias` is outside the vocabulary: its size is 512"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "up"}}, 400, "logit_bias", "number"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1}, "use_beam_search": True}, 400, "logit_bias",
     "beam search"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids", "1 to 1024"),
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, 400, "max_token", "not a field of this route"),
    ("/v1/completions", {"prompt": "hi", "min_characters": 5}, 400, "min_characters", "neither OpenAI nor vLLM"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": 5}}, 400, "guided_json", "does not compile"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a+", "json_object": True}}, 400,
     "structured_outputs", "exactly one of"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "-1 or at"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 4096}, 400, "truncate_prompt_tokens",
     "greater than max_model_len, 2048"),
    ("/v1/completions", {"prompt": "hi", "truncation_side": "middle"}, 400, "truncation_side", "middle"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_obfuscation": True}}, 400,
     "stream_options.include_obfuscation", "not supported"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400,
     "stream_options.usage", "not a field"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 40, "max_tokens": 4}, 400, "min_tokens", "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "array"),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "x"}]}, 400, "messages", "role must be a"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, 400,
     "messages", "messages[0].tool_calls[0] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {}}]}, 400,
     "messages", "messages[0].audio is not supported"),
    ("/v1/chat/completions", {"messages": HI, "continue_final_message": True}, 400, "continue_final_message",
     "add_generation_prompt: false"),
    ("/v1/chat/completions", {"messages": HI, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", "tokenize"),
    ("/v1/chat/completions", {"messages": HI, "response_format": {"type": "yaml"}}, 400, "response_format",
     "'yaml'"),
    ("/v1/chat/completions", {"messages": HI, "store": True}, 400, "store", "not stored"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "text only"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": -3}, 400, "max_completion_tokens",
     "max_completion_tokens must be at least 1"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function"}]}, 400, "tools", "functions only"),
    ("/v1/chat/completions", {"messages": HI, "model": 7}, 400, "model", "string"),
    ("/v1/chat/completions", {"messages": HI, "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs", "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", "surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udbff"}]}]},
     400, "messages", "surrogate"),
    ("/tokenize", {}, 400, "prompt", "required"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", "surrogate"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model", "gpt-9"),
    ("/tokenize", {"messages": "hi"}, 400, "messages", "array"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": False}, 400, "add_generation_prompt", "`messages`"),
    ("/tokenize", {"messages": HI, "continue_final_message": True}, 400, "continue_final_message", "add_generation"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens", "99999"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "array"),
    ("/detokenize", b"[", 400, None, "not valid JSON"),
]


def test_invalid_requests_get_openai_errors_and_never_reach_the_bus(base, model, redis_url):
    with LiveGateway(base, model) as gw:
        for path, body, status, param, fragment in INVALID:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            check_error(gw.post(path, content=content), status, param, fragment)
        limit = model.max_model_len
        prompt = "The blocks " * 5
        p = len(model.tokenizer.encode(prompt))
        check_error(gw.post("/v1/completions", json={"prompt": prompt, "max_tokens": limit}), 400,
                    "max_tokens", f"maximum context length is {limit} tokens", f"{p + limit} tokens",
                    f"({p} in the prompt, {limit} in the completion)")
        chat = model.tokenizer.render_chat(HI).token_ids
        check_error(gw.post("/v1/chat/completions", json={"messages": HI, "max_completion_tokens": limit}),
                    400, "max_completion_tokens", f"{limit} tokens", f"({len(chat)} in the messages, {limit} in")
        long = "The blocks " * (limit // 2)
        check_error(gw.post("/v1/completions", json={"prompt": long}), 400, "prompt",
                    f"{len(model.tokenizer.encode(long))} tokens long", f"{limit} tokens")
        check_error(gw.post("/v1/completions", json={"prompt": "x" * (65 << 10)}), 413, None,
                    f"limit of {64 << 10} bytes")
        check_error(gw.get("/v1/nothing"), 404, None, "Not Found")
        check_error(gw.get("/v1/completions"), 405, None, "Method Not Allowed")
    assert redis.Redis.from_url(redis_url).xlen(KEYS.requests) == 0


def test_a_model_without_chat_template_gets_a_clear_400(base, tiny_model_dir, tmp_path):
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "chat_template.jinja").unlink()
    no_template = ServedModel.load(base.replace(model=str(bare)))
    with LiveGateway(base.replace(model=str(bare)), no_template) as gw:
        check_error(gw.post("/v1/chat/completions", json={"messages": HI}), 400, "messages",
                    "no chat template")
        # The plain completions route still works without a template (validated up to the bus).
        check_error(gw.post("/v1/completions", json={"prompt": "hi", "n": 0}), 400, "n")


def test_api_key_guards_every_route_but_health_and_metrics(base, model):
    with LiveGateway(base.replace(api_key="sekret"), model) as gw:
        check_error(gw.get("/v1/models"), 401, None, "API key")
        check_error(gw.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, None)
        check_error(gw.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "sekret"}),
                    401, None)
        check_error(gw.post("/tokenize", json={"prompt": "hi"}), 401, None)
        check_error(gw.get("/tokenizer_info"), 401, None)
        ok = gw.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.status == 200 and ok.json()["data"][0]["id"] == model.name
        assert ok.json()["data"][0]["max_model_len"] == model.max_model_len
        assert ok.json()["data"][0]["root"] == model.name, "the model id, not a path on the server"
        assert gw.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekret"}).status == 200
        assert gw.get("/health").status == 503  # health and metrics need no key
        assert gw.get("/metrics").status == 200


def test_health_follows_worker_registrations_and_heartbeats(base, model, redis_url):
    r = redis.Redis.from_url(redis_url)
    with LiveGateway(base, model) as gw:
        resp = gw.get("/health")
        assert resp.status == 503 and "no worker has registered" in resp.json()["reason"]
        reg = WorkerRegistration("w0", model.name, 64, 0, 16, model.max_model_len, [2])
        r.hset(KEYS.workers, "w0", encode(reg))
        resp = gw.get("/health")
        assert resp.status == 503 and "1 registered" in resp.json()["reason"]
        r.set(KEYS.heartbeat("w0"), 1, px=60_000)
        resp = gw.get("/health")
        assert resp.status == 200 and resp.json()["workers"] == ["w0"]
        r.delete(KEYS.heartbeat("w0"))
        assert gw.get("/health").status == 503


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_export_gateway_counters_and_the_scheduler_snapshot(base, model, redis_url):
    text = "Hello 東京 🚀"
    with LiveGateway(base, model, answer(model, [text])) as gw:
        before = metric_values(gw.get("/metrics").text)
        assert ("pagedserve_num_requests_running", ()) not in before, "no scheduler snapshot yet"
        assert before[("pagedserve_workers_alive", ())] == 0
        stats = SchedulerStats(time.time(), running=3, waiting=1, preempted=2, preemptions=5,
                               workers=[WorkerStats("w0", 100, 75, 3, 40, 32)])
        redis.Redis.from_url(redis_url).set(KEYS.stats, encode(stats))
        resp = gw.post("/v1/completions", json={"prompt": "Say", "max_tokens": 50})
        assert resp.status == 200
        scrape = gw.get("/metrics")
        assert scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
        values = metric_values(scrape.text)
    w0 = (("worker", "w0"),)
    assert values[("pagedserve_num_requests_running", ())] == 3
    assert values[("pagedserve_num_requests_waiting", ())] == 1
    assert values[("pagedserve_num_requests_preempted", ())] == 2
    assert values[("pagedserve_num_preemptions_total", ())] == 5
    assert values[("pagedserve_kv_cache_usage_perc", w0)] == 0.25
    assert values[("pagedserve_prefix_cache_queries_total", w0)] == 40
    assert values[("pagedserve_prefix_cache_hits_total", w0)] == 32
    tenant = (("tenant", "default"),)
    assert values[("pagedserve_prompt_tokens_total", tenant)] == len(model.tokenizer.encode("Say"))
    assert values[("pagedserve_generation_tokens_total", tenant)] == len(tokens(model, text))
    assert values[("pagedserve_request_finished_total", (("finish_reason", "length"), *tenant))] == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert values[(f"pagedserve_{name}_count", tenant)] == 1, name
        assert values[(f"pagedserve_{name}_bucket", (("le", "+Inf"), *tenant))] == 1, name


def test_completion_whole_and_streamed_with_usage_logprobs_and_params(base, model):
    text = "Größe, 東京 🚀!"
    n_tokens = len(tokens(model, text))
    body = {"model": model.name, "prompt": "Say", "max_tokens": 40, "temperature": 0.7, "top_p": 0.9,
            "top_k": 5, "min_p": 0.1, "seed": 11, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "stop_token_ids": [9], "ignore_eos": True, "min_tokens": 2,
            "logprobs": 2, "user": "u1"}
    with LiveGateway(base, model, answer(model, [text])) as gw:
        whole = gw.post("/v1/completions", json=body).json()
        streamed = gw.post("/v1/completions", json=body | {"stream": True,
                                                                 "stream_options": {"include_usage": True}})
        req = gw.driver.requests[0]
    prompt_ids = model.tokenizer.encode("Say")
    assert req.model == model.name and req.prompt_token_ids == prompt_ids
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (40, 0.7, 0.9, 5, 0.1, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logprobs, p.n) == ([9], True, 2, 2, 1)

    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-")
    (choice,) = whole["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length" and choice["index"] == 0
    assert whole["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": n_tokens,
                              "total_tokens": len(prompt_ids) + n_tokens,
                              "prompt_tokens_details": {"cached_tokens": len(prompt_ids) // 2}}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_tokens
    assert lp["token_logprobs"] == [-0.25 * (i + 1) for i in range(n_tokens)]
    assert all(top[tok] == val for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert b"".join(map(bytes_of, lp["tokens"])) == text.encode(), "the tokens spell the text, byte for byte"

    assert streamed.status == 200 and streamed.headers["content-type"] == "text/event-stream"
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == text
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert sum(len(ch["logprobs"]["tokens"]) for c in chunks for ch in c["choices"]) == n_tokens


def test_several_prompts_with_n_and_echo_give_one_choice_per_prompt_and_sample(base, model, redis_url):
    texts = ["first answer", "second 🚀 answer"]
    prompts = ["Alpha", [5, 6, 7]]
    with LiveGateway(base, model, answer(model, texts)) as gw:
        resp = gw.post("/v1/completions", json={"prompt": prompts, "n": 2, "echo": True, "max_tokens": 30,
                                                     "temperature": 1.0, "seed": 3}).json()
        streamed = gw.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 30,
                                                         "stream": True})
        rids = [r.rid for r in gw.driver.requests]
    echoed = ["Alpha", model.tokenizer.decode([5, 6, 7], skip_special_tokens=False)]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in resp["choices"]] == [echoed[i // 2] + texts[i % 2] for i in range(4)]
    generated = 2 * sum(len(tokens(model, t)) for t in texts)
    alpha = len(model.tokenizer.encode("Alpha"))
    prompt_tokens = alpha + 3
    assert resp["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                             "total_tokens": prompt_tokens + generated,
                             "prompt_tokens_details": {"cached_tokens": alpha // 2 + 3 // 2}}, "summed over prompts"
    assert rids[:2] == [f"{resp['id']}-0", f"{resp['id']}-1"]
    by_index = ["", "", "", ""]
    for event in sse_events(streamed.text)[:-1]:
        for ch in json.loads(event)["choices"]:
            by_index[ch["index"]] += ch["text"]
    assert by_index == [texts[i % 2] for i in range(4)]
    assert aborts(redis_url) == [], "every sample ended on the bus: nothing to abort"


def test_chat_whole_and_streamed_with_role_first_and_logprobs(base, model):
    text = "Paris, 東京 🚀"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Capital"}, {"type": "text", "text": "?"}]}]
    body = {"model": model.name, "messages": messages, "logprobs": True, "top_logprobs": 2, "n": 2, "seed": 1}
    with LiveGateway(base, model, answer(model, [text])) as gw:
        whole = gw.post("/v1/chat/completions", json=body).json()
        streamed = gw.post("/v1/chat/completions", json=body | {"stream": True})
        req = gw.driver.requests[0]
    rendered = model.tokenizer.render_chat([{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Capital?"}]).token_ids
    assert req.prompt_token_ids == rendered
    assert req.params.max_tokens == model.max_model_len - len(rendered), "chat defaults to the room left"
    assert req.params.logprobs == 2
    assert whole["object"] == "chat.completion" and whole["id"].startswith("chatcmpl-")
    assert [c["message"] for c in whole["choices"]] == [{"role": "assistant", "content": text}] * 2
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == len(tokens(model, text)) and len(content[0]["top_logprobs"]) == 2
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    per_choice: dict[int, list[dict]] = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            per_choice[ch["index"]].append(ch)
    for deltas in per_choice.values():
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(d["delta"].get("content", "") for d in deltas) == text
        assert deltas[-1]["finish_reason"] == "length"


def test_stop_string_cuts_the_text_and_aborts_the_request(base, model, redis_url):
    with LiveGateway(base, model, answer(model, ["one two STOP three four"], finish=None)) as gw:
        whole = gw.post("/v1/completions", json={"prompt": "Go", "stop": ["STOP", "zzz"]}).json()
        streamed = gw.post("/v1/completions", json={"prompt": "Go", "stop": "STOP", "stream": True})
        rids = [r.rid for r in gw.driver.requests]
    assert whole["choices"][0]["text"] == "one two "
    assert whole["choices"][0]["finish_reason"] == "stop" and whole["choices"][0]["stop_reason"] == "STOP"
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == "one two "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    wait_until(lambda: [a.rid for a in aborts(redis_url)] == rids, "an abort per stopped request")
    assert all(a.reason == "stop string" for a in aborts(redis_url))


@pytest.mark.parametrize("kind, status", [(REJECTED, 400), (UNAVAILABLE, 503), (FAILED, 500)])
def test_a_request_ended_before_any_token_gets_the_status_of_its_cause(base, model, kind, status):
    with LiveGateway(base, model, answer(model, [], error="the scheduler's message", error_kind=kind)) as gw:
        for stream in (False, True):
            resp = gw.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            check_error(resp, status, None, "the scheduler's message")
            assert (resp.headers.get("Retry-After") == "1") == (kind == UNAVAILABLE)


def test_a_request_that_fails_after_tokens_is_a_500_or_a_last_sse_error(base, model):
    with LiveGateway(base, model, answer(model, ["partial text"], finish=None, error="worker lost")) as gw:
        check_error(gw.post("/v1/completions", json={"prompt": "hi"}), 500, None, "worker lost")
        events = sse_events(gw.post("/v1/completions", json={"prompt": "hi", "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"].endswith("worker lost")
    assert "".join(ch["text"] for e in events[:-2] for ch in json.loads(e)["choices"]) == "partial text"


def test_a_client_that_disconnects_gets_its_request_aborted_at_once_with_no_grace_period(base, model, redis_url):
    async def read_one_line_and_leave(gw: LiveGateway) -> bytes:
        resp = await gw.session.post(gw.url + "/v1/completions", json={"prompt": "hi", "stream": True})
        first = await resp.content.readline()
        resp.close()
        return first

    with LiveGateway(base.replace(reconnect_grace=0), model, answer(model, ["endless output"], finish=None)) as gw:
        assert gw.run(read_one_line_and_leave(gw)).startswith(b"id: ")
        wait_until(lambda: len(aborts(redis_url)) == 1, "the streaming request's abort")
        with pytest.raises(asyncio.TimeoutError):
            gw.run(gw.request("POST", "/v1/completions", {"prompt": "hi"}, timeout=1.0))
        wait_until(lambda: len(aborts(redis_url)) == 2, "the waiting request's abort")
        rids = [r.rid for r in gw.driver.requests]
    assert [a.rid for a in aborts(redis_url)] == rids


def test_a_streaming_client_that_goes_runs_on_for_the_grace_period_and_one_that_comes_back_is_not_aborted(
        base, model, redis_url):
    body = {"prompt": "hi", "stream": True}

    async def read_one(gw: LiveGateway, headers: dict[str, str] | None = None) -> tuple[aiohttp.ClientResponse, str]:
        resp = await gw.session.post(gw.url + "/v1/completions", json=body, headers=headers or {})
        assert resp.status == 200, await resp.text()
        return resp, (await resp.content.readline()).decode().removeprefix("id: ").strip()

    async def leave(resp: aiohttp.ClientResponse) -> None:
        resp.close()

    grace = 1.5
    with LiveGateway(base.replace(reconnect_grace=grace), model, answer(model, ["endless output"], finish=None)) as gw:
        before = len(aborts(redis_url))
        resp, _ = gw.run(read_one(gw))
        gw.run(leave(resp))
        time.sleep(grace / 3)
        assert len(aborts(redis_url)) == before, "no abort within the grace period"
        wait_until(lambda: len(aborts(redis_url)) == before + 1, "the abort once the grace period is over")
        resp, first = gw.run(read_one(gw))
        gw.run(leave(resp))
        time.sleep(grace / 3)
        again, second = gw.run(read_one(gw, {"Last-Event-ID": first}))
        call, _, count = first.partition(":")
        assert second == f"{call}:{int(count.split('.')[0]) + 1}.0", "the event after the last one had"
        time.sleep(grace * 1.5)
        assert len(aborts(redis_url)) == before + 1, "the stream picked up again is not aborted"
        gw.run(leave(again))
        wait_until(lambda: len(aborts(redis_url)) == before + 2, "its abort once its new client is gone too")
        assert aborts(redis_url)[-1].rid.startswith(call)


def test_the_streams_of_many_requests_are_read_on_one_connection(base, model, redis_url):
    async def open_streams(gw: LiveGateway, count: int) -> list[aiohttp.ClientResponse]:
        resps = [await gw.session.post(gw.url + "/v1/completions", json={"prompt": "hi", "stream": True})
                 for _ in range(count)]
        assert all([(await r.content.readline()).startswith(b"id: ") for r in resps])
        return resps

    async def close(resps: list[aiohttp.ClientResponse]) -> None:
        for resp in resps:
            resp.close()

    with LiveGateway(base, model, answer(model, ["endless output"], finish=None)) as gw:
        resps = gw.run(open_streams(gw, 20))
        client = redis.Redis.from_url(redis_url)
        samples = []
        for _ in range(20):
            samples.append(sum("b" in c["flags"] for c in client.client_list()))
            time.sleep(0.05)
        assert 1 <= max(samples) <= 2, f"at most the driver's read and the gateway's one read of 20 streams: {samples}"
        gw.run(close(resps))
        wait_until(lambda: len(aborts(redis_url)) == 20, "every stream's abort")


def test_backpressure_answers_429_with_retry_after_spread_by_jitter(base, model, redis_url):
    r = redis.Redis.from_url(redis_url)
    with LiveGateway(base.replace(max_waiting_requests=2), model) as gw:  # no driver: requests stay waiting
        hanging = [asyncio.run_coroutine_threadsafe(gw.request("POST", "/v1/completions", {"prompt": "hi"},
                                                               timeout=5), gw.loop) for _ in range(2)]
        wait_until(lambda: r.xlen(KEYS.requests) == 2, "two waiting requests")
        turned_away = [gw.post("/v1/completions", json={"prompt": "hi"}) for _ in range(20)]
        for future in hanging:
            with pytest.raises(asyncio.TimeoutError):
                future.result(30)
        wait_until(lambda: len(aborts(redis_url)) == 2, "aborts of the two abandoned requests")
    assert r.xlen(KEYS.requests) == 2
    waits_ms = []
    for resp in turned_away:
        error = check_error(resp, 429, None, "2 requests are waiting", "limit is 2")
        assert error["type"] == "rate_limit_error"
        ms = int(resp.headers["retry-after-ms"])
        assert int(resp.headers["Retry-After"]) == -(-ms // 1000), "whole seconds, rounded up"
        waits_ms.append(ms)
    # Nothing has left the queue yet: one request to drain at the assumed 1/s, with +-50 % jitter.
    assert all(500 <= ms <= 1500 for ms in waits_ms), waits_ms
    assert len(set(waits_ms)) >= 15 and max(waits_ms) - min(waits_ms) >= 300, f"retries spread out: {waits_ms}"


def test_a_waiting_request_survives_a_redis_restart(own_redis, tiny_model_dir, model):
    text = "after the restart 🚀"
    with LiveGateway(Settings(model=str(tiny_model_dir), redis_url=own_redis.url), model) as gw:
        pending = asyncio.run_coroutine_threadsafe(gw.request("POST", "/v1/completions", {"prompt": "hi"}, timeout=60),
                                                   gw.loop)
        wait_until(lambda: redis.Redis.from_url(own_redis.url).xlen(KEYS.requests) == 1, "the request on the bus")
        ((_, fields),) = redis.Redis.from_url(own_redis.url).xrange(KEYS.requests)
        own_redis.restart()  # the gateway's blocking read loses its connection and must come back
        r = redis.Redis.from_url(own_redis.url)
        req = decode(fields[FIELD.encode()], Request)
        for entry in as_placed(req, answer(model, [text])(req)):
            r.xadd(KEYS.out(req.rid), {FIELD: encode(entry)})
        reply = pending.result(60)
    assert reply.status == 200, reply.text
    assert reply.json()["choices"][0]["text"] == text


def test_a_malformed_entry_in_a_token_stream_is_dropped_and_the_rest_streams(base, model, redis_url, caplog):
    text = "still whole 🚀"
    r = redis.Redis.from_url(redis_url)
    with LiveGateway(base, model) as gw:
        pending = asyncio.run_coroutine_threadsafe(gw.request("POST", "/v1/completions", {"prompt": "hi"}), gw.loop)
        wait_until(lambda: r.xlen(KEYS.requests) == 1, "the request on the bus")
        ((_, fields),) = r.xrange(KEYS.requests)
        req = decode(fields[FIELD.encode()], Request)
        entries = [{FIELD: encode(entry)} for entry in as_placed(req, answer(model, [text])(req))]
        for entry in entries[:2] + [{"other": b"field"}, {FIELD: b"\xc1not msgpack"}] + entries[2:]:
            r.xadd(KEYS.out(req.rid), entry)
        reply = pending.result(60)
    assert reply.status == 200, reply.text
    assert reply.json()["choices"][0]["text"] == text
    assert caplog.text.count("dropped malformed entry") == 2


def forged_around(model: ServedModel, text: str) -> Script:
    """`text` from the assigned worker w0 (epoch 1), interleaved with what a process that can write to Redis
    might add: a huge output index, tokens of a worker the request is not assigned to, a stale epoch, an
    older assignment; and after the scheduler's end entry, more tokens and an error end."""
    def script(req: Request) -> list[TokenOutput | Assignment]:
        ids, evil = tokens(model, text), tokens(model, " EVIL")
        half = len(ids) // 2
        good = [TokenOutput(req.rid, 0, i, t, worker_id="w0", epoch=1,
                            finish_reason="length" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]
        forged = [TokenOutput(req.rid, 0, 10**9, evil[0], worker_id="w0", epoch=1),
                  TokenOutput(req.rid, 0, half, evil[0], worker_id="intruder", epoch=1),
                  TokenOutput(req.rid, 0, half, evil[0], worker_id="w0", epoch=0),
                  Assignment(req.rid, "intruder", 0),
                  TokenOutput(req.rid, 0, half, evil[0], worker_id="intruder", epoch=0)]
        end = TokenOutput(req.rid, -1, 0, 0, finish_reason="length")
        after = [TokenOutput(req.rid, 0, len(ids), evil[0], worker_id="w0", epoch=1),
                 TokenOutput(req.rid, -1, 0, 0, finish_reason="error", error="EVIL", error_kind=FAILED)]
        return [Assignment(req.rid, "w0", 1), *good[:half], *forged, *good[half:-1],
                dataclasses.replace(good[-1], finish_reason=None), end, *after]
    return script


def test_forged_bus_entries_never_reach_the_client(base, model, caplog):
    text = "the real answer 東京"
    with LiveGateway(base, model, forged_around(model, text), place=False) as gw:
        whole = gw.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40},
                        headers={"X-Request-Id": "trace-42"})
        streamed = gw.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stream": True})
    assert whole.status == 200, whole.text
    (choice,) = whole.json()["choices"]
    assert (choice["text"], choice["finish_reason"]) == (text, "length")
    assert whole.json()["usage"]["completion_tokens"] == len(tokens(model, text))
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    assert "".join(ch["text"] for e in events[:-1] for ch in json.loads(e)["choices"]) == text
    dropped = [r.getMessage() for r in caplog.records if "dropped an entry" in r.getMessage()]
    assert sum(m.startswith("[trace-42] ") for m in dropped) == 5, "each forgery logged under the call's id"


def test_a_burst_of_1024_gets_200_or_429_and_leaves_few_connections(base, model, redis_url):
    async def burst(gw: LiveGateway, count: int) -> list[int]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(i: int) -> int:
                async with session.post(gw.url + "/v1/completions", json={"prompt": f"{i} hi", "max_tokens": 4},
                                        timeout=aiohttp.ClientTimeout(total=120)) as resp:
                    await resp.read()
                    return resp.status
            return list(await asyncio.gather(*(one(i) for i in range(count))))

    r = redis.Redis.from_url(redis_url)
    before = len(r.client_list())  # this client and any other test's still closing
    with LiveGateway(base, model, answer(model, ["ok"])) as gw:
        for count in (256, 1024):
            statuses = gw.run(burst(gw, count))
            assert set(statuses) <= {200, 429}, {s: statuses.count(s) for s in set(statuses)}
            assert statuses.count(200) >= count // 4
        after = gw.post("/v1/completions", json={"prompt": "still there?"})
        assert after.status == 200 and after.json()["choices"][0]["text"] == "ok"
        # The driver's, the gateway's stream reader and heartbeat, and its bounded pool.
        assert len(r.client_list()) - before <= base.redis_max_connections + 3


def test_the_gateway_keeps_a_heartbeat_and_tags_its_requests(base, model, redis_url):
    r = redis.Redis.from_url(redis_url)
    with LiveGateway(base.replace(heartbeat_ttl=0.8), model, answer(model, ["ok"])) as gw:
        (key,) = wait_until(lambda: r.keys(KEYS.gateway_alive("*")), "the gateway's heartbeat key")
        instance = key.decode().split(":")[-2]
        for _ in range(12):  # 2.4 s, three TTLs: it must be refreshed to stay
            assert 0 < r.pttl(key) <= 800
            time.sleep(0.2)
        assert gw.post("/v1/completions", json={"prompt": "hi"}).status == 200
        assert gw.driver.requests[0].gateway_id == instance
    assert r.keys(KEYS.gateway_alive("*")) == [], "a clean shutdown deletes it at once"


def test_a_body_that_is_not_what_its_content_encoding_says_gets_400(base, model):
    body = json.dumps({"prompt": "hi"}).encode()
    with LiveGateway(base, model, answer(model, ["ok"])) as gw:
        for encoding in ("gzip", "deflate"):
            check_error(gw.post("/v1/completions", content=b"not compressed", headers={"Content-Encoding": encoding}),
                        400, None, f"not {encoding}")
        check_error(gw.post("/v1/completions", content=gzip.compress(body)[:-9], headers={"Content-Encoding": "gzip"}),
                    400, None, "cut short")
        check_error(gw.post("/v1/completions", content=body, headers={"Content-Encoding": "br"}), 415, None, "'br'")
        bomb = gzip.compress(b" " * (base.max_body_bytes + 1))
        check_error(gw.post("/v1/completions", content=bomb, headers={"Content-Encoding": "gzip"}), 413, None)
        for compressed, encoding in ((gzip.compress(body), "gzip"), (zlib.compress(body), "deflate")):
            good = gw.post("/v1/completions", content=compressed, headers={"Content-Encoding": encoding})
            assert good.status == 200 and good.json()["choices"][0]["text"] == "ok"


def test_request_ids_are_honoured_or_made_and_returned(base, model):
    with LiveGateway(base, model, answer(model, ["ok"])) as gw:
        body = {"prompt": "hi"}
        assert gw.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-1"}).headers["X-Request-Id"] == "abc-1"
        streamed = gw.post("/v1/completions", json=body | {"stream": True}, headers={"X-Request-Id": "abc-2"})
        assert streamed.headers["X-Request-Id"] == "abc-2"
        error = gw.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-Id": "abc-3"})
        assert error.status == 400 and error.headers["X-Request-Id"] == "abc-3"
        made = {gw.post("/v1/completions", json=body).headers["X-Request-Id"] for _ in range(3)}
        unusable = gw.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 200})
        made.add(unusable.headers["X-Request-Id"])
    assert len(made) == 4 and all(len(m) == 32 and int(m, 16) >= 0 for m in made), made


def test_streams_send_an_event_for_every_token_even_one_without_text(base, model):
    text = "🚀🚀 東京 ok"
    ids = tokens(model, text)
    assert any(model.tokenizer.decode([t]).endswith("\ufffd") for t in ids), "some tokens end mid-character"
    with LiveGateway(base, model, answer(model, [text])) as gw:
        completion = gw.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stream": True})
        chat = gw.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 40, "stream": True})
    texts = [ch["text"] for e in sse_events(completion.text)[:-1] for ch in json.loads(e)["choices"]]
    assert len(texts) == len(ids) and "".join(texts) == text and "" in texts
    deltas = [ch["delta"] for e in sse_events(chat.text)[:-1] for ch in json.loads(e)["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d["content"] for d in deltas[1:]] == texts, "one chunk per token, empty while a character is unfinished"


def test_tokenizer_endpoints_round_trip_text_with_the_models_own_tokenizer(base, model, tiny_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    text = "Größe, café — 東京 🚀 <|im_end|> and more"
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": text}]
    with LiveGateway(base, model) as gw:
        plain = gw.post("/tokenize", json={"model": model.name, "prompt": text, "add_special_tokens": False,
                                           "return_token_strs": True}).json()
        with_specials = gw.post("/tokenize", json={"prompt": text}).json()
        chat = gw.post("/tokenize", json={"messages": messages}).json()
        back = gw.post("/detokenize", json={"model": model.name, "tokens": plain["tokens"]}).json()
        info = gw.get("/tokenizer_info").json()
    assert plain["tokens"] == hf(text, add_special_tokens=False).input_ids
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == model.max_model_len
    assert plain["token_strs"] == hf.convert_ids_to_tokens(plain["tokens"])
    assert with_specials["tokens"] == hf(text).input_ids and with_specials["token_strs"] is None
    assert chat["tokens"] == hf(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False).input_ids
    assert back == {"prompt": text}
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (hf.eos_token, hf.bos_token, hf.pad_token)
    assert info["chat_template"] == hf.chat_template and info["model_max_length"] == model.max_model_len


# Text with lone surrogates now and then ("\ud800" in JSON), which UTF-8 cannot carry.
TEXT = st.text(max_size=8) | st.text(st.characters(categories=["Cs", "Lo", "So"]), max_size=4)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=12)
# Mostly well-typed values around the valid ranges' edges, sometimes any JSON at all.
TYPED = {
    "model": st.sampled_from(["tiny", "other"]), "max_tokens": st.integers(-1, 40),
    "max_completion_tokens": st.integers(-1, 40), "temperature": st.floats(-0.5, 2.5), "top_p": st.floats(0, 1.2),
    "top_k": st.integers(-2, 40), "min_p": st.floats(-0.1, 1.1), "seed": st.integers(-1, 2**64),
    "n": st.integers(0, 3), "stop": TEXT | st.lists(TEXT, max_size=2),
    "stop_token_ids": st.lists(st.integers(-1, 600), max_size=2), "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5), "repetition_penalty": st.floats(0, 2.5),
    "logprobs": st.integers(-1, 22) | st.booleans(), "top_logprobs": st.integers(-1, 22), "echo": st.booleans(),
    "prompt_logprobs": st.integers(-1, 22), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "user": st.text(max_size=5),
    "min_tokens": st.integers(-1, 5), "best_of": st.integers(0, 3), "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=1),
    "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(), "return_token_strs": st.booleans(),
}
OPTIONAL = {name: st.one_of(values, values, JSON) for name, values in TYPED.items()}
VALID = {"max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
         "top_k": st.integers(-1, 20), "seed": st.integers(0, 2**63 - 1), "n": st.integers(1, 3),
         "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "logprobs": st.integers(0, 5),
         "stream": st.booleans(), "ignore_eos": st.booleans(), "presence_penalty": st.floats(-2, 2)}
PROMPT_LOGPROBS = {"echo": st.booleans(), "prompt_logprobs": st.integers(0, 5), "max_tokens": st.integers(0, 4)}
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                           "content": TEXT | JSON}), max_size=3)
PROMPTS = TEXT | st.lists(st.integers(-1, 600), max_size=5) | st.lists(TEXT | st.lists(st.integers(0, 511),
                                                                                          max_size=3), max_size=3)
BODIES = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from([*TYPED, "prompt", "messages", "tokens"]), JSON, max_size=6),
    st.fixed_dictionaries({"prompt": PROMPTS}, optional=OPTIONAL),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}, optional=TYPED),
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}, optional=VALID),
    st.fixed_dictionaries({"prompt": PROMPTS}, optional=VALID | PROMPT_LOGPROBS),
    st.fixed_dictionaries({"messages": st.just(HI)}, optional=VALID | {"logprobs": st.booleans(),
                                                                       "prompt_logprobs": st.integers(0, 3)}),
    st.fixed_dictionaries({"messages": MESSAGES}, optional=OPTIONAL),
    st.fixed_dictionaries({"tokens": st.lists(st.integers(-1, 600), max_size=6) | JSON}, optional=OPTIONAL),
)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
HEADERS = st.fixed_dictionaries({}, optional={
    "X-Request-Id": st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=140),
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "identity", "br"])})


def test_fuzzed_bodies_of_every_endpoint_never_get_a_5xx(base, model):
    with LiveGateway(base, model, answer(model, ["ok 🚀"])) as gw:
        @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
        @given(path=PATHS, body=BODIES, headers=HEADERS, compress=st.booleans())
        def check(path, body, headers, compress):
            content = json.dumps(body).encode()
            if compress and headers.get("Content-Encoding") == "gzip":
                content = gzip.compress(content)
            resp = gw.post(path, content=content, headers=headers)
            assert resp.status < 500, (body, headers, resp.text)
            if resp.status >= 400:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

        check()
        after = gw.post("/v1/completions", json={"prompt": "hi"})
        assert after.status == 200 and after.json()["choices"][0]["text"] == "ok 🚀"


def test_readers_of_ended_requests_let_go_of_their_connections(base, model, redis_url):
    # The driver never ends these requests on the bus: only the gateway's own end can stop their readers.
    with LiveGateway(base, model, answer(model, ["one two STOP three"], finish=None)) as gw:
        for _ in range(6):
            gw.post("/v1/completions", json={"prompt": "Go", "stop": "STOP"})
            gw.post("/v1/completions", json={"prompt": "Go", "stop": "STOP", "stream": True})
        client = redis.Redis.from_url(redis_url)
        blocked = lambda: sum("b" in c["flags"] for c in client.client_list())  # noqa: E731
        wait_until(lambda: blocked() <= 1, "readers of ended requests to stop (only the driver's read blocks)")
