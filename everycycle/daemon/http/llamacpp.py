"""llama-server's native API, the fifth dialect: what editors (llama.vim, llama.vscode),
Continue's llama.cpp provider, Mikupad and SillyTavern speak.

    POST /completion, /completions   prompt (text, token ids, mixed, or a list of them)
                                     → one Generate each (SSE ``data:`` objects; the last
                                     one ``stop: true`` with timings), no ``[DONE]``
    POST /infill                     input_prefix/input_suffix/input_extra/prompt → a
                                     Generate with ``infill`` (fill in the middle)
    POST /tokenize, /detokenize      the model's tokenizer (``add_special``,
                                     ``parse_special``, ``with_pieces``)
    POST /apply-template             messages → the prompt the chat template renders
    GET  /props                      the model's context, slots, template, modalities
    GET  /slots                      each slot: busy or not, and (to its own key) what
                                     it holds

Which model: ``model`` (or ``?model=``) when given, else the registry's default;
llama-server serves one model, so its clients name none. Work on the tokenizer loads the
model where it is not resident. Prompts are tokenized as llama-server tokenizes them
(control tokens' text read as those tokens, BOS added where the model adds one), then
sent as ``prompt_tokens``. Errors are llama-server's ``{"error": {code, message, type}}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio.to_thread
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...engine.host.contract import Engine
from ...errors import EverycycleError
from ...hardware.gguf import read_metadata
from ...models.registry import ModelSpec
from ...protocol import Error, Format, Generate, TokenLogprob, sampling
from ..events import RequestState
from ..keys import Principal, may_act_for
from ..outcome import Outcome
from ..residency import context as residency_context
from . import llamacpp_request as parse
from . import openai_request
from .answer import Answer, Choice, Failed, Finished, FinishReason, Text, Usage
from .common import HttpError, protocol_errors, request_id
from .exchange import STATUS, Dialect, Exchange, Spawner, dumps, on_engine, text_biases
from .llamafields import FINGERPRINT, timings
from .ollama_meta import present_file

T = TypeVar("T")

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "unavailable_error", 499: "cancelled", 500: "server_error",
         501: "not_supported_error", 503: "unavailable_error"}

PATHS = ("/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
         "/slots")
"""The routes whose errors are llama-server's shape (``/completion`` covers
``/completions``)."""

def error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message,
                      "type": _TYPE.get(status, "server_error")}}


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def error_answer(event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
    """A terminal Error in llama-server's shape; a prompt longer than the context is its
    ``exceed_context_size_error`` (400) with both sizes."""
    status = STATUS[event.kind]
    body = error_body(status, event.message)
    if outcome is not None and outcome.context_limit is not None:
        body["error"].update(type="exceed_context_size_error",
                             n_prompt_tokens=outcome.prompt_tokens,
                             n_ctx=outcome.context_limit)
    return status, dumps(body)


def _stop_type(reason: FinishReason) -> str:
    return {FinishReason.EOS: "eos", FinishReason.STOP: "word"}.get(reason, "limit")


def _probs(entries: Sequence[TokenLogprob], ids: Sequence[int], post: bool
           ) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities``: each token with its log-probability
    and its alternatives' (``post``: the probabilities after the sampler chain, as
    ``prob``/``top_probs``)."""
    import math

    def value(logprob: float) -> float:
        return math.exp(logprob) if post else logprob

    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    return [{"id": tok, "token": e.token, "bytes": list(e.token.encode()),
             key: value(e.logprob),
             top_key: [{"id": t.id, "token": t.token, "bytes": list(t.token.encode()),
                        key: value(t.logprob)} for t in e.top]}
            for e, tok in zip(entries, ids, strict=False)]


