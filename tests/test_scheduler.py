"""The scheduler's decisions with plain data: slots, jobs and parked records built by
hand, no llama.cpp (as Ollama's sched_test.go tests placement with fakes). What the
real engine makes of them is tested in test_priority.py, test_preempt.py and
test_lookup.py; here, each rule alone, in milliseconds."""

from __future__ import annotations

from collections.abc import Sequence

from everycycle.engine.core.jobs import Job, JobSpec
from everycycle.engine.core.plan import NO_DRAFT, Draft, Park, Resume, Start, StepPlan, Work
from everycycle.engine.core.scheduler import BACKGROUND_CHUNK, STEP_BUDGET_S, Scheduler
from everycycle.engine.core.slots import Parked, Run, Slot
from everycycle.engine.core.stepcost import N_UBATCH, Costs, Rows, StepCost
from everycycle.engine.spec.drafter import Drafter
from everycycle.engine.spec.forced import ForcedTokens
from everycycle.engine.spec.lookup import History, PromptLookup
from everycycle.engine.spec.lookupdrafts import LookupDrafts

NOW = 1000.0


def job(tokens: Sequence[int] = (1, 2, 3), *, background: bool = False, max_tokens: int = 50,
        age: float = 600.0) -> Job:
    return Job(JobSpec(tokens=list(tokens), max_tokens=max_tokens,
                       background_age=age if background else None))


def running(seq: int, j: Job, *, cached: Sequence[int] = (), todo: Sequence[int] = (),
            generated: int = 0) -> Slot:
    """A slot with ``j`` on it, its cells holding ``cached``, ``todo`` left to read."""
    slot = Slot(seq, list(cached))
    slot.run = Run(j, n_past=len(cached), todo=list(todo), last=cached[-1] if cached else -1)
    j.n_generated = generated
    return slot


def parked_on(slot: Slot, *, since: float = NOW) -> Parked:
    """Park ``slot``'s job as the engine does, at ``since``."""
    run = slot.run
    assert run is not None
    p = Parked(run, slot, list(slot.cached), since=since)
    slot.run, slot.parked = None, p
    return p


class Fixed(Drafter):
    """Proposes ``tokens`` (cut to the room) to every run, at ``rate``."""

    def __init__(self, costs: Costs, tokens: Sequence[int] = (), rate: float = 0.9) -> None:
        super().__init__(costs, [])
        self.tokens, self.rate = list(tokens), rate
        self.asked: list[tuple[int, int]] = []

    def propose(self, run: Run, room: int, rows: Rows, expected: float) -> Draft:
        self.asked.append((room, rows.n))
        return Draft(self.tokens[:max(room, 0)], self.rate) if self.tokens else NO_DRAFT


def scheduler(*, parallel: int = 2, n_batch: int = 64, n_ctx_slot: int = 256,
              costs: Costs | None = None, draft: Sequence[int] = ()) -> Scheduler:
    costs = costs or Costs()
    return Scheduler(n_batch=n_batch, n_ctx_slot=n_ctx_slot, parallel=parallel, costs=costs,
                     drafter=Fixed(costs, draft))


# ---------------------------------------------------------------- admit: lanes, parking


def test_an_interactive_job_starts_before_a_background_job_queued_earlier() -> None:
    slots = [Slot(0)]
    bg, it = job(background=True), job()
    moves = scheduler().admit(slots, [bg, it], [], NOW).moves
    assert [type(m) for m in moves] == [Start] and moves[0].job is it  # type: ignore[union-attr]


def test_free_slots_take_pending_jobs_in_order_the_one_sharing_a_prefix_first() -> None:
    warm = Slot(1, [7, 8, 9, 10])  # a conversation the second job continues
    slots = [Slot(0), warm]
    a, b = job([1, 2]), job([7, 8, 9, 10, 11])
    moves = scheduler().admit(slots, [a, b], [], NOW).moves
    assert [(m.job, m.slot) for m in moves if isinstance(m, Start)] == [
        (a, slots[0]), (b, warm)] and len(moves) == 2


def test_with_no_free_slot_an_interactive_job_parks_a_background_one_and_takes_its_slot() -> None:
    busy = running(0, job(background=True), cached=[5, 6, 7])
    it = job([1, 2, 3])
    moves = scheduler(parallel=1).admit([busy], [it], [], NOW).moves
    assert len(moves) == 2 and isinstance(moves[0], Park) and moves[0].slot is busy
    assert isinstance(moves[1], Start) and (moves[1].job, moves[1].slot) == (it, busy)


