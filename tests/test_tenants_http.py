"""Tenants end to end: `pagedserve up` (tiny model, 2 workers) with a keys file and the priority policy, driven with
the official `openai` client. Each key is its tenant's; the file is read again when it changes and on SIGHUP, under
load, losing nothing; a bad file keeps the keys there were; a tenant's queue limits are 429s with a wait; prefix
caches are never shared across tenants; metrics carry the tenant."""
from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_harness import free_port
from up_harness import UpProcess

pytestmark = [pytest.mark.slow, pytest.mark.redis]

KEYS = """
[tenants.interactive]
keys = ["key-interactive"]
weight = 4
max_priority = -10

[tenants.batch]
keys = ["key-batch"]

[tenants.queued]
keys = ["key-queued"]
max_seqs = 1
max_waiting_requests = 1
max_queue_time = 1.5
"""
LONG = 1500  # tokens: a stream that runs while the test does the rest
MODEL = "tiny"  # the tiny model's directory name (tests/conftest.py)
PROMPT = "The paged KV cache keeps every block of a long shared prefix once, and the scheduler finds it by hash. " * 3


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("tenants")
    keys = home / "keys.toml"
    keys.write_text(KEYS)
    port = free_port()
    up = UpProcess.start(["--workers", "2", "--model", str(tiny_model_dir), "--port", str(port), "--redis-port",
                          str(free_port()), "--dtype", "float32", "--api-keys", str(keys), "--scheduling-policy",
                          "priority", "--kv-cache-bytes", str(16 << 20)], home / "up.log")
    try:
        yield up, keys
    finally:
        up.stop()


def client(up: UpProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(up: UpProcess, key: str, **body) -> openai.types.Completion:
    return client(up, key).completions.create(model=MODEL, **({"prompt": "Hi", "max_tokens": 4} | body))


def test_each_key_is_its_tenants_and_an_unknown_one_is_a_401(stack):
    up, _ = stack
    assert complete(up, "key-interactive").usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        complete(up, "key-nobody")


def test_a_priority_past_the_tenants_cap_is_a_400_naming_it(stack):
    up, _ = stack
    assert complete(up, "key-interactive", extra_body={"priority": -10}).usage.completion_tokens == 4
    for key, priority in (("key-interactive", -11), ("key-batch", -1)):
        with pytest.raises(openai.BadRequestError) as caught:
            complete(up, key, extra_body={"priority": priority})
        assert caught.value.body["param"] == "priority" and "more urgent than tenant" in caught.value.body["message"]


def test_prefix_blocks_are_reused_within_a_tenant_and_never_across(stack):
    up, _ = stack
    times, cached = {}, {}
    for name, key in (("first", "key-batch"), ("same tenant", "key-batch"), ("other tenant", "key-interactive"),
                      ("other salt", "key-batch")):
        salt = {"cache_salt": "project-x"} if name == "other salt" else {}
        start = time.perf_counter()
        answer = complete(up, key, prompt=PROMPT, max_tokens=1, extra_body=salt)
        times[name] = time.perf_counter() - start
        cached[name] = answer.usage.prompt_tokens_details.cached_tokens if answer.usage.prompt_tokens_details else 0
    print("\nprefix cache across tenants: cached tokens", cached, "seconds", {k: round(v, 3) for k, v in times.items()})
    assert cached["same tenant"] > 0
    assert cached["first"] == cached["other tenant"] == cached["other salt"] == 0


def streams(up: UpProcess, key: str, count: int, max_tokens: int) -> tuple[list[threading.Thread], list[int]]:
    """`count` streamed completions in threads; each one's received token count lands in the returned list."""
    counts: list[int] = []

    def run() -> None:
        stream = client(up, key).completions.create(model=MODEL, prompt="Count", max_tokens=max_tokens,
                                                     stream=True, extra_body={"ignore_eos": True})
        counts.append(sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text is not None))
    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads, counts


def wait_until(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def works(up: UpProcess, key: str) -> bool:
    try:
        complete(up, key, max_tokens=1)
    except openai.AuthenticationError:
        return False
    return True


def test_keys_changed_under_load_hold_within_a_second_and_no_request_is_lost(stack):
    up, keys = stack
    threads, counts = streams(up, "key-batch", 6, 300)
    keys.write_text(KEYS + '\n[tenants.newcomer]\nkeys = ["key-newcomer"]\n')
    took = wait_until(lambda: works(up, "key-newcomer"), 5, "the new key to work")
    print(f"\nnew key accepted {took:.2f} s after the file changed, under load")
    keys.write_text("[tenants.broken\n")  # a bad edit: the keys there were stay
    time.sleep(1.2)
    assert works(up, "key-newcomer") and works(up, "key-batch")
    assert "is not valid TOML" in up.log() and "keeping the" in up.log()
    for t in threads:
        t.join(120)
    assert counts == [300] * 6, "every stream whole through the reloads"
    keys.write_text(KEYS)
    wait_until(lambda: not works(up, "key-newcomer"), 5, "the removed key to stop working")


def test_sighup_reloads_the_keys_file_even_when_its_change_time_says_nothing(stack):
    up, keys = stack
    before = keys.stat()
    keys.write_text(KEYS.replace("key-batch", "key-bAtch"))  # same size
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    time.sleep(1.2)
    assert works(up, "key-batch"), "the poll saw no change"
    up.kill("gateway", signal.SIGHUP)
    wait_until(lambda: works(up, "key-bAtch"), 5, "SIGHUP to reload the file")
    assert not works(up, "key-batch") and "(SIGHUP)" in up.log()
    keys.write_text(KEYS)
    wait_until(lambda: works(up, "key-batch"), 5, "the file back as it was")


def test_a_tenants_queue_limits_are_429s_with_a_wait_and_the_others_are_served(stack):
    up, _ = stack
    threads, counts = streams(up, "key-queued", 1, LONG)  # takes the tenant's one running sequence
    wait_until(lambda: _tenant_gauge(up, "pagedserve_tenant_running_sequences", "queued") == 1, 30,
               "the tenant's stream to run")
    waited: dict = {}

    def wait_in_queue() -> None:
        try:
            complete(up, "key-queued")
        except openai.RateLimitError as e:
            waited["error"] = e
    queued = threading.Thread(target=wait_in_queue)
    queued.start()
    wait_until(lambda: _tenant_gauge(up, "pagedserve_tenant_waiting_requests", "queued") == 1, 30,
               "the second request to wait")
    with pytest.raises(openai.RateLimitError) as full:
        complete(up, "key-queued")
    assert "tenant queued has 1 requests waiting" in full.value.body["message"]
    assert float(full.value.response.headers["retry-after-ms"]) > 0 and full.value.response.headers["Retry-After"]
    assert complete(up, "key-batch").usage.completion_tokens == 4, "another tenant is served meanwhile"
    queued.join(30)
    assert "past the queue time of 1.5 s" in waited["error"].body["message"]
    assert waited["error"].response.headers["Retry-After"]
    metrics = _metrics(up)
    assert metrics[("pagedserve_time_to_first_token_seconds_count", (("tenant", "batch"),))] >= 1
    assert ("pagedserve_tenant_tokens_last_minute", (("tenant", "queued"),)) in metrics
    for t in threads:
        t.join(120)
    assert counts == [LONG]


def _metrics(up: UpProcess) -> dict:
    with urllib.request.urlopen(up.url + "/metrics") as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _tenant_gauge(up: UpProcess, name: str, tenant: str) -> float:
    return _metrics(up).get((name, (("tenant", tenant),)), -1)
