"""OpenAI's Responses API as pure parsing and shaping (gateway/responses_api.py): bodies parsed and refused by the
field table, turned into chat calls that the chat request model accepts, and answers written whole and streamed in
shapes that the official openai client's own types validate (its pydantic models of a Response, of each stream event,
of input items) and that its own stream accumulator reads back to the same response. No Redis, no server."""
from __future__ import annotations

import json

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseInputItemParam, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway import fields
from gateway.answer import Answer, Event, Step, Usage
from gateway.calls import chat_call
from gateway.errors import ApiError
from gateway.request_model import parse_chat
from gateway.responses_api import (ResponseShape, chat_body, conversation_items, input_items, item_id, parse,
                                   relabel)
from gateway.tools import HERMES, CallParser

MODEL = "tiny"
VOCAB = 512
RID = "resp_0123abcd"
BASE = {"model": MODEL, "input": "hi"}
TOOLS = [{"type": "function", "name": "get_time", "description": "The time in a zone", "strict": True,
          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"],
                         "additionalProperties": False}},
         {"type": "function", "name": "get_date", "parameters": {"type": "object", "properties": {}}}]
EVENTS = TypeAdapter(ResponseStreamEvent)
ITEMS = TypeAdapter(ResponseItem)
INPUT_ITEMS = TypeAdapter(ResponseInputItemParam)


def rejected(body: dict, param: str, says: str) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    assert says in caught.value.message
    return caught.value


def chat_of(body: dict, earlier: list[dict] | None = None):
    """The chat request the Responses body becomes, as the chat request model parses it."""
    return parse_chat(chat_body(parse(body), earlier or []), MODEL, VOCAB)


# ---- parsing ---------------------------------------------------------------------------------------------------------

def test_a_string_input_is_the_users_message():
    chat = chat_of(BASE)
    assert [(m.role, m.content) for m in chat.messages] == [("user", "hi")]


def test_instructions_are_the_first_message_the_systems():
    chat = chat_of(BASE | {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]})
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("system", "Answer in French."),
                                                            ("user", "hi")]


def test_message_items_take_text_parts_and_an_assistants_output_text():
    chat = chat_of(BASE | {"input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                          {"type": "input_text", "text": "2+2?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "4", "annotations": []}]},
        {"role": "user", "content": "And 3+3?"}]})
    assert [(m.role, m.content) for m in chat.messages] == [("user", "What is 2+2?"), ("assistant", "4"),
                                                            ("user", "And 3+3?")]


def test_consecutive_function_calls_join_the_assistants_message_and_outputs_become_tool_messages():
    chat = chat_of(BASE | {"tools": TOOLS, "input": [
        {"role": "user", "content": "Time and date?"},
        {"role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": '{"tz": "UTC"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_date", "arguments": "{}", "id": "fc_9"},
        {"type": "function_call_output", "call_id": "call_a", "output": "12:00"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "May 1"}]}]})
    user, assistant, time, date = chat.messages
    assert (assistant.role, assistant.content) == ("assistant", "Checking.")
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_a", "get_time", '{"tz": "UTC"}'),
                                                                          ("call_b", "get_date", "{}")]
    assert [(m.role, m.tool_call_id, m.content) for m in (time, date)] == [("tool", "call_a", "12:00"),
                                                                          ("tool", "call_b", "May 1")]


