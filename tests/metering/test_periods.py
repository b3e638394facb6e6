"""Closing a period freezes it; late events become adjustments in the next open period."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.core.exceptions import ValidationError

from metering import export, rollups, services, tasks
from metering.models import ClosedPeriod, UsageAdjustment, UsageEvent, UsageRollup
from tests.metering.conftest import drain, emit, record

NOV = datetime(2026, 11, 1, tzinfo=UTC)
DEC = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture
def nov_price(public_model):
    with time_machine.travel(NOV - timedelta(days=3), tick=False):
        return services.set_price(None, public_model, Decimal("1"), None, Decimal("2"))


def csv_for(period: str, fmt: str = "showback") -> str:
    q = export.parse_query({"period": period, "granularity": "day", "format": fmt}, None)
    return "".join(export.csv_lines(q))


def test_a_period_cannot_close_before_it_ends(db) -> None:
    with time_machine.travel(datetime(2026, 11, 30, 23, tzinfo=UTC), tick=False):
        with pytest.raises(ValidationError):
            rollups.close_period(None, NOV)


def test_a_late_event_for_a_closed_period_becomes_an_adjustment_in_the_next(
    tenant_a, key_a, public_model, nov_price
) -> None:
    with time_machine.travel(DEC + timedelta(days=2), tick=False):
        emit(*[record(tenant_a, public_model, key_a, at=NOV + timedelta(days=d)) for d in (3, 9)])
        drain()
        closed = rollups.close_period(None, NOV)
        frozen_csv, frozen_focus = csv_for("2026-11"), csv_for("2026-11", "focus")
        assert closed.totals["USD"]["requests"] == 2

        late = record(tenant_a, public_model, key_a, at=NOV + timedelta(days=20, hours=5))
        emit(late)
        drain()

        assert csv_for("2026-11") == frozen_csv
        assert csv_for("2026-11", "focus") == frozen_focus
        adjustment = UsageAdjustment.objects.get()
        assert adjustment.hour == DEC + timedelta(days=2)
        assert adjustment.usage_hour == NOV + timedelta(days=20, hours=5)
        assert adjustment.requests == 1 and adjustment.cost == Decimal("0.001600000")
        dec_lines = csv_for("2026-12").splitlines()
        assert len(dec_lines) == 2 and ",adjustment,2026-11-21T00:00:00Z" in dec_lines[1]
        assert "Correction" in csv_for("2026-12", "focus")
        # The event itself keeps when it happened and the price then in force.
        event = UsageEvent.objects.get(request_id=late.request_id)
        assert event.price == nov_price and event.adjustment_hour is not None


def test_rebuilding_never_touches_a_closed_period(tenant_a, key_a, public_model, nov_price) -> None:
    with time_machine.travel(DEC + timedelta(days=2), tick=False):
        emit(*[record(tenant_a, public_model, key_a, at=NOV + timedelta(days=d)) for d in (3, 9)])
        emit(record(tenant_a, public_model, key_a, at=DEC + timedelta(hours=5)))
        drain()
        rollups.close_period(None, NOV)
        UsageEvent.objects.filter(occurred_at__lt=DEC).update(prompt_tokens=1)  # tampering
        before = list(UsageRollup.objects.filter(hour__lt=DEC).values())
        UsageRollup.objects.filter(hour__gte=DEC).update(requests=99)

        rollups.rebuild_rollups(NOV, DEC + timedelta(days=3))

        assert list(UsageRollup.objects.filter(hour__lt=DEC).values()) == before
        assert UsageRollup.objects.get(hour__gte=DEC).requests == 1


def test_periods_close_in_order_and_the_beat_job_closes_after_the_grace(
    tenant_a, key_a, public_model, nov_price
) -> None:
    with time_machine.travel(NOV + timedelta(days=5), tick=False):
        emit(record(tenant_a, public_model, key_a, at=NOV + timedelta(days=1)))
        drain()
    with time_machine.travel(DEC + timedelta(hours=71), tick=False):
        assert tasks.close_periods() == []  # within the 72 h grace
    with time_machine.travel(DEC + timedelta(hours=73), tick=False):
        assert tasks.close_periods() == ["2026-11"]
        assert tasks.close_periods() == []
    with time_machine.travel(datetime(2027, 2, 10, tzinfo=UTC), tick=False):
        with pytest.raises(ValidationError):
            rollups.close_period(None, datetime(2027, 1, 1, tzinfo=UTC))  # December first
        assert tasks.close_periods() == ["2026-12", "2027-01"]
    assert ClosedPeriod.objects.count() == 3
