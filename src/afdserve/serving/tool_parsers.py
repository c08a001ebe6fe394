"""Tool-call parsers: the markup a model writes for a tool call -> OpenAI tool calls, chosen by name
with ``afdserve serve --tool-call-parser NAME`` (as vLLM's ``--tool-call-parser``).

A parser reads the generated text incrementally: ``feed(text)`` returns the pieces it can tell apart
so far -- content (``str``) and complete tool calls (``ToolCall``) -- and holds back what may still
become markup (e.g. a trailing ``"<tool"``); ``finish()`` returns what is left. Markup that does
not parse as a tool call is given back as content, so that text without a (valid) tool call comes
out unchanged. Register more parsers with ``register_tool_parser``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Union


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Piece = Union[str, ToolCall]


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Piece]: ...
    def finish(self) -> list[Piece]: ...


TOOL_PARSERS: dict[str, Callable[[], ToolParser]] = {}


def register_tool_parser(*names: str) -> Callable[[Any], Any]:
    """Class decorator: the parser (a class taking no arguments) is chosen by any of ``names``."""

    def register(cls: Any) -> Any:
        for name in names:
            TOOL_PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> Callable[[], ToolParser]:
    """The parser factory registered as ``name``; KeyError naming the known parsers otherwise."""
    if name not in TOOL_PARSERS:
        raise KeyError(f"unknown tool call parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]


def call_from_json(obj: Any) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` (or ``"parameters"``) as a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class TaggedJsonParser:
    """Tool calls as JSON objects between a start and an end tag (several calls allowed)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.start)
                if i < 0:
                    keep = _partial_suffix(self._buf, self.start)
                    cut = len(self._buf) - keep
                    if cut:
                        out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                if i:
                    out.append(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(self.start):], True
            else:
                j = self._buf.find(self.end)
                if j < 0:
                    return out
                body, self._buf, self._inside = self._buf[:j], self._buf[j + len(self.end):], False
                call = self.parse(body)
                out.append(call if call is not None else self.start + body + self.end)

    def finish(self) -> list[Piece]:
        """What is left: an unterminated call (the output ran out) counts if its JSON is complete."""
        body, self._buf = self._buf, ""
        if not self._inside:
            return [body] if body else []
        self._inside = False
        call = self.parse(body)
        return [call if call is not None else self.start + body]

    def parse(self, body: str) -> ToolCall | None:
        try:
            return call_from_json(json.loads(body))
        except ValueError:
            return None


@register_tool_parser("hermes")
class HermesToolParser(TaggedJsonParser):
    """Hermes 2 Pro / Qwen 2.5+ style: ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``."""
