"""Draft models (speculative decoding, llama-server's ``-md``): a small model with the
target's vocabulary drafts tokens the target verifies in its own step.

The pair here is made to agree as a matched pair does: the target is the tiny model with
60 more layers that write nothing to the residual stream (``inert_layers``), so it costs
many times the draft and computes the draft's logits; a second draft of other weights is
a pair that never agrees. Through the real daemon: greedy output with the draft equals
the target alone (where the load-time probe says batches are exact), sampled tokens
follow the target's distribution (a chi-square test over a fixed seed set), a bad draft
stops being drafted, a vocabulary llama.cpp's rule refuses is one sentence at load, and
usage, ``run -v``, ``fleet`` and ``/metrics`` report the drafts. The policy alone (no
llama.cpp): when a draft model's tokens pay, the rest after they stop paying."""

from __future__ import annotations

import math
import subprocess
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC
from enginehelp import Collector
from httphelp import fleet_http, openai_client
from modelshelp import Entry, models_toml
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.core.slots import Run, Slot
from everycycle.engine.core.stepcost import Costs, Rows, StepCost
from everycycle.engine.spec.drafter import Drafter
from everycycle.engine.spec.draftmodel import Ask, DraftLimits, DraftModel
from everycycle.engine.spec.lookup import Acceptance
from everycycle.engine.spec.paced import PROBE, REST_FIRST, Pace, PacedDrafts
from everycycle.engine.worker.runner import Runner
from everycycle.errors import ConfigError, InvalidRequestError
from everycycle.models.drafting import parse
from everycycle.protocol import Format, Tokens, Usage

PROMPT = "hello world the"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("drafts")
    return {"target": write_tiny_gguf(folder / "target.gguf", inert_layers=60),
            "draft": write_tiny_gguf(folder / "draft.gguf"),
            "stranger": write_tiny_gguf(folder / "stranger.gguf", seed=5),
            "wide": write_tiny_gguf(folder / "wide.gguf", extra_tokens=200)}


@pytest.fixture(scope="module")
def target_exact(pair: dict[str, Path]) -> bool:
    """The engine's own load-time verdict on the target: are multi-row batches bit-exact
    on this CPU (then a draft changes no token, greedy or seeded)."""
    runner = Runner(pair["target"], context=256, parallel=1, notify=Collector(), n_threads=2)
    try:
        return runner.lookup_exact
    finally:
        runner.close()


