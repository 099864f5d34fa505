"""The Ollama dialect's model routes, and what ``ollama.py`` shares with them.

    GET  /api/tags      the registry's models as NAME:latest, with size, digest, details
    GET  /api/ps        the loaded models, with size, size_vram (0 on the CPU), expires_at
    POST /api/show      a model's parameters, chat template, details and GGUF metadata
    POST /api/pull      a hub download (a registry name, hf://… or hf.co/…), NDJSON progress
    DELETE /api/delete  remove a model of the user's models.toml and its files (daemon token)
    GET  /api/version   everycycle's version · GET|HEAD / "Ollama is running" (for probes)

Facts about a model's file (its size, GGUF metadata) are read on a worker thread, never
on the event loop, and remembered while the file is unchanged. A pull runs its download
on a worker thread; a client that goes away stops it (what arrived stays in the cache,
resumed by the next pull). A pulled ``hf://`` file is not added to the registry
(``everycycle models add`` does that).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from ... import __version__
from ...chatfmt.infill import fim_texts
from ...errors import EverycycleError, UnavailableError, UnknownModelError
from ...models import hub, manage
from ...models.registry import ModelSpec, local_file
from ...protocol import Unload, sampling
from ..events import PullProgress
from ..keys import load_or_create_token
from ..residency import context as residency_context
from . import ollama_request as parse
from .common import HttpError, Reader, presented_key, request_id
from .exchange import STATUS, Dialect, Spawner, control, dumps

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
FOREVER = "2318-11-26T00:00:00Z"
"""``expires_at`` of a model that stays loaded (-1), the date Ollama gives."""
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
               15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
               20: "IQ2_XS", 25: "IQ4_NL", 28: "IQ4_XS", 32: "BF16", 38: "MXFP4"}
"""llama.cpp's ``general.file_type`` numbers, as Ollama names quantization levels."""


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """Ollama's error answer, ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def rfc3339(when: float | None = None) -> str:
    """``when`` (a Unix time; now by default) in RFC 3339, UTC, as Ollama writes times."""
    stamp = dt.datetime.fromtimestamp(time.time() if when is None else when, dt.UTC)
    return stamp.isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class _Facts:
    """What a model's file says: where it is, its size and time, its GGUF metadata."""

    path: Path | None = None
    size: int = 0
    mtime: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        arch = self.meta.get("general.architecture")
        ftype = self.meta.get("general.file_type")
        return {"parent_model": "", "format": "gguf", "family": arch or "",
                "families": [arch] if arch else None,
                "parameter_size": str(self.meta.get("general.size_label") or ""),
                "quantization_level": (_FILE_TYPES.get(ftype, str(ftype))
                                       if isinstance(ftype, int) else "")}


def present_file(spec: ModelSpec) -> Path | None:
    """``spec``'s GGUF if it is here (a weights package is never imported for it)."""
    if spec.package is not None and spec.package_file is None:
        return hub.verified_path(spec.sha256) if spec.sha256 else None
    with contextlib.suppress(EverycycleError):
        return local_file(spec)
    return None


