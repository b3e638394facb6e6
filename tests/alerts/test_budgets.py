"""Budget alerts: a tenant crossing 50, 80 and 100 % of its money quota gets exactly one
signed webhook each (checked by the receiver with the documented recipe; a replay refused
by its timestamp); thresholds crossed at once fire in order; key budgets warn; a quota
raised mid-period does not fire a threshold twice."""

import json
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import pytest
import time_machine
from django.db import connection

from alerts import services as alert_services
from alerts.choices import DeliveryStatus, Event, Severity
from alerts.models import Notice, WebhookDelivery
from metering import budgets
from tenants import services as tenant_services
from tests.alerts.usage import spend

NOW = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
def quota_tenant(tenant_a):
    """Tenant A with a money quota of 100 USD a month and the default thresholds."""
    return tenant_services.update_tenant(None, tenant_a, quota_amount=Decimal("100"))


def check_twice_at_once() -> None:
    """Two budget checks at the same moment, as two beat runs overlapping would."""
    errors = []

    def run() -> None:
        try:
            budgets.check_budgets()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors


@pytest.mark.django_db(transaction=True)
def test_a_tenant_crossing_50_80_100_percent_gets_exactly_one_webhook_each(
    quota_tenant, alice, public_model, price, receiver
) -> None:
    made = alert_services.create_endpoint(
        alice, quota_tenant, receiver.url, [Event.BUDGET_THRESHOLD]
    )
    receiver.secret = made.secret  # the receiver checks every request with the recipe
    tenant = quota_tenant
    with time_machine.travel(NOW, tick=False) as clock:
        expected = 0
        for step_usd, threshold in ((30, None), (20, 50), (30, 80), (20, 100), (5, None)):
            clock.shift(600)
            spend(tenant, public_model, price, datetime.now(UTC), usd=step_usd)
            for _ in range(3):
                budgets.check_budgets()
            check_twice_at_once()
            if threshold is not None:
                expected += 1
                got = receiver.wait_for(expected)
                body = json.loads(got[-1].body)
                assert got[-1].answered == 200 and not got[-1].refused
                assert body["data"]["threshold"] == threshold
            assert len(receiver.deliveries) == expected
        # Exactly one each, in order, all verified by the receiver.
        bodies = [json.loads(d.body) for d in receiver.deliveries]
        assert [b["data"]["threshold"] for b in bodies] == [50, 80, 100]
        assert all(d.answered == 200 and not d.refused for d in receiver.deliveries)
        assert [b["severity"] for b in bodies] == ["warning", "warning", "critical"]
        fifty = bodies[0]["data"]
        assert fifty["subject"] == "tenant" and fifty["key"] is None
        assert fifty["quota"] == "money" and fifty["unit"] == "USD"
        assert Decimal(fifty["used"]) == 50 and Decimal(fifty["limit"]) == 100
        assert fifty["period"]["id"] == "2026-11"
        assert fifty["period"]["end"] == "2026-12-01T00:00:00+00:00"
        assert fifty["forecast"]["state"] == "runs_out"
        assert WebhookDelivery.objects.filter(status=DeliveryStatus.SUCCEEDED).count() == 3
        # The tenant's admins got a notice per threshold.
        titles = list(Notice.objects.order_by("created_at").values_list("title", flat=True))
        assert titles == [f"Acme Research used {t} % of its money quota" for t in (50, 80, 100)]

        # A captured delivery replayed later: refused by its timestamp.
        captured = receiver.deliveries[0]
        clock.shift(301)
        replay = httpx.post(receiver.url, content=captured.body, headers=captured.headers)
    assert replay.status_code == 400
    assert "timestamp outside the tolerance" in replay.text
    assert receiver.deliveries[-1].refused.startswith("timestamp outside the tolerance")


@pytest.mark.django_db(transaction=True)
def test_thresholds_crossed_at_once_fire_each_once_in_order(
    quota_tenant, public_model, price, receiver
) -> None:
    alert_services.create_endpoint(None, quota_tenant, receiver.url, [Event.BUDGET_THRESHOLD])
    with time_machine.travel(NOW, tick=False):
        spend(quota_tenant, public_model, price, NOW - timedelta(hours=1), usd=40)
        assert budgets.check_budgets() == 0
        spend(quota_tenant, public_model, price, NOW - timedelta(minutes=1), usd=60)  # a big job
        assert budgets.check_budgets() == 3
        assert budgets.check_budgets() == 0
    got = receiver.wait_for(3)
    assert [json.loads(d.body)["data"]["threshold"] for d in got] == [50, 80, 100]


