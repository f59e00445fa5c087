"""End to end: `pagedserve up` (tiny model, 2 workers, its own Redis) driven with the official `openai`
client. Greedy output is checked against transformers' generate on the same weights in float32."""
from __future__ import annotations

import asyncio
import http.client
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from redis_harness import free_port
from test_gateway_http import BODIES, PATHS
from test_gateway_logprobs import (
    lm_eval_generate_body, lm_eval_loglikelihood_body, lm_eval_parse_generations, lm_eval_parse_logprobs,
)
from up_harness import UpProcess, run_up

from shared.keys import Keys

pytestmark = [pytest.mark.slow, pytest.mark.redis]
KEY = "test-key"
BODY_LIMIT = 64 << 10
MAX_WAITING = 2


def test_up_without_redis_server_says_how_to_get_one(tiny_model_dir):
    bare_path = str(Path(sys.executable).parent)  # python, but no redis-server
    out = run_up("--model", str(tiny_model_dir), env={"PATH": bare_path})
    assert out.returncode == 1 and out.stdout == ""
    assert "redis-server was not found" in out.stderr and "--redis-url" in out.stderr
    assert "apt-get install redis-server" in out.stderr


def test_up_writes_the_tiny_model_on_first_use(tmp_path):
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    out = run_up("--model", "tiny", "--redis-url", dead_redis, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 1 and f"no Redis answers at {dead_redis}" in out.stderr
    assert (tmp_path / "pagedserve" / "pagedserve-tiny-llama" / "config.json").is_file()
    assert "writing the built-in tiny model" in out.stderr


@dataclass(slots=True)
class Stack:
    up: UpProcess
    redis_url: str

    @property
    def url(self) -> str:
        return self.up.url

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def raw(self, method: str, path: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, dict, str]:
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json"}
                                     | ({"Authorization": f"Bearer {key}"} if key else {}))
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read().decode()

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = self.raw("GET", "/metrics")[2]
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    port = free_port()
    up = UpProcess.start(["--workers", "2", "--model", str(tiny_model_dir), "--port", str(port), "--redis-port",
                   str(free_port()), "--dtype", "float32", "--api-key", KEY, "--max-body-bytes", str(BODY_LIMIT),
                   "--max-waiting-requests", str(MAX_WAITING), "--heartbeat-ttl", "2", "--reconnect-grace", "1",
                   "--kv-cache-bytes", str(16 << 20), "--swap-space-bytes", str(16 << 20)],
                   tmp_path_factory.mktemp("stack") / "up.log")
    try:
        assert up.url == f"http://127.0.0.1:{port}", up.url
        yield Stack(up, up.redis_url())
        assert up.lines.empty(), "`pagedserve up` prints exactly one line on stdout"
    finally:
        up.stop()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True, dtype=torch.float32)
    return tok, model.eval()


def greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (stopping at the model's EOS ids, as the server does)."""
    import torch

    tok, model = hf
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def logprobs_of(hf, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    import torch

    _, model = hf
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


PROMPT = "The blocks of a sequence"


def test_greedy_completion_equals_transformers_and_counts_usage(stack, hf):
    tok = hf[0]
    prompt_ids = tok(PROMPT).input_ids
    expected = greedy(hf, prompt_ids, 16)
    resp = stack.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    choice = resp.choices[0]
    assert choice.text == tok.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(expected) == 16 else "stop")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(prompt_ids), len(expected))
    assert resp.usage.total_tokens == len(prompt_ids) + len(expected)
    by_ids = stack.client().completions.create(model="tiny", prompt=prompt_ids, max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_streamed_text_equals_the_whole_response(stack):
    client = stack.client()
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.text for ch in chunks for c in ch.choices) == whole.choices[0].text
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for ch in chunks for c in ch.choices]) == whole.usage.completion_tokens, "an event per token"


def test_chat_greedy_equals_transformers_streamed_and_not(stack, hf):
    tok = hf[0]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, 東京 🚀?"}]
    prompt_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids
    expected = tok.decode(greedy(hf, prompt_ids, 12), skip_special_tokens=True)
    client = stack.client()
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(prompt_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == expected


def test_n_samples_and_seeded_sampling_is_reproducible(stack):
    client = stack.client()
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.95, seed=1234)
    first = client.completions.create(n=2, **kw)
    again = client.completions.create(n=2, **kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == again.usage.completion_tokens
    streamed = ["", ""]
    for chunk in client.completions.create(n=2, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in first.choices]


def test_stop_string_ends_the_text_before_it(stack, hf):
    tok = hf[0]
    full = tok.decode(greedy(hf, tok(PROMPT).input_ids, 24), skip_special_tokens=True)
    candidates = [full[i:i + 2] for i in range(len(full) // 3, len(full) - 2)
                  if full[i:i + 2].isprintable() and "\ufffd" not in full[i:i + 2]]
    assert candidates, f"the greedy text {full!r} has no printable pair to stop on"
    stop = candidates[0]
    client = stack.client()
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].text == full[:full.find(stop)]
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.text for ch in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24,
                                                                   temperature=0, stop=stop, stream=True)
                       for c in ch.choices)
    assert streamed == full[:full.find(stop)]


