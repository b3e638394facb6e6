"""Ingestion from the Redis stream into PostgreSQL: idempotent, priced, acked after commit."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import time_machine
from django.db.models import Sum

from core.keyspace import usage_stream
from core.redis import get_redis
from core.usage import FIELD
from metering import ingest
from metering.models import DeadLetter, UsageEvent, UsageRollup
from tests.metering.conftest import drain, emit, record


def pending() -> int:
    return get_redis().xpending(usage_stream(), ingest.GROUP)["pending"]


def test_the_same_event_delivered_three_times_is_stored_once(
    tenant_a, key_a, public_model, price
) -> None:
    event = record(tenant_a, public_model, key_a)
    emit(event, event, event)

    drain()

    assert UsageEvent.objects.filter(request_id=event.request_id).count() == 1
    rollup = UsageRollup.objects.get()
    assert (rollup.requests, rollup.prompt_tokens) == (1, 1000)
    assert pending() == 0


def test_redelivery_in_a_later_batch_is_ignored_and_rollups_do_not_double(
    tenant_a, key_a, public_model, price
) -> None:
    event = record(tenant_a, public_model, key_a)
    emit(event)
    drain()
    emit(event)
    drain()

    assert UsageEvent.objects.count() == 1
    assert UsageRollup.objects.get().requests == 1


def test_cost_is_exact_decimal_per_input_cached_and_output_tokens(
    tenant_a, key_a, public_model, price
) -> None:
    emit(
        record(
            tenant_a,
            public_model,
            key_a,
            prompt_tokens=1000,
            cached_tokens=200,
            completion_tokens=300,
        )
    )
    drain()

    event = UsageEvent.objects.get()
    # 800 x 0.20 + 200 x 0.10 + 300 x 0.60 per million
    assert event.cost == Decimal("0.000360000")
    assert (event.input_per_mtok, event.cached_input_per_mtok, event.output_per_mtok) == (
        Decimal("0.2"),
        Decimal("0.1"),
        Decimal("0.6"),
    )
    assert event.price == price and not event.unpriced


def test_cost_is_rounded_up_to_the_nano_unit(tenant_a, key_a, public_model) -> None:
    from metering import services

    services.set_price(None, public_model, Decimal("0.123456"), None, Decimal("0"))
    emit(
        record(tenant_a, public_model, key_a, prompt_tokens=1, cached_tokens=0, completion_tokens=0)
    )
    drain()
    # 1 x 0.123456 / 1M = 0.000000123456: never under-billed, so 0.000000124
    assert UsageEvent.objects.get().cost == Decimal("0.000000124")


def test_a_price_change_mid_period_prices_earlier_and_later_events_differently(
    tenant_a, key_a, public_model
) -> None:
    from metering import services

    start = datetime(2026, 11, 10, 9, 0, tzinfo=UTC)
    with time_machine.travel(start, tick=False):
        old = services.set_price(None, public_model, Decimal("1"), None, Decimal("2"))
    with time_machine.travel(start + timedelta(days=5), tick=False):
        new = services.set_price(None, public_model, Decimal("3"), None, Decimal("4"))
    before = record(
        tenant_a,
        public_model,
        key_a,
        at=start + timedelta(days=1),
        prompt_tokens=1_000_000,
        cached_tokens=0,
        completion_tokens=1_000_000,
    )
    after = record(
        tenant_a,
        public_model,
        key_a,
        at=start + timedelta(days=6),
        prompt_tokens=1_000_000,
        cached_tokens=0,
        completion_tokens=1_000_000,
    )
    emit(before, after)
    drain()

    assert UsageEvent.objects.get(request_id=before.request_id).cost == Decimal("3")
    assert UsageEvent.objects.get(request_id=before.request_id).price == old
    assert UsageEvent.objects.get(request_id=after.request_id).cost == Decimal("7")
    assert UsageEvent.objects.get(request_id=after.request_id).price == new
    assert UsageRollup.objects.aggregate(c=Sum("cost"))["c"] == Decimal("10")


def test_the_price_the_gateway_saw_is_kept_even_if_a_newer_one_applies(
    tenant_a, key_a, public_model, price
) -> None:
    from metering import services

    newer = services.set_price(None, public_model, Decimal("9"), None, Decimal("9"))
    emit(record(tenant_a, public_model, key_a, price_id=price.pk))
    drain()
    assert UsageEvent.objects.get().price == price != newer


def test_without_any_price_the_event_is_stored_unpriced_at_zero_cost(
    tenant_a, key_a, public_model
) -> None:
    emit(record(tenant_a, public_model, key_a))
    drain()
    event = UsageEvent.objects.get()
    assert event.unpriced and event.cost == 0 and event.currency == "USD"


def test_malformed_entries_go_to_dead_letters_and_do_not_block_the_stream(
    tenant_a, key_a, key_b, public_model, price
) -> None:
    client = get_redis()
    client.xadd(usage_stream(), {FIELD: b"{not json"})
    client.xadd(usage_stream(), {b"other": b"x"})
    emit(record(tenant_a, public_model, key_a, prompt_tokens=-5))
    emit(record(tenant_a, public_model, key_b))  # another tenant's key
    emit(record(tenant_a, public_model, key_a, tenant_id=999999))
    good = record(tenant_a, public_model, key_a)
    emit(good)

    drain()

    assert list(UsageEvent.objects.values_list("request_id", flat=True)) == [good.request_id]
    reasons = sorted(DeadLetter.objects.values_list("reason", flat=True))
    assert len(reasons) == 5
    assert any("undecodable" in r for r in reasons)
    assert any("not a key of tenant" in r for r in reasons)
    assert pending() == 0


def test_an_unknown_endpoint_or_status_is_a_dead_letter_naming_it(
    tenant_a, key_a, public_model, price
) -> None:
    emit(record(tenant_a, public_model, key_a, endpoint="teleport"))
    emit(record(tenant_a, public_model, key_a, status="vanished"))
    good = record(tenant_a, public_model, key_a, endpoint="responses")
    emit(good)

    drain()

    assert list(UsageEvent.objects.values_list("request_id", flat=True)) == [good.request_id]
    reasons = sorted(DeadLetter.objects.values_list("reason", flat=True))
    assert any("unknown endpoint 'teleport'" in r for r in reasons)
    assert any("unknown status 'vanished'" in r for r in reasons)


def test_entries_of_a_dead_consumer_are_claimed_by_another(
    tenant_a, key_a, public_model, price
) -> None:
    ingest.ensure_group()
    emit(*[record(tenant_a, public_model, key_a) for _ in range(3)])
    # A consumer reads them and dies before storing or acknowledging.
    get_redis().xreadgroup(ingest.GROUP, "dead-one", {usage_stream(): ">"}, count=10)
    assert pending() == 3

    ingest.ingest_once("survivor", claim_idle_ms=0, block_ms=0)

    assert UsageEvent.objects.count() == 3 and pending() == 0


def test_the_stream_is_trimmed_only_below_what_every_group_acknowledged(
    tenant_a, key_a, public_model, price
) -> None:
    client = get_redis()
    ingest.ensure_group()
    client.xgroup_create(usage_stream(), "audit", id="0")
    ids = emit(*[record(tenant_a, public_model, key_a) for _ in range(4)])
    client.xreadgroup("audit", "a1", {usage_stream(): ">"}, count=2)  # audit: 2 pending
    drain()  # metering: all 4 acked

    ingest.trim_stream()
    assert [e[0] for e in client.xrange(usage_stream())] == ids  # audit acked nothing

    client.xack(usage_stream(), "audit", ids[0])
    ingest.trim_stream()
    assert [e[0] for e in client.xrange(usage_stream())] == ids[1:]


def test_a_batch_committed_but_never_acked_is_redelivered_without_doubling(
    tenant_a, key_a, public_model, price
) -> None:
    ingest.ensure_group()
    emit(*[record(tenant_a, public_model, key_a) for _ in range(5)])
    entries = ingest.read_batch("crashes-before-xack", block_ms=0)
    ingest.store(entries)  # committed; the process dies before XACK

    ingest.ingest_once("survivor", claim_idle_ms=0, block_ms=0)

    assert UsageEvent.objects.count() == 5
    assert UsageRollup.objects.aggregate(n=Sum("requests"))["n"] == 5
    assert pending() == 0


def test_the_consumer_lets_small_batches_fill_and_drains_a_backlog_without_waiting(
    tenant_a, key_a, public_model, price, monkeypatch
) -> None:
    """After a batch smaller than its size the consumer waits (``linger``) for more to
    arrive, instead of paying a transaction for every few events; full batches follow each
    other at once. The clock is not real here: ``time.sleep`` records the waits."""
    ingest.ensure_group()
    emit(*(record(tenant_a, public_model, key_a) for _ in range(5)))
    waits: list[object] = []
    rounds = iter(range(3))
    monkeypatch.setattr(ingest.time, "sleep", waits.append)
    monkeypatch.setattr(ingest, "ensure_group", lambda *a: waits.append("group"))
    ingest.run_consumer("c1", count=2, block_ms=0, stop=lambda: next(rounds, None) is None)
    # Batches of 2, 2 (full: no wait) and 1 (short: linger), one group check in all.
    assert waits == ["group", ingest.LINGER_SECONDS]
    assert UsageEvent.objects.count() == 5