def mixed_tokens(engine: Engine, prompts: Sequence[parse.Prompt], *, add_bos: bool = True,
                 parse_special: bool = True) -> list[list[int]]:
    """Each prompt's tokens as llama-server reads a prompt: its text with control tokens'
    text read as those tokens, its ids as they are, BOS first (``add_bos``) where the
    model adds one and the prompt begins with text. (On a worker thread.)"""
    texts = [p for prompt in prompts for p in prompt if isinstance(p, str)]
    toks = iter(engine.tokens(texts, parse_special=parse_special))
    bos = engine.vocab_facts.bos if add_bos else None
    out = []
    for prompt in prompts:
        ids = [bos] if bos is not None and isinstance(prompt[0], str) else []
        for piece in prompt:
            ids.extend(next(toks) if isinstance(piece, str) else (piece,))
        out.append(ids)
    return out


class _Native(Exchange):
    """A native completion's answer: one object per prompt (a list for several), or an
    SSE stream of ``data:`` objects, each prompt's last with ``stop: true``."""

    def __init__(self, api: Spawner, reqs: Sequence[Generate], principal: Principal,
                 shape: parse.Completion, *, model: str, prompts: Sequence[str],
                 listed: bool, n_ctx: int, eog: Sequence[int] = ()) -> None:
        super().__init__(api, reqs[0], principal, reqs[1:])
        self.shape = shape
        self.stream = shape.stream
        self.model = model
        self.prompts = prompts
        self.listed = listed
        """Several prompts (or one given as a list of prompts): a list answers."""
        self.generated = [0] * len(reqs)
        self.n_ctx = n_ctx
        self.eog = eog
        """The model's end tokens (listed in ``generation_settings`` with ``ignore_eos``)."""
        """A slot's context (llama.vscode reads it in ``generation_settings``)."""

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        return error_answer(event, outcome)

    def _settings(self, i: int) -> dict[str, Any]:
        """``generation_settings``: the request's sampling, the table's defaults elsewhere."""
        req = self.reqs[i]
        assert isinstance(req, Generate)
        given = sampling.values_of(req)
        out = sampling.to_json({p.name: given.get(p.name, p.default) for p in sampling.PARAMS
                                if p is not sampling.LOGIT_BIAS})
        # llama-server's list; ``ignore_eos`` bars each end token (-inf: null in JSON)
        biases = given.get(sampling.LOGIT_BIAS.name, ())
        out["logit_bias"] = [{"bias": b.bias, "token": b.token} for b in biases] + [
            {"bias": None, "token": t} for t in self.eog if req.ignore_eos]
        n_predict = -1 if self.shape.n_predict is None else self.shape.n_predict
        return {**out, "n_ctx": self.n_ctx, "seed": req.seed if req.seed is not None else -1,
                "n_predict": n_predict, "max_tokens": n_predict,
                "stop": list(req.stop or ()), "ignore_eos": bool(req.ignore_eos),
                "stream": self.stream, "n_probs": self.shape.n_probs,
                "post_sampling_probs": self.shape.post_sampling, "grammar": req.grammar or "",
                "lora": [{"id": s.id, "scale": s.scale} for s in req.lora or ()]}

    def _text(self, text: str) -> str:
        return "" if self.shape.n_predict == 0 else text

    def _final(self, i: int, choice: Choice, *, content: str) -> dict[str, Any]:
        usage = choice.usage
        generated = 0 if self.shape.n_predict == 0 else usage.generated
        shown = Usage(usage.prompt, usage.cached, generated, usage.reasoning, usage.drafted,
                      usage.draft_accepted)
        req = self.reqs[i]
        stops = req.stop if isinstance(req, Generate) and req.stop else ()
        obj: dict[str, Any] = {
            "index": i, "content": content,
            "tokens": list(choice.ids) if self.shape.return_tokens and not self.stream
            and self.shape.n_predict != 0 else [],
            "id_slot": -1, "stop": True, "model": self.model,
            "tokens_predicted": generated, "tokens_evaluated": usage.prompt,
            "generation_settings": self._settings(i), "prompt": self.prompts[i],
            "has_new_line": "\n" in content, "truncated": False,
            "stop_type": _stop_type(choice.reason),
            "stopping_word": stops[0] if choice.reason is FinishReason.STOP and len(stops)
            == 1 else "",
            "tokens_cached": usage.prompt + generated, "timings": timings(shown, choice.outcome),
            "system_fingerprint": FINGERPRINT}
        if self.shape.n_probs and not self.stream and self.shape.n_predict != 0:
            obj["completion_probabilities"] = _probs(choice.logprobs, choice.ids,
                                                     self.shape.post_sampling)
        if self.shape.response_fields:
            return parse.nested(self.shape.response_fields, obj)
        return obj

    def whole(self, answer: Answer) -> Any:  # (a list for several prompts)
        objs = [self._final(i, c, content=self._text(c.text))
                for i, c in enumerate(answer.choices)]
        return objs if self.listed else objs[0]

    def on_text(self, part: Text) -> bytes:
        if self.shape.n_predict == 0:
            return b""
        i = part.index
        pieces: list[tuple[str, Sequence[int], Sequence[TokenLogprob]]] = [
            (part.text, part.ids, part.logprobs)]
        if self.shape.n_probs and len(part.logprobs) > 1 and "".join(
                e.token for e in part.logprobs) == part.text:
            # one object a token, as llama-server streams them
            pieces = [(e.token, (t,), (e,)) for e, t in zip(part.logprobs, part.ids,
                                                            strict=False)]
        out = b""
        for text, ids, logprobs in pieces:
            self.generated[i] += len(ids)
            obj: dict[str, Any] = {
                "index": i, "content": text,
                "tokens": list(ids) if self.shape.return_tokens else [], "stop": False,
                "id_slot": -1, "tokens_predicted": self.generated[i],
                "tokens_evaluated": 0}
            if self.shape.n_probs and logprobs:
                obj["completion_probabilities"] = _probs(logprobs, ids,
                                                         self.shape.post_sampling)
            out += b"data: " + dumps(obj) + b"\n\n"
        return out

    def on_finished(self, part: Finished) -> bytes:
        choice = Choice(finished=part)
        return b"data: " + dumps(self._final(part.index, choice, content="")) + b"\n\n"

    def on_failed(self, part: Failed) -> bytes:
        return b"data: " + error_answer(part.error, part.outcome)[1] + b"\n\n"