def test_echo_prepends_the_prompt(stack):
    client = stack.client()
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_logprobs_match_transformers(stack, hf):
    tok = hf[0]
    prompt_ids = tok(PROMPT).input_ids
    expected = greedy(hf, prompt_ids, 8)
    resp = stack.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    for token_id, token in zip(expected, lp.tokens):  # a token that ends mid-character keeps its bytes
        text = tok.decode([token_id])
        assert token == text if "\ufffd" not in text else token.startswith("bytes:")
    assert lp.token_logprobs == pytest.approx(logprobs_of(hf, prompt_ids, expected), abs=2e-3)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Top entries are keyed by text, so tokens that decode alike (e.g. partial UTF-8) share one key.
        assert 1 <= len(top) <= 4 and chosen == pytest.approx(max(top.values()), abs=1e-6), "greedy: the argmax"
    chat = stack.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)


def error_of(e: openai.APIStatusError) -> dict:
    error = e.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_validation_errors_auth_and_body_limit(stack, hf):
    client = stack.client()
    cases = [(dict(temperature=5), "temperature", "[0.0, 2.0]"), (dict(top_p=0), "top_p", "(0, 1]"),
             (dict(n=0), "n", "n must be"), (dict(max_tokens=0), "max_tokens", "at least 1"),
             (dict(logprobs=50), "logprobs", "[0, 20]"), (dict(presence_penalty=9), "presence_penalty", "[-2.0, 2.0]"),
             (dict(prompt=""), "prompt", "empty"), (dict(stop=[""]), "stop", "non-empty")]
    for extra, param, fragment in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**({"model": "tiny", "prompt": "hi"} | extra))
        error = error_of(e.value)
        assert e.value.status_code == 400 and error["param"] == param and fragment in error["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi")
    assert error_of(e.value)["param"] == "model"
    n_prompt = len(hf[0](PROMPT).input_ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2048)
    message = error_of(e.value)["message"]
    assert "2048 tokens" in message and f"{n_prompt + 2048} tokens" in message
    assert f"({n_prompt} in the prompt, 2048 in the completion)" in message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0).models.list()
    status, _, body = stack.raw("POST", "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    status, _, body = stack.raw("POST", "/v1/completions", json.dumps({"prompt": "x" * BODY_LIMIT}).encode())
    assert status == 413 and str(BODY_LIMIT) in json.loads(body)["error"]["message"]
    status, _, _ = stack.raw("GET", "/v1/models", key=None)
    assert status == 401
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_a_burst_past_the_waiting_limit_gets_429_with_retry_after(stack):
    # Long prompts, distinct from their first token (no prefix-cache hit): each takes real prefill time,
    # so a burst cannot be served as fast as it arrives.
    prompts = [f"{i} " + "The blocks of a sequence need not be contiguous. " * 60 for i in range(24)]

    async def burst() -> list[object]:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(client.completions.create(model="tiny", prompt=p, max_tokens=4,
                                                                    temperature=0) for p in prompts),
                                        return_exceptions=True)
        finally:
            await client.close()

    results = asyncio.run(burst())
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert limited, "24 long requests at once against a limit of 2 waiting must see 429s"
    waits = [int(r.response.headers["retry-after-ms"]) for r in limited]
    assert all(0 < ms <= 60_000 and int(r.response.headers["retry-after"]) == -(-ms // 1000)
               for ms, r in zip(waits, limited))
    assert len(limited) < 3 or len(set(waits)) > 1, f"jitter spreads the retries: {waits}"
    assert all(not isinstance(r, Exception) or isinstance(r, openai.RateLimitError) for r in results), results
    assert any(not isinstance(r, Exception) for r in results)


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)
    return result


def idle(stack: Stack) -> bool:
    m = stack.metrics()
    usage = [v for (name, _), v in m.items() if name == "pagedserve_kv_cache_usage_perc"]
    return m.get(("pagedserve_num_requests_running", ())) == 0 and usage and all(v == 0 for v in usage)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(stack):
    wait_for(lambda: idle(stack), "an idle stack before the test")
    host, port = stack.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}",
                                                               "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"id: ")
    first = json.loads(resp.readline().decode().removeprefix("data: "))
    resp.readline()
    wait_for(lambda: not idle(stack), "the long request to show as running, holding KV blocks")
    conn.close()
    wait_for(lambda: idle(stack), "running requests and KV usage back to zero")
    out = redis.Redis.from_url(stack.redis_url).xlen(Keys().out(first["id"] + "-0"))
    assert out < 1500, "the request was aborted, not run to its end"


