"""The request model: each route's JSON body parsed once into one immutable, validated value (sans-IO).

Every field is looked up in the route's table (gateway/fields.py): a refused field, or one neither OpenAI nor vLLM
defines, is a 400 naming it; a honoured one is converted and checked here, each error naming its parameter. Value
ranges that the bus also enforces (temperature, top_p, ...) are checked where the bus parameters are built
(gateway/calls.py, through SamplingParams.validate), so that one rule holds on both sides of the bus.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from gateway import fields
from gateway.errors import ApiError, bad_request
from gateway.fields import Field
from gateway.tools import Tool, ToolCall, ToolUse
from shared.sampling import Constraint

MAX_LOGIT_BIAS_ENTRIES = 1024  # as vLLM
MAX_ALLOWED_TOKEN_IDS = 1024
_INT64 = (-(2**63), 2**63 - 1)
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


@dataclass(frozen=True, slots=True)
class Sampling:
    """The generation fields the completions and chat routes share, as sent (None: not sent)."""
    n: int | None
    best_of: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logit_bias: tuple[tuple[int, float], ...]
    allowed_token_ids: tuple[int, ...] | None
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    min_tokens: int | None
    skip_special_tokens: bool
    use_beam_search: bool
    length_penalty: float | None
    early_stopping: bool | str | None
    prompt_logprobs: int | None
    truncate_prompt_tokens: int | None
    truncation_side: str
    return_token_ids: bool
    return_tokens_as_token_ids: bool
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    user: str | None
    priority: int  # lower runs first, under the priority policy
    cache_salt: str  # "" unless sent: blocks are shared only between requests of one tenant and one salt
    constraint: Constraint | None  # structured outputs
    constraint_param: str | None  # the field that asked for it, for errors


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompts: tuple[str | tuple[int, ...], ...]
    echo: bool
    logprobs: int | None  # top k per output token; None: no logprobs
    max_tokens: int | None
    add_special_tokens: bool
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            # templates read the arguments as a mapping (as vLLM hands them over), or as text where they are no JSON
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _json_or_text(c.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """How the chat template renders the messages."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    kwargs: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    template: ChatTemplate
    logprobs: int | None  # top_logprobs when logprobs is true (0: the chosen token's alone); None: no logprobs
    max_tokens: int | None
    max_tokens_param: str  # the name it came as: max_completion_tokens or max_tokens
    echo: bool
    return_prompt_text: bool
    safety_identifier: str | None
    tool_use: ToolUse | None  # None: no tools offered
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    prompt: str | None  # a prompt, or the messages
    messages: tuple[Message, ...] | None
    add_special_tokens: bool
    template: ChatTemplate
    return_token_strs: bool
    tools: tuple[Tool, ...] = ()  # rendered with the messages


@dataclass(frozen=True, slots=True)
class DetokenizeRequest:
    tokens: tuple[int, ...]


class Body:
    """A JSON object body checked against its route's table: `get` converts one honoured field."""

    def __init__(self, raw: Any, table: dict[str, Field], where: str = "",
                 undefined: str = "neither OpenAI nor vLLM defines it") -> None:
        if not isinstance(raw, dict):
            what = f"`{where}`" if where else "the request body"
            raise bad_request(f"{what} must be a JSON object, not {kind_of(raw)}", param=where or None)
        self.raw = raw
        self.where = where
        for name, value in raw.items():
            f = table.get(name)
            param = self.param(name)
            if f is None:
                raise bad_request(f"`{param}` is not a field of this route ({undefined}); see the README's field "
                                  "list", param=param, code="unknown_field")
            if f.refuses(value):
                raise bad_request(f"`{param}` is not supported by this server: {f.meaning}", param=param,
                                  code="unsupported")

    def param(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def get(self, name: str, tp: type, default: Any = None) -> Any:
        """The field converted to `tp`, or `default` when absent or null; 400 naming the field otherwise."""
        return convert(self.raw.get(name), tp, self.param(name), default)


def convert(value: Any, tp: type, param: str, default: Any = None) -> Any:
    if value is None:
        return default
    if tp is float and type(value) in (int, float):
        if not math.isfinite(value):
            raise bad_request(f"`{param}` must be a finite number; got {value}", param=param)
        return float(value)
    if tp is int and type(value) is float and value.is_integer():
        value = int(value)
    if type(value) is not tp:
        raise bad_request(f"`{param}` must be {_KIND_NAMES[tp]}, not {kind_of(value)}", param=param)
    if tp is int and not _INT64[0] <= value <= _INT64[1]:
        raise bad_request(f"`{param}` must fit in a signed 64-bit integer; got {value}", param=param)
    if tp is str:
        utf8(value, param)
    return value


def kind_of(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for tp, name in _KIND_NAMES.items() if type(value) is tp), type(value).__name__)


