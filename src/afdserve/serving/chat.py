"""Chat messages -> prompt text, with the model's Jinja chat template (``tokenizer_config.json``'s
``chat_template``, or ``--chat-template``), rendered as Hugging Face's
``apply_chat_template(add_generation_prompt=True, tools=...)`` does; models without one get
``DEFAULT_CHAT_TEMPLATE``. A template supports tools when it reads the ``tools`` variable."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from afdserve.errors import RequestError
from afdserve.serving.protocol import ChatMessage

#: For models without a chat template: one ``role: content`` line per message, then ``assistant:``.
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token or '' }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template. ``render`` raises ``RequestError`` when the template rejects the
    conversation (e.g. Mixtral's "roles must alternate")."""

    def __init__(self, template: str | None, bos_token: str | None = None, eos_token: str | None = None):
        self.source = template or DEFAULT_CHAT_TEMPLATE
        self.is_default = not template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(self.source)
        self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(self.source))
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt, tools=tools)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"the chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Request messages as chat templates read them (as vLLM passes them): ``developer`` is ``system``;
    a tool call's ``arguments`` is a dict (templates such as Qwen's and Llama 3.1's write it as JSON)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                        "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
