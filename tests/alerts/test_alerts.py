"""raise_alert: a notice, a log line and signed deliveries to the subscribed endpoints only;
fired once per dedupe key. Delivery attempts against a real receiver on 127.0.0.1: success,
retries with back-off, giving up, retry now, rotation and the test event."""

import json
import logging
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.core.exceptions import ValidationError
from django.db import connection

from alerts import delivery, services
from alerts.choices import DeliveryStatus, Event, Severity
from alerts.models import Notice, WebhookDelivery
from tests.alerts.conftest import recipe

NOW = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)


def endpoint(tenant, url, events=(Event.BUDGET_THRESHOLD,), **fields):
    return services.create_endpoint(None, tenant, url, list(events), **fields)


def raise_budget(tenant, key="budget:x"):
    return services.raise_alert(
        Event.BUDGET_THRESHOLD,
        title=f"{tenant.name} used 80 % of its money quota",
        detail="80 of 100 USD",
        payload={"threshold": 80},
        tenant=tenant,
        dedupe_key=key,
    )


def check(secret, got) -> dict:
    """A delivery as the receiver's documented code checks it; its parsed body."""
    verify = recipe()["verify_tollgate_webhook"]
    verify(secret, got.headers, got.body, now=int(got.headers["Tollgate-Timestamp"]))
    return json.loads(got.body)


def test_a_tenant_alert_reaches_its_tenant_and_subscribed_platform_endpoints_only(
    tenant_a, tenant_b, receiver, django_capture_on_commit_callbacks, caplog
) -> None:
    mine = endpoint(tenant_a, receiver.url + "?to=a")
    platform = endpoint(None, receiver.url + "?to=platform")
    endpoint(tenant_b, receiver.url + "?to=b")  # another tenant's
    endpoint(None, receiver.url + "?to=drift", [Event.ENGINE_DRIFT])  # not subscribed
    endpoint(tenant_a, receiver.url + "?to=off", enabled=False)
    caplog.set_level(logging.INFO, logger="alerts")
    with django_capture_on_commit_callbacks(execute=True):
        notice = raise_budget(tenant_a)
    assert notice.tenant == tenant_a and notice.severity == Severity.WARNING
    got = receiver.wait_for(2)
    rows = {row.endpoint_id: row for row in WebhookDelivery.objects.all()}
    assert set(rows) == {mine.endpoint.pk, platform.endpoint.pk}
    assert {r.status for r in rows.values()} == {DeliveryStatus.SUCCEEDED}
    assert {d.headers["Tollgate-Delivery"] for d in got} == {str(r.pk) for r in rows.values()}
    secrets = {str(rows[mine.endpoint.pk].pk): mine.secret}
    secrets[str(rows[platform.endpoint.pk].pk)] = platform.secret
    for each in got:
        body = check(secrets[each.headers["Tollgate-Delivery"]], each)
        assert body["id"] == each.headers["Tollgate-Delivery"]
        assert body["event"] == "budget.threshold" and body["data"] == {"threshold": 80}
        assert body["tenant"] == {"id": tenant_a.pk, "slug": "acme", "name": "Acme Research"}
        assert each.headers["Tollgate-Event"] == "budget.threshold"
        assert each.headers["Content-Type"] == "application/json"
    # One log line naming the event and the tenant; no secret in the log.
    lines = [r.getMessage() for r in caplog.records if r.name == "alerts.services"]
    assert len(lines) == 1 and "budget.threshold tenant=acme" in lines[0]
    assert mine.secret not in caplog.text and platform.secret not in caplog.text


def test_a_platform_alert_reaches_platform_endpoints_only(
    tenant_a, receiver, django_capture_on_commit_callbacks
) -> None:
    platform = endpoint(None, receiver.url, [Event.ENGINE_DRIFT, Event.BUDGET_THRESHOLD])
    endpoint(tenant_a, receiver.url + "?tenant")
    with django_capture_on_commit_callbacks(execute=True):
        notice = services.raise_alert(
            Event.ENGINE_DRIFT,
            title="replica qwen-1 drifted",
            detail="billed 90 of 100 tokens",
            payload={"replica": "qwen-1", "drift_tokens": -10},
            severity=Severity.CRITICAL,
        )
    assert notice.tenant is None
    (got,) = receiver.wait_for(1)
    body = check(platform.secret, got)
    assert body["tenant"] is None and body["severity"] == "critical"
    assert WebhookDelivery.objects.get().endpoint == platform.endpoint


def test_a_dedupe_key_fires_once(tenant_a, receiver, django_capture_on_commit_callbacks) -> None:
    endpoint(tenant_a, receiver.url)
    with django_capture_on_commit_callbacks(execute=True):
        assert raise_budget(tenant_a, key="k1") is not None
        assert raise_budget(tenant_a, key="k1") is None
        assert raise_budget(tenant_a, key="k1") is None
    receiver.wait_for(1)
    assert Notice.objects.count() == 1 and WebhookDelivery.objects.count() == 1
    with django_capture_on_commit_callbacks(execute=True):
        assert raise_budget(tenant_a, key="k2") is not None  # another key fires
    receiver.wait_for(2)