def test_an_interactive_job_never_parks_another_interactive_one() -> None:
    busy = running(0, job(), cached=[5, 6, 7])
    assert scheduler(parallel=1).admit([busy], [job()], [], NOW).moves == []


def test_nothing_parks_for_background_work_and_nothing_starts_without_a_free_slot() -> None:
    busy = running(0, job(background=True), cached=[5, 6, 7])
    assert scheduler(parallel=1).admit([busy], [job(background=True)], [], NOW).moves == []


def test_the_victim_shares_the_most_cells_with_the_interactive_prompt() -> None:
    system = [50, 51, 52, 53]
    a = running(0, job(background=True), cached=[9, 9, 9, 9, 9, 9])
    b = running(1, job(background=True), cached=[*system, 60])
    moves = scheduler().admit([a, b], [job([*system, 70, 71])], [], NOW).moves
    assert isinstance(moves[0], Park) and moves[0].slot is b


def test_while_background_work_waits_the_victim_has_the_fewest_cells() -> None:
    small = running(0, job(background=True, max_tokens=500), cached=[1] * 10)
    big = running(1, job(background=True, max_tokens=20), cached=[2] * 100)
    waiting_bg = job(background=True)
    moves = scheduler().admit([small, big], [job([3, 4]), waiting_bg], [], NOW).moves
    assert isinstance(moves[0], Park) and moves[0].slot is small


def test_once_none_waits_the_victim_has_the_least_work_left() -> None:
    long = running(0, job(background=True, max_tokens=500), cached=[1] * 10)
    short = running(1, job(background=True, max_tokens=20), cached=[2] * 100, generated=5)
    moves = scheduler().admit([long, short], [job([3, 4])], [], NOW).moves
    assert isinstance(moves[0], Park) and moves[0].slot is short


def test_two_interactive_jobs_park_two_background_jobs_in_one_admission() -> None:
    slots = [running(i, job(background=True), cached=[i + 1] * 4) for i in range(2)]
    a, b = job([10]), job([11])
    moves = scheduler().admit(slots, [a, b], [], NOW).moves
    assert [type(m) for m in moves] == [Park, Start, Park, Start]
    assert {m.slot.seq for m in moves} == {0, 1}


def test_an_image_job_or_a_cancelled_one_is_not_parked() -> None:
    image = Job(JobSpec(tokens=[1], max_tokens=5, images=(b"x",), text="t",
                        background_age=600))
    cancelled = job(background=True)
    cancelled.cancel_reason = "client"
    slots = [running(0, image, cached=[1]), running(1, cancelled, cached=[2])]
    assert scheduler().admit(slots, [job()], [], NOW).moves == []


def test_a_parked_job_resumes_on_its_own_untouched_slot_before_pending_background_work() -> None:
    own = running(0, job(background=True), cached=[1, 2, 3])
    p = parked_on(own)
    other = Slot(1, [], used=0)
    later_bg = job(background=True)
    moves = scheduler().admit([own, other], [later_bg], [p], NOW).moves
    assert isinstance(moves[0], Resume) and (moves[0].parked, moves[0].slot) == (p, own)
    assert isinstance(moves[1], Start) and moves[1].job is later_bg and moves[1].slot is other


def test_elsewhere_a_parked_job_resumes_on_a_slot_holding_no_other_parked_cells() -> None:
    taken = running(0, job(), cached=[1, 2, 3])  # its own slot, taken by an interactive job
    p = parked_on(running(9, job(background=True), cached=[1, 2, 3]))
    p.slot = None  # (its cells were copied out when the slot was taken)
    holder = running(1, job(background=True), cached=[4, 4])
    held = parked_on(holder)  # (parked, its cells still in its slot)
    holder.used = 1
    clear = Slot(2, [5], used=5)  # (used later than holder, but free of parked cells)
    moves = scheduler(parallel=3).admit([taken, holder, clear], [], [p, held], NOW).moves
    assert [(m.parked, m.slot) for m in moves if isinstance(m, Resume)] == [
        (p, clear), (held, holder)] and len(moves) == 2


def test_a_job_parked_past_its_background_age_is_promoted_and_parks_another() -> None:
    p = parked_on(running(5, job(background=True, age=30.0), cached=[1, 2]), since=NOW - 31)
    busy = running(0, job(background=True), cached=[3, 4])
    decided = scheduler(parallel=1).admit([busy], [], [p], NOW)
    assert decided.promote == [p.job]
    assert [type(m) for m in decided.moves] == [Park, Resume]
    young = parked_on(running(6, job(background=True, age=30.0), cached=[1]), since=NOW - 5)
    assert scheduler(parallel=1).admit([busy], [], [young], NOW).promote == []


