"""Every field OpenAI or vLLM defines for the routes pagedserve serves is honoured (a probe here sends it and sees it
take effect, on the bus or in the answer) or refused with a 400 naming it; the table that decides (gateway/fields.py)
is complete against the official openai client's own parameter types and vLLM's request models, and the README's
field list is that table. Against the gateway over HTTP and a real Redis, with a scripted scheduler (as in
test_gateway_http.py); the worker's side of the sampling fields is tested on the real sampler (test_sampler.py,
test_engine.py)."""
from __future__ import annotations

import functools
import json
import logging
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import redis
from test_gateway_http import HI, KEYS, LiveGateway, answer, check_error, sse_events, tokens

from gateway import fields
from gateway.fields import Field
from shared.protocol import Request
from shared.sampling import Constraint

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Paris is big. It has 東京 🚀"

# vLLM 0.34.0's request models (entrypoints/openai/completion/protocol.py, chat_completion/protocol.py,
# serve/tokenize/protocol.py, generate/base/protocol.py): vLLM is never installed beside the tests, so its field
# names are written out here, and the removed ones it still names (guided decoding, logits processors).
VLLM_SAMPLING = [
    "model", "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop",
    "stream", "stream_options", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
    "prompt_logprobs", "logprob_token_ids", "bad_words", "add_special_tokens", "response_format",
    "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids", "return_token_ids",
    "return_weight_versions", "routed_experts_prompt_start", "return_token_offsets", "mm_payload", "return_mm_kwargs",
    "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
    "thinking_token_budget", "stream_interval", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "logits_processors",
]
VLLM = {
    "/v1/completions": VLLM_SAMPLING + ["prompt", "echo", "logprobs", "max_tokens", "suffix", "prompt_embeds"],
    "/v1/chat/completions": VLLM_SAMPLING + [
        "messages", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "tools", "tool_choice",
        "parallel_tool_calls", "reasoning_effort", "include_reasoning", "echo", "add_generation_prompt",
        "continue_final_message", "documents", "chat_template", "chat_template_kwargs", "media_io_kwargs",
        "mm_processor_kwargs", "return_prompt_text"],
    "stream_options": ["include_usage", "continuous_usage_stats"],
    "structured_outputs": ["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                           "disable_additional_properties", "whitespace_pattern", "structural_tag"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "continue_final_message", "return_token_strs", "chat_template", "chat_template_kwargs",
                  "response_format", "media_io_kwargs", "mm_processor_kwargs", "tools"],
    "/detokenize": ["model", "tokens"],
    # vLLM's ResponsesRequest (entrypoints/openai/responses/protocol.py, its extra fields as its docs list them)
    "/v1/responses": [
        "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
        "logit_bias", "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier", "store",
        "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "top_k", "truncation", "user",
        "skip_special_tokens", "include_stop_str_in_output", "prompt_cache_key", "request_id", "session_id",
        "media_io_kwargs", "mm_processor_kwargs", "priority", "cache_salt", "enable_response_messages",
        "previous_input_messages", "structured_outputs", "repetition_penalty", "seed", "stop", "ignore_eos",
        "vllm_xargs", "kv_transfer_params", "ec_transfer_params", "chat_template_kwargs"],
    "text": ["format", "verbosity"],  # the openai client's ResponseTextConfig, which vLLM takes as it is
}


