"""The gateway's batched metric updates show exactly what per-request updates would."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway import metrics


def test_a_batch_of_observations_renders_like_observing_each_one() -> None:
    values = [random.choice(metrics.LATENCY_BUCKETS) for _ in range(200)]  # bucket edges included
    values += [random.uniform(0, 400) for _ in range(2000)] + [0.0, 1e9]
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    a = Histogram(
        "t_seconds", "t", ["m"], buckets=metrics.LATENCY_BUCKETS, registry=one_by_one
    ).labels("x")
    b = Histogram(
        "t_seconds", "t", ["m"], buckets=metrics.LATENCY_BUCKETS, registry=batched
    ).labels("x")
    for v in values:
        a.observe(v)
    metrics._observe_all(b, values[:1000])
    metrics._observe_all(b, values[1000:])

    def lines(registry: CollectorRegistry) -> dict[str, float]:
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#") and "_created" not in line
        }

    got, want = lines(batched), lines(one_by_one)
    assert got.keys() == want.keys()
    for name, value in want.items():  # bucket counts exactly; the sum up to float rounding
        assert abs(got[name] - value) <= 1e-9 * max(abs(value), 1), name


def sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_finished_requests_reach_the_metrics_at_the_next_flush() -> None:
    labels = {"tenant": "metrics-test", "model": "m1"}
    before = (
        sample("tollgate_requests_total", **labels, endpoint="chat", status="ok"),
        sample("tollgate_tokens_total", **labels, kind="completion"),
        sample("tollgate_request_duration_seconds_count", **labels),
        sample("tollgate_time_to_first_token_seconds_sum", **labels),
    )
    for i in range(5):
        metrics.request_done(
            "metrics-test", "m1", "chat", "ok", 0.02, 0.005 if i < 3 else None, 10, 7
        )
    metrics.request_done("metrics-test", "m1", "chat", "client_closed", 0.5, 0.01, 10, 2)
    metrics.in_flight["m1"] += 3
    metrics.flush()
    after = (
        sample("tollgate_requests_total", **labels, endpoint="chat", status="ok"),
        sample("tollgate_tokens_total", **labels, kind="completion"),
        sample("tollgate_request_duration_seconds_count", **labels),
        sample("tollgate_time_to_first_token_seconds_sum", **labels),
    )
    assert after[0] - before[0] == 5
    assert after[1] - before[1] == 5 * 7 + 2
    assert after[2] - before[2] == 6
    assert round(after[3] - before[3], 6) == round(3 * 0.005 + 0.01, 6)
    assert sample("tollgate_in_flight_requests", model="m1") == 3
    metrics.in_flight["m1"] -= 3
    metrics.flush()
    assert sample("tollgate_in_flight_requests", model="m1") == 0