# ---------------------------------------------------------------- plan: the batch


def test_decode_rows_come_first_then_drafts_then_prompt_chunks() -> None:
    a = running(0, job(), cached=[1, 2, 3])
    b = running(1, job(), cached=[], todo=[7, 8, 9])
    a.run.drafting["lookup"] = object()  # type: ignore[union-attr]  # (it drafts)
    plan = scheduler(draft=[4, 5]).plan([a, b])
    wa, wb = plan.work
    assert (wa.slot, wa.tokens, wa.rows, wa.draft, wa.sample) == (a, [3, 4, 5], [0, 1, 2], 2, 0)
    assert (wb.slot, wb.tokens, wb.rows, wb.prompt, wb.sample) == (b, [7, 8, 9], [3, 4, 5], 3, 5)
    assert plan.n == 6 and plan.filling and not plan.background
    assert [wa.logits(i) for i in range(3)] == [True] * 3
    assert [wb.logits(i) for i in range(3)] == [False, False, True]


def test_a_prompt_longer_than_the_batch_reads_in_chunks_without_logits() -> None:
    s = running(0, job(), todo=list(range(100)))
    plan = scheduler(n_batch=32).plan([s])
    (w,) = plan.work
    assert len(w.tokens) == 32 and w.sample is None and not any(
        w.logits(i) for i in range(32))
    w.commit()
    assert s.run is not None and s.run.n_past == 32 and len(s.run.todo) == 68
    assert s.cached == list(range(32))


def test_prompts_arriving_together_are_read_in_one_step_as_long_as_it_stays_short() -> None:
    """Up to llama-server's batch (2,048) a step, micro-batch by micro-batch while the
    measured costs say such a step takes at most STEP_BUDGET_S; one micro-batch before
    any prompt step was timed (a big model on a slow CPU must not be read 2,048 at once)."""
    def plan(costs: Costs) -> list[int]:
        slots = [running(i, job(), todo=list(range(600))) for i in range(3)]
        return [w.prompt for w in scheduler(parallel=3, n_batch=2048, n_ctx_slot=4096,
                                            costs=costs).plan(slots).work]

    assert plan(Costs()) == [N_UBATCH]  # (nothing timed yet)
    fast = Costs()  # (SmolLM2-135M on 2 cores: 512 prompt tokens in 1.5 s)
    fast.fill = StepCost.fit([(512, 1.5)])
    assert plan(fast) == [600, 600, 600]  # (all three start together)
    slow = Costs()  # (an 8B model on the same CPU: 512 tokens in 6 s)
    slow.fill = StepCost.fit([(512, 6.0)])
    assert plan(slow) == [N_UBATCH] and 2 * 6.0 > STEP_BUDGET_S
    middling = Costs()
    middling.fill = StepCost.fit([(512, 4.0)])
    assert plan(middling) == [600, 2 * N_UBATCH - 600]


def test_while_an_interactive_prompt_is_read_background_jobs_sit_the_step_out() -> None:
    bg = running(0, job(background=True), cached=[1, 2])
    it = running(1, job(), todo=[5, 6])
    plan = scheduler().plan([bg, it])
    assert [w.slot for w in plan.work] == [it]
    it.run.todo = []  # type: ignore[union-attr]
    it.run.last = 6  # type: ignore[union-attr]
    assert [w.slot for w in scheduler().plan([bg, it]).work] == [bg, it]


def test_a_background_prompt_reads_only_what_keeps_the_step_short() -> None:
    costs = Costs()
    # A 2-core CPU's step costs: each row nearly a step of its own.
    costs.decode = StepCost.fit([(1, .0147), (2, .028), (4, .0427), (8, .0816), (16, .1546)])
    decoding = running(0, job(background=True), cached=[1])
    reading = running(1, job(background=True), todo=list(range(100)))
    plan = scheduler(parallel=2, costs=costs).plan([decoding, reading])
    assert plan.work[1].prompt == scheduler(costs=costs).background_room(1) < BACKGROUND_CHUNK
    assert plan.background  # (a step Preempt may stop)
    assert scheduler().background_room(1) == BACKGROUND_CHUNK  # (nothing measured)