def openai_fields(route: str) -> set[str]:
    """The official client's parameters of a route (its TypedDicts, as the client sends them)."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import ChatCompletionStreamOptionsParam
    from openai.types.chat import completion_create_params as chat
    from openai.types.responses import ResponseTextConfigParam
    from openai.types.responses import response_create_params as responses

    params = {"/v1/completions": completions.CompletionCreateParamsBase,
              "/v1/chat/completions": chat.CompletionCreateParamsBase,
              "stream_options": ChatCompletionStreamOptionsParam,
              "/v1/responses": responses.ResponseCreateParamsBase, "text": ResponseTextConfigParam}.get(route)
    return set(typing.get_type_hints(params)) | ({"stream"} if route.startswith("/v1/") else set()) \
        if params is not None else set()


def anthropic_types(table: str) -> tuple[list[type], list[type]]:
    """The official anthropic client's parameter types of a Messages table: the API's, and its betas'."""
    import anthropic.types as ga
    import anthropic.types.beta as beta
    from anthropic.types import message_count_tokens_params as count, message_create_params as create
    from anthropic.types.beta import message_count_tokens_params as beta_count, message_create_params as beta_create

    names = {"message": ["UserMessageParam", "AssistantMessageParam", "SystemMessageParam"],
             "text block": ["TextBlockParam"], "tool_use block": ["ToolUseBlockParam"],
             "tool_result block": ["ToolResultBlockParam"], "tool": ["ToolParam"],
             "tool_choice": ["ToolChoiceAutoParam", "ToolChoiceAnyParam", "ToolChoiceToolParam", "ToolChoiceNoneParam"],
             "metadata": ["MetadataParam"], "output_config": ["OutputConfigParam"],
             "output_config.format": ["JSONOutputFormatParam"]}
    if table == "/v1/messages":
        return [create.MessageCreateParamsStreaming], [beta_create.MessageCreateParamsStreaming]
    if table == "/v1/messages/count_tokens":
        return [count.MessageCountTokensParams], [beta_count.MessageCountTokensParams]
    kinds = names[table.removeprefix("/v1/messages: ")]
    return [getattr(ga, k) for k in kinds], [getattr(beta, "Beta" + k) for k in kinds]


ANTHROPIC_TABLES = [t for t in fields.ROUTES if t.startswith("/v1/messages")]
ANTHROPIC_HEADERS = {"betas", "user_profile_id", "workspace_id"}  # the client sends these as headers
# The Messages API's sampling fields, which the client's types no longer name since 2.x but the API takes.
ANTHROPIC_SAMPLING = {"temperature", "top_p", "top_k"}
VLLM_EXTENSIONS = {"/v1/messages": {"priority"}}  # vLLM's fields the Messages route takes as chat does


@pytest.mark.parametrize("table", ANTHROPIC_TABLES)
def test_a_messages_table_names_every_field_the_anthropic_client_defines(table):
    ga, beta = (set().union(*(typing.get_type_hints(t) for t in types)) - ANTHROPIC_HEADERS
                for types in anthropic_types(table))
    ga |= ANTHROPIC_SAMPLING if table == "/v1/messages" else set()
    defined = fields.ROUTES[table]
    assert not (ga | beta) - set(defined), f"{table}: fields in neither list: {sorted((ga | beta) - set(defined))}"
    extensions = VLLM_EXTENSIONS.get(table, set())
    for f in defined.values():
        if f.name in extensions:
            assert f.defined_by == fields.VLLM, f
            continue
        assert f.defined_by == (fields.ANTHROPIC if f.name in ga else fields.ANTHROPIC_BETA), f
        assert f.name in ga | beta, f"{table}: {f.name} is no field of Anthropic's"


@pytest.mark.parametrize("route", [r for r in fields.ROUTES if r not in ANTHROPIC_TABLES])
def test_the_table_names_every_field_openai_and_vllm_define_for_each_route(route):
    table = fields.ROUTES[route]
    missing = (openai_fields(route) | set(VLLM[route])) - set(table)
    assert not missing, f"{route}: fields in neither the honoured nor the refused list: {sorted(missing)}"
    for f in table.values():
        by_openai, by_vllm = f.name in openai_fields(route), f.name in VLLM[route]
        assert f.defined_by == {(True, True): fields.BOTH, (True, False): fields.OPENAI,
                                (False, True): fields.VLLM, (False, False): fields.OURS}[(by_openai, by_vllm)], f


def test_the_readme_field_list_is_the_table():
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"<!-- fields: start -->\n(.*?)<!-- fields: end -->", readme, re.S)
    assert listed is not None, "the README has no field list between its markers"
    assert listed.group(1).strip() == fields.markdown().strip(), "regenerate it: python -m gateway.fields"