def utf8(text: str, param: str) -> str:
    """The text, or 400 when it holds what JSON can carry but UTF-8 cannot: a lone surrogate (\\ud800)."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise bad_request(f"`{param}` holds a lone surrogate (U+{ord(e.object[e.start]):04X}), which is not "
                          "text", param=param) from None
    return text


def check_model(body: Body, served: str) -> None:
    name = body.get("model", str, served)
    if name != served:
        raise ApiError(404, f"the model `{name}` does not exist; this server serves `{served}`", param="model",
                       code="model_not_found")


def check_ids(ids: tuple[int, ...] | list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:8]))} in `{param}` "
                          f"{'are' if len(bad) > 1 else 'is'} outside the vocabulary: its size is {vocab_size}",
                          param=param)


def _token_ids(body: Body, name: str, vocab_size: int) -> tuple[int, ...] | None:
    raw = body.get(name, list)
    if raw is None:
        return None
    if not all(type(t) is int for t in raw):
        raise bad_request(f"`{name}` must be an array of integers", param=name)
    check_ids(raw, vocab_size, name)
    return tuple(raw)


def _logit_bias(body: Body, vocab_size: int) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias", dict, {})
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"`logit_bias` has {len(raw)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}",
                          param="logit_bias")
    out = []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"`logit_bias` keys must be token ids; got {key!r}", param="logit_bias") from None
        out.append((token, convert(value, float, "logit_bias")))
    check_ids([t for t, _ in out], vocab_size, "logit_bias")
    return tuple(sorted(out))


def _stop(body: Body) -> tuple[str, ...]:
    raw = body.raw.get("stop")
    stops = [raw] if isinstance(raw, str) else raw if raw is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("`stop` must be a non-empty string or an array of non-empty strings", param="stop")
    return tuple(utf8(s, "stop") for s in stops)


def _sampling(body: Body, vocab_size: int) -> Sampling:
    stream = body.get("stream", bool, False)
    options = Body(body.raw["stream_options"], fields.STREAM_OPTIONS, "stream_options") \
        if body.has("stream_options") else None
    if options is not None and not stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true", param="stream_options")
    early = body.raw.get("early_stopping")
    if early not in (None, True, False, "never"):
        raise bad_request(f"`early_stopping` must be true, false or \"never\"; got {early!r}", param="early_stopping")
    side = body.get("truncation_side", str, "left")
    if side not in ("left", "right"):
        raise bad_request(f"`truncation_side` must be \"left\" or \"right\"; got {side!r}", param="truncation_side")
    allowed = _token_ids(body, "allowed_token_ids", vocab_size)
    if allowed is not None and not 0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS:
        raise bad_request(f"`allowed_token_ids` must hold 1 to {MAX_ALLOWED_TOKEN_IDS} ids", param="allowed_token_ids")
    return Sampling(
        n=body.get("n", int), best_of=body.get("best_of", int), temperature=body.get("temperature", float),
        top_p=body.get("top_p", float), top_k=body.get("top_k", int), min_p=body.get("min_p", float),
        seed=body.get("seed", int), presence_penalty=body.get("presence_penalty", float),
        frequency_penalty=body.get("frequency_penalty", float),
        repetition_penalty=body.get("repetition_penalty", float), logit_bias=_logit_bias(body, vocab_size),
        allowed_token_ids=allowed, stop=_stop(body),
        include_stop_str_in_output=body.get("include_stop_str_in_output", bool, False),
        stop_token_ids=_token_ids(body, "stop_token_ids", vocab_size) or (),
        ignore_eos=body.get("ignore_eos", bool, False), min_tokens=body.get("min_tokens", int),
        skip_special_tokens=body.get("skip_special_tokens", bool, True),
        use_beam_search=body.get("use_beam_search", bool, False), length_penalty=body.get("length_penalty", float),
        early_stopping=early, prompt_logprobs=body.get("prompt_logprobs", int),
        truncate_prompt_tokens=body.get("truncate_prompt_tokens", int), truncation_side=side,
        return_token_ids=body.get("return_token_ids", bool, False),
        return_tokens_as_token_ids=body.get("return_tokens_as_token_ids", bool, False),
        stream=stream, include_usage=options is not None and options.get("include_usage", bool, False),
        continuous_usage_stats=options is not None and options.get("continuous_usage_stats", bool, False),
        user=body.get("user", str), priority=body.get("priority", int, 0), cache_salt=_cache_salt(body),
        **_constraint(body))


def _cache_salt(body: Body) -> str:
    salt = body.get("cache_salt", str, "")
    if body.has("cache_salt") and not salt:
        raise bad_request("`cache_salt` must be a non-empty string when sent", param="cache_salt")
    return salt


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _constraint(body: Body) -> dict[str, Any]:
    """The one constraint a body asks for (response_format, structured_outputs or vLLM's older guided_* fields)."""
    asked = [name for name in ("response_format", "structured_outputs", *GUIDED) if body.has(name)]
    fmt = body.raw.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1:
        asked.remove("response_format")  # asks for nothing
    if len(asked) > 1:
        raise bad_request(f"send one constraint, not {' and '.join(f'`{a}`' for a in asked)}", param=asked[1])
    if not asked:
        return {"constraint": None, "constraint_param": None}
    param = asked[0]
    if param == "response_format":
        constraint = _response_format(fmt)
    elif param == "structured_outputs":
        constraint = _structured_outputs(Body(body.raw[param], fields.STRUCTURED_OUTPUTS, param))
    else:
        constraint = _outputs(GUIDED[param], body.raw[param], param)
    return {"constraint": constraint, "constraint_param": param}


def _response_format(fmt: Any) -> Constraint:
    if not isinstance(fmt, dict):
        raise bad_request("`response_format` must be an object", param="response_format")
    kind = fmt.get("type")
    extra = next((k for k in fmt if k not in ("type", "json_schema")), None)
    if extra is not None:
        raise bad_request(f"`response_format.{extra}` is not a field of response_format", param="response_format")
    if kind == "json_object":
        return _outputs("json_object", True, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("`response_format.json_schema` must be an object with the `schema` (and a `name`)",
                              param="response_format")
        odd = next((k for k in spec if k not in ("name", "schema", "strict", "description")), None)
        if odd is not None:
            raise bad_request(f"`response_format.json_schema.{odd}` is not a field of json_schema",
                              param="response_format")
        return _outputs("json", spec["schema"], "response_format")
    raise bad_request(f"`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"; got {kind!r}",
                      param="response_format")


def _structured_outputs(body: Body) -> Constraint:
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if body.has(k)]
    if len(kinds) != 1:
        raise bad_request("`structured_outputs` takes exactly one of json, regex, choice, grammar or json_object; "
                          f"got {', '.join(kinds) or 'none'}", param="structured_outputs")
    constraint = _outputs(kinds[0], body.raw[kinds[0]], "structured_outputs")
    if body.get("disable_any_whitespace", bool, False):
        if constraint.kind != "json_schema":
            raise bad_request("`structured_outputs.disable_any_whitespace` applies to JSON", param="structured_outputs")
        constraint = Constraint(constraint.kind, constraint.spec, compact=True)
    return constraint


def _outputs(kind: str, value: Any, param: str) -> Constraint:
    """A constraint of vLLM's kinds (json, regex, choice, grammar, json_object) as the bus carries it."""
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"`{param}`: json_object must be true", param=param)
        return Constraint("json_schema", '{"type": "object"}')
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise bad_request(f"`{param}`: the JSON schema is not JSON: {e}", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"`{param}`: a JSON schema is an object, not {kind_of(value)}", param=param)
        return Constraint("json_schema", json.dumps(value))  # key order kept: it is the output's order
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"`{param}`: choice must be a non-empty array of strings", param=param)
        return Constraint("choice", json.dumps([utf8(c, param) for c in value]))
    if not isinstance(value, str) or not value:
        raise bad_request(f"`{param}`: {kind} must be a non-empty string", param=param)
    return Constraint(kind, utf8(value, param))


