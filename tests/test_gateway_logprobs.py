"""Logprobs through the gateway, against a real Redis with the test driver playing the scheduler and worker
(tests/test_gateway_http.py): the prompt's logprobs (`echo` with `logprobs`, `max_tokens` 0, vLLM's
`prompt_logprobs`) in the shapes clients read, lm-eval's own request bodies read the way lm-eval reads the
answers, and logprob tokens that are no whole characters on their own. The numbers are the driver's
(`prompt_logprobs_of`); tests/test_openai_api.py checks real ones against transformers."""
from __future__ import annotations

import json
from operator import itemgetter

from test_gateway_http import (  # noqa: F401  (base and model are fixtures)
    HI, LiveGateway, answer, base, bytes_of, check_error, model, prompt_logprobs_of, sse_events, tokens,
)

from gateway.model import ServedModel
from shared.protocol import Request, TokenOutput


def expected_prompt_logprobs(ids: list[int], k: int) -> tuple[list[float | None], list[bool]]:
    """The driver's prompt logprobs as a completion shows them: token_logprobs (None first), and per token
    whether it is the likeliest (lm-eval's greedy)."""
    plps = prompt_logprobs_of(ids, k)
    return [None] + [p.logprob for p in plps], [True] + [p.rank == 1 for p in plps]


def test_echo_with_logprobs_starts_each_choice_with_its_prompts_logprobs(base, model):
    generated = "ok then"
    text_prompt, id_prompt = "The blocks 🚀 move", tokens(model, "Paged 東京 attention")
    body = {"prompt": [text_prompt, id_prompt], "echo": True, "logprobs": 2, "max_tokens": 5, "n": 2}
    with LiveGateway(base, model, answer(model, [generated])) as gw:
        whole = gw.post("/v1/completions", json=body).json()
        streamed = gw.post("/v1/completions", json=body | {"stream": True})
        req = gw.driver.requests[0]
    assert (req.params.prompt_logprobs, req.params.logprobs, req.params.max_tokens) == (2, 2, 5)
    echoed = [text_prompt, model.tokenizer.decode(id_prompt, skip_special_tokens=False)]
    gen_ids = tokens(model, generated)
    for choice in whole["choices"]:
        i = choice["index"] // 2
        ids = model.tokenizer.encode(text_prompt) if i == 0 else id_prompt
        lp = choice["logprobs"]
        assert choice["text"] == echoed[i] + generated
        assert len(lp["tokens"]) == len(ids) + len(gen_ids)
        want, greedy = expected_prompt_logprobs(ids, 2)
        assert lp["token_logprobs"] == want + [-0.25 * (j + 1) for j in range(len(gen_ids))]
        assert lp["top_logprobs"][0] is None
        for chosen, top, is_greedy in zip(lp["token_logprobs"][1:len(ids)], lp["top_logprobs"][1:], greedy[1:]):
            assert (max(top.values()) == chosen) == is_greedy
            assert chosen in top.values() and len(top) <= 3
        assert b"".join(map(bytes_of, lp["tokens"])) == (echoed[i] + generated).encode()
        assert_offsets_index_the_text(model, ids + gen_ids, lp["text_offset"], choice["text"])
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    per_choice: dict[int, list[dict]] = {}
    for c in chunks:
        for ch in c["choices"]:
            per_choice.setdefault(ch["index"], []).append(ch)
    assert sorted(per_choice) == [0, 1, 2, 3]
    for index, parts in per_choice.items():
        whole_choice = whole["choices"][index]
        assert parts[0]["text"] == echoed[index // 2], "the echo comes first, with the prompt's logprobs"
        assert "".join(p["text"] for p in parts) == whole_choice["text"]
        for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
            assert [x for p in parts for x in p["logprobs"][field]] == whole_choice["logprobs"][field], field


def assert_offsets_index_the_text(model: ServedModel, ids: list[int], offsets: list[int], text: str) -> None:
    """Each token starts where the text of the tokens before it ends (whole characters only)."""
    assert len(offsets) == len(ids)
    for i, offset in enumerate(offsets):
        before = model.tokenizer.decode(ids[:i], skip_special_tokens=False).rstrip("\ufffd")
        assert text.startswith(before) and offset == len(before), (i, offset, before)


def test_max_tokens_0_with_echo_answers_the_prompt_alone(base, model):
    prompt = "Hello, world"
    ids = model.tokenizer.encode(prompt)
    with LiveGateway(base, model, answer(model, ["never shown"])) as gw:
        plain = gw.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 0}).json()
        scored = gw.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 0})
        streamed = gw.post("/v1/completions", json={"prompt": prompt, "echo": True, "max_tokens": 0,
                                                    "logprobs": 1, "stream": True})
        check_error(gw.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0}), 400, "max_tokens")
        sent = [r.params.max_tokens for r in gw.driver.requests]
    assert sent == [1, 1, 1], "the bus makes one token, which the answer drops"
    for body in (plain, scored.json()):
        (choice,) = body["choices"]
        assert (choice["text"], choice["finish_reason"]) == (prompt, "length")
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert plain["choices"][0]["logprobs"] is None
    lp = scored.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == expected_prompt_logprobs(ids, 0)[0]
    assert lp["top_logprobs"][1:] == [{t: v} for t, v in zip(lp["tokens"][1:], lp["token_logprobs"][1:])]
    parts = [ch for e in sse_events(streamed.text)[:-1] for ch in json.loads(e)["choices"]]
    assert "".join(p["text"] for p in parts) == prompt and parts[-1]["finish_reason"] == "length"
    assert [x for p in parts for x in p["logprobs"]["token_logprobs"]] == lp["token_logprobs"]


