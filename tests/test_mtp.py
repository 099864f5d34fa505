"""A model's own MTP heads draft for it (engine/spec/mtp.py), on tiny random-weight
GGUFs with one MTP layer that llama.cpp really loads and runs (tests/mtpmodel.py):
output identical to the model without them where batches are exact, the drafts
counted per method through the engine, the fleet view and /metrics; a method that
fails is dropped and the engine serves on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from conftest import SpawnDaemon
from enginehelp import Collector, Flat
from httphelp import fleet_http
from modelshelp import Entry, models_toml
from mtpmodel import write_mtp_gguf

from everycycle.client import SyncClient
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.core.plan import Draft, StepPlan
from everycycle.engine.core.slots import Run, Slot
from everycycle.engine.core.stepcost import Costs, Rows, StepCost
from everycycle.engine.spec.drafter import Drafter
from everycycle.engine.spec.mtp import mtp_layers
from everycycle.engine.spec.proposer import DraftCount, Weighing
from everycycle.engine.worker.runner import Runner
from everycycle.errors import InternalError
from everycycle.protocol import Format, Tokens

PROMPT = "hello world the a hello"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mtp")
    return {"perfect": write_mtp_gguf(d / "perfect.gguf", perfect=True),
            "random": write_mtp_gguf(d / "random.gguf")}


class GpuPriced(Runner):
    """The real engine, its steps priced as a GPU's (a row costs nothing more) and its
    MTP steps at a tenth of one, whatever this machine measures (busy or not), so that
    drafts pay: the plumbing is under test here, the policy in test_draft_model.py."""

    def _probe(self) -> tuple[bool, StepCost]:
        exact, _ = super()._probe()
        flat = Flat(0.01)
        flat.observe(1, 0.0)
        if self.mtp is not None:
            self.mtp.cost = Flat(0.001)
            self.mtp.cost.observe(1, 0.0)
        return exact, flat


def _generate(path: Path, *, mtp: bool, kind: type[Runner] = GpuPriced
              ) -> tuple[list[list[int]], dict[str, DraftCount], bool]:
    """Two greedy answers at once (prompt lookup off); each method's counts; whether
    batches are exact here."""
    got = Collector()
    runner = kind(path, context=256, parallel=2, notify=got, n_threads=2, mtp=mtp)
    try:
        tokens = runner.tokenize(PROMPT, Format.RAW)
        for tag in ("a", "b"):
            runner.submit(Job(JobSpec(tokens=tokens, max_tokens=60, lookup=False,
                                      sampling=Sampling.of(temperature=0.0)), tag=tag))
        answers = [got.wait(tag, 120) for tag in ("a", "b")]
        assert all(a[-1].reason == "length" for a in answers)
        return ([[i for o in a for i in o.ids] for a in answers],
                {c.method: c for c in runner.draft_counts}, runner.lookup_exact)
    finally:
        runner.close()


def test_a_gguf_with_mtp_layers_is_found(models: dict[str, Path], tiny_gguf: Path) -> None:
    assert mtp_layers(models["random"]) == 1
    assert mtp_layers(tiny_gguf) == 0


def test_mtp_drafts_are_confirmed_where_the_heads_agree(models: dict[str, Path]) -> None:
    # The perfect model's MTP layer computes what its trunk does: every draft confirmed.
    with_heads, counts, exact = _generate(models["perfect"], mtp=True)
    alone, plain_counts, _ = _generate(models["perfect"], mtp=False)
    assert "mtp" not in plain_counts
    mtp = counts["mtp"]
    assert mtp.drafted >= 20 and mtp.accepted == mtp.drafted, mtp
    if exact:  # (the load-time probe: a row's logits are the same in any batch here)
        assert with_heads == alone


def test_random_heads_draft_and_change_no_output_where_batches_are_exact(
        models: dict[str, Path]) -> None:
    with_heads, counts, exact = _generate(models["random"], mtp=True)
    alone, _, _ = _generate(models["random"], mtp=False)
    assert counts["mtp"].drafted > 0  # (acceptance is the weights' business, not asserted)
    if exact:
        assert with_heads == alone
    assert all(len(ids) == 60 for ids in with_heads)


def test_mtp_heads_can_be_left_off(models: dict[str, Path]) -> None:
    got = Collector()
    runner = Runner(models["random"], context=128, parallel=1, notify=got, n_threads=2,
                    mtp=False)
    try:
        assert runner.mtp is None and "mtp" not in {c.method for c in runner.draft_counts}
    finally:
        runner.close()


@pytest.fixture
def url(spawn_daemon: SpawnDaemon, models: dict[str, Path], tmp_path: Path) -> Iterator[str]:
    spawn_daemon("--http", "127.0.0.1:0", models=models_toml(
        tmp_path / "models.toml", Entry("heads", models["perfect"], context=256, parallel=2),
        Entry("headless", models["perfect"], context=256, more={"mtp": False}),
        default="heads"))
    yield fleet_http()


def test_the_fleet_view_and_metrics_count_the_mtp_method(url: str) -> None:
    with SyncClient() as c:
        events = list(c.generate("heads", PROMPT, format=Format.RAW, max_tokens=30,
                                 temperature=0.0))
        assert sum(len(e.chunk.ids) for e in events if isinstance(e, Tokens)) == 30
        (model,) = c.describe_fleet().loaded_models
        list(c.generate("headless", PROMPT, format=Format.RAW, max_tokens=2))
        off = next(m for m in c.describe_fleet().loaded_models if m.name == "headless")
    assert "mtp" not in {d.method for d in off.drafts or ()}  # (``mtp = false``)
    assert {d.method for d in model.drafts or ()} >= {"forced", "lookup", "mtp"}
    drafted, accepted = model.drafted("mtp")
    assert accepted <= drafted  # (whether they pay on this CPU is the policy's call)
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert f'everycycle_drafted_tokens{{method="mtp",model="heads"}} {float(drafted)}' \
        in metrics


class Failing:
    """A method whose following of the target fails: llama.cpp refusing its batch."""

    def __init__(self, name: str) -> None:
        self.name, self.count, self.makes = name, DraftCount(name), True

    def start(self, run: Run) -> object:
        return object()

    def propose(self, state: object, weighing: Weighing, best: Draft) -> Draft:
        return best

    def offers(self, state: object, n_batch: int) -> bool:
        return False

    def joins(self, state: object) -> bool:
        return False

    def prepare(self, items: Sequence[tuple[Slot, object, Weighing]]) -> None:
        raise InternalError("the MTP layers failed to decode")

    def decoded(self, plan: StepPlan) -> None:
        raise InternalError("the MTP layers failed to decode")

    def took(self, state: object, token: int) -> None:
        pass

    def verified(self, state: object, drafted: int, accepted: int) -> None:
        pass

    def ended(self, state: object, cached: Sequence[int], n_prompt: int) -> None:
        pass


def test_a_method_that_fails_is_dropped_and_the_others_go_on(
        caplog: pytest.LogCaptureFixture) -> None:
    failing, kept = Failing("heads"), Failing("other")
    kept.decoded = lambda plan: None  # type: ignore[method-assign]
    kept.prepare = lambda items: None  # type: ignore[method-assign]
    drafter = Drafter(Costs(), [failing, kept], label="m")
    run = Run(Job(JobSpec(tokens=[1, 2], max_tokens=5)))
    drafter.start(run)
    assert set(run.drafting) == {"heads", "other"}
    drafter.decoded(StepPlan())
    assert drafter.proposers == [kept]
    drafter.prepare([(Slot(0, run=run), 4, Rows(((0, 1),), 0), 1.0)])
    assert drafter.proposers == [kept]
    assert "m: heads drafting stops: the MTP layers failed to decode" in caplog.text
    assert not drafter.joins(run) and drafter.propose(run, 4, Rows(((0, 1),), 0), 1.0).tokens == []
    assert [c.method for c in drafter.counts()] == ["heads", "other"]  # (its counts stay)