def test_a_function_call_output_item_renders_as_a_tool_message():
    chat = chat_of(BASE | {"input": [
        {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_a", "output": "12:00"}]})
    called, answered = chat.messages
    assert (called.role, called.content, called.tool_calls[0].id) == ("assistant", "", "call_a")
    assert answered.for_template() == {"role": "tool", "content": "12:00", "tool_call_id": "call_a"}


def test_the_sampling_fields_and_tools_become_the_chat_calls():
    chat = chat_of(BASE | {"max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9, "tools": TOOLS,
                           "tool_choice": {"type": "function", "name": "get_date"}, "parallel_tool_calls": False,
                           "user": "alice", "top_k": 5, "seed": 7, "stop": ["\n"], "stream": True})
    s = chat.sampling
    assert (chat.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.user, s.stream) == (
        9, 0.5, 0.9, 5, 7, ("\n",), "alice", True)
    use = chat.tool_use
    assert ([t.name for t in use.tools], use.choice, use.function, use.parallel) == (
        ["get_time", "get_date"], "function", "get_date", False)
    assert json.loads(use.tools[0].parameters) == TOOLS[0]["parameters"]


def test_a_json_schema_text_format_is_chats_response_format():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = chat_of(BASE | {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}})
    assert (chat.sampling.constraint.kind, json.loads(chat.sampling.constraint.spec)) == ("json_schema", schema)
    assert chat_of(BASE | {"text": {"format": {"type": "json_object"}}}).sampling.constraint.kind == "json_schema"
    assert chat_of(BASE | {"text": {"format": {"type": "text"}}}).sampling.constraint is None


def test_the_earlier_conversation_comes_before_the_input_and_its_instructions_do_not_carry_over():
    first = parse(BASE | {"instructions": "Old rules.", "input": "Time?", "tools": TOOLS})
    answered = answer_of(["<tool_call>", '{"name": "get_time", "arguments": {"tz": "UTC"}}', "</tool_call>"], "stop")
    earlier = conversation_items(first, RID, answered)
    chat = chat_of(BASE | {"instructions": "New rules.", "tools": TOOLS, "input": [
        {"type": "function_call_output", "call_id": answered.calls[0].id, "output": "12:00"}]}, earlier)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert (chat.messages[0].content, chat.messages[1].content) == ("New rules.", "Time?")
    assert chat.messages[2].tool_calls == answered.calls


REFUSED = [f for f in fields.RESPONSES.values() if f.refused]


def refusing_value(f: fields.Field):
    return next(v for v in (True, "x", 7, {"a": 1}, [1]) if f.refuses(v))


@pytest.mark.parametrize("field", REFUSED, ids=[f.name for f in REFUSED])
def test_a_refused_field_is_a_400_naming_it_and_its_nothing_values_pass(field):
    error = rejected(BASE | {field.name: refusing_value(field)}, field.name, "not supported")
    assert error.code == "unsupported"
    for nothing in field.nothing:
        chat_of(BASE | {field.name: nothing})


def test_an_unknown_field_is_a_400_naming_it():
    assert rejected(BASE | {"temprature": 1}, "temprature", "not a field").code == "unknown_field"
    rejected(BASE | {"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity", "not supported")


@pytest.mark.parametrize("item, says", [
    ({"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}, "'input_image'"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}, "'input_file'"),
    ({"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}, "'input_text'"),
    ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "'output_text'"),
    ({"type": "reasoning", "id": "rs_1", "summary": []}, "'reasoning'"),
    ({"type": "web_search_call", "id": "ws_1", "status": "completed"}, "'web_search_call'"),
    ({"type": "item_reference", "id": "msg_1"}, "'item_reference'"),
    ({"role": "user", "content": "x", "phase": "commentary"}, "input[0].phase"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "n"}, "input[0].namespace"),
    ({"role": "tool", "content": "x"}, "role"),
])
def test_other_item_and_part_types_are_a_400_naming_them(item, says):
    rejected(BASE | {"input": [item]}, "input", says)


@pytest.mark.parametrize("body, param, says", [
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools", "tools[0].defer_loading"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice",
     "allowed_tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "functions only"),
])
def test_hosted_tools_and_their_tool_choices_are_a_400(body, param, says):
    rejected(BASE | body, param, says)


def test_background_needs_store():
    rejected(BASE | {"background": True, "store": False}, "background", "needs `store`")
    assert parse(BASE | {"background": True}).background


def test_metadata_is_up_to_sixteen_string_pairs():
    rejected(BASE | {"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16")
    rejected(BASE | {"metadata": {"k": 1}}, "metadata", "strings")
    assert parse(BASE | {"metadata": {"a": "1"}}).metadata == (("a", "1"),)


def test_include_of_logprobs_is_a_400_and_of_items_never_written_includes_nothing():
    rejected(BASE | {"include": ["message.output_text.logprobs"]}, "include", "no logprobs")
    rejected(BASE | {"include": ["everything"]}, "include", "'everything'")
    assert parse(BASE | {"include": ["reasoning.encrypted_content"]}).include == ("reasoning.encrypted_content",)


def test_a_json_schema_format_needs_its_name_and_schema():
    rejected(BASE | {"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "name")
    rejected(BASE | {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema")
    rejected(BASE | {"text": {"format": {"type": "xml"}}}, "text.format", "'xml'")


def test_chat_errors_name_the_responses_fields():
    bad_name = BASE | {"tools": [{"type": "function", "name": "no spaces allowed"}]}
    with pytest.raises(ApiError) as caught:
        chat_of(bad_name)
    error = relabel(caught.value)
    assert error.param == "tools" and "tools[0].name" in error.message and ".function." not in error.message
    both = BASE | {"text": {"format": {"type": "json_object"}}, "structured_outputs": {"json_object": True}}
    with pytest.raises(ApiError) as caught:
        chat_of(both)
    assert "`text.format`" in relabel(caught.value).message


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from gateway.model import ServedModel
    from shared.settings import Settings

    return ServedModel.load(Settings(model=str(tiny_model_dir)))


def test_the_chat_call_runs_the_body_and_its_context_error_names_max_output_tokens(model):
    call = chat_call(parse_chat(chat_body(parse({"input": "hi", "max_output_tokens": 5}), []), model.name, VOCAB),
                     model)
    assert call.params.max_tokens == 5
    with pytest.raises(ApiError) as caught:
        chat_call(parse_chat(chat_body(parse({"input": "hi", "max_output_tokens": 10**6}), []), model.name, VOCAB),
                  model)
    error = relabel(caught.value)
    assert (error.param, error.code) == ("max_output_tokens", "context_length_exceeded")
    assert "`max_output_tokens`" in error.message and "the input" in error.message


HONOURED = {"model": MODEL, "input": [{"role": "user", "content": "yo"}], "instructions": "Be brief.",
            "max_output_tokens": 3, "temperature": 0.2, "top_p": 0.5, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "text": {"format": {"type": "json_object"}}, "stream": True, "store": False,
            "background": True, "previous_response_id": "resp_1", "metadata": {"a": "b"}, "user": "u",
            "safety_identifier": "s", "max_tool_calls": 2, "top_k": 3, "seed": 1, "stop": ["x"],
            "repetition_penalty": 1.1, "ignore_eos": True, "skip_special_tokens": False,
            "include_stop_str_in_output": True, "logit_bias": {"5": 1.0}, "structured_outputs": {"json_object": True},
            "chat_template_kwargs": {"a": 1}, "priority": -1, "cache_salt": "salt"}
VACUOUS = {"include"}  # its values name items this server never writes (tested above)


@pytest.mark.parametrize("name", sorted(n for n, f in fields.RESPONSES.items() if not f.refused and n not in VACUOUS))
def test_a_honoured_field_changes_the_chat_call_or_the_response(name):
    plain = {"input": "hi"} | ({"tools": TOOLS} if name == "tool_choice" else {})
    plain, asked = parse(plain), parse(plain | {name: HONOURED[name]})
    changed = chat_body(asked, []) != chat_body(plain, []) or \
        ResponseShape(asked, RID, 1, MODEL).whole(TEXT_ANSWER) != ResponseShape(plain, RID, 1, MODEL).whole(TEXT_ANSWER)
    assert changed


# ---- the response, whole and streamed --------------------------------------------------------------------------------

def answer_of(tokens: list[str], finish: str) -> Answer:
    return stream_of(tokens, finish)[1]


def stream_of(tokens: list[str], finish: str) -> tuple[list[Step], Answer]:
    """The steps a route feeds for these tokens' text (read for hermes tool calls, as gateway.tools does), and the
    answer they add up to."""
    parser = CallParser(HERMES, "an-answer")
    steps = []
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        piece = parser.feed(token, end=last)
        steps.append(Step(piece.content, piece.calls, finish if last else None, None))
    text = "".join(s.content for s in steps)
    return steps, Answer(text, tuple(parser.calls), finish, None, Usage(11, len(tokens), 4))


TEXT_TOKENS = ["Paris", " is", " big", ".", " 東京", " 🚀"]
TEXT_ANSWER = answer_of(TEXT_TOKENS, "stop")
CALL_TOKENS = ["Let me", " check.", "\n<tool_", "call>\n{\"name\": \"get_time\", ", "\"arguments\": {\"tz\": ",
               "\"UTC\"}}\n</tool_call>", "\n<tool_call>\n{\"name\": \"get_date\", \"arguments\": {}}",
               "\n</tool_call>"]
CASES = {"text": (TEXT_TOKENS, "stop"), "tool calls": (CALL_TOKENS, "stop"), "cut": (TEXT_TOKENS[:3], "length"),
         "cut call": (CALL_TOKENS[:5], "length"), "cut call later": (CALL_TOKENS[:5] + ['"U'], "length"),
         "cancelled": (TEXT_TOKENS[:2], "abort")}


def shape(**body) -> ResponseShape:
    return ResponseShape(parse(BASE | {"tools": TOOLS} | body), RID, 1700000000, MODEL)


def run(s: ResponseShape, steps: list[Step], answer: Answer) -> list[Event]:
    return s.opening() + [e for step in steps for e in s.step(step)] + s.closing(answer)


def test_a_text_answer_is_a_completed_response_the_client_reads():
    body = shape(instructions="Be brief.", metadata={"k": "v"}, max_output_tokens=50).whole(TEXT_ANSWER)
    response = Response.model_validate(body)
    assert "output_text" not in body and response.output_text == TEXT_ANSWER.content
    assert (response.status, response.instructions, response.metadata, response.max_output_tokens) == (
        "completed", "Be brief.", {"k": "v"}, 50)
    assert response.output[0].id == item_id(RID, "message", "0")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens, usage.input_tokens_details.cached_tokens) == (
        11, len(TEXT_TOKENS), 11 + len(TEXT_TOKENS), 4)


def test_tool_calls_are_function_call_items_after_the_text():
    calls = answer_of(CALL_TOKENS, "stop")
    response = Response.model_validate(shape().whole(calls))
    message, time, date = response.output
    assert (message.type, response.output_text) == ("message", "Let me check.\n")
    assert [(c.type, c.call_id, c.name, json.loads(c.arguments), c.status) for c in (time, date)] == [
        ("function_call", calls.calls[0].id, "get_time", {"tz": "UTC"}, "completed"),
        ("function_call", calls.calls[1].id, "get_date", {}, "completed")]
    assert [t.name for t in response.tools] == ["get_time", "get_date"] and response.tools[0].strict


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    response = Response.model_validate(shape().whole(answer_of(TEXT_TOKENS[:3], "length")))
    assert (response.status, response.incomplete_details.reason, response.output[0].status) == (
        "incomplete", "max_output_tokens", "incomplete")


@pytest.mark.parametrize("status", ["queued", "in_progress", "cancelled", "failed"])
def test_the_stored_response_validates_at_every_stage(status):
    s = shape()
    so_far = answer_of(TEXT_TOKENS[:2], "abort" if status == "cancelled" else None)
    error = {"code": "server_error", "message": "a worker failed"} if status == "failed" else None
    response = Response.model_validate(s.body(status, None if status == "queued" else so_far, error))
    assert response.status == status and (response.error is not None) == (status == "failed")
    assert response.output_text == ("" if status == "queued" else "Paris is")
    assert (response.usage is None) == (status in ("queued", "in_progress"))


@pytest.mark.parametrize("case", list(CASES))
def test_every_streamed_event_is_one_the_client_types_numbered_from_zero(case):
    steps, answer = stream_of(*CASES[case])
    events = run(shape(), steps, answer)
    parsed = [EVENTS.validate_python(e.data) for e in events]
    assert [p.sequence_number for p in parsed] == list(range(len(events)))
    assert all(e.name == e.data["type"] for e in events)
    ends = {"stop": "response.completed", "length": "response.incomplete", "abort": "response.incomplete"}
    assert (parsed[0].type, parsed[-1].type) == ("response.created", ends[answer.finish_reason])


@pytest.mark.parametrize("case", list(CASES))
def test_the_stream_adds_up_to_the_whole_response(case):
    steps, answer = stream_of(*CASES[case])
    s = shape()
    events = run(s, steps, answer)
    assert events[-1].data["response"] == s.whole(answer)
    deltas = "".join(e.data["delta"] for e in events if e.name == "response.output_text.delta")
    assert deltas == answer.content
    for call in answer.calls:
        item = next(e.data["item"]["id"] for e in events if e.name == "response.output_item.added"
                    and e.data["item"].get("call_id") == call.id)
        arguments = "".join(e.data["delta"] for e in events if e.name == "response.function_call_arguments.delta"
                            and e.data["item_id"] == item)
        assert arguments == call.arguments
    added = [e.data["output_index"] for e in events if e.name == "response.output_item.added"]
    done = [e.data["output_index"] for e in events if e.name == "response.output_item.done"]
    assert added == done == list(range(len(added))), "each item done before the next opens"


@pytest.mark.parametrize("case", list(CASES))
def test_the_clients_own_stream_accumulator_reads_the_events_to_the_final_response(case):
    steps, answer = stream_of(*CASES[case])
    state = ResponseStreamState(input_tools=TOOLS, text_format=omit)
    for event in run(shape(), steps, answer):
        state.handle_event(EVENTS.validate_python(event.data))  # it raises on items out of order or changed
    final = state._completed_response
    if answer.finish_reason != "stop":
        assert final is None, "the client's final response is a completed one's"
        return
    assert final.output_text == answer.content
    assert [o.call_id for o in final.output if o.type == "function_call"] == [c.id for c in answer.calls]


def test_a_call_cut_in_the_last_step_streams_as_the_text_the_response_holds():
    steps, answer = stream_of(*CASES["cut call"])
    events = run(shape(), steps, answer)
    assert not any(e.data.get("item", {}).get("type") == "function_call" for e in events)
    assert events[-1].data["response"]["output"] == [e.data["item"] for e in events
                                                     if e.name == "response.output_item.done"]


def test_a_replay_is_the_same_events():
    steps, answer = stream_of(*CASES["tool calls"])
    first, again = run(shape(), steps, answer), run(shape(), steps, answer)
    assert first == again


def test_a_failure_ends_the_stream_with_the_failed_response():
    steps, so_far = stream_of(TEXT_TOKENS[:2], None)
    s = shape()
    events = s.opening() + [e for step in steps for e in s.step(step)]
    failed = s.failure(ApiError(500, "the worker failed", type="server_error"), so_far)
    assert [e.name for e in failed] == ["response.failed"]
    event = EVENTS.validate_python(failed[0].data)
    assert event.sequence_number == len(events)
    assert (event.response.status, event.response.error.code, event.response.error.message) == (
        "failed", "server_error", "the worker failed")


def test_input_items_are_listed_in_the_clients_item_shapes_with_ids_from_the_response():
    req = parse(BASE | {"input": [
        {"role": "system", "content": "Rules."}, {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": "a"},
        {"type": "function_call", "call_id": "call_a", "name": "get_time", "arguments": "{}", "id": "fc_given"},
        {"type": "function_call_output", "call_id": "call_a", "output": "12:00"}]})
    listed = input_items(req, RID)
    for item in listed:
        ITEMS.validate_python(item)
    assert [i["id"] for i in listed] == [item_id(RID, "message", "in0"), item_id(RID, "message", "in1"),
                                         item_id(RID, "message", "in2"), "fc_given",
                                         item_id(RID, "function_call_output", "in4")]
    assert input_items(req, RID) == listed, "the same ids each time"


def test_the_stored_conversation_is_valid_input_and_reads_back_as_the_same_chat():
    req = parse(BASE | {"input": "Time?", "tools": TOOLS})
    answer = answer_of(CALL_TOKENS, "stop")
    conversation = conversation_items(req, RID, answer)
    for item in conversation:
        ITEMS.validate_python(item)
        INPUT_ITEMS.validate_python(item)
    again = chat_of(BASE | {"input": conversation, "tools": TOOLS})
    assert [(m.role, m.content, m.tool_calls) for m in again.messages] == [
        ("user", "Time?", ()), ("assistant", answer.content, answer.calls)]