def test_the_readme_names_every_route_the_gateway_serves(gw):
    from gateway.dashboard import STATIC_PREFIX

    readme = (ROOT / "README.md").read_text()
    served = {(r.method, r.resource.canonical) for r in gw.server.app.router.routes() if r.method != "HEAD"}
    unnamed = [f"{m} {path}" for m, path in served if not path.startswith(STATIC_PREFIX)
               and f"`{m} {path}`" not in readme]
    assert not unnamed, f"routes the README's API section does not name: {unnamed}"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from gateway.model import ServedModel
    from shared.settings import Settings

    return ServedModel.load(Settings(model=str(tiny_model_dir)))


@pytest.fixture
def gw(redis_url, tiny_model_dir, model):
    from shared.settings import Settings

    with LiveGateway(Settings(model=str(tiny_model_dir), redis_url=redis_url), model, answer(model, [TEXT])) as gw:
        yield gw


def refusing_value(f: Field) -> Any:
    """A value that asks for something the field's refusal is about."""
    return next(v for v in (True, "x", 7, {"a": 1}, [1]) if f.refuses(v))


NESTED = {"stream_options": {"stream": True, "stream_options": {}}, "structured_outputs": {"structured_outputs": {
    "json_object": True}}}  # a body that uses the table's object, which a field is added to
REFUSED = [(route, table, f) for route in ("/v1/completions", "/v1/chat/completions")
           for table in (route, *NESTED) for f in fields.ROUTES[table].values() if f.refused]


def with_field(route: str, table: str, name: str, value: Any) -> tuple[dict, str]:
    """The route's plain body with `name` set to `value`, at the top or in the nested table's object; its param."""
    body = {"prompt": "hi", "max_tokens": 2} if route == "/v1/completions" else {"messages": HI, "max_tokens": 2}
    if table == route:
        return body | {name: value}, name
    nested = json.loads(json.dumps(NESTED[table]))
    nested[table][name] = value
    return body | nested, f"{table}.{name}"


@pytest.mark.parametrize("route, table, field", REFUSED,
                         ids=[f"{r[4:]}:{'' if t == r else t + '.'}{f.name}" for r, t, f in REFUSED])
def test_a_refused_field_is_a_400_naming_it_and_nothing_reaches_the_bus(gw, redis_url, route, table, field):
    body, param = with_field(route, table, field.name, refusing_value(field))
    check_error(gw.post(route, json=body), 400, param, "not supported")
    for nothing in field.nothing:  # values that ask for nothing pass
        assert gw.post(route, json=with_field(route, table, field.name, nothing)[0]).status == 200, nothing
    assert redis.Redis.from_url(redis_url).xlen(KEYS.requests) == len(field.nothing)


# ---- honoured fields, each with a probe ------------------------------------------------------------------------------

@dataclass(slots=True)
class Probing:
    """One honoured field sent to one route: `post` sends the route's plain body with some fields added and returns
    the answer (JSON, or the SSE text of a stream) and the request the bus got."""
    gw: LiveGateway
    route: str
    name: str
    caplog: pytest.LogCaptureFixture
    tmp_path: Path
    body: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.body = {"prompt": PROMPT, "max_tokens": 64} if self.completions else {"messages": HI}

    @property
    def completions(self) -> bool:
        return self.route == "/v1/completions"

    def post(self, body: dict | None = None, **fields_: Any) -> tuple[Any, Request]:
        reply = self.gw.post(self.route, json=(self.body if body is None else body) | fields_)
        assert reply.status == 200, reply.text
        return (reply.text if fields_.get("stream") else reply.json()), self.gw.driver.requests[-1]


PROMPT = "Hello, world! How are you today? I am fine"
PROBES: dict[str, Callable[[Probing], None]] = {}


def probe(*names: str) -> Callable:
    def register(fn: Callable[[Probing], None]) -> Callable[[Probing], None]:
        for name in names:
            PROBES[name] = fn
        return fn
    return register


BUS_FIELDS = {"n": 3, "temperature": 0.3, "top_p": 0.5, "top_k": 7, "min_p": 0.2, "seed": 99, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "repetition_penalty": 1.3, "ignore_eos": True, "min_tokens": 2,
              "stop_token_ids": [9, 10], "allowed_token_ids": [40, 41]}