def test_unknown_events_and_severities_are_programming_errors(tenant_a) -> None:
    with pytest.raises(ValueError, match="unknown alert event"):
        services.raise_alert("budget.crossed", title="t", detail="", payload={})
    with pytest.raises(ValueError, match="unknown severity"):
        services.raise_alert(Event.ENGINE_DRIFT, title="t", detail="", payload={}, severity="x")
    assert not Notice.objects.exists()


def test_decimal_and_datetime_payloads_are_sent_as_strings(
    tenant_a, receiver, django_capture_on_commit_callbacks
) -> None:
    from decimal import Decimal

    made = endpoint(tenant_a, receiver.url)
    with django_capture_on_commit_callbacks(execute=True):
        services.raise_alert(
            Event.BUDGET_THRESHOLD,
            title="t",
            detail="",
            payload={"used": Decimal("40.500000000"), "at": NOW},
            tenant=tenant_a,
        )
    data = check(made.secret, receiver.wait_for(1)[0])["data"]
    assert data == {"used": "40.500000000", "at": "2026-11-20T12:00:00Z"}


# --- Endpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://example.test/x", "http:// or https://"),
        ("example.test/hook", "http:// or https://"),
        ("https://user:pw@example.test/hook", "no credentials"),
        ("https://token@example.test/hook", "no credentials"),
        ("https:///nohost", "host"),
        ("http://example.test:99999/", "not a valid URL"),
    ],
)
def test_endpoint_urls_are_checked(tenant_a, url, message) -> None:
    with pytest.raises(ValidationError, match=message):
        endpoint(tenant_a, url)


def test_internal_addresses_are_allowed(tenant_a) -> None:
    for url in ("http://10.0.0.5:8080/hook", "http://alerts.internal/x", "https://[::1]/h"):
        assert endpoint(tenant_a, url).endpoint.url == url


def test_events_are_checked_per_owner(tenant_a) -> None:
    with pytest.raises(ValidationError, match="platform endpoints only"):
        endpoint(tenant_a, "https://example.test/", [Event.ENGINE_DRIFT])
    with pytest.raises(ValidationError, match="Unknown event"):
        endpoint(None, "https://example.test/", ["budget.exceeded"])
    with pytest.raises(ValidationError, match="at least one"):
        endpoint(None, "https://example.test/", [])
    made = endpoint(None, "https://example.test/", [Event.ENGINE_DRIFT, Event.BUDGET_THRESHOLD])
    assert made.endpoint.events == ["budget.threshold", "engine.drift"]


def test_the_secret_is_shown_once_and_stored_encrypted(tenant_a) -> None:
    made = endpoint(tenant_a, "https://example.test/")
    assert made.secret.startswith("whsec_") and len(made.secret) > 40
    with connection.cursor() as cursor:
        sql = "SELECT secret FROM alerts_webhookendpoint WHERE id = %s"
        cursor.execute(sql, [made.endpoint.pk])
        (stored,) = cursor.fetchone()
    assert stored.startswith("fernet:") and made.secret not in stored
    audit = made.endpoint.tenant.audit_entries.get(object_type="webhookendpoint")
    assert audit.changes["secret"] == "set" and made.secret not in json.dumps(audit.changes)


def test_a_rotated_secret_signs_the_next_attempt(
    tenant_a, receiver, django_capture_on_commit_callbacks
) -> None:
    made = endpoint(tenant_a, receiver.url)
    rotated = services.rotate_secret(None, made.endpoint)
    assert rotated.secret != made.secret
    with django_capture_on_commit_callbacks(execute=True):
        services.send_test(None, made.endpoint)
    (got,) = receiver.wait_for(1)
    check(rotated.secret, got)
    with pytest.raises(recipe()["InvalidWebhook"], match="signature"):
        check(made.secret, got)


def test_a_test_event_goes_to_that_endpoint_even_while_disabled(
    tenant_a, receiver, django_capture_on_commit_callbacks
) -> None:
    made = endpoint(tenant_a, receiver.url, enabled=False)
    endpoint(tenant_a, receiver.url + "?other")
    with django_capture_on_commit_callbacks(execute=True):
        row = services.send_test(None, made.endpoint)
    (got,) = receiver.wait_for(1)
    body = check(made.secret, got)
    assert body["event"] == "test" and got.headers["Tollgate-Event"] == "test"
    assert body["data"]["endpoint"]["id"] == made.endpoint.pk
    row.refresh_from_db()
    assert row.status == DeliveryStatus.SUCCEEDED and row.response_code == 200
    assert row.response_excerpt == "ok"


