"""The adaptive concurrency ceiling: how many requests each model's engines get at once.

Starting from the static budget (the replicas' ``max_num_seqs``, which is also its upper
bound: beyond it requests would only queue inside the engine), a periodic task compares
the engines' token throughput and time to first token over the last interval with the
interval before, and moves one step at a time:

- the engine queues requests itself, or its time to first token is above
  ``TTFT_TOLERANCE`` × the best recently seen → one fewer;
- demand is waiting in the gateway and the ceiling is below the budget → one more;
- a step that did not pay off is taken back: an increase that bought no throughput
  (< +2 %), or a decrease that cost throughput (> −5 %);
- otherwise hold.

So a box settles where more concurrency stops buying throughput and only adds latency —
often below a guessed ``max_num_seqs`` on a memory-bandwidth-bound box — and never starves
its engines by overshooting and over-correcting. Every decision is recorded for the console.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

TTFT_TOLERANCE = 2.0
BASELINE_DRIFT = 1.05  # the best TTFT seen drifts up slowly, so the baseline can recover
PAID_OFF = 1.02
COST_TOO_MUCH = 0.95


@dataclass(frozen=True, slots=True)
class Sample:
    """One interval of a model's engines, from their /metrics counters."""

    tokens_per_second: float
    ttft_seconds: float | None  # mean over the interval; None when nothing started
    engine_waiting: float
    gateway_queued: int


@dataclass(frozen=True, slots=True)
class ControllerState:
    ceiling: int
    baseline_ttft: float | None = None
    last_tokens_per_second: float = 0.0
    last_step: int = 0  # +1, -1 or 0: what the previous tick did


def next_ceiling(
    state: ControllerState, sample: Sample, budget: int
) -> tuple[ControllerState, str]:
    """The new state and why (``increase``, ``decrease``, ``revert`` or ``hold``)."""
    high = max(1, budget)
    baseline = state.baseline_ttft
    if sample.ttft_seconds is not None:
        # The best TTFT seen, drifting up slowly so a permanently slower model is re-learnt.
        drifted = baseline * BASELINE_DRIFT if baseline is not None else sample.ttft_seconds
        baseline = min(drifted, sample.ttft_seconds)
    slow = (
        sample.ttft_seconds is not None
        and baseline is not None
        and sample.ttft_seconds > TTFT_TOLERANCE * baseline
    )
    tps, last = sample.tokens_per_second, state.last_tokens_per_second
    step, why = 0, "hold"
    if state.last_step > 0 and tps < last * PAID_OFF and not slow:
        step, why = -1, "revert"
    elif state.last_step < 0 and tps < last * COST_TOO_MUCH and sample.engine_waiting == 0:
        step, why = +1, "revert"
    elif sample.engine_waiting > 0 or slow:
        step, why = -1, "decrease"
    elif sample.gateway_queued > 0 and state.ceiling < high:
        step, why = +1, "increase"
    ceiling = min(max(state.ceiling + step, 1), high)
    if ceiling == state.ceiling:
        why = "hold"
    # A revert is not a new probe: the next interval is judged afresh.
    step = 0 if why == "revert" else ceiling - state.ceiling
    return ControllerState(ceiling, baseline, tps, step), why