@probe(*BUS_FIELDS)
def _bus(p: Probing) -> None:
    _, req = p.post(**{p.name: BUS_FIELDS[p.name]})
    assert getattr(req.params, p.name) == BUS_FIELDS[p.name]


@probe("logit_bias")
def _logit_bias(p: Probing) -> None:
    _, req = p.post(logit_bias={"17": 100, "5": -100.0})
    assert req.params.logit_bias == [(5, -100.0), (17, 100.0)]


@probe("model")
def _model(p: Probing) -> None:
    _, req = p.post(model=p.gw.model.name)
    assert req.model == p.gw.model.name
    check_error(p.gw.post(p.route, json=p.body | {"model": "other"}), 404, "model", "other")


@probe("stop")
def _stop(p: Probing) -> None:
    assert text_of(p.post(stop=[" is"])[0]) == "Paris"


@probe("include_stop_str_in_output")
def _include_stop(p: Probing) -> None:
    assert text_of(p.post(stop=[" is"], include_stop_str_in_output=True)[0]) == "Paris is"


@probe("skip_special_tokens")
def _skip_special(p: Probing) -> None:
    p.gw.driver.script = answer(p.gw.model, ["<|im_end|>ok"])
    assert (text_of(p.post(skip_special_tokens=False)[0]), text_of(p.post()[0])) == ("<|im_end|>ok", "ok")


@probe("best_of")
def _best_of(p: Probing) -> None:
    answer_, req = p.post(best_of=3, n=1)
    assert (req.params.n, req.params.beam_width, len(answer_["choices"])) == (3, 0, 1)
    assert "cumulative_logprob" in answer_["choices"][0]


@probe("use_beam_search", "length_penalty", "early_stopping")
def _beams(p: Probing) -> None:
    asked = {"use_beam_search": {}, "length_penalty": {"length_penalty": 0.5},
             "early_stopping": {"early_stopping": "never"}}[p.name]
    answer_, req = p.post(use_beam_search=True, best_of=2, **asked)
    assert req.params.beam_width == 2 and req.params.temperature == 0 and "cumulative_logprob" in answer_["choices"][0]
    assert (req.params.length_penalty, req.params.early_stopping) == (asked.get("length_penalty", 1.0),
                                                                      asked.get("early_stopping", False))


@probe("prompt_logprobs")
def _prompt_logprobs(p: Probing) -> None:
    answer_, req = p.post(prompt_logprobs=2)
    held = answer_["choices"][0]["prompt_logprobs"] if p.completions else answer_["prompt_logprobs"]
    assert req.params.prompt_logprobs == 2 and held[0] is None and len(held) == len(req.prompt_token_ids)
    plain = p.post()[0]
    assert (plain["choices"][0] if p.completions else plain)["prompt_logprobs"] is None, "null when not asked"


@probe("truncate_prompt_tokens", "truncation_side")
def _truncate(p: Probing) -> None:
    ids = p.post()[1].prompt_token_ids
    left = p.post(truncate_prompt_tokens=3)[1].prompt_token_ids
    right = p.post(truncate_prompt_tokens=3, truncation_side="right")[1].prompt_token_ids
    assert len(ids) > 3 and left == ids[-3:] and right == ids[:3]
    assert p.post(truncate_prompt_tokens=-1)[1].prompt_token_ids == ids, "-1 keeps what fits"


@probe("return_token_ids")
def _token_ids(p: Probing) -> None:
    whole, req = p.post(return_token_ids=True)
    ids = tokens(p.gw.model, TEXT)
    assert whole["choices"][0]["token_ids"] == ids
    assert (whole["choices"][0] if p.completions else whole)["prompt_token_ids"] == req.prompt_token_ids
    chunks = [json.loads(e) for e in sse_events(p.post(return_token_ids=True, stream=True)[0])[:-1]]
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
    first = chunks[0]["choices"][0] if p.completions else chunks[0]
    assert first["prompt_token_ids"] == req.prompt_token_ids
    assert "token_ids" not in p.post()[0]["choices"][0], "only when asked for"


