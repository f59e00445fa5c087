"""The Responses and Messages APIs through their official clients, and streams that outlive what serves them:
`pagedserve up --gateways 2`, a stream's gateway SIGKILLed mid-stream and its client picking the stream up at the
other gateway with `Last-Event-ID`; background responses through a gateway, a scheduler, a worker and Redis
SIGKILLed; the response store's owners, deletions, expiry and bound."""
from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import openai
import pytest
import redis
from up_harness import UpProcess, free_gateway_port, health

from gateway.records import request_id
from shared.keys import Keys

KEYS = ("key-a", "key-b")
BOUND = 24
STREAMS = 6  # of chat and of responses each: twelve streams
TOKENS = 160
GRACE_S = 8.0
BACKGROUND_TOKENS = 900  # each fault lands while the background responses run


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    up = UpProcess.start(["--model", str(tiny_model_dir), "--workers", "2", "--gateways", "2", "--port",
                          str(free_gateway_port(2)), "--dtype", "float32", "--api-key", ",".join(KEYS),
                          "--heartbeat-ttl", "2", "--reconnect-grace", str(GRACE_S), "--max-stored-responses",
                          str(BOUND), "--kv-cache-bytes", str(32 << 20)],
                         tmp_path_factory.mktemp("durable") / "up.log")
    try:
        yield up
    finally:
        up.stop()


