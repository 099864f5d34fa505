"""``load MODEL --draft-model DRAFT``: a model loaded with a draft model its models.toml
entry does not name (or another than it names), its bounds kept."""

from __future__ import annotations

from dataclasses import replace

from ...models.drafting import DraftSpec
from ...models.registry import ModelSpec
from .resident import Residency


async def with_draft(res: Residency, spec: ModelSpec, model: str) -> ModelSpec:
    """``spec`` with ``model`` as its draft model; where it is loaded with another (or
    none), it is loaded again with this one."""
    draft = replace(spec.draft, model=model) if spec.draft is not None else DraftSpec(model)
    spec = replace(spec, draft=draft)
    loaded = res.models.get(spec.name)
    if loaded is not None and loaded.spec.draft != draft:
        await res.reload(replace(loaded.spec, draft=draft),
                         f"model '{spec.name}' loaded again with draft model '{model}'")
    return spec