def _prompts(raw: Any, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    if raw is None:
        raise bad_request("`prompt` is required", param="prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(type(t) is int for t in raw)):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise bad_request("`prompt` must be a non-empty string, a list of token ids, or a list of either",
                          param="prompt")
    prompts: list[str | tuple[int, ...]] = []
    for item in raw:
        if isinstance(item, str):
            if not item:
                raise bad_request("`prompt` must not be empty", param="prompt")
            prompts.append(utf8(item, "prompt"))
        elif isinstance(item, list) and item and all(type(t) is int for t in item):
            check_ids(item, vocab_size, "prompt")
            prompts.append(tuple(item))
        else:
            raise bad_request("each prompt must be a non-empty string or a non-empty list of token ids, "
                              f"not {kind_of(item) if item != [] else 'an empty array'}", param="prompt")
    return tuple(prompts)


def parse_completion(raw: Any, served: str, vocab_size: int) -> CompletionRequest:
    body = Body(raw, fields.COMPLETIONS)
    check_model(body, served)
    return CompletionRequest(prompts=_prompts(raw.get("prompt"), vocab_size), echo=body.get("echo", bool, False),
                             logprobs=body.get("logprobs", int), max_tokens=body.get("max_tokens", int),
                             add_special_tokens=body.get("add_special_tokens", bool, True),
                             sampling=_sampling(body, vocab_size))


def _content(raw: Any, i: int) -> str:
    if raw is None or isinstance(raw, str):
        return utf8(raw or "", "messages")
    if isinstance(raw, list):
        parts = []
        for part in raw:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                  "this server takes text only", param="messages")
            parts.append(part["text"])
        return utf8("".join(parts), "messages")
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts, not {kind_of(raw)}",
                      param="messages")


MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


def messages(raw: Any) -> tuple[Message, ...]:
    """Chat messages: any role (the chat template decides which it takes), text content, an optional name; an
    assistant's tool calls, a tool's answer with the id of the call it answers."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("`messages` must be a non-empty array of messages", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object, not {kind_of(m)}", param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"messages[{i}].role must be a non-empty string; got {role!r}", param="messages")
        extra = next((k for k, v in m.items() if k not in MESSAGE_KEYS and v is not None), None)
        if extra is not None:
            raise bad_request(f"messages[{i}].{extra} is not supported by this server (messages carry a role, text "
                              "content, a name, tool calls and a tool call's id)", param="messages",
                              code="unsupported")
        name, call_id = m.get("name"), m.get("tool_call_id")
        for key, value in (("name", name), ("tool_call_id", call_id)):
            if value is not None and not isinstance(value, str):
                raise bad_request(f"messages[{i}].{key} must be a string", param="messages")
        out.append(Message(utf8(role, "messages"), _content(m.get("content"), i),
                           None if name is None else utf8(name, "messages"), _tool_calls(m.get("tool_calls"), i),
                           None if call_id is None else utf8(call_id, "messages")))
    return tuple(out)


def _tool_calls(raw: Any, i: int) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls` as OpenAI returns them."""
    if raw is None:
        return ()
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be an array", param="messages")
    calls = []
    for j, call in enumerate(raw):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str) and call.get("type", "function") == "function"
                and isinstance(call.get("id", ""), str)):
            raise bad_request(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\" (a string)}}}", param="messages")
        calls.append(ToolCall(utf8(call.get("id", ""), "messages"), utf8(function["name"], "messages"),
                              utf8(function.get("arguments", ""), "messages")))
    return tuple(calls)