@pytest.fixture
def url(spawn_daemon: SpawnDaemon, pair: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    models = models_toml(
        tmp_path / "models.toml",
        Entry("alone", pair["target"], context=512, parallel=2),
        Entry("drafted", pair["target"], context=512, parallel=2,
              more={"draft_model": "small", "draft_max": 6}),
        Entry("mismatched", pair["target"], context=512, parallel=2,
              more={"draft_model": str(pair["stranger"]), "draft_max": 6}),
        Entry("small", pair["draft"], context=512),
        Entry("wide-drafted", pair["target"], context=512,
              more={"draft_model": "wide.gguf"}), default="alone")
    (tmp_path / "wide.gguf").symlink_to(pair["wide"])  # (a path relative to the file)
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    yield fleet_http()


def _generate(model: str, **options: Any) -> tuple[list[int], Usage]:
    with SyncClient() as c:
        events = list(c.generate(model, PROMPT, format=Format.RAW, usage=True, **options))
    ids = [i for e in events if isinstance(e, Tokens) for i in e.chunk.ids]
    return ids, next(e for e in events if isinstance(e, Usage))


def test_greedy_output_with_a_draft_model_is_the_target_alone(url: str,
                                                               target_exact: bool) -> None:
    alone, _ = _generate("alone", max_tokens=160, temperature=0)
    drafted, usage = _generate("drafted", max_tokens=160, temperature=0)
    # A draft as good as this one pays on any machine: the target is 30 times its size.
    assert usage.draft_n and usage.draft_n >= 40, usage
    assert (usage.draft_n_accepted or 0) >= 0.9 * usage.draft_n, usage
    if not target_exact:
        pytest.skip("batched logits are not bit-exact on this CPU (the load-time probe): "
                    "verified drafts may round a token otherwise")
    assert drafted == alone


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at ``z`` standard deviations (3.09: p =
    0.001), by Wilson and Hilferty's approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_sampled_tokens_with_a_draft_model_follow_the_target_distribution(url: str) -> None:
    """Over a fixed set of seeds, the tokens sampled with the draft and without it come
    from one distribution (a chi-square test of homogeneity, p > 0.001): the draft
    changes how many steps a token takes, never which token is drawn."""
    counts: dict[str, Counter[int]] = {"alone": Counter(), "drafted": Counter()}
    drafted = accepted = 0
    for seed in range(60):
        for model, counter in counts.items():
            ids, usage = _generate(model, max_tokens=12, temperature=1.0, seed=seed)
            counter.update(ids[1:])  # (the first token is no draft's)
            if model == "drafted":
                drafted += usage.draft_n or 0
                accepted += usage.draft_n_accepted or 0
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    a, b = counts["alone"], counts["drafted"]
    common = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
    rare = (sum(a.values()) - sum(a[t] for t in common), sum(b.values()) - sum(b[t] for t in common))
    cells = [(a[t], b[t]) for t in common] + ([rare] if sum(rare) else [])
    na, nb = sum(x for x, _ in cells), sum(y for _, y in cells)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for seen, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (seen - expected) ** 2 / expected
    assert len(cells) >= 5
    assert stat < _chi_square_critical(len(cells) - 1), (stat, cells)


def test_a_draft_model_that_never_agrees_stops_being_drafted(url: str) -> None:
    ids, usage = _generate("mismatched", max_tokens=300, temperature=0)
    assert len(ids) == 300
    assert (usage.draft_n_accepted or 0) <= 0.2 * (usage.draft_n or 0) + 2
    # It tries: a draft at the start, then short tries after rests that double.
    assert (usage.draft_n or 0) < 0.25 * len(ids), usage


def test_a_vocabulary_llama_cpp_refuses_is_one_sentence_at_load(url: str) -> None:
    shown = subprocess.run([*EC, "load", "wide-drafted"], capture_output=True, text=True,
                           timeout=120, check=False)
    assert shown.returncode != 0
    assert "draft model 'wide.gguf' cannot draft for model 'wide-drafted'" in shown.stderr
    assert "vocabularies hold" in shown.stderr and "Traceback" not in shown.stderr


def test_drafts_are_reported_by_usage_run_v_fleet_and_metrics(url: str) -> None:
    with openai_client(url) as client:
        answer = client.chat.completions.create(
            model="drafted", messages=[{"role": "user", "content": PROMPT}], max_tokens=80,
            temperature=0)
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    details = answer.usage.completion_tokens_details
    assert details.accepted_prediction_tokens and details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens is not None
    shown = subprocess.run([*EC, "run", "-v", "-m", "drafted", "-n", "60", "--temperature",
                            "0", PROMPT], capture_output=True, text=True, timeout=120,
                           check=False)
    assert shown.returncode == 0, shown.stderr
    assert "drafted " in shown.stderr and "accepted " in shown.stderr
    with SyncClient() as c:
        model = next(m for m in c.describe_fleet().loaded_models if m.name == "drafted")
    assert model.draft_model == "small"
    counted = {d.method: d for d in model.drafts or ()}
    assert counted["model"].drafted and counted["model"].accepted > 0
    fleet = subprocess.run([*EC, "fleet"], capture_output=True, text=True, timeout=60,
                           check=False)
    assert "draft models: drafted by small" in fleet.stdout + fleet.stderr
    assert "drafts: drafted model " in fleet.stdout + fleet.stderr
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert 'everycycle_draft_accepted_tokens{method="model",model="drafted"}' in metrics


def test_load_draft_model_loads_it_with_one_and_again_with_another(
        url: str, pair: dict[str, Path]) -> None:
    done = subprocess.run([*EC, "load", "alone", "--draft-model", "small"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "drafted by small" in done.stderr
    _, usage = _generate("alone", max_tokens=80, temperature=0)
    assert usage.draft_n, usage
    again = subprocess.run([*EC, "load", "alone", "--draft-model", str(pair["stranger"])],
                           capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr
    assert f"drafted by {pair['stranger'].name}" in again.stderr
    unknown = subprocess.run([*EC, "load", "alone", "--draft-model", "nope"],
                             capture_output=True, text=True, timeout=120, check=False)
    assert unknown.returncode != 0 and "its draft model 'nope'" in unknown.stderr
    assert "Traceback" not in unknown.stderr


# ---------------------------------------------------------------- the engine alone


def test_the_draft_model_loads_beside_the_target_and_its_drafts_are_verified(
        pair: dict[str, Path]) -> None:
    got = Collector()
    runner = Runner(pair["target"], context=256, parallel=1, notify=got, n_threads=2,
                    draft=pair["draft"], draft_label="small", draft_limits=DraftLimits(4))
    try:
        assert runner.draft_model is not None
        job = Job(JobSpec(tokens=runner.tokenize(PROMPT, Format.RAW), max_tokens=64,
                          sampling=Sampling.of(temperature=0.0), lookup=False), tag="j")
        runner.submit(job)
        got.wait("j")
        assert job.n_generated == 64 and job.n_drafted > 0
        assert job.n_draft_accepted >= 0.9 * job.n_drafted
        assert {c.method: c.drafted for c in runner.draft_counts}["model"] == job.n_drafted
    finally:
        runner.close()


def test_p_min_one_stops_every_draft_and_a_short_draft_under_n_min_is_dropped(
        pair: dict[str, Path]) -> None:
    for limits in (DraftLimits(4, 0, 1.0), DraftLimits(4, 5, 0.0)):
        got = Collector()
        runner = Runner(pair["target"], context=256, parallel=1, notify=got, n_threads=2,
                        draft=pair["draft"], draft_limits=limits)
        try:
            job = Job(JobSpec(tokens=runner.tokenize(PROMPT, Format.RAW), max_tokens=32,
                              sampling=Sampling.of(temperature=0.0), lookup=False),
                      tag="j")
            runner.submit(job)
            got.wait("j")
            assert job.n_generated == 32 and job.n_drafted == 0, limits
        finally:
            runner.close()


def test_a_long_prompt_is_read_by_the_draft_model_over_several_steps(
        pair: dict[str, Path]) -> None:
    runner = Runner(pair["target"], context=256, parallel=1, notify=Collector(), n_threads=2,
                    draft=pair["draft"], draft_limits=DraftLimits(4))
    try:
        draft = runner.draft_model
        assert draft is not None
        tokens = runner.tokenize("hello world the a " * 8, Format.RAW)
        # (the engine thread is idle: no job, so the draft model is the test's here)
        steps = []
        while not (got := draft.draft([Ask(0, tokens, 4)], budget=16)[0]):
            steps.append(len(got))
            assert len(steps) < 10
        assert len(steps) == (len(tokens) - 1) // 16 and len(got) == 4
        again = draft.draft([Ask(0, [*tokens, *got[:2]], 4)], budget=16)[0]
        assert again[:2] == got[2:4]  # (the same draft model, further on: the same tokens)
    finally:
        runner.close()


def test_a_vocabulary_of_other_size_is_refused_naming_both_models(
        pair: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match=r"draft model 'wide' cannot draft for "
                       r"model 'target.gguf': their vocabularies hold [\d,]+ and [\d,]+"):
        Runner(pair["target"], context=256, parallel=1, notify=Collector(), n_threads=2,
               draft=pair["wide"], draft_label="wide")


# ---------------------------------------------------------------- the policy alone


class Priced(DraftModel):
    """A draft model with its costs and limits only (no weights): the policy's input. Its
    drafts are ``n`` sevens; it keeps what it was asked for."""

    def __init__(self, seconds: float, n_max: int = 4) -> None:
        self.limits = DraftLimits(n_max)
        self.cost = StepCost.fit([(1, seconds)] * 3 + [(2, seconds * 1.2)] * 3)
        self.asked: list[int] = []

    def draft(self, asks: Sequence[Ask], budget: int) -> list[list[int]]:
        self.asked.extend(a.n for a in asks)
        return [[7] * a.n for a in asks]


ALONE = Rows(((0, 1),), 0)
"""One slot decoding, its own row so far."""


def _slot(rate: float) -> Slot:
    """A slot whose run drafts with the draft model, confirming ``rate`` of its tokens."""
    run = Run(Job(JobSpec(tokens=[1, 2, 3], max_tokens=100)), n_past=3, last=9)
    run.drafting["model"] = Pace(Acceptance(rate * 10, 10.0))
    return Slot(0, cached=[1, 2, 3], run=run)


def _drafter(costs: Costs, model: DraftModel) -> Drafter:
    """A drafter with the draft model alone."""
    return Drafter(costs, [PacedDrafts("model", costs, model)])


def _costs(step: float, per_row: float) -> Costs:
    costs = Costs()
    costs.decode = StepCost.fit([(n, step + per_row * n) for n in (1, 2, 4, 8, 16)] * 3)
    return costs


def _asked(drafter: Drafter, slot: Slot) -> int:
    """Tokens the draft model was asked for the slot's next step (0: none), and made."""
    model = drafter.proposers[0].model  # type: ignore[attr-defined]
    before = len(model.asked)
    drafter.prepare([(slot, 50, ALONE, 1.0)])
    return int(model.asked[before]) if len(model.asked) > before else 0


def _took(drafter: Drafter, slot: Slot) -> None:
    """The run took a token: what was made for it is stale."""
    assert slot.run is not None
    drafter.took(slot.run, 9)


def test_a_cheap_draft_that_agrees_is_asked_for_and_a_dear_one_is_not() -> None:
    # A target step of 20 ms whose rows are nearly free (a GPU), a 1 ms draft step:
    drafter = _drafter(_costs(0.020, 0.0005), Priced(0.001))
    slot = _slot(0.8)
    assert slot.run is not None
    assert _asked(drafter, slot) == 4
    # The next plan takes what was made, as it pays in the step's rows then.
    draft = drafter.propose(slot.run, room=50, rows=ALONE, expected=1.0)
    assert draft.source == "model" and draft.tokens == [7, 7, 7, 7]
    assert drafter.propose(slot.run, room=2, rows=ALONE, expected=1.0).tokens == [7, 7]
    _took(drafter, slot)
    assert drafter.propose(slot.run, room=50, rows=ALONE, expected=1.0).tokens == []
    # Each draft token as dear as the target's own step: no length pays.
    dear = _drafter(_costs(0.020, 0.0005), Priced(0.020))
    assert _asked(dear, _slot(0.8)) == 0
    # A CPU where each row costs what a step does: drafting loses.
    cpu = _drafter(_costs(0.001, 0.010), Priced(0.001))
    assert _asked(cpu, _slot(0.8)) == 0


def test_a_slot_whose_drafts_fail_rests_then_tries_a_short_one_then_rests_longer() -> None:
    drafter = _drafter(_costs(0.020, 0.0005), Priced(0.001))
    slot = _slot(0.02)
    assert slot.run is not None
    assert _asked(drafter, slot) == PROBE  # a new request tries at once
    # The try is taken as made, though the rate it is to test says it does not pay.
    assert drafter.propose(slot.run, 50, ALONE, 1.0).tokens == [7] * PROBE
    drafter.verified(slot.run, PROBE, 0, "model")
    _took(drafter, slot)
    assert _asked(drafter, slot) == 0
    assert slot.run.drafting["model"].rest == REST_FIRST
    for _ in range(REST_FIRST):
        assert _asked(drafter, slot) == 0
    assert _asked(drafter, slot) == PROBE  # a short try once rested
    drafter.verified(slot.run, PROBE, 0, "model")
    _took(drafter, slot)
    assert _asked(drafter, slot) == 0
    assert slot.run.drafting["model"].rest == 2 * REST_FIRST  # it failed: the next rest is longer
    # Where not even a draft always confirmed pays, it rests without trying.
    cpu = _drafter(_costs(0.001, 0.010), Priced(0.001))
    idle = _slot(0.5)
    assert idle.run is not None
    assert [_asked(cpu, idle) for _ in range(40)] == [0] * 40
    assert idle.run.drafting["model"].backoff > REST_FIRST


def test_a_draft_made_for_the_next_step_waits_out_a_stopped_one() -> None:
    """A step stopped and undone (preempted) takes nothing: the draft made for it is
    still the run's, and the plan after takes it."""
    drafter = _drafter(_costs(0.020, 0.0005), Priced(0.001))
    slot = _slot(0.8)
    assert slot.run is not None and _asked(drafter, slot) == 4
    first = drafter.propose(slot.run, room=50, rows=ALONE, expected=1.0)
    again = drafter.propose(slot.run, room=50, rows=ALONE, expected=1.0)  # (undone: no took)
    assert first.tokens == again.tokens == [7, 7, 7, 7]
    assert _asked(drafter, slot) == 0  # (made already: nothing asked again)


def test_draft_keys_are_checked_in_models_toml(tmp_path: Path) -> None:
    origin = tmp_path / "models.toml"
    spec = parse({"draft_model": "d.gguf", "draft_max": 8}, "models.m", origin)
    assert spec is not None and spec.model == str(tmp_path / "d.gguf") and spec.max == 8
    assert parse({"draft_model": "small"}, "models.m", origin) == parse(
        {"draft_model": "small", "draft_max": 3, "draft_min": 0, "draft_p_min": 0.0},
        "models.m", origin)
    for bad, said in (({"draft_max": 4}, "draft_max needs draft_model"),
                      ({"draft_model": "s", "draft_max": 0}, "draft_max must be 1 to 64"),
                      ({"draft_model": "s", "draft_min": 5, "draft_max": 4},
                       "draft_min (5) is more than draft_max (4)"),
                      ({"draft_model": "s", "draft_p_min": 2}, "draft_p_min must be a probability"),
                      ({"draft_model": "hf://x"}, "draft_model:")):
        with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
            parse(bad, "models.m", origin)
