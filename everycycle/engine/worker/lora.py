"""LoRA adapters on a loaded model (llama-server's ``--lora``): loaded once beside the
weights, applied per step with the scales of the jobs in it (``llama_set_adapters_lora``
on the context: an adapter set is the context's, not a sequence's, so a step holds only
jobs with the same scales; ``scheduler.py`` groups them). Changing the set between steps
makes llama.cpp reserve its graph again."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import InvalidRequestError
from ..core.slots import Scales, adapted
from ..llama.llamalog import log_capture


class Adapters:
    """A model's adapters, and the set its context applies now."""

    def __init__(self, L: Any, model: Any, paths: Sequence[Path], label: str) -> None:
        self._L = L
        self.paths = tuple(paths)
        self._handles: list[Any] = []
        for path in self.paths:
            if not path.is_file():
                raise InvalidRequestError(f"LoRA adapter {path}: no such file")
            with log_capture() as loading:
                handle = L.llama_adapter_lora_init(model, str(path).encode())
            if not handle:
                why = "; ".join(loading.errors[-2:]) or "not a LoRA adapter GGUF"
                raise InvalidRequestError(
                    f"LoRA adapter {path.name} cannot be applied to model '{label}': "
                    f"llama.cpp refused it ({why})")
            self._handles.append(handle)
        self.applied: Scales = ()
        """The scales the context applies now (empty: none set yet, the base model)."""
        self.switches = 0
        """Times the context's set changed (each reserves llama.cpp's graph again)."""

    def apply(self, ctx: Any, scales: Scales) -> None:
        """Make the context apply ``scales`` (the adapters with a non-zero one)."""
        if scales == self.applied or (not adapted(scales) and not adapted(self.applied)):
            return
        chosen = [(h, s) for h, s in zip(self._handles, scales, strict=False) if s != 0.0]
        handles = (self._L.llama_adapter_lora_p_ctypes * max(1, len(chosen)))(
            *(h for h, _ in chosen))
        values = (ctypes.c_float * max(1, len(chosen)))(*(s for _, s in chosen))
        rc = self._L.llama_set_adapters_lora(ctx, handles if chosen else None, len(chosen),
                                             values if chosen else None)
        if rc != 0:
            raise InvalidRequestError(f"llama.cpp could not apply LoRA scales {scales} ({rc})")
        self.applied = scales
        self.switches += 1
