"""Tool calling for ``/v1/chat/completions``, as vLLM does it: what the chat template is given, and
how the generated text becomes ``tool_calls``.

``tool_choice`` (default ``"auto"`` when the request has tools):

* ``"none"``: the template still gets the tools (if it reads them); the output is plain content.
* ``"auto"``: needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; tool-call markup in the
  output becomes ``tool_calls`` (``finish_reason="tool_calls"``), the text around it ``content``.
* ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: the output is constrained with
  structured outputs to the JSON schema ``tool_call_schema`` builds (a list of ``{"name",
  "parameters"}``, or the named function's arguments), then read as tool calls.

A chat template that never reads ``tools`` cannot show them to the model: a request with tools (and
``tool_choice`` other than ``"none"``) gets a 400.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable

from afdserve.engine.sampling_params import SamplingParams
from afdserve.errors import ConfigError
from afdserve.serving.chat import ChatTemplate
from afdserve.serving.errors import ApiError
from afdserve.serving.protocol import ChatTool, NamedToolChoice, ToolChoice
from afdserve.serving.tool_parsers import TOOL_PARSERS, ToolCall, ToolParser, call_from_json, get_tool_parser

Delta = tuple[dict[str, Any], "str | None"]  # (a chunk's delta, its finish reason)


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool-calling flags (``--enable-auto-tool-choice``, ``--tool-call-parser``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def check(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                              f"{', '.join(sorted(TOOL_PARSERS))})")
        if self.tool_call_parser is not None:
            try:
                get_tool_parser(self.tool_call_parser)
            except KeyError as e:
                raise ConfigError(str(e.args[0])) from e


def tool_call_schema(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> dict[str, Any]:
    """The JSON schema the output must follow for ``tool_choice`` ``"required"`` (a non-empty list of
    ``{"name", "parameters"}``) or a named function (its arguments), as vLLM builds it. ``tools`` in
    the request's shape: ``[{"type": "function", "function": {"name", "parameters"?}}]``."""
    empty = {"type": "object", "properties": {}}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        fn = next(t["function"] for t in tools if t["function"]["name"] == name)
        return copy.deepcopy(fn.get("parameters") or empty)
    if tool_choice != "required":
        raise ValueError(f"no schema for tool_choice={tool_choice!r}")
    defs: dict[str, Any] = {}
    variants = []
    for t in tools:
        params = copy.deepcopy(t["function"].get("parameters") or empty)
        for k, v in params.pop("$defs", {}).items():
            if defs.setdefault(k, v) != v:
                raise ValueError(f"tool definition '{k}' has several schemas")
        variants.append({"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                        "parameters": params}, "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolPlan:
    """How one request uses tools: ``tools`` for the chat template; ``mode`` says how to read the
    output (``"none"``: as content)."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None
    parser: Callable[[], ToolParser] | None = None
    name: str | None = None  # the named function
    schema: dict[str, Any] | None = None

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the structured-output constraint of ``required`` / named tool choice."""
        if self.schema is None:
            return params
        choice = self.mode if self.mode == "required" else f"{{function: {self.name}}}"
        if not any(f.name == "structured_outputs" for f in dataclasses.fields(params)):
            raise ApiError(400, f"tool_choice={choice} needs structured outputs, which this server does not "
                           f"support yet; use tool_choice 'auto'", param="tool_choice", code="unsupported_value")
        if getattr(params, "structured_outputs") is not None:
            raise ApiError(400, f"tool_choice={choice} cannot be combined with another structured output "
                           f"constraint", param="tool_choice", code="invalid_value")
        from afdserve.engine.sampling_params import StructuredOutputsParams

        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=self.schema))

    def apply(self, choice: dict[str, Any], text: str) -> None:
        """Turns a finished choice's text into ``message.tool_calls`` (and its finish reason)."""
        if self.mode == "none":
            return
        stream = ToolStream(self)
        deltas = stream.step(text, choice["finish_reason"] or "stop")
        calls = [c.to_dict() for c in stream.calls]
        if not calls:
            return
        content = "".join(d.get("content", "") for d, _ in deltas)
        choice["message"] = {"role": "assistant", "content": content or None, "tool_calls": calls}
        choice["finish_reason"] = stream.finish_reason(choice["finish_reason"])

    def stream(self) -> ToolStream | None:
        return None if self.mode == "none" else ToolStream(self)


