"""Where a grammar allows one continuation only, its tokens ride along as a draft
(llguidance's fast-forward tokens) and the model confirms them in the same step: fewer
steps, and the same tokens, greedy or sampled, as one-at-a-time decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from enginehelp import Collector, Flat

from everycycle.chatfmt import constraint
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.core.plan import NO_DRAFT, Draft
from everycycle.engine.core.slots import Run
from everycycle.engine.core.stepcost import Rows, StepCost
from everycycle.engine.spec.drafter import Drafter
from everycycle.engine.worker.runner import Runner

# Long keys, and values the model picks: most of the text is forced.
SCHEMA = {
    "type": "object",
    "properties": {
        "the_first_property_name": {"enum": ["alpha", "beta", "gamma"]},
        "a_second_rather_long_key": {"type": "integer", "minimum": 0, "maximum": 999},
        "and_the_third_one_here": {"type": "boolean"},
    },
    "required": ["the_first_property_name", "a_second_rather_long_key",
                 "and_the_third_one_here"],
    "additionalProperties": False,
}


class Forcing(Runner):
    """The real engine, its step costs flat (the probe's timings are noise here)."""

    def _probe(self) -> tuple[bool, StepCost]:
        exact, _ = super()._probe()
        flat = Flat()
        flat.observe(1, 0.0)
        return exact, flat


class Undrafting(Drafter):
    """Proposes no draft."""

    def propose(self, run: Run, room: int, rows: Rows, expected: float) -> Draft:
        return NO_DRAFT


class NoDrafts(Runner):
    """The real engine, drafting nothing: one token per step."""

    drafter_type = Undrafting


def _decode(kind: type[Runner], tiny_gguf: Path, temperature: float
            ) -> tuple[list[int], str, str, int, int]:
    """ids, text, finish reason, forced tokens drafted and confirmed."""
    c = Collector()
    runner = kind(tiny_gguf, context=512, parallel=1, notify=c)
    try:
        grammar = constraint.json_schema(SCHEMA)
        runner.check_grammar(grammar)
        job = Job(JobSpec(tokens=runner.tokenize("Describe it as JSON:"), max_tokens=200,
                          sampling=Sampling.of(temperature=temperature, seed=5,
                                               grammar=grammar)), tag="j")
        runner.submit(job)
        outs = c.wait("j", 120)
        forced = next(((c.drafted, c.accepted) for c in runner.draft_counts
                       if c.method == "forced"), (0, 0))
        return ([i for o in outs for i in o.ids], "".join(o.text for o in outs),
                str(outs[-1].reason), *forced)
    finally:
        runner.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_tokens_are_drafted_and_confirmed(tiny_gguf: Path, tiny_batches_exact: bool,
                                                 temperature: float) -> None:
    ids, text, reason, drafted, accepted = _decode(Forcing, tiny_gguf, temperature)
    value: Any = json.loads(text)
    assert set(value) == set(SCHEMA["properties"])  # type: ignore[arg-type]
    assert reason == "eos"
    # The three keys and the punctuation around them: most of the text.
    keys = sum(len(k) for k in SCHEMA["properties"])  # type: ignore[arg-type]
    assert accepted >= keys, (drafted, accepted, text)
    assert accepted >= 0.9 * drafted
    plain_ids, plain_text, plain_reason, none, _ = _decode(NoDrafts, tiny_gguf, temperature)
    assert none == 0
    json.loads(plain_text)
    if tiny_batches_exact:  # the engine's probe: a draft's rows are bit-exact here
        assert (ids, reason) == (plain_ids, plain_reason)