def test_fuzzed_bodies_never_get_a_5xx_and_the_stack_still_answers(stack):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=PATHS, body=BODIES)
    def check(path, body):
        if isinstance(body, dict):  # keep valid requests short on a CPU
            body.setdefault("max_tokens", 4)
            body.setdefault("max_completion_tokens", 4)
        status, _, text = stack.raw("POST", path, json.dumps(body).encode())
        assert status < 500, (body, text)

    check()
    resp = stack.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert resp.usage.completion_tokens >= 1


def test_tokenizer_endpoints_round_trip_with_the_models_own_tokenizer(stack, hf):
    tok = hf[0]
    text = "The blocks of a sequence, 東京 🚀"
    status, _, body = stack.raw("POST", "/tokenize", json.dumps({"prompt": text, "add_special_tokens": False}).encode())
    assert status == 200 and json.loads(body)["tokens"] == tok(text, add_special_tokens=False).input_ids
    ids = json.loads(body)["tokens"]
    status, _, body = stack.raw("POST", "/detokenize", json.dumps({"tokens": ids}).encode())
    assert status == 200 and json.loads(body) == {"prompt": text}
    status, _, body = stack.raw("GET", "/tokenizer_info")
    assert status == 200 and json.loads(body)["eos_token"] == tok.eos_token
    assert stack.raw("GET", "/tokenizer_info", key=None)[0] == 401, "the API key guards it"


def prompt_logprobs_of(hf, ids: list[int]) -> tuple[list[float], list[bool]]:
    """transformers' log-softmax of each prompt token after the first, and whether it is the argmax."""
    import torch

    _, model = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, -1)
    targets = torch.tensor(ids[1:])
    return (logprobs.gather(1, targets[:, None])[:, 0].tolist(), (logits.argmax(-1) == targets).tolist())


def test_prompt_logprobs_equal_transformers_on_both_endpoints(stack, hf):
    tok = hf[0]
    ids = tok(PROMPT).input_ids
    want, _ = prompt_logprobs_of(hf, ids)
    client = stack.client()
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == PROMPT and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-3)
    vllm = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    got = vllm.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and [p[str(t)]["logprob"] for p, t in zip(got[1:], ids[1:])] == pytest.approx(want, abs=2e-3)
    messages = [{"role": "user", "content": "Hello, 東京 🚀?"}]
    chat_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    got = chat.model_extra["prompt_logprobs"]
    assert [p[str(t)]["logprob"] for p, t in zip(got[1:], chat_ids[1:])] == \
        pytest.approx(prompt_logprobs_of(hf, chat_ids)[0], abs=2e-3)


def test_lm_eval_loglikelihood_rolling_and_generate_until_against_the_stack(stack, hf):
    tok = hf[0]
    context = tok("The blocks of a sequence need", add_special_tokens=False).input_ids
    continuations = [tok(t, add_special_tokens=False).input_ids for t in (" not be contiguous", " a block table")]
    prompts = [context + c for c in continuations]
    status, _, body = stack.raw("POST", "/v1/completions",
                                json.dumps(lm_eval_loglikelihood_body("tiny", prompts)).encode())
    assert status == 200, body
    got = lm_eval_parse_logprobs(json.loads(body), [len(context)] * 2)
    for (total, is_greedy), ids in zip(got, prompts):
        lps, argmax = prompt_logprobs_of(hf, ids)
        assert total == pytest.approx(sum(lps[len(context) - 1:]), abs=1e-2)
        assert is_greedy == all(argmax[len(context) - 1:])
    rolling = tok("PagedAttention divides the key value cache of each sequence into blocks.",
                  add_special_tokens=False).input_ids
    window = [tok.bos_token_id] + rolling  # lm-eval's first rolling window: the prefix token, then the text
    status, _, body = stack.raw("POST", "/v1/completions",
                                json.dumps(lm_eval_loglikelihood_body("tiny", [window])).encode())
    ((total, _),) = lm_eval_parse_logprobs(json.loads(body), [1])
    assert total == pytest.approx(sum(prompt_logprobs_of(hf, window)[0]), abs=1e-2)
    status, _, body = stack.raw("POST", "/v1/completions",
                                json.dumps(lm_eval_generate_body("tiny", [context], ["\n\n"], 8)).encode())
    full = tok.decode(greedy(hf, context, 8), skip_special_tokens=True)
    assert lm_eval_parse_generations(json.loads(body)) == [full.split("\n\n")[0]]


