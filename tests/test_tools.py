"""Tool calling in the gateway: the grammar of each `tool_choice` (checked by llguidance itself against the calls it
must admit and refuse), the parser that reads a model's calls (whole and streamed alike), OpenAI's shapes through
the official client (`message.tool_calls`, `finish_reason: "tool_calls"`, streamed `delta.tool_calls`), the chat
template given the tools and the tool history, and the errors. The real model's constrained calls:
tests/test_real_model.py."""
from __future__ import annotations

import json
import shutil

import openai
import pytest
from test_gateway_http import HI, LiveGateway, answer, check_error

from gateway import tools
from gateway.tools import HERMES, LLAMA3_JSON, CallParser, Tool, ToolUse
from shared import constraints
from shared.settings import Settings

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer",
                  "minimum": 1, "maximum": 7}}, "required": ["city"], "additionalProperties": False}
WEATHER = Tool("get_weather", "The weather in a city", json.dumps(WEATHER_SCHEMA))
TIME = Tool("get_time", None, json.dumps({"type": "object", "properties": {"tz": {"type": "string"}},
                                          "required": ["tz"]}))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": json.loads(TIME.parameters)}}]
HERMES_ANSWER = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}", "days": 2}}'
                 '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>')
# A chat template that renders tools and their history as Qwen2.5's does (hermes), to see what the model reads.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}"
    "{{ m['content'] }}{% endif %}{% for c in m.get('tool_calls', []) %}<tool_call>\n{\"name\": \""
    "{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def stream_in_pieces(fmt, text: str, size: int) -> tuple[str, dict[int, list[str]]]:
    parser = CallParser(fmt, "an-answer")
    pieces = [parser.feed(text[i:i + size], end=i + size >= len(text)) for i in range(0, len(text), size)]
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        for d in piece.calls:
            if d.name is not None:
                assert d.index not in calls and d.id.startswith("call_")
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return "".join(p.content for p in pieces), calls


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_calls_read_the_same_streamed_in_any_pieces_as_whole(size):
    content, calls = tools.parse(HERMES, HERMES_ANSWER, "an-answer")
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"ris {x}', "days": 2}), ("get_time", {"tz": "UTC"})]
    assert stream_in_pieces(HERMES, HERMES_ANSWER, size) == (content, {i: [c.name, c.arguments]
                                                                       for i, c in enumerate(calls)})


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_time", "arguments": {"tz": "U',
                                  'Hi <tool_call>\n{"na', ' {"name": "get_time", "parameters": {"tz'])
def test_a_call_cut_short_is_answer_text_whole_and_streamed(text):
    fmt = LLAMA3_JSON if text.startswith(" ") else HERMES
    content, calls = tools.parse(fmt, text, "an-answer")
    assert (content.strip(), calls) == (text.strip(), [])  # (llama3_json's leading whitespace aside)
    assert stream_in_pieces(fmt, text, 1)[0].endswith(text.strip()[-8:])


def test_text_that_only_looked_like_a_call_is_answer_text():
    assert tools.parse(HERMES, "a < b and <tool", "an-answer") == ("a < b and <tool", [])
    assert stream_in_pieces(HERMES, "a < b and <tool", 1) == ("a < b and <tool", {})
    not_json = "<tool_call>not json</tool_call> ok"
    assert tools.parse(HERMES, not_json, "an-answer") == (not_json, [])
    # keys in another order than the grammar's: read whole at the closing tag
    reordered = '<tool_call>{"arguments": {"tz": "X"}, "name": "get_time"}</tool_call>'
    [call] = tools.parse(HERMES, reordered, "an-answer")[1]
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"tz": "X"})


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_calls_are_the_whole_answer_separated_by_semicolons(size):
    text = ' {"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    content, calls = tools.parse(LLAMA3_JSON, text, "an-answer")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Rome"})]
    assert stream_in_pieces(LLAMA3_JSON, text, size)[1] == {i: [c.name, c.arguments] for i, c in enumerate(calls)}
    assert tools.parse(LLAMA3_JSON, "It is {warm} today.", "an-answer") == ("It is {warm} today.", [])


