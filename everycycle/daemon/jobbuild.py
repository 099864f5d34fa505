"""A protocol request to the engine Job that runs it: tokens, sampling, grammar.

Blocking (tokenizing, compiling a grammar): the supervisor calls it on a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine.contract import Engine
from ..engine.grammar import check_size as check_grammar_size
from ..engine.grammar import schema_to_gbnf
from ..engine.jobs import Job, Sampling
from ..models.registry import ModelSpec
from ..protocol import Embed, Format, Generate


def sampling(req: Generate, model_defaults: Mapping[str, Any],
             grammar: str | None = None) -> Sampling:
    """The request's options, else the model's (models.toml), else llama.cpp's defaults."""
    values: dict[str, Any] = {**model_defaults, "grammar": grammar}
    for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed"):
        given = getattr(req, name)
        if given is not None:
            values[name] = given
    return Sampling(**values)


def build_job(spec: ModelSpec, engine: Engine, req: Generate | Embed, tag: object) -> Job:
    """The engine Job for ``req`` on ``engine``, routed by ``tag``.

    Raises InvalidRequestError for what cannot run: too long a prompt or input, a
    schema or grammar that does not compile.
    """
    if isinstance(req, Embed):
        inputs = [engine.tokenize(text, Format.RAW) for text in req.input]
        job = Job(tokens=(), max_tokens=1, embed_inputs=inputs, tag=tag)
        job.check_fits(engine.n_ctx_slot)
        return job
    if req.messages is not None:
        tokens = engine.tokenize_chat(req.messages)
    else:
        assert req.prompt is not None
        tokens = engine.tokenize(req.prompt, req.format or spec.format)
    grammar = req.grammar
    if req.json_schema is not None:
        grammar = schema_to_gbnf(req.json_schema)  # (its size checked)
    elif grammar is not None:
        check_grammar_size(grammar)
    # On by default only where a draft's batch cannot change the output (the engine
    # checked at load); asked for explicitly, it runs regardless.
    lookup = (req.speculative if req.speculative is not None
              else spec.speculative and engine.lookup_exact)
    job = Job(tokens=tokens, max_tokens=req.max_tokens or engine.n_ctx_slot,
              sampling=sampling(req, spec.sampling, grammar), stop=req.stop or (), tag=tag,
              lookup=lookup)
    job.check_fits(engine.n_ctx_slot)
    if grammar is not None:
        engine.check_grammar(grammar)  # compiled once: the engine keeps it for the job
    return job
