"""OpenAI's Responses API (`POST /v1/responses`, the stored response and its input items) as pure parsing and
shaping: a body is parsed once into a ResponsesRequest, which becomes the body of a chat call (the chat request model
then checks and runs it, its errors relabelled to the Responses fields), and the single-choice answer is written back
as a Response, whole or as OpenAI's typed stream events.

Items: a request's input (and a stored conversation) is a list of items, each a message, a function call or a
function call's output. Stored items are written in the shapes `GET /v1/responses/{id}/input_items` lists, which are
valid input items too, so a stored conversation reads back through the same parser as a request's input.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway import fields
from gateway.answer import Answer, Event, Step, Usage
from gateway.errors import ApiError, bad_request
from gateway.request_model import Body, convert, kind_of, utf8

MAX_METADATA = 16  # pairs, as OpenAI
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
# OpenAI's includable values; all but logprobs name items this server never writes, so they include nothing.
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")
LOGPROBS = "message.output_text.logprobs"
TOOL_CHOICES = ("none", "auto", "required")
FORMATS = ("text", "json_object", "json_schema")
ITEM_STATUSES = (None, "in_progress", "completed", "incomplete")
CHAT_ROLES = {"developer": "system"}  # chat templates know the system's role; OpenAI's developer messages are its
PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}  # item ids, as OpenAI's
RELABELS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
# OpenAI defines no stream event for a cancelled response: it ends as the one that is not an error, incomplete.
ENDS = {"completed": "response.completed", "incomplete": "response.incomplete", "cancelled": "response.incomplete"}


@dataclass(frozen=True, slots=True)
class MessageItem:
    role: str  # user, system, developer or assistant
    texts: tuple[str, ...]  # its text parts
    id: str | None = None

    def listed(self, item_id: str) -> dict[str, Any]:
        if self.role == "assistant":
            return _message(item_id, "".join(self.texts), "completed")
        return {"id": item_id, "type": "message", "role": self.role, "status": "completed",
                "content": [{"type": "input_text", "text": t} for t in self.texts]}


@dataclass(frozen=True, slots=True)
class FunctionCallItem:
    call_id: str
    name: str
    arguments: str  # its JSON text, as the model wrote it
    id: str | None = None

    def listed(self, item_id: str) -> dict[str, Any]:
        return _call(item_id, self.call_id, self.name, self.arguments, "completed")


@dataclass(frozen=True, slots=True)
class FunctionOutputItem:
    call_id: str
    output: str
    id: str | None = None

    def listed(self, item_id: str) -> dict[str, Any]:
        return {"id": item_id, "type": "function_call_output", "call_id": self.call_id, "output": self.output,
                "status": "completed"}


Item = MessageItem | FunctionCallItem | FunctionOutputItem
KINDS = {MessageItem: "message", FunctionCallItem: "function_call", FunctionOutputItem: "function_call_output"}


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: str | None  # its JSON schema's text (None: not sent); text, so that the value is hashable
    strict: bool  # Responses' default is true; the calls are held to the schema either way

    def echoed(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description, "strict": self.strict,
                "parameters": None if self.parameters is None else json.loads(self.parameters)}

    def for_chat(self) -> dict[str, Any]:
        function = {"name": self.name, "strict": self.strict}
        for key, value in (("description", self.description), ("parameters", self.parameters)):
            if value is not None:
                function[key] = json.loads(value) if key == "parameters" else value
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class TextFormat:
    """`text.format`: plain text, any JSON object, or JSON that a schema (its text) describes."""
    type: str = "text"
    name: str | None = None
    schema: str | None = None
    strict: bool | None = None
    description: str | None = None

    def echoed(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "name": self.name, "schema": json.loads(self.schema), "strict": self.strict,
                "description": self.description}

    def for_chat(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": self.name, "schema": json.loads(self.schema)}
        for key, value in (("strict", self.strict), ("description", self.description)):
            if value is not None:
                spec[key] = value
        return {"type": "json_schema", "json_schema": spec}


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str | None
    input: tuple[Item, ...]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: tuple[FunctionTool, ...]
    tool_choice: str | None  # "none", "auto", "required" or "function" (the one `tool_name` names); None: not sent
    tool_name: str | None
    parallel_tool_calls: bool
    text_format: TextFormat
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    metadata: tuple[tuple[str, str], ...]
    user: str | None
    safety_identifier: str | None
    include: tuple[str, ...]
    max_tool_calls: int | None
    chat_fields: str  # vLLM's fields that chat takes too (fields.RESPONSES_FROM_CHAT), a JSON object's text as sent


def parse(raw: Any) -> ResponsesRequest:
    """A `POST /v1/responses` body, every field checked against its table (gateway/fields.py)."""
    body = Body(raw, fields.RESPONSES)
    store, background = body.get("store", bool, True), body.get("background", bool, False)
    if background and not store:
        raise bad_request("`background` needs `store`: a background response is fetched later, so it is stored "
                          "(`store` is true unless sent false)", param="background")
    choice, name = _tool_choice(raw.get("tool_choice"))
    max_tool_calls = body.get("max_tool_calls", int)
    if max_tool_calls is not None and max_tool_calls < 0:
        raise bad_request(f"`max_tool_calls` must be at least 0; got {max_tool_calls}", param="max_tool_calls")
    return ResponsesRequest(
        model=body.get("model", str), input=items(raw["input"], "input") if body.has("input") else (),
        instructions=body.get("instructions", str), max_output_tokens=body.get("max_output_tokens", int),
        temperature=body.get("temperature", float), top_p=body.get("top_p", float), tools=_tools(body),
        tool_choice=choice, tool_name=name, parallel_tool_calls=body.get("parallel_tool_calls", bool, True),
        text_format=_text(body), stream=body.get("stream", bool, False), store=store, background=background,
        previous_response_id=body.get("previous_response_id", str), metadata=_metadata(body.get("metadata", dict, {})),
        user=body.get("user", str), safety_identifier=body.get("safety_identifier", str), include=_include(body),
        max_tool_calls=max_tool_calls,
        chat_fields=json.dumps({k: raw[k] for k in fields.RESPONSES_FROM_CHAT if raw.get(k) is not None}))


def items(raw: Any, param: str) -> tuple[Item, ...]:
    """Input items (or a stored conversation's): a string is the user's message."""
    if isinstance(raw, str):
        return (MessageItem("user", (utf8(raw, param),)),)
    if not isinstance(raw, list):
        raise bad_request(f"`{param}` must be a string or an array of items, not {kind_of(raw)}", param=param)
    return tuple(_item(item, f"{param}[{i}]", param) for i, item in enumerate(raw))


def _item(raw: Any, where: str, param: str) -> Item:
    if not isinstance(raw, dict):
        raise bad_request(f"`{where}` must be an object, not {kind_of(raw)}", param=param)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind not in KINDS.values():
        raise bad_request(f"`{where}.type` {kind!r} is not supported by this server: items are messages (text), "
                          "`function_call` and `function_call_output`", param=param, code="unsupported")
    status = raw.get("status")
    if status not in ITEM_STATUSES:
        raise bad_request(f"`{where}.status` must be \"in_progress\", \"completed\" or \"incomplete\"; got {status!r}",
                          param=param)
    item_id = _string(raw, "id", where, param, required=False)
    if kind == "message":
        _only(raw, ("type", "role", "content", "id", "status"), where, param)
        role = raw.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"`{where}.role` must be \"user\", \"system\", \"developer\" or \"assistant\"; got "
                              f"{role!r}", param=param)
        return MessageItem(role, _texts(raw.get("content"), "output_text" if role == "assistant" else "input_text",
                                        f"{where}.content", param), item_id)
    if kind == "function_call":
        _only(raw, ("type", "call_id", "name", "arguments", "id", "status"), where, param)
        return FunctionCallItem(*(_string(raw, key, where, param) for key in ("call_id", "name", "arguments")),
                                item_id)
    _only(raw, ("type", "call_id", "output", "id", "status"), where, param)
    output = raw.get("output")
    text = output if isinstance(output, str) else "".join(_texts(output, "input_text", f"{where}.output", param))
    return FunctionOutputItem(_string(raw, "call_id", where, param), utf8(text, param), item_id)


def _only(raw: dict[str, Any], keys: tuple[str, ...], where: str, param: str) -> None:
    odd = next((k for k, v in raw.items() if k not in keys and v is not None), None)
    if odd is not None:
        raise bad_request(f"`{where}.{odd}` is not supported by this server (it takes {', '.join(keys)})",
                          param=param, code="unsupported")


def _string(raw: dict[str, Any], key: str, where: str, param: str, required: bool = True) -> str | None:
    value = raw.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise bad_request(f"`{where}.{key}` must be a string, not {kind_of(value)}", param=param)
    return utf8(value, param)


def _texts(raw: Any, part: str, where: str, param: str) -> tuple[str, ...]:
    """A message's content: a string, or text parts of the type its role writes (`input_text`, an assistant's
    `output_text`, whose annotations and logprobs are what that earlier output carried, not input)."""
    if isinstance(raw, str):
        return (utf8(raw, param),)
    if not isinstance(raw, list):
        raise bad_request(f"`{where}` must be a string or an array of `{part}` parts, not {kind_of(raw)}",
                          param=param)
    texts = []
    for i, p in enumerate(raw):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind != part:
            raise bad_request(f"`{where}[{i}]` of type {kind!r} is not supported by this server: this role's content "
                              f"is `{part}` parts (text only)", param=param, code="unsupported")
        _only(p, ("type", "text", "annotations", "logprobs") if part == "output_text" else ("type", "text"),
              f"{where}[{i}]", param)
        texts.append(_string(p, "text", f"{where}[{i}]", param))
    return tuple(texts)


TOOL_KEYS = ("type", "name", "description", "parameters", "strict")


def _tools(body: Body) -> tuple[FunctionTool, ...]:
    """Responses' flat function tools; their names and schemas are checked where chat checks its own."""
    raw = body.get("tools", list, [])
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"`{where}.type` {kind!r} is not supported by this server: it calls functions only "
                              "(no hosted tools)", param="tools", code="unsupported")
        _only(tool, TOOL_KEYS, where, "tools")
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"`{where}.parameters` must be a JSON schema (an object)", param="tools")
        tools.append(FunctionTool(_string(tool, "name", where, "tools"),
                                  _string(tool, "description", where, "tools", required=False),
                                  None if parameters is None else json.dumps(parameters),
                                  convert(tool.get("strict"), bool, f"{where}.strict", True)))
    return tuple(tools)


