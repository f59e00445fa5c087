"""`pagedserve up --gateways 2`: two gateways of one stack, each on its own port, answering alike from the same
worker; one SIGKILLed is restarted by the launcher while the other keeps serving."""
from __future__ import annotations

import time

import openai
import pytest
from redis_harness import free_port
from up_harness import UpProcess, free_gateway_port, health

pytestmark = [pytest.mark.slow, pytest.mark.redis]
MAX_TOKENS = 8


def complete(url: str) -> str:
    """The greedy completion of one fixed prompt through the gateway at `url`."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.completions.create(model="tiny", prompt="Hello", max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == MAX_TOKENS
    return response.choices[0].text


def test_two_gateways_answer_alike_and_a_killed_one_is_restarted_while_the_other_serves(tiny_model_dir, tmp_path):
    port = free_gateway_port(2)
    up = UpProcess.start(["--gateways", "2", "--workers", "1", "--model", str(tiny_model_dir), "--port", str(port),
                          "--redis-port", str(free_port())], tmp_path / "up.log")
    try:
        gateways = up.gateways()
        assert gateways == {"gateway": f"http://127.0.0.1:{port}", "gateway-1": f"http://127.0.0.1:{port + 1}"}
        assert [health(url)[0] for url in gateways.values()] == [200, 200]
        text = complete(gateways["gateway"])
        assert complete(gateways["gateway-1"]) == text
        old = up.kill("gateway-1")
        assert complete(gateways["gateway"]) == text
        deadline = time.monotonic() + 60
        while not (up.pids()["gateway-1"] != old and health(gateways["gateway-1"])[0] == 200):
            if time.monotonic() > deadline:
                raise AssertionError(f"gateway-1 did not come back:\n{up.log()[-3000:]}")
            time.sleep(0.2)
        assert "gateway-1 exited (exit code -9); restarting it" in up.log()
        assert complete(gateways["gateway-1"]) == text
        assert up.lines.empty(), "`pagedserve up` prints exactly one line on stdout"
    finally:
        assert up.stop() == 0
