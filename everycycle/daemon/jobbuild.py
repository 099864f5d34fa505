"""A protocol request to the engine Job that runs it: tokens, sampling, grammar, and
how its output is split (answer, thinking, tool calls).

Blocking (tokenizing, compiling a grammar): the supervisor calls it on a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..chatfmt import constraint, infill
from ..chatfmt.callgrammar import CallGrammar, CallGrammars
from ..chatfmt.chat import ChatPrompt
from ..chatfmt.chatoutput import ChatOutput
from ..chatfmt.reasoning import ReasoningFormat
from ..chatfmt.schemacheck import ArgumentCheck
from ..chatfmt.tools import ToolFormat
from ..engine.core.jobs import Job, JobSpec, Sampling
from ..engine.core.thinking import ThinkBudget
from ..engine.host.contract import Engine
from ..errors import InvalidRequestError, ProtocolError
from ..models.registry import ModelSpec
from ..protocol import Embed, Format, Generate, Message, Role, ToolChoice
from ..protocol.sampling import values_of as sampling_values
from .lorascales import LoraScales


def sampling(req: Generate, model_defaults: Mapping[str, Any], grammar: str | None = None
             ) -> Sampling:
    """The request's options, else the model's (models.toml), else llama.cpp's defaults
    (the table's: the engine reads an unset one as its default)."""
    return Sampling({**model_defaults, **sampling_values(req)}, grammar,
                    ignore_eos=req.ignore_eos is True)


def infill_tokens(spec: ModelSpec, engine: Engine, req: Generate) -> list[int]:
    """A fill-in-the-middle prompt, laid out as llama-server lays it out with the model's
    own FIM tokens. Raises InvalidRequestError for a model without them."""
    assert req.infill is not None and req.prompt is not None
    facts = engine.vocab_facts
    if missing := facts.fim.missing:
        raise InvalidRequestError(
            f"model '{spec.name}' cannot fill in the middle: its vocabulary has no FIM "
            f"{', '.join(missing)} token{'s' if len(missing) > 1 else ''}")

    def tokenize(texts: Sequence[str]) -> list[list[int]]:
        return engine.tokens(texts)

    fill = req.infill
    return infill.layout(facts.fim, tokenize, prefix=req.prompt, suffix=fill.suffix,
                         middle=fill.middle,
                         extra=[infill.Chunk(c.filename, c.text) for c in fill.extra],
                         bos=facts.bos, n_ctx=engine.n_ctx_slot,
                         n_predict=req.max_tokens or -1)


def given_tokens(engine: Engine, ids: Sequence[int]) -> list[int]:
    """A prompt given as token ids. Raises InvalidRequestError for an id the model's
    vocabulary lacks."""
    n_vocab = engine.vocab_facts.n_vocab
    bad = next((t for t in ids if t >= n_vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token {bad} is not in the model's vocabulary of "
                                  f"{n_vocab}")
    return list(ids)


Listed = tuple[list[dict[str, Any]], list[str]]
"""A request's tools, and their names."""


def _tools(req: Generate, grammars: CallGrammars) -> Listed | None:
    """The request's tools (each one a well-formed function tool; parsed once per list)
    and their names, unless ``tool_choice`` is none. Raises InvalidRequestError."""
    if req.tools is None or req.tool_choice is ToolChoice.NONE:
        return None
    tools, names = grammars.parsed(req.tools)  # (a JSON array: the protocol checked)
    if req.tool_name is not None and req.tool_name not in names:
        raise InvalidRequestError(f"tool_name names '{req.tool_name}', which is not in tools")
    return tools, names


def _tool_grammar(req: Generate, prompt: ChatPrompt, grammars: CallGrammars) -> CallGrammar:
    """The constraint that holds the model to well-formed calls (lazy under ``auto``:
    free text stays free until a call begins), compiled once per list."""
    assert prompt.tool_format is not None and req.tools is not None
    forced = req.tool_choice is ToolChoice.REQUIRED or req.tool_name is not None
    return grammars.get(ToolFormat[prompt.tool_format], req.tools, forced=forced,
                        name=req.tool_name, parallel=req.parallel_tool_calls is True)


def _images(spec: ModelSpec, req: Generate) -> tuple[bytes, ...]:
    """The request's images, in order. Raises InvalidRequestError for a model without a
    vision projector, or data that is not base64."""
    parts = [p for m in req.messages or () for p in m.images]
    if not parts:
        return ()
    if spec.mmproj is None:
        raise InvalidRequestError(f"model '{spec.name}' cannot read images: it has no vision "
                                  "projector (`mmproj` in models.toml)")
    try:
        return tuple(p.image_bytes() for p in parts)
    except ProtocolError as exc:
        raise InvalidRequestError(exc.message) from None


def _model_grammar(spec: ModelSpec, req: Generate) -> str | None:
    """The model's own grammar for this turn (models.toml ``grammar``, or
    ``grammar_after_tools`` when the conversation ends with tool results); None where
    the request forces a tool of its own."""
    if req.tool_name is not None or req.tool_choice is ToolChoice.REQUIRED:
        return None
    last = req.messages[-1].role if req.messages else Role.USER
    return spec.grammar_after_tools if last is Role.TOOL else spec.grammar


def _think(spec: ModelSpec, req: Generate, prompt: ChatPrompt | None) -> ThinkBudget | None:
    """The request's thinking budget, where its model thinks between markers and a
    budget applies (its own, its effort's, or the model's default)."""
    if prompt is None or prompt.reasoning is None or req.think is False:
        return None
    effort = req.think_effort.value if req.think_effort is not None else None
    budget = spec.reasoning.budget(req.think_budget, effort)
    if budget is None:
        return None
    markers = ReasoningFormat[prompt.reasoning]
    return ThinkBudget(budget, markers.open, markers.close, inside=prompt.starts_inside,
                       message=spec.reasoning.message)


def build_job(spec: ModelSpec, engine: Engine, req: Generate | Embed, tag: object,
              background_age: float | None = None, grammars: CallGrammars | None = None,
              lora: LoraScales | None = None) -> tuple[Job, ChatOutput | None]:
    """The engine Job for ``req`` on ``engine``, routed by ``tag``, and what splits its
    output (None: the text is the answer). ``grammars``: the compiled tool lists kept
    (a fresh one, keeping nothing, when not given).

    Raises InvalidRequestError for what cannot run: too long a prompt or input, a
    schema, grammar or tools that do not compile, a conversation for a completion model.
    """
    if isinstance(req, Embed):
        inputs = ([engine.tokenize(text, Format.RAW) for text in req.input]
                  if req.query is None else engine.rerank_tokens(req.query, req.input))
        job = Job(JobSpec(tokens=(), max_tokens=1, embed_inputs=inputs,
                          rerank=req.query is not None, background_age=background_age),
                  tag=tag)
        job.spec.check_fits(engine.n_ctx_slot)
        return job, None
    grammars = grammars or CallGrammars(0)
    listed = _tools(req, grammars)
    tools, names = listed if listed is not None else (None, None)
    prompt: ChatPrompt | None = None
    if req.prompt_tokens is not None:
        tokens = given_tokens(engine, req.prompt_tokens)
    elif req.infill is not None:
        tokens = infill_tokens(spec, engine, req)
    elif req.messages is not None:
        if spec.format is Format.RAW:
            raise InvalidRequestError(f"model '{spec.name}' is a completion model: it has no "
                                      "chat; send a `prompt` instead of `messages`")
        tokens, prompt = engine.chat_prompt(req.messages, tools, req.think)
    elif (req.format or spec.format) is Format.RAW:
        assert req.prompt is not None
        tokens = engine.tokenize(req.prompt, Format.RAW)
    else:
        assert req.prompt is not None
        tokens, prompt = engine.chat_prompt((Message(Role.USER, req.prompt),), None,
                                            req.think, True)
    grammar: str | None = None
    if req.json_schema is not None:
        grammar = constraint.json_schema(req.json_schema)
    elif req.grammar is not None:
        grammar = constraint.gbnf(req.grammar)
    elif (own := _model_grammar(spec, req)) is not None:
        grammar = constraint.gbnf(own, f"model '{spec.name}' grammar")
    check: ArgumentCheck | None = None
    if grammar is None and tools is not None and prompt is not None:
        calls = _tool_grammar(req, prompt, grammars)
        grammar, check = calls.grammar, calls.check
    output = (ChatOutput(prompt, names, check) if prompt is not None
              and ChatOutput.needed(prompt, names) else None)
    # On by default only where a draft's batch cannot change the output (the engine
    # checked at load); asked for explicitly, it runs regardless.
    lookup = (req.speculative if req.speculative is not None
              else spec.speculative and engine.lookup_exact) and req.logprobs is None
    images = _images(spec, req)
    job = Job(JobSpec(
        tokens=tokens, max_tokens=req.max_tokens or spec.max_tokens or engine.n_ctx_slot,
        sampling=sampling(req, spec.sampling, grammar), stop=req.stop or (),
        lookup=lookup and not images, draft=req.speculative is not False,
        special=output is not None, logprobs=req.logprobs,
        post_sampling=req.post_sampling_probs is True,
        images=images, text=prompt.text if images and prompt is not None else None,
        progress=bool(req.progress), background_age=background_age,
        think=_think(spec, req, prompt), n_indent=req.n_indent or 0,
        t_max_predict_ms=req.t_max_predict_ms or 0,
        lora=(lora or LoraScales()).for_request(spec, [(s.id, s.scale) for s in req.lora or ()])
        if spec.lora or req.lora else ()), tag=tag)
    job.spec.check_fits(engine.n_ctx_slot)
    if grammar is not None:
        engine.check_grammar(grammar)  # compiled once, for its vocabulary: the engine keeps it
    return job, output
