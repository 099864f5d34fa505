"""What llama-server adds to every dialect's answer, which its clients and its test suite
read there: ``system_fingerprint`` and ``timings`` (the prompt's read and the answer's
generation, as its ``server_slot_stats`` reports them)."""

from __future__ import annotations

from typing import Any

from ... import __version__
from ..outcome import Outcome
from .answer import Usage

FINGERPRINT = f"b{__version__}-everycycle"
"""``system_fingerprint`` (llama-server's is its build, ``b1234-…``, and its clients check
the ``b``)."""


def timings(usage: Usage, outcome: Outcome | None) -> dict[str, Any]:
    """llama-server's ``timings``: the prompt read (cached tokens apart) and the tokens
    generated, with their times and rates (the first token comes with the prompt, so a
    rate counts the steps after it)."""
    prompt_s = gen_s = 0.0
    if outcome is not None and outcome.ttft_s is not None:
        prompt_s = max(0.0, outcome.ttft_s - outcome.queue_wait_s)
        gen_s = max(0.0, outcome.duration_s - outcome.ttft_s)
    steps = max(0, usage.generated - 1)
    read = usage.prefilled
    out = {"cache_n": usage.cached, "prompt_n": read, "prompt_ms": prompt_s * 1e3,
           "prompt_per_token_ms": prompt_s * 1e3 / read if read else 0.0,
           "prompt_per_second": read / prompt_s if prompt_s else 0.0,
           "predicted_n": usage.generated, "predicted_ms": gen_s * 1e3,
           "predicted_per_token_ms": gen_s * 1e3 / steps if steps else 0.0,
           "predicted_per_second": steps / gen_s if gen_s else 0.0}
    if usage.drafted:
        out.update(draft_n=usage.drafted, draft_n_accepted=usage.draft_accepted)
    return out
