"""The console's alert pages: notices (banner and list), webhook endpoints (secret shown
once), the delivery log (what retries and give-ups look like), budgets and forecasts on
the tenant and key pages; each role sees what it should and tenant B nothing of tenant A."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.urls import reverse

from alerts import delivery, services
from alerts.choices import Event
from alerts.models import Notice, WebhookDelivery, WebhookEndpoint
from tenants import services as tenant_services
from tests.alerts.usage import spend

NOW = datetime(2026, 11, 10, 12, 0, tzinfo=UTC)


def u(name: str, *args: object) -> str:
    return reverse(f"console:{name}", args=args)


@pytest.fixture
def notice_a(tenant_a):
    return services.raise_alert(
        Event.BUDGET_THRESHOLD,
        title="Acme Research used 80 % of its money quota",
        detail="80.00 of 100.00 USD in 2026-11.",
        payload={"threshold": 80},
        tenant=tenant_a,
    )


@pytest.fixture
def hook_a(tenant_a, alice):
    return services.create_endpoint(
        alice, tenant_a, "https://hooks.acme.test/t", ["budget.threshold"]
    )


def test_a_tenant_admin_sees_the_banner_until_acknowledged(web, alice, notice_a) -> None:
    client = web(alice)
    page = client.get(u("tenant-detail", "acme")).content.decode()
    assert "Acme Research used 80 % of its money quota" in page and "Acknowledge" in page
    assert 'href="/alerts/"' in page  # the Alerts navigation entry
    done = client.post(u("notice-acknowledge", notice_a.pk), {"next": u("tenant-detail", "acme")})
    assert done.status_code == 302 and done["Location"] == u("tenant-detail", "acme")
    page = client.get(u("tenant-detail", "acme")).content.decode()
    assert "Acknowledge</button>" not in page
    listed = client.get(u("notice-list") + "?state=acknowledged").content.decode()
    assert "Acme Research used 80 %" in listed and "by alice" in listed


def test_platform_notices_are_the_platform_admins_banner(web, root, alice, notice_a) -> None:
    services.raise_alert(
        Event.ENGINE_DRIFT, title="Replica qwen#0 drifted by 12 %", detail="", payload={}
    )
    staff_page = web(root).get(u("dashboard")).content.decode()
    assert "Replica qwen#0 drifted by 12 %" in staff_page
    assert "Acme Research used 80 %" not in staff_page  # a tenant's, not a banner for staff
    assert "Acme Research used 80 %" in web(root).get(u("notice-list")).content.decode()
    tenant_page = web(alice).get(u("tenant-detail", "acme")).content.decode()
    assert "Replica qwen#0" not in tenant_page
    assert "Replica qwen#0" not in web(alice).get(u("notice-list")).content.decode()


def test_members_get_no_alert_pages_and_tenant_b_nothing_of_tenant_a(
    web, bob, carol, notice_a, hook_a, django_capture_on_commit_callbacks
) -> None:
    row = services.send_test(None, hook_a.endpoint)
    pk = hook_a.endpoint.pk
    for url in (u("notice-list"), u("webhook-list"), u("webhook-new"), u("delivery-list")):
        assert web(bob).get(url).status_code == 403, url
    assert (
        "Acme Research used 80 %" not in web(bob).get(u("tenant-detail", "acme")).content.decode()
    )
    for client in (web(bob), web(carol)):
        for url in (
            u("notice-detail", notice_a.pk),
            u("webhook-detail", pk),
            u("webhook-edit", pk),
            u("delivery-detail", row.pk),
        ):
            assert client.get(url).status_code == 404, url
        for url in (
            u("notice-acknowledge", notice_a.pk),
            u("webhook-rotate", pk),
            u("webhook-test", pk),
            u("webhook-delete", pk),
            u("delivery-retry", row.pk),
        ):
            assert client.post(url).status_code == 404, url
    for url in (u("notice-list"), u("webhook-list"), u("delivery-list")):
        assert "acme" not in web(carol).get(url).content.decode().lower(), url
    assert WebhookEndpoint.objects.get().secret == hook_a.secret
    assert Notice.objects.get().acknowledged_at is None


def test_making_an_endpoint_shows_the_secret_once(web, alice, tenant_a) -> None:
    client = web(alice)
    bad = client.post(
        u("webhook-new"),
        {
            "tenant": tenant_a.pk,
            "url": "https://me:pw@hooks.acme.test/",
            "events": ["budget.threshold"],
        },
    )
    assert bad.status_code == 400 and "no credentials" in bad.content.decode()
    drift = client.post(
        u("webhook-new"),
        {"tenant": tenant_a.pk, "url": "http://chat-bridge:9000/", "events": ["engine.drift"]},
    )
    assert drift.status_code == 400 and "platform endpoints only" in drift.content.decode()
    made = client.post(
        u("webhook-new"),
        {
            "tenant": tenant_a.pk,
            "url": "http://chat-bridge:9000/hook",
            "description": "Ops chat",
            "events": ["budget.threshold"],
            "enabled": "on",
        },
    )
    assert made.status_code == 200 and made["Cache-Control"] == "no-store"
    endpoint = WebhookEndpoint.objects.get()
    assert endpoint.secret in made.content.decode()
    detail = client.get(u("webhook-detail", endpoint.pk)).content.decode()
    assert endpoint.secret not in detail and endpoint.secret_hint in detail
    rotated = client.post(u("webhook-rotate", endpoint.pk))
    endpoint.refresh_from_db()
    assert endpoint.secret in rotated.content.decode() and "old secret signs nothing" in (
        rotated.content.decode()
    )
    edited = client.post(
        u("webhook-edit", endpoint.pk),
        {
            "url": "http://chat-bridge:9000/v2",
            "description": "Ops chat",
            "events": ["budget.threshold"],
        },
    )
    assert edited.status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.url.endswith("/v2") and endpoint.enabled is False


def test_only_platform_admins_make_platform_endpoints(web, alice, root) -> None:
    refused = web(alice).post(
        u("webhook-new"),
        {"tenant": "", "url": "https://pager.test/", "events": ["budget.threshold"]},
    )
    assert refused.status_code == 400 and not WebhookEndpoint.objects.exists()  # tenant required
    made = web(root).post(
        u("webhook-new"),
        {"tenant": "", "url": "https://pager.test/", "events": ["engine.drift"], "enabled": "on"},
    )
    assert made.status_code == 200 and WebhookEndpoint.objects.get().tenant is None


def test_the_delivery_log_shows_retries_and_give_ups(
    web, alice, tenant_a, receiver, free_url, django_capture_on_commit_callbacks
) -> None:
    ok = services.create_endpoint(alice, tenant_a, receiver.url, ["budget.threshold"])
    down = services.create_endpoint(alice, tenant_a, free_url, ["budget.threshold"])
    receiver.answers = [500]
    with time_machine.travel(NOW, tick=False) as clock:
        with django_capture_on_commit_callbacks(execute=True):
            services.raise_alert(
                Event.BUDGET_THRESHOLD, title="t", detail="", payload={}, tenant=tenant_a
            )
        client = web(alice)
        page = client.get(u("delivery-list") + "?status=failed").content.decode()
        assert page.count(">Failed, will retry</span>") == 2  # the two rows' badges
        assert "2026-11-10 12:00:30" in page  # the next retry, 30 s on
        while WebhookDelivery.objects.filter(status="failed").exists():
            clock.move_to(WebhookDelivery.objects.filter(status="failed").first().next_attempt_at)
            delivery.deliver_due()
        client = web(alice)  # a new session: the clock moved past the old one's life
        retried = WebhookDelivery.objects.get(endpoint=ok.endpoint)
        given_up = WebhookDelivery.objects.get(endpoint=down.endpoint)
        log = client.get(u("delivery-list")).content.decode()
        assert ">Succeeded</span>" in log and ">Gave up</span>" in log
        detail = client.get(u("delivery-detail", retried.pk)).content.decode()
        assert "<dd>2, the last" in detail and "<dd>200</dd>" in detail
        assert "Retry now" not in detail
        detail = client.get(u("delivery-detail", given_up.pk)).content.decode()
        assert "<dd>6, the last" in detail and "ConnectError" in detail and "Retry now" in detail
        only_ok = client.get(u("delivery-list") + f"?endpoint={ok.endpoint.pk}").content.decode()
    assert ">Succeeded</span>" in only_ok and ">Gave up</span>" not in only_ok


def test_the_tenant_page_shows_the_forecast(web, alice, bob, tenant_a, public_model, price):
    tenant = tenant_services.update_tenant(None, tenant_a, quota_amount=Decimal("100"))
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(days=3), usd=28)
        spend(tenant, public_model, price, NOW - timedelta(hours=2), usd=12)
        for user in (alice, bob):
            page = web(user).get(u("tenant-detail", "acme")).content.decode()
            assert "Forecast" in page and "2026-11-15 12:00 UTC" in page
            assert "12.00 USD a day" in page and "50 %, 80 %, 100 %" in page


def test_the_usage_page_forecasts_the_tenant_shown(
    web, alice, root, tenant_a, tenant_b, public_model, price
) -> None:
    tenant = tenant_services.update_tenant(None, tenant_a, quota_tokens=50_000_000)
    with time_machine.travel(NOW, tick=False):
        spend(tenant, public_model, price, NOW - timedelta(hours=1), tokens=12_000_000)
        mine = web(alice).get(u("usage")).content.decode()  # her only tenant
        everyone = web(root).get(u("usage")).content.decode()
        chosen = web(root).get(u("usage") + "?tenant=acme").content.decode()
    # 38M tokens left at 12M a day: 3 days 4 h.
    assert "Forecast for Acme Research" in mine and "2026-11-13 16:00 UTC" in mine
    assert "Forecast for" not in everyone
    assert "Forecast for Acme Research" in chosen and "2026-11-13 16:00 UTC" in chosen


def test_a_key_budget_is_set_in_the_key_form_and_shown_with_its_forecast(
    web, alice, tenant_a, public_model, price
) -> None:
    client = web(alice)
    form = client.get(u("key-new")).content.decode()
    assert "never blocks" in form
    client.post(
        u("key-new"),
        {"tenant": tenant_a.pk, "name": "notebook", "budget_amount": "20", "budget_tokens": ""},
    )
    key = tenant_a.api_keys.get(name="notebook")
    assert key.budget_amount == Decimal("20") and key.budget_tokens is None
    with time_machine.travel(NOW, tick=False):
        spend(tenant_a, public_model, price, NOW - timedelta(hours=1), usd=4, key=key)
        page = client.get(u("key-detail", key.pk)).content.decode()
    assert "20.00 USD per monthly period" in page
    assert "2026-11-14 12:00 UTC" in page  # 16 USD left at 4 a day


def test_the_tenant_form_sets_thresholds(web, root, tenant_a) -> None:
    base = {
        "name": "Acme Research",
        "slug": "acme",
        "priority": "P1",
        "quota_period": "monthly",
        "currency": "USD",
        "model_access": "all",
    }
    form = web(root).get(u("tenant-edit", "acme")).content.decode()
    assert 'value="50,80,100"' in form
    bad = web(root).post(u("tenant-edit", "acme"), {**base, "alert_thresholds": "0,50"})
    assert bad.status_code == 400 and "from 1 to 100" in bad.content.decode()
    web(root).post(u("tenant-edit", "acme"), {**base, "alert_thresholds": "90, 25"})
    tenant_a.refresh_from_db()
    assert tenant_a.alert_thresholds == [25, 90]
