"""The adaptive concurrency ceiling: how many requests each model's engines get at once.

Starting from the static budget (the replicas' ``max_num_seqs``), a periodic task compares
the engines' token throughput and time to first token over the last interval with the
interval before, AIMD-style:

- queueing inside the engine (its own waiting requests) or time to first token above
  ``TTFT_TOLERANCE`` × the best recently seen → multiplicative decrease (× 0.8);
- demand waiting in the gateway and throughput still rising (within 2 %) → additive
  increase (+1), up to twice the static budget;
- otherwise hold.

So a box settles where more concurrency stops buying throughput and only adds latency,
instead of at a guessed ``max_num_seqs``. Every decision is recorded for the console.
"""

from __future__ import annotations

from dataclasses import dataclass

DECREASE = 0.8
TTFT_TOLERANCE = 2.0
BASELINE_DRIFT = 1.05  # the best TTFT seen drifts up slowly, so the baseline can recover


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


def next_ceiling(state: ControllerState, sample: Sample, budget: int) -> tuple[ControllerState, str]:
    """The new state and why (``decrease``, ``increase`` or ``hold``)."""
    low, high = 1, max(1, 2 * budget)
    baseline = state.baseline_ttft
    if sample.ttft_seconds is not None:
        # The best TTFT seen, drifting up slowly so a permanently slower model is re-learnt.
        drifted = baseline * BASELINE_DRIFT if baseline is not None else sample.ttft_seconds
        baseline = min(drifted, sample.ttft_seconds)
    slow = (sample.ttft_seconds is not None and baseline is not None
            and sample.ttft_seconds > TTFT_TOLERANCE * baseline)
    ceiling, why = state.ceiling, "hold"
    if sample.engine_waiting > 0 or slow:
        ceiling, why = max(low, int(state.ceiling * DECREASE)), "decrease"
    elif sample.gateway_queued > 0 and sample.tokens_per_second >= 0.98 * state.last_tokens_per_second:
        ceiling, why = min(high, state.ceiling + 1), "increase"
    ceiling = min(max(ceiling, low), high)
    return ControllerState(ceiling, baseline, sample.tokens_per_second), why