def test_the_call_format_follows_the_setting_else_the_chat_template():
    assert tools.call_format("llama3_json", "<tool_call>") is LLAMA3_JSON
    assert tools.call_format("", "...<tool_call>...") is HERMES
    assert tools.call_format("", "{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert tools.call_format("", None) is HERMES


@pytest.fixture(scope="module")
def grammar_tokenizer(tiny_model_dir):
    from shared.model_dir import eos_token_ids

    return constraints.tokenizer((tiny_model_dir / "tokenizer.json").read_text(), 512, eos_token_ids(tiny_model_dir))


def admits(tokenizer, constraint, text: str) -> bool:
    """llguidance's own verdict: the whole text, then the end of the output, within the grammar."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, constraints.grammar(constraint), limits=constraints.limits(), log_level=0)
    return matcher.consume_tokens(matcher_tokens(tokenizer, text)) and matcher.is_accepting()


def matcher_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.tokenize_str(text)


CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
CALL_T = '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
GRAMMAR_CASES = [  # (choice, named function, parallel, text, admitted)
    ("auto", None, True, "Just an answer, no call.", True),
    ("auto", None, True, "Checking.\n" + CALL_W + "\n" + CALL_T, True),
    ("auto", None, True, 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"town": "Oslo"}}</tool_call>',
     False),  # once a call is open, its arguments follow its schema
    ("auto", None, True, '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', False),
    ("auto", None, False, CALL_W + CALL_T, False),
    ("required", None, True, CALL_W + "\n" + CALL_T, True),
    ("required", None, True, "No call.", False),
    ("required", None, True, 'Sure. ' + CALL_W, False),
    ("required", None, True, '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 9}}</tool_call>',
     False),  # days at most 7
    ("function", "get_time", True, CALL_T, True),
    ("function", "get_time", True, CALL_W, False),
    ("function", "get_time", True, CALL_T + CALL_T, False),
]


PERSON = Tool("greet", None, json.dumps({"type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}},
                                         "required": ["who"], "$defs": {"Person": {
                                             "type": "object", "properties": {"name": {"type": "string"}},
                                             "required": ["name"]}}}))


def test_a_tools_own_defs_and_refs_hold_its_arguments(grammar_tokenizer):
    """As the openai client's pydantic_function_tool writes them: the arguments' schema is a JSON root of its own."""
    constraint = tools.constraint(ToolUse((PERSON, TIME), "required"), HERMES)
    constraints.check(constraint, grammar_tokenizer)
    assert admits(grammar_tokenizer, constraint, '<tool_call>{"name": "greet", "arguments": {"who": {"name": "Al"}}}'
                                                 '</tool_call>')
    assert not admits(grammar_tokenizer, constraint, '<tool_call>{"name": "greet", "arguments": {"who": "Al"}}'
                                                     '</tool_call>')


@pytest.mark.parametrize("choice, name, parallel, text, admitted", GRAMMAR_CASES)
def test_each_tool_choice_grammar_admits_valid_calls_and_nothing_else(grammar_tokenizer, choice, name, parallel, text,
                                                                      admitted):
    constraint = tools.constraint(ToolUse((WEATHER, TIME), choice, name, parallel), HERMES)
    constraints.check(constraint, grammar_tokenizer)
    assert admits(grammar_tokenizer, constraint, text) == admitted


@pytest.mark.parametrize("choice, text, admitted", [
    ("auto", "Plain words.", True), ("auto", '{"name": "get_time", "parameters": {"tz": "UTC"}}', True),
    ("auto", '{"name": "get_time", "parameters": {}}', False),
    ("required", '{"name": "get_time", "parameters": {"tz": "UTC"}}; {"name": "get_weather", "parameters": '
                 '{"city": "Rome"}}', True),
    ("required", "Plain words.", False),
    ("auto", ' \n{"name": "launch", "parameters": {}}', False),  # whitespace first is no way around the calls' grammar
    ("auto", '\n{"name": "get_time", "parameters": {"tz": "UTC"}}', True)])
def test_llama3_json_grammars_admit_its_calls(grammar_tokenizer, choice, text, admitted):
    constraint = tools.constraint(ToolUse((WEATHER, TIME), choice), LLAMA3_JSON)
    assert admits(grammar_tokenizer, constraint, text) == admitted


def test_tool_choice_none_and_no_tools_constrain_nothing():
    assert tools.constraint(ToolUse((WEATHER,), "none"), HERMES) is None


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a chat template that renders tools (as Qwen2.5's does)."""
    path = tmp_path_factory.mktemp("tool-model") / "tiny-tools"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return path


def live(model_dir, redis_url, texts, finish="stop"):
    from gateway.model import ServedModel

    settings = Settings(model=str(model_dir), redis_url=redis_url)
    model = ServedModel.load(settings)
    eos = model.tokenizer.decode(model.eos_token_ids[:1], skip_special_tokens=False)  # the token a stop ends with
    return LiveGateway(settings, model, answer(model, [t + eos for t in texts], finish=finish))


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_calls_come_back_as_openais_tool_calls_whole_and_streamed(redis_url, tool_model_dir):
    with live(tool_model_dir, redis_url, [HERMES_ANSWER]) as gw:
        ask = dict(model=gw.model.name, messages=HI, tools=TOOLS, max_tokens=400)
        whole = client(gw).chat.completions.create(**ask)
        [choice] = whole.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert calls == [("get_weather", {"city": 'Pa"ris {x}', "days": 2}), ("get_time", {"tz": "UTC"})]
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
        request = gw.driver.requests[-1]
        assert request.params.constraint.kind == "grammar" and "get_weather" in request.params.constraint.spec

        streamed: dict[int, list[str]] = {}
        content, finish = "", None
        for chunk in client(gw).chat.completions.create(**ask, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    if d.id is not None:
                        streamed[d.index] = [d.function.name, ""]
                    streamed[d.index][1] += d.function.arguments or ""
        assert (content, finish) == ("Let me look.\n", "tool_calls")
        assert [(n, json.loads(a)) for n, a in streamed.values()] == calls

        # the openai client's own stream helper reassembles the deltas into the same message
        with client(gw).chat.completions.stream(**ask) as stream:
            final = stream.get_final_completion()
        assert [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls] \
            == calls


def test_an_answer_without_calls_is_plain_content_with_no_tool_calls(redis_url, tool_model_dir):
    with live(tool_model_dir, redis_url, ["It is sunny."]) as gw:
        answer_ = client(gw).chat.completions.create(model=gw.model.name, messages=HI, tools=TOOLS,
                                                     tool_choice="auto", max_tokens=50)
        assert answer_.choices[0].message.content == "It is sunny." and answer_.choices[0].finish_reason == "stop"
        assert not answer_.choices[0].message.tool_calls
        plain = client(gw).chat.completions.create(model=gw.model.name, messages=HI, tools=TOOLS,
                                                   tool_choice="none", max_tokens=50)
        assert gw.driver.requests[-1].params.constraint is None and plain.choices[0].message.content == "It is sunny."


@pytest.mark.parametrize("choice, parallel, schema_of", [
    ("required", True, None), ({"type": "function", "function": {"name": "get_time"}}, True, "get_time"),
    ("required", False, None)])
def test_required_and_named_choices_send_the_grammar_of_calls_alone(redis_url, tool_model_dir, grammar_tokenizer,
                                                                     choice, parallel, schema_of):
    with live(tool_model_dir, redis_url, ["x"]) as gw:
        client(gw).chat.completions.create(model=gw.model.name, messages=HI, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=parallel, max_tokens=50)
        constraint = gw.driver.requests[-1].params.constraint
    assert admits(grammar_tokenizer, constraint, CALL_T)
    assert not admits(grammar_tokenizer, constraint, "Plain words.")
    assert admits(grammar_tokenizer, constraint, CALL_W) == (schema_of is None)
    assert admits(grammar_tokenizer, constraint, CALL_T + CALL_T) == (schema_of is None and parallel)


def test_the_chat_template_is_given_the_tools_and_the_calls_and_answers_so_far(redis_url, tool_model_dir):
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]
    with live(tool_model_dir, redis_url, ["x"]) as gw:
        reply = gw.post("/tokenize", json={"messages": history, "tools": TOOLS, "return_token_strs": False})
        assert reply.status == 200, reply.text
        text = gw.post("/detokenize", json={"tokens": reply.json()["tokens"]}).json()["prompt"]
        client(gw).chat.completions.create(model=gw.model.name, messages=history, tools=TOOLS, max_tokens=5)
        prompt = gw.driver.requests[-1].prompt_token_ids
    assert '"name": "get_weather"' in text and "The weather in a city" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text  # arguments as a mapping
    assert "<|im_start|>tool\n12 C, rain" in text
    assert prompt == reply.json()["tokens"]


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "functions only"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "two tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    ({"tools": TOOLS, "use_beam_search": True, "best_of": 2}, "best_of", "constrained"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "tools", "does not compile"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parmeters": {}}}]}, "tools",
     "`tools[0].function.parmeters` is not a field"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools", "`tools[0].extra`"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     "schema of an object"),
    ({"tools": TOOLS, "allowed_token_ids": [5]}, "allowed_token_ids", "constrained"),
]


@pytest.mark.parametrize("fields, param, fragment", BAD, ids=[f"{b[1]}:{b[2]}" for b in BAD])
def test_a_bad_tool_request_is_a_400_naming_the_field(redis_url, tool_model_dir, fields, param, fragment):
    with live(tool_model_dir, redis_url, ["x"]) as gw:
        check_error(gw.post("/v1/chat/completions", json={"messages": HI} | fields), 400, param, fragment)
        assert not gw.driver.requests