class LlamaCpp(Dialect):
    """llama-server's native routes over ``api`` (where requests run) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/completion", self.completion, methods=["POST"]),
            Route("/completions", self.completion, methods=["POST"]),
            Route("/infill", self.infill, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/props", self.props, methods=["GET"]),
            Route("/slots", self.slots, methods=["GET"]),
        ]

    async def _on_engine(self, request: HttpRequest, model: str,
                         fn: Callable[[Engine], T]) -> tuple[ModelSpec, T]:
        return await on_engine(self.api, request, model, fn)

    async def _body(self, request: HttpRequest) -> tuple[dict[str, Any], str]:
        data = await self.reader.json(request)
        name = data.get("model") or request.query_params.get("model")
        return data, self.reader.model(request, name, "GET /v1/models")

    # ------------------------------------------------------------------ generating

    async def completion(self, request: HttpRequest) -> Any:
        data, model = await self._body(request)
        prompts = parse.prompts(data.get("prompt"))
        listed = len(prompts) > 1 or (isinstance(data.get("prompt"), list) and any(
            not isinstance(v, int) for v in data["prompt"]) and len(prompts) == 1
            and isinstance(data["prompt"][0], list | dict))
        spec, token_lists = await self._on_engine(
            request, model, lambda engine: mixed_tokens(engine, prompts))
        await text_biases(self.api, request, model, data)
        if not all(token_lists):
            raise HttpError(400, "the prompt is empty after tokenization", "invalid_prompt")
        return self._answer(request, data, spec, "cmpl", model, listed, [
            ({"prompt_tokens": tuple(ids)}, "".join(p for p in prompt if isinstance(p, str)))
            for ids, prompt in zip(token_lists, prompts, strict=True)])

    async def infill(self, request: HttpRequest) -> Any:
        data, model = await self._body(request)

        def missing(engine: Engine) -> list[str]:
            return engine.vocab_facts.fim.missing

        spec, lacks = await self._on_engine(request, model, missing)
        if lacks:
            raise HttpError(501, "Infill is not supported by this model: " + " ".join(
                f"{name} token is missing." for name in lacks), "not_supported_error")
        prefix, fill = parse.infill(data)
        await text_biases(self.api, request, model, data)
        return self._answer(request, data, spec, "infill", model, False, [
            ({"prompt": prefix, "format": Format.RAW, "infill": fill}, prefix + fill.middle)])

    def _answer(self, request: HttpRequest, data: dict[str, Any], spec: ModelSpec,
                prefix: str, model: str, listed: bool,
                prompts: Sequence[tuple[dict[str, Any], str]]) -> _Native:
        """The answer to ``prompts`` (each: its Generate's prompt fields, and its text),
        ``n_cmpl`` completions of each (at most the model's slots, as llama-server's
        limit: they run at once; seeds ``seed+1``, … where one is given)."""
        shape, own = parse.completion(data)
        options = {**openai_request.options(request, data), **own}
        n_cmpl = parse.integer(data, "n_cmpl", parse.integer(data, "n", 1)) or 1
        if not 1 <= n_cmpl <= spec.parallel:  # (llama-server's words: its clients read them)
            raise HttpError(400, "Field 'n_cmpl': Value must be between 1 <= value <= "
                            f"{spec.parallel}, but got {n_cmpl}", "invalid_value")
        rid = request_id(request, prefix)
        seed = options.get("seed")
        reqs: list[Generate] = []
        texts: list[str] = []
        for i, (fields, text) in enumerate(prompts):
            for j in range(n_cmpl):
                k = i * n_cmpl + j
                seeded = {"seed": (seed + j) % (2**32 - 1)} if seed is not None and j else {}
                reqs.append(protocol_errors(Generate, rid if k == 0 else f"{rid[:56]}.{k}",
                                            model, **fields, **{**options, **seeded}))
                texts.append(text)
        residency = self.api.supervisor.residency
        resident = residency.models.get(spec.name)
        return _Native(self.api, reqs, request.state.principal, shape, model=model,
                       prompts=texts, listed=listed or len(reqs) > 1,
                       n_ctx=residency_context.of(residency, spec.name) or 0,
                       eog=resident.engine.vocab_facts.eog if resident is not None else ())

    # ------------------------------------------------------------------ the tokenizer

    async def tokenize(self, request: HttpRequest) -> Response:
        data, model = await self._body(request)
        content = data.get("content")
        if content is None:
            return JSONResponse({"tokens": []})
        (prompt,) = parse.prompts(content, "`content`") if not isinstance(content, list) or any(
            isinstance(v, int) for v in content) else [tuple(content)]
        add_special = parse.flag(data, "add_special", False)
        parse_special = parse.flag(data, "parse_special", True)
        with_pieces = parse.flag(data, "with_pieces", False)

        def work(engine: Engine) -> list[Any]:
            (ids,) = mixed_tokens(engine, [prompt], add_bos=add_special,
                                  parse_special=parse_special)
            if not with_pieces:
                return ids
            out: list[Any] = []
            for tok, raw in zip(ids, engine.pieces(ids), strict=True):
                try:
                    shown: Any = raw.decode("utf-8")
                except UnicodeDecodeError:
                    shown = list(raw)
                out.append({"id": tok, "piece": shown})
            return out

        _, tokens = await self._on_engine(request, model, work)
        return JSONResponse({"tokens": tokens})

    async def detokenize(self, request: HttpRequest) -> Response:
        data, model = await self._body(request)
        ids = parse.token_ids(data.get("tokens", []), "`tokens`")

        def work(engine: Engine) -> str:
            return b"".join(engine.pieces(ids)).decode("utf-8", "replace")

        _, content = await self._on_engine(request, model, work)
        return JSONResponse({"content": content})

    async def apply_template(self, request: HttpRequest) -> Response:
        data, model = await self._body(request)
        messages = openai_request.messages(data.get("messages"))
        tools = data.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise HttpError(400, "`tools` must be a list of tool objects", "invalid_tools")
        think = openai_request.thinking(data).get("think")

        def work(engine: Engine) -> str:
            return engine.chat_prompt(messages, tools, think)[1].text

        _, prompt = await self._on_engine(request, model, work)
        return JSONResponse({"prompt": prompt})

    # ------------------------------------------------------------------ the server

    async def props(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        model = self.reader.model(request, request.query_params.get("model"), "GET /v1/models")

        def facts(engine: Engine) -> tuple[int, int | None]:
            return engine.n_ctx_slot, engine.parallel

        spec, (n_ctx, slots) = await self._on_engine(request, model, facts)
        path = present_file(spec)
        meta: dict[str, Any] = {}
        if path is not None:
            try:
                meta = await anyio.to_thread.run_sync(
                    read_metadata, path, ("tokenizer.chat_template",))
            except EverycycleError:
                meta = {}
        template = meta.get("tokenizer.chat_template")
        values = {p.name: spec.sampling.get(p.name, p.default) for p in sampling.PARAMS}
        return JSONResponse({
            "default_generation_settings": {
                "n_ctx": n_ctx, "params": {**sampling.to_json(values), "n_predict": -1,
                                           "seed": spec.sampling.get("seed", -1)}},
            "total_slots": slots, "model_alias": model,
            "model_path": str(path) if path is not None else spec.source,
            "modalities": {"vision": spec.mmproj is not None, "audio": False,
                           "video": False},
            "chat_template": template if isinstance(template, str) else "",
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
            "build_info": FINGERPRINT, "is_sleeping": False})

    async def slots(self, request: HttpRequest) -> Response:
        """Each slot of the model: busy or not; what it reads and wrote so far only to the
        key that sent it (or an admin's)."""
        principal = self.reader.auth(request)
        model = self.reader.model(request, request.query_params.get("model"), "GET /v1/models")
        sup = self.api.supervisor
        model = sup.registry.alias(model) or model
        resident = sup.residency.models.get(model)
        spec = sup.registry.models.get(model)
        n_slots = (resident.engine.parallel if resident is not None
                   else spec.parallel if spec is not None else 1)
        n_ctx = residency_context.of(sup.residency, model) or 0
        running = [a for a in sup.requests.active.values()
                   if a.model == model and a.state is RequestState.RUNNING]
        out = []
        for i in range(n_slots):
            slot: dict[str, Any] = {"id": i, "n_ctx": n_ctx, "speculative": False,
                                    "is_processing": i < len(running)}
            if i < len(running):
                active = running[i]
                slot["id_task"] = active.req.request_id
                slot["n_prompt_tokens"] = active.n_prompt
                slot["next_token"] = [{"has_next_token": True, "n_decoded": active.n_out}]
                if may_act_for(principal, active.peer.principal) and isinstance(
                        active.req, Generate):
                    slot["prompt"] = await self._prompt_text(active.req, resident)
            out.append(slot)
        return JSONResponse(out)

    @staticmethod
    async def _prompt_text(req: Generate, resident: Any) -> str:
        """What a request asked its model to read, as text (token ids detokenized)."""
        if req.prompt_tokens is not None and resident is not None:
            ids = req.prompt_tokens
            with contextlib.suppress(EverycycleError):
                return b"".join(await anyio.to_thread.run_sync(
                    resident.engine.pieces, ids)).decode("utf-8", "replace")
        if req.messages is not None:
            return "".join(m.text for m in req.messages)
        return (req.prompt or "") + (req.infill.middle if req.infill else "")