def _tool_choice(raw: Any) -> tuple[str | None, str | None]:
    if raw is None or raw in TOOL_CHOICES:
        return raw, None
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str) and len(raw) == 2:
        return "function", utf8(raw["name"], "tool_choice")
    raise bad_request("`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": "
                      f"...}}; this server calls functions only; got {json.dumps(raw)[:200]}", param="tool_choice",
                      code="unsupported")


def _text(body: Body) -> TextFormat:
    if not body.has("text"):
        return TextFormat()
    raw = Body(body.raw["text"], fields.RESPONSES_TEXT, "text").get("format", dict)
    if raw is None:
        return TextFormat()
    kind = raw.get("type")
    if kind not in FORMATS:
        raise bad_request(f"`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"; got {kind!r}",
                          param="text.format")
    if kind != "json_schema":
        _only(raw, ("type",), "text.format", "text.format")
        return TextFormat(kind)
    _only(raw, ("type", "name", "schema", "strict", "description"), "text.format", "text.format")
    schema = raw.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("`text.format.schema` must be a JSON schema (an object)", param="text.format")
    return TextFormat(kind, _string(raw, "name", "text.format", "text.format"), json.dumps(schema),
                      convert(raw.get("strict"), bool, "text.format.strict"),
                      _string(raw, "description", "text.format", "text.format", required=False))