def test_a_prefix_cache_hit_shows_as_cached_tokens(stack):
    prompt = "9 " + "The blocks of a sequence need not be contiguous. " * 8
    client = stack.client()
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_beam_search_returns_transformers_best_beams_on_both_endpoints(stack, hf):
    import torch

    tok, model = hf
    prompt_ids = tok(PROMPT).input_ids
    eos = set(model.generation_config.eos_token_id)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), num_beams=3, num_return_sequences=2, max_new_tokens=12,
                             do_sample=False, length_penalty=0.5, pad_token_id=tok.pad_token_id)
    expected = []
    for row in out[:, len(prompt_ids):].tolist():
        cut = next((k for k, t in enumerate(row) if t in eos), len(row))
        expected.append(tok.decode(row[:cut], skip_special_tokens=True))
    client = stack.client()
    got = client.completions.create(model="tiny", prompt=prompt_ids, n=2, best_of=3, max_tokens=12,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.text for c in got.choices] == expected and [c.index for c in got.choices] == [0, 1]
    scores = [c.model_extra["cumulative_logprob"] for c in got.choices]
    assert all(s < 0 for s in scores)
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
    chat = client.chat.completions.create(model="tiny", messages=messages, n=1, max_tokens=12,
                                          extra_body={"use_beam_search": True, "best_of": 3})
    beams = model.generate(torch.tensor([chat_ids]), num_beams=3, max_new_tokens=12, do_sample=False,
                           pad_token_id=tok.pad_token_id)[0, len(chat_ids):].tolist()
    cut = next((k for k, t in enumerate(beams) if t in eos), len(beams))
    assert chat.choices[0].message.content == tok.decode(beams[:cut], skip_special_tokens=True)
    deadline = time.monotonic() + 10  # the scheduler's snapshot comes with its next tick
    while (sum(v for (name, _), v in stack.metrics().items() if name == "pagedserve_sequence_forks_total") == 0
           and time.monotonic() < deadline):
        time.sleep(0.2)
    metrics = stack.metrics()
    for name in ("pagedserve_sequence_forks_total", "pagedserve_kv_block_copies_total"):
        assert sum(v for (key, _), v in metrics.items() if key == name) > 0, f"beams fork and copy: {name}"
    for body in ({"use_beam_search": True, "stream": True}, {"best_of": 3, "stream": True},
                 {"use_beam_search": True, "seed": 3}, {"length_penalty": 2.0}, {"best_of": 1, "n": 2}):
        status, _, text = stack.raw("POST", "/v1/completions", json.dumps({"prompt": "hi", **body}).encode())
        assert status == 400, (body, text)


def test_logit_bias_through_the_client_steers_the_stack_as_it_does_transformers(stack, hf):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    tok, model = hf
    prompt_ids = tok(PROMPT).input_ids
    bias = {"17": 3.0, "40": -2.0, "300": 4.5}

    class Bias(LogitsProcessor):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            for token, value in bias.items():
                scores[:, int(token)] += value
            return scores

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=12, do_sample=False,
                             pad_token_id=tok.pad_token_id, logits_processor=LogitsProcessorList([Bias()]))
    expected = tok.decode(out[0, len(prompt_ids):], skip_special_tokens=True)
    got = stack.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                            logit_bias=bias)
    assert got.choices[0].text == expected
    forced = stack.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5, temperature=0, logit_bias={"17": 100})
    assert forced.choices[0].message.content == tok.decode([17] * 5)


def test_the_client_retrieves_the_served_model_and_a_missing_one_is_404(stack):
    client = stack.client()
    served = client.models.retrieve("tiny")
    assert (served.id, served.object, served.owned_by) == ("tiny", "model", "pagedserve")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert error_of(e.value)["code"] == "model_not_found" and "gpt-9" in error_of(e.value)["message"]


def test_best_of_returns_the_most_likely_of_its_samples(stack):
    client = stack.client()
    body = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **body)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(n=1, best_of=4, **body)
    (choice,) = best.choices
    assert choice.text == every.choices[totals.index(max(totals))].text and choice.logprobs is None
    assert abs(choice.model_extra["cumulative_logprob"] - max(totals)) < 1e-4
    assert best.usage.completion_tokens == every.usage.completion_tokens, "all four were generated"


# Last in this module: it stops the stack the tests above share.
def test_sigterm_stops_the_whole_stack_cleanly(stack):
    children = stack.up.pids()
    stack.up.proc.send_signal(signal.SIGTERM)
    assert stack.up.proc.wait(120) == 0
    for name, pid in children.items():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
            f"{name} (pid {pid}) outlived `pagedserve up`"
