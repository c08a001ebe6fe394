"""Chat messages -> prompt text, with the model's Jinja chat template (``tokenizer_config.json``'s
``chat_template``), rendered as Hugging Face's ``apply_chat_template(add_generation_prompt=True)``
does; models without one get ``DEFAULT_CHAT_TEMPLATE``."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from afdserve.errors import RequestError

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
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self._template.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=True)
        except jinja2.exceptions.TemplateError as e:
            raise RequestError(f"the chat template rejected the messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