def _metadata(raw: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    if len(raw) > MAX_METADATA:
        raise bad_request(f"`metadata` has {len(raw)} pairs; at most {MAX_METADATA}", param="metadata")
    for key, value in raw.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"`metadata` pairs are strings, keys up to {MAX_METADATA_KEY} characters and values up "
                              f"to {MAX_METADATA_VALUE}; {key[:80]!r} is not", param="metadata")
        for text in (key, value):
            utf8(text, "metadata")
    return tuple(raw.items())


def _include(body: Body) -> tuple[str, ...]:
    raw = body.get("include", list, [])
    for value in raw:
        if value not in INCLUDABLE:
            raise bad_request(f"`include` may hold {', '.join(INCLUDABLE)}; got {value!r}", param="include")
        if value == LOGPROBS:
            raise bad_request(f"`include` of {LOGPROBS!r} is not supported by this server: no logprobs on this "
                              "route yet", param="include", code="unsupported")
    return tuple(raw)


# ---- the chat call ---------------------------------------------------------------------------------------------------

def chat_body(req: ResponsesRequest, earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body of the call: the instructions (the system's message, first, so that any chat
    template takes it), the stored conversation `earlier` continues (input and output items, oldest first), then
    this request's input. `gateway.request_model.parse_chat` checks it; pass its errors through `relabel`."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict[str, Any] = {"messages": messages + _messages((*items(earlier, "previous_response_id"), *req.input)),
                            "parallel_tool_calls": req.parallel_tool_calls, **json.loads(req.chat_fields)}
    sent = {"model": req.model, "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "user": req.user, "safety_identifier": req.safety_identifier,
            "response_format": req.text_format.for_chat(), "stream": req.stream or None,
            "tools": [t.for_chat() for t in req.tools] or None,
            "tool_choice": {"type": "function", "function": {"name": req.tool_name}} if req.tool_choice == "function"
            else req.tool_choice}
    return body | {k: v for k, v in sent.items() if v is not None}


