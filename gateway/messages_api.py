"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as pure translation and shaping:
a Messages body becomes a chat-completions body, which the chat request model then parses and checks (so one set of
rules holds for both APIs), and the chat answer is written in Anthropic's shapes, whole and streamed (a `Shape`).

Every field and every nested object is looked up in its table in gateway/fields.py: honoured, or refused with a 400
naming it. Errors name the Anthropic field: this module checks what Anthropic's API defines differently from chat's
(`max_tokens` required, `temperature` in [0, 1], the blocks), and `relabel` renames what the chat model finds.

What this module decides where Anthropic's API leaves it to the server:
- `stop_reason`: finished tool calls end an answer as "tool_use", `max_tokens` as "max_tokens", a stop sequence as
  "stop_sequence" (naming it), the model's end of text as "end_turn". An answer the server ended before the model did
  (the bus's "abort") is "pause_turn": Anthropic's word for a turn cut short that goes on when sent back as it is,
  which works here, since a last assistant turn is continued.
- Tool call ids are the gateway's, unchanged: an id is opaque to Anthropic's API and to its clients, and so one call
  has one id in both APIs and in the logs.
- Usage: `input_tokens` counts the prompt tokens the prefix cache did not hold, `cache_read_input_tokens` those it
  did, `cache_creation_input_tokens` is 0 (caching costs no extra write), so the three add up to the prompt, as
  Anthropic counts. message_start counts the whole prompt as input, as the cache's hits are known only once tokens
  come; message_delta's usage is the final one.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway import fields
from gateway.answer import Answer, Event, Step, Usage
from gateway.errors import ApiError, bad_request
from gateway.request_model import Body, kind_of
from gateway.tools import CallDelta

UNDEFINED = "Anthropic's Messages API does not define it"
ROLES = ("user", "assistant", "system")
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}  # the block types each role sends
ERROR_MARK = "Error: "  # before a tool result sent with `is_error`, as chat templates have no flag for it
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool", chat's named function
SERVICE_TIER = "standard"
# The chat fields a Messages body is translated to, by the Anthropic field each comes from (others keep their name).
FROM_CHAT = {"stop": "stop_sequences", "parallel_tool_calls": "tool_choice", "user": "metadata",
             "response_format": "output_config", "add_generation_prompt": "messages",
             "continue_final_message": "messages"}
# Chat's paths into a function tool, as a Messages tool writes them.
TOOL_PATHS = ((re.compile(r"(tools\[\d+\])\.function\.parameters"), r"\1.input_schema"),
              (re.compile(r"(tools\[\d+\])\.function\."), r"\1."))
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error"}


@dataclass(frozen=True, slots=True)
class Block:
    """One content block of a turn, and where it is in the request (for errors)."""
    where: str
    raw: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Turn:
    role: str
    blocks: tuple[Block, ...]


def chat_body(raw: Any) -> dict[str, Any]:
    """The chat-completions body of a Messages request, as `request_model.parse_chat` takes it."""
    body = Body(raw, fields.MESSAGES, undefined=UNDEFINED)
    chat = _prompt(body)
    return chat | {"max_tokens": _max_tokens(body)} | _tool_choice(body, chat.get("tools", [])) | _sampling(body) \
        | _metadata(body) | _output_config(body)


def count_tokens_body(raw: Any) -> dict[str, Any]:
    """The body `request_model.parse_tokenize` takes for a count_tokens request: the prompt a Messages request with
    the same fields would render (its tool_choice and output_config checked, though they change no prompt token)."""
    body = Body(raw, fields.COUNT_TOKENS, undefined=UNDEFINED)
    prompt = _prompt(body)
    _tool_choice(body, prompt.get("tools", []))
    _output_config(body)
    return prompt


def count_tokens_answer(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens}


def relabel(e: ApiError) -> ApiError:
    """An error the chat request model (or the chat call) raised, naming the Anthropic field it came from."""
    param = FROM_CHAT.get(e.param, e.param)
    message = e.message.replace(f"`{e.param}`", f"`{param}`")
    for pattern, path in TOOL_PATHS:
        message = pattern.sub(path, message)
    return ApiError(e.status, message, type=e.type, param=param, code=e.code, headers=e.headers)