@probe("return_tokens_as_token_ids")
def _tokens_as_ids(p: Probing) -> None:
    logprobs = {"logprobs": 1} if p.completions else {"logprobs": True, "top_logprobs": 1}
    lp = p.post(return_tokens_as_token_ids=True, **logprobs)[0]["choices"][0]["logprobs"]
    shown = lp["tokens"] if p.completions else [e["token"] for e in lp["content"]]
    assert shown == [f"token_id:{t}" for t in tokens(p.gw.model, TEXT)]


@probe("stream")
def _stream(p: Probing) -> None:
    streamed = p.post(stream=True)[0]
    assert streamed.endswith("data: [DONE]\n\n") and text_of_stream(streamed) == TEXT


@probe("stream_options", "include_usage")
def _include_usage(p: Probing) -> None:
    last = json.loads(sse_events(p.post(stream=True, stream_options={"include_usage": True})[0])[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(tokens(p.gw.model, TEXT))


@probe("continuous_usage_stats")
def _continuous_usage(p: Probing) -> None:
    streamed, req = p.post(stream=True, stream_options={"continuous_usage_stats": True})
    chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == len(req.prompt_token_ids) for c in chunks)
    assert counts == sorted(counts) and counts[-1] == len(tokens(p.gw.model, TEXT))


@probe("user", "safety_identifier")
def _user(p: Probing) -> None:
    with p.caplog.at_level(logging.INFO, logger="gateway.app"):
        p.post(**{p.name: "alice@example"})
    assert "for user 'alice@example'" in p.caplog.text


@probe("priority")
def _priority(p: Probing) -> None:
    """The bus carries it under the priority policy (the scheduler's order: test_tenants.py); under another, only 0."""
    assert p.post(priority=0)[1].priority == 0
    refused = p.gw.post(p.route, json=p.body | {"priority": -5})
    assert refused.status == 400 and refused.json()["error"]["param"] == "priority", refused.text
    settings = p.gw.settings
    settings.scheduling_policy = "priority"
    try:
        assert p.post(priority=-5)[1].priority == -5
    finally:
        settings.scheduling_policy = "fcfs"


@probe("cache_salt")
def _cache_salt(p: Probing) -> None:
    """The bus carries it (blocks shared only within a salt: test_tenants.py); an empty one is a 400."""
    assert p.post(cache_salt="project-a")[1].cache_salt == "project-a"
    assert p.post()[1].cache_salt == ""
    empty = p.gw.post(p.route, json=p.body | {"cache_salt": ""})
    assert empty.status == 400 and empty.json()["error"]["param"] == "cache_salt", empty.text


@probe("prompt")
def _prompt(p: Probing) -> None:
    p.post({"prompt": [[5, 6, 7], "Hello"]})
    first, second = p.gw.driver.requests[-2:]
    assert (first.prompt_token_ids, second.prompt_token_ids) == ([5, 6, 7], p.gw.model.tokenizer.encode("Hello"))


@probe("echo")
def _echo(p: Probing) -> None:
    if p.completions:
        assert text_of(p.post(echo=True)[0]) == PROMPT + TEXT
        return
    continued = {"messages": HI + [{"role": "assistant", "content": "Well,"}], "add_generation_prompt": False,
                 "continue_final_message": True}
    answer_ = p.post(continued, echo=True)[0]
    assert text_of(answer_) == "Well," + TEXT and answer_["choices"][0]["message"]["role"] == "assistant"
    assert text_of_stream(p.post(continued, echo=True, stream=True)[0]) == "Well," + TEXT
    assert text_of(p.post(echo=True)[0]) == TEXT, "the last message is the user's, not the answer's: nothing to echo"


@probe("logprobs", "top_logprobs")
def _logprobs(p: Probing) -> None:
    if p.completions:
        answer_, req = p.post(logprobs=2)
        assert req.params.logprobs == 2 and answer_["choices"][0]["logprobs"]["top_logprobs"][0]
        return
    top = 2 if p.name == "top_logprobs" else 0
    answer_, req = p.post(logprobs=True, **({"top_logprobs": top} if top else {}))
    content = answer_["choices"][0]["logprobs"]["content"]
    assert req.params.logprobs == top and len(content) == len(tokens(p.gw.model, TEXT))


@probe("max_tokens", "max_completion_tokens")
def _max_tokens(p: Probing) -> None:
    assert p.post(**{p.name: 5})[1].params.max_tokens == 5


@probe("add_special_tokens")
def _add_special_tokens(p: Probing) -> None:
    """Against a copy of the tiny model whose tokenizer adds BOS (the tiny one adds nothing)."""
    from gateway.model import ServedModel
    from shared.settings import Settings

    bos_dir = with_bos(p.gw.model.path, p.tmp_path)
    bos = ServedModel.load(Settings(model=str(bos_dir)))
    settings = p.gw.settings.replace(model=str(bos_dir))
    with LiveGateway(settings, bos, answer(bos, [TEXT])) as gw:
        p.gw = gw
        added, plain = p.post(add_special_tokens=True)[1], p.post(add_special_tokens=False)[1]
    text = PROMPT if p.completions else bos.tokenizer.render_chat(HI).text
    assert plain.prompt_token_ids == bos.tokenizer.encode(text, False)
    assert added.prompt_token_ids == [bos.tokenizer.backend.token_to_id("<s>"), *plain.prompt_token_ids]


def with_bos(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "tiny-with-bos"
    shutil.copytree(model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<s>")
    a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, a],
                              "pair": [a, b], "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}}}
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@probe("messages")
def _messages(p: Probing) -> None:
    messages = [{"role": "critic", "content": "Be harsh.", "name": "bob"}] + HI
    rendered = p.gw.model.tokenizer.render_chat(messages).token_ids
    assert p.post({"messages": messages})[1].prompt_token_ids == rendered, "any role, as the template takes"


@probe("add_generation_prompt", "continue_final_message")
def _template_flags(p: Probing) -> None:
    decode = functools.partial(p.gw.model.tokenizer.decode, skip_special_tokens=False)
    messages = HI + [{"role": "assistant", "content": "Well,"}]
    opened = p.post({"messages": messages})[1]
    closed = p.post({"messages": messages, "add_generation_prompt": False})[1]
    continued = p.post({"messages": messages, "add_generation_prompt": False, "continue_final_message": True})[1]
    assert decode(opened.prompt_token_ids).endswith("Well,<|im_end|>\n<|im_start|>assistant\n")
    assert decode(closed.prompt_token_ids).endswith("Well,<|im_end|>\n")
    assert decode(continued.prompt_token_ids).endswith("<|im_start|>assistant\nWell,")


@probe("chat_template_kwargs")
def _template_kwargs(p: Probing) -> None:
    tokenizer = p.gw.model.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        greeted = p.post(chat_template_kwargs={"greeting": "Ahoy! "})[1]
    finally:
        tokenizer.chat_template = original
    assert tokenizer.decode(greeted.prompt_token_ids) == "Ahoy! hi"


@probe("return_prompt_text")
def _prompt_text(p: Probing) -> None:
    whole = p.post(return_prompt_text=True)[0]
    assert whole["prompt_text"] == p.gw.model.tokenizer.render_chat(HI).text
    streamed = p.post(return_prompt_text=True, stream=True)[0]
    assert json.loads(sse_events(streamed)[0])["prompt_text"] == whole["prompt_text"]
    assert "prompt_text" not in p.post()[0]


SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
CONSTRAINTS = {  # field: (what is sent, the constraint the bus carries)
    "response_format": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                   "strict": True}}},
                        Constraint("json_schema", SCHEMA_TEXT)),
    "json_object": ({"response_format": {"type": "json_object"}}, Constraint("json_schema", '{"type": "object"}')),
    "structured_outputs": ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", SCHEMA_TEXT)),
    "json": ({"structured_outputs": {"json": SCHEMA_TEXT}}, Constraint("json_schema", SCHEMA_TEXT)),
    "regex": ({"structured_outputs": {"regex": "[0-9]{3}"}}, Constraint("regex", "[0-9]{3}")),
    "choice": ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint("choice", '["yes", "no"]')),
    "grammar": ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, Constraint("grammar", 'start: "yes" | "no"')),
    "disable_any_whitespace": ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
                               Constraint("json_schema", SCHEMA_TEXT, compact=True)),
    "guided_json": ({"guided_json": SCHEMA}, Constraint("json_schema", SCHEMA_TEXT)),
    "guided_regex": ({"guided_regex": "[0-9]{3}"}, Constraint("regex", "[0-9]{3}")),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, Constraint("choice", '["yes", "no"]')),
    "guided_grammar": ({"guided_grammar": 'start: "yes"'}, Constraint("grammar", 'start: "yes"')),
}