class OllamaMeta(Dialect):
    """The model routes over ``api`` (the supervisor and its task group) and ``reader``."""

    def __init__(self, api: Spawner, reader: Reader) -> None:
        super().__init__(api, reader)
        self._facts: dict[tuple[str, int, int], _Facts] = {}
        self._fim_texts: dict[tuple[str, float], tuple[str, str, str] | None] = {}

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.root, methods=["GET", "HEAD"]),
            Route("/api/version", self.version, methods=["GET"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/pull", self.pull, methods=["POST"]),
            Route("/api/delete", self.delete, methods=["DELETE"]),
        ]

    async def root(self, request: HttpRequest) -> Response:
        """What Ollama's clients probe; a browser (it asks for HTML) gets the console."""
        if "text/html" in request.headers.get("accept", ""):
            return Response(status_code=307, headers={"location": "/console/"})
        return PlainTextResponse("Ollama is running")

    async def version(self, request: HttpRequest) -> Response:
        return JSONResponse({"version": __version__})

    # ------------------------------------------------------------------ what is there

    def _read(self, spec: ModelSpec | None) -> _Facts:
        """(On a worker thread.)"""
        path = present_file(spec) if spec is not None else None
        if path is None:  # (not here: the time of the registry file that names it)
            with contextlib.suppress(OSError):
                return _Facts(mtime=spec.origin.stat().st_mtime) if spec else _Facts()
            return _Facts()
        from ...hardware.gguf import read_metadata

        try:
            st = path.stat()
            key = (str(path), st.st_mtime_ns, st.st_size)
            if key not in self._facts:
                if len(self._facts) > 256:
                    self._facts.clear()  # (files replaced many times over)
                self._facts[key] = _Facts(path, st.st_size, st.st_mtime, read_metadata(path))
            return self._facts[key]
        except (OSError, EverycycleError):
            return _Facts()

    async def _read_all(self, specs: list[ModelSpec | None]) -> list[_Facts]:
        return await anyio.to_thread.run_sync(lambda: [self._read(s) for s in specs])

    async def tags(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        models = self.api.supervisor.registry.models
        names = self.reader.visible(principal)
        facts = await self._read_all([models[n] for n in names])
        return JSONResponse({"models": [
            {"name": parse.tagged(n), "model": parse.tagged(n), "modified_at": rfc3339(f.mtime),
             "size": f.size, "digest": models[n].sha256 or "", "details": f.details()}
            for n, f in zip(names, facts, strict=True)]})

    async def ps(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        sup = self.api.supervisor
        visible = set(self.reader.visible(principal))
        loaded = [m for m in sup.snapshot().loaded_models if m.name in visible]
        specs = [sup.registry.models.get(m.name) for m in loaded]
        facts = await self._read_all(specs)
        out = []
        for m, spec, f in zip(loaded, specs, facts, strict=True):
            size = (m.weights_bytes or 0) + (m.kv_bytes or 0)
            left = m.unload_in_ms if m.unload_in_ms is not None else m.keep_alive_ms
            expires = FOREVER if left is None or left < 0 else rfc3339(time.time() + left / 1000)
            out.append({"name": parse.tagged(m.name), "model": parse.tagged(m.name),
                        "size": size, "digest": (spec.sha256 or "") if spec else "",
                        "details": f.details(), "expires_at": expires,
                        "size_vram": 0 if m.assigned_executor == "cpu" else size,
                        "context_length": m.context or (spec.context if spec else None),
                        "executor": m.assigned_executor})
        return JSONResponse({"models": out})

    async def show(self, request: HttpRequest) -> Response:
        data = await self.reader.json(request)
        name = parse.model(self.reader, request, data.get("model") or data.get("name"))
        spec = self.api.supervisor.registry.models.get(name)
        (facts,) = await self._read_all([spec])
        if spec is None or facts.path is None:
            raise HttpError(404, f"model '{name}' not found or not downloaded "
                            "(POST /api/pull downloads it)", "model_not_found")
        template = facts.meta.get("tokenizer.chat_template")
        template = template if isinstance(template, str) else ""
        fim = await anyio.to_thread.run_sync(self._fim, facts.path, facts.mtime)
        if fim is not None:  # (as Ollama's FIM models' templates begin: clients such as
            # Continue send `suffix` only to a model whose template reads `.Suffix`)
            pre, suf, mid = fim
            template = (f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}"
                        f"{mid}{{{{- else }}}}{template}{{{{- end }}}}")
        context = residency_context.of(self.api.supervisor.residency, name)
        params = {**sampling.to_json(spec.sampling),
                  **({"num_ctx": context} if context is not None else {})}
        modelfile = (f"# everycycle: model '{name}' from {spec.source}\nFROM {facts.path}\n"
                     + "".join(f"PARAMETER {k} {v}\n" for k, v in params.items())
                     + (f'TEMPLATE """{template}"""\n' if template else ""))
        info = {k: v for k, v in facts.meta.items() if k != "tokenizer.chat_template"
                and not (isinstance(v, float) and not math.isfinite(v))}
        capabilities = ["completion", *(["tools"] if "tools" in template else []),
                        *(["insert"] if fim is not None else []),
                        *(["thinking"] if "think" in template else [])]
        return JSONResponse({
            "license": "", "modelfile": modelfile, "template": template,
            "parameters": "\n".join(f"{k} {v}" for k, v in params.items()),
            "details": facts.details(), "model_info": info, "capabilities": capabilities,
            "modified_at": rfc3339(facts.mtime)})

    def _fim(self, path: Path, mtime: float) -> tuple[str, str, str] | None:
        """The model's FIM tokens' texts, from its GGUF (None: it has none). (On a worker
        thread; each file read once.)"""
        key = (str(path), mtime)
        if key not in self._fim_texts:
            if len(self._fim_texts) > 256:
                self._fim_texts.clear()
            from ...hardware.gguf import read_metadata

            try:
                meta = read_metadata(path, ("tokenizer.ggml.tokens",))
            except EverycycleError:
                return None
            tokens = meta.get("tokenizer.ggml.tokens")
            self._fim_texts[key] = fim_texts(meta, tokens if isinstance(tokens, list) else [])
        return self._fim_texts[key]

    # ------------------------------------------------------------------ pull and delete

    def _plan(self, request: HttpRequest, given: str) -> manage.PullPlan:
        """What pulling ``given`` runs (the CLI's ``pull`` decides the same way). Raises
        HttpError (400 for a bad URL, 404 for a name this key cannot see)."""
        registry = self.api.supervisor.registry
        name = given if manage.is_hub_url(given) or given in registry.models else (
            given.removesuffix(parse.TAG))
        missing = HttpError(404, f"model '{given}' not found: pull a registry name "
                            f"({parse.LISTING}) or hf://owner/repo/file.gguf[@revision]",
                            "model_not_found")
        if not manage.is_hub_url(name) and name not in self.reader.visible(
                request.state.principal):
            raise missing
        try:
            return manage.plan_pull(name, registry)
        except UnknownModelError:
            raise missing from None
        except EverycycleError as exc:
            raise HttpError(400, exc.message, "invalid_model") from None

    async def pull(self, request: HttpRequest) -> Response:
        data = await self.reader.json(request)
        given = data.get("model") or data.get("name")
        stream = data.get("stream", True)
        if not isinstance(given, str) or not isinstance(stream, bool):
            raise HttpError(400, "`model` must be a name or hf:// URL, `stream` a boolean",
                            "invalid_type")
        plan = self._plan(request, given)
        send, receive = anyio.create_memory_object_stream[tuple[dict[str, Any], int]](math.inf)
        self.api.spawn(self._pull, plan, send, given)
        if stream:
            return StreamingResponse(self._lines(receive), media_type=NDJSON)
        last: tuple[dict[str, Any], int] = ({"error": "the pull ended early"}, 500)
        async with receive:
            async for item in receive:
                last = item
        return JSONResponse(last[0], status_code=last[1])

    @staticmethod
    async def _lines(receive: MemoryObjectReceiveStream[tuple[dict[str, Any], int]]
                     ) -> AsyncIterator[bytes]:
        async with receive:
            async for obj, _ in receive:
                yield dumps(obj) + b"\n"

    async def _pull(self, plan: manage.PullPlan,
                    send: MemoryObjectSendStream[tuple[dict[str, Any], int]], given: str
                    ) -> None:
        """The download of ``given``, on a worker thread, told to ``send`` as Ollama's
        progress lines (and on the daemon's bus). A client gone (``send`` broken) stops it
        at the next progress report."""
        label, digest = plan.label, plan.sha256
        base = {"status": f"pulling {label}", **({"digest": f"sha256:{digest}"} if digest
                                                  else {})}
        last = [0.0]
        stopped = [False]  # the daemon shuts down: the thread stops at its next report
        bus = self.api.supervisor.bus

        def report(done: int, total: int | None) -> None:  # (on the worker thread)
            if stopped[0]:
                raise anyio.BrokenResourceError
            moment = time.monotonic()
            if done != total and moment - last[0] < 0.1:
                return
            last[0] = moment
            line = {**base, "total": total or done, "completed": done}
            anyio.from_thread.run_sync(send.send_nowait, (line, 200))
            anyio.from_thread.run_sync(bus.publish, PullProgress(
                model=given, status="pulling", completed=done, total=total))

        with send:
            try:
                send.send_nowait(({"status": "pulling manifest"}, 200))
                path = await anyio.to_thread.run_sync(plan.run, report, abandon_on_cancel=True)
                size = path.stat().st_size
                send.send_nowait(({**base, "total": size, "completed": size}, 200))
                if digest:
                    send.send_nowait(({"status": "verifying sha256 digest"}, 200))
                send.send_nowait(({"status": "success"}, 200))
                bus.publish(PullProgress(model=given, status="done", completed=size,
                                         total=size))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                bus.publish(PullProgress(model=given, status="failed",
                                         message="stopped: the client went away"))
            except EverycycleError as exc:
                bus.publish(PullProgress(model=given, status="failed", message=exc.message))
                status = 502 if isinstance(exc, UnavailableError) else STATUS[exc.kind]
                with contextlib.suppress(anyio.BrokenResourceError):
                    send.send_nowait(({"error": exc.message}, status))
            except Exception as exc:  # a bug costs one pull, never the daemon
                log.exception("pull of %s failed", label)
                with contextlib.suppress(anyio.BrokenResourceError):
                    send.send_nowait(({"error": f"internal error: {type(exc).__name__}"}, 500))
            finally:
                stopped[0] = True

    async def _check_token(self, request: HttpRequest) -> None:
        """Only the daemon's own token (``everycycle daemon --show-token``) deletes."""
        secret = presented_key(request)
        token = self.reader.keys.default_token
        if token is None:
            token = await anyio.to_thread.run_sync(load_or_create_token)
        how = "send `Authorization: Bearer $(everycycle daemon --show-token)`"
        if not secret:
            raise HttpError(401, f"deleting a model needs the daemon's token: {how}",
                            "token_required")
        if not hmac.compare_digest(secret.encode(), token.encode()):
            raise HttpError(403, f"only the daemon's token deletes models: {how}",
                            "forbidden")

    async def delete(self, request: HttpRequest) -> Response:
        data = await self.reader.json(request)
        await self._check_token(request)
        given = data.get("model") or data.get("name")
        if not isinstance(given, str):
            raise HttpError(400, "`model` must name the model to delete", "invalid_model")
        sup = self.api.supervisor
        name = parse.model(self.reader, request, given)
        if name not in sup.registry.models:
            raise HttpError(404, f"model '{name}' not found", "model_not_found")
        if name in {m.name for m in sup.snapshot().loaded_models}:
            failed = await control(self.api, request.state.principal,
                                   Unload(request_id(request, "delete"), name))
            if failed is not None:
                return error_response(STATUS[failed.kind], failed.message)
        # As Ollama's: the model and its files (unless another model uses them).
        purge = sup.registry.models[name].hf_repo is not None
        try:
            await anyio.to_thread.run_sync(lambda: manage.remove(name, purge=purge))
        except UnknownModelError:
            raise HttpError(404, f"model '{name}' not found", "model_not_found") from None
        except EverycycleError as exc:
            raise HttpError(400, exc.message, "not_deletable") from None
        sup.forget(name)
        return JSONResponse({"status": "success"})