def wait_until(done, what: str, up: UpProcess, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s:\n{up.log()[-3000:]}")
        time.sleep(0.2)


def ready(up: UpProcess) -> dict[str, str]:
    """The gateways' URLs once each answers /health with every worker live."""
    urls = up.gateways()
    wait_until(lambda: all(health(u)[0] == 200 and len(health(u)[1]["workers"]) == 2 for u in urls.values()),
               "stack with every gateway and worker up", up)
    return urls


def openai_client(url: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_the_responses_and_messages_clients_work_unchanged(stack):
    url = ready(stack)["gateway"]
    client = openai_client(url)
    whole = client.responses.create(model="tiny", input="Say hello", instructions="Be brief.", max_output_tokens=24,
                                    temperature=0)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 24
    assert client.responses.retrieve(whole.id).output_text == whole.output_text
    events = list(client.responses.create(model="tiny", input="Say hello", instructions="Be brief.",
                                          max_output_tokens=24, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    [listed] = client.responses.input_items.list(whole.id).data
    assert listed.role == "user" and listed.content[0].text == "Say hello"
    later = client.responses.create(model="tiny", input="And again", previous_response_id=whole.id,
                                    max_output_tokens=4, temperature=0)
    assert later.previous_response_id == whole.id and later.usage.input_tokens > whole.usage.input_tokens + 24

    background = client.responses.create(model="tiny", input="Count", max_output_tokens=2000, temperature=0,
                                         background=True, extra_body={"ignore_eos": True})
    assert background.status == "queued"
    assert client.responses.cancel(background.id).status == "cancelled"
    wait_until(lambda: client.responses.retrieve(background.id).status == "cancelled", "cancelled status", stack)
    assert client.responses.retrieve(background.id).usage.output_tokens < 2000

    messages = anthropic.Anthropic(base_url=url, api_key=KEYS[0], max_retries=0)
    # this client no longer types the sampling fields the API still takes: they go as extra body fields
    sent = {"model": "tiny", "max_tokens": 24, "system": "Be brief.", "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "Say hello"}]}
    message = messages.messages.create(**sent)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 24
    with messages.messages.stream(**sent) as streamed:
        assert [b.text for b in streamed.get_final_message().content] == [b.text for b in message.content]
    counted = messages.messages.count_tokens(model="tiny", system="Be brief.",
                                             messages=[{"role": "user", "content": "Say hello"}])
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        messages.messages.create(**sent, stop_sequences="not a list")


# ---- twelve streams, their gateway SIGKILLed -------------------------------------------------------------------

def chat_body(i: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"Story number {i}"}], "max_tokens": TOKENS,
            "temperature": 0.8, "seed": 100 + i, "ignore_eos": True, "stream": True}


def responses_body(i: int) -> dict:
    return {"model": "tiny", "input": f"Story number {i}", "max_output_tokens": TOKENS, "temperature": 0.8,
            "seed": 200 + i, "ignore_eos": True, "stream": True}


def frames(text: str) -> list[dict[str, str]]:
    """Each event's fields (`id`, `event`, `data`)."""
    return [dict(line.split(": ", 1) for line in frame.split("\n")) for frame in text.split("\n\n") if frame]


def text_of(route: str, events: list[dict[str, str]]) -> str:
    out = ""
    for event in events:
        data = event["data"]
        if data == "[DONE]":
            continue
        data = json.loads(data)
        if route == "/v1/chat/completions":
            out += "".join(c["delta"].get("content") or "" for c in data["choices"])
        elif data["type"] == "response.output_text.delta":
            out += data["delta"]
    return out


async def stream(http: httpx.AsyncClient, url: str, body: dict, got: list[dict[str, str]], last: str | None = None,
                 until: asyncio.Event | None = None) -> None:
    """Stream `body` at `url` into `got` (after `last`, if given), until it ends, or its connection breaks."""
    headers = {"Authorization": f"Bearer {KEYS[0]}"} | ({"Last-Event-ID": last} if last else {})
    buffer = ""
    try:
        async with http.stream("POST", url, json=body, headers=headers) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for chunk in resp.aiter_text():
                buffer += chunk
                done, _, buffer = buffer.rpartition("\n\n")
                got.extend(frames(done))
                if until is not None and len(got) >= 8:
                    until.set()
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the gateway died mid-stream


def test_twelve_streams_whose_gateway_is_killed_are_picked_up_at_the_other_one_each_event_once(stack):
    urls = ready(stack)
    first, second = urls["gateway"], urls["gateway-1"]
    calls = [("/v1/chat/completions", chat_body(i)) for i in range(STREAMS)] + \
        [("/v1/responses", responses_body(i)) for i in range(STREAMS)]

    async def run() -> tuple[list[list[dict]], list[list[dict]], list[list[dict]]]:
        async with httpx.AsyncClient(timeout=120) as http:
            clean = [[] for _ in calls]
            await asyncio.gather(*(stream(http, second + route, body, got)
                                   for (route, body), got in zip(calls, clean)))
            before = [[] for _ in calls]
            begun = [asyncio.Event() for _ in calls]
            tasks = [asyncio.create_task(stream(http, first + route, body, got, until=b))
                     for (route, body), got, b in zip(calls, before, begun)]
            await asyncio.wait_for(asyncio.gather(*(b.wait() for b in begun)), 120)
            assert not any(t.done() for t in tasks), "the gateway must die mid-stream"
            stack.kill("gateway")
            await asyncio.gather(*tasks)
            after = [[] for _ in calls]
            await asyncio.gather(*(stream(http, second + route, body, got, last=got_before[-1]["id"])
                                   for (route, body), got, got_before in zip(calls, after, before)))
            return clean, before, after

    clean, before, after = asyncio.run(run())
    for (route, _), whole, head, tail in zip(calls, clean, before, after):
        # an id counts the events before it: the same counts, in order, as the fault-free stream's
        assert [e["id"].partition(":")[2] for e in head + tail] == [e["id"].partition(":")[2] for e in whole], route
        assert text_of(route, head + tail) == text_of(route, whole) and len(text_of(route, whole)) > 0, route
    assert sum(len(head) < len(whole) for whole, head in zip(clean, before)) == len(calls), "every stream was cut"


def test_a_messages_and_a_completions_stream_cut_short_are_picked_up_with_last_event_id(stack):
    urls = ready(stack)
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    cases = [("/v1/messages", {"model": "tiny", "max_tokens": 40, "temperature": 0, "stream": True,
                               "messages": [{"role": "user", "content": "Hi"}]}),
             ("/v1/completions", {"model": "tiny", "prompt": ["One", "Two"], "max_tokens": 30, "temperature": 0,
                                  "stream": True, "stream_options": {"include_usage": True}})]
    for route, body in cases:
        whole = frames(httpx.post(urls["gateway"] + route, json=body, headers=headers, timeout=60).text)
        with httpx.stream("POST", urls["gateway"] + route, json=body, headers=headers, timeout=60) as resp:
            head, buffer = [], ""
            for chunk in resp.iter_text():
                buffer += chunk
                done, _, buffer = buffer.rpartition("\n\n")
                head.extend(frames(done))
                if len(head) >= 7:
                    break
        tail = frames(httpx.post(urls["gateway-1"] + route, json=body, timeout=60,
                                 headers=headers | {"Last-Event-ID": head[-1]["id"]}).text)
        # Two prompts' events interleave as their tokens come, in any order: each choice's own events, in order,
        # are the fault-free stream's, and so are the events after every choice's.
        assert by_choice(head + tail) == by_choice(whole) and len(head) < len(whole), route
    wrong = httpx.post(urls["gateway-1"] + "/v1/completions", json=cases[1][1], timeout=60,
                       headers={"Authorization": f"Bearer {KEYS[1]}", "Last-Event-ID": head[-1]["id"]})
    assert wrong.status_code == 404, "another key's stream is not found"


def by_choice(events: list[dict[str, str]]) -> dict[int | None, list[str]]:
    """Each completion choice's events' data, in order (None: events of no choice)."""
    out: dict[int | None, list[str]] = {}
    for event in events:
        call_id = event["id"].partition(":")[0]  # the call's own id and time, which another call has its own of
        data = json.loads(event["data"].replace(call_id, "")) if event["data"] != "[DONE]" else {}
        data.pop("created", None)
        for index in [c["index"] for c in data.get("choices", ())] or [None]:
            out.setdefault(index, []).append(json.dumps(data))
    return out


# ---- background responses through faults ------------------------------------------------------------------------

def create_background(client: openai.OpenAI, i: int) -> str:
    return client.responses.create(model="tiny", input=f"Background story {i}", max_output_tokens=BACKGROUND_TOKENS,
                                   temperature=0.8, background=True,
                                   extra_body={"seed": 300 + i, "ignore_eos": True}).id


def running(client: openai.OpenAI, ids: list[str]) -> dict[str, object]:
    """The responses as they stand now; none while a gateway or Redis restarts."""
    try:
        return {i: client.responses.retrieve(i) for i in ids}
    except (openai.APIConnectionError, openai.InternalServerError):
        return {}


def finished(client: openai.OpenAI, ids: list[str], up: UpProcess) -> dict[str, object]:
    got: dict[str, object] = {}

    def ended() -> bool:
        got.update(running(client, ids))
        return len(got) == len(ids) and all(r.status not in ("queued", "in_progress") for r in got.values())

    wait_until(ended, "end of every background response", up)
    return got


def replayed_text(url: str, response_id: str, after: int | None = None) -> tuple[list[int], str]:
    params = {"stream": "true"} | ({"starting_after": after} if after is not None else {})
    with httpx.stream("GET", f"{url}/v1/responses/{response_id}", params=params,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=60) as resp:
        body = resp.read().decode()
        assert resp.status_code == 200, body
        events = [json.loads(f["data"]) for f in frames(body)]
    return ([e["sequence_number"] for e in events],
            "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"))


def test_twelve_background_responses_finish_through_a_gateway_a_scheduler_a_worker_and_redis_killed(stack):
    urls = ready(stack)
    survivor = openai_client(urls["gateway-1"])
    clean = finished(survivor, [create_background(survivor, i) for i in range(12)], stack)
    ids = [create_background(openai_client(urls["gateway"]), i) for i in range(12)]
    for child in ("gateway", "scheduler", "worker-0", "redis-server"):
        time.sleep(1.0)
        wait_until(lambda: any(r.status == "in_progress" for r in running(survivor, ids).values()),
                   f"response in progress to kill the {child} under", stack)
        old = stack.kill(child)
        wait_until(lambda: stack.pids()[child] != old, f"restart of {child}", stack)
    ready(stack)
    faulted = finished(survivor, ids, stack)
    for want, got in zip(clean.values(), faulted.values()):
        assert got.status == want.status == "incomplete" and got.usage.output_tokens == BACKGROUND_TOKENS
        assert got.output_text == want.output_text
        sequence, replay = replayed_text(urls["gateway"], got.id)
        assert sequence == list(range(len(sequence))) and replay == got.output_text
        cut = len(sequence) // 3
        tail, _ = replayed_text(urls["gateway-1"], got.id, cut)
        assert tail == sequence[cut + 1:]


# ---- the store --------------------------------------------------------------------------------------------------

def test_expired_deleted_and_other_keys_responses_are_404_and_the_store_keeps_its_bound(stack):
    urls = ready(stack)
    mine, theirs = openai_client(urls["gateway"]), openai_client(urls["gateway-1"], KEYS[1])
    r = redis.Redis.from_url(stack.redis_url())
    keys = Keys()
    made = []
    for i in range(3 * BOUND):  # a soak of the store: it keeps its bound all along, records and streams alike
        # (greedy: a sampled EOS in the first two tokens would end the latest one `completed`)
        made.append(mine.responses.create(model="tiny", input=f"n{i}", max_output_tokens=2, temperature=0).id)
        assert r.zcard(keys.responses) <= BOUND and len(r.keys(keys.response("*"))) <= BOUND
    for old in made[:2 * BOUND]:
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(old)
        assert not r.exists(keys.out(request_id(old))), "an evicted response's stream goes with it"
    latest = made[-1]
    assert mine.responses.retrieve(latest).status == "incomplete"
    assert 0 < r.pttl(keys.response(latest)) <= 86400 * 1000
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(latest)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(latest)
    mine.responses.delete(made[-2])
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(made[-2])
    r.pexpire(keys.response(made[-3]), 1)  # what the TTL does at its end, now
    time.sleep(0.05)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve(made[-3])
    with pytest.raises(openai.NotFoundError):
        mine.responses.create(model="tiny", input="go on", previous_response_id=made[-3], max_output_tokens=2)
