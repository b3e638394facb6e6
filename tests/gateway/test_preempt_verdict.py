"""The rule that decides whether the gateway's preemption frees an engine slot on a model
(gateway/controller.py judge_preemption), on its own: counts in, verdicts out."""

from gateway.controller import (
    PREEMPT_GRACE_SECONDS,
    PREEMPT_QUIET_SECONDS,
    EngineCount,
    PreemptJudge,
    judge_preemption,
    untracked_slots,
)

T = 1_000_000.0  # when the gateway last preempted (epoch seconds)


def judged(counts: list[EngineCount], preempted_at: float | None = T) -> list[bool | None]:
    judge, out = PreemptJudge(), []
    for count in counts:
        judge, verdict = judge_preemption(judge, count, preempted_at)
        out.append(verdict)
    return out


def test_an_engine_that_drops_the_aborted_request_frees_a_slot() -> None:
    # After the preemption the engine runs exactly what holds the gateway's slots.
    assert judged([EngineCount(T + 2, 4, 4)]) == [True]


def test_victims_still_running_on_two_judged_scrapes_free_no_slot() -> None:
    # One scrape with an excess is not enough (the two counts are read a moment apart).
    assert judged([EngineCount(T + 2, 5, 4), EngineCount(T + 7, 5, 4)]) == [None, False]


def test_a_single_excess_followed_by_a_clean_scrape_frees() -> None:
    assert judged([EngineCount(T + 2, 5, 4), EngineCount(T + 7, 4, 4)]) == [None, True]
    # ... and the strikes start again from nothing.
    judge = PreemptJudge()
    for count in (EngineCount(T + 2, 5, 4), EngineCount(T + 7, 4, 4), EngineCount(T + 12, 5, 4)):
        judge, verdict = judge_preemption(judge, count, T)
    assert verdict is None and judge.strikes == 1


def test_scrapes_too_soon_after_the_preemption_are_not_judged() -> None:
    # Within the grace the engine may not have dropped the aborted request yet; the same
    # scrape is judged once only; fewer slot holders than engine requests is no excess.
    soon = T + PREEMPT_GRACE_SECONDS / 2
    assert judged([EngineCount(soon, 9, 1), EngineCount(soon, 9, 1)]) == [None, None]
    late = EngineCount(T + 2, 5, 4)
    assert judged([late, late]) == [None, None]
    assert judged([EngineCount(T + 2, 2, 4)]) == [True]


def test_nothing_is_judged_without_a_recent_preemption() -> None:
    assert judged([EngineCount(T + 2, 9, 1), EngineCount(T + 7, 9, 1)], None) == [None, None]
    quiet = T + PREEMPT_QUIET_SECONDS + 1
    assert judged([EngineCount(quiet, 9, 1), EngineCount(quiet + 5, 9, 1)]) == [None, None]
    assert judged([None]) == [None]


def test_work_the_gateway_did_not_admit_is_a_baseline_not_an_excess() -> None:
    """An engine that also serves another model, or clients outside Tollgate: the excess on
    quiet scrapes (no preemption in the 30 s before) is the baseline; only more counts."""
    later = T + 600
    judge = PreemptJudge()
    for at in (later - 45, later - 40):  # quiet, twice: 3 more than the gateway admitted
        judge, verdict = judge_preemption(judge, EngineCount(at, 7, 4), T)
        assert verdict is None
    assert judge.baseline == 3
    judge, verdict = judge_preemption(judge, EngineCount(later + 2, 7, 4), later)
    assert verdict is True  # the same 3: the victim was dropped
    for at, want in ((later + 7, None), (later + 12, False)):
        judge, verdict = judge_preemption(judge, EngineCount(at, 8, 4), later)
        assert verdict is want  # one more than the baseline, twice: the victim still runs


def test_the_victims_ending_on_their_own_do_not_overturn_frees_none() -> None:
    """An engine that finishes what the gateway aborted: once judged "frees none", the later
    scrapes of the same preemption (the victims done by then, no excess left) give no verdict,
    so preemption stays paused; a newer preemption is judged afresh."""
    judge, verdicts = PreemptJudge(), []
    for count in (EngineCount(T + 2, 5, 4), EngineCount(T + 7, 5, 4), EngineCount(T + 12, 4, 4)):
        judge, verdict = judge_preemption(judge, count, T)
        verdicts.append(verdict)
    assert verdicts == [None, False, None]
    judge, verdict = judge_preemption(judge, EngineCount(T + 17, 4, 4), T)
    assert verdict is None
    later = T + 20
    judge, verdict = judge_preemption(judge, EngineCount(later + 2, 4, 4), later)
    assert verdict is True


def test_a_transient_excess_on_one_quiet_scrape_does_not_hide_a_victim() -> None:
    """A request the engine still reported after the gateway settled it makes one quiet
    scrape show an excess of one. Taken as the baseline, it would hide the one victim an
    engine that finishes aborted requests keeps running, and "frees" would let more
    preemptions follow: the baseline is the least of the last two quiet scrapes."""
    later = T + 600
    judge = PreemptJudge()
    for at, engine in ((later - 45, 4), (later - 40, 5)):  # the second one transient
        judge, verdict = judge_preemption(judge, EngineCount(at, engine, 4), T)
    assert judge.baseline == 0
    verdicts = []
    for at in (later + 2, later + 7):
        judge, verdict = judge_preemption(judge, EngineCount(at, 5, 4), later)
        verdicts.append(verdict)
    assert verdicts == [None, False]


def test_victims_an_engine_runs_on_are_slots_admission_does_not_have() -> None:
    """Where preempting frees nothing, the requests the engine runs beyond the gateway's slot
    holders (and the baseline) lower the ceiling admission uses, so the slot the headroom
    keeps for P0 is one the engine really has; not before the verdict, nor where it frees."""
    judge = PreemptJudge(baseline=1.0)
    count = EngineCount(T + 7, 7, 4)  # 3 more than the gateway holds, 1 of them elsewhere's
    assert untracked_slots(judge, count, False) == 2
    assert untracked_slots(judge, count, True) == 0
    assert untracked_slots(judge, count, None) == 0
    assert untracked_slots(judge, None, False) == 0
    assert untracked_slots(judge, EngineCount(T + 7, 3, 4), False) == 0  # they have ended
