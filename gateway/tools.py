"""Tool calling (chat): the tools a call offers, the grammar that keeps a model's calls to them valid, and the parser
that turns its output back into OpenAI's `tool_calls`, whole or streamed.

A model writes its calls in its family's format (vLLM's `--tool-call-parser`): `hermes`, each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>` after any text (Qwen2.5, Qwen3, Hermes and
many others); `llama3_json`, the whole answer one or more `{"name": ..., "parameters": {...}}` objects separated by
`;` (Llama 3.1-3.3). The constraint is written in that same format: `required` and a named function allow calls alone
(the named one's schema only); `auto` allows free text, and once the model opens a call, only a valid call. So the
parser below meets only calls it can read, and the model writes the format it was trained on.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from shared.sampling import Constraint

# Whitespace inside a call's JSON, bounded (see shared/constraints.py: a small model can spend every token on it).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: str  # its JSON schema's text (a schema is an object; kept as text so that the value is hashable)

    def for_template(self) -> dict[str, Any]:
        function = {"name": self.name, "parameters": json.loads(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat call says about tools: which it offers, whether the model may, must or must not call one, and
    whether it may call several."""
    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required", or "function" (the one named by `function`)
    function: str | None = None
    parallel: bool = True

    @property
    def callable(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if self.choice != "function" or t.name == self.function)


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a model family writes its calls."""
    name: str
    open: str  # what starts a call ("" where a call is the whole answer)
    close: str
    args_key: str  # the key of a call's arguments
    separator: str  # between calls, beside whitespace


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", "")
LLAMA3_JSON = CallFormat("llama3_json", "", "", "parameters", ";")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON)}


def call_format(setting: str, chat_template: str | None) -> CallFormat:
    """The format the setting names, else the one the chat template writes (hermes where it cannot tell)."""
    if setting:
        return FORMATS[setting]
    if chat_template and "<tool_call>" not in chat_template and "<|python_tag|>" in chat_template:
        return LLAMA3_JSON
    return HERMES


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _call_rule(tool: Tool, fmt: CallFormat) -> str:
    """One call of `tool` as Lark: `{"name": "<its name>", "<args key>": <its arguments>}`, the arguments held to
    its parameters' schema as a JSON root of their own (so that the schema's own `$defs` and `$ref`s resolve)."""
    arguments = json.loads(tool.parameters) | {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    parts = ['"{"', _lark_string('"name"'), '":"', _lark_string(json.dumps(tool.name)), '","',
             _lark_string(json.dumps(fmt.args_key)), '":"', f"%json {json.dumps(arguments)}", '"}"']
    return " JWS ".join(parts)


def constraint(use: ToolUse, fmt: CallFormat) -> Constraint | None:
    """The grammar (Lark, for llguidance) that keeps the output to `use` in `fmt`; None where nothing is forced."""
    if use.choice == "none" or not use.tools:
        return None
    more = " more*" if use.parallel and use.choice != "function" else ""  # a named function is called once
    lines = [f"one_call: {' | '.join(f'call_{i}' for i in range(len(use.callable)))}",
             *(f"call_{i}: {_call_rule(tool, fmt)}" for i, tool in enumerate(use.callable))]
    if fmt.open:
        opener, closer = _lark_string(fmt.open), _lark_string(fmt.close)
        lines.append(f"call: WS one_call WS {closer}")
        lines.append(f"more: WS {opener} call")
        if use.choice == "auto":
            # free text that never opens a call, or text up to the first opening and calls after it
            lines.append(f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{re.escape(fmt.open)}(.|\\n)*/")
            lines.append(f"pre[stop={opener}]: /(.|\\n)*/")
            start = f"TEXT | pre call{more}"
        else:
            start = f"{opener} call{more}"
    else:
        lines.append("call: WS one_call")
        lines.append(f"more: WS {_lark_string(fmt.separator)} call")
        if use.choice == "auto":
            lines.append("TEXT: /([ \\t\\n\\r]*[^{ \\t\\n\\r](.|\\n)*)?/")  # an answer that does not start as a call
            start = f"TEXT | call{more}"
        else:
            start = f"call{more}"
    lines.append("WS: /[ \\n]{0,4}/")
    lines.append(f"JWS: /{JSON_WHITESPACE}/")
    return Constraint("grammar", "\n".join([f"start: {start}", *lines]))


@dataclass(frozen=True, slots=True)
class CallDelta:
    """Part of one tool call: its first part names it (with its id), the others add to its arguments' text."""
    index: int
    id: str | None
    name: str | None
    arguments: str

    def as_chunk(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Piece:
    """What some output text amounts to: answer text, and parts of tool calls."""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id(choice: str, index: int) -> str:
    """The id of the `index`th call of the choice named `choice` (its call's id and place): a function of the two,
    so that a stream replayed after a reconnect (or a stored response read again) names its calls as it did."""
    return "call_" + hashlib.sha256(f"{choice}/{index}".encode()).hexdigest()[:24]


class CallParser:
    """Reads a model's output as it arrives, in its format: answer text passes through (less any that might be
    the start of a call), each call comes out as its name, then its arguments' text as it is written.
    The whole answer is the same parser fed all text at once (`parse`), so streamed deltas add up to it."""

    TEXT, HEAD, ARGS, TAIL, PLAIN = range(5)

    def __init__(self, fmt: CallFormat, choice: str) -> None:
        self.fmt = fmt
        self.choice = choice  # names the choice its calls' ids derive from
        self.state = self.TEXT
        self.pending = ""  # text read but not yet given out
        self.opened: list[CallDelta] = []  # each call's first part: its index, id and name
        self.arguments: list[str] = []  # each call's arguments' text so far
        self.complete = 0  # calls whose arguments have ended (one cut short by max_tokens has not)
        self.current = ""  # the text of the call being read, its opening included
        self.head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(fmt.args_key)
                               + r'"\s*:\s*')
        self.depth = 0  # the arguments' JSON nesting so far
        self.in_string = self.escaped = False

    def feed(self, text: str, end: bool = False) -> Piece:
        """What `text` adds; `end`: it is the output's last, so nothing is held back any more (see `_rest`)."""
        self.pending += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self.pending:
            before = (self.state, len(self.pending))
            if self.state == self.PLAIN:
                content.append(self.pending)
                self.pending = ""
            elif self.state == self.TEXT:
                content.append(self._text())
            elif self.state == self.HEAD:
                self._head(deltas, content)
            elif self.state == self.ARGS:
                self._args(deltas)
            else:
                self._tail()
            if (self.state, len(self.pending)) == before:
                break  # waiting for more text
        if end:
            content.append(self._rest())
        return Piece("".join(content), tuple(deltas))

    def _rest(self) -> str:
        """At the end of the output: text held back because it might have begun a call, and a call cut short (by
        max_tokens or a stop string), are answer text after all."""
        rest, self.pending = self.pending, ""
        if self.state in (self.HEAD, self.ARGS):
            rest, self.current = self.current + rest, ""
        elif self.state == self.TAIL:
            return ""
        return rest if rest.strip() else ""

    def _text(self) -> str:
        """Answer text up to a call's opening (or, for a format whose calls are the whole answer, its start)."""
        fmt = self.fmt
        if not fmt.open:
            stripped = self.pending.lstrip()
            if self.opened and stripped.startswith(fmt.separator):
                stripped = stripped[len(fmt.separator):].lstrip()
            if not stripped:
                return ""
            if stripped[0] == "{":
                self.state, self.pending, self.current = self.HEAD, stripped, ""
                return ""
            self.state = self.PLAIN
            return ""
        at = self.pending.find(fmt.open)
        if at >= 0:
            text, self.pending = self.pending[:at], self.pending[at + len(fmt.open):]
            self.state, self.current = self.HEAD, fmt.open
        else:
            keep = next((k for k in range(min(len(fmt.open) - 1, len(self.pending)), 0, -1)
                         if fmt.open.startswith(self.pending[-k:])), 0)
            text, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return text if not self.opened or text.strip() else ""  # whitespace between calls is no answer

    def _head(self, deltas: list[CallDelta], content: list[str]) -> None:
        """A call's name, once its JSON has said it (the grammar writes the name first)."""
        match = self.head.match(self.pending)
        if match is not None and self.pending[match.end():]:
            try:
                name = json.loads(f'"{match[1]}"')
            except ValueError:  # an escape JSON does not have: the name as written
                name = match[1]
            deltas.append(self._open(name, ""))
            self.current += self.pending[:match.end()]
            self.pending = self.pending[match.end():]
            self.state, self.depth, self.in_string, self.escaped = self.ARGS, 0, False, False
            return
        if self.fmt.open and self.fmt.close in self.pending:
            # a call the parser cannot read as it goes (keys in another order): read it whole, or keep it as text
            body, _, self.pending = self.pending.partition(self.fmt.close)
            self.state, self.current = self.TEXT, ""
            try:
                call = json.loads(body)
                name, args = call["name"], call[self.fmt.args_key]
                if not isinstance(name, str):
                    raise TypeError(name)
            except (ValueError, KeyError, TypeError):
                content.append(self.fmt.open + body + self.fmt.close)
                return
            deltas.append(self._open(name, json.dumps(args)))
            self.complete += 1

    def _open(self, name: str, arguments: str) -> CallDelta:
        opened = CallDelta(len(self.opened), call_id(self.choice, len(self.opened)), name, arguments)
        self.opened.append(opened)
        self.arguments.append(arguments)
        return opened

    @property
    def calls(self) -> list[ToolCall]:
        """The calls read whole so far."""
        return [ToolCall(o.id, o.name, args) for o, args in zip(self.opened[:self.complete], self.arguments)]

    def _args(self, deltas: list[CallDelta]) -> None:
        """The arguments' JSON as it is written, up to where its value ends."""
        end = None
        for i, ch in enumerate(self.pending):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    end = i + 1
                    break
        piece = self.pending if end is None else self.pending[:end]
        self.pending = "" if end is None else self.pending[end:]
        if piece:
            self.arguments[-1] += piece
            self.current += piece
            deltas.append(CallDelta(len(self.opened) - 1, None, None, piece))
        if end is not None:
            self.state, self.current = self.TAIL, ""
            self.complete += 1

    def _tail(self) -> None:
        """The call's closing brace, and its closing tag."""
        end = self.fmt.close or "}"
        at = self.pending.find(end if self.fmt.close else "}")
        if at < 0:
            return
        if self.fmt.close and "}" not in self.pending[:at]:
            return
        self.pending = self.pending[at + len(end):]
        self.state = self.TEXT


def parse(fmt: CallFormat, text: str, choice: str) -> tuple[str, list[ToolCall]]:
    """A whole answer (of the choice named `choice`): its text (less its calls) and its calls."""
    parser = CallParser(fmt, choice)
    return parser.feed(text, end=True).content, parser.calls