def _messages(conversation: tuple[Item, ...]) -> list[dict[str, Any]]:
    """Chat messages: a function call joins the assistant's message before it (its text, its other calls), as
    the model wrote them in one turn; a call's output is a tool message."""
    out: list[dict[str, Any]] = []
    for item in conversation:
        if isinstance(item, MessageItem):
            out.append({"role": CHAT_ROLES.get(item.role, item.role), "content": "".join(item.texts)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def relabel(e: ApiError) -> ApiError:
    """A chat request model's error as the Responses fields name what it is about."""
    message = e.message
    for chat, ours in RELABELS.items():
        message = message.replace(f"`{chat}`", f"`{ours}`").replace(f"the {chat}", f"the {ours}")
    if e.param == "tools":
        message = message.replace("].function.", "].")
    return ApiError(e.status, message, type=e.type, param=RELABELS.get(e.param, e.param), code=e.code,
                    headers=e.headers)


# ---- items and their ids ---------------------------------------------------------------------------------------------

def item_id(response_id: str, kind: str, place: str) -> str:
    """An item's id, from its response's and its place there (an output index, or `in<position>` in the input)."""
    return f"{PREFIXES[kind]}_{response_id.removeprefix('resp_')}_{place}"


def input_items(req: ResponsesRequest, response_id: str) -> list[dict[str, Any]]:
    """This request's input as `GET /v1/responses/{id}/input_items` lists it, oldest first; an item keeps the id
    it was sent with."""
    return [item.listed(item.id or item_id(response_id, KINDS[type(item)], f"in{i}"))
            for i, item in enumerate(req.input)]


def conversation_items(req: ResponsesRequest, response_id: str, answer: Answer) -> list[dict[str, Any]]:
    """What a response adds to its conversation: its input items, then its output items. The conversation a later
    request's `previous_response_id` continues is the stored conversation of this one's previous response (its
    own, recursively) followed by these."""
    return input_items(req, response_id) + output_items(response_id, status_of(answer), answer)


def output_items(response_id: str, status: str, answer: Answer) -> list[dict[str, Any]]:
    """The answer's output: its text as one message, then each finished call."""
    out = []
    if answer.content:
        out.append(_message(item_id(response_id, "message", "0"), answer.content,
                            _message_status(status, bool(answer.calls))))
    for call in answer.calls:
        out.append(_call(item_id(response_id, "function_call", str(len(out))), call.id, call.name, call.arguments,
                         "completed"))
    return out


def _message(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _call(call_item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": call_item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _message_status(status: str, calls: bool) -> str:
    """The answer's text is whole once a call follows it; else it is as far as the response went."""
    if calls or status == "completed":
        return "completed"
    return "in_progress" if status in ("queued", "in_progress") else "incomplete"


def status_of(answer: Answer) -> str:
    """The Response's status for the bus's finish reason: an abort (a cancel, or a client gone past its grace period)
    is `cancelled`."""
    return {None: "in_progress", "length": "incomplete", "abort": "cancelled"}.get(answer.finish_reason, "completed")


def error_body(e: ApiError) -> dict[str, Any]:
    """A failed response's `error` (OpenAI's codes: a request no worker can serve is an invalid prompt)."""
    code = {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(e.status, "server_error")
    return {"code": code, "message": e.message}


def _usage(usage: Usage) -> dict[str, Any]:
    # cache_write_tokens: the openai client requires it; writing the prefix cache is never billed apart here
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


# ---- the response, whole and streamed --------------------------------------------------------------------------------

@dataclass(slots=True)
class _OpenItem:
    """An output item a stream has opened: a message (`call_id` None) or a function call."""
    index: int
    id: str
    call_id: str | None = None
    name: str | None = None
    text: str = ""  # the message's text, or the call's arguments, so far


class ResponseShape:
    """A response as OpenAI's Responses API writes it: whole (`whole`, or `body` at any stage for the store), and
    streamed as typed events numbered from 0, items opened as their first text or call part arrives and done when
    the next opens or the answer ends (see gateway/answer.py for how a Shape is fed).

    A call cut short by the end of the answer is the answer's text, whole (as chat has it); a stream that opened
    its item before the last step ends that item `incomplete` and writes the text in a message after it (so there,
    and only there, the streamed items differ from the final response's)."""

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int, model: str) -> None:
        self.req = req
        self.id = response_id
        self.created_at = created_at
        self.model = model
        self.sequence = 0
        self.items: list[_OpenItem] = []
        self.open: _OpenItem | None = None  # the item taking text or arguments now
        self.calls: dict[int, _OpenItem] = {}  # by the call's index in the answer
        self.last: Step | None = None  # the answer's last step, held for its end

    def whole(self, answer: Answer) -> dict[str, Any]:
        return self.body(status_of(answer), answer)

    def body(self, status: str, answer: Answer | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response at any stage: `queued` (no answer yet), `in_progress`, or how it ended (`failed` with its
        `error`, see error_body)."""
        req = self.req
        done = answer is not None and status not in ("queued", "in_progress")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": output_items(self.id, status, answer) if answer is not None else [],
            "usage": _usage(answer.usage) if done else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tools": [t.echoed() for t in req.tools],
            "tool_choice": {"type": "function", "name": req.tool_name} if req.tool_choice == "function"
            else req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls, "text": {"format": req.text_format.echoed()},
            "metadata": dict(req.metadata), "previous_response_id": req.previous_response_id, "store": req.store,
            "background": req.background, "truncation": "disabled", "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "top_logprobs": 0, "user": req.user,
            "safety_identifier": req.safety_identifier, "prompt_cache_key": None,
        }

    def opening(self) -> list[Event]:
        begun = self.body("in_progress", None)
        return [self._event("response.created", response=begun), self._event("response.in_progress", response=begun)]

    def step(self, step: Step) -> list[Event]:
        if step.finish_reason is not None:
            self.last = step  # its events wait for the answer, which says which of its calls were finished
            return []
        return self._events(step, None)

    def closing(self, answer: Answer) -> list[Event]:
        status = status_of(answer)
        finished = frozenset(c.id for c in answer.calls)
        events = self._events(self.last, finished) if self.last is not None else []
        return events + self._close(self._status(finished, status)) + \
            [self._event(ENDS[status], response=self.whole(answer))]

    def failure(self, error: ApiError, answer: Answer) -> list[Event]:
        return [self._event("response.failed", response=self.body("failed", answer, error_body(error)))]

    def _events(self, step: Step, finished: frozenset[str] | None) -> list[Event]:
        """A step's events: first the parts of the call open now, then its text, then the calls it opens. On the
        last step (`finished`: the ids of the answer's finished calls), text after a call's start is that call cut
        short, whose text the answer holds: a call it opens is left out, and one open is done `incomplete`."""
        events = []
        before = set(self.calls)
        for delta in step.calls:
            if delta.index in before:
                events += self._arguments(self.calls[delta.index], delta.arguments)
        if step.content:
            if self.open is None or self.open.call_id is not None:
                events += self._close(self._status(finished, "completed")) + self._open_message()
            events.append(self._event("response.output_text.delta", item_id=self.open.id,
                                      output_index=self.open.index, content_index=0, delta=step.content, logprobs=[]))
            self.open.text += step.content
        for delta in (d for d in step.calls if d.index not in before):
            if delta.index not in self.calls:
                if finished is not None and delta.id not in finished:
                    continue
                events += self._close("completed")
                self.calls[delta.index] = self._add("function_call", call_id=delta.id, name=delta.name)
                item = self.calls[delta.index]
                events.append(self._event("response.output_item.added", output_index=item.index,
                                          item=_call(item.id, item.call_id, item.name, "", "in_progress")))
            events += self._arguments(self.calls[delta.index], delta.arguments)
        return events

    def _status(self, finished: frozenset[str] | None, status: str) -> str:
        """The status the open item ends with: a call is complete unless the answer ended without it; a message,
        which nothing follows, as the response went (`status` before its end)."""
        item = self.open
        if item is None or finished is None:
            return "completed"
        if item.call_id is not None:
            return "completed" if item.call_id in finished else "incomplete"
        return _message_status(status, False)

    def _arguments(self, item: _OpenItem, arguments: str) -> list[Event]:
        if not arguments:
            return []
        item.text += arguments
        return [self._event("response.function_call_arguments.delta", item_id=item.id, output_index=item.index,
                            delta=arguments)]

    def _event(self, kind: str, **data: Any) -> Event:
        event = Event(kind, {"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return event

    def _add(self, kind: str, **known: Any) -> _OpenItem:
        item = _OpenItem(len(self.items), item_id(self.id, kind, str(len(self.items))), **known)
        self.items.append(item)
        self.open = item
        return item

    def _open_message(self) -> list[Event]:
        item = self._add("message")
        added = {"id": item.id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return [self._event("response.output_item.added", output_index=item.index, item=added),
                self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                            content_index=0, part=_text_part(""))]

    def _close(self, status: str) -> list[Event]:
        """The events that end the open item, if one is open."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": item.index}
        if item.call_id is not None:
            return [self._event("response.function_call_arguments.done", **where, arguments=item.text),
                    self._event("response.output_item.done", output_index=item.index,
                                item=_call(item.id, item.call_id, item.name, item.text, status))]
        return [self._event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=_text_part(item.text)),
                self._event("response.output_item.done", output_index=item.index,
                            item=_message(item.id, item.text, status))]