def test_a_draft_fits_the_batch_the_context_and_the_tokens_left() -> None:
    s = running(0, job(max_tokens=10), cached=list(range(250)), generated=6)
    sched = scheduler(n_ctx_slot=256, draft=list(range(20)))
    s.run.drafting["forced"] = object()  # type: ignore[union-attr]  # (it may draft)
    (w,) = sched.plan([s]).work
    assert isinstance(sched.drafter, Fixed)
    assert sched.drafter.asked == [(3, 1)]  # min(64 - 1, 256 - 250 - 1, 10 - 6 - 1)
    assert w.draft == 3 and len(w.tokens) == 4


def test_a_slot_without_lookup_or_grammar_is_not_asked_for_a_draft() -> None:
    s = running(0, job(), cached=[1, 2])
    sched = scheduler(draft=[9])
    (w,) = sched.plan([s]).work
    assert w.draft == 0 and sched.drafter.asked == []  # type: ignore[attr-defined]


def test_a_plan_changes_no_slot_until_committed() -> None:
    s = running(0, job(), todo=[4, 5, 6])
    before = (list(s.cached), s.run.n_past, list(s.run.todo))  # type: ignore[union-attr]
    plan = scheduler().plan([s])
    assert (list(s.cached), s.run.n_past, list(s.run.todo)) == before  # type: ignore[union-attr]
    plan.work[0].commit()
    assert (s.cached, s.run.n_past, s.run.todo) == ([4, 5, 6], 3, [])  # type: ignore[union-attr]


def test_an_empty_plan_is_no_step() -> None:
    assert StepPlan().n == 0 and not StepPlan().background
    w = Work(Slot(0), Run(job()), 0, [1], [0], sample=0)
    assert w.decode and w.logits(0)


class NoCells:
    """llama.cpp's memory as far as a resume that reads its tokens again touches it."""

    removed: list[tuple[int, int, int]]

    def __init__(self) -> None:
        self.removed = []

    def llama_memory_seq_rm(self, mem: object, seq: int, start: int, end: int) -> bool:
        self.removed.append((seq, start, end))
        return True


def test_a_job_resumed_elsewhere_keys_the_slots_cells_by_its_lora_scales() -> None:
    from everycycle.engine.kvcache.promptcache import Spares
    from everycycle.engine.worker.parking import resume

    j = Job(JobSpec(tokens=[1, 2, 3], max_tokens=9, background_age=600, lora=(0.5,)))
    own = running(0, j, cached=[1, 2, 3, 4])
    p = parked_on(own)
    p.slot = own.parked = None  # (its cells were copied out, and the copy is gone)
    other = Slot(1, [7, 7])
    memory = NoCells()
    resume(memory, None, None, p, other, Spares())
    assert other.run is not None and other.run.todo == [1, 2, 3, 4, 4]  # (read again)
    assert memory.removed == [(1, -1, -1)] and other.lora == (0.5,)



class Forcing:
    """A grammar that forces as many tokens as it is asked for, and says how many."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def forced(self, room: int) -> list[int]:
        self.asked.append(room)
        return [7] * room


def test_only_the_slot_with_most_left_may_lengthen_a_step_of_several_unless_all_draft(
        ) -> None:
    """One slot's draft among several decoding slots is a micro-batch of its own
    (llama.cpp splits a step by sequence): only the slot the batch waits for (the most
    left to make) may add one; where every slot has a lookup draft to offer, any may."""
    costs = Costs()
    costs.decode = StepCost.fit([(n, 0.010) for n in (1, 2, 4, 8, 16, 32)] * 3)  # (a GPU)
    sched = Scheduler(n_batch=64, n_ctx_slot=256, parallel=2, costs=costs,
                      drafter=Drafter(costs, [ForcedTokens("forced"),
                                                LookupDrafts("lookup", History())]))
    short = running(0, job(max_tokens=10), cached=[1])
    long = running(1, job(max_tokens=50), cached=[1])
    grammars = {}
    for s in (short, long):
        assert s.run is not None
        s.run.grammar = grammars.setdefault(s.seq, Forcing())  # type: ignore[assignment]
        s.run.drafting["forced"] = s.run.grammar
    plan = sched.plan([short, long])
    assert grammars[0].asked == [] and grammars[1].asked == [49]  # (to its max_tokens)
    assert [w.draft for w in plan.work] == [0, 49]
    for s in (short, long):
        assert s.run is not None
        s.run.drafting["lookup"] = PromptLookup([1, 2, 3, 1, 2, 3])  # (both have a draft)
    plan = sched.plan([short, long])
    assert grammars[0].asked == [9] and plan.work[0].draft == 9