def test_vllm_prompt_logprobs_on_completion_choices_and_on_the_chat_response(base, model):
    prompt = "The blocks of a sequence"
    with LiveGateway(base, model, answer(model, ["ok"])) as gw:
        completion = gw.post("/v1/completions", json={"prompt": [prompt, "Hi"], "prompt_logprobs": 3}).json()
        chat = gw.post("/v1/chat/completions", json={"messages": HI, "prompt_logprobs": 0, "n": 2}).json()
        asked = [r.params.prompt_logprobs for r in gw.driver.requests]
    assert asked == [3, 3, 0]

    def vllm_shape(ids: list[int], k: int) -> list:
        out: list = [None]
        for t, p in zip(ids[1:], prompt_logprobs_of(ids, k)):
            entry = {str(t): {"logprob": p.logprob, "rank": p.rank, "decoded_token": model.tokenizer.token_text(t)}}
            for rank, (u, lp) in enumerate(p.top, 1):
                entry.setdefault(str(u), {"logprob": lp, "rank": rank, "decoded_token": model.tokenizer.token_text(u)})
            out.append(entry)
        return out

    for choice, text in zip(completion["choices"], [prompt, "Hi"]):
        assert choice["prompt_logprobs"] == vllm_shape(model.tokenizer.encode(text), 3)
        assert choice["logprobs"] is None
    chat_ids = model.tokenizer.render_chat(HI).token_ids
    assert chat["prompt_logprobs"] == vllm_shape(chat_ids, 0)
    assert all("prompt_logprobs" not in c for c in chat["choices"])


def test_a_first_token_without_the_prompt_logprobs_asked_for_fails_the_request(base, model):
    def forgetful(req: Request) -> list[TokenOutput]:
        return [TokenOutput(req.rid, 0, 0, 5, finish_reason="length")]

    with LiveGateway(base, model, forgetful) as gw:
        resp = gw.post("/v1/completions", json={"prompt": "hi there", "echo": True, "logprobs": 1, "max_tokens": 1})
    check_error(resp, 500, None, "sent no prompt logprobs")


def partial_utf8_script(model: ServedModel, text: str):
    """The tokens of `text`, each step's top listing every token of the text: many of them are no whole
    character alone, and would all read U+FFFD."""
    ids = tokens(model, text)

    def script(req: Request) -> list[TokenOutput]:
        def top(t: int) -> list[tuple[int, float]]:
            rivals = [(u, -1.0 - j / 16) for j, u in enumerate(dict.fromkeys(ids)) if u != t]
            return ([(t, -0.5)] + rivals)[:req.params.logprobs]

        return [TokenOutput(req.rid, 0, i, t, logprob=-0.5, top_logprobs=top(t),
                            finish_reason="length" if i == len(ids) - 1 else None) for i, t in enumerate(ids)]
    return script