def test_a_quota_raised_mid_period_does_not_fire_a_threshold_again(
    quota_tenant, public_model, price, django_capture_on_commit_callbacks
) -> None:
    with time_machine.travel(NOW, tick=False):
        spend(quota_tenant, public_model, price, NOW - timedelta(hours=1), usd=55)
        assert budgets.check_budgets() == 1  # 50 %
        tenant_services.update_tenant(None, quota_tenant, quota_amount=Decimal("200"))
        assert budgets.check_budgets() == 0  # 27.5 %
        spend(quota_tenant, public_model, price, NOW - timedelta(minutes=5), usd=50)
        assert budgets.check_budgets() == 0  # 52.5 % of the new quota: 50 % fired already
        spend(quota_tenant, public_model, price, NOW - timedelta(minutes=1), usd=60)
        assert budgets.check_budgets() == 1  # 82.5 %: 80 % fires
    assert [n.payload["threshold"] for n in Notice.objects.order_by("created_at")] == [50, 80]


def test_each_period_fires_afresh(quota_tenant, public_model, price) -> None:
    with time_machine.travel(NOW, tick=False) as clock:
        spend(quota_tenant, public_model, price, NOW, usd=50)
        assert budgets.check_budgets() == 1
        clock.move_to(datetime(2026, 12, 1, 0, 10, tzinfo=UTC))
        assert budgets.check_budgets() == 0  # a new month, nothing used yet
        spend(quota_tenant, public_model, price, datetime.now(UTC), usd=51)
        assert budgets.check_budgets() == 1
    assert [n.payload["period"]["id"] for n in Notice.objects.order_by("created_at")] == [
        "2026-11",
        "2026-12",
    ]


def test_custom_thresholds_and_a_token_quota(tenant_a, public_model, price) -> None:
    tenant = tenant_services.update_tenant(
        None, tenant_a, quota_tokens=1_000_000, alert_thresholds=[90, 25]
    )
    assert tenant.alert_thresholds == [25, 90]  # kept sorted
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW, tokens=300_000)
        assert budgets.check_budgets() == 1
    notice = Notice.objects.get()
    assert notice.payload["quota"] == "tokens" and notice.payload["threshold"] == 25
    assert notice.payload["used"] == 300_000 and notice.payload["unit"] == "tokens"
    assert notice.title == "Acme Research used 25 % of its tokens quota"


def test_no_thresholds_no_alerts(tenant_a, public_model, price) -> None:
    tenant = tenant_services.update_tenant(
        None, tenant_a, quota_amount=Decimal("10"), alert_thresholds=[]
    )
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW, usd=20)
        assert budgets.check_budgets() == 0


@pytest.mark.parametrize(
    ("thresholds", "message"),
    [([0, 50], "from 1 to 100"), ([50, 101], "from 1 to 100"), ([80, 80], "once")],
)
def test_thresholds_are_validated(tenant_a, thresholds, message) -> None:
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match=message):
        tenant_services.update_tenant(None, tenant_a, alert_thresholds=thresholds)


def test_the_redis_figure_is_used_and_postgresql_when_it_is_gone(
    quota_tenant, public_model, price
) -> None:
    from core.keyspace import quota_key
    from core.redis import get_redis

    with time_machine.travel(NOW, tick=False):
        spend(quota_tenant, public_model, price, NOW, usd=45)
        key = quota_key(quota_tenant.pk, "2026-11")
        get_redis().hincrby(key, "money_used", 5 * 10**9)  # settled, not yet ingested
        assert budgets.check_budgets() == 1
        Notice.objects.all().delete()
        get_redis().delete(key)
        assert budgets.check_budgets() == 0  # PostgreSQL holds 45 USD


def test_a_key_budget_warns_its_tenant_admins(quota_tenant, alice, public_model, price) -> None:
    key = tenant_services.issue_api_key(
        alice, quota_tenant, name="notebook", budget_amount=Decimal("10")
    ).key
    other = tenant_services.issue_api_key(alice, quota_tenant, name="ci").key
    with time_machine.travel(NOW, tick=False):
        spend(quota_tenant, public_model, price, NOW, usd=6, key=key)
        spend(quota_tenant, public_model, price, NOW, usd=30, key=other)
        assert budgets.check_budgets() == 1
    notice = Notice.objects.get()
    assert notice.tenant == quota_tenant and notice.severity == Severity.WARNING
    assert notice.payload["subject"] == "key"
    assert notice.payload["key"] == {"id": key.pk, "name": "notebook", "prefix": key.masked}
    assert Decimal(notice.payload["used"]) == 6 and Decimal(notice.payload["limit"]) == 10
    assert "only warns" in notice.detail
    assert notice in alert_services.notices_visible_to(alice)