def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error body (and a stream's `error` event), its type by the status."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _required(body: Body, name: str, tp: type) -> Any:
    value = body.get(name, tp)
    if value is None:
        raise bad_request(f"`{body.param(name)}` is required", param=body.param(name))
    return value


def _prompt(body: Body) -> dict[str, Any]:
    """What the chat template renders: the model, the messages (the system's first) and the tools; a last assistant
    turn is continued (Anthropic's prefill)."""
    model = _required(body, "model", str)
    turns = _turns(body.raw.get("messages"))
    prompt: dict[str, Any] = {"model": model, "messages": _system(body) + [m for t in turns for m in _chat(t)]}
    if turns[-1].role == "assistant":
        prompt |= {"add_generation_prompt": False, "continue_final_message": True}
    if body.has("tools"):
        prompt["tools"] = _tools(body.raw["tools"])
    return prompt


def _turns(raw: Any) -> list[Turn]:
    """The messages as turns, consecutive user or assistant ones joined into one (as Anthropic joins them)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("`messages` must be a non-empty array of messages", param="messages")
    turns: list[Turn] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        message = Body(m, fields.ANTHROPIC_MESSAGE, where, UNDEFINED)
        role = _required(message, "role", str)
        if role not in ROLES:
            raise bad_request(f"`{where}.role` must be \"user\", \"assistant\" or \"system\"; got {role!r}",
                              param=f"{where}.role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if turns and turns[-1].role == role != "system":
            turns[-1] = Turn(role, turns[-1].blocks + blocks)
        else:
            turns.append(Turn(role, blocks))
    return turns


def _blocks(raw: Any, where: str) -> tuple[Block, ...]:
    """Content: a string (one text block) or an array of blocks."""
    if isinstance(raw, str):
        return (Block(where, {"type": "text", "text": raw}),)
    if not isinstance(raw, list):
        raise bad_request(f"`{where}` must be a string or an array of content blocks, not {kind_of(raw)}", param=where)
    out = []
    for j, block in enumerate(raw):
        if not isinstance(block, dict):
            raise bad_request(f"`{where}[{j}]` must be a content block (an object), not {kind_of(block)}",
                              param=f"{where}[{j}]")
        out.append(Block(f"{where}[{j}]", block))
    return tuple(out)


def _kind(block: Block, served: tuple[str, ...], there: str) -> str:
    """The block's type, if one of those `served` in its place; a 400 naming it otherwise."""
    kind = block.raw.get("type")
    if kind not in served:
        raise bad_request(f"`{block.where}.type`: {kind!r} blocks are not served in {there}; this server takes "
                          f"{' and '.join(served)} blocks there (text models, no server tools)",
                          param=f"{block.where}.type", code="unsupported")
    return kind


def _text(block: Block) -> dict[str, str]:
    """A text block as a chat text part."""
    text = Body(block.raw, fields.TEXT_BLOCK, block.where, UNDEFINED)
    return {"type": "text", "text": _required(text, "text", str)}


def _texts(blocks: tuple[Block, ...], there: str) -> list[dict[str, str]]:
    """Blocks that may only be text, as chat text parts."""
    for block in blocks:
        _kind(block, ("text",), there)
    return [_text(b) for b in blocks]


def _system(body: Body) -> list[dict[str, Any]]:
    if not body.has("system"):
        return []
    parts = _texts(_blocks(body.raw["system"], "system"), "`system`")
    return [{"role": "system", "content": parts}] if any(p["text"] for p in parts) else []


def _chat(turn: Turn) -> list[dict[str, Any]]:
    """A turn's chat messages: an assistant's text and calls in one message; a user's tool results as `tool`
    messages, in order, then the rest of its text; a system turn's text as a system message."""
    if turn.role == "system":
        return [{"role": "system", "content": _texts(turn.blocks, "system turns")}]
    parts, calls, results = [], [], []
    for block in turn.blocks:
        kind = _kind(block, BLOCKS[turn.role], f"{turn.role} turns")
        if kind == "text":
            parts.append(_text(block))
        elif kind == "tool_use":
            calls.append(_tool_use(block))
        else:
            results.append(_tool_result(block))
    if turn.role == "assistant":
        return [{"role": "assistant", "content": parts} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": turn.role, "content": parts}] if parts or not results else [])


def _tool_use(block: Block) -> dict[str, Any]:
    use = Body(block.raw, fields.TOOL_USE_BLOCK, block.where, UNDEFINED)
    return {"id": _required(use, "id", str), "type": "function",
            "function": {"name": _required(use, "name", str), "arguments": json.dumps(_required(use, "input", dict))}}


def _tool_result(block: Block) -> dict[str, Any]:
    result = Body(block.raw, fields.TOOL_RESULT_BLOCK, block.where, UNDEFINED)
    content = block.raw.get("content")
    parts = [] if content is None else _texts(_blocks(content, f"{block.where}.content"), "tool results")
    mark = [{"type": "text", "text": ERROR_MARK}] if result.get("is_error", bool, False) else []
    return {"role": "tool", "tool_call_id": _required(result, "tool_use_id", str), "content": mark + parts}


def _tools(raw: Any) -> list[dict[str, Any]]:
    """Custom tools as chat's function tools (whose own checks, the name's and the schema's, then apply)."""
    if not isinstance(raw, list):
        raise bad_request(f"`tools` must be an array of tools, not {kind_of(raw)}", param="tools")
    out = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise bad_request(f"`{where}.type`: {tool['type']!r} is a server tool, which this server does not run; it "
                              "calls custom tools (name, description, input_schema)", param=f"{where}.type",
                              code="unsupported")
        t = Body(tool, fields.ANTHROPIC_TOOL, where, UNDEFINED)
        t.get("eager_input_streaming", bool)  # a boolean, though input streams as it is written either way
        function = {"name": t.raw.get("name"), "parameters": _required(t, "input_schema", dict)}
        out.append({"type": "function", "function": function | {k: t.raw[k] for k in ("description", "strict")
                                                                  if t.has(k)}})
    return out


def _tool_choice(body: Body, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat's `tool_choice` (and `parallel_tool_calls`) of Anthropic's."""
    if not body.has("tool_choice"):
        return {}
    choice = Body(body.raw["tool_choice"], fields.ANTHROPIC_TOOL_CHOICE, "tool_choice", UNDEFINED)
    kind, name = choice.get("type", str), choice.get("name", str)
    if kind not in (*TOOL_CHOICES, "tool"):
        raise bad_request(f"`tool_choice.type` must be \"auto\", \"any\", \"tool\" or \"none\"; got {kind!r}",
                          param="tool_choice.type")
    if (name is not None) != (kind == "tool"):
        raise bad_request("`tool_choice.name` names the tool of a tool_choice of type \"tool\", and only there",
                          param="tool_choice.name")
    if kind == "none" and choice.has("disable_parallel_tool_use"):
        raise bad_request("`tool_choice.disable_parallel_tool_use` does not go with type \"none\"",
                          param="tool_choice.disable_parallel_tool_use")
    if kind != "none" and not tools:
        raise bad_request("`tool_choice` needs `tools`", param="tool_choice")
    if kind == "tool" and not any(t["function"]["name"] == name for t in tools):
        raise bad_request(f"`tool_choice.name` names {name!r}, which is not among `tools`", param="tool_choice.name")
    chat: dict[str, Any] = {"tool_choice": TOOL_CHOICES.get(kind) or {"type": "function", "function": {"name": name}}}
    if choice.get("disable_parallel_tool_use", bool, False):
        chat["parallel_tool_calls"] = False
    return chat


def _max_tokens(body: Body) -> int:
    n = _required(body, "max_tokens", int)
    if n < 1:
        raise bad_request(f"`max_tokens` must be at least 1; got {n} (0, which only warms Anthropic's prompt cache, "
                          "asks for nothing here: every prompt's blocks are cached)", param="max_tokens")
    return n


def _sampling(body: Body) -> dict[str, Any]:
    """Sampling fields, checked where Anthropic's ranges differ from chat's (whose checks then apply)."""
    temperature, top_k = body.get("temperature", float), body.get("top_k", int)
    if temperature is not None and not 0 <= temperature <= 1:
        raise bad_request(f"`temperature` must be in [0, 1]; got {temperature}", param="temperature")
    if top_k is not None and top_k < 0:
        raise bad_request(f"`top_k` must be at least 0 (0: off); got {top_k}", param="top_k")
    stops = body.raw.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise bad_request("`stop_sequences` must be an array of non-empty strings", param="stop_sequences")
    chat = {name: body.raw[name] for name in ("temperature", "top_p", "top_k", "stream", "priority") if body.has(name)}
    return chat | ({"stop": stops} if stops else {})


def _metadata(body: Body) -> dict[str, Any]:
    if not body.has("metadata"):
        return {}
    user = Body(body.raw["metadata"], fields.ANTHROPIC_METADATA, "metadata", UNDEFINED).get("user_id", str)
    return {"user": user} if user is not None else {}


def _output_config(body: Body) -> dict[str, Any]:
    """`output_config.format` as chat's `response_format` (a JSON schema the answer is constrained to)."""
    if not body.has("output_config"):
        return {}
    config = Body(body.raw["output_config"], fields.OUTPUT_CONFIG, "output_config", UNDEFINED)
    if not config.has("format"):
        return {}
    fmt = Body(config.raw["format"], fields.OUTPUT_FORMAT, "output_config.format", UNDEFINED)
    if fmt.get("type", str) != "json_schema":
        raise bad_request("`output_config.format.type` must be \"json_schema\"", param="output_config.format.type")
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "output", "schema": _required(fmt, "schema", dict)}}}


