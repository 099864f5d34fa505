"""A model's chat: its own Jinja template (compiled once) turning a conversation and
tools into a prompt, and the formats that prompt implies for the output — where its
thinking goes, and how it writes tool calls.

Rendering prefers the GGUF's ``tokenizer.chat_template`` through the sandboxed Jinja
environment of ``template.py`` (as Hugging Face renders it). llama.cpp's own renderer
is used only when Jinja cannot compile the template; a model with no template gets
ChatML, as llama-server does. ``renderer`` says which.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from ..protocol import Message, Role
from . import reasoning
from .template import CHATML, ChatTemplate
from .templatebudget import RenderBudgetError
from .tools import ToolFormat, add_system_prompt, detect_format, generic_system_prompt

log = logging.getLogger(__name__)

Turns = Sequence[tuple[bytes, str]]
LlamaRender = Callable[[Turns], str]
"""llama.cpp's built-in renderer: (role, content) pairs to the prompt."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation rendered for one model, and what its output will hold."""

    text: str
    tool_format: str | None = None
    """The ToolFormat name its calls come in, when the request has tools."""
    reasoning: str | None = None
    """The ReasoningFormat name of its thinking markers, when the template has them."""
    starts_inside: bool = False
    """The prompt opened the thinking section: the output starts inside it."""


MEDIA_MARKER = "<__media__>"
"""Where an image goes in a rendered prompt: libmtmd's default marker, which it replaces
with the image's embeddings (llama-server renders image parts the same way)."""


def flat(m: Message) -> str:
    """``m``'s content as one string: its text, and MEDIA_MARKER where each image is."""
    if isinstance(m.content, str):
        return m.content
    return "".join(MEDIA_MARKER if p.text is None else p.text for p in m.content)