def test_a_token_that_is_an_incomplete_utf8_sequence_keeps_its_bytes(base, model):
    text = "🚀 東京 ok"
    ids = tokens(model, text)
    assert any(model.tokenizer.decode([t]).endswith("\ufffd") for t in ids), "the text splits characters"
    with LiveGateway(base, model, partial_utf8_script(model, text)) as gw:
        completion = gw.post("/v1/completions", json={"prompt": "Say", "max_tokens": 40, "logprobs": 5}).json()
        chat = gw.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 40, "logprobs": True,
                                                     "top_logprobs": 5}).json()
    (choice,) = completion["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == text and "\ufffd" not in "".join(lp["tokens"])
    assert b"".join(map(bytes_of, lp["tokens"])) == text.encode()
    for token in lp["tokens"]:
        raw = bytes_of(token)
        try:
            raw.decode()
            whole_characters = True
        except UnicodeDecodeError:
            whole_characters = False
        assert token.startswith("bytes:") != whole_characters, token
    distinct = len(dict.fromkeys(ids))
    assert distinct > 5 and all(len(top) == 5 for top in lp["top_logprobs"]), "no two tokens share a string"
    assert_offsets_index_the_text(model, ids, lp["text_offset"], text)
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == lp["tokens"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode(), "chat `bytes` are the real bytes"
    for c in content:
        assert all(bytes(t["bytes"]) == bytes_of(t["token"]) for t in c["top_logprobs"] + [c])
        assert len({t["token"] for t in c["top_logprobs"]}) == len(c["top_logprobs"]) == 5


# lm-evaluation-harness's `local-completions` model (lm_eval/models/openai_completions.py, 0.4.x): the bodies it
# sends and the way it reads the answers, line for line; lm-eval itself pulls datasets, evaluate and
# scikit-learn, too much for the test extra.
def lm_eval_loglikelihood_body(model_name: str, prompts: list[list[int]]) -> dict:
    return {"model": model_name, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}


def lm_eval_generate_body(model_name: str, prompts: list, until: list[str], max_gen_toks: int) -> dict:
    return {"prompt": prompts, "model": model_name, "max_tokens": max_gen_toks, "temperature": 0,
            "stop": until, "seed": 1234}


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        assert ctxlen > 0, "Context length must be greater than 0"
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


def lm_eval_parse_generations(out: dict) -> list[str]:
    tmp = [None] * len(out["choices"])
    for choices in out["choices"]:
        tmp[choices["index"]] = choices["text"]
    return tmp


def test_lm_eval_request_bodies_get_the_answers_it_reads(base, model):
    context, greedy_cont, other_cont = (tokens(model, t) for t in ("The blocks of", " a", " sequence need"))
    # Prompt token j of the driver's answer is the likeliest at odd j: a one-token continuation at an odd
    # position is greedy, one that spans an even position is not.
    assert len(context) % 2 == 1 and len(greedy_cont) == 1 and len(other_cont) > 1
    prompts = [context + greedy_cont, context + other_cont]
    rolling = tokens(model, "PagedAttention divides the cache")  # loglikelihood_rolling: context = its first token
    with LiveGateway(base, model, answer(model, ["x\n\ny"])) as gw:
        info = gw.get("/tokenizer_info").json()
        probe = gw.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()
        scored = gw.post("/v1/completions", json=lm_eval_loglikelihood_body(model.name, prompts)).json()
        rolled = gw.post("/v1/completions", json=lm_eval_loglikelihood_body(model.name, [rolling])).json()
        generated = gw.post("/v1/completions", json=lm_eval_generate_body(model.name, [context, "Q: hi"],
                                                                           ["\n\n"], 256)).json()
    assert "eos_token" in info and isinstance(probe["tokens"], list), "lm-eval's remote tokenizer probe"
    got = lm_eval_parse_logprobs(scored, [len(context)] * 2)
    want = [(sum(-j / 8 for j in range(len(context), len(p))), all(j % 2 for j in range(len(context), len(p))))
            for p in prompts]
    assert got == want and [greedy for _, greedy in got] == [True, False]
    ((total, _),) = lm_eval_parse_logprobs(rolled, [1])
    assert total == sum(-j / 8 for j in range(1, len(rolling)))
    assert lm_eval_parse_generations(generated) == ["x", "x"], "cut at the stop string"