@probe(*CONSTRAINTS)
def _constraint(p: Probing) -> None:
    """The bus carries the constraint (the worker's masks keep the output to it: test_structured_outputs.py)."""
    sent, carried = CONSTRAINTS[p.name]
    assert p.post(**sent)[1].params.constraint == carried
    assert p.post(response_format={"type": "text"})[1].params.constraint is None


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}


@probe("tools", "tool_choice", "parallel_tool_calls")
def _tools(p: Probing) -> None:
    """The bus carries the grammar of the model's calls (the answer read for calls: test_tools.py)."""
    auto = p.post(tools=[TOOL])[1].params.constraint
    assert auto.kind == "grammar" and 'get_time' in auto.spec and "more*" in auto.spec
    assert p.post(tools=[TOOL], tool_choice="none")[1].params.constraint is None
    assert "more*" not in p.post(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)[1].params.constraint.spec


def text_of(answer_: dict) -> str:
    choice = answer_["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def text_of_stream(streamed: str) -> str:
    out = ""
    for event in sse_events(streamed)[:-1]:
        for choice in json.loads(event)["choices"]:
            out += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return out


HONOURED = [(route, f.name) for route in ("/v1/completions", "/v1/chat/completions")
            for f in [*fields.ROUTES[route].values(), *fields.STREAM_OPTIONS.values(),
                      *fields.STRUCTURED_OUTPUTS.values()] if not f.refused]


def test_every_honoured_field_has_a_probe():
    assert {name for _, name in HONOURED} <= set(PROBES), sorted({n for _, n in HONOURED} - set(PROBES))


@pytest.mark.parametrize("route, name", HONOURED, ids=[f"{r[4:]}:{n}" for r, n in HONOURED])
def test_a_honoured_field_takes_effect(gw, caplog, tmp_path, route, name):
    PROBES[name](Probing(gw, route, name, caplog, tmp_path))


# ---- content types, the retrieve-model route -------------------------------------------------------------------------

NOT_JSON = {"form": ("application/x-www-form-urlencoded", b"prompt=hi"), "text": ("text/plain", b'{"prompt": "hi"}'),
            "multipart": ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="prompt"'
                          b'\r\n\r\nhi\r\n--x--\r\n'), "none": (None, b'{"prompt": "hi"}'),
            "latin-1 json": ("application/json; charset=latin-1", b'{"prompt": "hi"}')}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("case", list(NOT_JSON))
def test_a_body_of_another_content_type_is_a_415_and_nothing_is_queued(gw, redis_url, route, case):
    content_type, content = NOT_JSON[case]
    headers = {"Content-Type": content_type} if content_type else {}
    reply = gw.run(gw.session.post(gw.url + route, data=content, headers=headers, skip_auto_headers=["Content-Type"]))
    assert reply.status == 415, case
    error = gw.run(reply.json())["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert redis.Redis.from_url(redis_url).xlen(KEYS.requests) == 0
    utf8 = gw.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"Content-Type": "application/json; charset=UTF-8"})
    assert utf8.status == 200, "JSON with its charset named passes"


def test_get_model_answers_the_served_models_card_and_404_names_another(gw):
    card = gw.get(f"/v1/models/{gw.model.name}")
    assert card.status == 200 and card.json() == gw.get("/v1/models").json()["data"][0]
    check_error(gw.get("/v1/models/gpt-9"), 404, "model", "`gpt-9` does not exist")