# --- Does the gateway's preemption free an engine slot? ------------------------------------
#
# The gateway preempts by closing the victim's connection (gateway/preempt.py). vLLM then
# aborts the request and its slot is free; an engine (or proxy) that finishes abandoned
# requests keeps computing it, so preempting only adds load. The engine's own count tells:
# shortly after a preemption, its running + waiting requests should be no more than the
# gateway's slot holders for the model. More (the excess) means the victims still run.
#
# False alarms, and why the rule takes them into account:
# - The two counts are read a moment apart (the scrape, then the gateway's count): a request
#   the engine reported that the gateway settled in between is a transient excess of one,
#   and so is an aborted request the engine has not dropped yet. The excess must show on
#   STRIKES judged scrapes in a row (each a scrape interval, 5 s, apart), long after any
#   abort has taken effect, and only scrapes at least GRACE after the preemption are judged.
# - An engine may carry work admitted elsewhere (another model name served by the same
#   engine, clients outside Tollgate on an external one). So the excess is measured above a
#   baseline: the least excess of the last two quiet scrapes (no preemption in the QUIET
#   before them). One scrape alone is not enough: a transient excess of one taken as the
#   baseline hides a victim that runs on, and the "frees" it then gives lets more follow.
# - Until a model's preemptions are judged, the gateway preempts on probation: one per
#   QUIET window (acquire.lua), so an engine that finishes what it aborts meets one victim
#   it did not count, not one per P0 arrival, before the verdict.
# A wrong "does not free" costs little: preemption pauses on the model for the verdict's
# TTL while the headroom still keeps slots for P0. A wrong "frees" costs the load we avoid,
# until the next preemption is judged.
PREEMPT_GRACE_SECONDS = 1.0
PREEMPT_QUIET_SECONDS = 30.0
PREEMPT_STRIKES = 2


@dataclass(frozen=True, slots=True)
class EngineCount:
    """One scrape of a model's engines beside the gateway's slot holders."""

    scraped_at: float  # epoch seconds; with several replicas, the oldest scrape
    engine: float  # running + waiting, summed over the replicas
    holders: int  # the gateway's slot holders for the model, read right after the scrape

    @property
    def excess(self) -> float:
        return self.engine - self.holders


@dataclass(frozen=True, slots=True)
class PreemptJudge:
    """What the controller keeps between ticks to judge a model's preemptions."""

    judged: float = 0.0  # scraped_at of the last count judged or taken as the baseline
    strikes: int = 0  # judged counts in a row that showed an excess
    baseline: float = 0.0  # the least excess of the last two quiet counts
    last_quiet: float = 0.0  # the excess on the last quiet count
    # When the preemption judged "frees none" happened: later counts of the same episode are
    # not judged (the victims ending on their own is not a slot freed by preempting).
    condemned: float = 0.0


def judge_preemption(
    judge: PreemptJudge, count: EngineCount | None, preempted_at: float | None
) -> tuple[PreemptJudge, bool | None]:
    """The new judge and the verdict this count gives: True (preemption frees a slot),
    False (it does not: the victims still run), or None (nothing to judge: no new scrape,
    one taken too soon after the last preemption, or none recently)."""
    if count is None or count.scraped_at <= judge.judged:
        return judge, None
    since = count.scraped_at - preempted_at if preempted_at is not None else None
    if since is None or since >= PREEMPT_QUIET_SECONDS:
        baseline = max(min(count.excess, judge.last_quiet), 0.0)
        return PreemptJudge(count.scraped_at, 0, baseline, last_quiet=count.excess), None
    if since < PREEMPT_GRACE_SECONDS:
        return judge, None  # a later scrape will be judged
    if preempted_at <= judge.condemned:
        return replace(judge, judged=count.scraped_at), None  # that verdict stands
    if count.excess > judge.baseline:
        strikes = judge.strikes + 1
        if strikes >= PREEMPT_STRIKES:
            return replace(judge, judged=count.scraped_at, strikes=0, condemned=preempted_at), False
        return replace(judge, judged=count.scraped_at, strikes=strikes), None
    return replace(judge, judged=count.scraped_at, strikes=0), True


def untracked_slots(judge: PreemptJudge, count: EngineCount | None, frees: bool | None) -> int:
    """Engine slots held by requests the gateway let go of but the engines still run: where
    preempting frees nothing, its victims (aborted before the verdict, or on probation) go
    on until they end. The excess above the baseline, once the verdict says so; the ceiling
    admission uses is lowered by it, or the slot the headroom keeps for P0 would be one the
    engine does not have, and P0 would wait inside the engine behind a P2 reply."""
    if frees is not False or count is None:
        return 0
    return max(0, math.floor(count.excess - judge.baseline))
