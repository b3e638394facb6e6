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

from dataclasses import dataclass

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
    state: ControllerState, sample: Sample, budget: int, preempting: bool = False
) -> tuple[ControllerState, str]:
    """The new state and why (``increase``, ``decrease``, ``revert`` or ``hold``).

    ``preempting``: the engines schedule by priority, so P0 goes past the ceiling and the
    requests it preempts wait inside the engine (and show a long TTFT): that queue is the
    engine's scheduler at work, not overload, so it never lowers the ceiling there.
    """
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
    elif (
        state.last_step < 0
        and tps < last * COST_TOO_MUCH
        and (sample.engine_waiting == 0 or preempting)
    ):
        step, why = +1, "revert"
    elif (sample.engine_waiting > 0 or slow) and not preempting:
        step, why = -1, "decrease"
    elif sample.gateway_queued > 0 and state.ceiling < high:
        step, why = +1, "increase"
    ceiling = min(max(state.ceiling + step, 1), high)
    if ceiling == state.ceiling:
        why = "hold"
    # A revert is not a new probe: the next interval is judged afresh.
    step = 0 if why == "revert" else ceiling - state.ceiling
    return ControllerState(ceiling, baseline, tps, step), why