# --- Retries ---------------------------------------------------------------------------------


def test_a_failed_delivery_is_retried_after_its_back_off_and_succeeds(
    tenant_a, receiver, django_capture_on_commit_callbacks
) -> None:
    made = endpoint(tenant_a, receiver.url)
    receiver.answers = [500]
    with time_machine.travel(NOW, tick=False) as clock:
        with django_capture_on_commit_callbacks(execute=True):
            raise_budget(tenant_a)
        receiver.wait_for(1)
        row = WebhookDelivery.objects.get()
        assert row.status == DeliveryStatus.FAILED and row.attempts == 1
        assert row.response_code == 500 and row.response_excerpt == "receiver says no"
        assert row.error == "The receiver answered HTTP 500."
        assert row.next_attempt_at == NOW + timedelta(seconds=30)
        clock.shift(29)
        assert delivery.deliver_due() == 0  # not due yet
        clock.shift(2)
        assert delivery.deliver_due() == 1
    first, second = receiver.wait_for(2)
    row.refresh_from_db()
    assert row.status == DeliveryStatus.SUCCEEDED and row.attempts == 2
    assert row.response_code == 200 and row.error == "" and row.next_attempt_at is None
    # The same delivery, signed afresh.
    assert first.headers["Tollgate-Delivery"] == second.headers["Tollgate-Delivery"]
    stamps = [int(d.headers["Tollgate-Timestamp"]) for d in (first, second)]
    assert stamps[1] == stamps[0] + 31
    assert first.body == second.body
    check(made.secret, second)


def test_a_receiver_that_stays_down_is_given_up_after_the_last_attempt(
    tenant_a, free_url, django_capture_on_commit_callbacks
) -> None:
    endpoint(tenant_a, free_url)
    with time_machine.travel(NOW, tick=False) as clock:
        with django_capture_on_commit_callbacks(execute=True):
            raise_budget(tenant_a)
        row = WebhookDelivery.objects.get()
        waits = []
        while row.status == DeliveryStatus.FAILED:
            waits.append((row.next_attempt_at - datetime.now(UTC)).total_seconds())
            clock.move_to(row.next_attempt_at)
            assert delivery.deliver_due() == 1
            row.refresh_from_db()
    assert waits == [30, 120, 600, 3600, 21600]
    assert row.status == DeliveryStatus.GAVE_UP and row.attempts == 6
    assert row.next_attempt_at is None and row.response_code is None
    assert "ConnectError" in row.error


def test_retry_now_gives_a_given_up_delivery_one_more_attempt(
    tenant_a, receiver, free_url, settings, django_capture_on_commit_callbacks
) -> None:
    settings.TOLLGATE_WEBHOOK_RETRY_SCHEDULE = []  # one attempt, then give up
    made = endpoint(tenant_a, free_url)
    with django_capture_on_commit_callbacks(execute=True):
        raise_budget(tenant_a)
    row = WebhookDelivery.objects.get()
    assert row.status == DeliveryStatus.GAVE_UP and row.attempts == 1
    services.update_endpoint(None, made.endpoint, url=receiver.url)  # the receiver is back
    with django_capture_on_commit_callbacks(execute=True):
        services.retry_now(None, row)
    receiver.wait_for(1)
    row.refresh_from_db()
    assert row.status == DeliveryStatus.SUCCEEDED and row.attempts == 2
    with pytest.raises(ValidationError, match="it is succeeded"):
        services.retry_now(None, row)


def test_an_attempt_a_dead_worker_left_is_sent_by_the_beat_pass(
    tenant_a, receiver, django_capture_on_commit_callbacks
) -> None:
    endpoint(tenant_a, receiver.url)
    with time_machine.travel(NOW, tick=False) as clock:
        raise_budget(tenant_a)  # committed callbacks are not run: the queued task is lost
        row = WebhookDelivery.objects.get()
        assert row.status == DeliveryStatus.PENDING
        # A worker claimed the attempt and died before sending it.
        assert delivery._claim(row.pk) is not None
        assert delivery.deliver_due() == 0  # its lease holds the attempt
        clock.shift(delivery.LEASE.total_seconds() + 1)
        assert delivery.deliver_due() == 1
    receiver.wait_for(1)
    row.refresh_from_db()
    assert row.status == DeliveryStatus.SUCCEEDED and row.attempts == 2


def test_a_redirect_is_not_followed(tenant_a, receiver, django_capture_on_commit_callbacks) -> None:
    endpoint(tenant_a, receiver.url)
    receiver.answers = [302]
    with django_capture_on_commit_callbacks(execute=True):
        raise_budget(tenant_a)
    receiver.wait_for(1)
    row = WebhookDelivery.objects.get()
    assert row.status == DeliveryStatus.FAILED and row.response_code == 302
    assert "redirects are not followed" in row.error
    assert len(receiver.deliveries) == 1
