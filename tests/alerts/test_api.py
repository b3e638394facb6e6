"""The admin API for webhook endpoints, deliveries, notices and forecasts: who may do what,
the secret shown once, errors in the user's terms, and tenant B seeing nothing of tenant A."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine

from alerts import services
from alerts.choices import DeliveryStatus, Event
from alerts.models import Notice, WebhookDelivery, WebhookEndpoint
from tenants import services as tenant_services
from tests.alerts.usage import spend

HOOKS = "/api/v1/webhooks/"
NOW = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)


@pytest.fixture
def hook_a(tenant_a, alice):
    return services.create_endpoint(
        alice, tenant_a, "https://hooks.acme.test/t", ["budget.threshold"]
    )


def test_a_tenant_admin_makes_an_endpoint_and_sees_its_secret_once(
    tenant_a, alice, client_for
) -> None:
    api = client_for(alice)
    made = api.post(
        HOOKS,
        {"tenant": "acme", "url": "http://receiver:8080/hook", "events": ["budget.threshold"]},
        format="json",
    )
    assert made.status_code == 201, made.content
    body = made.json()
    assert body["secret"].startswith("whsec_") and made["Cache-Control"] == "no-store"
    assert body["tenant"] == "acme" and body["secret_hint"] == body["secret"][:10] + "…"
    shown = api.get(f"{HOOKS}{body['id']}/").json()
    assert "secret" not in shown and body["secret"] not in str(shown)
    assert api.get(HOOKS).json()["count"] == 1
    rotated = api.post(f"{HOOKS}{body['id']}/rotate-secret/")
    assert rotated.status_code == 200 and rotated.json()["secret"] != body["secret"]
    assert WebhookEndpoint.objects.get().secret == rotated.json()["secret"]


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"url": "ftp://x.test/", "events": ["budget.threshold"]}, "url", "http:// or https://"),
        ({"url": "https://u:p@x.test/", "events": ["budget.threshold"]}, "url", "credentials"),
        ({"url": "https://x.test/", "events": ["engine.drift"]}, "events", "platform"),
        ({"url": "https://x.test/", "events": ["nope"]}, "events", "Unknown event"),
        ({"url": "https://x.test/", "events": []}, "events", "at least one"),
    ],
)
def test_bad_endpoints_get_a_400_naming_the_field(
    tenant_a, alice, client_for, body, field, message
) -> None:
    answer = client_for(alice).post(HOOKS, {"tenant": "acme", **body}, format="json")
    assert answer.status_code == 400, answer.content
    errors = answer.json()["errors"]
    assert any(e["field"] == field and message in e["message"] for e in errors), errors
    assert not WebhookEndpoint.objects.exists()


def test_platform_endpoints_are_for_platform_admins(tenant_a, alice, root, client_for) -> None:
    body = {"url": "https://pager.test/", "events": ["engine.drift", "budget.threshold"]}
    refused = client_for(alice).post(HOOKS, body, format="json")
    assert refused.status_code == 403
    made = client_for(root).post(HOOKS, body, format="json")
    assert made.status_code == 201 and made.json()["tenant"] is None
    # Tenant admins do not see platform endpoints.
    assert client_for(alice).get(HOOKS).json()["count"] == 0
    assert client_for(alice).get(f"{HOOKS}{made.json()['id']}/").status_code == 404


def test_members_and_other_tenants_see_no_endpoint(hook_a, bob, carol, root, client_for) -> None:
    pk = hook_a.endpoint.pk
    for user in (bob, carol):
        api = client_for(user)
        assert api.get(HOOKS).json()["count"] == 0
        assert api.get(f"{HOOKS}{pk}/").status_code == 404
        assert api.patch(f"{HOOKS}{pk}/", {"enabled": False}, format="json").status_code == 404
        assert api.post(f"{HOOKS}{pk}/test/").status_code == 404
    assert client_for(root).get(f"{HOOKS}{pk}/").status_code == 200


def test_edit_test_and_delete(hook_a, alice, client_for, django_capture_on_commit_callbacks):
    api = client_for(alice)
    pk = hook_a.endpoint.pk
    changed = api.patch(f"{HOOKS}{pk}/", {"enabled": False, "description": "ops"}, format="json")
    assert changed.status_code == 200 and changed.json()["enabled"] is False
    moved = api.patch(f"{HOOKS}{pk}/", {"tenant": "bravo"}, format="json")
    assert moved.status_code == 400
    queued = api.post(f"{HOOKS}{pk}/test/")
    assert queued.status_code == 202 and queued.json()["event"] == "test"
    assert api.post(f"{HOOKS}{pk}/test/", {"x": 1}, format="json").status_code == 400
    assert api.delete(f"{HOOKS}{pk}/").status_code == 204
    assert not WebhookEndpoint.objects.exists() and not WebhookDelivery.objects.exists()


def test_the_delivery_log_filters_and_retries(
    hook_a, alice, carol, free_url, settings, client_for, django_capture_on_commit_callbacks
) -> None:
    settings.TOLLGATE_WEBHOOK_RETRY_SCHEDULE = []
    services.update_endpoint(None, hook_a.endpoint, url=free_url)
    with django_capture_on_commit_callbacks(execute=True):
        services.send_test(alice, hook_a.endpoint)
    api = client_for(alice)
    listed = api.get("/api/v1/webhook-deliveries/?status=gave_up").json()
    assert listed["count"] == 1
    row = listed["results"][0]
    assert row["attempts"] == 1 and row["tenant"] == "acme" and "ConnectError" in row["error"]
    assert api.get("/api/v1/webhook-deliveries/?status=succeeded").json()["count"] == 0
    assert client_for(carol).get("/api/v1/webhook-deliveries/").json()["count"] == 0
    with django_capture_on_commit_callbacks(execute=True):
        retried = api.post(f"/api/v1/webhook-deliveries/{row['id']}/retry/")
    assert retried.status_code == 200 and retried.json()["status"] == "failed"  # due now
    row = WebhookDelivery.objects.get()  # the attempt ran after the answer: down again
    assert row.status == DeliveryStatus.GAVE_UP and row.attempts == 2


def test_notices_by_audience_and_acknowledged(tenant_a, alice, bob, carol, root, client_for):
    tenant_notice = services.raise_alert(
        Event.BUDGET_THRESHOLD, title="Acme at 50 %", detail="", payload={}, tenant=tenant_a
    )
    services.raise_alert(Event.ENGINE_DRIFT, title="drift", detail="", payload={})
    assert [n["title"] for n in client_for(alice).get("/api/v1/notices/").json()["results"]] == [
        "Acme at 50 %"
    ]
    assert client_for(bob).get("/api/v1/notices/").json()["count"] == 0
    assert client_for(carol).get("/api/v1/notices/").json()["count"] == 0
    assert client_for(root).get("/api/v1/notices/").json()["count"] == 2
    done = client_for(alice).post(f"/api/v1/notices/{tenant_notice.pk}/acknowledge/")
    assert done.status_code == 200 and done.json()["acknowledged_by"] == "alice"
    assert Notice.objects.get(pk=tenant_notice.pk).acknowledged_at is not None


def test_the_forecast_api(tenant_a, alice, bob, carol, public_model, price, client_for) -> None:
    tenant = tenant_services.update_tenant(None, tenant_a, quota_amount=Decimal("100"))
    key = tenant_services.issue_api_key(alice, tenant, name="nb", budget_tokens=10_000_000).key
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(days=3), usd=28)
        spend(tenant, public_model, price, NOW - timedelta(hours=2), usd=12, key=key)
        answer = client_for(alice).get("/api/v1/tenants/acme/forecast/")
        member = client_for(bob).get("/api/v1/tenants/acme/forecast/")
        other = client_for(carol).get("/api/v1/tenants/acme/forecast/")
        for_key = client_for(alice).get(f"/api/v1/keys/{key.pk}/forecast/")
        key_other = client_for(carol).get(f"/api/v1/keys/{key.pk}/forecast/")
    assert answer.status_code == 200 and member.status_code == 200
    (money,) = answer.json()["forecasts"]
    assert money["state"] == "runs_out" and money["runs_out_at"] == "2026-11-15T12:00:00+00:00"
    assert other.status_code == 404 and key_other.status_code == 404
    (tokens,) = for_key.json()["forecasts"]
    assert for_key.json()["key"]["prefix"] == key.masked
    assert tokens["state"] == "exhausted" and tokens["used"] == 12_000_000


def test_v1_usage_carries_the_forecast(tenant_a, alice, public_model, price, client) -> None:
    tenant = tenant_services.update_tenant(None, tenant_a, quota_tokens=50_000_000)
    issued = tenant_services.issue_api_key(alice, tenant, name="nb")
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(hours=1), tokens=12_000_000)
        body = client.get("/v1/usage", HTTP_AUTHORIZATION=f"Bearer {issued.plaintext}").json()
    (tokens,) = body["forecast"]["tenant"]
    # 38M left at 12M a day: 3 days 4 h.
    assert tokens["runs_out_at"] == "2026-11-13T16:00:00+00:00"
    assert body["forecast"]["key"] == []