class ToolStream:
    """Reads one choice's output as it arrives: ``step(new text, finish reason or None)`` -> the
    deltas to send (content, and each tool call once its markup is complete). Whitespace next to a
    tool call is layout, not content: it is dropped."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parser = plan.parser() if plan.parser is not None else None
        self.calls: list[ToolCall] = []
        self._ws = ""  # trailing whitespace held back (dropped if a tool call follows)
        self._after_call = False
        self._text = ""  # required: the whole output (a JSON list, read at the end)

    def step(self, text: str, finish: str | None) -> list[Delta]:
        out: list[dict[str, Any]] = []
        if self.plan.mode == "auto":
            assert self.parser is not None
            pieces = self.parser.feed(text) + (self.parser.finish() if finish else [])
            for p in pieces:
                if isinstance(p, ToolCall):
                    out.append(self._call(p))
                elif (c := self._content(p)) is not None:
                    out.append({"content": c})
            if finish and self._ws and not self.calls:
                out.append({"content": self._ws})
        elif self.plan.mode == "named":
            if not self.calls and (text or finish):
                out.append(self._call(ToolCall(self.plan.name or "", text)))
            elif text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        elif self.plan.mode == "required":
            self._text += text
            if finish:
                out += self._required_calls()
        if not finish:
            return [(d, None) for d in out]
        reason = self.finish_reason(finish)
        return [(d, None) for d in out[:-1]] + [(out[-1] if out else {}, reason)]

    def finish_reason(self, finish: str | None) -> str | None:
        if self.calls and (self.plan.mode == "auto" or (self.plan.mode == "required" and finish == "stop")):
            return "tool_calls"
        return finish

    def _call(self, call: ToolCall) -> dict[str, Any]:
        self._ws, self._after_call = "", True
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1} | call.to_dict()]}

    def _content(self, piece: str) -> str | None:
        body = piece.rstrip()
        if not body:
            self._ws += piece
            return None
        text = self._ws + body
        if self._after_call:
            text, self._after_call = text.lstrip(), False
        self._ws = piece[len(body):]
        return text

    def _required_calls(self) -> list[dict[str, Any]]:
        try:
            items = json.loads(self._text)
        except ValueError:
            items = None
        calls = [call_from_json(x) for x in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls):  # cut short (length): give the text back as it is
            return [{"content": self._text}] if self._text else []
        return [self._call(c) for c in calls if c is not None]


def plan_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None, template: ChatTemplate,
               config: ToolConfig) -> ToolPlan:
    """Checks a request's ``tools`` and ``tool_choice`` against the template and the server's flags."""
    if not tools:
        if tool_choice is not None:
            raise ApiError(400, "tool_choice is only allowed when tools are specified", param="tool_choice",
                           code="invalid_value")
        return ToolPlan()
    specs = [t.model_dump(exclude_none=True) for t in tools]
    choice = tool_choice or "auto"
    if choice == "none":
        return ToolPlan(tools=specs if template.supports_tools else None)
    if not template.supports_tools:
        raise ApiError(400, "this model's chat template does not support tools (it never uses `tools`); serve it "
                       "with a --chat-template that does, or send tool_choice 'none'", param="tools",
                       code="unsupported_parameter")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools",
                           param="tool_choice", code="invalid_value")
        return ToolPlan("named", specs, name=name, schema=_schema(specs, choice.model_dump()))
    if choice == "required":
        return ToolPlan("required", specs, schema=_schema(specs, "required"))
    if not config.enable_auto_tool_choice or config.tool_call_parser is None:
        raise ApiError(400, '"auto" tool choice needs the server to run with --enable-auto-tool-choice and '
                       "--tool-call-parser", param="tool_choice", code="unsupported_value")
    return ToolPlan("auto", specs, parser=get_tool_parser(config.tool_call_parser))


def _schema(specs: list[dict[str, Any]], choice: str | dict[str, Any]) -> dict[str, Any]:
    try:
        return tool_call_schema(specs, choice)
    except ValueError as e:
        raise ApiError(400, str(e), param="tools", code="invalid_value") from e