def _dict(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role.value, "content": flat(m)}
    if m.tool_calls is not None:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
        if not m.content:
            out["content"] = None
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _polyfill(m: Message) -> dict[str, Any]:
    """``m`` for a template that knows no tools: calls and results as JSON text, a
    tool's result as the user's turn (as llama.cpp's generic format does)."""
    if m.tool_calls is not None:
        calls = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in m.tool_calls]
        return {"role": "assistant", "content": json.dumps({"tool_calls": calls},
                                                           ensure_ascii=False)}
    if m.role is Role.TOOL:
        result = {"tool_response": {"id": m.tool_call_id, "content": m.text}}
        return {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
    return {"role": m.role.value, "content": flat(m)}


PROBE = ({"role": "user", "content": "Hello"},)
"""The conversation a template is tried on once, before its first use."""


def probe(template: ChatTemplate) -> str | None:
    """Why ``template`` is unusable: it went over its render budget on a one-line
    conversation (a loop bomb, a huge string, ...); None when it rendered, or refused
    that conversation in its own words (which it may do)."""
    try:
        template.render(PROBE)
    except RenderBudgetError as exc:
        return f"the chat template exceeded its render budget ({exc})"
    except InvalidRequestError:
        return None
    return None


def renderer_of(source: str | None) -> tuple[str, str | None]:
    """How a model with chat template ``source`` has its chats rendered, and why not by
    its template when that is so: ``jinja``, ``llama.cpp`` (Jinja cannot compile it, or
    it exceeded its render budget) or ``chatml`` (it has none)."""
    if source is None:
        return "chatml", None
    try:
        template = ChatTemplate.compile(source, bos_token="", eos_token="")
    except InvalidRequestError as exc:
        return "llama.cpp", exc.message
    problem = probe(template)
    return ("llama.cpp", problem) if problem else ("jinja", None)


class ChatFormat:
    """One model's chat template and formats; ``render`` is safe from any thread."""

    def __init__(self, source: str | None, *, bos: str, eos: str, strip_bos: bool,
                 llama_render: LlamaRender | None = None, n_ctx: int = 0,
                 label: str = "this model") -> None:
        """``source``: the GGUF's template (None: none); ``strip_bos``: the tokenizer adds
        BOS itself, so a rendered leading BOS text is dropped; ``llama_render``: llama.cpp's
        renderer for this template, when it has one; ``n_ctx``: a slot's tokens (the
        render budget's bytes follow); ``label``: the model, in errors.

        Raises InvalidRequestError when the template does not compile and llama.cpp has
        no renderer for it."""
        self.source = source
        self.label = label
        self._bos = bos
        self._strip_bos = strip_bos
        self._llama = llama_render
        self._template: ChatTemplate | None = None
        self.renderer = "chatml"
        self.unusable: str | None = None
        """Why the model's own template is not used (it went over its render budget
        when tried), if so."""
        if source is not None:
            try:
                self._template = ChatTemplate.compile(source, bos_token=bos, eos_token=eos,
                                                      n_ctx=n_ctx)
                self.renderer = "jinja"
            except InvalidRequestError as exc:
                if llama_render is None:
                    raise
                log.info("%s; llama.cpp's renderer is used", exc.message)
                self.renderer = "llama.cpp"
            if self._template is not None and (problem := probe(self._template)):
                # As a template that does not compile: llama.cpp's renderer, if it has one.
                self._template, self.unusable = None, f"model '{label}': {problem}"
                self.renderer = "llama.cpp" if llama_render is not None else "none"
                log.warning("%s; %s", self.unusable,
                            "llama.cpp's renderer is used" if llama_render is not None
                            else "chats are refused")
        else:
            self._template = ChatTemplate.compile(CHATML, bos_token=bos, eos_token=eos,
                                                  n_ctx=n_ctx)
        text = source or ""
        self.tool_format = detect_format(text if self.renderer == "jinja" else None)
        self._thinks = reasoning.detect(text)
        self._think_flag = bool(source) and reasoning.accepts_enable_thinking(text)
        self._tool_role = "tool" in text

    def render(self, messages: Sequence[Message], *,
               tools: Sequence[dict[str, Any]] | None = None,
               think: bool | None = None) -> ChatPrompt:
        """The prompt for ``messages`` ready for the assistant's turn; with ``tools``,
        in the model's own tool format. Raises InvalidRequestError with the template's
        own message when it refuses the conversation."""
        tool_format = self.tool_format if tools else None
        if self._template is None and self._llama is None:
            raise InvalidRequestError(f"{self.unusable}: this model has no chat")
        if self._template is None:  # llama.cpp's renderer: no tools, no flags
            assert self._llama is not None
            dicts = [_polyfill(m) for m in messages]
            if tools:
                dicts = add_system_prompt(dicts, generic_system_prompt(tools))
                tool_format = ToolFormat.GENERIC
            text = self._llama([(d["role"].encode(), d["content"] or "") for d in dicts])
        else:
            flags: dict[str, Any] = {}
            if think is not None and self._think_flag:
                flags["enable_thinking"] = think
            native = tool_format is not None and tool_format is not ToolFormat.GENERIC
            polyfill = (tools and not native) or (not self._tool_role and any(
                m.tool_calls is not None or m.role is Role.TOOL for m in messages))
            dicts = [_polyfill(m) if polyfill else _dict(m) for m in messages]
            if tools and not native:
                dicts = add_system_prompt(dicts, generic_system_prompt(tools))
            try:
                text = self._template.render(dicts, tools=tools if native else None, **flags)
            except RenderBudgetError as exc:
                raise InvalidRequestError(f"the chat template of model '{self.label}' "
                                          f"exceeded its render budget: {exc}") from None
        if self._strip_bos and self._bos and text.startswith(self._bos):
            text = text[len(self._bos):]  # the tokenizer adds it
        inside = self._thinks is not None and reasoning.starts_inside(text, self._thinks)
        return ChatPrompt(text, tool_format.name if tool_format else None,
                          self._thinks.name if self._thinks else None, inside)
