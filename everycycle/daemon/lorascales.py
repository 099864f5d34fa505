"""Each model's LoRA adapters' scales: models.toml's, until ``POST /lora-adapters`` sets
others (as llama-server's global scales), and a request's own for the adapters it names
(llama-server's per-request ``lora``)."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidRequestError
from ..models.registry import ModelSpec


class LoraScales:
    """The scales set per model name (event loop only)."""

    def __init__(self) -> None:
        self._set: dict[str, list[float]] = {}

    def of(self, spec: ModelSpec) -> list[float]:
        """``spec``'s adapters' scales now, in their order (models.toml's again once an
        edit of it changed the model's adapters)."""
        given = self._set.get(spec.name)
        if given is None or len(given) != len(spec.lora):
            return [a.scale for a in spec.lora]
        return list(given)

    def update(self, spec: ModelSpec, changes: Iterable[tuple[int, float]]) -> list[float]:
        """Set the scales of the adapters ``changes`` names (id, scale); the scales now.
        Raises InvalidRequestError for an id the model has no adapter at."""
        scales = self._with(spec, changes)
        self._set[spec.name] = scales
        return scales

    def for_request(self, spec: ModelSpec, asked: Iterable[tuple[int, float]] | None
                    ) -> tuple[float, ...]:
        """A request's scales: its own for the adapters it names, the model's for the
        rest. Raises InvalidRequestError as ``update``."""
        return tuple(self._with(spec, asked or ()))

    def _with(self, spec: ModelSpec, changes: Iterable[tuple[int, float]]) -> list[float]:
        scales = self.of(spec)
        for i, scale in changes:
            if not 0 <= i < len(scales):
                have = f"0 to {len(scales) - 1}" if scales else "none"
                raise InvalidRequestError(f"model '{spec.name}' has no LoRA adapter {i} "
                                          f"(its adapters: {have})")
            scales[i] = scale
        return scales