@dataclass(frozen=True, slots=True)
class Ending:
    stop_reason: str
    stop_sequence: str | None


def ending(answer: Answer) -> Ending:
    """How an answer ended, in Anthropic's words (see the module's docstring)."""
    if answer.finish_reason == "length":
        return Ending("max_tokens", None)
    if answer.finish_reason == "abort":
        return Ending("pause_turn", None)
    if answer.calls:
        return Ending("tool_use", None)
    if isinstance(answer.stop_reason, str):
        return Ending("stop_sequence", answer.stop_reason)
    return Ending("end_turn", None)  # EOS or a stop token id


def usage(u: Usage) -> dict[str, int]:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens}


@dataclass(frozen=True, slots=True)
class OpenBlock:
    """The content block a stream has started and not stopped yet."""
    index: int  # its place in the message's content
    kind: str  # "text" or "tool_use"


def _event(data: dict[str, Any]) -> Event:
    return Event(data["type"], data)  # Anthropic names each event by its data's type


class MessagesShape:
    """An answer as Anthropic's Message, whole or as its stream of events (gateway/answer.py's Shape): a text block,
    then a tool_use block per call, as the steps bring them (the calls' grammar lets no text follow a call). A call
    cut short by `max_tokens` streams as a tool_use block, then as text, where the whole answer has it as text only,
    as chat streams and answers it (README: Structured outputs and tool calling)."""

    def __init__(self, id: str, model: str, prompt_tokens: int) -> None:
        self.id = id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.started = 0  # content blocks started so far
        self.open: OpenBlock | None = None

    def _message(self, content: list[dict[str, Any]], end: Ending | None, tokens: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": end and end.stop_reason, "stop_sequence": end and end.stop_sequence,
                "usage": tokens | {"service_tier": SERVICE_TIER}}

    def whole(self, answer: Answer) -> dict[str, Any]:
        text = [{"type": "text", "text": answer.content}] if answer.content else []
        calls = [{"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}
                 for c in answer.calls]
        return self._message(text + calls, ending(answer), usage(answer.usage))

    def opening(self) -> list[Event]:
        shell = self._message([], None, {"input_tokens": self.prompt_tokens, "output_tokens": 0})
        return [_event({"type": "message_start", "message": shell}), _event({"type": "ping"})]

    def step(self, step: Step) -> list[Event]:
        # A step's text comes after the parts of a call already open and before the calls it opens.
        first = next((k for k, d in enumerate(step.calls) if d.name is not None), len(step.calls))
        events = [e for d in step.calls[:first] for e in self._call(d)]
        if step.content:
            events += self._text(step.content)
        return events + [e for d in step.calls[first:] for e in self._call(d)]

    def closing(self, answer: Answer) -> list[Event]:
        end = ending(answer)
        return self._stop() + [
            _event({"type": "message_delta", "delta": {"stop_reason": end.stop_reason,
                                                       "stop_sequence": end.stop_sequence},
                    "usage": usage(answer.usage)}),
            _event({"type": "message_stop"})]

    def failure(self, error: ApiError, answer: Answer) -> list[Event]:
        return [_event(error_body(error))]

    def _text(self, text: str) -> list[Event]:
        events = [] if self.open is not None and self.open.kind == "text" else self._start({"type": "text", "text": ""})
        return events + [_event({"type": "content_block_delta", "index": self.open.index,
                                 "delta": {"type": "text_delta", "text": text}})]

    def _call(self, delta: CallDelta) -> list[Event]:
        events = [] if delta.name is None else self._start(
            {"type": "tool_use", "id": delta.id, "name": delta.name, "input": {}})
        if delta.arguments:
            events.append(_event({"type": "content_block_delta", "index": self.open.index,
                                  "delta": {"type": "input_json_delta", "partial_json": delta.arguments}}))
        return events

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self._stop()
        self.open = OpenBlock(self.started, block["type"])
        self.started += 1
        return events + [_event({"type": "content_block_start", "index": self.open.index, "content_block": block})]

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        index, self.open = self.open.index, None
        return [_event({"type": "content_block_stop", "index": index})]
