"""Anthropic's Messages API on the chat machinery (gateway/messages_api.py), pure: a Messages body becomes the chat
body the chat request model takes (and the messages its template gets), every error names the Anthropic field, and
the answer, whole and streamed, is what the official anthropic client's own types take: each event validates, and the
events accumulated by the client's own accumulation equal the whole message. No Redis, no server."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx2
import pytest
from anthropic import Anthropic, APIStatusError
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from gateway import fields
from gateway.answer import Answer, Event, Step, Usage
from gateway.calls import chat_call, tokenize
from gateway.errors import ApiError
from gateway.messages_api import (MessagesShape, chat_body, count_tokens_answer, count_tokens_body, error_body,
                                  relabel)
from gateway.request_model import ChatRequest, parse_chat, parse_tokenize
from gateway.tools import HERMES, CallParser, Piece

SERVED = "tiny"
VOCAB = 512
HI = [{"role": "user", "content": "hi"}]
PLAIN = {"model": SERVED, "max_tokens": 16, "messages": HI}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
EVENTS = TypeAdapter(RawMessageStreamEvent)


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """The chat request a Messages body makes, its errors named as the route names them."""
    try:
        return parse_chat(chat_body(body), SERVED, VOCAB)
    except ApiError as e:
        raise relabel(e) from None


def template_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m.for_template() for m in chat_request(body).messages]


def refused(body: dict[str, Any], param: str, words: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        chat_request(body)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    assert words in caught.value.message and param.split("[")[0] in caught.value.message, caught.value.message
    return caught.value


# ---- translation ----------------------------------------------------------------------------------------------------

def test_a_system_string_is_the_first_message_with_the_system_role():
    assert template_messages(PLAIN | {"system": "Be brief."}) == [{"role": "system", "content": "Be brief."}, *HI]


def test_system_text_blocks_are_one_system_message_and_a_cache_breakpoint_on_them_passes():
    system = [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind.",
                                                         "cache_control": {"type": "ephemeral"}}]
    assert template_messages(PLAIN | {"system": system})[0] == {"role": "system", "content": "Be brief. Be kind."}


def test_a_conversation_with_tool_use_and_tool_results_is_the_chat_messages_the_template_gets():
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {"tz": "CET"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here:"},
            {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "call_2", "content": "unknown zone", "is_error": True}]},
    ]
    assert template_messages(PLAIN | {"messages": messages, "tools": [WEATHER, TIME]}) == [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "Error: unknown zone", "tool_call_id": "call_2"},
        {"role": "user", "content": "Here:"},
    ]


def test_consecutive_user_turns_are_joined_into_one_as_anthropic_joins_them():
    messages = [{"role": "user", "content": "Hello. "}, {"role": "user", "content": [{"type": "text", "text": "Hi?"}]}]
    assert template_messages(PLAIN | {"messages": messages}) == [{"role": "user", "content": "Hello. Hi?"}]


def test_a_last_assistant_turn_is_continued_as_a_prefill():
    req = chat_request(PLAIN | {"messages": HI + [{"role": "assistant", "content": "The answer is ("}]})
    assert (req.template.add_generation_prompt, req.template.continue_final_message) == (False, True)
    assert chat_request(PLAIN).template.add_generation_prompt


def test_tools_are_function_tools_with_their_input_schema():
    use = chat_request(PLAIN | {"tools": [WEATHER | {"type": "custom", "strict": True}, TIME]}).tool_use
    assert [(t.name, t.description, json.loads(t.parameters)) for t in use.tools] == [
        ("get_weather", WEATHER["description"], WEATHER["input_schema"]), ("get_time", None, TIME["input_schema"])]
    assert (use.choice, use.parallel) == ("auto", True)


@pytest.mark.parametrize("choice, chat", [
    ({"type": "auto"}, ("auto", None, True)),
    ({"type": "any"}, ("required", None, True)),
    ({"type": "tool", "name": "get_time"}, ("function", "get_time", True)),
    ({"type": "none"}, ("none", None, True)),
    ({"type": "any", "disable_parallel_tool_use": True}, ("required", None, False)),
    ({"type": "auto", "disable_parallel_tool_use": False}, ("auto", None, True)),
])
def test_tool_choice_is_chats_choice_and_disable_parallel_tool_use_allows_one_call(choice, chat):
    use = chat_request(PLAIN | {"tools": [WEATHER, TIME], "tool_choice": choice}).tool_use
    assert (use.choice, use.function, use.parallel) == chat


def test_stop_sequences_sampling_fields_stream_and_the_user_id_reach_the_chat_request():
    req = chat_request(PLAIN | {"stop_sequences": ["\n\n", "END"], "temperature": 0.25, "top_p": 0.5, "top_k": 7,
                                "stream": True, "metadata": {"user_id": "u-42"}})
    s = req.sampling
    assert (req.max_tokens, s.stop, s.temperature, s.top_p, s.top_k, s.stream, s.user) == (
        16, ("\n\n", "END"), 0.25, 0.5, 7, True, "u-42")


def test_an_output_format_is_the_json_schema_the_answer_is_constrained_to():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = chat_request(PLAIN | {"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert (req.sampling.constraint.kind, json.loads(req.sampling.constraint.spec)) == ("json_schema", schema)


def test_values_that_ask_for_nothing_pass():
    nothing = {"thinking": {"type": "disabled"}, "service_tier": "standard_only", "mcp_servers": [],
               "speed": "standard", "cache_control": {"type": "ephemeral"}, "tool_choice": {"type": "none"},
               "metadata": {}}
    assert chat_request(PLAIN | nothing).messages[0].content == "hi"


REFUSED = [f for f in fields.MESSAGES.values() if f.refused]


@pytest.mark.parametrize("field", REFUSED, ids=[f.name for f in REFUSED])
def test_a_refused_field_is_a_400_naming_it(field):
    value = next(v for v in (True, "x", 7, {"type": "enabled", "budget_tokens": 2048}, [1]) if field.refuses(v))
    assert refused(PLAIN | {field.name: value}, field.name, "not supported").code == "unsupported"


BAD = {  # what is sent: (the param the 400 names, words of its message)
    "no max_tokens": ({"max_tokens": None}, "max_tokens", "is required"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens", "at least 1"),
    "no model": ({"model": None}, "model", "is required"),
    "an unknown field": ({"frobnicate": 1}, "frobnicate", "Anthropic's Messages API does not define it"),
    "a temperature above Anthropic's range": ({"temperature": 1.5}, "temperature", "[0, 1]"),
    "a negative top_k": ({"top_k": -1}, "top_k", "at least 0"),
    "a stop sequence that is not a string": ({"stop_sequences": ["a", 3]}, "stop_sequences", "non-empty strings"),
    "stop_sequences as one string": ({"stop_sequences": "END"}, "stop_sequences", "array"),
    "an image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
        "messages[0].content[0].type", "'image' blocks are not served"),
    "a document in a tool result": ({"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
        "messages[1].content[0].content[0].type", "'document' blocks are not served in tool results"),
    "a tool_use block in a user turn": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "c", "name": "f", "input": {}}]}]}, "messages[0].content[0].type", "user turns"),
    "a thinking block": ({"messages": HI + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]}]}, "messages[1].content[0].type", "'thinking'"),
    "a tool role": ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "\"user\", \"assistant\""),
    "a block with an unknown field": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                                                   "color": "red"}]}]},
                                      "messages[0].content[0].color", "does not define it"),
    "a cache ttl on a block": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]},
        "messages[0].content[0].cache_control", "not supported"),
    "a top-level cache ttl": ({"cache_control": {"type": "ephemeral", "ttl": "5m"}}, "cache_control", "`ttl`"),
    "citations": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]}]},
        "messages[0].content[0].citations", "no citations"),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type",
                      "server tool"),
    "a tool without input_schema": ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "is required"),
    "deferred tool loading": ({"tools": [WEATHER | {"defer_loading": True}]}, "tools[0].defer_loading", "tool search"),
    "tool_choice naming no tool": ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
                                   "tool_choice.name", "not among `tools`"),
    "tool_choice without tools": ({"tool_choice": {"type": "any"}}, "tool_choice", "needs `tools`"),
    "a tool_choice of another type": ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type",
                                      "\"auto\", \"any\", \"tool\" or \"none\""),
    "metadata beside user_id": ({"metadata": {"user_id": "u", "team": "x"}}, "metadata.team", "does not define it"),
    "an effort": ({"output_config": {"effort": "high"}}, "output_config.effort", "no reasoning models"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_body_is_a_400_naming_the_anthropic_field(case):
    change, param, words = BAD[case]
    refused({k: v for k, v in (PLAIN | change).items() if v is not None}, param, words)


RELABELLED = {  # errors the chat request model finds, in the fields the body was translated to
    "a stop sequence with a lone surrogate": ({"stop_sequences": ["\ud800"]}, "stop_sequences", "lone surrogate"),
    "a tool name chat's functions do not take": ({"tools": [WEATHER | {"name": "get weather!"}]}, "tools",
                                                 "tools[0].name must be 1-64"),
    "an input_schema of no object": ({"tools": [WEATHER | {"input_schema": {"type": "string"}}]}, "tools",
                                     "tools[0].input_schema must be a JSON schema of an object"),
}


@pytest.mark.parametrize("case", list(RELABELLED))
def test_an_error_the_chat_request_model_finds_names_the_anthropic_field(case):
    change, param, words = RELABELLED[case]
    error = refused({k: v for k, v in (PLAIN | change).items() if v is not None}, param, words)
    assert ".function." not in error.message and "`stop`" not in error.message


# ---- through the chat call, on the tiny model's template -------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from gateway.model import ServedModel
    from shared.settings import Settings

    return ServedModel.load(Settings(model=str(tiny_model_dir)))


def test_a_translated_body_renders_as_the_same_chat_body_would(model):
    body = PLAIN | {"system": "Be brief.", "messages": HI + [{"role": "assistant", "content": "Well,"}]}
    call = chat_call(chat_request(body | {"model": model.name}), model)
    assert model.tokenizer.decode(call.prompts[0].token_ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nWell,")
    assert (call.params.max_tokens, call.stream, call.named_tool) == (16, False, False)


def test_an_error_of_the_chat_call_names_the_anthropic_field(model):
    body = PLAIN | {"model": model.name, "tools": [WEATHER], "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}
    with pytest.raises(ApiError) as caught:
        try:
            chat_call(chat_request(body), model)
        except ApiError as e:
            raise relabel(e) from None
    assert caught.value.param == "output_config" and caught.value.message.startswith("`output_config` cannot go")


def test_count_tokens_counts_the_prompt_the_messages_call_sends(model):
    body = {"model": model.name, "system": "Be brief.", "messages": HI, "tools": [WEATHER]}
    counted = tokenize(parse_tokenize(count_tokens_body(body), model.name), model)["count"]
    assert counted == len(chat_call(chat_request(body | {"max_tokens": 16}), model).prompts[0].token_ids)


# ---- count_tokens ---------------------------------------------------------------------------------------------------

def test_count_tokens_renders_the_prompt_the_messages_call_renders():
    body = {"model": SERVED, "system": "Be brief.", "messages": HI, "tools": [WEATHER],
            "tool_choice": {"type": "any"}, "output_config": {"format": {"type": "json_schema", "schema": {}}}}
    counted = parse_tokenize(count_tokens_body(body), SERVED)
    called = chat_request(body | {"max_tokens": 16})
    assert counted.messages == called.messages and counted.tools == called.tool_use.tools
    assert counted.template == called.template
    assert MessageTokensCount.model_validate(count_tokens_answer(42)).input_tokens == 42


@pytest.mark.parametrize("change, param", [({"max_tokens": 16}, "max_tokens"), ({"thinking": {"type": "enabled"}},
                                                                                 "thinking"),
                                           ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
                                            "tool_choice.name")])
def test_count_tokens_refuses_what_its_route_does_not_take_naming_it(change, param):
    with pytest.raises(ApiError) as caught:
        count_tokens_body({"model": SERVED, "messages": HI} | change)
    assert (caught.value.status, caught.value.param) == (400, param)


# ---- errors ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "invalid_request_error"),
                                          (429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")])
def test_an_error_body_is_anthropics_its_type_by_the_status(status, kind):
    body = ErrorResponse.model_validate(error_body(ApiError(status, "went wrong")))
    assert (body.type, body.error.type, body.error.message) == ("error", kind, "went wrong")


# ---- the answer, whole and streamed ---------------------------------------------------------------------------------

PROMPT_TOKENS, CACHED = 12, 4


@dataclass(frozen=True, slots=True)
class Run:
    """An answer as the steps a stream is fed, and whole."""
    steps: tuple[Step, ...]
    answer: Answer


def run(text: str, finish: str = "stop", stop: str | int | None = None, tools: bool = False) -> Run:
    """`text` as a model writes it, three characters a token, read for hermes tool calls where `tools`."""
    parser = CallParser(HERMES, "an-answer")
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    steps = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        read = parser.feed(piece, end=last) if tools else Piece(piece)
        steps.append(Step(read.content, read.calls, finish if last else None, stop if last else None))
    usage = Usage(PROMPT_TOKENS, len(steps), CACHED)
    return Run(tuple(steps), Answer("".join(s.content for s in steps), tuple(parser.calls), finish, stop, usage))


def streamed(r: Run) -> list[Event]:
    shape = MessagesShape("msg_7", SERVED, PROMPT_TOKENS)
    return shape.opening() + [e for s in r.steps for e in shape.step(s)] + shape.closing(r.answer)


def accumulated(events: list[Event]) -> Message:
    """The events, each validated by the client's own types, accumulated by the client's own accumulation."""
    snapshot, buffers = None, {}
    for e in events:
        assert e.name == e.data["type"]
        if e.name != "ping":
            snapshot = accumulate_event(event=EVENTS.validate_python(e.data), current_snapshot=snapshot,
                                        json_bufs=buffers)
    return Message.model_validate(snapshot.to_dict())


CALLS = ('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
         '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
RUNS = {  # a run, the stop_reason and stop_sequence it ends with, its content's types
    "text": (run("The capital of France is Paris."), "end_turn", None, ["text"]),
    "tool calls": (run(CALLS, tools=True), "tool_use", None, ["text", "tool_use", "tool_use"]),
    "a stop sequence": (run("Paris", stop=" is"), "stop_sequence", " is", ["text"]),
    "max_tokens": (run("Paris is big and", finish="length"), "max_tokens", None, ["text"]),
    "a stop token": (run("Paris.", stop=2), "end_turn", None, ["text"]),
    "the server": (run("Paris is", finish="abort"), "pause_turn", None, ["text"]),
    "nothing": (run(""), "end_turn", None, []),
}


@pytest.mark.parametrize("case", list(RUNS))
def test_the_whole_answer_is_an_anthropic_message(case):
    r, stop_reason, stop_sequence, kinds = RUNS[case]
    message = Message.model_validate(MessagesShape("msg_7", SERVED, PROMPT_TOKENS).whole(r.answer))
    assert (message.id, message.role, message.model) == ("msg_7", "assistant", SERVED)
    assert (message.stop_reason, message.stop_sequence, [b.type for b in message.content]) == (
        stop_reason, stop_sequence, kinds)
    u = message.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.cache_creation_input_tokens, u.output_tokens) == (
        PROMPT_TOKENS - CACHED, CACHED, 0, len(r.steps))


@pytest.mark.parametrize("case", list(RUNS))
def test_the_stream_accumulated_by_the_anthropic_client_is_the_whole_message(case):
    r = RUNS[case][0]
    whole = Message.model_validate(MessagesShape("msg_7", SERVED, PROMPT_TOKENS).whole(r.answer))
    assert accumulated(streamed(r)).model_dump() == whole.model_dump()


def test_tool_calls_come_back_with_their_ids_names_and_input():
    r = RUNS["tool calls"][0]
    blocks = accumulated(streamed(r)).content
    assert [(b.id, b.name, b.input) for b in blocks[1:]] == [
        (r.answer.calls[0].id, "get_weather", {"city": "Paris"}), (r.answer.calls[1].id, "get_time", {"tz": "CET"})]
    assert blocks[0].text == "Let me look."


def test_a_stream_opens_with_the_message_shell_and_a_ping_and_closes_each_block_in_order():
    names = [e.name for e in streamed(RUNS["tool calls"][0])]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == ["message_delta",
                                                                                            "message_stop"]
    blocks = [(e.name, e.data["index"]) for e in streamed(RUNS["tool calls"][0]) if e.name.startswith("content_block_")
              and e.name != "content_block_delta"]
    assert blocks == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                      ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2)]
    start = EVENTS.validate_python(streamed(RUNS["text"][0])[0].data)
    assert (start.message.content, start.message.stop_reason, start.message.usage.input_tokens) == (
        [], None, PROMPT_TOKENS)


def test_the_same_steps_make_the_same_events_so_a_reconnected_stream_replays_them():
    r = RUNS["tool calls"][0]
    assert streamed(r) == streamed(r)


def sse(events: list[Event]) -> bytes:
    return b"".join(f"event: {e.name}\ndata: {json.dumps(e.data)}\n\n".encode() for e in events)


def client_reading(body: bytes) -> Anthropic:
    """The official client, its HTTP transport answering `body` as a stream (this module has no route to call)."""
    answer = httpx2.MockTransport(lambda request: httpx2.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    return Anthropic(api_key="unused", base_url="http://gateway", http_client=httpx2.Client(transport=answer))


def test_the_anthropic_clients_own_stream_reads_the_events_to_the_whole_message():
    r = RUNS["tool calls"][0]
    with client_reading(sse(streamed(r))).messages.stream(model=SERVED, max_tokens=16, messages=HI) as stream:
        final = stream.get_final_message()
    assert final.model_dump() == Message.model_validate(
        MessagesShape("msg_7", SERVED, PROMPT_TOKENS).whole(r.answer)).model_dump()


def test_a_failure_after_the_headers_is_an_error_event_the_client_raises():
    r, shape = RUNS["text"][0], MessagesShape("msg_7", SERVED, PROMPT_TOKENS)
    events = shape.opening() + shape.step(r.steps[0]) + shape.failure(ApiError(500, "the worker failed"), r.answer)
    assert events[-1].name == "error"
    assert ErrorResponse.model_validate(events[-1].data).error.type == "api_error"
    with pytest.raises(APIStatusError) as caught:
        with client_reading(sse(events)).messages.stream(model=SERVED, max_tokens=16, messages=HI) as stream:
            stream.get_final_message()
    assert caught.value.body == error_body(ApiError(500, "the worker failed"))