TOOL_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _tool_use(body: Body) -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI defines them."""
    raw = body.raw.get("tools")
    choice = body.raw.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_request("`tool_choice` needs `tools`", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise bad_request("`tools` must be an array of tools", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}: this server "
                              "calls functions only", param="tools")
        odd = next((f"tools[{i}].{k}" for k in tool if k not in ("type", "function")), None) or next(
            (f"tools[{i}].function.{k}" for k in function if k not in TOOL_FUNCTION_KEYS), None)
        if odd is not None:
            raise bad_request(f"`{odd}` is not a field of a function tool", param="tools")
        name, description = function.get("name"), function.get("description")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if isinstance(parameters, dict) and "type" not in parameters:
            parameters = parameters | {"type": "object"}  # arguments are an object, whatever else the schema says
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -; got {name!r}",
                              param="tools")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"tools[{i}].function.description must be a string", param="tools")
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of an object (a function's "
                              "arguments are named)", param="tools")
        if any(t.name == name for t in tools):
            raise bad_request(f"tools[{i}]: two tools are named {name!r}", param="tools")
        tools.append(Tool(name, None if description is None else utf8(description, "tools"), json.dumps(parameters)))
    parallel = body.get("parallel_tool_calls", bool, True)
    if choice is None or choice in ("none", "auto", "required"):
        return ToolUse(tuple(tools), choice or "auto", None, parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str)):
        raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", param="tool_choice")
    if not any(t.name == function["name"] for t in tools):
        raise bad_request(f"`tool_choice` names {function['name']!r}, which is not among `tools`", param="tool_choice")
    return ToolUse(tuple(tools), "function", function["name"], parallel)


def _template(body: Body, add_special_tokens: bool) -> ChatTemplate:
    kwargs = body.get("chat_template_kwargs", dict, {})
    reserved = next((k for k in kwargs if k in ("chat_template", "tokenize", "messages", "conversations", "tools",
                                                  "documents", "add_generation_prompt", "continue_final_message",
                                                  "return_assistant_tokens_mask")), None)
    if reserved is not None:
        raise bad_request(f"`chat_template_kwargs` may not set `{reserved}`", param="chat_template_kwargs")
    template = ChatTemplate(add_generation_prompt=body.get("add_generation_prompt", bool, True),
                            continue_final_message=body.get("continue_final_message", bool, False),
                            add_special_tokens=body.get("add_special_tokens", bool, add_special_tokens),
                            kwargs=tuple(sorted(kwargs.items())))
    if template.continue_final_message and template.add_generation_prompt:
        raise bad_request("`continue_final_message` continues the last message, which cannot go with "
                          "`add_generation_prompt` (true by default): send `add_generation_prompt: false`",
                          param="continue_final_message")
    return template


def parse_chat(raw: Any, served: str, vocab_size: int) -> ChatRequest:
    body = Body(raw, fields.CHAT)
    check_model(body, served)
    want = body.get("logprobs", bool, False)
    top = body.get("top_logprobs", int)
    if top is not None and top != 0 and not want:
        raise bad_request("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
    max_param = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    return ChatRequest(messages=messages(raw.get("messages")), template=_template(body, False),
                       logprobs=(top or 0) if want else None, max_tokens=body.get(max_param, int),
                       max_tokens_param=max_param, echo=body.get("echo", bool, False),
                       return_prompt_text=body.get("return_prompt_text", bool, False),
                       safety_identifier=body.get("safety_identifier", str), tool_use=_tool_use(body),
                       sampling=_sampling(body, vocab_size))


def parse_tokenize(raw: Any, served: str) -> TokenizeRequest:
    """`POST /tokenize` in either of vLLM's forms: a `prompt`, or chat `messages` (with their template fields)."""
    body = Body(raw, fields.TOKENIZE)
    check_model(body, served)
    if body.has("messages"):
        if body.has("prompt"):
            raise bad_request("send `prompt` or `messages`, not both", param="prompt")
        use = _tool_use(body)
        return TokenizeRequest(None, messages(raw["messages"]), False, _template(body, False),
                               body.get("return_token_strs", bool, False), use.tools if use is not None else ())
    chat_only = next((k for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
                      if body.has(k)), None)
    if chat_only is not None:
        raise bad_request(f"`{chat_only}` applies to `messages`, not to a `prompt`", param=chat_only)
    prompt = raw.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("`prompt` (a string) or `messages` is required", param="prompt")
    return TokenizeRequest(utf8(prompt, "prompt"), None, body.get("add_special_tokens", bool, True), ChatTemplate(),
                           body.get("return_token_strs", bool, False))


def parse_detokenize(raw: Any, served: str, vocab_size: int) -> DetokenizeRequest:
    body = Body(raw, fields.DETOKENIZE)
    check_model(body, served)
    ids = raw.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise bad_request("`tokens` must be an array of token ids", param="tokens")
    check_ids(ids, vocab_size, "tokens")
    return DetokenizeRequest(tuple(ids))
