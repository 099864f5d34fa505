"""``everycycle models`` (list, add) and ``everycycle pull``: the registry and the hub."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import EverycycleError
from ..protocol import Format, sampling
from .common import ModelsOpt, app, exit_for, fail

models_app = typer.Typer(no_args_is_help=False)
WideOpt = Annotated[bool, typer.Option("--wide", help="Also where each comes from, and its "
                                                      "revision.")]
app.add_typer(models_app, name="models")


AllOpt = Annotated[bool, typer.Option(
    "--all", help="Also the GGUFs in other tools' stores (Ollama, LM Studio, llama.cpp's "
    "cache, the Hugging Face cache), by the name `run -m` takes.")]


@models_app.callback(invoke_without_command=True)
def models_cmd(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list of the models.")]
    = False,
    wide: WideOpt = False,
    every: AllOpt = False,
    models: ModelsOpt = None,
) -> None:
    """List the model registry (with --all, other tools' models too, read in place).

    \b
    Example:
      everycycle models --json
      everycycle models --all
      everycycle run -m ollama:llama3.2:3b "Hello"
    """
    if ctx.invoked_subcommand is not None:
        return
    list_models(as_json, models, wide, every)


@app.command("list")
def list_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list of the models.")]
    = False,
    wide: WideOpt = False,
    every: AllOpt = False,
    models: ModelsOpt = None,
) -> None:
    """List the model registry (as `models`; Ollama's name for it).

    \b
    Example:
      everycycle list
    """
    list_models(as_json, models, wide, every)


def _row(spec: Any, default: bool, store: str | None) -> dict[str, Any]:
    return {"name": spec.name, "default": default, "source": spec.source,
            "store": store, "revision": spec.revision, "available": _available(spec),
            "context": spec.context, "parallel": spec.parallel, "executor": spec.executor,
            "context_auto": spec.context is None,
            "kind": "completion" if spec.format is Format.RAW else "chat",
            "kv_cache_type": spec.kv_cache_type, **_needs(spec)}


def list_models(as_json: bool, models: Path | None, wide: bool = False,
                every: bool = False) -> None:
    from ..models.registry import load_registry

    try:
        reg = load_registry(models)
    except EverycycleError as exc:
        exit_for(exc)
    rows = [_row(spec, spec.name == reg.default, None) for spec in reg.models.values()]
    if every:
        rows += _store_rows(rows)
    if as_json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    from rich.console import Console

    from .. import paths
    from ..hardware import cpukernels
    from .render import models_view

    kernels = cpukernels.cached(paths.state_dir())  # (never probes: the daemon does)
    Console(stderr=not sys.stdout.isatty()).print(
        models_view(rows, note=kernels.note if kernels else None, wide=wide))


@models_app.command("add")
def models_add(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The name to record it by.")],
    url: Annotated[str, typer.Argument(
        metavar="SOURCE", help="hf://owner/repo[:QUANT][@revision], "
        "hf://owner/repo/file.gguf[@revision], or a model in another tool's store: "
        "ollama:MODEL[:TAG], lmstudio:PUBLISHER/REPO, llamacpp:NAME (see models --all)")],
    context: Annotated[int | None, typer.Option(
        "--context", help="Tokens per slot (default: the store's own, else chosen at "
        "load from what the model was trained for and the memory it has).")] = None,
    parallel: Annotated[int | None, typer.Option(
        "--parallel", help="Slots: requests decoded at once (default 4).")] = None,
) -> None:
    """Record a model in your models.toml, pinned by sha256: a hub GGUF (downloaded, its
    commit pinned), or one in another tool's store (read where it is, never copied).

    \b
    Example:
      everycycle models add qwen hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M
      everycycle models add llama ollama:llama3.2:3b
    """
    from ..models import manage, stores

    try:
        if stores.is_ref(url):
            where, entry = manage.add_store_model(name, url, context=context,
                                                  parallel=parallel)
            sys.stderr.write(f"everycycle: added '{name}' ({entry['path']}, sha256 "
                             f"{entry['sha256']}, read in place) to {where}\n")
            return
        where, got, digest = manage.add(name, url, context=context,
                                        parallel=parallel or 4,
                                        progress=sys.stderr.isatty())
    except EverycycleError as exc:
        exit_for(exc)
    sys.stderr.write(f"everycycle: added '{name}' ({manage.repo_path(got.path, got.commit)}, "
                     f"revision {got.commit}, sha256 {digest}) to {where}\n")


@app.command()
def pull(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", help="A registry name, hf://owner/repo[:QUANT][@rev] (QUANT: "
        "Q4_K_M by default) or hf://owner/repo/file.gguf[@rev]")],
    models: ModelsOpt = None,
) -> None:
    """Download a model into the Hugging Face cache; prints its local path (a split
    GGUF's first part).

    \b
    Example:
      everycycle pull hf://ggml-org/gemma-3-270m-it-GGUF:Q8_0
    """
    from ..models import manage
    from ..models.registry import load_registry

    web = re.fullmatch(r"https?://(?:www\.)?huggingface\.co/([^/]+/[^/]+)/(?:resolve|blob)/"
                       r"([^/]+)/(.+?)(?:\?.*)?", model)
    if web is not None:  # a browser's address for it: say what it means here
        fail(f"{model!r} is a web address; pull it as hf://{web[1]}/{web[3]}@{web[2]}", 2)
    try:
        path = manage.plan_pull(model, load_registry(models)).run(
            progress=sys.stderr.isatty())
    except EverycycleError as exc:
        exit_for(exc)
    sys.stdout.write(f"{path}\n")


def _store_rows(registry_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the models in other tools' stores (a hub download the registry already
    names is left out); a line on stderr for each one left out for a fault."""
    from ..models import stores

    found, left = stores.discover()
    for line in left:
        sys.stderr.write(f"everycycle: left out: {line}\n")
    named = {str(r["source"]) for r in registry_rows}
    rows = []
    for m in found:
        if m.ref not in named:  # (a hub download the registry names is listed once)
            rows.append(_row(stores.spec_of(m), False, m.store))
    return rows


def host_context(path: Path, spec: Any) -> int:
    """The context a slot of ``spec`` gets when the daemon chooses it on this machine's
    CPU (``memory.fit_context`` on its host memory): what ``models`` shows before a
    load."""
    import os

    from ..hardware.executors import host_available
    from ..hardware.memory import fit_context

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return fit_context(path, parallel=spec.parallel, kv_cache_type=spec.kv_cache_type,
                       free=host_available() or total, total=total)


def _loaded_context(name: str) -> int | None:
    """The context a running daemon loaded ``name`` with, if one has it loaded."""
    from ..client import SyncClient

    try:
        with SyncClient() as c:
            fleet = c.describe_fleet()
    except EverycycleError:
        return None
    return next((m.context for m in fleet.loaded_models if m.name == name and m.context),
                None)


def _needs(spec: Any) -> dict[str, int | str | None]:
    """What ``spec`` will need in memory (weights, KV cache), and how its chats are
    rendered (``jinja``, ``llama.cpp``, ``chatml``; ``none`` for a completion model)
    and why not by its own template where that is so, if its file is here."""
    from ..chatfmt.chat import renderer_of
    from ..hardware.gguf import read_metadata
    from ..hardware.memory import plan
    from ..models.registry import local_file

    unknown: dict[str, int | str | None] = {"weights_bytes": None, "kv_bytes": None,
                                            "chat_template": None,
                                            "chat_template_note": None}
    try:
        if spec.package is not None and spec.package_file is None:
            # Finding it would import the weights package: only a file verified before.
            from ..models.hub import verified_path

            found = verified_path(spec.sha256) if spec.sha256 else None
            if found is None:
                return unknown
        else:
            found = local_file(spec)
        context = spec.context or host_context(found, spec)
        needs = plan(found, context=context, parallel=spec.parallel,
                     kv_cache_type=spec.kv_cache_type)
        source = read_metadata(found).get("tokenizer.chat_template")
    except EverycycleError:
        return unknown
    renderer, note = (("none", None) if spec.format is Format.RAW
                      else renderer_of(source if isinstance(source, str) else None))
    return {"weights_bytes": needs.weights, "kv_bytes": needs.kv, "context": context,
            "chat_template": renderer,
            "chat_template_note": note}


def _available(spec: Any) -> bool:
    import importlib.util

    if spec.path is not None:
        return bool(spec.path.is_file())
    if spec.package is not None:
        if spec.package_file is not None:
            from ..models.registry import package_path

            found = package_path(spec)
            return found is not None and found.is_file()
        return importlib.util.find_spec(spec.package) is not None
    from ..models.hub import cached_file

    try:
        cached_file(spec.hub_ref, sha256=spec.sha256, name=spec.name)
    except EverycycleError:
        return False
    return True


@app.command()
def show(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", help="A registry name, or a model in another tool's store "
        "(ollama:llama3.2:3b).")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    models: ModelsOpt = None,
) -> None:
    """Show a model: its entry, its GGUF's metadata, chat template and sampling defaults
    (Ollama's `show`).

    \b
    Example:
      everycycle show smollm2-135m
    """
    from ..chatfmt.chat import renderer_of
    from ..hardware.gguf import read_metadata
    from ..models import stores
    from ..models.registry import load_registry, local_file

    notes: tuple[str, ...] = ()
    try:
        if stores.is_ref(model) and model not in load_registry(models).models:
            found = stores.find(model)
            spec, notes = stores.spec_of(found), found.notes
        else:
            spec = load_registry(models).get(model)
        path = local_file(spec)
        meta = read_metadata(path)
    except EverycycleError as exc:
        exit_for(exc)
    arch = str(meta.get("general.architecture", "?"))
    source = meta.get("tokenizer.chat_template")
    renderer, note = (("none", None) if spec.format is Format.RAW
                      else renderer_of(source if isinstance(source, str) else None))
    info: dict[str, Any] = {
        "name": spec.name, "source": spec.source, "revision": spec.revision,
        "file": str(path), "kind": "completion" if spec.format is Format.RAW else "chat",
        "architecture": arch, "model_name": meta.get("general.name"),
        "context_trained": meta.get(f"{arch}.context_length"),
        "context": _loaded_context(spec.name) or spec.context
        or f"auto ({host_context(path, spec)} on this machine's CPU)",
        "parallel": spec.parallel, "executor": spec.executor,
        "parameters": sampling.to_json(spec.sampling) or None,
        "lora": [f"{a.source} (scale {a.scale:g})" for a in spec.lora] or None,
        "chat_renderer": f"{renderer} ({note})" if note else renderer,
        "notes": list(notes) or None,
        "chat_template": source,
    }
    if as_json:
        sys.stdout.write(json.dumps(info) + "\n")
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "chat_template" or value is None:
            continue
        shown = (", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict)
                 else "; ".join(value) if isinstance(value, list) else str(value))
        sys.stdout.write(f"{key.replace('_', ' '):<{width}}  {shown}\n")
    template = info["chat_template"]
    sys.stdout.write("chat template:\n" + ("".join(f"  {ln}\n" for ln in
                                                   str(template).splitlines())
                                           if template else "  (none)\n"))


@app.command()
def rm(
    model: Annotated[str, typer.Argument(
        metavar="MODEL", help="A model you added (your models.toml).")],
    purge: Annotated[bool, typer.Option(
        "--purge", help="Also delete its downloaded files from the hub cache (unless "
        "another entry uses them).")] = False,
) -> None:
    """Remove a model from your models.toml (with --purge, its downloaded files too).

    \b
    Example:
      everycycle rm qwen --purge
    """
    from ..models import manage

    try:
        removed = manage.remove(model, purge=purge)
    except EverycycleError as exc:
        exit_for(exc)
    sys.stderr.write(f"everycycle: removed '{model}' from {removed.where}\n")
    if purge:
        sys.stderr.write(f"everycycle: kept its files: {', '.join(removed.shared)} uses them\n"
                         if removed.shared else f"everycycle: deleted {removed.files} file(s), "
                         f"{removed.freed / (1 << 20):.1f} MiB, from the hub cache\n")
