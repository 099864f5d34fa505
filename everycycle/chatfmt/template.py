"""Chat templates: a GGUF's ``tokenizer.chat_template`` rendered the way Hugging Face
transformers' ``apply_chat_template`` renders it.

The environment is transformers' own: an immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, a ``tojson`` filter that keeps non-ASCII
text and takes ``indent``, and the globals ``raise_exception`` and ``strftime_now``; the
``{% generation %}`` block (assistant masks in training) renders its body unchanged.
Every render runs under a budget of time, operations and bytes (templatebudget.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser

from ..errors import InvalidRequestError
from .templatebudget import BudgetedEnvironment, bounded, output_cap, str_join

CHATML = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)
"""llama.cpp's ChatML template, which llama-server uses for a model without one."""


class TemplateRaisedError(jinja2.TemplateError):
    """Raised by a template's ``raise_exception(message)``."""


def _raise_exception(message: object) -> NoReturn:
    raise TemplateRaisedError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: no HTML escaping, non-ASCII kept, ``indent`` honoured."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: the body, rendered as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.cache
def _environment() -> BudgetedEnvironment:
    env = BudgetedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _syntax_error(exc: jinja2.TemplateError) -> InvalidRequestError:
    line = getattr(exc, "lineno", None)
    where = f" at line {line}" if line else ""
    return InvalidRequestError(f"chat template: syntax error{where}: {exc.message or exc}")


def template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads without setting them (``enable_thinking``, ...).

    Raises InvalidRequestError when it does not parse.
    """
    try:
        ast = _environment().parse(source)
    except jinja2.TemplateError as exc:
        raise _syntax_error(exc) from None
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


def _arguments(value: object) -> object:
    """Tool-call arguments as the templates expect them: a dict where the JSON allows."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, dict):
            return parsed
    return value


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(call)
    function = out.get("function")
    if isinstance(function, Mapping):
        out["function"] = dict(function)
        if "arguments" in function:
            out["function"]["arguments"] = _arguments(function["arguments"])
    if "arguments" in out:
        out["arguments"] = _arguments(out["arguments"])
    return out


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    calls = out.get("tool_calls")
    if isinstance(calls, Sequence) and not isinstance(calls, str):
        out["tool_calls"] = [_tool_call(c) if isinstance(c, Mapping) else c for c in calls]
    return out


class ChatTemplate:
    """One compiled chat template and the BOS/EOS texts it is rendered with."""

    def __init__(self, source: str, template: jinja2.Template, *, bos_token: str,
                 eos_token: str, max_bytes: int) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.max_bytes = max_bytes
        """The largest prompt (and value inside the render) it may build."""
        self._template = template

    @classmethod
    def compile(cls, source: str, *, bos_token: str, eos_token: str,
                n_ctx: int = 0) -> ChatTemplate:
        """Compile ``source`` for a model of ``n_ctx`` tokens a slot (its render budget
        follows); raises InvalidRequestError naming a syntax error."""
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise _syntax_error(exc) from None
        except (RecursionError, MemoryError, ValueError) as exc:  # nested past the parser
            raise InvalidRequestError(f"chat template does not compile: "
                                      f"{type(exc).__name__}") from None
        # Jinja's ``~`` calls the compiled module's str_join: the budgeted one.
        template.root_render_func.__globals__["str_join"] = str_join
        return cls(source, template, bos_token=bos_token, eos_token=eos_token,
                   max_bytes=output_cap(n_ctx))

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **flags: object) -> str:
        """The prompt for ``messages`` (and ``tools``; extra ``flags`` such as
        ``enable_thinking`` become template variables).

        A null ``content`` is passed as None (as transformers does); only when that
        fails to render is it retried as "" (as llama.cpp does). Raises
        InvalidRequestError with the template's own message when it calls
        ``raise_exception``, or saying what failed when rendering fails otherwise;
        RenderBudgetError when it runs out of time, operations or bytes.
        """
        prepared = [_message(m) for m in messages]
        try:
            return self._render(prepared, tools, add_generation_prompt, flags)
        except InvalidRequestError:
            if not any(m.get("content", "") is None for m in prepared):
                raise
        # Many templates concatenate or search the content, which fails on the null
        # content of an assistant message that only calls tools; llama.cpp (minja's
        # requires_non_null_content) then renders it as "", and so do we.
        for m in prepared:
            if "content" in m and m["content"] is None:
                m["content"] = ""
        return self._render(prepared, tools, add_generation_prompt, flags)

    def _render(self, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                add_generation_prompt: bool, flags: Mapping[str, object]) -> str:
        context: dict[str, object] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **flags,
            "messages": messages,
            "tools": [dict(t) for t in tools] if tools else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return bounded(lambda: self._template.generate(context), self.max_bytes)
        except TemplateRaisedError as exc:
            message = exc.message or "the chat template refused the request"
            raise InvalidRequestError(message) from None
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed to render: {exc}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError,
                RecursionError) as exc:
            raise InvalidRequestError(
                f"chat template failed to render: {type(exc).__name__}: {exc}") from None
